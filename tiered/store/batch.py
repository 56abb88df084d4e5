"""put_many / get_many: many keys per call, with one allocation run, coalesced syscalls and one group commit.

A mixin of TieredStore: its methods run on the store's state, and the private ones on its loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Iterable, Mapping, Optional, Sequence

import torch

from tiered.backends import NvmeCopy
from tiered.backends.device import allocation_event
from tiered.store.entry import RAW, Entry
from tiered.errors import KeyNotFoundError, TieredError
from tiered.io.spans import Span, new_result, spans_of_tensor
from tiered.store.error_messages import batch_error, naming_key, read_error
from tiered.store.validation import (
    batch_compress,
    batch_items,
    batch_keys,
    check_atomic,
    check_keep,
    check_out,
    dense_copy,
    parse_device,
    plain,
    ready_event,
)
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


class BatchCalls:
    """The batched calls of :class:`~tiered.TieredStore` (mixed into it)."""

    async def put_many(
        self, items: "Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]", tier: "Tier | str" = Tier.NVME,
        compress: "Optional[bool] | Mapping[str, Optional[bool]]" = None, *, atomic: bool = False,
        keep: "Tier | str | None" = None,
    ) -> None:
        """:meth:`put` of many tensors as one operation: ``items`` maps keys to tensors, or lists (key, tensor) pairs.

        To nvme, the tensors are written into one run of swap-file extents with few vectored syscalls
        and committed by one group commit (one fdatasync round, one manifest transaction), so each
        costs a fraction of a put; every key is durable when this returns. Each entry keeps its own
        CRCs, generation and record, exactly as a put would write it. ``compress`` applies to every
        entry, or maps keys to their own setting (a key it leaves out: None).

        Bad input (a non-string key, a non-tensor, the same key twice: ValueError; a ``compress``
        mapping naming a key not in ``items``: ValueError) is refused before anything is stored.
        Otherwise, by default, the call is not all-or-nothing: when some entries fail (a full tier,
        an I/O error), the others are still stored, and the call then raises an error of the first
        failure's type whose message names every failed key. Whatever happens, including a crash,
        each key holds either its old or its new value, never a mix of the two: a named key is left
        as a failed :meth:`put` of it would leave it, every other key holds its new value.

        ``atomic=True`` (nvme only; another tier is a ValueError) makes the batch all-or-nothing:
        no entry is committed unless every one was written, and all records commit in one manifest
        transaction. When any entry fails, every key keeps its old value and the error names the
        failed keys; after a crash at any moment, either every key holds its new value or every key
        holds its old one ([Note: Atomic batches]).

        ``keep`` as for :meth:`put`: each entry written may also keep a clean copy in that faster tier
        ([Note: Kept copies]).
        """
        pairs = batch_items(items)
        compresses = batch_compress(compress, pairs)
        check_atomic(atomic, tier)
        check_keep(keep, tier)
        return await self._call(self._put_many, pairs, tier, compresses, [ready_event(t) for _, t in pairs], atomic,
                                keep)

    async def get_many(
        self, keys: Sequence[str], device: "torch.device | str" = "cpu", *,
        out: Optional[Sequence[Optional[torch.Tensor]]] = None,
    ) -> list[torch.Tensor]:
        """:meth:`get` of many keys as one operation; the results come in the order of ``keys``.

        ``out``, when given, has one entry per key: a tensor to read that key into (as ``get(out=)``)
        or None. Entries on nvme whose extents lie back to back (as :meth:`put_many` writes them) are
        read with one syscall per ``block_size`` of them, each entry still checked against its CRCs.
        Missing keys raise KeyNotFoundError naming them, and repeated keys ValueError, before anything
        is read. When reading some entries fails (corrupt bytes, an I/O error), the others are still
        read; the call then raises an error of the first failure's type naming every failed key and
        returns nothing (the ``out`` tensors of failed keys hold unspecified bytes).
        """
        keys, outs = batch_keys(keys, out)
        return await self._call(self._get_many, keys, device, outs, [ready_event(o) for o in outs or ()])

    async def _put_many(
        self, pairs: list[tuple[str, torch.Tensor]], tier: "Tier | str", compress: list[Optional[bool]],
        ready: list[Any], atomic: bool = False, keep: "Tier | str | None" = None,
    ) -> None:
        kept = check_keep(keep, tier)
        tier = Tier.parse(tier)
        await self._wait_for_callers(ready)
        datas = [plain(t) for _, t in pairs]
        odd = [i for i, d in enumerate(datas) if d is None]
        if odd:  # one trip to the cpu pool for every tensor that needs a dense copy
            dense = await self._in_cpu_pool(lambda: [dense_copy(pairs[i][1]) for i in odd])
            for i, d in zip(odd, dense):
                datas[i] = d
        keys = [k for k, _ in pairs]
        failures: dict[str, BaseException] = {}
        locked = await self._key_locks.acquire_all(keys)
        try:
            if tier is Tier.NVME:
                await self._put_many_nvme(keys, datas, compress, failures, atomic, kept)  # type: ignore[arg-type]
            else:
                results = await asyncio.gather(
                    *(self._put_locked(k, d, tier, c, kept)  # type: ignore[arg-type]
                      for k, d, c in zip(keys, datas, compress)),
                    return_exceptions=True,
                )
                for k, r in zip(keys, results):
                    if isinstance(r, BaseException):
                        failures[k] = r
        finally:
            self._key_locks.release_all(locked)
        if failures:
            raise batch_error("put_many(atomic=True) stored nothing" if atomic else "put_many", failures, len(keys))

    async def _put_many_nvme(
        self, keys: list[str], datas: list[torch.Tensor], compress: list[Optional[bool]],
        failures: dict[str, BaseException], atomic: bool = False, keep: Optional[Tier] = None,
    ) -> None:
        """Write every key's tensor in one allocation run, few syscalls and one group commit, then install
        the ones that committed. What failed is added to ``failures``; those keys keep their old value
        (with ``atomic``, every key does when anything failed)."""
        entries = [Entry(k, d.dtype, tuple(d.shape), d.numel() * d.element_size(), next(self._generation),
                         compress=c) for k, d, c in zip(keys, datas, compress)]
        started = time.perf_counter()
        written = await self._write_nvme_many(entries, [spans_of_tensor(d) for d in datas], failures, atomic=atomic)
        self._stats.io_wait_seconds += time.perf_counter() - started
        for entry, copy in zip(entries, written):
            if copy is not None:
                await self._finish_put(entry, Tier.NVME, copy)  # never waits: the new version is on nvme
        if keep is not None:
            for entry, copy, data in zip(entries, written, datas):
                if copy is not None:
                    await self._keep_copy(entry, keep, spans_of_tensor(data))

    async def _get_many(
        self, keys: list[str], device: "torch.device | str", outs: Optional[list[Optional[torch.Tensor]]],
        ready: Sequence[Any] = (),
    ) -> list[torch.Tensor]:
        device = parse_device(device)
        await self._wait_for_callers(ready)
        entries = self._entries_of(keys)
        faster = {task for e in entries if e.moving
                  for t, task in e.moving.items() if (top := e.top()) is None or t.rank < top.rank}
        if faster:
            await asyncio.wait(faster)  # a failed prefetch only means we read the slower copy
            entries = self._entries_of(keys)
        # Last, as nothing awaits between this and taking the readers: versions in modify blocks.
        while editing := [e.editing for e in entries if e.editing is not None]:
            await asyncio.wait(editing)
            entries = self._entries_of(keys)
        results: list[torch.Tensor] = []
        dsts: list[list[Span]] = []
        last_new: Optional[torch.Tensor] = None
        for i, entry in enumerate(entries):
            out = outs[i] if outs is not None else None
            if out is None:
                result, dst = new_result(entry.shape, entry.dtype, device, self._results)
                last_new = result
            else:
                check_out(out, entry)
                result, dst = out, spans_of_tensor(out)
            results.append(result)
            dsts.append(dst)
        allocated = allocation_event(last_new) if last_new is not None else None  # covers every new result
        tiers = [e.top() for e in entries]
        copies = [self._begin_read(e, t) for e, t in zip(entries, tiers)]  # type: ignore[arg-type]
        batch = [i for i, (e, t) in enumerate(zip(entries, tiers)) if t is Tier.NVME and e.codec == RAW]
        batched = set(batch)
        alone = [i for i in range(len(entries)) if i not in batched]
        errors: list[Optional[BaseException]] = [None] * len(entries)
        started = time.perf_counter()
        try:
            coros: list[Awaitable[Any]] = [self._read_copy(entries[i], tiers[i], copies[i], dsts[i], allocated)
                                           for i in alone]
            if batch:
                coros.append(self._nvme.load_many([copies[i] for i in batch], [dsts[i] for i in batch]))  # type: ignore[misc]
            outcomes = await asyncio.gather(*coros, return_exceptions=True)
        finally:
            for t, c in zip(tiers, copies):
                self._end_read(t, c)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - started
        for i, outcome in zip(alone, outcomes):
            if isinstance(outcome, BaseException):
                errors[i] = outcome
        if batch:
            loaded = outcomes[-1]
            for j, i in enumerate(batch):
                error = loaded if isinstance(loaded, BaseException) else loaded[j]
                errors[i] = read_error(error, entries[i].key) if error is not None else None
            self._compression.observe_read(sum(copies[i].nbytes for i in batch), elapsed)
        if any(t is Tier.NVME for t in tiers):
            self._stats.io_wait_seconds += elapsed
        failures = {}
        for entry, tier, error in zip(entries, tiers, errors):
            if error is None:
                self._count_get(entry, tier)  # type: ignore[arg-type]
            else:
                failures[entry.key] = error
        if failures:
            raise batch_error("get_many", failures, len(keys))
        return results

    def _entries_of(self, keys: Sequence[str]) -> list[Entry]:
        """The current entries of ``keys``; KeyNotFoundError naming every missing key."""
        entries = [self._entries.get(k) for k in keys]
        missing = [k for k, e in zip(keys, entries) if e is None]
        if missing:
            raise KeyNotFoundError(f"{len(missing)} of {len(keys)} keys are not in the store: {missing!r}")
        return entries  # type: ignore[return-value]

    async def _write_nvme_many(
        self, entries: list[Entry], srcs: list[list[Span]], failures: dict[str, BaseException], *,
        atomic: bool = False,
    ) -> list[Optional[NvmeCopy]]:
        """:meth:`_write_nvme` for new versions of distinct keys whose locks the caller holds: one
        allocation run, coalesced writes, one group commit. Returns each entry's committed copy, or
        None with its error in ``failures``. ``atomic``: nothing is committed unless every entry was
        written, and then every record in one transaction ([Note: Atomic batches])."""
        for entry in entries:
            entry.persisted = True
        payloads = await asyncio.gather(*(self._encode(e, s) for e, s in zip(entries, srcs)), return_exceptions=True)
        todo = []
        for entry, payload in zip(entries, payloads):
            if isinstance(payload, BaseException):
                failures[entry.key] = payload
            else:
                todo.append((entry, payload))
        if atomic and failures:
            for _, payload in todo:
                payload.close()
            return [None] * len(entries)
        copies: list[Optional[NvmeCopy]] = [None] * len(todo)
        try:
            try:
                allocated = await self._nvme.allocate_many([p.nbytes for _, p in todo])
            except BaseException as exc:
                for entry, _ in todo:
                    failures[entry.key] = exc
                return [None] * len(entries)
            for i, copy in enumerate(allocated):
                self._inflight[Tier.NVME] += copy.footprint
                copies[i] = copy
            started = time.perf_counter()
            errors = await self._nvme.store_many(allocated, [p.spans for _, p in todo])
            self._compression.observe_write(sum(p.nbytes for _, p in todo), time.perf_counter() - started)
        finally:
            for _, payload in todo:
                payload.close()
        for i, ((entry, _), copy, error) in enumerate(zip(todo, allocated, errors)):
            if error is not None:
                self._discard(Tier.NVME, copy)
                copies[i] = None
                failures[entry.key] = naming_key(error, "writing", entry.key) if isinstance(error, OSError) else error
        if atomic and failures:
            for copy in copies:
                if copy is not None:
                    self._discard(Tier.NVME, copy)
            return [None] * len(entries)
        written = [i for i, copy in enumerate(copies) if copy is not None]
        # Submitted together, with no await between them: one batch of the commit log, one transaction.
        futures = self._commits.submit_many([
            (todo[i][0].key, todo[i][0].generation, todo[i][1].record(todo[i][0], copies[i]), copies[i])
            for i in written
        ])
        results = await asyncio.gather(*futures, return_exceptions=True)
        for i, applied in zip(written, results):
            entry, payload = todo[i]
            copy = copies[i]
            assert copy is not None
            if isinstance(applied, BaseException):
                self._discard(Tier.NVME, copy)
                copies[i] = None
                failures[entry.key] = (naming_key(applied, "committing", entry.key)
                                       if isinstance(applied, (OSError, TieredError)) else applied)
            else:
                assert applied, "put_many holds the key locks, so nothing newer can supersede it"
                self._written(entry, payload)
        by_entry = {id(e): c for (e, _), c in zip(todo, copies)}
        return [by_entry.get(id(e)) for e in entries]
