"""The block scheduler: transfers split into blocks, run on worker threads, bounded in flight.

[Note: blocks in flight]
Every block takes one of ``queue_depth`` tokens before it is handed to a worker thread, so at most
``queue_depth`` blocks are at the disk over the whole store. A staged block (one without iovecs of
its own: its memory cannot take O_DIRECT in place) also takes one of ``staging_buffers`` slots of
``block_size`` bytes, cut from one buffer made when the engine starts (populated, page-locked where
allowed, pinned under CUDA), so staging memory is bounded whatever the size of the tensors and does
not grow with the queue depth. Tokens and slots are handed out first come, first served. Workers
hand finished blocks back through a mailbox, one wakeup of the loop for all the blocks finishing
together, and a slot returns to the pool only once its thread is done with it. A transfer waits for
every one of its blocks before it raises the first error, and a cancelled transfer still waits for
the blocks it submitted, which use its buffers.

[Note: tail padding]
Every block starts at a file offset that is a multiple of 4 KiB (``ALIGNMENT``) and its syscall
moves its length rounded up to one, as O_DIRECT needs. A staged write pads the tail with zeros; an
in-place write sends the rest of its memory's last page (the host arena's extents and the store's
own buffers run to a page boundary), bytes past the block's length that no CRC covers and no read
returns. A read fills the same padded length, into the slot or into that padding. A caller's tensor
offers no memory past its end, so when its length is not a multiple of 4 KiB its last block is
staged (see [Note: in-place O_DIRECT] in tiered.io.spans): no transfer reads or writes a byte past a
caller's tensor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Optional, Sequence

from tiered.config import ALIGNMENT
from tiered.errors import ChecksumError
from tiered.io.aligned import AlignedBuffer, round_up
from tiered.io.crc import crc32
from tiered.io.files import FileHandle, Syscalls, pread_full, pwrite_full
from tiered.io.mailbox import Mailbox

_ZEROS = bytes(ALIGNMENT)


@dataclasses.dataclass
class BlockWrite:
    """Write ``length`` bytes at ``offset`` (aligned) of a file.

    The bytes come either from ``source`` (aligned iovecs totalling ``length`` rounded up to the
    alignment) or from ``fill``, which copies them into a staging buffer it is given.
    """

    handle: FileHandle
    offset: int
    length: int
    source: Optional[list[memoryview]] = None
    fill: Optional[Callable[[memoryview], None]] = None
    #: False: ``fill`` checksums the bytes itself (a batched block, one CRC per entry); the block returns None.
    checksum: bool = True


@dataclasses.dataclass
class BlockRead:
    """Read ``length`` bytes at ``offset`` (aligned) of a file.

    The bytes land in ``dest`` (aligned iovecs totalling ``length`` rounded up) or in a staging
    buffer handed to ``drain``. With ``expected_crc`` set, a mismatch raises ChecksumError before
    ``drain`` sees the bytes.
    """

    handle: FileHandle
    offset: int
    length: int
    dest: Optional[list[memoryview]] = None
    drain: Optional[Callable[[memoryview], None]] = None
    expected_crc: Optional[int] = None
    #: False: ``drain`` verifies the bytes itself (a batched block, one CRC per entry); no CRC is computed here.
    checksum: bool = True


@dataclasses.dataclass
class IOCounters:
    """Totals since the engine started."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_requests: int = 0
    write_requests: int = 0
    syncs: int = 0
    io_seconds: float = 0.0
    #: Blocks that moved through a staging buffer (a copy) rather than straight from/to their memory.
    staged_writes: int = 0
    staged_reads: int = 0
    #: Worker-thread seconds computing blocks' CRC-32s, and copying blocks into and out of staging
    #: buffers (with the CRC-32s of small pieces that share a block, computed as they are copied).
    checksum_seconds: float = 0.0
    staging_seconds: float = 0.0


