"""The I/O fast paths: the result pool, the CRC-32 implementations, mailboxes, decoupled staging."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import threading
import zlib

import pytest
import torch

import tiered
from tiered.io import AlignedBuffer, BlockRead, BlockWrite, IOEngine, ResultPool, open_file
from tiered.io.crc import CRC32_IMPL, crc32
from tiered.io.mailbox import Mailbox
from tiered.io.spans import DIRECT_RESULT_BYTES, new_result

KiB = 1024
MiB = 1024 * KiB


def test_result_pool_reuses_a_freed_mapping_and_respects_its_capacity():
    pool = ResultPool(capacity=3 * MiB)
    t, view = pool.take(MiB + 5)
    assert t.numel() == MiB + 5 and t.data_ptr() % 4096 == 0 and len(view) == MiB + 4096
    address = t.data_ptr()
    view.release()
    del t
    gc.collect()
    assert pool.waiting_bytes == MiB + 4096
    again, view = pool.take(MiB + 5)
    assert again.data_ptr() == address and pool.hits == 1 and pool.waiting_bytes == 0
    view.release()
    views = []
    held = [again]
    for _ in range(3):
        t, v = pool.take(MiB + 5)
        held.append(t)
        views.append(v)
    for v in views:
        v.release()
    del held, t, again
    gc.collect()
    assert pool.waiting_bytes <= pool.capacity  # the oldest were unmapped to make room
    pool.close()
    assert pool.waiting_bytes == 0


def test_result_pool_bounds_buffers_lent_and_waiting_together():
    """[Note: Result pool bound]: freed buffers wait only while lent + waiting fit the capacity, a new
    mapping first unmaps waiting ones, and a smaller bound unmaps what waits beyond it at once."""
    pool = ResultPool(capacity=4 * MiB)
    a, va = pool.take(2 * MiB)
    b, vb = pool.take(2 * MiB)
    c, vc = pool.take(MiB)  # beyond the capacity: what callers hold is theirs
    for v in (va, vb, vc):
        v.release()
    assert pool.lent_bytes == 5 * MiB and pool.waiting_bytes == 0
    del a
    gc.collect()
    assert pool.waiting_bytes == 0  # 3 MiB lent + 2 waiting would exceed 4 MiB: unmapped
    del b
    gc.collect()
    assert (pool.lent_bytes, pool.waiting_bytes) == (MiB, 2 * MiB)
    d, vd = pool.take(3 * MiB)  # 1 lent + 2 waiting + 3 new > 4: the waiting buffer goes first
    vd.release()
    assert (pool.lent_bytes, pool.waiting_bytes, pool.misses) == (4 * MiB, 0, 4)
    del c
    gc.collect()
    assert pool.waiting_bytes == MiB
    pool.resize(3 * MiB)  # 3 lent + 1 waiting > 3
    assert pool.waiting_bytes == 0 and pool.capacity == 3 * MiB
    del d
    gc.collect()
    assert (pool.lent_bytes, pool.waiting_bytes) == (0, 3 * MiB)
    pool.close()


def test_a_view_of_a_pooled_result_keeps_its_memory():
    pool = ResultPool(capacity=8 * MiB)
    t, view = pool.take(2 * MiB)
    view.release()
    t.fill_(7)
    part = t[MiB:].view(torch.int16)  # the base tensor dies, the view keeps the storage alive
    del t
    gc.collect()
    assert pool.waiting_bytes == 0
    other, v2 = pool.take(2 * MiB)  # must not hand out the memory `part` still uses
    v2.release()
    other.fill_(1)
    assert int(part.view(torch.uint8).min()) == 7
    pool.close()


def _thp_eligible(address: int) -> bool:
    """The THPeligible line of /proc/self/smaps for the mapping holding ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_buffers_that_o_direct_fills_ask_for_huge_pages_where_the_kernel_gives_them():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off here ([never])")
    # Asked for (MADV_HUGEPAGE) even under the "madvise" mode: each 2 MiB is then physically
    # contiguous, so an 8 MiB block is a few segments, not up to 2,048 (docs/tuning.md, "Memory").
    pool = ResultPool(capacity=0)
    result, view = pool.take(8 * MiB)
    view.release()
    engine = IOEngine(block_size=4 * MiB, queue_depth=2, io_threads=1, checksum=False, staging_buffers=2)
    plain = AlignedBuffer(8 * MiB)
    try:
        assert _thp_eligible(result.data_ptr())  # large get results
        assert _thp_eligible(engine._staging.address)  # every block of a plain tensor moves through here
        if "[madvise]" in mode:  # under "always" every large mapping is eligible
            assert not _thp_eligible(plain.address)  # only where asked: the host tier's pool is not
    finally:
        engine.close()
        plain.close()
        pool.close()


def test_new_result_is_aligned_for_large_cpu_results_and_plain_otherwise():
    pool = ResultPool(capacity=0)
    big, spans = new_result((8192, 1024), torch.float32, "cpu", pool)
    assert big.shape == (8192, 1024) and big.dtype == torch.float32 and big.is_contiguous()
    assert spans[0].view is not None and big.data_ptr() % 4096 == 0
    small, spans = new_result((3,), torch.bfloat16, "cpu", pool)
    assert spans[0].view is None and small.shape == (3,)
    empty, spans = new_result((0, 4), torch.float32, "cpu", pool)
    assert spans == [] and empty.shape == (0, 4)


