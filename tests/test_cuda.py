"""The store and the engine on a CUDA device: tensors on the GPU through every tier, stream ordering
against kernels still queued, eviction from the GPU, and training parity on the GPU (pinned host
memory: tests/test_aligned_tensors.py).

Skipped without CUDA (CI has none); run on a GPU machine with ``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import engine
import tiered
from conftest import KiB, MiB, random_tensor
from engine_models import TinyGPT, gpt_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TIERS = ["device", "host", "nvme"]
#: About 50 ms of GPU time at 2 GHz: long enough for the CPU to race ahead of a queued kernel.
SLEEP_CYCLES = 100_000_000


@pytest.fixture
def store(tmp_path):
    config = tiered.StoreConfig(path=str(tmp_path / "store"), device="cuda", device_bytes=64 * MiB,
                                host_bytes=64 * MiB, prefault_host=False, durable=False)
    with tiered.TieredStore.open(config) as s:
        yield s


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8], ids=str)
def test_cuda_tensors_round_trip_through_every_tier(store, tier, dtype):
    value = random_tensor((3, 1000, 17), dtype, seed=1).cuda()
    store.sync.put("k", value, tier)
    assert torch.equal(store.sync.get("k", "cuda").view(torch.uint8), value.view(torch.uint8))
    assert torch.equal(store.sync.get("k", "cpu").view(torch.uint8), value.cpu().view(torch.uint8))
    out = torch.empty_like(value)
    store.sync.get("k", "cuda", out=out)
    assert torch.equal(out.view(torch.uint8), value.view(torch.uint8))


@pytest.mark.parametrize("tier", TIERS)
def test_cuda_tensors_round_trip_compressed_and_batched(store, tier):
    values = {f"k{i}": random_tensor((5000 + 4096 * i,), torch.bfloat16, seed=i).cuda() for i in range(4)}
    store.sync.put_many(values, tier, compress=True)
    for key, got in zip(values, store.sync.get_many(list(values), "cuda")):
        assert got.is_cuda and torch.equal(got.view(torch.int16), values[key].view(torch.int16))


@pytest.mark.parametrize("tier", TIERS)
async def test_async_get_into_cuda_out(store, tier):
    value = random_tensor((1 * MiB,), torch.uint8, seed=2).cuda()
    await store.put("k", value, tier)
    out = torch.zeros_like(value)
    assert await store.get("k", "cuda", out=out) is out
    assert torch.equal(out, value)


def _queued_read(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x``, computed by a kernel queued behind ~50 ms of GPU sleep on the current stream."""
    torch.cuda._sleep(SLEEP_CYCLES)
    return x.sum(dtype=torch.int64)


@pytest.mark.parametrize("tier", TIERS)
def test_a_new_result_waits_for_kernels_reading_its_recycled_memory(store, tier):
    nbytes = 4 * MiB
    store.sync.put("k", torch.zeros(nbytes, dtype=torch.uint8), tier)
    for _ in range(3):
        x = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
        ptr = x.data_ptr()
        total = _queued_read(x)
        del x  # the caching allocator may hand x's block to the next allocation on this stream
        result = store.sync.get("k", "cuda")
        assert result.data_ptr() == ptr, "the allocator did not recycle the block, so this test checks nothing"
        assert total.item() == 7 * nbytes, "the get overwrote memory a queued kernel was still reading"
        assert not result.any()
        del result


def test_a_device_tier_copy_waits_for_kernels_reading_its_recycled_memory(store):
    nbytes = 4 * MiB
    for i in range(3):
        x = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
        total = _queued_read(x)
        del x
        store.sync.put(f"k{i}", torch.zeros(nbytes, dtype=torch.uint8), "device")
        assert total.item() == 7 * nbytes, "the put overwrote memory a queued kernel was still reading"
        assert store.info(f"k{i}").tiers == (tiered.Tier.DEVICE,)


@pytest.mark.parametrize("tier", TIERS)
def test_get_into_out_waits_for_the_callers_stream(store, tier):
    nbytes = 4 * MiB
    store.sync.put("k", torch.zeros(nbytes, dtype=torch.uint8), tier)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
        total = _queued_read(out)
        store.sync.get_future("k", "cuda", out=out).result()
        assert total.item() == 7 * nbytes, "the get wrote into `out` before the caller's kernels read it"
        assert not out.any()


