"""How a call reaches the store's loop, from any thread, and whether the store takes calls at all.

[Note: calls from any thread]
A public coroutine, awaited on any other loop, posts ``_start_detached`` to the store's inbox
(``tiered.io.mailbox.Mailbox``) with a ``LoopReply``: a future on the caller's loop that the
outcome reaches through that loop's own mailbox (one per caller loop, weakly keyed). The blocking
facade (``store.sync``) and prefetch handles do the same with a ``concurrent.futures.Future``
(``FutureReply``). A mailbox wakes its loop once for all the posts that arrive together, not once
per post, so many small operations in flight cost few wakeups. On the store's own thread a call
awaits ``detached`` instead (the blocking facade refuses to run there: it would deadlock).

Either way the operation is a task of its own, tracked in ``tasks``, and the caller only waits
for its outcome: a cancelled caller stops waiting, the operation finishes on the store's loop, and
``close()`` waits for it; a call cancelled before the loop picked it up never starts. So a
cancellation never leaves a transfer half-applied. Below the store the same rule holds: a
cancelled transfer waits for the blocks it submitted, which still use its buffers (see
[Note: blocks in flight] in tiered.io.blocks), and a cancelled caller of a coalesced batch waits
until the batch is done with its buffers (tiered.backends.coalesce).

[Note: a store belongs to its process]
The loop thread, the I/O threads and the directory locks are the opening process's. A child that
``fork()`` makes has a copy of the store object and none of its threads, so a call there would
wait for ever for a loop that does not run: at fork, the child marks its copy forked, and from
then on every call raises StoreForkedError at once, the exit hook leaves it alone
(tiered.store.process), and the child closes its copies of the locked directories' descriptors
without unlocking them (see [Note: directory ownership] in tiered.manifest.ownership), so the
parent can close and reopen its store while the child lives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import weakref
from typing import Any, Awaitable, Callable, Optional, TypeVar

from tiered.errors import StoreClosedError, StoreForkedError
from tiered.io.mailbox import FutureReply, LoopReply, Mailbox
from tiered.util.loop import LoopThread

T = TypeVar("T")


class Calls:
    """The store's calling convention: the loop thread, its inbox, the tasks in flight, and the
    open/closing/closed state every call checks first."""

    def __init__(self, loop_thread: LoopThread, path: str) -> None:
        self.loop_thread = loop_thread
        self._path = path
        self.tasks: set[asyncio.Task[Any]] = set()
        #: close() has begun: new calls raise StoreClosedError.
        self.closing = False
        #: close() has finished (or the store never opened).
        self.closed = False
        #: This is a forked child's copy of the store ([Note: a store belongs to its process]).
        self.forked = False
        self._pid = os.getpid()
        os.register_at_fork(after_in_child=functools.partial(_mark_forked, weakref.ref(self)))
        self._inbox = Mailbox(loop_thread.loop)  # calls from other threads
        self._outboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox]" = weakref.WeakKeyDictionary()
        self._last_outbox: Optional[Mailbox] = None

    def check_process(self) -> None:
        """StoreForkedError in a process forked from the one that opened the store."""
        if self.forked:
            raise StoreForkedError(
                f"the store at {self._path} belongs to process {self._pid}, which opened it; this process "
                f"({os.getpid()}) was forked from it and cannot use it: open a store of its own (on other "
                "directories) here, or leave the store to the parent"
            )

    def check_open(self) -> None:
        """StoreForkedError in a forked child, StoreClosedError once close() has begun."""
        if self.forked:
            self.check_process()
        if self.closed or self.closing:
            raise StoreClosedError(f"the store at {self._path} is closed; open it again to use it")

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the store's loop and await its outcome, from any loop."""
        self.check_open()
        if self.loop_thread.on_loop_thread():
            return await self.detached(fn, *args)
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

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> "concurrent.futures.Future[T]":
        """Start ``fn(*args)`` on the store's loop; its outcome comes in the returned future."""
        self.check_open()
        result: "concurrent.futures.Future[T]" = concurrent.futures.Future()
        self._inbox.post(self._start_detached, FutureReply(result), fn, args)
        return result

    def submit_sync(self, fn: Callable[..., Awaitable[T]], *args: Any) -> "concurrent.futures.Future[T]":
        """:meth:`submit` for the blocking facade, which must not block the store's own loop thread."""
        self.check_open()
        if self.loop_thread.on_loop_thread():
            raise RuntimeError(
                "the sync facade (store.sync) cannot be used on the store's own loop thread; await the async method"
            )
        return self.submit(fn, *args)

    def call_sync(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the store's loop and block until it is done."""
        return self.submit_sync(fn, *args).result()

    async def detached(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """On the store's loop: run ``fn`` as a task the caller's cancellation cannot interrupt,
        tracked for close()."""
        self.check_open()
        task = asyncio.ensure_future(fn(*args))
        self.track(task)
        return await asyncio.shield(task)

    def track(self, task: "asyncio.Task[Any]") -> None:
        """Count ``task`` among the work close() waits for."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def wait_for_tasks(self) -> None:
        """Wait until every tracked task but the current one is done (those they start included)."""
        current = asyncio.current_task()
        while True:
            pending = {t for t in self.tasks if t is not current and not t.done()}
            if not pending:
                return
            await asyncio.wait(pending)

    def _start_detached(self, reply: "FutureReply | LoopReply", fn: Callable[..., Awaitable[Any]],
                        args: tuple) -> None:
        """On the store loop: run ``fn`` as a tracked task whose outcome goes to ``reply``.

        Like :meth:`detached` but with one task instead of two and a shield: the caller giving up
        never reaches the task. A call the caller cancelled before the loop got here never starts.
        Calls arrive through a mailbox and answer through the caller loop's, so many calls in
        flight cost a few wakeups, not two per call. See [Note: calls from any thread].
        """
        if reply.cancelled():
            return
        try:
            self.check_open()
        except StoreClosedError as exc:
            reply.fail(exc)
            return
        task = self.loop_thread.loop.create_task(fn(*args))
        self.tasks.add(task)
        task.add_done_callback(functools.partial(self._finish_detached, reply))

    def _finish_detached(self, reply: "FutureReply | LoopReply", task: "asyncio.Task[Any]") -> None:
        # One done-callback instead of two (untrack, answer): each costs the loop a scheduled handle.
        self.tasks.discard(task)
        reply.finish(task)


def _mark_forked(calls: "weakref.ref[Calls]") -> None:
    """In a child just forked: its copy of the store takes no calls ([Note: a store belongs to its process])."""
    copy = calls()
    if copy is not None:
        copy.forked = True
