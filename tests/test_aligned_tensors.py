"""tiered.empty_aligned: page-aligned host tensors that puts and get(out=) move with no staging copy."""

from __future__ import annotations

import gc

import pytest
import torch

import tiered
from tests.conftest import random_tensor, same_bytes

KiB = 1024
MiB = 1024 * KiB


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@pytest.mark.parametrize(
    "shape, dtype",
    [((3, 5), torch.float32), ((0,), torch.bfloat16), ((), torch.float64), (7, torch.bool),
     ((4, 4), torch.complex64), ((1000, 1001), torch.int16), ((3,), torch.float8_e4m3fn)],
)
def test_shape_dtype_alignment_and_zeros(shape, dtype):
    t = tiered.empty_aligned(shape, dtype)
    want = (shape,) if isinstance(shape, int) else shape
    assert t.shape == torch.Size(want) and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous() and t.data_ptr() % 4096 == 0
    raw = t.reshape(-1).view(torch.uint8)
    assert raw.numel() == t.numel() * dtype.itemsize and not raw.any()  # a fresh mapping reads as zeros
    assert t.is_pinned() == torch.cuda.is_available()  # pinned by default where CUDA is
    assert not tiered.empty_aligned(shape, dtype, pin=False).is_pinned()


def test_memory_is_unmapped_when_the_last_view_dies():
    t = tiered.empty_aligned((4 * MiB,), torch.uint8)
    t.fill_(3)
    address = t.data_ptr()
    part = t[MiB:].view(torch.int32)  # a view keeps the memory after the base tensor dies
    del t
    gc.collect()
    assert _mapped(address) and int(part[0]) == 0x03030303
    del part
    gc.collect()
    assert not _mapped(address)