def test_results_from_4_mib_come_from_the_pool():
    # torch.empty memory of a few MiB may be faulted in afresh on every allocation.
    assert DIRECT_RESULT_BYTES == 4 * MiB
    pool = ResultPool(capacity=8 * MiB)
    first, spans = new_result((MiB,), torch.float32, "cpu", pool)
    assert spans[0].view is not None and first.data_ptr() % 4096 == 0
    address = first.data_ptr()
    del first, spans
    gc.collect()
    again, _ = new_result((MiB,), torch.float32, "cpu", pool)
    assert again.data_ptr() == address and pool.hits == 1  # the freed mapping, already faulted in
    new_result((MiB - 1,), torch.float32, "cpu", pool)
    assert (pool.hits, pool.misses) == (1, 1)  # one element under the threshold: torch.empty, not the pool
    pool.close()


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 300 * KiB, 3 * MiB + 7])
def test_crc32_matches_zlib_across_pieces(size):
    data = bytearray(os.urandom(size + 4096))
    views = [memoryview(data)[:1000], memoryview(data)[1000:]]
    assert crc32(views, size) == zlib.crc32(bytes(data[:size]))
    assert crc32([memoryview(bytes(data))], size) == zlib.crc32(bytes(data[:size]))  # read-only view
    assert CRC32_IMPL == "zlib" or CRC32_IMPL.startswith("libdeflate (")


def test_the_deflate_packages_libdeflate_is_the_one_in_use():
    # A dependency, so it is there; if a release stopped exporting libdeflate's C API, checksums
    # would quietly fall back to a copy half as fast (or zlib's, a fifth): this says so instead.
    spec = importlib.util.find_spec("deflate._deflate")
    assert spec is not None and spec.origin
    assert CRC32_IMPL == f"libdeflate ({spec.origin})"


def test_mailbox_runs_posts_in_order_with_few_wakeups():
    loop = asyncio.new_event_loop()
    box = Mailbox(loop)
    seen: list[int] = []
    done = threading.Event()

    def poster() -> None:
        for i in range(500):
            box.post(seen.append, i)
        box.post(lambda: done.set())

    thread = threading.Thread(target=poster)
    thread.start()

    async def wait() -> None:
        while not done.is_set():
            await asyncio.sleep(0.001)

    loop.run_until_complete(wait())
    thread.join()
    loop.close()
    assert seen == list(range(500))
    box.post(seen.append, -1)  # the loop is closed: dropped, not raised


async def test_direct_blocks_do_not_wait_for_staging_slots(tmp_path):
    engine = IOEngine(block_size=64 * KiB, queue_depth=8, io_threads=4, checksum=True, staging_buffers=1)
    handle = open_file(str(tmp_path / "f"), direct=True)
    os.posix_fallocate(handle.fd, 0, 1 * MiB)
    src = AlignedBuffer(512 * KiB)
    src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
    try:
        def fill(at: int):
            return lambda v: v.__setitem__(slice(None), src.view[at : at + len(v)])

        direct = [BlockWrite(handle, o, 64 * KiB, source=[src.view[o : o + 64 * KiB]])
                  for o in range(0, 256 * KiB, 64 * KiB)]
        staged = [BlockWrite(handle, o, 64 * KiB, fill=fill(o)) for o in range(256 * KiB, 512 * KiB, 64 * KiB)]
        crcs = await asyncio.gather(engine.write(direct), engine.write(staged))
        await engine.fdatasync([handle])
        dst = AlignedBuffer(512 * KiB)
        reads = [BlockRead(handle, o, 64 * KiB, dest=[dst.view[o : o + 64 * KiB]], expected_crc=c)
                 for o, c in zip(range(0, 512 * KiB, 64 * KiB), crcs[0] + crcs[1])]
        await engine.read(reads)
        assert torch.equal(src.tensor[: 512 * KiB], dst.tensor[: 512 * KiB])
        assert engine.staging_buffers == 1
    finally:
        handle.close()
        engine.close()


async def test_many_concurrent_callers_on_two_loops_get_their_own_results(tmp_path):
    cfg = tiered.StoreConfig(path=str(tmp_path / "s"), host_bytes=0, block_size=64 * KiB)
    store = await tiered.TieredStore.open_async(cfg)
    try:
        values = {f"k{i}": torch.full((1000 + i,), float(i)) for i in range(64)}
        await asyncio.gather(*(store.put(k, v) for k, v in values.items()))

        def other_loop() -> list[bool]:
            async def run() -> list[bool]:
                got = await asyncio.gather(*(store.get(k) for k in values))
                return [torch.equal(g, values[k]) for g, k in zip(got, values)]
            return asyncio.run(run())

        other = await asyncio.get_running_loop().run_in_executor(None, other_loop)
        got = await asyncio.gather(*(store.get(k) for k in values))
        assert all(other) and all(torch.equal(g, values[k]) for g, k in zip(got, values))
        big = torch.randn(9 * MiB)  # 36 MiB: a pooled, page-aligned result
        await store.put("big", big)
        for _ in range(3):
            assert torch.equal(await store.get("big"), big)
    finally:
        await store.close()
