"""Callbacks posted to an event loop from other threads, with one wakeup per batch.

``loop.call_soon_threadsafe`` writes to the loop's self-pipe on every call: a syscall and a
wakeup each time, which can cost more than the callback itself. When many completions arrive
together (many small transfers in flight), a Mailbox wakes the loop once and runs all of them in
that turn. How the store uses them: [Note: calls from any thread] in tiered.store.calls.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from typing import Any, Callable


class Mailbox:
    """Runs ``fn(*args)`` on ``loop`` for every :meth:`post`, in order, from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque[tuple[Callable[..., Any], tuple]] = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` to run on the loop; wakes the loop only if no drain is pending."""
        with self._lock:
            self._items.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is left to run the callbacks
            pass

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._items:
                    self._scheduled = False
                    return
                batch = list(self._items)
                self._items.clear()
            for fn, args in batch:
                try:
                    fn(*args)
                except Exception as exc:  # noqa: BLE001 - one bad callback must not drop the rest
                    self.loop.call_exception_handler({"message": "Mailbox callback failed", "exception": exc})


class FutureReply:
    """Where a cross-thread call's outcome goes: a ``concurrent.futures.Future`` (blocking callers,
    prefetch handles). Cancelling that future only stops the caller waiting."""

    def __init__(self, future: "concurrent.futures.Future[Any]") -> None:
        self.future = future

    def cancelled(self) -> bool:
        """Whether the caller gave up before the call started."""
        return self.future.cancelled()

    def fail(self, error: BaseException) -> None:
        """Report an error raised before the call could start."""
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)

    def finish(self, task: "asyncio.Task[Any]") -> None:
        """Copy a finished task's outcome into the future (unless the caller cancelled it)."""
        _settle_concurrent(self.future, task)


class LoopReply:
    """Where a cross-thread call's outcome goes: an asyncio future on the caller's loop, set from
    that loop's mailbox, so many calls finishing together wake the caller once."""

    def __init__(self, future: "asyncio.Future[Any]", outbox: Mailbox) -> None:
        self.future = future
        self.outbox = outbox

    def cancelled(self) -> bool:
        """Whether the caller gave up before the call started (read across threads: a stale answer
        only means the call runs and its result is dropped)."""
        return self.future.cancelled()

    def fail(self, error: BaseException) -> None:
        """Report an error raised before the call could start."""
        self.outbox.post(_set_error, self.future, error)

    def finish(self, task: "asyncio.Task[Any]") -> None:
        """Pass a finished task's outcome to the caller's loop."""
        self.outbox.post(_settle_asyncio, self.future, task)


def _settle_concurrent(future: "concurrent.futures.Future[Any]", task: "asyncio.Task[Any]") -> None:
    if task.cancelled():
        future.cancel()
        return
    error = task.exception()  # retrieved either way, so a caller that gave up leaves no log noise
    if not future.set_running_or_notify_cancel():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(task.result())


def _settle_asyncio(future: "asyncio.Future[Any]", task: "asyncio.Task[Any]") -> None:
    if task.cancelled():
        future.cancel()
        return
    error = task.exception()
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(task.result())


def _set_error(future: "asyncio.Future[Any]", error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
