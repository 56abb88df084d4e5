"""TieredStore: keys -> tensors over device memory, host buffers and nvme swap files.

Every piece of store state is owned by the store's own event loop (one thread). Public coroutines
may be awaited from any other loop: they hand the work to the store's loop and await the result,
and the work is shielded there, so a cancelled caller never leaves a transfer half-applied.
Syscalls, copies, checksums and codecs run on worker threads; the loop only does bookkeeping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import fcntl
import functools
import itertools
import os
import threading
import time
import weakref
from typing import Any, Awaitable, Callable, Iterable, Mapping, Optional, Sequence, TypeVar

import torch

from tiered.backends import Copy, DeviceBackend, HostBackend, NvmeBackend, NvmeCopy, TierBackend
from tiered.codecs import Codecs, CompressionPolicy
from tiered.commits import CommitLog
from tiered.config import StoreConfig
from tiered.entry import RAW, Entry, EntryInfo
from tiered.errors import (
    CapacityError,
    ChecksumError,
    KeyNotFoundError,
    ManifestError,
    StoreClosedError,
    StoreLockedError,
    TieredError,
    TransferError,
)
from tiered.io import IOEngine, ResultPool
from tiered.io.mailbox import FutureReply, LoopReply, Mailbox
from tiered.keylocks import KeyLocks
from tiered.loop import LoopThread
from tiered.manifest import Manifest, Record
from tiered.policy import EvictionPolicy, FutureOrderPolicy
from tiered.spans import Span, new_result, spans_of_tensor
from tiered.stats import NvmeSpace, StoreStats
from tiered.tier import TIERS_TOP_DOWN, Tier

T = TypeVar("T")
LOCK_NAME = "LOCK"
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


class Prefetch:
    """Handle of a prefetch: awaitable from any event loop, or waited on with :meth:`result`.

    Cancelling the handle stops waiting; the transfer itself completes in the background.
    """

    def __init__(
        self, future: "concurrent.futures.Future[None]", on_store_thread: Optional[Callable[[], bool]] = None
    ) -> None:
        self._future = future
        self._on_store_thread = on_store_thread

    def __await__(self):  # noqa: ANN204 - generator protocol
        return asyncio.wrap_future(self._future).__await__()

    def done(self) -> bool:
        """True once the transfer finished (or failed)."""
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> None:
        """Block until the transfer finished; re-raise its error. Not on the store's own loop thread
        (RuntimeError there: the transfer needs that thread), where the handle can be awaited."""
        if self._on_store_thread is not None and not self._future.done() and self._on_store_thread():
            raise RuntimeError("Prefetch.result() cannot block on the store's own loop thread; await the handle")
        self._future.result(timeout)

    def cancel(self) -> bool:
        """Stop waiting for the transfer."""
        return self._future.cancel()


class TieredStore:
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
        self._key_locks = KeyLocks()  # puts and deletes of one key run one at a time
        self._tasks: set[asyncio.Task[Any]] = set()
        self._generation = itertools.count()
        self._stats = StoreStats()
        self._closed = False
        self._closing = False
        self._close_task: Optional[asyncio.Task[None]] = None
        self._lock_fd = -1
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
        _close_at_exit(store)
        return store

    async def _open(self) -> None:
        cfg = self.config
        try:
            os.makedirs(cfg.path, mode=0o700, exist_ok=True)
            self._lock_fd = _acquire_lock(os.path.join(cfg.path, LOCK_NAME))
        except OSError as exc:
            raise _unusable_directory(exc, "StoreConfig.path", cfg.path) from exc
        device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cuda = device.type == "cuda"
        self._cpu_pool = concurrent.futures.ThreadPoolExecutor(cfg.cpu_threads, thread_name_prefix="tiered-cpu")
        self._manifest_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiered-manifest")
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
        try:
            self._nvme = NvmeBackend(
                cfg.nvme_paths,  # type: ignore[arg-type]
                files_per_dir=cfg.swap_files_per_dir,
                budget=cfg.nvme_bytes,
                grow_bytes=cfg.swap_grow_bytes,
                io=self._io,
                direct=cfg.direct_io,
            )
        except OSError as exc:
            raise _unusable_directory(exc, "StoreConfig.nvme_paths", exc.filename or str(cfg.nvme_paths)) from exc
        self._backends[Tier.NVME] = self._nvme
        self._codec = Codecs(self._cpu_pool)
        self._compression = CompressionPolicy(cfg.compress, cfg.compress_policy)
        layout = {"nvme_paths": list(cfg.nvme_paths), "swap_files_per_dir": cfg.swap_files_per_dir}  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        swap_bytes = sum(f.alloc.capacity for f in self._nvme.files)
        self._manifest = await loop.run_in_executor(
            self._manifest_thread, functools.partial(Manifest, cfg.path, layout, swap_bytes=swap_bytes)
        )
        records = await loop.run_in_executor(self._manifest_thread, self._manifest.load)
        committed: dict[str, int] = {}
        for rec in records:
            self._adopt(rec)
            committed[rec.key] = rec.generation
        self._generation = itertools.count(max(committed.values(), default=-1) + 1)
        self._commits = CommitLog(
            self._manifest, self._nvme.sync, self._manifest_thread, durable=cfg.durable, committed_generations=committed
        )

    def _adopt(self, rec: Record) -> None:
        """Rebuild an entry from its committed record; its extents become used, all else is free."""
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
            rec.key, rec.dtype, rec.shape, rec.nbytes, rec.generation,
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
        self._closing = True
        current = asyncio.current_task()
        while True:
            pending = {t for t in self._tasks if t is not current and not t.done()}
            if not pending:
                break
            await asyncio.wait(pending)
        try:
            if self.config.flush_on_close:
                await self._flush()
            await self._commits.drain()
        finally:
            await self._release_resources()

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
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = -1

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
        self, key: str, tensor: torch.Tensor, tier: "Tier | str" = Tier.NVME, compress: Optional[bool] = None
    ) -> None:
        """Store a copy of ``tensor`` under ``key`` in ``tier``, replacing any previous value.

        The caller may reuse ``tensor`` as soon as this returns (not before). A put to nvme is
        durable when it returns; a put to host or device is written down when evicted, flushed or
        on close. ``compress=True`` stores the nvme copy compressed (lossless, bplane-zstd);
        None leaves it to the config's ``compress`` and ``compress_policy`` (docs/compression.md).
        """
        return await self._call(self._put, key, tensor, tier, compress, _ready_event(tensor))

    async def get(self, key: str, device: "torch.device | str" = "cpu", *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A new tensor with the entry's exact bytes, dtype and shape, on ``device``.

        With ``out`` (contiguous, same dtype and shape), the bytes land there instead. Waits for a
        prefetch of the key that is in flight instead of reading the slower copy again.
        """
        return await self._call(self._get, key, device, out)

    async def put_many(
        self, items: "Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]", tier: "Tier | str" = Tier.NVME,
        compress: Optional[bool] = None,
    ) -> None:
        """:meth:`put` of many tensors as one operation: ``items`` maps keys to tensors, or lists (key, tensor) pairs.

        To nvme, the tensors are written into one run of swap-file extents with few vectored syscalls
        and committed by one group commit (one fdatasync round, one manifest transaction), so each
        costs a fraction of a put; every key is durable when this returns. Each entry keeps its own
        CRCs, generation and record, exactly as a put would write it.

        Bad input (a non-string key, a non-tensor, the same key twice: ValueError) is refused before
        anything is stored. Otherwise the call is not all-or-nothing: when some entries fail (a full
        tier, an I/O error), the others are still stored, and the call then raises an error of the
        first failure's type whose message names every failed key. Whatever happens, including a
        crash, each key holds either its old or its new value, never a mix of the two: a named key is
        left as a failed :meth:`put` of it would leave it, every other key holds its new value.
        """
        pairs = _batch_items(items)
        return await self._call(self._put_many, pairs, tier, compress, [_ready_event(t) for _, t in pairs])

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
        keys, outs = _batch_keys(keys, out)
        return await self._call(self._get_many, keys, device, outs)

    def prefetch(self, key: str, tier: "Tier | str" = Tier.HOST) -> Prefetch:
        """Start bringing ``key`` into ``tier`` and return at once; the handle is awaitable.

        Prefetches of the same key and tier coalesce into one transfer.
        """
        self._check_open()
        _check_key(key)
        if key not in self._entries:
            raise KeyNotFoundError(f"key {key!r} is not in the store")
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

    async def flush(self) -> None:
        """Write every entry without an nvme copy down to nvme and commit it."""
        return await self._call(self._flush)

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
        """Every key in the store."""
        return list(self._entries)

    def info(self, key: str) -> EntryInfo:
        """dtype, shape, nbytes, stored_nbytes, tiers, codec, dirty and pinned of ``key``."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyNotFoundError(f"key {key!r} is not in the store")
        return entry.info()

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
        if hasattr(self, "_commits"):
            s.manifest_commits = self._commits.commits
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
        flight cost a few wakeups, not two per call.
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
        if self._loop_thread.on_loop_thread():
            raise RuntimeError(
                "the sync facade (store.sync) cannot be used on the store's own loop thread; await the async method"
            )
        return self._submit(fn, *args).result()

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
        self, key: str, tensor: torch.Tensor, tier: "Tier | str", compress: Optional[bool], ready: Any = None
    ) -> None:
        _check_key(key)
        _check_tensor(tensor)
        if ready is not None:  # kernels the caller queued that write `tensor` must finish first
            await self._in_cpu_pool(ready.synchronize)
        tier = Tier.parse(tier)
        _check_compress(compress)
        data = _plain(tensor)
        if data is None:
            data = await self._in_cpu_pool(_dense_copy, tensor)
        await self._key_locks.acquire(key)
        try:
            await self._put_locked(key, data, tier, compress)
        finally:
            self._key_locks.release(key)

    async def _put_locked(self, key: str, data: torch.Tensor, tier: Tier, compress: Optional[bool]) -> None:
        """The put of one key whose lock the caller holds; ``data`` is contiguous."""
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

    async def _finish_put(self, entry: Entry, tier: Tier, copy: Copy) -> None:
        """Make a written ``entry`` the key's current version and retire the old one.

        Awaits only for a memory-tier put over a persisted key (its tombstone must commit first).
        """
        key = entry.key
        old = self._entries.get(key)
        self._entries[key] = entry
        self._settle(tier, copy)
        self._add_copy(entry, tier, copy)
        self._wake(tier)
        self._stats.puts += 1
        if tier is not Tier.NVME:  # _write_nvme counted nvme's bytes_in
            self._stats.tiers[tier].bytes_in += entry.nbytes
        self._policy.touch(key)
        if old is not None:
            entry.pinned = old.pinned
            if old.persisted and tier is not Tier.NVME:
                # The old version must not come back after a crash once a newer one was put.
                await self._retire_durably(old, entry.generation)
            else:
                self._retire(old)

    async def _put_many(
        self, pairs: list[tuple[str, torch.Tensor]], tier: "Tier | str", compress: Optional[bool], ready: list[Any]
    ) -> None:
        tier = Tier.parse(tier)
        _check_compress(compress)
        events = [e for e in ready if e is not None]
        if events:
            await self._in_cpu_pool(lambda: [e.synchronize() for e in events])
        datas = [_plain(t) for _, t in pairs]
        odd = [i for i, d in enumerate(datas) if d is None]
        if odd:  # one trip to the cpu pool for every tensor that needs a dense copy
            dense = await self._in_cpu_pool(lambda: [_dense_copy(pairs[i][1]) for i in odd])
            for i, d in zip(odd, dense):
                datas[i] = d
        keys = [k for k, _ in pairs]
        failures: dict[str, BaseException] = {}
        locked = await self._key_locks.acquire_all(keys)
        try:
            if tier is Tier.NVME:
                await self._put_many_nvme(keys, datas, compress, failures)  # type: ignore[arg-type]
            else:
                results = await asyncio.gather(
                    *(self._put_locked(k, d, tier, compress) for k, d in zip(keys, datas)),  # type: ignore[arg-type]
                    return_exceptions=True,
                )
                for k, r in zip(keys, results):
                    if isinstance(r, BaseException):
                        failures[k] = r
        finally:
            self._key_locks.release_all(locked)
        if failures:
            raise _batch_error("put_many", failures, len(keys))

    async def _put_many_nvme(
        self, keys: list[str], datas: list[torch.Tensor], compress: Optional[bool], failures: dict[str, BaseException]
    ) -> None:
        """Write every key's tensor in one allocation run, few syscalls and one group commit, then install
        the ones that committed. What failed is added to ``failures``; those keys keep their old value."""
        entries = [Entry(k, d.dtype, tuple(d.shape), d.numel() * d.element_size(), next(self._generation),
                         compress=compress) for k, d in zip(keys, datas)]
        started = time.perf_counter()
        written = await self._write_nvme_many(entries, [spans_of_tensor(d) for d in datas], failures)
        self._stats.io_wait_seconds += time.perf_counter() - started
        for entry, copy in zip(entries, written):
            if copy is not None:
                await self._finish_put(entry, Tier.NVME, copy)  # never waits: the new version is on nvme

    async def _get(self, key: str, device: "torch.device | str", out: Optional[torch.Tensor]) -> torch.Tensor:
        _check_key(key)
        device = _parse_device(device)
        entry = self._entry(key)
        if entry.moving:
            top = entry.top()
            faster = [task for t, task in entry.moving.items() if top is None or t.rank < top.rank]
            if faster:
                await asyncio.wait(faster)  # a failed prefetch only means we read the slower copy
                entry = self._entry(key)
        if out is None:
            result, dst = new_result(entry.shape, entry.dtype, device, self._results)
        else:
            _check_out(out, entry)
            result, dst = out, spans_of_tensor(out)
        tier = entry.top()
        assert tier is not None
        copy = self._begin_read(entry, tier)
        started = time.perf_counter()
        try:
            await self._read_copy(entry, tier, copy, dst)
        finally:
            self._end_read(tier, copy)
        if tier is Tier.NVME:
            self._stats.io_wait_seconds += time.perf_counter() - started
        self._count_get(entry, tier)
        return result

    def _count_get(self, entry: Entry, tier: Tier) -> None:
        stats = self._stats
        stats.gets += 1
        stats.tiers[tier].hits += 1
        stats.tiers[tier].bytes_out += entry.nbytes
        for above in TIERS_TOP_DOWN[: tier.rank]:
            stats.tiers[above].misses += 1
        self._policy.touch(entry.key)

    async def _get_many(
        self, keys: list[str], device: "torch.device | str", outs: Optional[list[Optional[torch.Tensor]]]
    ) -> list[torch.Tensor]:
        device = _parse_device(device)
        entries = self._entries_of(keys)
        faster = {task for e in entries if e.moving
                  for t, task in e.moving.items() if (top := e.top()) is None or t.rank < top.rank}
        if faster:
            await asyncio.wait(faster)  # a failed prefetch only means we read the slower copy
            entries = self._entries_of(keys)
        results: list[torch.Tensor] = []
        dsts: list[list[Span]] = []
        for i, entry in enumerate(entries):
            out = outs[i] if outs is not None else None
            if out is None:
                result, dst = new_result(entry.shape, entry.dtype, device, self._results)
            else:
                _check_out(out, entry)
                result, dst = out, spans_of_tensor(out)
            results.append(result)
            dsts.append(dst)
        tiers = [e.top() for e in entries]
        copies = [self._begin_read(e, t) for e, t in zip(entries, tiers)]  # type: ignore[arg-type]
        batch = [i for i, (e, t) in enumerate(zip(entries, tiers)) if t is Tier.NVME and e.codec == RAW]
        batched = set(batch)
        alone = [i for i in range(len(entries)) if i not in batched]
        errors: list[Optional[BaseException]] = [None] * len(entries)
        started = time.perf_counter()
        try:
            coros: list[Awaitable[Any]] = [self._read_copy(entries[i], tiers[i], copies[i], dsts[i]) for i in alone]
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
                errors[i] = _read_error(error, entries[i].key) if error is not None else None
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
            raise _batch_error("get_many", failures, len(keys))
        return results

    def _entries_of(self, keys: Sequence[str]) -> list[Entry]:
        """The current entries of ``keys``; KeyNotFoundError naming every missing key."""
        entries = [self._entries.get(k) for k in keys]
        missing = [k for k, e in zip(keys, entries) if e is None]
        if missing:
            raise KeyNotFoundError(f"{len(missing)} of {len(keys)} keys are not in the store: {missing!r}")
        return entries  # type: ignore[return-value]

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
        _check_key(key)
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
        _check_key(key)
        await self._key_locks.acquire(key)
        try:
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

    async def _flush(self) -> None:
        tasks = [self._materialize(e, Tier.NVME) for e in list(self._entries.values()) if e.dirty]
        pending = [t for t in tasks if t is not None]
        if pending:
            results = await asyncio.gather(*(asyncio.shield(t) for t in pending), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]

    # ------------------------------------------------------------------ moving copies between tiers

    def _materialize(self, entry: Entry, tier: Tier) -> "Optional[asyncio.Task[None]]":
        """Start (or join) a transfer that gives ``entry`` a copy in ``tier``; None if it has one."""
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
                # still points at these extents, so they must not be reused yet.
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
                await self._read_copy(entry, source, src_copy, self._backends[tier].spans(new))  # type: ignore[arg-type]
            finally:
                self._end_read(source, src_copy)
        except BaseException:
            self._discard(tier, new)
            raise
        self._stats.transfers += 1
        self._stats.tiers[tier].bytes_in += entry.nbytes
        self._install(entry, tier, new)
        self._policy.touch(entry.key, access=False)

    async def _write_nvme(self, entry: Entry, src: Sequence[Span]) -> Optional[NvmeCopy]:
        """Write ``src`` (the entry's bytes) to new extents and commit a record for it.

        Returns the copy, or None when a newer version of the key committed first.
        """
        entry.persisted = True  # from now on a delete or put of this key must write a tombstone
        payload = await self._encode(entry, src)
        try:
            copy = await self._admit(Tier.NVME, payload.nbytes)
            try:
                started = time.perf_counter()
                await self._nvme.store(copy, payload.spans)
                self._compression.observe_write(payload.nbytes, time.perf_counter() - started)
            except BaseException as exc:
                self._discard(Tier.NVME, copy)
                if isinstance(exc, OSError):
                    raise _naming_key(exc, "writing", entry.key) from exc
                raise
        finally:
            payload.close()
        try:
            applied = await self._commits.submit(entry.key, entry.generation, payload.record(entry, copy), copy)
        except BaseException as exc:
            self._discard(Tier.NVME, copy)
            if isinstance(exc, (OSError, TieredError)):
                raise _naming_key(exc, "committing", entry.key) from exc
            raise
        if not applied:
            self._discard(Tier.NVME, copy)
            return None
        self._written(entry, payload)
        return copy

    async def _write_nvme_many(
        self, entries: list[Entry], srcs: list[list[Span]], failures: dict[str, BaseException]
    ) -> list[Optional[NvmeCopy]]:
        """:meth:`_write_nvme` for new versions of distinct keys whose locks the caller holds: one
        allocation run, coalesced writes, one group commit. Returns each entry's committed copy, or
        None with its error in ``failures``."""
        for entry in entries:
            entry.persisted = True
        payloads = await asyncio.gather(*(self._encode(e, s) for e, s in zip(entries, srcs)), return_exceptions=True)
        todo = []
        for entry, payload in zip(entries, payloads):
            if isinstance(payload, BaseException):
                failures[entry.key] = payload
            else:
                todo.append((entry, payload))
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
        requests = []
        for i, ((entry, payload), copy, error) in enumerate(zip(todo, allocated, errors)):
            if error is not None:
                self._discard(Tier.NVME, copy)
                copies[i] = None
                failures[entry.key] = _naming_key(error, "writing", entry.key) if isinstance(error, OSError) else error
            else:
                record = payload.record(entry, copy)
                requests.append((i, self._commits.submit(entry.key, entry.generation, record, copy)))
        results = await asyncio.gather(*(r for _, r in requests), return_exceptions=True)
        for (i, _), applied in zip(requests, results):
            entry, payload = todo[i]
            copy = copies[i]
            assert copy is not None
            if isinstance(applied, BaseException):
                self._discard(Tier.NVME, copy)
                copies[i] = None
                failures[entry.key] = (_naming_key(applied, "committing", entry.key)
                                       if isinstance(applied, (OSError, TieredError)) else applied)
            else:
                assert applied, "put_many holds the key locks, so nothing newer can supersede it"
                self._written(entry, payload)
        by_entry = {id(e): c for (e, _), c in zip(todo, copies)}
        return [by_entry.get(id(e)) for e in entries]

    async def _encode(self, entry: Entry, src: Sequence[Span]) -> "_Payload":
        """What goes to disk for ``entry``: its bytes, or their compressed form when that is wanted and pays."""
        if not (entry.nbytes and self._compression.wants(entry.compress)):
            return _Payload(src, entry.nbytes)
        host = await self._host_bytes(src, entry.nbytes)
        started = time.perf_counter()
        encoded = await self._codec.encode(host, entry.dtype)
        elapsed = time.perf_counter() - started if encoded is not None else 0.0
        self._compression.observe_encode(entry.nbytes, encoded.nbytes if encoded else entry.nbytes, elapsed)
        if encoded is None:
            return _Payload(src, entry.nbytes)
        return _Payload(encoded.spans(), encoded.nbytes, encoded.codec, encoded.meta, encoded)

    def _written(self, entry: Entry, payload: "_Payload") -> None:
        """Bookkeeping once an entry's nvme record committed."""
        entry.codec, entry.codec_meta, entry.stored_nbytes = payload.codec, payload.meta, payload.nbytes
        self._stats.bytes_before_codec += entry.nbytes
        self._stats.bytes_after_codec += payload.nbytes
        self._stats.tiers[Tier.NVME].bytes_in += entry.nbytes

    async def _read_copy(self, entry: Entry, tier: Tier, copy: Copy, dst: Sequence[Span]) -> None:
        """Fill ``dst`` with the entry's bytes from its copy in ``tier``."""
        if tier is not Tier.NVME:
            await self._device.copy(dst, self._memory_spans(tier, copy))
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
            raise _read_error(exc, entry.key) from exc

    async def _store_memory(self, tier: Tier, copy: Copy, src: Sequence[Span]) -> None:
        await self._device.copy(self._backends[tier].spans(copy), src)  # type: ignore[arg-type]

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

    # ------------------------------------------------------------------ budgets and eviction

    async def _admit(self, tier: Tier, nbytes: int) -> Copy:
        """Allocate ``nbytes`` in ``tier``, evicting victims (writing dirty ones down) as needed.

        Waits while the only bytes that could be freed belong to transfers in flight; raises
        CapacityError when even evicting everything evictable could not make room.
        """
        backend = self._backends[tier]
        if tier is Tier.NVME:  # no eviction below nvme; allocate() checks the budget itself
            copy = await backend.allocate(nbytes)
            self._inflight[tier] += copy.footprint
            return copy
        backend.check_fits_budget(nbytes)
        async with self._tier_locks[tier]:
            while not backend.has_room(nbytes):
                victim = self._pick_victim(tier)
                if victim is not None:
                    await self._make_room(victim, tier)
                    continue
                pinned = self._pinned_bytes(tier)
                if backend.used > pinned:
                    waiter = asyncio.get_running_loop().create_future()
                    self._space_waiters[tier].append(waiter)
                    await waiter
                    continue
                raise CapacityError(
                    f"{tier.value} tier: {nbytes} bytes do not fit; {backend.used} of {backend.budget} bytes are "
                    f"in use and {pinned} of them are pinned; unpin entries or raise the budget"
                )
            copy = await backend.allocate(nbytes)
            self._inflight[tier] += copy.footprint
            return copy

    def _pick_victim(self, tier: Tier) -> Optional[Entry]:
        resident = self._resident[tier]
        for key in self._policy.victims(resident):
            entry = self._entries.get(key)
            if entry is None or tier not in entry.copies:
                continue
            if entry.pinned or tier in entry.leaving or entry.copies[tier].readers:
                continue
            return entry
        return None

    def _pinned_bytes(self, tier: Tier) -> int:
        return sum(
            e.copies[tier].footprint for k in self._resident[tier] if (e := self._entries[k]).pinned
        )

    async def _make_room(self, entry: Entry, tier: Tier) -> None:
        """Remove ``entry``'s copy from ``tier``: a plain drop when a slower copy exists, else a write down."""
        self._stats.tiers[tier].evictions += 1
        if any(t.rank > tier.rank for t in entry.copies):
            self._drop_copy(entry, tier)
            return
        entry.leaving.add(tier)
        try:
            dest = tier.below()
            assert dest is not None
            host = self._backends[Tier.HOST]
            if dest is Tier.HOST and host.budget is not None and host.footprint(entry.nbytes) > host.budget:
                dest = Tier.NVME
            task = self._materialize(entry, dest)
            if task is not None:
                await asyncio.shield(task)
        finally:
            entry.leaving.discard(tier)
        if self._entries.get(entry.key) is entry and tier in entry.copies:
            self._drop_copy(entry, tier)

    def _wake(self, tier: Tier) -> None:
        waiters, self._space_waiters[tier] = self._space_waiters[tier], []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    # ------------------------------------------------------------------ copy bookkeeping

    def _begin_read(self, entry: Entry, tier: Tier) -> Copy:
        copy = entry.copies[tier]
        copy.readers += 1
        return copy

    def _end_read(self, tier: Tier, copy: Copy) -> None:
        self._backends[tier].end_read(copy)
        self._wake(tier)

    def _add_copy(self, entry: Entry, tier: Tier, copy: Copy) -> None:
        entry.copies[tier] = copy
        self._resident[tier].add(entry.key)

    def _drop_copy(self, entry: Entry, tier: Tier) -> None:
        copy = entry.copies.pop(tier)
        if self._entries.get(entry.key) is entry or entry.key not in self._entries:
            self._resident[tier].discard(entry.key)
        self._backends[tier].release(copy)
        self._wake(tier)

    def _settle(self, tier: Tier, copy: Copy) -> None:
        """A copy allocated by _admit stops counting as in flight."""
        self._inflight[tier] -= copy.footprint

    def _install(self, entry: Entry, tier: Tier, copy: Copy) -> None:
        """Attach a finished copy to its entry, or free it if the entry was replaced meanwhile."""
        self._settle(tier, copy)
        if self._entries.get(entry.key) is entry and tier not in entry.copies:
            self._add_copy(entry, tier, copy)
            self._wake(tier)
        else:
            self._backends[tier].release(copy)
            self._wake(tier)

    def _discard(self, tier: Tier, copy: Copy) -> None:
        self._settle(tier, copy)
        self._backends[tier].release(copy)
        self._wake(tier)

    def _retire(self, entry: Entry) -> None:
        """Release every copy of a replaced or deleted entry (freed once their readers finish)."""
        current = self._entries.get(entry.key)
        for tier in list(entry.copies):
            copy = entry.copies.pop(tier)
            if current is None or tier not in current.copies:
                self._resident[tier].discard(entry.key)
            self._backends[tier].release(copy)
            self._wake(tier)

    async def _retire_durably(self, entry: Entry, generation: int) -> None:
        """Retire an entry whose record may be committed: remove the record first, and only then
        free its extents, so committed extents are never reused while a record points at them."""
        nvme = entry.copies.pop(Tier.NVME, None)
        current = self._entries.get(entry.key)
        if nvme is not None and (current is None or Tier.NVME not in current.copies):
            self._resident[Tier.NVME].discard(entry.key)
        self._retire(entry)
        try:
            await self._commits.submit(entry.key, generation, None, None)
        except BaseException as exc:
            # The old record may still be committed, pointing at these extents: keep them allocated
            # (until the next open) so no later put overwrites them. A delete that failed leaves the
            # key as committed; after a put, the new version's put or delete must try again.
            if current is not None:
                current.persisted = True
            elif nvme is not None and entry.key not in self._entries:
                self._entries[entry.key] = entry
                self._add_copy(entry, Tier.NVME, nvme)
                self._policy.touch(entry.key)
            if isinstance(exc, (OSError, TieredError)):
                raise _naming_key(exc, "removing the committed record of", entry.key) from exc
            raise
        if nvme is not None:
            self._backends[Tier.NVME].release(nvme)

    def _entry(self, key: str) -> Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyNotFoundError(f"key {key!r} is not in the store")
        return entry

    async def _in_cpu_pool(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._cpu_pool, fn, *args)


class SyncStore:
    """Blocking versions of the store's coroutines, for code without an event loop (module hooks).

    Works from any thread except the store's own loop thread.
    """

    def __init__(self, store: TieredStore) -> None:
        self._store = store

    def put(self, key: str, tensor: torch.Tensor, tier: "Tier | str" = Tier.NVME, compress: Optional[bool] = None) -> None:
        """Blocking :meth:`TieredStore.put`."""
        self._store._call_sync(self._store._put, key, tensor, tier, compress, _ready_event(tensor))

    def get(self, key: str, device: "torch.device | str" = "cpu", *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Blocking :meth:`TieredStore.get`."""
        return self._store._call_sync(self._store._get, key, device, out)

    def put_many(
        self, items: "Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]", tier: "Tier | str" = Tier.NVME,
        compress: Optional[bool] = None,
    ) -> None:
        """Blocking :meth:`TieredStore.put_many`."""
        pairs = _batch_items(items)
        self._store._call_sync(self._store._put_many, pairs, tier, compress, [_ready_event(t) for _, t in pairs])

    def get_many(
        self, keys: Sequence[str], device: "torch.device | str" = "cpu", *,
        out: Optional[Sequence[Optional[torch.Tensor]]] = None,
    ) -> list[torch.Tensor]:
        """Blocking :meth:`TieredStore.get_many`."""
        keys, outs = _batch_keys(keys, out)
        return self._store._call_sync(self._store._get_many, keys, device, outs)

    def get_future(
        self, key: str, device: "torch.device | str" = "cpu", *, out: Optional[torch.Tensor] = None
    ) -> "concurrent.futures.Future[torch.Tensor]":
        """Start :meth:`TieredStore.get` and return at once; the future holds the result (``out`` when given).

        ``out`` must not be read or written until the future is done. A CUDA ``out`` is written only after
        the work queued so far on the caller's current stream has finished (memory the caching allocator
        handed back may still be read by queued kernels).
        """
        return self._store._submit(self._get_when_ready, key, device, out, _ready_event(out))

    def put_future(
        self, key: str, tensor: torch.Tensor, tier: "Tier | str" = Tier.NVME, compress: Optional[bool] = None
    ) -> "concurrent.futures.Future[None]":
        """Start :meth:`TieredStore.put` and return at once; ``tensor`` must stay unchanged until the future is done."""
        return self._store._submit(self._store._put, key, tensor, tier, compress, _ready_event(tensor))

    async def _get_when_ready(
        self, key: str, device: "torch.device | str", out: Optional[torch.Tensor], ready: Any
    ) -> torch.Tensor:
        if ready is not None:
            await self._store._in_cpu_pool(ready.synchronize)
        return await self._store._get(key, device, out)

    def prefetch(self, key: str, tier: "Tier | str" = Tier.HOST) -> Prefetch:
        """Same as :meth:`TieredStore.prefetch` (it never blocks)."""
        return self._store.prefetch(key, tier)

    def evict(self, key: str, tier: "Tier | str" = Tier.NVME) -> None:
        """Blocking :meth:`TieredStore.evict`."""
        self._store._call_sync(self._store._evict, key, tier)

    def delete(self, key: str) -> None:
        """Blocking :meth:`TieredStore.delete`."""
        self._store._call_sync(self._store._delete, key)

    def pin(self, key: str, tier: "Tier | str | None" = None) -> None:
        """Blocking :meth:`TieredStore.pin`."""
        self._store._call_sync(self._store._pin, key, tier)

    def unpin(self, key: str) -> None:
        """Blocking :meth:`TieredStore.unpin`."""
        self._store._call_sync(self._store._unpin, key)

    def flush(self) -> None:
        """Blocking :meth:`TieredStore.flush`."""
        self._store._call_sync(self._store._flush)

    def close(self) -> None:
        """Blocking :meth:`TieredStore.close`."""
        store = self._store
        if store._closed:
            return
        if store._loop_thread.on_loop_thread():
            raise RuntimeError("TieredStore.close() cannot run on the store's own loop thread")
        try:
            store._loop_thread.submit(store._close()).result()
        finally:
            store._closed = True
            store._loop_thread.stop()


def _close_at_exit(store: TieredStore) -> None:
    """Close ``store`` at interpreter exit if the program forgot to, so host and device entries
    are flushed and the lock released.

    It must run before concurrent.futures stops its worker pools, which happens in threading's
    exit hooks (run last-registered first), ahead of atexit handlers.
    """
    ref = weakref.ref(store)

    def close() -> None:
        s = ref()
        if s is not None and not s._closed:
            s.sync.close()

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every CPython since 3.9 has it
        import atexit

        atexit.register(close)
    else:
        register(close)


def _acquire_lock(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise StoreLockedError(
            f"the store directory {os.path.dirname(path)} is already open (owner pid {owner}); "
            "close that store first, or use another path"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _check_key(key: object) -> None:
    if not isinstance(key, str):
        raise TypeError(f"keys are strings, got {type(key).__name__}: {key!r}")
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates: the manifest stores keys as UTF-8 text
            raise ValueError(f"key {key!r} is not valid Unicode ({exc.reason} at {exc.start}); use a valid string") \
                from None


def _check_tensor(tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"put takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_nested:
        raise TypeError("put does not take nested tensors; store each component with t.unbind() instead")
    if tensor.layout is not torch.strided:
        raise TypeError(f"put takes dense (strided) tensors, got layout {tensor.layout}; convert with .to_dense()")
    if tensor.device.type == "meta":
        raise TypeError("put takes a tensor with data, got one on the meta device")
    if tensor.dtype in _QUANTIZED or tensor.is_quantized:
        raise TypeError(
            f"put does not take quantized tensors ({tensor.dtype}); store t.int_repr() and the quantizer's "
            "scale and zero point instead"
        )


def _check_compress(compress: object) -> None:
    if compress is not None and not isinstance(compress, bool):
        raise TypeError(f"compress must be True, False or None, got {compress!r}")


def _parse_device(device: "torch.device | str") -> torch.device:
    if isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from None


def _plain(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """``tensor`` without autograd, when its memory already holds its values in order; else None."""
    data = tensor.detach() if tensor.requires_grad else tensor
    if data.is_conj() or data.is_neg() or not data.is_contiguous():
        return None
    return data


def _dense_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor holding ``tensor``'s values (lazy conjugate/negative views resolved)."""
    return tensor.detach().resolve_conj().resolve_neg().contiguous()


def _check_distinct(keys: Sequence[str], what: str) -> None:
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        repeated = sorted({k for k in keys if k in seen or seen.add(k)})  # type: ignore[func-returns-value]
        raise ValueError(f"{what} got the same key more than once: {repeated!r}; pass each key once")


def _batch_items(items: object) -> list[tuple[str, torch.Tensor]]:
    """Validate put_many's items (a mapping or an iterable of (key, tensor) pairs) on the caller's thread."""
    if isinstance(items, Mapping):
        pairs = list(items.items())
    elif isinstance(items, (str, bytes, torch.Tensor)) or not isinstance(items, Iterable):
        raise TypeError(
            f"put_many takes a mapping of keys to tensors or (key, tensor) pairs, got {type(items).__name__}"
        )
    else:
        pairs = []
        for item in items:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(f"put_many takes (key, tensor) pairs, got the item {item!r}")
            pairs.append((item[0], item[1]))
    for key, tensor in pairs:
        _check_key(key)
        _check_tensor(tensor)
    _check_distinct([k for k, _ in pairs], "put_many")
    return pairs


def _batch_keys(
    keys: object, out: Optional[Sequence[Optional[torch.Tensor]]]
) -> tuple[list[str], Optional[list[Optional[torch.Tensor]]]]:
    """Validate get_many's keys and ``out`` on the caller's thread."""
    if isinstance(keys, (str, bytes, torch.Tensor)) or not isinstance(keys, Iterable):
        raise TypeError(f"get_many takes a sequence of keys, got {type(keys).__name__}: {keys!r}")
    keys = list(keys)
    for key in keys:
        _check_key(key)
    _check_distinct(keys, "get_many")
    if out is None:
        return keys, None
    outs = list(out)
    if len(outs) != len(keys):
        raise ValueError(f"out must hold one tensor (or None) per key: {len(keys)} keys, {len(outs)} in out")
    return keys, outs


def _batch_error(doing: str, failures: dict[str, BaseException], total: int) -> BaseException:
    """One error for the failed entries of a batched call: the first failure's type, naming every failed key."""
    first = next(iter(failures.values()))
    keys = list(failures)
    message = f"{doing}: {len(keys)} of {total} entries failed, keys {keys!r}; the first error: {first}"
    try:
        error = type(first)(message) if isinstance(first, TieredError) else TransferError(message)
    except TypeError:  # an error type that takes other arguments
        error = TransferError(message)
    error.__cause__ = first
    return error


def _read_error(exc: BaseException, key: str) -> BaseException:
    """A failed read of one entry, naming its key."""
    if isinstance(exc, ChecksumError):
        return ChecksumError(f"entry {key!r} is corrupt on disk: {exc}")
    if isinstance(exc, TransferError):
        return TransferError(f"reading entry {key!r} failed: {exc}")
    return exc


class _Payload:
    """What an nvme write stores for one entry: its own bytes, or a codec's output (closed after the write)."""

    __slots__ = ("spans", "nbytes", "codec", "meta", "_encoded")

    def __init__(self, spans: Sequence[Span], nbytes: int, codec: str = RAW, meta: bytes = b"",
                 encoded: Any = None) -> None:
        self.spans = spans
        self.nbytes = nbytes
        self.codec = codec
        self.meta = meta
        self._encoded = encoded

    def record(self, entry: Entry, copy: NvmeCopy) -> Record:
        """The manifest record of ``entry`` written to ``copy``."""
        return Record(
            entry.key, entry.dtype, entry.shape, entry.nbytes, self.nbytes, self.codec, self.meta, copy.chunk,
            tuple(copy.extents), tuple(copy.crcs) if copy.crcs is not None else None, entry.generation,
        )

    def close(self) -> None:
        """Free the codec's buffers, if any."""
        if self._encoded is not None:
            self._encoded.close()
            self._encoded = None


def _check_out(out: torch.Tensor, entry: Entry) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != entry.dtype or tuple(out.shape) != entry.shape or not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous with dtype {entry.dtype} and shape {entry.shape}, got dtype {out.dtype}, "
            f"shape {tuple(out.shape)}, contiguous={out.is_contiguous()}"
        )


