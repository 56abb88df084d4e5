"""Page-aligned buffers for the tensors a get returns, recycled once the caller frees them.

A get that returns a new tensor must put its bytes in memory nobody has touched yet, and first
touches (a page fault per 4 KiB page) are often slower than copying into memory already mapped.
So large results (``tiered.io.spans.DIRECT_RESULT_BYTES`` and up) live in page-aligned mappings that
O_DIRECT reads fill directly, the kernel faulting their pages in on the I/O threads, in parallel;
and when the caller drops such a tensor, its mapping comes back here, already mapped, for the next
get of the same size, like a caching allocator. The tensor owns its mapping through a numpy array
whose finalizer hands it back, so it is an ordinary CPU tensor except that its storage cannot be
resized. The same pool lends buffers to whoever owns the store
(:meth:`tiered.TieredStore.host_buffer`: an engine's parameter storage), so memory one phase of a
program freed serves the next.

[Note: Result pool bound]
``capacity`` bounds every mapping the pool made, lent out and waiting together: a buffer coming
back waits only while lent + waiting stays within it, and a new mapping first unmaps waiting ones
(the oldest first) until it fits. So the pool's memory never exceeds ``max(capacity, bytes lent
out)``: what callers hold is theirs, the rest is the capacity. A caller that keeps its lent bytes
within the capacity (an engine's memory plan does) keeps the whole pool within it.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Optional

import numpy as np
import torch

from tiered.io.aligned import anonymous_map, round_up


class ResultPool:
    """Hands out page-aligned uint8 tensors and takes their memory back when they are freed.

    Thread-safe: a tensor may die on any thread, and its memory is returned from there.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: dict[int, list[mmap.mmap]] = {}
        self._age: dict[int, mmap.mmap] = {}  # id -> buffer, oldest first
        self._bytes = 0
        self._lent = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a forked child gives nothing back: the lock may be held by a thread it lacks
        self._closed = False
        self.hits = 0
        self.misses = 0

    def take(self, nbytes: int, *, populate: bool = False) -> tuple[torch.Tensor, memoryview]:
        """A 1-D uint8 tensor of exactly ``nbytes`` (uninitialized) and an aligned view of its whole mapping.

        The view may run past the tensor to the mapping's page-rounded end; drop it when done.
        ``populate`` gives a new mapping all its pages at once (a reused one has them already).
        """
        size = round_up(max(nbytes, 1), mmap.PAGESIZE)
        buf: Optional[mmap.mmap] = None
        evicted: list[mmap.mmap] = []
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                buf = bucket.pop()
                del self._age[id(buf)]
                self._bytes -= size
                self.hits += 1
            else:
                self.misses += 1
                # [Note: Result pool bound]: waiting buffers make room for the new mapping.
                while self._age and self._lent + self._bytes + size > self.capacity:
                    evicted.append(self._pop_oldest())
            self._lent += size
        for b in evicted:
            _unmap(b)
        if buf is None:
            # Transparent huge pages where the kernel gives them on request: then every 2 MiB of the
            # result is physically contiguous, whatever state free memory is in. Pages faulted in 4 KiB
            # at a time may lie in thousands of physical pieces, each a segment of the disk request,
            # which slows every later read into the buffer (docs/tuning.md, "Memory").
            try:
                buf = anonymous_map(size, populate=populate, huge_pages=True)
            except BaseException:
                with self._lock:
                    self._lent -= size
                raise
        array = np.frombuffer(buf, dtype=np.uint8)
        # The tensor keeps `array` alive; when the last tensor on this memory dies, so does `array`,
        # and the mapping comes back (the finalizer holds the only other reference to it).
        weakref.finalize(array, self._give_back, buf).atexit = False
        return torch.frombuffer(array, dtype=torch.uint8, count=max(nbytes, 0)), memoryview(buf)

    def resize(self, capacity: int) -> None:
        """Bound the pool by ``capacity`` from now on; waiting buffers beyond it are unmapped now."""
        evicted: list[mmap.mmap] = []
        with self._lock:
            self.capacity = capacity
            while self._age and self._lent + self._bytes > capacity:
                evicted.append(self._pop_oldest())
        for b in evicted:
            _unmap(b)

    def close(self) -> None:
        """Unmap every waiting buffer; tensors still alive keep theirs until they die."""
        with self._lock:
            self._closed = True
            waiting = list(self._age.values())
            self._free.clear()
            self._age.clear()
            self._bytes = 0
        for buf in waiting:
            _unmap(buf)

    @property
    def waiting_bytes(self) -> int:
        """Bytes of freed buffers kept for reuse."""
        return self._bytes

    @property
    def lent_bytes(self) -> int:
        """Bytes of buffers alive in callers' tensors (page-rounded)."""
        return self._lent

    def _pop_oldest(self) -> mmap.mmap:
        """The waiting buffer that came back first, taken out of the pool (lock held)."""
        old = self._age.pop(next(iter(self._age)))
        self._free[len(old)].remove(old)
        self._bytes -= len(old)
        return old

    def _give_back(self, buf: mmap.mmap) -> None:
        if os.getpid() != self._pid:
            return  # the parent's mapping: the child's copy goes when the process does
        size = len(buf)
        evicted: list[mmap.mmap] = []
        with self._lock:
            self._lent -= size
            if self._closed or self._lent + size > self.capacity:
                evicted.append(buf)
            else:
                self._free.setdefault(size, []).append(buf)
                self._age[id(buf)] = buf
                self._bytes += size
                while self._lent + self._bytes > self.capacity:  # the oldest waiting buffers make room
                    evicted.append(self._pop_oldest())
        for b in evicted:
            _unmap(b)


def _unmap(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # a view is still exported; the mapping goes when that view does
        pass
