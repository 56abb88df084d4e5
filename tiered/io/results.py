"""Page-aligned buffers for the tensors a get returns, recycled once the caller frees them.

A get that returns a new tensor must put its bytes in memory nobody has touched yet, and first
touches (a page fault per 4 KiB page) are often slower than copying into memory already mapped.
So large results (``tiered.spans.DIRECT_RESULT_BYTES`` and up) live in page-aligned mappings that
O_DIRECT reads fill directly, the kernel faulting their pages in on the I/O threads, in parallel;
and when the caller drops such a tensor, its mapping comes back here, already mapped, for the next
get of the same size, like a caching allocator. The tensor owns its mapping through a numpy array
whose finalizer hands it back, so it is an ordinary CPU tensor except that its storage cannot be
resized. At most ``capacity`` bytes wait here, oldest unmapped first; beyond that, freed mappings
go back to the system.
"""

from __future__ import annotations

import mmap
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
        self._lock = threading.Lock()
        self._closed = False
        self.hits = 0
        self.misses = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """A 1-D uint8 tensor of ``nbytes`` (uninitialized) and an aligned view of its whole mapping.

        The view may run past the tensor to the mapping's page-rounded end; drop it when done.
        """
        size = round_up(nbytes, mmap.PAGESIZE)
        buf: Optional[mmap.mmap] = None
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                buf = bucket.pop()
                del self._age[id(buf)]
                self._bytes -= size
                self.hits += 1
            else:
                self.misses += 1
        if buf is None:
            # Transparent huge pages where the kernel gives them on request: then every 2 MiB of the
            # result is physically contiguous, whatever state free memory is in. Pages faulted in 4 KiB
            # at a time may lie in thousands of physical pieces, each a segment of the disk request,
            # which slows every later read into the buffer (docs/tuning.md, "Memory").
            buf = anonymous_map(size, populate=False, huge_pages=True)
        array = np.frombuffer(buf, dtype=np.uint8)
        # The tensor keeps `array` alive; when the last tensor on this memory dies, so does `array`,
        # and the mapping comes back (the finalizer holds the only other reference to it).
        weakref.finalize(array, self._give_back, buf).atexit = False
        return torch.from_numpy(array)[:nbytes], memoryview(buf)

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
        """Bytes of freed results kept for reuse."""
        return self._bytes

    def _give_back(self, buf: mmap.mmap) -> None:
        size = len(buf)
        evicted: list[mmap.mmap] = []
        with self._lock:
            if self._closed or size > self.capacity:
                evicted.append(buf)
            else:
                self._free.setdefault(size, []).append(buf)
                self._age[id(buf)] = buf
                self._bytes += size
                while self._bytes > self.capacity:  # the oldest waiting buffers make room
                    old = self._age.pop(next(iter(self._age)))
                    self._free[len(old)].remove(old)
                    self._bytes -= len(old)
                    evicted.append(old)
        for b in evicted:
            _unmap(b)


def _unmap(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # a view is still exported; the mapping goes when that view does
        pass