@pytest.mark.parametrize(
    "shape, dtype, error",
    [((-1,), torch.float32, ValueError), ((2.5,), torch.float32, ValueError), ((True,), torch.float32, ValueError),
     ((2,), "float32", TypeError), ((2,), torch.qint8, TypeError)],
)
def test_bad_input_is_refused_with_the_value(shape, dtype, error):
    with pytest.raises(error, match="empty_aligned"):
        tiered.empty_aligned(shape, dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_pinning_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="pin=True"):
        tiered.empty_aligned((16,), torch.float32, pin=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to page-lock memory")
def test_pinned_under_cuda_by_default():
    t = tiered.empty_aligned((MiB,), torch.float32)
    assert t.is_pinned() and t.data_ptr() % 4096 == 0
    assert torch.equal(t.fill_(2).cuda(non_blocking=True).cpu(), t)


@pytest.fixture
def nvme_config(tmp_path) -> tiered.StoreConfig:
    return tiered.StoreConfig(path=str(tmp_path / "store"), host_bytes=0, device_bytes=0, block_size=256 * KiB,
                              queue_depth=4, io_threads=2, staging_buffers=2, swap_grow_bytes=4 * MiB)


async def test_aligned_tensors_are_written_and_read_in_place(nvme_config):
    """No block of an aligned tensor's put or of a get(out=aligned) goes through a staging buffer;
    a torch.empty tensor of the same size does (the control, so the counter can fail)."""
    value = random_tensor((3 * MiB // 4 + 512,), torch.float32, seed=1)  # 3 MiB + 2 KiB: a short last block
    aligned = tiered.empty_aligned(value.shape, value.dtype)
    aligned.copy_(value)
    async with await tiered.TieredStore.open_async(nvme_config) as store:
        counters = store._io.counters
        await store.put("aligned", aligned, tier="nvme")
        assert counters.write_requests >= 12 and counters.staged_writes <= 1  # at most the unaligned tail
        out = tiered.empty_aligned(value.shape, value.dtype)
        got = await store.get("aligned", out=out)
        assert got is out and same_bytes(out, value)
        assert counters.staged_reads <= 1

        exact = tiered.empty_aligned((2 * MiB,), torch.bfloat16)  # whole pages: every block in place
        exact.copy_(random_tensor(exact.shape, exact.dtype, seed=2))
        before = (counters.staged_writes, counters.staged_reads, counters.write_requests)
        await store.put("exact", exact, tier="nvme")
        back = tiered.empty_aligned(exact.shape, exact.dtype)
        await store.get("exact", out=back)
        assert counters.write_requests - before[2] == 16
        assert (counters.staged_writes, counters.staged_reads) == before[:2]
        assert same_bytes(back, exact)

        # A view 64 bytes into an aligned buffer, where torch's allocator puts large tensors: staged
        # unless the disk's O_DIRECT takes 64-byte-aligned memory (NVMe does; tests/test_direct_alignment.py).
        backing = tiered.empty_aligned((value.numel() + 16,), value.dtype)
        plain = backing[16:]
        plain.copy_(value)
        assert plain.data_ptr() % 4096 == 64
        before_w = counters.staged_writes
        await store.put("plain", plain, tier="nvme")
        staged = counters.staged_writes - before_w
        assert staged >= 12 if 64 % store._nvme.memory_alignment else staged <= 1
        assert same_bytes(await store.get("plain"), value)


async def test_in_place_write_is_checksummed(nvme_config):
    """A block written from the caller's memory still gets its CRC: a flipped bit on disk is caught."""
    t = tiered.empty_aligned((MiB,), torch.float32)
    t.copy_(random_tensor(t.shape, t.dtype, seed=3))
    async with await tiered.TieredStore.open_async(nvme_config) as store:
        await store.put("k", t, tier="nvme")
        assert store._io.counters.staged_writes == 0
        nvme = store._versions.entries["k"].copies[tiered.Tier.NVME]
        assert nvme.crcs is not None and len(nvme.crcs) == 16
        ext = nvme.extents[0]
        path = store._nvme.files[ext.file].path
    with open(path, "r+b") as f:
        f.seek(ext.offset + 12345)
        byte = f.read(1)
        f.seek(ext.offset + 12345)
        f.write(bytes([byte[0] ^ 0x10]))
    async with await tiered.TieredStore.open_async(nvme_config) as store:
        with pytest.raises(tiered.ChecksumError):
            await store.get("k", out=tiered.empty_aligned(t.shape, t.dtype))


def test_huge_pages_is_a_hint_and_the_memory_works_the_same():
    t = tiered.empty_aligned((4 * MiB,), torch.float32, huge_pages=True)
    assert t.data_ptr() % 4096 == 0 and not t.any()
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * 4 * MiB
    with pytest.raises(TypeError, match="huge_pages"):
        tiered.empty_aligned((4,), torch.float32, huge_pages="yes")


def _locked_kib() -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmLck:")).split()[1])


def test_memory_is_populated_and_locked_where_permitted():
    """Pages are all present at allocation; the lock is best effort: lock_pages says whether it took,
    and a tensor made without the right to lock (RLIMIT_MEMLOCK, no CAP_IPC_LOCK) works all the same."""
    from tiered.io.aligned import anonymous_map, lock_pages

    region = anonymous_map(2 * MiB, populate=True)
    before = _locked_kib()
    locked = lock_pages(region)
    assert locked == (_locked_kib() - before >= 2048)
    region.close()  # the lock took no lasting export of the mapping
    assert _locked_kib() == before

    t = tiered.empty_aligned((MiB,), torch.uint8, pin=False)
    t.fill_(3)
    assert int(t.sum()) == 3 * MiB


async def test_the_store_counts_its_checksum_and_staging_time(nvme_config, tmp_path):
    """stats() says where the I/O threads' CPU went: CRC-32s of every block, copies only for blocks
    that move through staging; with checksums off, no CRC time."""
    aligned = tiered.empty_aligned((4 * MiB // 4,), torch.float32)
    aligned.copy_(random_tensor(aligned.shape, aligned.dtype, seed=5))
    async with await tiered.TieredStore.open_async(nvme_config) as store:
        await store.put("aligned", aligned, tier="nvme")
        s = store.stats()
        assert s.checksum_seconds > 0 and s.staging_seconds == 0  # written from the caller's memory
        await store.put("small", random_tensor((1000,), torch.float32, seed=6), tier="nvme")
        assert store.stats().staging_seconds > 0
    unchecked = tiered.StoreConfig(path=str(tmp_path / "unchecked"), host_bytes=0, device_bytes=0,
                                   block_size=256 * KiB, checksum=False)
    async with await tiered.TieredStore.open_async(unchecked) as store:
        await store.put("aligned", aligned, tier="nvme")
        assert same_bytes(await store.get("aligned"), aligned)
        assert store.stats().checksum_seconds == 0
