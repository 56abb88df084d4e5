"""Whole files at the disk's speed: writing one front to back, reading large ranges of one.

Buffered writes of a multi-GB file go through the page cache, which on the machines this project
targets runs at a fraction of the disk's speed (every page is a new allocation) and leaves the
whole file dirty for the final fsync to push out. :class:`SequentialWriter` copies the caller's
bytes into page-aligned chunks and writes each full chunk with O_DIRECT on a small thread pool,
several chunks in flight at their own offsets, while the caller fills the next. The last chunk is
written padded to the alignment and the file truncated to its exact length. Where the filesystem
refuses O_DIRECT (tmpfs) the same path runs buffered.

:class:`RangeReader` reads a byte range with O_DIRECT into page-aligned memory, in chunks read in
parallel, where a buffered read of a cold file would go at the page cache's readahead pace.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
from typing import Optional

import torch

from tiered.config import ALIGNMENT
from tiered.errors import TransferError
from tiered.io.aligned import AlignedBuffer, round_up
from tiered.io.files import FileHandle, Syscalls, open_file, pread_full, pwrite_full
from tiered.io.futures import wait_all
from tiered.io.host_memory import empty_aligned

#: Bytes per staging chunk (one write syscall each).
CHUNK_BYTES = 8 * 1024 * 1024
#: Chunks in flight at once, plus the one being filled.
CHUNKS_IN_FLIGHT = 8


class SequentialWriter:
    """``w = SequentialWriter(path); w.write(view); ...; w.close()`` writes a new file (replacing
    any file at ``path``), durable when :meth:`close` returns. Not thread-safe: one writer thread.
    ``size_hint`` (the final length, when known) allocates the file up front; ``direct=False``
    writes through the page cache (where O_DIRECT is refused, that happens anyway). A new file gets
    ``mode`` less the umask (0600: private by default; 0o666 for files meant to be shared)."""

    def __init__(
        self, path: str, *, size_hint: int = 0, chunk_bytes: int = CHUNK_BYTES, in_flight: int = CHUNKS_IN_FLIGHT,
        direct: bool = True, syscalls: Optional[Syscalls] = None, mode: int = 0o600,
    ) -> None:
        if chunk_bytes < ALIGNMENT or chunk_bytes % ALIGNMENT:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGNMENT}, got {chunk_bytes}")
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self.path = path
        self._sys = syscalls or Syscalls()
        self._handle: FileHandle = open_file(path, direct=direct, mode=mode)
        try:
            os.ftruncate(self._handle.fd, 0)
            if size_hint > 0:  # one allocation up front, not one per write (and a contiguous extent, likely)
                _allocate(self._handle.fd, round_up(size_hint, ALIGNMENT))
            self._chunk = chunk_bytes
            self._buffers = [AlignedBuffer(chunk_bytes) for _ in range(in_flight + 1)]
        except BaseException:
            self._handle.close()
            raise
        self._pending: list[Optional[concurrent.futures.Future[None]]] = [None] * len(self._buffers)
        self._pool = concurrent.futures.ThreadPoolExecutor(in_flight, thread_name_prefix="tiered-seqwrite")
        self._current = 0  # index of the buffer being filled
        self._filled = 0  # bytes in it
        self._offset = 0  # file offset of its first byte
        self.nbytes = 0  # bytes written so far (logical length of the file)

    @property
    def direct(self) -> bool:
        """True when the file is written with O_DIRECT."""
        return self._handle.direct

    def write(self, data: "memoryview | bytes") -> None:
        """Append ``data`` (copied into a staging chunk before this returns, so the caller may reuse it)."""
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = min(len(view) - done, self._chunk - self._filled)
            self._buffers[self._current].view[self._filled : self._filled + n] = view[done : done + n]
            self._filled += n
            done += n
            if self._filled == self._chunk:
                self._submit(self._chunk)
        self.nbytes += len(view)

    def close(self) -> None:
        """Write what is buffered, wait for every write, trim the file to its length, fsync, close.
        Raises the first write error (the file is then incomplete: remove it)."""
        try:
            if self._filled:
                self._submit(round_up(self._filled, ALIGNMENT))
            self._wait_all()
            os.ftruncate(self._handle.fd, self.nbytes)
            os.fsync(self._handle.fd)
        finally:
            self._release()

    def abort(self) -> None:
        """Stop: wait for the writes in flight (ignoring their errors) and close. The caller removes the file."""
        try:
            self._wait_all(raise_errors=False)
        finally:
            self._release()

    # ------------------------------------------------------------------ internals

    def _submit(self, length: int) -> None:
        """Write the current buffer's first ``length`` bytes at its offset; move on to the next buffer."""
        buffer = self._buffers[self._current]
        if length > self._filled:  # the padded tail of the last chunk: zeros, trimmed by close()
            buffer.view[self._filled : length] = bytes(length - self._filled)
        view = buffer.view[:length]
        self._pending[self._current] = self._pool.submit(pwrite_full, self._sys, self._handle, [view], self._offset)
        self._offset += self._filled
        self._current = (self._current + 1) % len(self._buffers)
        self._filled = 0
        previous = self._pending[self._current]
        if previous is not None:  # the next buffer's last write must be done before it is refilled
            self._pending[self._current] = None
            previous.result()

    def _wait_all(self, raise_errors: bool = True) -> None:
        pending = [f for f in self._pending if f is not None]
        self._pending = [None] * len(self._pending)
        wait_all(pending, raise_errors=raise_errors)

    def _release(self) -> None:
        self._pool.shutdown(wait=True)
        self._handle.close()
        for buffer in self._buffers:
            buffer.close()
        self._buffers = []


