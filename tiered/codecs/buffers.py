"""Aligned buffers for codec payloads: a small reuse pool, and the encoded result that holds one."""

from __future__ import annotations

import threading
from typing import Callable, Optional

from tiered.io.aligned import AlignedBuffer
from tiered.io.spans import Span

#: A cached buffer serves a request only if it is at most this many times larger.
_MAX_OVERSIZE = 2


class BufferPool:
    """Reuses page-aligned buffers, so encoding and compressed reads take no first-touch faults.

    A fresh mmap's first touch runs at about 1.7 GB/s here against 5 GB/s for warm memory, which
    is as slow as the codec itself. At most ``cache_bytes`` of idle buffers are kept; the oldest go
    first. Thread-safe: buffers are taken on worker threads and given back from the store loop.
    """

    def __init__(self, cache_bytes: int) -> None:
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._idle: list[AlignedBuffer] = []
        self._closed = False

    @property
    def idle_bytes(self) -> int:
        """Bytes held by idle buffers."""
        with self._lock:
            return sum(b.nbytes for b in self._idle)

    def take(self, nbytes: int) -> AlignedBuffer:
        """A buffer of at least ``nbytes`` bytes (``nbytes`` > 0): a cached one that fits, or a new one."""
        with self._lock:
            fits = [b for b in self._idle if nbytes <= b.nbytes <= _MAX_OVERSIZE * max(nbytes, 1 << 20)]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._idle.remove(best)
                return best
        return AlignedBuffer(nbytes, huge_pages=True)  # the nvme copy is read into it with O_DIRECT

    def give(self, buffer: AlignedBuffer) -> None:
        """Return a buffer taken from :meth:`take`; nothing may use it afterwards."""
        dropped = [buffer]
        with self._lock:
            if not self._closed and buffer.nbytes <= self.cache_bytes:
                self._idle.append(buffer)
                dropped = []
                while sum(b.nbytes for b in self._idle) > self.cache_bytes:
                    dropped.append(self._idle.pop(0))
        for b in dropped:
            b.close()

    def close(self) -> None:
        """Unmap every idle buffer; buffers given back later are unmapped at once."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for b in idle:
            b.close()


class Encoded:
    """A compressed payload in aligned memory, ready for O_DIRECT, and how to decode it."""

    def __init__(
        self,
        codec: str,
        buffer: AlignedBuffer,
        nbytes: int,
        meta: bytes,
        release: Optional[Callable[[AlignedBuffer], None]] = None,
    ) -> None:
        self.codec = codec
        self.buffer = buffer
        self.nbytes = nbytes
        self.meta = meta
        self._release = release or AlignedBuffer.close
        self._closed = False

    def spans(self) -> list[Span]:
        """The payload as spans (aligned, so the nvme tier writes it without staging)."""
        return [Span(self.buffer.tensor[: self.nbytes], self.buffer.view)] if self.nbytes else []

    def close(self) -> None:
        """Give the buffer back; the payload must no longer be used."""
        if not self._closed:
            self._closed = True
            self._release(self.buffer)
