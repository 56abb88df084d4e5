"""Moving copies between tiers: admission (evicting to make room), transfers up and down, and the
nvme write with its commit.

Every method runs on the store's loop. It works on versions, never on keys: what it makes for a
version that was retired meanwhile is discarded (see [Note: versions and copies] in
tiered.store.entry), and a transfer of a version that is held waits until it is not.

[Note: admission and eviction]
Space in a tier is taken only through ``admit``. A tensor larger than the tier's whole budget is
refused at once (CapacityError with the numbers). nvme evicts nothing: its allocation checks the
budget and the disk itself. In device or host memory, under that tier's lock, ``admit`` picks
victims in the policy's order (skipping pinned entries, copies being read or written down, and
versions in modify blocks) until the tensor fits. ``make_room`` drops a victim's copy outright
when a slower copy exists; otherwise it writes the entry one tier down first (host, or nvme when
the tensor is larger than the whole host budget), so eviction cascades device -> host -> nvme.

A holder of the device tier's lock may wait for the host tier's (a write-down into host admits
there), a holder of the host tier's never waits for the device tier's, and nvme has only its
allocation lock: the lock graph has no cycle. When no victim is left, ``admit`` waits only while
some of the bytes in use are not pinned: those are transient (copies allocated but not installed
yet, copies being read or written down, released copies waiting for their last reader), and
``Tiers.wake`` runs at every drop, install, discard, retire, end of a read and unpin. When every
byte in use is pinned (a copy lent to a modify block counts), it raises CapacityError rather than
wait for something that may never come.

[Note: promotion]
A get reads the fastest copy into its result and leaves the tiers as they are, so a one-off read
never evicts the working set. Copies move up only when the caller asks, by ``prefetch`` or ``pin``:
``materialize`` starts the transfer as a tracked task kept in ``entry.moving``, and a prefetch of
the same key into the same tier joins it. A get that finds a transfer into a faster tier in
flight waits for it and reads the copy it made; when it failed, the get reads the slower copy.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional, Sequence

import torch

from tiered.backends import Copy, DeviceBackend, NvmeBackend, NvmeCopy
from tiered.codecs import Codecs, CompressionPolicy
from tiered.errors import CapacityError, ChecksumError, TieredError, TransferError
from tiered.io.spans import Span
from tiered.manifest.commits import CommitLog
from tiered.stats import StoreStats
from tiered.store.entry import RAW, Entry
from tiered.store.error_messages import naming_key, read_error
from tiered.store.payload import Payload
from tiered.store.tiers import Tiers
from tiered.tier import Tier

# [Note: Kept copies]
# ``get(..., keep=tier)`` and ``put(..., keep=tier)`` offer the store a clean copy of what they just
# read or wrote, from the memory they already hold, so keeping it costs a copy and no I/O. The
# store keeps it when the tier has room, or when the eviction policy values it over the victim
# that would make room (``EvictionPolicy.keeps``: with the future access order, Belady's rule with
# bypass, so a copy used later than everything resident is dropped instead of evicting something
# used sooner); it never waits for room and never fails the call for it. A caller that reads and
# rewrites the same entries in a repeating order (a training step) thus keeps the ones it will
# read soonest in the faster tier across iterations.


class _NotKept(Exception):
    """An optional copy is not worth the room it would take (see [Note: Kept copies])."""


class Transfers:
    """Admission into tiers and every transfer of a version's bytes (store loop state: the
    versions' ``moving`` transfers)."""

    def __init__(self, tiers: Tiers, commits: CommitLog, codecs: Codecs, compression: CompressionPolicy,
                 stats: StoreStats, track: Callable[["asyncio.Task[Any]"], None]) -> None:
        self.tiers = tiers
        self.device: DeviceBackend = tiers.backends[Tier.DEVICE]  # type: ignore[assignment]
        self.nvme: NvmeBackend = tiers.backends[Tier.NVME]  # type: ignore[assignment]
        self.commits = commits
        self.codecs = codecs
        self.compression = compression
        self.stats = stats
        self._track = track

    # ------------------------------------------------------------------ admission and eviction

    async def admit(self, tier: Tier, nbytes: int, *, optional_for: Optional[str] = None) -> Copy:
        """Allocate ``nbytes`` in ``tier``, evicting victims (writing dirty ones down) as needed
        (see [Note: admission and eviction]).

        Waits while the only bytes that could be freed belong to transfers in flight; raises
        CapacityError when even evicting everything evictable could not make room. With
        ``optional_for`` (a copy of that key the store may skip), raises _NotKept instead of waiting
        or of evicting a victim the policy values more (see [Note: Kept copies]).
        """
        tiers = self.tiers
        backend = tiers.backends[tier]
        if tier is Tier.NVME:  # no eviction below nvme; allocate() checks the budget itself
            copy = await backend.allocate(nbytes)
            tiers.inflight[tier] += copy.footprint
            return copy
        backend.check_fits_budget(nbytes)
        async with tiers.locks[tier]:
            while not backend.has_room(nbytes):
                victim = tiers.pick_victim(tier)
                if optional_for is not None and (victim is None or not tiers.policy.keeps(optional_for, victim.key)):
                    raise _NotKept()
                if victim is not None:
                    await self.make_room(victim, tier)
                    continue
                pinned = tiers.pinned_bytes(tier)
                if backend.used > pinned:
                    await tiers.wait_for_change(tier)
                    continue
                raise CapacityError(
                    f"{tier.value} tier: {nbytes} bytes do not fit; {backend.used} of {backend.budget} bytes are "
                    f"in use and {pinned} of them are pinned or held by modify blocks; unpin entries, end the blocks "
                    "or raise the budget"
                )
            copy = await backend.allocate(nbytes)
            tiers.inflight[tier] += copy.footprint
            return copy

    async def make_room(self, entry: Entry, tier: Tier) -> None:
        """Remove ``entry``'s copy from ``tier``: a plain drop when a slower copy exists, else a write down."""
        self.stats.tiers[tier].evictions += 1
        if any(t.rank > tier.rank for t in entry.copies):
            self.tiers.drop_copy(entry, tier)
            return
        entry.leaving.add(tier)
        try:
            dest = Tier.NVME if tier is Tier.HOST else Tier.HOST
            host = self.tiers.backends[Tier.HOST]
            if dest is Tier.HOST and host.budget is not None and host.footprint(entry.nbytes) > host.budget:
                dest = Tier.NVME
            task = self.materialize(entry, dest)
            if task is not None:
                await asyncio.shield(task)
        finally:
            entry.leaving.discard(tier)
        if not entry.retired and tier in entry.copies:
            self.tiers.drop_copy(entry, tier)

    async def keep_copy(self, entry: Entry, tier: Tier, src: Sequence[Span]) -> None:
        """Give ``entry`` a clean copy in ``tier`` from ``src`` (its bytes, in memory) when the tier has
        room or the policy values it over what would go for it; else nothing ([Note: Kept copies])."""
        if tier in entry.copies or tier in entry.moving or entry.retired:
            return
        # The call this copy serves has succeeded already: a copy that cannot be made (no room, a
        # victim's write-down failing) is simply not kept.
        try:
            copy = await self.admit(tier, entry.nbytes, optional_for=entry.key)
        except (_NotKept, CapacityError, TransferError, OSError):
            return
        try:
            await self.store_memory(tier, copy, src)
        except Exception:
            self.tiers.discard(tier, copy)
            return
        except BaseException:
            self.tiers.discard(tier, copy)
            raise
        self.stats.tiers[tier].bytes_in += entry.nbytes
        self.tiers.install(entry, tier, copy)
        self.tiers.policy.touch(entry.key, access=False)

    # ------------------------------------------------------------------ moving copies between tiers

    def materialize(self, entry: Entry, tier: Tier) -> "Optional[asyncio.Task[None]]":
        """Start (or join) a transfer that gives ``entry`` a copy in ``tier``; None if it has one
        (see [Note: promotion])."""
        if tier in entry.copies:
            return None
        task = entry.moving.get(tier)
        if task is not None:
            return task
        task = asyncio.ensure_future(self._copy_to(entry, tier))
        entry.moving[tier] = task
        task.add_done_callback(lambda _: entry.moving.pop(tier, None))
        task.add_done_callback(_consume_exception)
        self._track(task)
        return task

    async def _copy_to(self, entry: Entry, tier: Tier) -> None:
        """Make a copy of ``entry`` in ``tier`` from its fastest existing copy, then install it."""
        while (held := entry.holder) is not None:  # [Note: holding a version] in tiered.store.versions
            await asyncio.wait([held])
        if entry.retired:
            return
        if tier is Tier.NVME:
            await self._write_down(entry)
            return
        new = await self.admit(tier, entry.nbytes)
        try:
            source = entry.top() if not entry.retired else None
            if source is None:
                self.tiers.discard(tier, new)
                return
            src_copy = self.tiers.begin_read(entry, source)
            dst = self.tiers.backends[tier].spans(new)
            try:
                await self.read_copy(entry, source, src_copy, dst, new.allocated)  # type: ignore[arg-type]
            finally:
                self.tiers.end_read(source, src_copy)
        except BaseException:
            self.tiers.discard(tier, new)
            raise
        self.stats.transfers += 1
        self.stats.tiers[tier].bytes_in += entry.nbytes
        self.tiers.install(entry, tier, new)
        self.tiers.policy.touch(entry.key, access=False)  # see [Note: what the policy sees] in tiered.policy

    async def _write_down(self, entry: Entry) -> None:
        """Give ``entry`` an nvme copy from its fastest copy, with its record committed."""
        source = entry.top()
        if source is None:
            return
        copy = self.tiers.begin_read(entry, source)
        try:
            written = await self.write_nvme(entry, self.memory_spans(source, copy))
        finally:
            self.tiers.end_read(source, copy)
        if written is None:
            return
        if not entry.retired:
            self.tiers.install(entry, Tier.NVME, written)
            return
        # Replaced or deleted while being written, after our record committed: the tombstone that
        # supersedes it is already submitted. Until it commits, our record still points at these
        # extents, so they must not be reused yet (see the tombstones of [Note: crash safety] in
        # tiered.store.versions).
        self.tiers.settle(Tier.NVME, written)
        await self.commits.barrier()
        if self.commits.committed_generation(entry.key) != entry.generation:
            self.nvme.release(written)  # else the tombstone failed: keep them
        self.tiers.wake(Tier.NVME)

    async def write_nvme(self, entry: Entry, src: Sequence[Span]) -> Optional[NvmeCopy]:
        """Write ``src`` (the entry's bytes) to new extents and commit a record for it (see
        [Note: crash safety] in tiered.store.versions).

        Returns the copy, or None when a newer version of the key committed first.
        """
        entry.persisted = True  # from now on a delete or put of this key must write a tombstone
        payload = await self.encode(entry, src)
        try:
            try:
                copy: NvmeCopy = await self.admit(Tier.NVME, payload.nbytes)  # type: ignore[assignment]
            except CapacityError as exc:
                raise naming_key(exc, "writing", entry.key) from exc
            try:
                started = time.perf_counter()
                await self.nvme.store(copy, payload.spans)
                self.compression.observe_write(payload.nbytes, time.perf_counter() - started)
            except BaseException as exc:
                self.tiers.discard(Tier.NVME, copy)
                if isinstance(exc, OSError):
                    raise naming_key(exc, "writing", entry.key) from exc
                raise
        finally:
            payload.close()
        try:
            applied = await self.commits.submit(entry.key, entry.generation, payload.record(entry, copy), copy)
        except BaseException as exc:
            self.tiers.discard(Tier.NVME, copy)
            if isinstance(exc, (OSError, TieredError)):
                raise naming_key(exc, "committing", entry.key) from exc
            raise
        if not applied:
            self.tiers.discard(Tier.NVME, copy)
            return None
        self._written(entry, payload)
        return copy

    async def write_nvme_many(
        self, entries: list[Entry], srcs: list[list[Span]], failures: dict[str, BaseException], *,
        atomic: bool = False,
    ) -> list[Optional[NvmeCopy]]:
        """:meth:`write_nvme` for new versions of distinct keys whose locks the caller holds: one
        allocation run, coalesced writes, one group commit. Returns each entry's committed copy, or
        None with its error in ``failures``. ``atomic``: nothing is committed unless every entry was
        written, and then every record in one transaction ([Note: Atomic batches] in tiered.store.batch)."""
        for entry in entries:
            entry.persisted = True
        payloads = await asyncio.gather(*(self.encode(e, s) for e, s in zip(entries, srcs)), return_exceptions=True)
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
                allocated = await self.nvme.allocate_many([p.nbytes for _, p in todo])
            except BaseException as exc:
                for entry, _ in todo:
                    failures[entry.key] = exc
                return [None] * len(entries)
            for i, copy in enumerate(allocated):
                self.tiers.inflight[Tier.NVME] += copy.footprint
                copies[i] = copy
            started = time.perf_counter()
            errors = await self.nvme.store_many(allocated, [p.spans for _, p in todo])
            self.compression.observe_write(sum(p.nbytes for _, p in todo), time.perf_counter() - started)
        finally:
            for _, payload in todo:
                payload.close()
        for i, ((entry, _), copy, error) in enumerate(zip(todo, allocated, errors)):
            if error is not None:
                self.tiers.discard(Tier.NVME, copy)
                copies[i] = None
                failures[entry.key] = naming_key(error, "writing", entry.key) if isinstance(error, OSError) else error
        if atomic and failures:
            for copy in copies:
                if copy is not None:
                    self.tiers.discard(Tier.NVME, copy)
            return [None] * len(entries)
        written = [i for i, copy in enumerate(copies) if copy is not None]
        # Submitted together, with no await between them: one batch of the commit log, one transaction.
        futures = self.commits.submit_many([
            (todo[i][0].key, todo[i][0].generation, todo[i][1].record(todo[i][0], copies[i]), copies[i])
            for i in written
        ])
        results = await asyncio.gather(*futures, return_exceptions=True)
        for i, applied in zip(written, results):
            entry, payload = todo[i]
            copy = copies[i]
            assert copy is not None
            if isinstance(applied, BaseException):
                self.tiers.discard(Tier.NVME, copy)
                copies[i] = None
                failures[entry.key] = (naming_key(applied, "committing", entry.key)
                                       if isinstance(applied, (OSError, TieredError)) else applied)
            else:
                assert applied, "put_many holds the key locks, so nothing newer can supersede it"
                self._written(entry, payload)
        by_entry = {id(e): c for (e, _), c in zip(todo, copies)}
        return [by_entry.get(id(e)) for e in entries]

    async def encode(self, entry: Entry, src: Sequence[Span]) -> Payload:
        """What goes to disk for ``entry``: its bytes, or their compressed form when that is wanted and pays
        (see [Note: compressed copies] in tiered.codecs)."""
        if not (entry.nbytes and self.compression.wants(entry.compress)):
            return Payload(src, entry.nbytes)
        host = await self._host_bytes(src, entry.nbytes)
        started = time.perf_counter()
        encoded = await self.codecs.encode(host, entry.dtype)
        elapsed = time.perf_counter() - started if encoded is not None else 0.0
        self.compression.observe_encode(entry.nbytes, encoded.nbytes if encoded else entry.nbytes, elapsed)
        if encoded is None:
            return Payload(src, entry.nbytes)
        return Payload(encoded.spans(), encoded.nbytes, encoded.codec, encoded.meta, encoded)

    def _written(self, entry: Entry, payload: Payload) -> None:
        """Bookkeeping once an entry's nvme record committed."""
        entry.codec, entry.codec_meta, entry.stored_nbytes = payload.codec, payload.meta, payload.nbytes
        self.stats.bytes_before_codec += entry.nbytes
        self.stats.bytes_after_codec += payload.nbytes
        self.stats.tiers[Tier.NVME].bytes_in += entry.nbytes

    # ------------------------------------------------------------------ reading and writing bytes

    async def read_copy(self, entry: Entry, tier: Tier, copy: Copy, dst: Sequence[Span], allocated: Any = None
                        ) -> None:
        """Fill ``dst`` with the entry's bytes from its copy in ``tier``; ``allocated`` is the
        :func:`allocation_event` of ``dst`` when the store just allocated it on CUDA."""
        if tier is not Tier.NVME:
            await self.device.copy(dst, self.memory_spans(tier, copy), after=(allocated,))
            return
        try:
            started = time.perf_counter()
            if entry.codec == RAW:
                await self.nvme.load(copy, dst)  # type: ignore[arg-type]
                self.compression.observe_read(copy.nbytes, time.perf_counter() - started)
                return
            buf = self.codecs.buffer(max(copy.nbytes, 1))
            try:
                await self.nvme.load(copy, [Span(buf.tensor[: copy.nbytes], buf.view)])  # type: ignore[arg-type]
                loaded = time.perf_counter()
                self.compression.observe_read(copy.nbytes, loaded - started)
                await self.codecs.decode(entry.codec, buf.view[: copy.nbytes], entry.codec_meta, dst)
                self.compression.observe_decode(entry.nbytes, time.perf_counter() - loaded)
            finally:
                self.codecs.release(buf)
        except (ChecksumError, TransferError) as exc:
            raise read_error(exc, entry.key) from exc

    async def store_memory(self, tier: Tier, copy: Copy, src: Sequence[Span]) -> None:
        """Copy ``src`` into a memory tier's copy."""
        await self.device.copy(self.tiers.backends[tier].spans(copy), src,  # type: ignore[arg-type]
                               after=(copy.allocated,))

    def memory_spans(self, tier: Tier, copy: Copy) -> list[Span]:
        spans = self.tiers.backends[tier].spans(copy)
        assert spans is not None, "memory_spans of an nvme copy"
        return spans

    async def _host_bytes(self, src: Sequence[Span], nbytes: int) -> torch.Tensor:
        """The bytes of ``src`` as one contiguous CPU uint8 tensor (copying only when needed)."""
        if len(src) == 1 and src[0].tensor.device.type == "cpu":
            return src[0].tensor
        out = torch.empty(nbytes, dtype=torch.uint8)
        await self.device.copy([Span(out)], src)
        return out


def _consume_exception(task: "asyncio.Task[Any]") -> None:
    # Transfers started by prefetch may fail with nobody awaiting them; their error reaches the
    # next waiter (or a get falls back to the slower copy). Mark it retrieved to keep logs clean.
    if not task.cancelled():
        task.exception()
