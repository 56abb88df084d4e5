"""TieredStore: keys -> tensors over device memory, host buffers and nvme swap files.

The facade: it opens and closes the store, checks each call's arguments on the caller's thread and
brings the call to the store's loop, where the parts it composes run it. Below it, each part owns
the state it changes: ``Versions`` (tiered.store.versions) which version each key holds,
``Tiers`` (tiered.store.tiers) the copies in each tier, ``Transfers`` (tiered.store.transfers)
admission and every move of bytes; ``Operations``, ``Batches``, ``Renames`` and ``Modifications``
compose them into the calls, and ``Calls`` (tiered.store.calls) is how a call gets there. None of
them knows the facade.

[Note: one loop owns the state]
Every piece of store state (entries, the resident sets, allocators, the policy, the commit log,
stats) is read and changed only on the store's own asyncio loop, which runs on a thread of its
own (``LoopThread``, named ``tiered-store:<dir>``). So no lock guards store state and the hot path
takes none; the few thread locks there are guard what worker threads share (I/O counters,
mailboxes, buffer pools). Asyncio locks order the work on the loop: one per tier for admission
(see [Note: admission and eviction] in tiered.store.transfers), one around nvme allocation, and
the key locks (see [Note: key locks] in tiered.store.versions). Blocking work runs in three pools,
never on the loop: ``io_threads`` (``IOEngine``: preadv/pwritev, fdatasync, fallocate, the CRCs of
the blocks they move), ``cpu_threads`` (memory and CUDA copies, CUDA event waits, dense copies of
caller tensors, codecs) and one manifest thread, so SQLite is used from one thread only (it also
opens the store's files at open). The loop itself does bookkeeping and a few short syscalls: opening the
swap files at open, ``statvfs`` before a swap file grows, mapping a get result or a codec buffer
the pools have none of. ``keys()``, ``in``, ``len()``, ``info()``, ``stats()``, ``nvme_space()`` and
``nvme_layout()`` read the loop's state from the caller's thread without a round trip, so they
return snapshots that may be a moment stale.

How a call from any thread reaches the loop: [Note: calls from any thread] in tiered.store.calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from typing import Iterable, Mapping, Optional, Sequence

import torch

from tiered.backends import DeviceBackend, HostBackend, NvmeBackend, NvmeCopy
from tiered.codecs import READABLE_CODECS, Codecs, CompressionPolicy
from tiered.config import StoreConfig
from tiered.io import IOEngine, ResultPool
from tiered.manifest.commits import CommitLog
from tiered.policy import EvictionPolicy, FutureOrderPolicy
from tiered.stats import NvmeSpace, StoreStats, SwapExtent
from tiered.store.batch import Batches
from tiered.store.calls import Calls
from tiered.store.entry import EntryInfo
from tiered.store.error_messages import lost_at_close
from tiered.store.modify import Modification, Modifications
from tiered.store.opening import OpenedFiles, open_files
from tiered.store.operations import Operations
from tiered.store.prefetch import Prefetch
from tiered.store.process import close_at_exit
from tiered.store.renames import Renames, check_durable, rename_pairs
from tiered.store.sync import SyncStore
from tiered.store.tiers import Tiers
from tiered.store.transfers import Transfers
from tiered.store.validation import (
    batch_compress,
    batch_items,
    batch_keys,
    check_atomic,
    check_keep,
    check_key,
    key_list,
    ready_event,
)
from tiered.store.versions import Versions
from tiered.tier import Tier
from tiered.util.loop import LoopThread

__all__ = ["TieredStore"]

# [Note: closing]
# ``close()`` sets ``Calls.closing`` (new calls raise StoreClosedError), ends the open modify blocks
# (gets and transfers waiting for one would hold the close up), waits for every tracked task,
# writes dirty entries down (``flush_on_close``) and drains the commit log, gives back the swap
# files' free space when nothing failed ([Note: free space at close] in tiered.backends.free_space);
# only then does it close the manifest, the backends, the codecs, the I/O engine and the pools, and
# last the directories' descriptors, so their locks go only when nothing of this store can write
# there any more. A store the program never closed is closed at interpreter exit (tiered.store.process).



class TieredStore:
    """A key -> tensor store over three tiers. Create it with :meth:`open`."""

    #: The blocking facade (``store.sync.put(...)``); see :class:`SyncStore`.
    sync: SyncStore

    def __init__(self, config: StoreConfig, policy: Optional[EvictionPolicy], loop: LoopThread) -> None:
        # Use TieredStore.open(); this constructor only sets fields. It runs on the store loop, and
        # _open builds the parts once the store's files and resources are there.
        self.config = config
        self._loop_thread = loop
        self._policy = policy or FutureOrderPolicy()
        self._calls = Calls(loop, config.path)
        self._stats = StoreStats()
        self._close_task: Optional[asyncio.Task[None]] = None
        self._files: Optional[OpenedFiles] = None

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
        """Lock the directories and load the manifest, start the resources, then build the parts."""
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
        self._host = HostBackend(cfg.host_bytes, self._cpu_pool, pin=cuda, prefault=cfg.prefault_host)
        self._tiers = Tiers({Tier.DEVICE: self._device, Tier.HOST: self._host, Tier.NVME: self._nvme}, self._policy)
        self._codec = Codecs(self._cpu_pool, cache_bytes=cfg.codec_cache_bytes)
        self._compression = CompressionPolicy(cfg.compress, cfg.compress_policy)
        records = self._files.loaded.records
        committed = {rec.key: rec.generation for rec in records}
        self._commits = CommitLog(
            self._manifest, self._nvme, self._manifest_thread, durable=cfg.durable, committed_generations=committed
        )
        self._versions = Versions(cfg.path, self._tiers, self._commits, self._stats,
                                  damaged=self._files.loaded.damaged,
                                  first_generation=max(committed.values(), default=-1) + 1)
        for rec in records:
            self._versions.adopt(rec)
        await loop.run_in_executor(self._manifest_thread, self._manifest.upgrade, records)
        await loop.run_in_executor(self._manifest_thread, self._manifest.record_location)
        self._build_parts()

    def _build_parts(self) -> None:
        """The parts that run the calls, each given what it works on (see the module's docstring)."""
        self._transfers = Transfers(self._tiers, self._commits, self._codec, self._compression, self._stats,
                                    self._calls.track)
        self._ops = Operations(self._versions, self._transfers, self._results, self._cpu_pool, self._stats)
        self._batches = Batches(self._ops)
        self._renames = Renames(self._versions)
        self._modifications = Modifications(self._ops)
        self.sync = SyncStore(self._calls, self._ops, self._batches, self._renames, self.prefetch, self.modify,
                              self._close_blocking)

    async def close(self) -> None:
        """Finish transfers in flight, write dirty entries down (``flush_on_close``), and stop.

        Idempotent. Afterwards every method raises StoreClosedError. In a process forked from the
        one that opened the store, StoreForkedError: the store is the opener's to close.
        """
        if not self._may_close():
            return
        try:
            await asyncio.wrap_future(self._loop_thread.submit(self._close()))
        finally:
            self._stop()

    def _close_blocking(self) -> None:
        """:meth:`close` for callers without a loop (``store.sync.close()``, ``with``, the exit hook)."""
        if not self._may_close():
            return
        try:
            self._loop_thread.submit(self._close()).result()
        finally:
            self._stop()

    def _may_close(self) -> bool:
        """Both ways of closing: False when closed already; StoreForkedError in a forked child,
        RuntimeError on the store's own loop thread (it would wait for itself)."""
        self._calls.check_process()
        if self._calls.closed:
            return False
        if self._loop_thread.on_loop_thread():
            raise RuntimeError("TieredStore.close() cannot run on the store's own loop thread")
        return True

    def _stop(self) -> None:
        self._calls.closed = True
        self._loop_thread.stop()

    async def _close(self) -> None:
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close_once())
        await asyncio.shield(self._close_task)

    async def _close_once(self) -> None:
        # See [Note: closing].
        self._calls.closing = True
        self._modifications.abandon_all()  # gets and transfers waiting for a block would hold the close up
        await self._calls.wait_for_tasks()
        failures = None
        try:
            failures = await self._ops.write_down() if self.config.flush_on_close else {}
        finally:
            try:
                await self._commits.drain()
                if failures == {}:  # a clean close ([Note: free space at close] in tiered.backends.free_space)
                    await self._nvme.give_back_free_space()
            finally:
                await self._release_resources()
        if failures:
            raise lost_at_close(failures, len(self._versions.entries))

    async def _release_resources(self) -> None:
        loop = asyncio.get_running_loop()
        if hasattr(self, "_manifest"):
            await loop.run_in_executor(self._manifest_thread, self._manifest.close)
        for name in ("_device", "_nvme", "_host"):  # those an open that failed part way had made
            if hasattr(self, name):
                await getattr(self, name).close()
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
        self._close_blocking()

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
        policy finds it worth the room ([Note: Kept copies] in tiered.store.transfers): a write-through cache.
        """
        check_keep(keep, tier)
        return await self._calls.call(self._ops.put, key, tensor, tier, compress, ready_event(tensor), keep)

    async def get(
        self, key: str, device: "torch.device | str" = "cpu", *, out: Optional[torch.Tensor] = None,
        keep: "Tier | str | None" = None,
    ) -> torch.Tensor:
        """A new tensor with the entry's exact bytes, dtype and shape, on ``device``.

        With ``out`` (contiguous, same dtype and shape), the bytes land there instead; a CUDA ``out``
        is written once the work queued so far on the caller's current stream has finished. Waits for
        a prefetch of the key that is in flight instead of reading the slower copy again. A get does
        not promote, unless ``keep`` (host or device) asks the store to keep a copy of what it read
        from a slower tier there, when the eviction policy finds it worth the room
        ([Note: Kept copies] in tiered.store.transfers).
        """
        check_keep(keep)
        return await self._calls.call(self._ops.get, key, device, out, ready_event(out), keep)

    def prefetch(self, key: str, tier: "Tier | str" = Tier.HOST) -> Prefetch:
        """Start bringing ``key`` into ``tier`` and return at once; the handle is awaitable.

        Prefetches of the same key and tier coalesce into one transfer.
        """
        self._calls.check_open()
        self._versions.entry(key)
        return Prefetch(self._calls.submit(self._ops.prefetch, key, tier), self._loop_thread.on_loop_thread)

    async def evict(self, key: str, tier: "Tier | str" = Tier.NVME) -> None:
        """Keep ``key`` only in ``tier`` and below: drop faster copies, writing the entry down
        first only when no copy at or below ``tier`` exists (a clean drop costs no I/O)."""
        return await self._calls.call(self._ops.evict, key, tier)

    async def delete(self, key: str) -> None:
        """Remove ``key`` from every tier and from the manifest (durably)."""
        return await self._calls.call(self._ops.delete, key)

    async def pin(self, key: str, tier: "Tier | str | None" = None) -> None:
        """Exempt ``key``'s copies from eviction; with ``tier``, first bring a copy there."""
        return await self._calls.call(self._ops.pin, key, tier)

    async def unpin(self, key: str) -> None:
        """Make ``key`` evictable again."""
        return await self._calls.call(self._ops.unpin, key)

    async def flush(self, keys: Optional[Sequence[str]] = None) -> None:
        """Write every entry without an nvme copy down to nvme and commit it; with ``keys``, only
        those keys' entries (KeyNotFoundError naming any that is missing). Copies in faster tiers
        stay, now clean."""
        checked = None if keys is None else key_list(keys, "flush")
        return await self._calls.call(self._ops.flush, checked)

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
        self._calls.check_open()
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
        self._calls.check_open()
        self._results.resize(nbytes)

    def set_access_order(self, keys: Optional[Sequence[str]]) -> None:
        """Tell the eviction policy the future access order (one repeating iteration); None drops it."""
        self._calls.check_open()
        order = list(keys) if keys is not None else None
        self._loop_thread.loop.call_soon_threadsafe(self._policy.set_future_order, order)

    def __contains__(self, key: object) -> bool:
        self._calls.check_process()
        return key in self._versions.entries

    def __len__(self) -> int:
        self._calls.check_process()
        return len(self._versions.entries)

    def keys(self) -> list[str]:
        """Every key in the store (a key whose manifest record is damaged is not one)."""
        self._calls.check_process()
        return list(self._versions.entries)

    def info(self, key: str) -> EntryInfo:
        """dtype, shape, nbytes, stored_nbytes, tiers, codec, dirty and pinned of ``key``.

        Raises TypeError for a key that is not a string, KeyNotFoundError for a key not in the store,
        ManifestError for a key whose manifest record is damaged.
        """
        self._calls.check_process()
        return self._versions.entry(key).info()

    def stats(self) -> StoreStats:
        """A snapshot of occupancy, traffic, hits and misses, evictions and time spent on I/O."""
        self._calls.check_process()
        s = StoreStats(**{k: v for k, v in vars(self._stats).items() if k != "tiers"})
        for tier, backend in self._tiers.backends.items():
            t = s.tiers[tier]
            own = self._stats.tiers[tier]
            for field in ("hits", "misses", "evictions", "bytes_in", "bytes_out"):
                setattr(t, field, getattr(own, field))
            t.budget_bytes = backend.budget
            t.used_bytes = backend.used
            t.entries = len(self._tiers.resident[tier])
        s.entries = len(self._versions.entries)
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
        self._calls.check_process()
        files = self._nvme.files
        entry_bytes = sum(
            c.footprint for e in list(self._versions.entries.values()) if (c := e.copies.get(Tier.NVME)) is not None
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
        self._calls.check_process()
        copy = self._versions.entry(key).copies.get(Tier.NVME)
        if copy is None:
            return ()
        assert isinstance(copy, NvmeCopy)
        return self._nvme.layout(copy)

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
        ([Note: Kept copies] in tiered.store.transfers).
        """
        pairs = batch_items(items)
        compresses = batch_compress(compress, pairs)
        check_atomic(atomic, tier)
        check_keep(keep, tier)
        return await self._calls.call(self._batches.put_many, pairs, tier, compresses,
                                     [ready_event(t) for _, t in pairs], atomic, keep)

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
        return await self._calls.call(self._batches.get_many, keys, device, outs, [ready_event(o) for o in outs or ()])

    async def rename(self, src: str, dst: str) -> None:
        """Move the value of ``src`` to the key ``dst`` (replacing any value ``dst`` had); ``src`` is
        gone afterwards. No byte is read or written: the entry keeps its copies and extents.

        Durable when it returns, and atomic: after a crash at any moment either the value is under
        ``dst`` and ``src`` is absent, or both keys are as they were ([Note: Renames] in tiered.store.renames).

        Raises:
            TypeError / ValueError: a key that is not a valid string, or ``src == dst``.
            KeyNotFoundError: ``src`` is not in the store (ManifestError: its record is damaged).
            CapacityError / ManifestError: the manifest could not commit; nothing changed.
        """
        await self.rename_many([(src, dst)])

    async def rename_many(self, pairs: Iterable[tuple[str, str]], *, durable: bool = True) -> None:
        """:meth:`rename` of several ``(src, dst)`` pairs as one transaction: every pair moves, or
        (when the call raises, or after a crash) none does. A key may appear once in the whole call.

        ``durable=False`` skips the flush of the manifest that makes the renames durable on their
        own: they are applied at once and in order with every other change, and become durable with
        the next change that is (a put to nvme, a delete, a durable rename, a flush that writes
        down, close). A power loss before that may find none of the pairs moved, as if the call had
        not been made, never some (a killed process keeps them). For keeping values aside before
        writing their replacements: the write's flush then covers both ([Note: changes without a
        flush] in tiered.manifest.commits). TypeError when ``durable`` is not a bool."""
        checked = rename_pairs(pairs)
        return await self._calls.call(self._renames.rename_many, checked, check_durable(durable))

    def modify(self, key: str, tier: "Tier | str | None" = None) -> Modification:
        """Change the value of ``key`` in place: ``async with store.modify(key) as t: t.mul_(2)``.

        ``t`` has the entry's dtype and shape. When the entry's fastest copy is one contiguous range
        of CPU memory (host tier; device tier without a GPU), ``t`` is that memory and nothing is
        copied. Otherwise ``t`` is a new CPU tensor holding the value, written back when the block
        exits: into the same memory when the entry was in host or device memory, else put to
        ``tier`` (None: back to nvme, durably). The new value replaces the old as a put would (an
        older committed version is retired; one in memory is written down when evicted, flushed or
        on close).

        Until the block exits, the key's gets, puts, deletes and transfers wait for it: do not call
        them for the same key inside the block (they would wait for ever), and do not use ``t``
        after it. If the block raises, the key keeps what the block wrote so far, as a tensor
        changed in place by a failing function would. KeyNotFoundError if the key is absent.
        """
        self._calls.check_open()
        check_key(key)
        return Modification(self._calls, self._modifications, key, None if tier is None else Tier.parse(tier))
