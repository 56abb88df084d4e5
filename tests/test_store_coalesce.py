"""Coalescing: small puts and gets in flight together reach the disk as one batch (backends/coalesce.py),
with each key's record, CRC, errors and cancellation its own."""

from __future__ import annotations

import asyncio

import torch

import tiered
from tiered.io import Syscalls

from conftest import KiB, MiB, random_tensor, same_bytes
from test_store_batch import _failing_file_writes, batch_config


async def test_concurrent_small_calls_share_syscalls_and_round_trip(tmp_path):
    items = {f"k{i}": random_tensor((3000 + 211 * i,), torch.uint8, seed=i) for i in range(48)}
    async with await tiered.TieredStore.open_async(batch_config(tmp_path / "s", swap_grow_bytes=16 * MiB)) as store:
        await store.put("warm-up", torch.ones(1), tier="nvme")
        before = store.stats()
        await asyncio.gather(*(store.put(k, t, tier="nvme") for k, t in items.items()))
        after = store.stats()
        # How many join one batch depends on where each put is when the flush runs (a dozen to all 48):
        # that they share batches, and fewer syscalls than puts, does not.
        assert store._nvme.writes.batches >= 1 and store._nvme.writes.batched >= 2
        assert after.write_requests - before.write_requests < 48
        got = await asyncio.gather(*(store.get(k) for k in items))
        assert all(same_bytes(items[k], g) for k, g in zip(items, got))
        assert store._nvme.reads.batched >= 2
        assert store.stats().read_requests - after.read_requests < 48
    # Every entry has its own record: a reopened store reads them alone.
    async with await tiered.TieredStore.open_async(batch_config(tmp_path / "s")) as store:
        for key, want in items.items():
            assert same_bytes(want, await store.get(key))


async def test_a_failed_block_fails_only_the_puts_in_it(tmp_path):
    cfg = batch_config(tmp_path / "s", nvme_paths=[str(tmp_path / "a"), str(tmp_path / "b")], block_size=64 * KiB)
    async with await tiered.TieredStore.open_async(cfg) as store:
        old = {f"k{i}": torch.full((20_000,), -1.0) for i in range(6)}
        for k, t in old.items():
            await store.put(k, t, tier="nvme")
        new = {f"k{i}": torch.full((20_000,), float(i)) for i in range(6)}  # 80 KB each: striped over a/ and b/
        real = store._io.syscalls
        store._io.syscalls = Syscalls(pwritev=_failing_file_writes(real.pwritev, store._nvme.files[2].handle.fd))
        try:
            results = await asyncio.gather(*(store.put(k, t, tier="nvme") for k, t in new.items()),
                                           return_exceptions=True)
        finally:
            store._io.syscalls = real
        assert store._nvme.writes.batches >= 1
        failed = [k for k, r in zip(new, results) if isinstance(r, BaseException)]
        assert failed and all(isinstance(r, tiered.TransferError) for r in results if r is not None)
        for key in new:
            assert torch.equal(await store.get(key), old[key] if key in failed else new[key]), key
        space = store.nvme_space()
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes


async def test_a_cancelled_put_leaves_the_others_and_the_store_whole(tmp_path):
    async with await tiered.TieredStore.open_async(batch_config(tmp_path / "s")) as store:
        await store.put("victim", torch.zeros(5000), tier="nvme")
        tasks = {k: asyncio.ensure_future(store.put(k, torch.full((5000,), float(i)), tier="nvme"))
                 for i, k in enumerate(["a", "victim", "b", "c"])}
        await asyncio.sleep(0)  # every put is queued or running
        tasks["victim"].cancel()
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        outcome = dict(zip(tasks, results))
        assert all(outcome[k] is None for k in "abc")
        for k in "abc":
            assert torch.equal(await store.get(k), torch.full((5000,), {"a": 0.0, "b": 2.0, "c": 3.0}[k]))
        victim = await store.get("victim")  # old or new, never torn
        assert torch.equal(victim, torch.zeros(5000)) or torch.equal(victim, torch.full((5000,), 1.0))
        await store.put("victim", torch.ones(5000), tier="nvme")  # the key is usable again
        assert torch.equal(await store.get("victim"), torch.ones(5000))
        space = store.nvme_space()
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes


def test_sync_facade_calls_from_threads_coalesce_too(tmp_path):
    import concurrent.futures

    store = tiered.TieredStore.open(batch_config(tmp_path / "s"))
    try:
        items = {f"t{i}": random_tensor((2048,), torch.float32, seed=i) for i in range(64)}
        futures = [store.sync.put_future(k, t, "nvme") for k, t in items.items()]
        concurrent.futures.wait(futures)
        assert all(f.exception() is None for f in futures)
        assert all(same_bytes(t, store.sync.get(k)) for k, t in items.items())
    finally:
        store.sync.close()


async def test_coalesce_bytes_zero_runs_every_transfer_alone(tmp_path):
    items = {f"k{i}": random_tensor((1000 + i,), torch.float32, seed=i) for i in range(16)}
    items["empty"] = torch.empty(0)
    async with await tiered.TieredStore.open_async(batch_config(tmp_path / "s", coalesce_bytes=0)) as store:
        await asyncio.gather(*(store.put(k, t, tier="nvme") for k, t in items.items()))
        got = await asyncio.gather(*(store.get(k) for k in items))
        assert all(same_bytes(items[k], g) for k, g in zip(items, got))
        assert store._nvme.writes.batches == store._nvme.reads.batches == 0
        assert store._nvme.writes.batched == store._nvme.reads.batched == 0


async def test_small_reads_queued_before_a_large_one_reach_the_disk_first(tmp_path):
    """Gets arriving together in need order (small ones, then a large one read alone): the small
    ones' batch is read before the large one, not after it, as a model's first bias or norm would
    otherwise wait for every large weight of the prefetch window. One I/O thread, so the reads run
    in the order they were handed to the I/O engine."""
    small = {f"s{i}": random_tensor((3000 + 7 * i,), torch.uint8, seed=i) for i in range(6)}
    large = random_tensor((3 * MiB,), torch.uint8, seed=99)  # over coalesce_bytes: read alone
    async with await tiered.TieredStore.open_async(batch_config(tmp_path / "s", io_threads=1)) as store:
        await store.put_many(small, tier="nvme")
        await store.put("large", large, tier="nvme")
        large_at = {(x.path, x.offset) for x in store.nvme_layout("large")}
        paths = {f.handle.fd: f.handle.path for f in store._nvme.files}
        reads: list[bool] = []  # each preadv, in order: whether it read the large entry
        real = store._io.syscalls

        def preadv(fd, buffers, offset):
            reads.append((paths[fd], offset) in large_at)
            return real.preadv(fd, buffers, offset)

        store._io.syscalls = Syscalls(preadv=preadv, pwritev=real.pwritev, fdatasync=real.fdatasync)
        try:
            got = await asyncio.gather(*(store.get(k) for k in small), store.get("large"))
        finally:
            store._io.syscalls = real
        assert all(same_bytes(want, g) for want, g in zip([*small.values(), large], got))
        assert store._nvme.reads.batched >= 2  # the small ones went together
        assert any(reads) and not reads[0], reads  # ... and before the large one
