"""put_many / get_many on the store's loop: many keys per call, with one allocation run, coalesced
syscalls and one group commit. The facade (tiered.store.tiered_store) checks their arguments.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Optional, Sequence

import torch

from tiered.backends.device import allocation_event
from tiered.io.spans import Span, new_result, spans_of_tensor
from tiered.store.entry import RAW, Entry
from tiered.store.error_messages import batch_error, read_error
from tiered.store.operations import Operations
from tiered.store.validation import check_keep, check_out, dense_copy, parse_device, plain
from tiered.tier import Tier

# [Note: Atomic batches]
# ``put_many(..., atomic=True)`` writes every entry's bytes to new extents first, as any put does.
# Only when every one of them is on disk are the records submitted, all at once with no await
# between them, so the commit log takes them into one batch: one fdatasync round and one SQLite
# transaction that replaces every old record (CommitLog.submit_many). A failure before that point
# frees the new extents and commits nothing; a failed transaction rolls back as a whole; a crash
# before the transaction commits leaves the old records, and the new extents are free space at the
# next open. The key locks are held throughout, so no other put or delete of these keys can slip
# in between. Memory tiers have no transaction to lean on, so the mode is nvme's alone.


class Batches:
    """put_many and get_many (store loop side)."""

    def __init__(self, operations: Operations) -> None:
        self.ops = operations
        self.versions = operations.versions
        self.transfers = operations.transfers
        self.tiers = operations.tiers
        self.stats = operations.stats

    async def put_many(
        self, pairs: list[tuple[str, torch.Tensor]], tier: "Tier | str", compress: list[Optional[bool]],
        ready: list[Any], atomic: bool = False, keep: "Tier | str | None" = None,
    ) -> None:
        kept = check_keep(keep, tier)
        tier = Tier.parse(tier)
        ops = self.ops
        await ops.wait_for_callers(ready)
        datas = [plain(t) for _, t in pairs]
        odd = [i for i, d in enumerate(datas) if d is None]
        if odd:  # one trip to the cpu pool for every tensor that needs a dense copy
            dense = await ops.in_cpu_pool(lambda: [dense_copy(pairs[i][1]) for i in odd])
            for i, d in zip(odd, dense):
                datas[i] = d
        keys = [k for k, _ in pairs]
        failures: dict[str, BaseException] = {}
        locks = self.versions.locks
        locked = await locks.acquire_all(keys)
        try:
            if tier is Tier.NVME:
                await self._put_many_nvme(keys, datas, compress, failures, atomic, kept)  # type: ignore[arg-type]
            else:
                results = await asyncio.gather(
                    *(ops.put_locked(k, d, tier, c, kept)  # type: ignore[arg-type]
                      for k, d, c in zip(keys, datas, compress)),
                    return_exceptions=True,
                )
                for k, r in zip(keys, results):
                    if isinstance(r, BaseException):
                        failures[k] = r
        finally:
            locks.release_all(locked)
        if failures:
            raise batch_error("put_many(atomic=True) stored nothing" if atomic else "put_many", failures, len(keys))

    async def _put_many_nvme(
        self, keys: list[str], datas: list[torch.Tensor], compress: list[Optional[bool]],
        failures: dict[str, BaseException], atomic: bool = False, keep: Optional[Tier] = None,
    ) -> None:
        """Write every key's tensor in one allocation run, few syscalls and one group commit, then install
        the ones that committed. What failed is added to ``failures``; those keys keep their old value
        (with ``atomic``, every key does when anything failed)."""
        versions = self.versions
        entries = [Entry(k, d.dtype, tuple(d.shape), d.numel() * d.element_size(), versions.next_generation(),
                         compress=c) for k, d, c in zip(keys, datas, compress)]
        started = time.perf_counter()
        written = await self.transfers.write_nvme_many(entries, [spans_of_tensor(d) for d in datas], failures,
                                                       atomic=atomic)
        self.stats.io_wait_seconds += time.perf_counter() - started
        for entry, copy in zip(entries, written):
            if copy is not None:
                await versions.replace(entry, Tier.NVME, copy)  # never waits: the new version is on nvme
        if keep is not None:
            for entry, copy, data in zip(entries, written, datas):
                if copy is not None:
                    await self.transfers.keep_copy(entry, keep, spans_of_tensor(data))

    async def get_many(
        self, keys: list[str], device: "torch.device | str", outs: Optional[list[Optional[torch.Tensor]]],
        ready: Sequence[Any] = (),
    ) -> list[torch.Tensor]:
        device = parse_device(device)
        await self.ops.wait_for_callers(ready)
        versions, tiers, transfers = self.versions, self.tiers, self.transfers
        entries = versions.entries_of(keys)
        faster = {task for e in entries if e.moving
                  for t, task in e.moving.items() if (top := e.top()) is None or t.rank < top.rank}
        if faster:
            await asyncio.wait(faster)  # a failed prefetch only means we read the slower copy
            entries = [versions.current(e, k) for e, k in zip(entries, keys)]
        # Last, as nothing awaits between this and taking the readers: versions in modify blocks.
        while editing := [held for e in entries if (held := e.changing) is not None]:
            await asyncio.wait(editing)
            entries = [versions.current(e, k) for e, k in zip(entries, keys)]
        results: list[torch.Tensor] = []
        dsts: list[list[Span]] = []
        last_new: Optional[torch.Tensor] = None
        for i, entry in enumerate(entries):
            out = outs[i] if outs is not None else None
            if out is None:
                result, dst = new_result(entry.shape, entry.dtype, device, self.ops.results)
                last_new = result
            else:
                check_out(out, entry)
                result, dst = out, spans_of_tensor(out)
            results.append(result)
            dsts.append(dst)
        allocated = allocation_event(last_new) if last_new is not None else None  # covers every new result
        top = [e.top() for e in entries]
        copies = [tiers.begin_read(e, t) for e, t in zip(entries, top)]  # type: ignore[arg-type]
        batch = [i for i, (e, t) in enumerate(zip(entries, top)) if t is Tier.NVME and e.codec == RAW]
        batched = set(batch)
        alone = [i for i in range(len(entries)) if i not in batched]
        errors: list[Optional[BaseException]] = [None] * len(entries)
        started = time.perf_counter()
        try:
            coros: list[Awaitable[Any]] = [transfers.read_copy(entries[i], top[i], copies[i], dsts[i], allocated)
                                           for i in alone]  # type: ignore[arg-type]
            if batch:
                coros.append(transfers.nvme.load_many([copies[i] for i in batch],  # type: ignore[misc]
                                                      [dsts[i] for i in batch]))
            outcomes = await asyncio.gather(*coros, return_exceptions=True)
        finally:
            for t, c in zip(top, copies):
                tiers.end_read(t, c)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - started
        for i, outcome in zip(alone, outcomes):
            if isinstance(outcome, BaseException):
                errors[i] = outcome
        if batch:
            loaded = outcomes[-1]
            for j, i in enumerate(batch):
                error = loaded if isinstance(loaded, BaseException) else loaded[j]
                errors[i] = read_error(error, entries[i].key) if error is not None else None
            transfers.compression.observe_read(sum(copies[i].nbytes for i in batch), elapsed)
        if any(t is Tier.NVME for t in top):
            self.stats.io_wait_seconds += elapsed
        failures = {}
        for entry, tier, error in zip(entries, top, errors):
            if error is None:
                self.ops.count_get(entry, tier)  # type: ignore[arg-type]
            else:
                failures[entry.key] = error
        if failures:
            raise batch_error("get_many", failures, len(keys))
        return results