def _allocate(fd: int, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate: allocate as written
            raise


class RangeReader:
    """``with RangeReader(path) as r: t = r.read(offset, length)``: a uint8 tensor of the file's
    bytes ``[offset, offset + length)``, read in ``chunk_bytes`` pieces on ``threads`` threads.
    The tensor lives in page-aligned memory of its own."""

    def __init__(self, path: str, *, chunk_bytes: int = CHUNK_BYTES, threads: int = CHUNKS_IN_FLIGHT,
                 direct: bool = True, syscalls: Optional[Syscalls] = None) -> None:
        if chunk_bytes < ALIGNMENT or chunk_bytes % ALIGNMENT:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGNMENT}, got {chunk_bytes}")
        self.path = path
        self._sys = syscalls or Syscalls()
        self._chunk = chunk_bytes
        self._handle: FileHandle = open_file(path, direct=direct, create=False, read_only=True)
        self.size = os.fstat(self._handle.fd).st_size
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tiered-rangeread")

    def read(self, offset: int, length: int) -> torch.Tensor:
        """The bytes ``[offset, offset + length)``: ValueError for a range outside the file,
        TransferError when a read fails or the file shrank while it was read."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(
                f"{self.path}: range [{offset}, {offset + length}) is outside the file ({self.size} bytes)"
            )
        start = offset - offset % ALIGNMENT
        # O_DIRECT reads whole blocks: round the end up, but not past the last block of the file
        end = min(round_up(offset + length, ALIGNMENT), round_up(self.size, ALIGNMENT))
        out = empty_aligned(max(end - start, 1), torch.uint8, pin=False)  # freed with the last view of it
        view = memoryview(out.numpy())
        futures = [
            self._pool.submit(self._read_chunk, view[at - start : min(at + self._chunk, end) - start], at)
            for at in range(start, end, self._chunk)
        ]
        wait_all(futures)
        return out[offset - start : offset - start + length]

    def _read_chunk(self, view: memoryview, at: int) -> None:
        want = min(len(view), self.size - at)
        if want == len(view):
            pread_full(self._sys, self._handle, [view], at)
            return
        # The file's last block, read whole: a direct read returns the bytes up to the end of the file.
        try:
            got = self._sys.preadv(self._handle.fd, [view], at)
        except OSError as exc:
            raise TransferError(f"read of {want} bytes at offset {at} of {self.path} failed: {exc}") from exc
        if got < want:
            raise TransferError(
                f"read at offset {at} of {self.path} returned {got} of {want} bytes: the file shrank while read"
            )

    def close(self) -> None:
        """Stop the threads and close the file."""
        self._pool.shutdown(wait=True)
        self._handle.close()

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
