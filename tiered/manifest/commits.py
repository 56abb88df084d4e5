"""Group commit: make swap-file bytes durable, then write manifest records, many puts per fsync.

[Note: group commit]
Every change of the manifest (a record, or a tombstone: ``record=None``) goes through one
``CommitLog``, whose task takes everything submitted so far as one batch:

1. unless the store is opened with ``durable=False``, flush (``fdatasync``) every swap file the
   batch's bytes lie in, once each, before any record naming them is written;
2. per key, keep the request with the highest generation, if it is not older than what is
   already committed for that key;
3. write the kept records and remove the tombstoned keys in one SQLite transaction;
4. answer each request True (applied) or False (superseded, in this batch or before); a writer
   told False frees the extents it wrote.

Requests that arrive while a batch commits form the next one, so concurrent puts share one flush
round and one transaction, and the requests of one ``put_many``, submitted together, normally
make one batch (not always: a crash may find some of its keys committed and others not). A
failure reaches every request of its batch. Each step is a round trip from the store's loop to a
worker thread, which can cost as much as a flush, so when the batch's bytes lie in one swap file
(the common case) the manifest thread flushes it and writes the records in one job; a batch spread
over several files flushes them in parallel on I/O threads first. Why the order matters: see
[Note: crash safety] in tiered.store.versions.

[Note: changes without a flush]
A change that names no new bytes (a rename's records and tombstones) may be submitted with
``flush=False``: a batch made only of such changes writes its transaction without flushing the
log. SQLite's WAL keeps transactions in order and recovers a prefix of them, so such a batch is
durable once any later batch is flushed; a power loss before that may lose it, whole and with
everything after it (a killed process loses nothing: the log is written, only not flushed). A
caller that sets values aside this way and then durably writes the values that replace them pays
one flush for both (``TieredStore.rename_many(durable=False)``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any, Optional, Protocol, Sequence

from tiered.backends import NvmeCopy
from tiered.manifest.database import Manifest, Record


@dataclasses.dataclass
class _Request:
    key: str
    generation: int
    record: Optional[Record]  # None: delete the key
    copy: Optional[NvmeCopy]
    done: "asyncio.Future[bool]"
    flush: bool = True  # False: durable with the next flushed batch ([Note: changes without a flush])


class DataSync(Protocol):
    """How the commit log makes swap-file bytes durable before it writes the records naming them."""

    def files_to_sync(self, copies: Sequence[NvmeCopy]) -> Sequence[Any]:
        """The files the copies' bytes lie in, each once."""

    def sync_file(self, file: Any) -> None:
        """Flush one file's data to stable storage (blocking; runs on a worker thread)."""

    async def sync_files(self, files: Sequence[Any]) -> None:
        """Flush several files' data to stable storage, in parallel."""


class CommitLog:
    """Serializes manifest changes in generation order per key and batches their fsyncs.

    ``submit`` returns True once the change is durable, or False when a newer generation of the
    same key was already committed (the caller then discards what it wrote).
    """

    def __init__(
        self,
        manifest: Manifest,
        data: DataSync,
        thread: concurrent.futures.Executor,
        *,
        durable: bool,
        committed_generations: dict[str, int],
    ) -> None:
        self._manifest = manifest
        self._data = data
        self._thread = thread
        self._durable = durable
        self._generations = committed_generations
        self._pending: list[_Request] = []
        self._outstanding: set[asyncio.Future[bool]] = set()
        self._wakeup = asyncio.Event()
        self._task: Optional[asyncio.Task[None]] = None
        self.commits = 0

    def submit(
        self, key: str, generation: int, record: Optional[Record], copy: Optional[NvmeCopy], *, flush: bool = True
    ) -> "asyncio.Future[bool]":
        """Queue a record (or a deletion when ``record`` is None); await the result. ``flush=False``
        (only for a change whose ``copy`` is None): applied in order, durable with the next flushed
        batch ([Note: changes without a flush])."""
        if not flush and copy is not None:
            raise ValueError(f"a change of {key!r} that names new bytes must be flushed")
        done = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(key, generation, record, copy, done, flush))
        self._outstanding.add(done)  # removed by _run once its batch is through (no callback per request)
        self._wakeup.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return done

    def submit_many(
        self, changes: Sequence[tuple[str, int, Optional[Record], Optional[NvmeCopy]]], *, flush: bool = True
    ) -> "list[asyncio.Future[bool]]":
        """Queue several changes, each ``(key, generation, record or None, copy)``, to commit in one
        transaction: queued together, they are taken into the same batch, whose records the manifest
        writes all or none of. One future per change, as :meth:`submit` returns."""
        return [self.submit(*change, flush=flush) for change in changes]

    def committed_generation(self, key: str) -> Optional[int]:
        """The generation of ``key``'s last committed change (a record or a tombstone), if any."""
        return self._generations.get(key)

    async def barrier(self) -> None:
        """Wait until every change submitted so far has committed (or failed)."""
        if self._outstanding:
            await asyncio.wait(set(self._outstanding))

    async def drain(self) -> None:
        """Wait until everything submitted so far is committed, then stop the worker."""
        if self._task is not None:
            if self._outstanding:
                await asyncio.wait(set(self._outstanding))
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            try:
                await self._commit(batch)
            except BaseException as exc:  # noqa: BLE001 - every waiter must hear of the failure
                for req in batch:
                    if not req.done.done():
                        req.done.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
                if isinstance(exc, asyncio.CancelledError):
                    raise
            finally:
                self._outstanding.difference_update(req.done for req in batch)

    async def _commit(self, batch: list[_Request]) -> None:
        flush_with_records: Sequence[Any] = ()  # one file: flushed by the manifest thread's job itself
        if self._durable:
            files = self._data.files_to_sync([r.copy for r in batch if r.copy is not None])
            if len(files) > 1:
                await self._data.sync_files(files)
            else:
                flush_with_records = files
        applied: dict[str, _Request] = {}
        verdicts: list[tuple[_Request, bool]] = []
        generations: dict[str, int] = {}  # this batch's changes; copying every key's would cost O(keys)
        for req in batch:
            ok = req.generation >= generations.get(req.key, self._generations.get(req.key, -1))
            if ok:
                generations[req.key] = req.generation
                applied[req.key] = req
            verdicts.append((req, ok))
        upserts = [r.record for r in applied.values() if r.record is not None]
        deletes = [r.key for r in applied.values() if r.record is None]
        loop = asyncio.get_running_loop()
        flush = any(r.flush for r in batch)
        await loop.run_in_executor(self._thread, self._write_records, flush_with_records, upserts, deletes, flush)
        self._generations.update(generations)
        self.commits += 1
        for req, ok in verdicts:
            # Superseded inside this batch counts as superseded too.
            final = ok and applied.get(req.key) is req
            if not req.done.done():
                req.done.set_result(final)

    def _write_records(self, files: Sequence[Any], upserts: list[Record], deletes: list[str], flush: bool) -> None:
        """On the manifest thread: flush ``files`` (data first, so no record ever names bytes that
        are not down), then write the records, and flush them unless no change of the batch asks."""
        for f in files:
            self._data.sync_file(f)
        if flush:  # the plain call: the manifest's stand-ins in tests take (upserts, deletes)
            self._manifest.commit(upserts, deletes)
        else:
            self._manifest.commit(upserts, deletes, flush=False)