def _ready_event(tensor: object) -> Any:
    """A CUDA event on the caller's current stream (captured on the caller's thread), or None."""
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event
    return None


def _consume_exception(task: "asyncio.Task[Any]") -> None:
    # Transfers started by prefetch may fail with nobody awaiting them; their error reaches the
    # next waiter (or a get falls back to the slower copy). Mark it retrieved to keep logs clean.
    if not task.cancelled():
        task.exception()


def _naming_key(exc: BaseException, doing: str, key: str) -> TieredError:
    """A failed write or commit of one entry as a typed error naming the key: CapacityError when
    the disk is full, the same type for store errors, TransferError for other OSErrors."""
    message = f"{doing} entry {key!r} failed: {exc}"
    cause = exc.__cause__ if isinstance(exc, TransferError) else exc
    if getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return CapacityError(f"{message}; free disk space or set nvme_bytes")
    if isinstance(exc, TieredError):
        return type(exc)(message)
    return TransferError(message)


def _unusable_directory(exc: OSError, field: str, path: str) -> OSError:
    """An OSError from creating or locking a store directory, saying which setting to change."""
    reason = exc.strerror or str(exc)
    return OSError(exc.errno, f"cannot use {path!r} ({field}) as a store directory: {reason}; give a directory "
                              "this process can create and write")