def test_put_waits_for_the_kernels_that_write_the_tensor(store):
    nbytes = 4 * MiB
    for tier in TIERS:
        x = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(9)  # queued behind the sleep: the put must store 9s, not the zeros there now
        store.sync.put(f"k-{tier}", x, tier)
        assert torch.equal(store.sync.get(f"k-{tier}"), torch.full((nbytes,), 9, dtype=torch.uint8))


def test_eviction_cascades_from_the_gpu_to_nvme_and_back(tmp_path):
    config = tiered.StoreConfig(path=str(tmp_path / "store"), device="cuda", device_bytes=2 * MiB,
                                host_bytes=2 * MiB, prefault_host=False, durable=False)
    values = [random_tensor((MiB // 4,), torch.float32, seed=i).cuda() for i in range(8)]
    with tiered.TieredStore.open(config) as s:
        for i, v in enumerate(values):
            s.sync.put(f"k{i}", v, "device")
        assert s.stats().tiers[tiered.Tier.NVME].bytes_in > 0, "nothing was evicted: the budgets are too large"
        for i, v in enumerate(values):
            s.sync.prefetch(f"k{i}", "device").result()
            assert torch.equal(s.sync.get(f"k{i}", "cuda").view(torch.int32), v.view(torch.int32))
    with tiered.TieredStore.open(config) as s:  # everything comes back after a reopen
        for i, v in enumerate(values):
            assert torch.equal(s.sync.get(f"k{i}", "cuda").view(torch.int32), v.view(torch.int32))


def _cuda_config(tmp_path, tier: str) -> engine.EngineConfig:
    return engine.EngineConfig(
        store=tiered.StoreConfig(path=str(tmp_path / "store"), device="cuda", device_bytes=64 * KiB,
                                 host_bytes=64 * KiB, prefault_host=False, durable=False),
        param_tier=tier, optimizer_tier="nvme", grad_tier="host", prefetch_bytes=32 * KiB,
        optimizer_group_bytes=16 * KiB, compute_device="cuda",
    )


def test_inputs_on_the_cpu_reach_a_model_computing_on_the_gpu(tmp_path):
    """A model built on the CPU, wrapped to compute on the GPU, takes the batch a script loaded on the
    CPU (FSDP2 moves the root's inputs too): the plain GPU model's output."""
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model).cuda()
    eng = engine.wrap(model, config=_cuda_config(tmp_path, "nvme"))
    x = gpt_tokens(seed=0)
    out = model(x)
    eng.close()
    assert x.device.type == "cpu" and out.is_cuda and torch.equal(out, ref(x.cuda()))


@pytest.mark.parametrize("tier", TIERS)
def test_training_on_the_gpu_matches_torch_adamw(tmp_path, tier):
    """Forward and backward on the GPU, AdamW on the CPU (as the engine runs it): the oracle steps
    torch.optim.AdamW over CPU copies of a plain GPU model's parameters. Torch's AdamW on the GPU
    would differ by rounding, which AdamW blows up to whole steps where a gradient is rounding noise
    (TinyGPT's key bias, which softmax ignores)."""
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    ref = copy.deepcopy(model)
    masters = [p.detach().cpu().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-2, weight_decay=0.01), config=_cuda_config(tmp_path, tier))
    for step in range(5):
        x = gpt_tokens(seed=step).cuda()
        loss, ref_loss = model(x).pow(2).mean(), ref(x).pow(2).mean()
        assert torch.equal(loss, ref_loss), step
        loss.backward(), ref_loss.backward()
        eng.step()
        for master, p in zip(masters, ref.parameters()):
            master.grad = p.grad.cpu()
        ref_opt.step()
        with torch.no_grad():
            for master, p in zip(masters, ref.parameters()):
                p.copy_(master)
        model.zero_grad(), ref.zero_grad()
    assert eng.stats().prefetch_hits > 0
    eng.unwrap()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.is_cuda and torch.equal(p, q)


def test_bf16_autocast_training_on_the_gpu_stays_finite(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-2), config=_cuda_config(tmp_path, "nvme"))
    losses = []
    for step in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(gpt_tokens(seed=step % 2).cuda()).float().pow(2).mean()
        loss.backward()
        eng.step()
        model.zero_grad()
        losses.append(loss.item())
    eng.close()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
