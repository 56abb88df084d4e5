"""The I/O layer: short transfers continued, failures raised, extents allocated without overlap."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from short_transfers import capped as chunky

import tiered
from tiered.manifest.extents import Extent, ExtentAllocator
from tiered.io import AlignedBuffer, BlockRead, BlockWrite, IOEngine, Syscalls, open_file

KiB = 1024


async def round_trip(tmp_path, syscalls: Syscalls, nbytes: int = 200 * KiB):
    engine = IOEngine(block_size=64 * KiB, queue_depth=3, io_threads=3, checksum=True, syscalls=syscalls)
    handle = open_file(str(tmp_path / "f"), direct=True)
    os.posix_fallocate(handle.fd, 0, 1 << 20)
    src = AlignedBuffer(nbytes)
    src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
    dst = AlignedBuffer(nbytes)
    try:
        blocks = [(o, min(64 * KiB, nbytes - o)) for o in range(0, nbytes, 64 * KiB)]
        crcs = await engine.write([BlockWrite(handle, o, n, source=[src.view[o : o + n]]) for o, n in blocks])
        await engine.fdatasync([handle])
        reads = [BlockRead(handle, o, n, dest=[dst.view[o : o + n]], expected_crc=c) for (o, n), c in zip(blocks, crcs)]
        await engine.read(reads)
        assert torch.equal(src.tensor[:nbytes], dst.tensor[:nbytes])
        return engine
    finally:
        handle.close()
        engine.close()


async def test_short_transfers_are_continued(tmp_path):
    sys = Syscalls(preadv=chunky(os.preadv, 8 * KiB), pwritev=chunky(os.pwritev, 12 * KiB))
    engine = await round_trip(tmp_path, sys)
    assert engine.counters.bytes_written == 200 * KiB


async def test_write_without_progress_raises(tmp_path):
    with pytest.raises(tiered.TransferError, match="no progress"):
        await round_trip(tmp_path, Syscalls(pwritev=lambda fd, views, off: 0))


async def test_read_at_end_of_file_raises(tmp_path):
    with pytest.raises(tiered.TransferError, match="end of file"):
        await round_trip(tmp_path, Syscalls(preadv=lambda fd, views, off: 0))


async def test_syscall_error_names_file_and_offset(tmp_path):
    def failing(fd, views, offset):
        raise OSError(5, "Input/output error")

    with pytest.raises(tiered.TransferError, match=r"offset \d+ of .*/f failed: .*Input/output error"):
        await round_trip(tmp_path, Syscalls(preadv=failing))


async def test_store_surfaces_io_errors_and_stays_usable(tmp_path, monkeypatch):
    cfg = tiered.StoreConfig(path=str(tmp_path / "s"), block_size=64 * KiB, swap_grow_bytes=1 << 20)
    async with await tiered.TieredStore.open_async(cfg) as store:
        await store.put("good", torch.ones(1000))
        real = store._io.syscalls
        store._io.syscalls = Syscalls(pwritev=lambda fd, views, off: 0)
        with pytest.raises(tiered.TransferError):
            await store.put("bad", torch.ones(100_000))
        store._io.syscalls = real
        assert "bad" not in store
        assert torch.equal(await store.get("good"), torch.ones(1000))
        await store.put("bad", torch.ones(100_000))
        assert torch.equal(await store.get("bad"), torch.ones(100_000))


def test_buffered_fallback_warns_once_and_works(tmp_path, monkeypatch):
    import tiered.backends.nvme as nvme

    real_open = nvme.open_file
    monkeypatch.setattr(nvme, "open_file", lambda path, direct, **kw: real_open(path, direct=False, **kw))
    cfg = tiered.StoreConfig(path=str(tmp_path / "s"), block_size=64 * KiB, swap_grow_bytes=1 << 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = tiered.TieredStore.open(cfg)
    assert len([w for w in caught if "O_DIRECT" in str(w.message)]) == 1
    with store:
        x = torch.randint(-100, 100, (100_003,), dtype=torch.int16)
        store.sync.put("k", x)
        store.sync.evict("k")
        assert torch.equal(store.sync.get("k"), x)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40_000)), max_size=60))
def test_extent_allocator_never_overlaps(ops):
    alloc = ExtentAllocator(256 * KiB)
    held: list[list[Extent]] = []
    for is_alloc, n in ops:
        if is_alloc or not held:
            got = alloc.allocate(n)
            if got is None:
                assert -(-n // 4096) * 4096 > alloc.free_bytes
                continue
            assert sum(e.length for e in got) == -(-n // 4096) * 4096
            held.append(got)
        else:
            alloc.free(held.pop(n % len(held)))
        ranges = sorted((e.offset, e.end) for h in held for e in h)
        for (a0, a1), (b0, b1) in zip(ranges, ranges[1:]):
            assert a1 <= b0, "two allocations overlap"
        assert all(r[0] % 4096 == 0 and r[1] <= 256 * KiB for r in ranges)
        assert alloc.used_bytes == sum(r[1] - r[0] for r in ranges)
    for h in held:
        alloc.free(h)
    assert alloc.free_bytes == 256 * KiB and alloc.allocate(256 * KiB) == [Extent(0, 256 * KiB)]
