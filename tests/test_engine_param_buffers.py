"""Pooled parameter storage (engine/paging/param_buffers.py): large CPU parameters are fetched into reused,
page-aligned buffers swapped into their own storage; results stay exactly the unwrapped model's."""

from __future__ import annotations

import copy
import mmap

import pytest
import torch
from torch import nn

import engine
from engine.paging.param_buffers import ParamBuffers, swap_supported
from engine_models import KiB, TinyGPT, assert_same_params, engine_config, gpt_tokens, train_parity

MiB = 1024 * KiB
#: torch builds without ``UntypedStorage._swap_data_ptr_`` (2.11 has none) cannot lend buffers at all.
needs_swap = pytest.mark.skipif(not swap_supported(), reason="this torch has no UntypedStorage._swap_data_ptr_")


def _model() -> TinyGPT:
    """fc and out weights are 1 MiB (pooled); the embedding, qkv and small tensors are not."""
    torch.manual_seed(0)
    return TinyGPT(vocab=512, d=256, heads=4, layers=2, ctx=16)


def _pooled_params(model: TinyGPT) -> list[nn.Parameter]:
    return [p for b in model.blocks for p in (b.fc.weight, b.out.weight)]


@needs_swap
def test_lend_and_give_back_keep_the_parameter_and_its_views():
    param = nn.Parameter(torch.zeros(512, 1024))  # 2 MiB
    view = param.t()
    storage = param.untyped_storage()
    ident = storage._cdata
    storage.resize_(0)
    pool = ParamBuffers()
    storage.resize_(param.numel() * 4)
    pool.lend(storage, param.numel() * 4)
    assert pool.holds(storage) and param.data_ptr() % mmap.PAGESIZE == 0
    with torch.no_grad():
        param.copy_(torch.arange(param.numel(), dtype=torch.float32).view(512, 1024))
    assert torch.equal(view, param.t()) and view[3, 2].item() == 2 * 1024 + 3
    first = param.data_ptr()
    pool.give_back(storage)
    assert storage.nbytes() == 0 and storage.resizable() and param.untyped_storage()._cdata == ident
    assert pool.idle_bytes == param.numel() * 4 and pool.lent_bytes == 0
    storage.resize_(param.numel() * 4)
    pool.lend(storage, param.numel() * 4)  # the same buffer again: mapped, values kept
    assert param.data_ptr() == first and pool.reused == 1 and pool.created == 1
    assert view[3, 2].item() == 2 * 1024 + 3
    pool.give_back(storage)
    pool.clear()
    assert pool.idle_bytes == 0


@needs_swap
def test_idle_buffers_stay_within_the_peak_in_use_plus_the_largest():
    pool = ParamBuffers()
    storages = {}

    def lend(name: str, nbytes: int) -> None:
        storages[name] = torch.UntypedStorage(nbytes)
        pool.lend(storages[name], nbytes)

    lend("a", 2 * MiB)
    lend("b", 2 * MiB)
    pool.give_back(storages["a"])
    pool.give_back(storages["b"])
    lend("c", 3 * MiB)  # peak 4 MiB, largest 3 MiB: 3 lent + 4 idle fit
    pool.give_back(storages["c"])
    assert pool.idle_bytes == 7 * MiB and pool.created == 3
    lend("d", 5 * MiB)  # peak 5, largest 5: 5 + 7 > 10, so "a" (returned first) is unmapped
    assert pool.lent_bytes + pool.idle_bytes == 10 * MiB and pool.idle_bytes == 5 * MiB
    lend("e", 2 * MiB)  # "b"'s buffer
    lend("f", 2 * MiB)  # none left of that size
    assert pool.reused == 1 and pool.created == 5


