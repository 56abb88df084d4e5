"""Group commit: make swap-file bytes durable, then write manifest records, many puts per fsync."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Awaitable, Callable, Optional, Sequence

from tiered.backends import NvmeCopy
from tiered.manifest import Manifest, Record


@dataclasses.dataclass
class _Request:
    key: str
    generation: int
    record: Optional[Record]  # None: delete the key
    copy: Optional[NvmeCopy]
    done: "asyncio.Future[bool]"


class CommitLog:
    """Serializes manifest changes in generation order per key and batches their fsyncs.

    ``submit`` returns True once the change is durable, or False when a newer generation of the
    same key was already committed (the caller then discards what it wrote).
    """

    def __init__(
        self,
        manifest: Manifest,
        sync_files: Callable[[Sequence[NvmeCopy]], Awaitable[None]],
        thread: concurrent.futures.Executor,
        *,
        durable: bool,
        committed_generations: dict[str, int],
    ) -> None:
        self._manifest = manifest
        self._sync_files = sync_files
        self._thread = thread
        self._durable = durable
        self._generations = committed_generations
        self._pending: list[_Request] = []
        self._outstanding: set[asyncio.Future[bool]] = set()
        self._wakeup = asyncio.Event()
        self._task: Optional[asyncio.Task[None]] = None
        self.commits = 0

    def submit(
        self, key: str, generation: int, record: Optional[Record], copy: Optional[NvmeCopy]
    ) -> "asyncio.Future[bool]":
        """Queue a record (or a deletion when ``record`` is None); await the result."""
        done = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(key, generation, record, copy, done))
        self._outstanding.add(done)  # removed by _run once its batch is through (no callback per request)
        self._wakeup.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return done

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
        if self._durable:
            await self._sync_files([r.copy for r in batch if r.copy is not None])
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
        await loop.run_in_executor(self._thread, self._manifest.commit, upserts, deletes)
        self._generations.update(generations)
        self.commits += 1
        for req, ok in verdicts:
            # Superseded inside this batch counts as superseded too.
            final = ok and applied.get(req.key) is req
            if not req.done.done():
                req.done.set_result(final)
