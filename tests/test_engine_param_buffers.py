"""Pooled parameter storage (engine/paging/param_buffers.py): large CPU parameters are fetched into reused,
page-aligned buffers swapped into their own storage; results stay exactly the unwrapped model's."""

from __future__ import annotations

import copy
import mmap

import pytest
import torch
from torch import nn

import engine
import tiered
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


@pytest.fixture
def store(tmp_path):
    config = tiered.StoreConfig(path=str(tmp_path / "pool"), host_bytes=0, result_pool_bytes=8 * MiB,
                                staging_buffers=1, block_size=MiB, io_threads=2)
    with tiered.TieredStore.open(config) as s:
        yield s


@needs_swap
def test_lend_and_give_back_keep_the_parameter_and_its_views(store):
    param = nn.Parameter(torch.zeros(512, 1024))  # 2 MiB
    view = param.t()
    storage = param.untyped_storage()
    ident = storage._cdata
    storage.resize_(0)
    pool = ParamBuffers(store.host_buffer)
    storage.resize_(param.numel() * 4)
    pool.lend(storage, param.numel() * 4)
    assert pool.holds(storage) and param.data_ptr() % mmap.PAGESIZE == 0 and pool.lent_bytes == 2 * MiB
    with torch.no_grad():
        param.copy_(torch.arange(param.numel(), dtype=torch.float32).view(512, 1024))
    assert torch.equal(view, param.t()) and view[3, 2].item() == 2 * 1024 + 3
    first = param.data_ptr()
    pool.give_back(storage)
    assert storage.nbytes() == 0 and storage.resizable() and param.untyped_storage()._cdata == ident
    stats = store.stats()
    assert pool.lent_bytes == 0 and stats.pool_waiting_bytes == 2 * MiB and stats.pool_lent_bytes == 0
    storage.resize_(param.numel() * 4)
    pool.lend(storage, param.numel() * 4)  # the same buffer again, from the store's pool: mapped, values kept
    assert param.data_ptr() == first and store.stats().pool_hits == 1 and pool.lent == 2
    assert view[3, 2].item() == 2 * 1024 + 3
    pool.give_back(storage)


@needs_swap
def test_a_given_back_buffer_serves_a_get_of_its_size_and_the_pool_stays_bounded(store):
    """Parameters and get results share the store's pool: the step's state reads reuse the buffers
    forward freed, and the pool never holds more than result_pool_bytes besides what is lent out."""
    pool = ParamBuffers(store.host_buffer)
    storages = [torch.UntypedStorage(4 * MiB) for _ in range(3)]
    for s in storages:
        pool.lend(s, 4 * MiB)
    addresses = {s.data_ptr() for s in storages}
    assert store.stats().pool_lent_bytes == 12 * MiB  # more than the bound: what is lent is the caller's
    for s in storages:
        pool.give_back(s)
    stats = store.stats()
    assert stats.pool_lent_bytes == 0 and stats.pool_waiting_bytes == 8 * MiB  # one was unmapped
    store.sync.put("state", torch.arange(MiB, dtype=torch.float32), "nvme")
    got = store.sync.get("state")  # 4 MiB: a waiting buffer
    assert got.data_ptr() in addresses and torch.equal(got, torch.arange(MiB, dtype=torch.float32))
    assert store.stats().pool_waiting_bytes == 4 * MiB
    store.resize_result_pool(0)  # a smaller bound unmaps what waits beyond it at once
    assert store.stats().pool_waiting_bytes == 0 and store.stats().pool_lent_bytes == 4 * MiB


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
    mapped = []
    with torch.inference_mode():
        for seed in range(4):
            x = gpt_tokens(t=12, vocab=512, seed=seed)
            assert torch.equal(model(x), ref(x))
            mapped.append(eng.store.stats().pool_misses)
    stats = eng.stats()
    assert stats.bytes_fetched["nvme"] > 0
    if not swap_supported():  # the engine allocates each time instead, with the same results
        assert buffers.lent == 0
        eng.unwrap()
        assert_same_params(model, ref)
        return
    assert seen and all(ptr % mmap.PAGESIZE == 0 for ptr in seen)
    assert mapped[-1] == mapped[1] and stats.store.pool_hits > 0  # later forwards only reuse
    # The pool holds parameters' buffers, lent and waiting, within the plan's bound for them.
    assert stats.store.pool_lent_bytes + stats.store.pool_waiting_bytes <= eng.memory_plan.pool_bytes
    eng.unwrap()
    assert buffers.lent_bytes == 0
    assert all(p.untyped_storage().resizable() for p in pooled)  # unwrap hands back torch's own memory
    assert_same_params(model, ref)


def test_training_parity_and_optimizer_steps_with_pooled_buffers(tmp_path):
    model = _model()
    config = engine_config(tmp_path, prefetch_bytes=2 * MiB, host_bytes=256 * KiB)
    eng = train_parity(model, config, [gpt_tokens(t=12, vocab=512, seed=s) for s in range(2)])
    assert eng.store.stats().pool_hits > 0 or not swap_supported()  # backward refetched pooled weights
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
    assert eng._pager.buffers.lent == 0 and eng._pager.buffers.lent_bytes == 0
    eng.unwrap()
