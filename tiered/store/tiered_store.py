"""TieredStore: keys -> tensors over device memory, host buffers and nvme swap files.

[Note: one loop owns the state]
Every piece of store state (entries, the resident sets, allocators, the policy, the commit log,
stats) is read and changed only on the store's own asyncio loop, which runs on a thread of its
own (``LoopThread``, named ``tiered-store:<dir>``). So no lock guards store state and the hot path
takes none; the few thread locks there are guard what worker threads share (I/O counters,
mailboxes, buffer pools). Asyncio locks order the work on the loop: one per tier for admission
(see [Note: admission and eviction] in tiered.store.tiers), one around nvme allocation, and the
key locks (see [Note: key locks]). Blocking work runs in three pools, never on the loop:
``io_threads`` (``IOEngine``: preadv/pwritev, fdatasync, fallocate, the CRCs of the blocks they
move), ``cpu_threads`` (memory and CUDA copies, CUDA event waits, dense copies of caller tensors,
codecs) and one manifest thread, so SQLite is used from one thread only (it also opens the
store's files at open). The loop itself does bookkeeping and a few short syscalls: opening the
swap files at open, ``statvfs`` before a swap file grows, mapping a get result or a codec buffer
the pools have none of. ``keys()``, ``in``, ``len()``, ``info()``, ``stats()``, ``nvme_space()`` and
``nvme_layout()`` read the loop's state from the caller's thread without a round trip, so they
return snapshots that may be a moment stale.

[Note: calls from any thread]
A public coroutine, awaited on any other loop, posts ``_start_detached`` to the store's inbox
(``tiered.io.mailbox.Mailbox``) with a ``LoopReply``: a future on the caller's loop that the
outcome reaches through that loop's own mailbox (one per caller loop, weakly keyed). The blocking
facade (``store.sync``) and prefetch handles do the same with a ``concurrent.futures.Future``
(``FutureReply``). A mailbox wakes its loop once for all the posts that arrive together, not once
per post, so many small operations in flight cost few wakeups. On the store's own thread a call
awaits ``_detached`` instead (the blocking facade refuses to run there: it would deadlock).

Either way the operation is a task of its own, tracked in ``_tasks``, and the caller only waits
for its outcome: a cancelled caller stops waiting, the operation finishes on the store's loop, and
``close()`` waits for it; a call cancelled before the loop picked it up never starts. So a
cancellation never leaves a transfer half-applied. Below the store the same rule holds: a
cancelled transfer waits for the blocks it submitted, which still use its buffers (see
[Note: blocks in flight] in tiered.io.blocks), and a cancelled caller of a coalesced batch waits
until the batch is done with its buffers (tiered.backends.coalesce).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import os
import time
import weakref
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

import torch

from tiered.backends import Copy, DeviceBackend, HostBackend, NvmeBackend, NvmeCopy, TierBackend
from tiered.backends.device import allocation_event
from tiered.codecs import READABLE_CODECS, Codecs, CompressionPolicy
from tiered.manifest.commits import CommitLog
from tiered.config import StoreConfig
from tiered.store.entry import RAW, Entry, EntryInfo
from tiered.errors import (
    CapacityError,
    ChecksumError,
    KeyNotFoundError,
    ManifestError,
    StoreClosedError,
    TieredError,
    TransferError,
)
from tiered.io import IOEngine, ResultPool
from tiered.io.mailbox import FutureReply, LoopReply, Mailbox
from tiered.util.keylocks import KeyLocks
from tiered.util.loop import LoopThread
from tiered.policy import EvictionPolicy, FutureOrderPolicy
from tiered.manifest.records import Record, Row
from tiered.io.spans import Span, new_result, spans_of_tensor
from tiered.stats import NvmeSpace, StoreStats, SwapExtent
from tiered.store.batch import BatchCalls
from tiered.store.error_messages import lost_at_close, naming_key, read_error
from tiered.store.validation import (
    check_compress,
    check_keep,
    check_key,
    check_out,
    check_tensor,
    dense_copy,
    key_list,
    parse_device,
    plain,
    ready_event,
)
from tiered.store.modify import Modifications
from tiered.store.payload import Payload
from tiered.store.prefetch import Prefetch
from tiered.store.opening import OpenedFiles, open_files
from tiered.store.process import close_at_exit
from tiered.store.renames import Renames
from tiered.store.sync import SyncStore
from tiered.store.tiers import TierBookkeeping
from tiered.tier import TIERS_TOP_DOWN, Tier

__all__ = ["TieredStore"]

T = TypeVar("T")

# [Note: key locks]
# Puts, deletes and modify blocks of one key take that key's lock (``KeyLocks``: first come, first
# served) and run one at a time. ``put_many`` takes all of its keys at once, in sorted order so that
# two batches sharing keys cannot deadlock, and holds them until every entry is written, committed
# and installed. Gets, prefetches, pins, evictions, write-downs and flushes take no key lock: they
# work on the version they found, and what they make for a version that is no longer the key's
# current one is discarded (see [Note: versions and copies] in tiered.store.entry); they wait for a
# version's ``editing`` future before reading bytes a modify block may be changing.
#
# [Note: promotion]
# A get reads the fastest copy into its result and leaves the tiers as they are, so a one-off read
# never evicts the working set. Copies move up only when the caller asks, by ``prefetch`` or ``pin``:
# ``_materialize`` starts the transfer as a tracked task kept in ``entry.moving``, and a prefetch of
# the same key into the same tier joins it. A get that finds a transfer into a faster tier in
# flight waits for it and reads the copy it made; when it failed, the get reads the slower copy.
#
# [Note: crash safety]
# A process killed at any instant leaves every key with its old or its new value, bit-exact,
# because of two rules:
#
# 1. a record is committed only after the bytes it names are durable (see [Note: group commit] in
#    tiered.manifest.commits);
# 2. extents that a committed record points at are never written. A new version always gets new
#    extents (``_write_nvme``), and old ones are freed only once the record replacing them has
#    committed: a put to nvme commits its record in place of the old one, and ``_finish_put`` then
#    retires the old version. A delete, a put to host or device memory and a modify block lending a
#    memory copy, over a key that has a record (``persisted``), commit a tombstone first
#    (``_commit_tombstone``, ``_retire_durably``); else a crash would bring the older value back.
#    ``persisted`` is set before a write-down writes its first byte, so a delete or put racing it
#    commits a tombstone too, and a write-down whose record committed just before its version was
#    replaced waits for that tombstone (``CommitLog.barrier``) before freeing its extents. When a
#    tombstone fails to commit, the extents it would have freed stay allocated (at worst until the
#    next open).
#
# So space written by work that never committed is free again at the next open, with no scan:
# ``_adopt`` marks the committed records' extents used (one that overlaps another or lies past the
# end of its file is a ManifestError) and the rest of each swap file is free. Generations continue
# after the largest committed one. ``StoreConfig(durable=False)`` skips the ``fdatasync`` of rule 1:
# records still commit, but after a crash one may name bytes that fail their checksums.
#
# [Note: closing]
# ``close()`` sets ``_closing`` (new calls raise StoreClosedError), ends the open modify blocks
# (gets and transfers waiting for one would hold the close up), waits for every tracked task,
# writes dirty entries down (``flush_on_close``) and drains the commit log; only then does it close
# the manifest, the backends, the codecs, the I/O engine and the pools, and last the directories'
# descriptors, so their locks go only when nothing of this store can write there any more. A store
# the program never closed is closed at interpreter exit (tiered.store.process).


class TieredStore(BatchCalls, Modifications, Renames, TierBookkeeping):
    """A key -> tensor store over three tiers. Create it with :meth:`open`."""

    def __init__(self, config: StoreConfig, policy: Optional[EvictionPolicy], loop: LoopThread) -> None:
        # Use TieredStore.open(); this constructor only sets fields. It runs on the store loop.
        self.config = config
        self._loop_thread = loop
        self._policy = policy or FutureOrderPolicy()
        self._entries: dict[str, Entry] = {}
        self._resident: dict[Tier, set[str]] = {t: set() for t in TIERS_TOP_DOWN}
        self._inflight: dict[Tier, int] = {t: 0 for t in TIERS_TOP_DOWN}
        self._tier_locks = {t: asyncio.Lock() for t in TIERS_TOP_DOWN}
        self._space_waiters: dict[Tier, list[asyncio.Future[None]]] = {t: [] for t in TIERS_TOP_DOWN}
        self._key_locks = KeyLocks()  # see [Note: key locks]
        self._edits: set[Any] = set()  # open modify blocks (store_modify._Edit)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._generation = itertools.count()
        self._stats = StoreStats()
        self._closed = False
        self._closing = False
        self._close_task: Optional[asyncio.Task[None]] = None
        self._files: Optional[OpenedFiles] = None
        self._damaged: dict[str, Row] = {}
        self._backends: dict[Tier, TierBackend] = {}
        self._inbox = Mailbox(loop.loop)  # calls from other threads
        self._outboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox]" = weakref.WeakKeyDictionary()
        self._last_outbox: Optional[Mailbox] = None
        self.sync = SyncStore(self)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def open(cls, config: StoreConfig, *, policy: Optional[EvictionPolicy] = None) -> "TieredStore":
        """Start a store over ``config.path``, reopening the data a previous store committed there.

        Blocks while it opens; from async code ``await TieredStore.open_async(config)`` does not.
        """
        if not isinstance(config, StoreConfig):
            raise TypeError(f"TieredStore.open takes a StoreConfig, got {type(config).__name__}")
        loop = LoopThread(name=f"tiered-store:{os.path.basename(config.path)}")
        try:
            return loop.submit(cls._start(config, policy, loop)).result()
        except BaseException:
            loop.stop()
            raise

    @classmethod
    async def open_async(cls, config: StoreConfig, *, policy: Optional[EvictionPolicy] = None) -> "TieredStore":
        """:meth:`open` for async callers: the caller's loop keeps running while the store opens."""
        if not isinstance(config, StoreConfig):
            raise TypeError(f"TieredStore.open_async takes a StoreConfig, got {type(config).__name__}")
        loop = LoopThread(name=f"tiered-store:{os.path.basename(config.path)}")
        try:
            return await asyncio.wrap_future(loop.submit(cls._start(config, policy, loop)))
        except BaseException:
            loop.stop()
            raise

    @classmethod
    async def _start(cls, config: StoreConfig, policy: Optional[EvictionPolicy], loop: LoopThread) -> "TieredStore":
        store = cls(config, policy, loop)
        try:
            await store._open()
        except BaseException:
            await store._release_resources()
            raise
        close_at_exit(store)
        return store

    async def _open(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        self._manifest_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiered-manifest")
        self._files = await loop.run_in_executor(self._manifest_thread, open_files, cfg, READABLE_CODECS)
        self._manifest = self._files.manifest
        device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cuda = device.type == "cuda"
        self._cpu_pool = concurrent.futures.ThreadPoolExecutor(cfg.cpu_threads, thread_name_prefix="tiered-cpu")
        self._io = IOEngine(
            block_size=cfg.block_size,
            queue_depth=cfg.queue_depth,
            io_threads=cfg.io_threads,
            checksum=cfg.checksum,
            pin=cuda,
            staging_buffers=cfg.staging_buffers,
        )
        self._results = ResultPool(cfg.result_pool_bytes)
        self._device = DeviceBackend(device, cfg.device_bytes, self._cpu_pool)
        self._backends[Tier.DEVICE] = self._device
        self._backends[Tier.HOST] = HostBackend(cfg.host_bytes, self._cpu_pool, pin=cuda, prefault=cfg.prefault_host)
        self._nvme = NvmeBackend(
            self._files.directories.swap,
            store_id=self._manifest.store_id,
            adopt_unlabelled=self._manifest.meta.legacy,
            files_per_dir=cfg.swap_files_per_dir,
            budget=cfg.nvme_bytes,
            grow_bytes=cfg.swap_grow_bytes,
            io=self._io,
            direct=cfg.direct_io,
            coalesce_bytes=cfg.coalesce_bytes,
        )
        self._backends[Tier.NVME] = self._nvme
        self._codec = Codecs(self._cpu_pool, cache_bytes=cfg.codec_cache_bytes)
        self._compression = CompressionPolicy(cfg.compress, cfg.compress_policy)
        records = self._files.loaded.records
        committed: dict[str, int] = {}
        for rec in records:
            self._adopt(rec)
            committed[rec.key] = rec.generation
        self._damaged = {row.record.key: row for row in self._files.loaded.damaged}
        await loop.run_in_executor(self._manifest_thread, self._manifest.upgrade, records)
        await loop.run_in_executor(self._manifest_thread, self._manifest.record_location)
        self._generation = itertools.count(max(committed.values(), default=-1) + 1)
        self._commits = CommitLog(
            self._manifest, self._nvme, self._manifest_thread, durable=cfg.durable, committed_generations=committed
        )

    def _adopt(self, rec: Record) -> None:
        """Rebuild an entry from its committed record; its extents become used, all else is free
        (see [Note: crash safety])."""
        copy = NvmeCopy(
            nbytes=rec.stored_nbytes,
            footprint=sum(e.length for e in rec.extents),
            extents=list(rec.extents),
            chunk=rec.chunk,
            crcs=list(rec.crcs) if rec.crcs is not None else None,
        )
        try:
            self._nvme.mark_used(copy)
        except ValueError as exc:
            raise ManifestError(
                f"entry {rec.key!r} in the manifest is inconsistent with the swap files: {exc}; the swap files were "
                f"truncated or replaced, or the manifest is damaged. `tiered fsck {self.config.path} --delete-damaged` "
                "removes such records and keeps the rest"
            ) from exc
        entry = Entry(
            rec.key, rec.torch_dtype(), rec.shape, rec.nbytes, rec.generation,  # type: ignore[arg-type]
            codec=rec.codec, codec_meta=rec.codec_meta, stored_nbytes=rec.stored_nbytes, persisted=True,
        )
        self._entries[rec.key] = entry
        self._add_copy(entry, Tier.NVME, copy)
        self._policy.touch(rec.key)

    async def close(self) -> None:
        """Finish transfers in flight, write dirty entries down (``flush_on_close``), and stop.

        Idempotent. Afterwards every method raises StoreClosedError.
        """
        if self._closed:
            return
        if self._loop_thread.on_loop_thread():
            raise RuntimeError("TieredStore.close() cannot run on the store's own loop thread")
        try:
            await asyncio.wrap_future(self._loop_thread.submit(self._close()))
        finally:
            self._closed = True
            self._loop_thread.stop()

    async def _close(self) -> None:
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close_once())
        await asyncio.shield(self._close_task)

    async def _close_once(self) -> None:
        # See [Note: closing].
        self._closing = True
        self._abandon_modifications()  # gets and transfers waiting for a block would hold the close up
        current = asyncio.current_task()
        while True:
            pending = {t for t in self._tasks if t is not current and not t.done()}
            if not pending:
                break
            await asyncio.wait(pending)
        try:
            failures = await self._write_down() if self.config.flush_on_close else {}
        finally:
            try:
                await self._commits.drain()
            finally:
                await self._release_resources()
        if failures:
            raise lost_at_close(failures, len(self._entries))

    async def _release_resources(self) -> None:
        loop = asyncio.get_running_loop()
        if hasattr(self, "_manifest"):
            await loop.run_in_executor(self._manifest_thread, self._manifest.close)
        for backend in self._backends.values():
            await backend.close()
        if hasattr(self, "_codec"):
            self._codec.close()
        if hasattr(self, "_io"):
            await loop.run_in_executor(None, self._io.close)
        if hasattr(self, "_results"):
            self._results.close()
        for pool in ("_cpu_pool", "_manifest_thread"):
            if hasattr(self, pool):
                getattr(self, pool).shutdown(wait=False)
        if self._files is not None:
            self._files.directories.close()  # closing the descriptors drops the locks

    async def __aenter__(self) -> "TieredStore":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.sync.close()

    # ------------------------------------------------------------------ public API

    async def put(
        self, key: str, tensor: torch.Tensor, tier: "Tier | str" = Tier.NVME, compress: Optional[bool] = None, *,
        keep: "Tier | str | None" = None,
    ) -> None:
        """Store a copy of ``tensor`` under ``key`` in ``tier``, replacing any previous value.

        The caller may reuse ``tensor`` as soon as this returns (not before). A put to nvme is
        durable when it returns; a put to host or device is written down when evicted, flushed or
        on close. ``compress=True`` stores the nvme copy compressed (lossless, bplane-zstd);
        None leaves it to the config's ``compress`` and ``compress_policy`` (docs/compression.md).
        ``keep`` (a tier faster than ``tier``) also keeps a clean copy there when the eviction
        policy finds it worth the room ([Note: Kept copies]): a write-through cache.
        """
        check_keep(keep, tier)
        return await self._call(self._put, key, tensor, tier, compress, ready_event(tensor), keep)

    async def get(
        self, key: str, device: "torch.device | str" = "cpu", *, out: Optional[torch.Tensor] = None,
        keep: "Tier | str | None" = None,
    ) -> torch.Tensor:
        """A new tensor with the entry's exact bytes, dtype and shape, on ``device``.

        With ``out`` (contiguous, same dtype and shape), the bytes land there instead; a CUDA ``out``
        is written once the work queued so far on the caller's current stream has finished. Waits for
        a prefetch of the key that is in flight instead of reading the slower copy again. A get does
        not promote, unless ``keep`` (host or device) asks the store to keep a copy of what it read
        from a slower tier there, when the eviction policy finds it worth the room ([Note: Kept copies]).
        """
        check_keep(keep)
        return await self._call(self._get, key, device, out, ready_event(out), keep)

    def prefetch(self, key: str, tier: "Tier | str" = Tier.HOST) -> Prefetch:
        """Start bringing ``key`` into ``tier`` and return at once; the handle is awaitable.

        Prefetches of the same key and tier coalesce into one transfer.
        """
        self._check_open()
        self._entry(key)
        return Prefetch(self._submit(self._prefetch, key, tier), self._loop_thread.on_loop_thread)

    async def evict(self, key: str, tier: "Tier | str" = Tier.NVME) -> None:
        """Keep ``key`` only in ``tier`` and below: drop faster copies, writing the entry down
        first only when no copy at or below ``tier`` exists (a clean drop costs no I/O)."""
        return await self._call(self._evict, key, tier)

    async def delete(self, key: str) -> None:
        """Remove ``key`` from every tier and from the manifest (durably)."""
        return await self._call(self._delete, key)

    async def pin(self, key: str, tier: "Tier | str | None" = None) -> None:
        """Exempt ``key``'s copies from eviction; with ``tier``, first bring a copy there."""
        return await self._call(self._pin, key, tier)

    async def unpin(self, key: str) -> None:
        """Make ``key`` evictable again."""
        return await self._call(self._unpin, key)

    async def flush(self, keys: Optional[Sequence[str]] = None) -> None:
        """Write every entry without an nvme copy down to nvme and commit it; with ``keys``, only
        those keys' entries (KeyNotFoundError naming any that is missing). Copies in faster tiers
        stay, now clean."""
        checked = None if keys is None else key_list(keys, "flush")
        return await self._call(self._flush, checked)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 CPU tensor of exactly ``nbytes`` (uninitialized), page-aligned and with every
        page present, from the pool large get results come from (``StoreConfig.result_pool_bytes``).

        Puts from it and ``get(key, out=...)`` into it move its bytes in place (no staging copy).
        When the last tensor or storage on its memory dies, the memory goes back to the pool and
        serves the next get or ``host_buffer`` of the same page-rounded size, already mapped; the
        pool keeps at most ``result_pool_bytes`` of mappings, lent out and waiting together
        ([Note: Result pool bound]). Thread-safe; no call to the store's loop.

        Raises:
            ValueError: ``nbytes`` is not an int >= 1.
            StoreClosedError: the store is closed.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"host_buffer: nbytes must be an int >= 1, got {nbytes!r}")
        self._check_open()
        tensor, view = self._results.take(nbytes, populate=True)
        view.release()
        return tensor

    def resize_result_pool(self, nbytes: int) -> None:
        """Bound the buffer pool (opened with ``StoreConfig.result_pool_bytes``) by ``nbytes`` from now
        on: freed buffers beyond it are unmapped at once. A program whose phases need different
        amounts of it (an engine's backward and optimizer step) moves the bound between them.

        Raises:
            ValueError: ``nbytes`` is not an int >= 0.
            StoreClosedError: the store is closed.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"resize_result_pool: nbytes must be an int >= 0, got {nbytes!r}")
        self._check_open()
        self._results.resize(nbytes)

    def set_access_order(self, keys: Optional[Sequence[str]]) -> None:
        """Tell the eviction policy the future access order (one repeating iteration); None drops it."""
        self._check_open()
        order = list(keys) if keys is not None else None
        self._loop_thread.loop.call_soon_threadsafe(self._policy.set_future_order, order)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        """Every key in the store (a key whose manifest record is damaged is not one)."""
        return list(self._entries)

    def info(self, key: str) -> EntryInfo:
        """dtype, shape, nbytes, stored_nbytes, tiers, codec, dirty and pinned of ``key``.

        Raises TypeError for a key that is not a string, KeyNotFoundError for a key not in the store,
        ManifestError for a key whose manifest record is damaged.
        """
        return self._entry(key).info()

    def stats(self) -> StoreStats:
        """A snapshot of occupancy, traffic, hits and misses, evictions and time spent on I/O."""
        s = StoreStats(**{k: v for k, v in vars(self._stats).items() if k != "tiers"})
        for tier, backend in self._backends.items():
            t = s.tiers[tier]
            own = self._stats.tiers[tier]
            for field in ("hits", "misses", "evictions", "bytes_in", "bytes_out"):
                setattr(t, field, getattr(own, field))
            t.budget_bytes = backend.budget
            t.used_bytes = backend.used
            t.entries = len(self._resident[tier])
        s.entries = len(self._entries)
        c = self._io.counters if hasattr(self, "_io") else None
        if c is not None:
            s.bytes_read, s.bytes_written = c.bytes_read, c.bytes_written
            s.read_requests, s.write_requests, s.syncs = c.read_requests, c.write_requests, c.syncs
            s.io_busy_seconds = c.io_seconds
            s.checksum_seconds, s.staging_seconds = c.checksum_seconds, c.staging_seconds
        if hasattr(self, "_commits"):
            s.manifest_commits = self._commits.commits
        if hasattr(self, "_results"):
            pool = self._results
            s.pool_lent_bytes, s.pool_waiting_bytes = pool.lent_bytes, pool.waiting_bytes
            s.pool_hits, s.pool_misses = pool.hits, pool.misses
        if hasattr(self, "_compression"):
            e = self._compression.estimates
            s.codec_encode_bps, s.codec_decode_bps, s.codec_ratio = e.encode_bps, e.decode_bps, e.ratio
            s.nvme_write_bps, s.nvme_read_bps = e.write_bps, e.read_bps
            s.compress_skipped = self._compression.skipped
        return s

    def nvme_space(self) -> NvmeSpace:
        """Swap-file capacity, allocated extents, budget charge and current entries' extents, in bytes.

        A snapshot like :meth:`stats`. With no operation in flight, allocated == charged == entries'
        extents; after a reopen that is exactly the committed records' extents (nothing leaked).
        """
        files = self._nvme.files
        entry_bytes = sum(
            c.footprint for e in list(self._entries.values()) if (c := e.copies.get(Tier.NVME)) is not None
        )
        return NvmeSpace(
            file_bytes=sum(f.alloc.capacity for f in files),
            allocated_bytes=sum(f.alloc.used_bytes for f in files),
            charged_bytes=self._nvme.used,
            entry_bytes=entry_bytes,
        )

    def nvme_layout(self, key: str) -> tuple[SwapExtent, ...]:
        """Where ``key``'s nvme copy lies: its stored bytes (after any codec), in order, as ranges of
        swap files; empty when the key has no nvme copy.

        A snapshot for tools that read the swap files themselves (the benchmark's same-file
        comparison with other I/O engines, forensics). Every put writes a new version to new
        extents, so it holds until the key is next written, evicted from nvme or deleted. Writing
        anything but the same bytes to these ranges corrupts the entry (its checksums catch that).
        """
        copy = self._entry(key).copies.get(Tier.NVME)
        if copy is None:
            return ()
        assert isinstance(copy, NvmeCopy)
        return self._nvme.layout(copy)

    # ------------------------------------------------------------------ calling convention

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise StoreClosedError(f"the store at {self.config.path} is closed; open it again to use it")

    def _submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> "concurrent.futures.Future[T]":
        self._check_open()
        result: "concurrent.futures.Future[T]" = concurrent.futures.Future()
        self._inbox.post(self._start_detached, FutureReply(result), fn, args)
        return result

    def _start_detached(self, reply: "FutureReply | LoopReply", fn: Callable[..., Awaitable[Any]],
                        args: tuple) -> None:
        """On the store loop: run ``fn`` as a tracked task whose outcome goes to ``reply``.

        Like ``_detached`` but with one task instead of two and a shield: the caller giving up
        never reaches the task. A call the caller cancelled before the loop got here never starts.
        Calls arrive through a mailbox and answer through the caller loop's, so many calls in
        flight cost a few wakeups, not two per call. See [Note: calls from any thread].
        """
        if reply.cancelled():
            return
        try:
            self._check_open()
        except StoreClosedError as exc:
            reply.fail(exc)
            return
        task = self._loop_thread.loop.create_task(fn(*args))
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._finish_detached, reply))

    def _finish_detached(self, reply: "FutureReply | LoopReply", task: "asyncio.Task[Any]") -> None:
        # One done-callback instead of two (untrack, answer): each costs the loop a scheduled handle.
        self._tasks.discard(task)
        reply.finish(task)

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if self._loop_thread.on_loop_thread():
            self._check_open()
            return await self._detached(fn, *args)
        self._check_open()
        loop = asyncio.get_running_loop()
        outbox = self._last_outbox
        if outbox is None or outbox.loop is not loop:  # the common case: the same loop as last time
            outbox = self._outboxes.get(loop)
            if outbox is None:  # one per caller loop; a loop is only ever run by one thread at a time
                outbox = self._outboxes[loop] = Mailbox(loop)
            self._last_outbox = outbox
        future = loop.create_future()
        self._inbox.post(self._start_detached, LoopReply(future, outbox), fn, args)
        return await future

    def _call_sync(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self._submit_sync(fn, *args).result()

    def _submit_sync(self, fn: Callable[..., Awaitable[T]], *args: Any) -> "concurrent.futures.Future[T]":
        """``_submit`` for the sync facade, which must not block the store's own loop thread."""
        if self._loop_thread.on_loop_thread():
            raise RuntimeError(
                "the sync facade (store.sync) cannot be used on the store's own loop thread; await the async method"
            )
        return self._submit(fn, *args)

    async def _detached(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn`` as a task the caller's cancellation cannot interrupt, tracked for close()."""
        self._check_open()
        task = asyncio.ensure_future(fn(*args))
        self._track(task)
        return await asyncio.shield(task)

    def _track(self, task: "asyncio.Task[Any]") -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ operations (store loop)

    async def _put(
        self, key: str, tensor: torch.Tensor, tier: "Tier | str", compress: Optional[bool], ready: Any = None,
        keep: "Tier | str | None" = None,
    ) -> None:
        check_key(key)
        check_tensor(tensor)
        await self._wait_for_callers((ready,))
        tier = Tier.parse(tier)
        check_compress(compress)
        data = plain(tensor)
        if data is None:
            data = await self._in_cpu_pool(dense_copy, tensor)
        kept = check_keep(keep, tier)
        await self._key_locks.acquire(key)
        try:
            await self._put_locked(key, data, tier, compress, kept)
        finally:
            self._key_locks.release(key)

    async def _put_locked(self, key: str, data: torch.Tensor, tier: Tier, compress: Optional[bool],
                          keep: Optional[Tier] = None) -> None:
        """The put of one key whose lock the caller holds; ``data`` is contiguous. ``keep``: see
        [Note: Kept copies]."""
        entry = Entry(key, data.dtype, tuple(data.shape), data.numel() * data.element_size(), next(self._generation),
                      compress=compress)
        src = spans_of_tensor(data)
        if tier is Tier.NVME:
            started = time.perf_counter()
            copy = await self._write_nvme(entry, src)
            assert copy is not None, "a put holds the key lock, so nothing newer can supersede it"
            self._stats.io_wait_seconds += time.perf_counter() - started
        else:
            copy = await self._admit(tier, entry.nbytes)
            try:
                await self._store_memory(tier, copy, src)
            except BaseException:
                self._discard(tier, copy)
                raise
        await self._finish_put(entry, tier, copy)
        if keep is not None:
            await self._keep_copy(entry, keep, src)

    async def _finish_put(self, entry: Entry, tier: Tier, copy: Copy) -> None:
        """Make a written ``entry`` the key's current version and retire the old one.

        Awaits only for a memory-tier put over a persisted key (its tombstone must commit first).
        """
        key = entry.key
        old = self._entries.get(key)
        if old is not None and old.persisted and tier is not Tier.NVME:
            # The old version must not come back after a crash once a newer one was put: its
            # tombstone commits first, and when it cannot, the put fails and the old version stays
            # (see [Note: crash safety]).
            try:
                await self._commit_tombstone(key, entry.generation, "putting")
            except BaseException:
                self._discard(tier, copy)
                raise
        self._entries[key] = entry
        if self._damaged.pop(key, None) is not None:
            entry.persisted = True  # a damaged row of the key is on disk: a delete must remove it
        self._settle(tier, copy)
        self._add_copy(entry, tier, copy)
        self._wake(tier)
        self._stats.puts += 1
        if tier is not Tier.NVME:  # _write_nvme counted nvme's bytes_in
            self._stats.tiers[tier].bytes_in += entry.nbytes
        self._policy.touch(key, access=False)  # recent, but not a step of the (read) order
        if old is not None:
            entry.pinned = old.pinned
            self._retire(old)

    async def _get(self, key: str, device: "torch.device | str", out: Optional[torch.Tensor], ready: Any = None,
                   keep: "Tier | str | None" = None) -> torch.Tensor:
        check_key(key)
        await self._wait_for_callers((ready,))
        device = parse_device(device)
        entry = self._entry(key)
        if entry.moving:
            top = entry.top()
            faster = [task for t, task in entry.moving.items() if top is None or t.rank < top.rank]
            if faster:
                await asyncio.wait(faster)  # a failed prefetch only means we read the slower copy
            entry = self._entry(key)
        if entry.editing is not None:  # last: nothing awaits between this and taking the reader
            entry = await self._unedited(key)
        allocated = None
        if out is None:
            result, dst = new_result(entry.shape, entry.dtype, device, self._results)
            allocated = allocation_event(result)  # see [Note: CUDA stream order] in tiered.backends.device
        else:
            check_out(out, entry)
            result, dst = out, spans_of_tensor(out)
        tier = entry.top()
        assert tier is not None
        copy = self._begin_read(entry, tier)
        started = time.perf_counter()
        try:
            await self._read_copy(entry, tier, copy, dst, allocated)
        finally:
            self._end_read(tier, copy)
        if tier is Tier.NVME:
            self._stats.io_wait_seconds += time.perf_counter() - started
        self._count_get(entry, tier)
        kept = check_keep(keep)
        if kept is not None and kept.rank < tier.rank:
            await self._keep_copy(entry, kept, dst)
        return result

    def _count_get(self, entry: Entry, tier: Tier) -> None:
        stats = self._stats
        stats.gets += 1
        stats.tiers[tier].hits += 1
        stats.tiers[tier].bytes_out += entry.nbytes
        for above in TIERS_TOP_DOWN[: tier.rank]:
            stats.tiers[above].misses += 1
        self._policy.touch(entry.key)

    async def _prefetch(self, key: str, tier: "Tier | str") -> None:
        tier = Tier.parse(tier)
        entry = self._entry(key)
        self._stats.prefetches += 1
        if tier in entry.moving:
            self._stats.prefetches_coalesced += 1
        task = self._materialize(entry, tier)
        if task is not None:
            await asyncio.shield(task)

    async def _evict(self, key: str, tier: "Tier | str") -> None:
        check_key(key)
        tier = Tier.parse(tier)
        entry = self._entry(key)
        if entry.pinned:
            raise ValueError(f"key {key!r} is pinned; unpin it before evicting it")
        if not any(t.rank >= tier.rank for t in entry.copies):
            task = self._materialize(entry, tier)
            if task is not None:
                await asyncio.shield(task)
        if self._entries.get(key) is not entry:
            return
        for above in TIERS_TOP_DOWN[: tier.rank]:
            if above in entry.copies and any(t.rank > above.rank for t in entry.copies):
                self._drop_copy(entry, above)
                self._stats.tiers[above].evictions += 1

    async def _delete(self, key: str) -> None:
        check_key(key)
        await self._key_locks.acquire(key)
        try:
            if key not in self._entries and key in self._damaged:  # the damaged record goes
                await self._commit_tombstone(key, next(self._generation), "deleting")
                del self._damaged[key]
                return
            entry = self._entry(key)
            del self._entries[key]
            self._policy.forget(key)
            self._stats.deletes += 1
            if entry.persisted:
                await self._retire_durably(entry, next(self._generation))
            else:
                self._retire(entry)
        finally:
            self._key_locks.release(key)

    async def _pin(self, key: str, tier: "Tier | str | None") -> None:
        entry = self._entry(key)
        if tier is not None:
            task = self._materialize(entry, Tier.parse(tier))
            if task is not None:
                await asyncio.shield(task)
            entry = self._entry(key)
        entry.pinned = True

    async def _unpin(self, key: str) -> None:
        self._entry(key).pinned = False
        for tier in TIERS_TOP_DOWN:
            self._wake(tier)

    async def _flush(self, keys: Optional[list[str]] = None) -> None:
        failures = await self._write_down(keys)
        if failures:
            raise next(iter(failures.values()))[1]

    async def _write_down(self, keys: Optional[list[str]] = None) -> dict[str, tuple[int, BaseException]]:
        """Write every dirty entry (of ``keys``, when given) down to nvme, as many as fit; return
        those that failed (key -> bytes, error), in no particular order."""
        entries = list(self._entries.values()) if keys is None else self._entries_of(keys)
        dirty = [e for e in entries if e.dirty]
        tasks = [(e, self._materialize(e, Tier.NVME)) for e in dirty]
        pending = [(e, t) for e, t in tasks if t is not None]
        if not pending:
            return {}
        results = await asyncio.gather(*(asyncio.shield(t) for _, t in pending), return_exceptions=True)
        return {e.key: (e.nbytes, r) for (e, _), r in zip(pending, results) if isinstance(r, BaseException)}

    # ------------------------------------------------------------------ moving copies between tiers

    def _materialize(self, entry: Entry, tier: Tier) -> "Optional[asyncio.Task[None]]":
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
        if entry.editing is not None:  # a modify block is changing the bytes: copy what it leaves
            await asyncio.wait([entry.editing])
            if self._entries.get(entry.key) is not entry:
                return
        if tier is Tier.NVME:
            source = entry.top()
            if source is None:
                return
            copy = self._begin_read(entry, source)
            try:
                written = await self._write_nvme(entry, self._memory_spans(source, copy))
            finally:
                self._end_read(source, copy)
            if written is None:
                return
            if self._entries.get(entry.key) is entry:
                self._install(entry, Tier.NVME, written)
            else:
                # Replaced or deleted while being written, after our record committed: the
                # tombstone that supersedes it is already submitted. Until it commits, our record
                # still points at these extents, so they must not be reused yet (see the
                # tombstones of [Note: crash safety]).
                self._settle(Tier.NVME, written)
                await self._commits.barrier()
                if self._commits.committed_generation(entry.key) != entry.generation:
                    self._backends[Tier.NVME].release(written)  # else the tombstone failed: keep them
                self._wake(Tier.NVME)
            return
        new = await self._admit(tier, entry.nbytes)
        try:
            source = entry.top() if self._entries.get(entry.key) is entry else None
            if source is None:
                self._discard(tier, new)
                return
            src_copy = self._begin_read(entry, source)
            try:
                await self._read_copy(entry, source, src_copy, self._backends[tier].spans(new),  # type: ignore[arg-type]
                                      new.allocated)
            finally:
                self._end_read(source, src_copy)
        except BaseException:
            self._discard(tier, new)
            raise
        self._stats.transfers += 1
        self._stats.tiers[tier].bytes_in += entry.nbytes
        self._install(entry, tier, new)
        self._policy.touch(entry.key, access=False)  # see [Note: what the policy sees] in tiered.policy

    async def _write_nvme(self, entry: Entry, src: Sequence[Span]) -> Optional[NvmeCopy]:
        """Write ``src`` (the entry's bytes) to new extents and commit a record for it (see
        [Note: crash safety]).

        Returns the copy, or None when a newer version of the key committed first.
        """
        entry.persisted = True  # from now on a delete or put of this key must write a tombstone
        payload = await self._encode(entry, src)
        try:
            try:
                copy = await self._admit(Tier.NVME, payload.nbytes)
            except CapacityError as exc:
                raise naming_key(exc, "writing", entry.key) from exc
            try:
                started = time.perf_counter()
                await self._nvme.store(copy, payload.spans)
                self._compression.observe_write(payload.nbytes, time.perf_counter() - started)
            except BaseException as exc:
                self._discard(Tier.NVME, copy)
                if isinstance(exc, OSError):
                    raise naming_key(exc, "writing", entry.key) from exc
                raise
        finally:
            payload.close()
        try:
            applied = await self._commits.submit(entry.key, entry.generation, payload.record(entry, copy), copy)
        except BaseException as exc:
            self._discard(Tier.NVME, copy)
            if isinstance(exc, (OSError, TieredError)):
                raise naming_key(exc, "committing", entry.key) from exc
            raise
        if not applied:
            self._discard(Tier.NVME, copy)
            return None
        self._written(entry, payload)
        return copy

    async def _encode(self, entry: Entry, src: Sequence[Span]) -> "Payload":
        """What goes to disk for ``entry``: its bytes, or their compressed form when that is wanted and pays
        (see [Note: compressed copies] in tiered.codecs)."""
        if not (entry.nbytes and self._compression.wants(entry.compress)):
            return Payload(src, entry.nbytes)
        host = await self._host_bytes(src, entry.nbytes)
        started = time.perf_counter()
        encoded = await self._codec.encode(host, entry.dtype)
        elapsed = time.perf_counter() - started if encoded is not None else 0.0
        self._compression.observe_encode(entry.nbytes, encoded.nbytes if encoded else entry.nbytes, elapsed)
        if encoded is None:
            return Payload(src, entry.nbytes)
        return Payload(encoded.spans(), encoded.nbytes, encoded.codec, encoded.meta, encoded)

    def _written(self, entry: Entry, payload: "Payload") -> None:
        """Bookkeeping once an entry's nvme record committed."""
        entry.codec, entry.codec_meta, entry.stored_nbytes = payload.codec, payload.meta, payload.nbytes
        self._stats.bytes_before_codec += entry.nbytes
        self._stats.bytes_after_codec += payload.nbytes
        self._stats.tiers[Tier.NVME].bytes_in += entry.nbytes

    async def _read_copy(self, entry: Entry, tier: Tier, copy: Copy, dst: Sequence[Span], allocated: Any = None
                         ) -> None:
        """Fill ``dst`` with the entry's bytes from its copy in ``tier``; ``allocated`` is the
        :func:`allocation_event` of ``dst`` when the store just allocated it on CUDA."""
        if tier is not Tier.NVME:
            await self._device.copy(dst, self._memory_spans(tier, copy), after=(allocated,))
            return
        try:
            started = time.perf_counter()
            if entry.codec == RAW:
                await self._nvme.load(copy, dst)
                self._compression.observe_read(copy.nbytes, time.perf_counter() - started)
                return
            buf = self._codec.buffer(max(copy.nbytes, 1))
            try:
                await self._nvme.load(copy, [Span(buf.tensor[: copy.nbytes], buf.view)])
                loaded = time.perf_counter()
                self._compression.observe_read(copy.nbytes, loaded - started)
                await self._codec.decode(entry.codec, buf.view[: copy.nbytes], entry.codec_meta, dst)
                self._compression.observe_decode(entry.nbytes, time.perf_counter() - loaded)
            finally:
                self._codec.release(buf)
        except (ChecksumError, TransferError) as exc:
            raise read_error(exc, entry.key) from exc

    async def _store_memory(self, tier: Tier, copy: Copy, src: Sequence[Span]) -> None:
        await self._device.copy(self._backends[tier].spans(copy), src,  # type: ignore[arg-type]
                                after=(copy.allocated,))

    def _memory_spans(self, tier: Tier, copy: Copy) -> list[Span]:
        spans = self._backends[tier].spans(copy)
        assert spans is not None
        return spans

    async def _host_bytes(self, src: Sequence[Span], nbytes: int) -> torch.Tensor:
        """The bytes of ``src`` as one contiguous CPU uint8 tensor (copying only when needed)."""
        if len(src) == 1 and src[0].tensor.device.type == "cpu":
            return src[0].tensor
        out = torch.empty(nbytes, dtype=torch.uint8)
        await self._device.copy([Span(out)], src)
        return out

    def _entry(self, key: str) -> Entry:
        """The current entry of ``key``; TypeError for a non-string key, else :meth:`_missing`'s error."""
        entry = self._entries.get(key)
        if entry is None:
            check_key(key)
            raise self._missing(key)
        return entry

    def _missing(self, key: str) -> TieredError:
        """The error for a key without an entry: ManifestError when its manifest record is damaged
        (it is never served), else KeyNotFoundError (saying when damaged records might hold it)."""
        row = self._damaged.get(key)
        fsck = f"tiered fsck {self.config.path}"
        if row is not None:
            return ManifestError(
                f"the manifest record of {key!r} (row {row.rowid}) is damaged ({'; '.join(row.problems)}), so it is "
                f"not served; put or delete the key to replace the record, or `{fsck} --delete-damaged` removes it"
            )
        if self._damaged:
            return KeyNotFoundError(
                f"key {key!r} is not in the store; {len(self._damaged)} damaged manifest record(s) are not served, "
                f"and one of them may have been this key (`{fsck}` lists them)"
            )
        return KeyNotFoundError(f"key {key!r} is not in the store")

    async def _in_cpu_pool(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._cpu_pool, fn, *args)

    async def _wait_for_callers(self, events: Sequence[Any]) -> None:
        """Wait, in one trip to the cpu pool, for the caller-stream events a put or a get into ``out``
        captured (:func:`ready_event`; None entries are skipped): the kernels the caller queued on
        those tensors have finished. See [Note: CUDA stream order] in tiered.backends.device."""
        pending = [e for e in events if e is not None]
        if pending:
            await self._in_cpu_pool(lambda: [e.synchronize() for e in pending])


def _consume_exception(task: "asyncio.Task[Any]") -> None:
    # Transfers started by prefetch may fail with nobody awaiting them; their error reaches the
    # next waiter (or a get falls back to the slower copy). Mark it retrieved to keep logs clean.
    if not task.cancelled():
        task.exception()