class IOEngine:
    """Runs block reads and writes on ``io_threads`` worker threads with at most ``queue_depth`` in flight.

    A block that moves through a staging buffer holds one of ``staging_buffers`` of ``block_size``
    bytes while it runs, so memory is bounded whatever the transfer size (see
    [Note: blocks in flight]). Methods are coroutines for the event loop that created the engine.
    """

    def __init__(
        self,
        *,
        block_size: int,
        queue_depth: int,
        io_threads: int,
        checksum: bool,
        pin: bool = False,
        syscalls: Syscalls = Syscalls(),
        staging_buffers: Optional[int] = None,
    ) -> None:
        assert block_size % ALIGNMENT == 0
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.staging_buffers = min(staging_buffers or queue_depth, queue_depth)
        self.checksum = checksum
        self.syscalls = syscalls
        self.counters = IOCounters()
        self._lock = threading.Lock()
        self._staging = AlignedBuffer(block_size * self.staging_buffers, pin=pin, prefault=True, lock=True,
                                      huge_pages=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="tiered-io")
        self._slots: Optional[asyncio.Queue[memoryview]] = None
        self._tokens: Optional[asyncio.Semaphore] = None
        self._done: Optional[Mailbox] = None

    def _slot_queue(self) -> "asyncio.Queue[memoryview]":
        if self._slots is None:  # created lazily so it binds to the loop that runs the engine
            self._slots = asyncio.Queue()
            for i in range(self.staging_buffers):
                self._slots.put_nowait(self._staging.view[i * self.block_size : (i + 1) * self.block_size])
        return self._slots

    def _in_flight(self) -> asyncio.Semaphore:
        if self._tokens is None:
            self._tokens = asyncio.Semaphore(self.queue_depth)
        return self._tokens

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        if self._done is None:
            self._done = Mailbox(loop)
        return self._done

    async def write(self, blocks: Sequence[BlockWrite]) -> list[Optional[int]]:
        """Write every block; return each block's CRC-32 (None with checksums off)."""
        return await self._run(blocks, self._write_one)

    async def read(self, blocks: Sequence[BlockRead]) -> list[Optional[int]]:
        """Read every block; return each block's CRC-32 (None with checksums off)."""
        return await self._run(blocks, self._read_one)

    async def read_each(self, blocks: Sequence[BlockRead]) -> "list[Optional[int] | Exception]":
        """:meth:`read`, but each block's error is returned in its place instead of raised. Blocks
        are handed to the worker threads before the first await that suspends (while tokens and
        staging slots are free), so a caller's blocks go to the disk in the order of the calls."""
        return await self._run(blocks, self._read_one, return_exceptions=True)

    async def fdatasync(self, handles: Sequence[FileHandle]) -> None:
        """Flush the data of each file to stable storage, in parallel."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, self.fdatasync_now, h) for h in handles))

    def fdatasync_now(self, handle: FileHandle) -> None:
        """Flush one file's data to stable storage on the calling thread (blocks; never on a loop)."""
        self.syscalls.fdatasync(handle.fd)
        with self._lock:
            self.counters.syncs += 1

    def run_sync(self, fn: Callable[..., object], *args: object) -> "asyncio.Future[object]":
        """Run a small blocking file operation (fallocate, ftruncate) on an I/O thread."""
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Stop the worker threads (after running transfers finish) and free the staging memory."""
        self._pool.shutdown(wait=True)
        self._staging.close()

    async def _run(self, blocks: Sequence, fn: Callable, *, return_exceptions: bool = False) -> list[Any]:
        loop = asyncio.get_running_loop()
        slots = self._slot_queue()
        tokens = self._in_flight()
        done = self._mailbox(loop)
        futures: list[asyncio.Future[Optional[int]]] = []
        try:
            for block in blocks:
                # Every block in flight holds a token (at most queue_depth); a block whose memory
                # cannot take O_DIRECT also holds a staging slot. Both queues are FIFO.
                slot = await slots.get() if _staged(block) else None
                try:
                    await tokens.acquire()
                except BaseException:
                    if slot is not None:
                        slots.put_nowait(slot)
                    raise
                future = loop.create_future()
                self._pool.submit(self._work, fn, block, slot, done, future)
                futures.append(future)
        except asyncio.CancelledError:
            # Submitted blocks still use the caller's buffers: let them finish before giving up.
            while not all(f.done() for f in futures):
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(futures)
            for f in futures:
                f.exception()  # retrieved: nobody will await these
            raise
        results: list[Any] = []
        error: Optional[BaseException] = None
        for future in futures:  # every block finishes before the first error is raised
            try:
                results.append(await future)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other blocks
                error = error or exc
                results.append(exc if return_exceptions else None)
        if error is not None and not return_exceptions:
            raise error
        return results

    def _work(self, fn: Callable, block: object, slot: Optional[memoryview], done: Mailbox,
              future: "asyncio.Future[Optional[int]]") -> None:
        """Run one block on a worker thread, then hand back its slot and its result to the loop
        (one wakeup for all blocks finishing together). The slot goes back only now that the
        thread is done with it."""
        try:
            result, error = fn(block, slot), None
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting coroutine
            result, error = None, exc
        done.post(self._finish, slot, future, result, error)

    def _finish(self, slot: Optional[memoryview], future: "asyncio.Future[Optional[int]]", result: Optional[int],
                error: Optional[BaseException]) -> None:
        self._in_flight().release()
        if slot is not None:
            self._slot_queue().put_nowait(slot)
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _write_one(self, block: BlockWrite, slot: Optional[memoryview]) -> Optional[int]:
        n_io = round_up(block.length)
        staging = checksum = 0.0
        if block.source is not None:
            views = block.source
            assert sum(len(v) for v in views) == n_io
        else:
            assert block.fill is not None and slot is not None
            start = time.perf_counter()
            view = _room(slot, n_io)[:n_io]
            block.fill(view[: block.length])
            if n_io > block.length:
                view[block.length : n_io] = _ZEROS[: n_io - block.length]
            views = [view]
            staging = time.perf_counter() - start
        crc = None
        if self.checksum and block.checksum:
            start = time.perf_counter()
            crc = crc32(views, block.length)
            checksum = time.perf_counter() - start
        start = time.perf_counter()
        pwrite_full(self.syscalls, block.handle, views, block.offset)
        with self._lock:
            self.counters.bytes_written += n_io
            self.counters.write_requests += 1
            self.counters.staged_writes += block.source is None
            self.counters.io_seconds += time.perf_counter() - start
            self.counters.staging_seconds += staging
            self.counters.checksum_seconds += checksum
        return crc

    def _read_one(self, block: BlockRead, slot: Optional[memoryview]) -> Optional[int]:
        n_io = round_up(block.length)
        if block.dest is not None:
            views = block.dest
            assert sum(len(v) for v in views) == n_io
        else:
            assert slot is not None
            views = [_room(slot, n_io)[:n_io]]
        start = time.perf_counter()
        pread_full(self.syscalls, block.handle, views, block.offset)
        io_seconds = time.perf_counter() - start
        crc, checksum = None, 0.0
        if (self.checksum or block.expected_crc is not None) and block.checksum:
            start = time.perf_counter()
            crc = crc32(views, block.length)
            checksum = time.perf_counter() - start
        with self._lock:
            self.counters.bytes_read += n_io
            self.counters.read_requests += 1
            self.counters.staged_reads += block.dest is None
            self.counters.io_seconds += io_seconds
            self.counters.checksum_seconds += checksum
        if block.expected_crc is not None and crc != block.expected_crc:
            raise ChecksumError(
                f"checksum mismatch in {block.handle.path} at offset {block.offset} "
                f"({block.length} bytes): stored {block.expected_crc:#010x}, read {crc:#010x}"
            )
        if block.drain is not None:
            assert block.dest is None
            start = time.perf_counter()
            block.drain(views[0][: block.length])
            with self._lock:
                self.counters.staging_seconds += time.perf_counter() - start
        return crc


def _staged(block: "BlockWrite | BlockRead") -> bool:
    """Whether the block moves through a staging slot (it has no iovecs of its own)."""
    return (block.source if isinstance(block, BlockWrite) else block.dest) is None


def _room(slot: memoryview, nbytes: int) -> memoryview:
    """The staging slot, or a temporary aligned buffer when a block is larger than a slot
    (an entry written with a larger block_size than the store now uses)."""
    return slot if nbytes <= len(slot) else AlignedBuffer(nbytes).view
