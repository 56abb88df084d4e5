"""Coalescing: small transfers that reach a backend in the same event-loop iteration go together.

[Note: coalescing]
Independent puts and gets in flight (64 callers each putting a 64 KiB tensor, say) arrive at the
nvme backend several per loop iteration. Run one by one, each is a block on a worker thread, a
syscall, a CRC call and a wakeup of the loop; run together through the batched path
(``nvme_batch``), chunks lying back to back become one vectored syscall and the whole group one
wakeup. Every transfer (up to ``StoreConfig.coalesce_bytes``; 0 turns this off) still has its own
chunks and CRCs, so what lands on disk is what it would have been alone, and a failed block fails
only the transfers with a chunk in it. A cancelled caller waits until its batch is done with its
buffers.

The first transfer of an iteration schedules the flush with ``call_soon``, so the ones queued
behind it in the same iteration join it; a lone transfer waits for nothing but one loop turn.
A large read, which the backend runs alone, calls :meth:`Coalescer.go_first` before its own I/O:
the queued batch of reads is started at once and reaches the I/O engine first. Otherwise a burst of
requests in need order (a model's parameters: embedding, small biases and norms, large weights)
would put every large read ahead of the small ones queued before it, and the disk, which serves
requests in about the order they come, would return the small ones last.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable, Generic, Optional, Sequence, TypeVar

Copy = TypeVar("Copy")
Spans = TypeVar("Spans")
#: Runs one transfer alone (raises on failure).
RunOne = Callable[[Copy, Spans], Awaitable[None]]
#: Runs several transfers together; returns each one's error (None when it succeeded).
RunMany = Callable[[Sequence[Copy], Sequence[Spans]], Awaitable[list[Optional[BaseException]]]]


class Coalescer(Generic[Copy, Spans]):
    """Queues transfers and runs each loop iteration's queue as one batch (or alone, if alone)."""

    def __init__(self, run_one: RunOne, run_many: RunMany) -> None:
        self._run_one = run_one
        self._run_many = run_many
        self._queue: list[tuple[Copy, Spans, asyncio.Future[None]]] = []
        self._scheduled: Optional[asyncio.Handle] = None  # the flush the queue's first transfer scheduled
        self._running: set[asyncio.Task[None]] = set()
        #: Batches run with more than one transfer, and the transfers in them (for tests and stats).
        self.batches = 0
        self.batched = 0

    async def submit(self, copy: Copy, spans: Spans) -> None:
        """Run the transfer with whatever else arrives in this loop iteration; raise its own error."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._queue.append((copy, spans, done))
        if len(self._queue) == 1:
            self._scheduled = loop.call_soon(self._flush)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            # The batch may be using the caller's buffers: let it finish with them before giving up.
            while not done.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([done])
            if not done.cancelled():
                done.exception()  # retrieved: the cancelled caller will not see it
            raise

    async def go_first(self) -> None:
        """Let the transfers queued so far reach the I/O engine before the caller's own: start their
        batch now, and yield once, so that the batch task's first step (which submits its blocks)
        runs before the caller goes on."""
        if not self._queue:
            return
        assert self._scheduled is not None
        self._scheduled.cancel()
        self._flush()
        await asyncio.sleep(0)

    def _flush(self) -> None:
        self._scheduled = None
        queue, self._queue = self._queue, []  # never empty: the first submit of the queue scheduled this
        task = asyncio.ensure_future(self._run(queue))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, queue: list[tuple[Copy, Spans, "asyncio.Future[None]"]]) -> None:
        errors: list[Optional[BaseException]]
        try:
            if len(queue) == 1:
                copy, spans, _ = queue[0]
                try:
                    await self._run_one(copy, spans)
                    errors = [None]
                except Exception as exc:  # noqa: BLE001 - handed to the waiting caller
                    errors = [exc]
            else:
                self.batches += 1
                self.batched += len(queue)
                errors = await self._run_many([c for c, _, _ in queue], [s for _, s, _ in queue])
        except BaseException as exc:  # noqa: BLE001 - every caller of the batch gets it
            errors = [exc] * len(queue)
        for (_, _, done), error in zip(queue, errors):
            if done.done():
                continue
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)
