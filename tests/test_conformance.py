"""Conformance suites: one class every tier backend passes, one the store passes for every tier."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
import torch

import tiered
from tiered.backends import DeviceBackend, HostBackend, NvmeBackend, TierBackend
from tiered.io import IOEngine
from tiered.manifest.ownership import OwnedDirectories
from tiered.io.spans import Span, spans_of_tensor

from conftest import ALL_DTYPES, KiB, random_tensor, same_bytes


@pytest.fixture(params=["device", "host", "nvme"])
async def backend(request, tmp_path):
    pool = concurrent.futures.ThreadPoolExecutor(2)
    io = IOEngine(block_size=16 * KiB, queue_depth=4, io_threads=4, checksum=True)
    if request.param == "device":
        b: TierBackend = DeviceBackend(torch.device("cpu"), 256 * KiB, pool)
    elif request.param == "host":
        b = HostBackend(256 * KiB, pool)
    else:
        dirs = OwnedDirectories.open(str(tmp_path), [str(tmp_path / "a"), str(tmp_path / "b")], exclusive=True,
                                     create=True)
        b = NvmeBackend(dirs.swap, store_id="conformance", files_per_dir=2, budget=256 * KiB, grow_bytes=64 * KiB,
                        io=io, direct=True)
    yield b
    await b.close()
    if request.param == "nvme":
        dirs.close()
    io.close()
    pool.shutdown()


class TestBackendConformance:
    """What every TierBackend guarantees."""

    @pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 50_000, 100 * KiB])
    async def test_round_trip(self, backend, nbytes):
        src = random_tensor((nbytes,), torch.uint8, seed=nbytes)
        copy = await backend.allocate(nbytes)
        assert copy.footprint >= nbytes and backend.used == copy.footprint
        await backend.store(copy, spans_of_tensor(src))
        out = torch.empty(nbytes, dtype=torch.uint8)
        await backend.load(copy, spans_of_tensor(out))
        assert torch.equal(src, out)
        backend.release(copy)
        assert backend.used == 0

    async def test_scattered_spans_both_ways(self, backend):
        src = random_tensor((30_000,), torch.uint8, seed=1)
        parts = [src[:7], src[7:12_000], src[12_000:]]
        copy = await backend.allocate(30_000)
        await backend.store(copy, [Span(p) for p in parts])
        out = torch.zeros(30_000, dtype=torch.uint8)
        await backend.load(copy, [Span(out[:5000]), Span(out[5000:5001]), Span(out[5001:])])
        assert torch.equal(src, out)

    async def test_budget(self, backend):
        with pytest.raises(tiered.CapacityError, match="budget"):
            await backend.allocate(backend.budget + 1)
        a = await backend.allocate(200 * KiB)
        with pytest.raises(tiered.CapacityError):
            await backend.allocate(100 * KiB)
        backend.release(a)
        b = await backend.allocate(250 * KiB)  # the space came back
        backend.release(b)
        assert backend.used == 0

    async def test_release_waits_for_readers(self, backend):
        copy = await backend.allocate(64 * KiB)
        copy.readers += 1
        backend.release(copy)
        assert backend.used == copy.footprint, "a copy being read must not be freed"
        backend.end_read(copy)
        assert backend.used == 0

    async def test_copies_are_independent(self, backend):
        a_data = random_tensor((40_000,), torch.uint8, seed=2)
        b_data = random_tensor((40_000,), torch.uint8, seed=3)
        a = await backend.allocate(40_000)
        b = await backend.allocate(40_000)
        await asyncio.gather(backend.store(a, spans_of_tensor(a_data)), backend.store(b, spans_of_tensor(b_data)))
        out = torch.empty(40_000, dtype=torch.uint8)
        await backend.load(a, spans_of_tensor(out))
        assert torch.equal(out, a_data)
        await backend.load(b, spans_of_tensor(out))
        assert torch.equal(out, b_data)


@pytest.fixture(params=[tiered.Tier.DEVICE, tiered.Tier.HOST, tiered.Tier.NVME], ids=lambda t: t.value)
def tier(request) -> tiered.Tier:
    return request.param


class TestStoreConformance:
    """What the store guarantees for a put to any tier."""

    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
    async def test_every_dtype(self, store, tier, dtype):
        x = random_tensor((3, 5), dtype, seed=7)
        await store.put("k", x, tier=tier)
        y = await store.get("k")
        assert same_bytes(x, y)

    @pytest.mark.parametrize("shape", [(), (0,), (4, 0, 3), (1,), (17,), (3, 1, 7), (64, 1000)])
    async def test_every_shape(self, store, tier, shape):
        x = random_tensor(shape, torch.float32, seed=len(shape))
        await store.put("k", x, tier=tier)
        y = await store.get("k")
        assert same_bytes(x, y)
        info = store.info("k")
        assert info.shape == tuple(shape) and info.dtype == torch.float32 and info.nbytes == x.numel() * 4

    async def test_non_contiguous_input(self, store, tier):
        base = random_tensor((40, 60), torch.bfloat16, seed=1)
        for view in (base.t(), base[::3, 1::2], base.expand(2, 40, 60)[1]):
            await store.put("k", view, tier=tier)
            assert same_bytes(view.contiguous(), await store.get("k"))

    async def test_put_copies_the_tensor(self, store, tier):
        x = torch.arange(10_000, dtype=torch.float32)
        expected = x.clone()
        await store.put("k", x, tier=tier)
        x.fill_(-1)  # the caller reuses its tensor at once
        assert torch.equal(await store.get("k"), expected)
        y = await store.get("k")
        y.fill_(5)  # and a result is the caller's own
        assert torch.equal(await store.get("k"), expected)

    async def test_overwrite_and_delete(self, store, tier):
        await store.put("k", torch.ones(100), tier=tier)
        await store.put("k", torch.zeros(7, dtype=torch.int64), tier=tier)
        y = await store.get("k")
        assert y.dtype == torch.int64 and torch.equal(y, torch.zeros(7, dtype=torch.int64))
        assert "k" in store and store.keys() == ["k"]
        await store.delete("k")
        assert "k" not in store and store.keys() == []
        with pytest.raises(tiered.KeyNotFoundError):
            await store.get("k")
        with pytest.raises(KeyError):  # also a KeyError
            store.info("k")

    async def test_get_into_out(self, store, tier):
        x = random_tensor((100, 33), torch.float16, seed=4)
        await store.put("k", x, tier=tier)
        out = torch.empty_like(x)
        assert (await store.get("k", out=out)) is out and same_bytes(out, x)
        with pytest.raises(ValueError, match="shape"):
            await store.get("k", out=torch.empty(3, dtype=torch.float16))

    async def test_info_and_dirty(self, store, tier):
        await store.put("k", torch.randn(1000), tier=tier)
        info = store.info("k")
        assert info.tiers == (tier,)
        assert info.dirty == (tier is not tiered.Tier.NVME)
        assert info.codec == "raw"
        assert (info.stored_nbytes == 4000) == (tier is tiered.Tier.NVME)

    async def test_evict_writes_down_once_then_drops_clean(self, store, tier):
        x = torch.randn(50_000)
        await store.put("k", x, tier=tier)
        written = store.stats().bytes_written
        await store.evict("k", tiered.Tier.NVME)
        assert store.info("k").tiers == (tiered.Tier.NVME,)
        if tier is not tiered.Tier.NVME:
            assert store.stats().bytes_written > written
        await store.prefetch("k", tiered.Tier.HOST)
        assert store.info("k").tiers == (tiered.Tier.HOST, tiered.Tier.NVME)
        written = store.stats().bytes_written
        await store.evict("k", tiered.Tier.NVME)  # the host copy is clean: no I/O
        assert store.stats().bytes_written == written
        assert same_bytes(await store.get("k"), x)

    async def test_too_large_for_tier(self, store, tier):
        budget = store.stats().tiers[tier].budget_bytes
        if budget is None:
            pytest.skip("nvme is bounded by the disk")
        with pytest.raises(tiered.CapacityError, match=str(budget)):
            await store.put("big", torch.empty(budget // 4 + 1), tier=tier)
        assert "big" not in store

    async def test_bad_input(self, store, tier):
        with pytest.raises(TypeError, match="str"):
            await store.put(3, torch.ones(1), tier=tier)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="Tensor"):
            await store.put("k", [1, 2], tier=tier)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="meta"):
            await store.put("k", torch.empty(2, device="meta"), tier=tier)
        with pytest.raises(ValueError, match="'warm'"):
            await store.put("k", torch.ones(1), tier="warm")


class TestEviction:
    async def test_lru_demotes_least_recent(self, store):
        for i in range(4):  # 4 x 400 KB into a 1 MiB device tier
            await store.put(f"k{i}", torch.full((100_000,), float(i)), tier="device")
            await store.get(f"k{i}")
        tiers = {k: store.info(k).tiers for k in store.keys()}
        assert tiered.Tier.DEVICE not in tiers["k0"] and tiered.Tier.DEVICE not in tiers["k1"]
        assert tiered.Tier.DEVICE in tiers["k3"]
        for i in range(4):  # demoted, not lost
            assert torch.equal(await store.get(f"k{i}"), torch.full((100_000,), float(i)))
        s = store.stats()
        assert s.tiers[tiered.Tier.DEVICE].evictions >= 2
        assert s.tiers[tiered.Tier.DEVICE].used_bytes <= s.tiers[tiered.Tier.DEVICE].budget_bytes

    async def test_future_order_evicts_furthest(self, store):
        store.set_access_order(["a", "b", "c", "a", "b", "c"])
        for k in "abc":
            await store.put(k, torch.zeros(60_000), tier="device")  # 240 KB each, 4 fit
        await store.get("a")  # cursor after a: next uses b, c, a
        await store.put("d", torch.zeros(60_000), tier="device")
        await store.put("e", torch.zeros(60_000), tier="device")  # must evict: d and e are never used again
        on_device = {k for k in store.keys() if tiered.Tier.DEVICE in store.info(k).tiers}
        assert {"b", "c"} <= on_device

    async def test_pinned_entries_stay(self, store):
        await store.put("p", torch.ones(150_000), tier="device")  # 600 KB of 1 MiB
        await store.pin("p")
        await store.put("q", torch.ones(100_000), tier="device")
        assert tiered.Tier.DEVICE in store.info("p").tiers and store.info("p").pinned
        with pytest.raises(tiered.CapacityError, match="pinned"):
            await store.put("r", torch.ones(150_000), tier="device")
        with pytest.raises(ValueError, match="pinned"):
            await store.evict("p")
        await store.unpin("p")
        await store.put("r", torch.ones(150_000), tier="device")
        assert tiered.Tier.DEVICE not in store.info("p").tiers
        assert torch.equal(await store.get("p"), torch.ones(150_000))

    async def test_cascade_device_to_host_to_nvme(self, store):
        xs = [torch.randn(200_000) for _ in range(6)]  # 800 KB each: 1 fits on device, 2 on host
        for i, x in enumerate(xs):
            await store.put(f"k{i}", x, tier="device")
        s = store.stats()
        assert s.tiers[tiered.Tier.NVME].entries >= 3
        for i, x in enumerate(xs):
            assert same_bytes(await store.get(f"k{i}"), x)


class TestPrefetch:
    async def test_prefetch_then_get_hits(self, store):
        x = torch.randn(100_000)
        await store.put("k", x)
        handle = store.prefetch("k", "device")
        await handle
        assert handle.done()
        assert same_bytes(await store.get("k"), x)
        assert store.stats().tiers[tiered.Tier.DEVICE].hits == 1

    async def test_prefetch_missing_key(self, store):
        with pytest.raises(tiered.KeyNotFoundError):
            store.prefetch("nope")

    async def test_prefetch_too_large_reports_capacity(self, store):
        await store.put("k", torch.zeros(300_000))  # 1.2 MB > device budget
        with pytest.raises(tiered.CapacityError):
            await store.prefetch("k", "device")
        assert store.info("k").tiers == (tiered.Tier.NVME,)


class TestRegressions:
    async def test_admission_wakes_when_a_put_lands(self, store):
        """A prefetch waiting for host room must wake when a concurrent put's copy becomes evictable."""
        await store.put("a", torch.ones(375_000))  # 1.5 MB on nvme
        for _ in range(5):
            put = store.put("b", torch.zeros(375_000), tier="host")
            fetch = store.prefetch("a", "host")
            await asyncio.wait_for(asyncio.gather(put, fetch), timeout=60)
            await store.evict("a")
            await store.evict("b")
        assert torch.equal(await store.get("a"), torch.ones(375_000))

    async def test_nvme_bytes_in_counted_once(self, store):
        await store.put("k", torch.ones(1024))
        assert store.stats().tiers[tiered.Tier.NVME].bytes_in == 4096

    async def test_put_keeps_the_pin(self, store):
        await store.put("k", torch.ones(10), tier="host")
        await store.pin("k")
        await store.put("k", torch.zeros(10), tier="host")
        assert store.info("k").pinned


async def test_delete_during_write_down_stays_deleted(config):
    """A delete racing a flush of the same key must win after reopen, whatever the interleaving."""
    for attempt in range(4):
        store = await tiered.TieredStore.open_async(config)
        await store.put("k", torch.full((400_000,), float(attempt)), tier="host")
        flush = asyncio.ensure_future(store.flush())
        for _ in range(attempt):
            await asyncio.sleep(0)
        await store.delete("k")
        await flush
        await store.close()
        store = await tiered.TieredStore.open_async(config)
        assert "k" not in store, f"deleted key came back (attempt {attempt})"
        assert store.stats().tiers[tiered.Tier.NVME].used_bytes == 0
        await store.close()
