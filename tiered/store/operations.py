"""The single-key operations of the store, as they run on its loop: put, get, prefetch, evict,
delete, pin, unpin and flush.

The facade (tiered.store.tiered_store) checks a call's arguments and brings it here; these
coroutines compose the parts below them: versions (which version a key holds), tiers (the copies)
and transfers (moving bytes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from tiered.backends import Copy
from tiered.backends.device import allocation_event
from tiered.io import ResultPool
from tiered.io.spans import new_result, spans_of_tensor
from tiered.stats import StoreStats
from tiered.store.entry import Entry
from tiered.store.transfers import Transfers
from tiered.store.validation import (
    check_compress,
    check_keep,
    check_key,
    check_out,
    check_tensor,
    dense_copy,
    parse_device,
    plain,
)
from tiered.store.versions import Versions
from tiered.tier import TIERS_TOP_DOWN, Tier

T = TypeVar("T")


class Operations:
    """put, get, prefetch, evict, delete, pin, unpin and flush on the store's loop."""

    def __init__(self, versions: Versions, transfers: Transfers, results: ResultPool,
                 cpu_pool: concurrent.futures.Executor, stats: StoreStats) -> None:
        self.versions = versions
        self.transfers = transfers
        self.tiers = transfers.tiers
        self.results = results
        self.cpu_pool = cpu_pool
        self.stats = stats

    # ------------------------------------------------------------------ put

    async def put(
        self, key: str, tensor: torch.Tensor, tier: "Tier | str", compress: Optional[bool], ready: Any = None,
        keep: "Tier | str | None" = None,
    ) -> None:
        check_key(key)
        check_tensor(tensor)
        await self.wait_for_callers((ready,))
        tier = Tier.parse(tier)
        check_compress(compress)
        data = plain(tensor)
        if data is None:
            data = await self.in_cpu_pool(dense_copy, tensor)
        kept = check_keep(keep, tier)
        locks = self.versions.locks
        await locks.acquire(key)
        try:
            await self.put_locked(key, data, tier, compress, kept)
        finally:
            locks.release(key)

    async def put_locked(self, key: str, data: torch.Tensor, tier: Tier, compress: Optional[bool],
                         keep: Optional[Tier] = None) -> None:
        """The put of one key whose lock the caller holds; ``data`` is contiguous. ``keep``: see
        [Note: Kept copies] in tiered.store.transfers."""
        entry = Entry(key, data.dtype, tuple(data.shape), data.numel() * data.element_size(),
                      self.versions.next_generation(), compress=compress)
        src = spans_of_tensor(data)
        copy: Optional[Copy]
        if tier is Tier.NVME:
            started = time.perf_counter()
            copy = await self.transfers.write_nvme(entry, src)
            assert copy is not None, "a put holds the key lock, so nothing newer can supersede it"
            self.stats.io_wait_seconds += time.perf_counter() - started
        else:
            copy = await self.transfers.admit(tier, entry.nbytes)
            try:
                await self.transfers.store_memory(tier, copy, src)
            except BaseException:
                self.tiers.discard(tier, copy)
                raise
        await self.versions.replace(entry, tier, copy)
        if keep is not None:
            await self.transfers.keep_copy(entry, keep, src)

    # ------------------------------------------------------------------ get

    async def get(self, key: str, device: "torch.device | str", out: Optional[torch.Tensor], ready: Any = None,
                  keep: "Tier | str | None" = None) -> torch.Tensor:
        check_key(key)
        await self.wait_for_callers((ready,))
        device = parse_device(device)
        versions = self.versions
        entry = versions.entry(key)
        if entry.moving:
            top = entry.top()
            faster = [task for t, task in entry.moving.items() if top is None or t.rank < top.rank]
            if faster:
                await asyncio.wait(faster)  # a failed prefetch only means we read the slower copy
            entry = versions.current(entry, key)
        if entry.changing is not None:  # last: nothing awaits between this and taking the reader
            entry = await versions.unedited(entry, key)
        allocated = None
        if out is None:
            result, dst = new_result(entry.shape, entry.dtype, device, self.results)
            allocated = allocation_event(result)  # see [Note: CUDA stream order] in tiered.backends.device
        else:
            check_out(out, entry)
            result, dst = out, spans_of_tensor(out)
        tier = entry.top()
        assert tier is not None, "a current version always has a copy"
        copy = self.tiers.begin_read(entry, tier)
        started = time.perf_counter()
        try:
            await self.transfers.read_copy(entry, tier, copy, dst, allocated)
        finally:
            self.tiers.end_read(tier, copy)
        if tier is Tier.NVME:
            self.stats.io_wait_seconds += time.perf_counter() - started
        self.count_get(entry, tier)
        kept = check_keep(keep)
        if kept is not None and kept.rank < tier.rank:
            await self.transfers.keep_copy(entry, kept, dst)
        return result

    def count_get(self, entry: Entry, tier: Tier) -> None:
        stats = self.stats
        stats.gets += 1
        stats.tiers[tier].hits += 1
        stats.tiers[tier].bytes_out += entry.nbytes
        for above in TIERS_TOP_DOWN[: tier.rank]:
            stats.tiers[above].misses += 1
        self.tiers.policy.touch(entry.key)

    # ------------------------------------------------------------------ moving copies on request

    async def prefetch(self, key: str, tier: "Tier | str") -> None:
        tier = Tier.parse(tier)
        entry = self.versions.entry(key)
        self.stats.prefetches += 1
        if tier in entry.moving:
            self.stats.prefetches_coalesced += 1
        task = self.transfers.materialize(entry, tier)
        if task is not None:
            await asyncio.shield(task)

    async def evict(self, key: str, tier: "Tier | str") -> None:
        check_key(key)
        tier = Tier.parse(tier)
        entry = self.versions.entry(key)
        if entry.pinned:
            raise ValueError(f"key {key!r} is pinned; unpin it before evicting it")
        if not any(t.rank >= tier.rank for t in entry.copies):
            task = self.transfers.materialize(entry, tier)
            if task is not None:
                await asyncio.shield(task)
        if entry.retired:
            return
        for above in TIERS_TOP_DOWN[: tier.rank]:
            if above in entry.copies and any(t.rank > above.rank for t in entry.copies):
                self.tiers.drop_copy(entry, above)
                self.stats.tiers[above].evictions += 1

    async def pin(self, key: str, tier: "Tier | str | None") -> None:
        entry = self.versions.entry(key)
        if tier is not None:
            task = self.transfers.materialize(entry, Tier.parse(tier))
            if task is not None:
                await asyncio.shield(task)
            entry = self.versions.current(entry, key)
        entry.pinned = True

    async def unpin(self, key: str) -> None:
        self.versions.entry(key).pinned = False
        self.tiers.wake_all()

    async def flush(self, keys: Optional[list[str]] = None) -> None:
        failures = await self.write_down(keys)
        if failures:
            raise next(iter(failures.values()))[1]

    async def write_down(self, keys: Optional[list[str]] = None) -> dict[str, tuple[int, BaseException]]:
        """Write every dirty entry (of ``keys``, when given) down to nvme, as many as fit; return
        those that failed (key -> bytes, error), in no particular order."""
        versions = self.versions
        entries = list(versions.entries.values()) if keys is None else versions.entries_of(keys)
        dirty = [e for e in entries if e.dirty]
        tasks = [(e, self.transfers.materialize(e, Tier.NVME)) for e in dirty]
        pending = [(e, t) for e, t in tasks if t is not None]
        if not pending:
            return {}
        results = await asyncio.gather(*(asyncio.shield(t) for _, t in pending), return_exceptions=True)
        return {e.key: (e.nbytes, r) for (e, _), r in zip(pending, results) if isinstance(r, BaseException)}

    # ------------------------------------------------------------------ delete

    async def delete(self, key: str) -> None:
        check_key(key)
        locks = self.versions.locks
        await locks.acquire(key)
        try:
            await self.versions.remove(key)
        finally:
            locks.release(key)

    # ------------------------------------------------------------------ helpers

    async def in_cpu_pool(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn, *args)

    async def wait_for_callers(self, events: Sequence[Any]) -> None:
        """Wait, in one trip to the cpu pool, for the caller-stream events a put or a get into ``out``
        captured (:func:`ready_event`; None entries are skipped): the kernels the caller queued on
        those tensors have finished. See [Note: CUDA stream order] in tiered.backends.device."""
        pending = [e for e in events if e is not None]
        if pending:
            await self.in_cpu_pool(lambda: [e.synchronize() for e in pending])
