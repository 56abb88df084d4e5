"""Per-key mutual exclusion for the coroutines of one event loop, free of cost when uncontended.

Which store operations take a key's lock, and which rely on versions instead: see [Note: key locks]
in tiered.store.versions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Iterable, Optional


class KeyLocks:
    """One FIFO lock per key. Taking a free key is one dict insert (no lock object, no future);
    only a key someone waits for gets a queue of waiters. Used only from one event loop."""

    def __init__(self) -> None:
        # key -> None while held and nobody waits, else the waiters in arrival order
        self._held: dict[str, Optional[collections.deque[asyncio.Future[None]]]] = {}

    def locked(self, key: str) -> bool:
        """Whether some coroutine holds ``key``."""
        return key in self._held

    async def acquire(self, key: str) -> None:
        """Wait until ``key`` is free and take it."""
        if key not in self._held:
            self._held[key] = None
            return
        waiters = self._held[key]
        if waiters is None:
            waiters = self._held[key] = collections.deque()
        future = asyncio.get_running_loop().create_future()
        waiters.append(future)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.release(key)  # the lock was handed to us as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    waiters.remove(future)
            raise

    async def acquire_all(self, keys: Iterable[str]) -> list[str]:
        """Take several distinct keys, in sorted order so that two callers can never deadlock;
        returns them in that order, for :meth:`release_all`."""
        taken: list[str] = []
        try:
            for key in sorted(keys):
                await self.acquire(key)
                taken.append(key)
        except BaseException:
            self.release_all(taken)
            raise
        return taken

    def release(self, key: str) -> None:
        """Give ``key`` up; the longest waiter, if any, takes it."""
        waiters = self._held[key]
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(None)
                return
        del self._held[key]

    def release_all(self, keys: Iterable[str]) -> None:
        """Give up every key of :meth:`acquire_all`."""
        for key in keys:
            self.release(key)