def test_forward_only_loop_reuses_aligned_buffers(tmp_path):
    model = _model()
    ref = copy.deepcopy(model)
    pooled = _pooled_params(model)
    seen: list[int] = []

    def record(module, args):  # runs after the engine's pre-hook: the weight is materialized
        seen.append(module.weight.data_ptr())

    eng = engine.wrap(model, config=engine_config(tmp_path, prefetch_bytes=3 * MiB, host_bytes=256 * KiB))
    for block in model.blocks:
        block.fc.register_forward_pre_hook(record)
    buffers = eng._pager.buffers
    created = []
    with torch.inference_mode():
        for seed in range(4):
            x = gpt_tokens(t=12, vocab=512, seed=seed)
            assert torch.equal(model(x), ref(x))
            created.append(buffers.created)
    stats = eng.stats()
    assert stats.bytes_fetched["nvme"] > 0
    if not swap_supported():  # the engine allocates each time instead, with the same results
        assert buffers.created == 0
        eng.unwrap()
        assert_same_params(model, ref)
        return
    assert seen and all(ptr % mmap.PAGESIZE == 0 for ptr in seen)
    assert created[-1] == created[1] and buffers.reused > 0  # later forwards only reuse
    largest = max(p.numel() * p.element_size() for p in pooled)
    assert buffers.lent_bytes + buffers.idle_bytes <= stats.peak_materialized_bytes + largest
    eng.unwrap()
    assert buffers.idle_bytes == 0 and buffers.lent_bytes == 0
    assert all(p.untyped_storage().resizable() for p in pooled)  # unwrap hands back torch's own memory
    assert_same_params(model, ref)


def test_training_parity_and_optimizer_steps_with_pooled_buffers(tmp_path):
    model = _model()
    config = engine_config(tmp_path, prefetch_bytes=2 * MiB, host_bytes=256 * KiB)
    eng = train_parity(model, config, [gpt_tokens(t=12, vocab=512, seed=s) for s in range(2)])
    assert eng._pager.buffers.reused > 0 or not swap_supported()  # backward refetched pooled weights
    eng.unwrap()

    model, ref = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    eng = engine.wrap(model, config=engine_config(tmp_path / "2", prefetch_bytes=2 * MiB, host_bytes=256 * KiB),
                      optimizer=opt)
    for seed in range(3):
        x = gpt_tokens(t=12, vocab=512, seed=seed)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).float().pow(2).mean().backward()
            o.step()
            o.zero_grad()
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
    eng.unwrap()
    assert_same_params(model, ref)


def test_cold_forward_reads_a_tied_weight_once(tmp_path):
    """From nothing prefetched, a forward-only step keeps the tied embedding / head (needed first and
    last) in the window between its two uses instead of reading it twice."""
    model = _model()
    ref = copy.deepcopy(model)
    unique = len(list(model.parameters()))
    tied = model.wte.weight.numel() * 4
    eng = engine.wrap(model, config=engine_config(tmp_path, prefetch_bytes=tied + 2 * MiB, host_bytes=256 * KiB))
    with torch.inference_mode():
        for seed in range(3):
            eng.drop_prefetched()
            before = eng.stats()
            x = gpt_tokens(t=12, vocab=512, seed=seed)
            assert torch.equal(model(x), ref(x))
            fetched = eng.stats().fetches - before.fetches
            carried = [h for h in eng._handles if h.prefetched]  # loaded for the next forward
            if seed >= 1:  # the order was recorded in the first forward
                reused = 1 if any(h.param is model.wte.weight for h in carried) else 0
                assert fetched == unique + len(carried) - reused
    eng.unwrap()


def test_a_torch_without_storage_swap_fetches_into_its_own_allocation(tmp_path, monkeypatch):
    """torch 2.11 has no ``UntypedStorage._swap_data_ptr_``: the engine then pools nothing and trains the same."""
    monkeypatch.setattr("engine.paging.param_buffers.swap_supported", lambda: False)
    model = _model()
    config = engine_config(tmp_path, prefetch_bytes=2 * MiB, host_bytes=256 * KiB)
    eng = train_parity(model, config, [gpt_tokens(t=12, vocab=512, seed=s) for s in range(2)])
    assert eng._pager.buffers.created == 0 and eng._pager.buffers.lent_bytes == 0
    eng.unwrap()
