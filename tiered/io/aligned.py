"""Page-aligned memory from anonymous mmap, optionally page-locked for CUDA."""

from __future__ import annotations

import ctypes
import mmap

import torch

from tiered.config import ALIGNMENT


#: madvise(MADV_POPULATE_WRITE), Linux 5.14+; Python's mmap module names it only from 3.13.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def round_up(n: int, multiple: int = ALIGNMENT) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def anonymous_map(nbytes: int, *, populate: bool, huge_pages: bool = False, lock: bool = False) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` rounded up to whole pages (so page-aligned).

    ``populate`` gives it every page now, in one kernel call (``MADV_POPULATE_WRITE``), rather than
    one fault per 4 KiB page on first touch, as DeepSpeed's locked tensors are populated when they
    are locked: no fault is left for the middle of a transfer. ``huge_pages`` asks for
    transparent huge pages first (``MADV_HUGEPAGE``; refused quietly where THP is off). ``lock``
    page-locks it where the process may (:func:`lock_pages`).
    """
    size = round_up(max(nbytes, 1), mmap.PAGESIZE)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # kernels without THP refuse the advice; the memory works the same
            pass
    if populate:
        populate_pages(region, 0, size)
    if lock:
        lock_pages(region)
    return region


def populate_pages(region: mmap.mmap, start: int, length: int) -> None:
    """Give ``region``'s pages in ``[start, start + length)`` (page-aligned) memory now, in one kernel
    call (``MADV_POPULATE_WRITE``), or by touching one byte per page on kernels before 5.14. Pages
    already present keep their contents."""
    if length <= 0:
        return
    try:
        region.madvise(_MADV_POPULATE_WRITE, start, length)
    except OSError:  # a kernel before 5.14: write one byte per page, adding 0 to keep its contents
        pages = torch.frombuffer(region, dtype=torch.uint8, offset=start, count=length)[:: mmap.PAGESIZE]
        pages.add_(0)


def lock_pages(region: mmap.mmap) -> bool:
    """``mlock`` the whole mapping, as DeepSpeed's ``new_cpu_locked_tensor`` locks its memory; True
    if it is now locked. False, leaving it unlocked, where the process may not lock that much
    (``RLIMIT_MEMLOCK``, 8 MiB by default without root or ``CAP_IPC_LOCK``): locking only speeds
    transfers up, nothing depends on it. The lock goes with the mapping.

    Why: a kernel that pages cold memory out in the background (a DAMON ``pageout`` scheme, say)
    leaves locked pages alone, so no transfer waits for its buffer to come back into memory.
    """
    address = ctypes.c_char.from_buffer(region)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.mlock(ctypes.c_void_p(ctypes.addressof(address)), ctypes.c_size_t(len(region))) == 0
    finally:
        del address  # the export would keep the mapping from being closed


class AlignedBuffer:
    """A page-aligned byte region (anonymous mmap) usable for O_DIRECT.

    ``torch.empty`` is only 64-byte aligned, so O_DIRECT buffers come from here. Under CUDA the
    region can be registered as pinned memory so host<->device copies run asynchronously.
    """

    def __init__(
        self, nbytes: int, *, pin: bool = False, prefault: bool = False, lock: bool = False, huge_pages: bool = False
    ) -> None:
        if nbytes <= 0:
            raise ValueError(f"AlignedBuffer size must be positive, got {nbytes}")
        self.nbytes = round_up(nbytes, mmap.PAGESIZE)
        # ``lock``: page-locked where permitted (lock_pages); pinning under CUDA locks it anyway.
        # ``huge_pages``: anonymous_map's MADV_HUGEPAGE, for buffers that O_DIRECT moves whole blocks through.
        self._map = anonymous_map(self.nbytes, populate=prefault, huge_pages=huge_pages, lock=lock and not pin)
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        assert self.address % ALIGNMENT == 0, "mmap returned memory that is not page-aligned"
        self.pinned = False
        if pin:
            self._pin()

    def populate(self, start: int, length: int) -> None:
        """Populate the pages of ``[start, start + length)`` (page-aligned) now (:func:`populate_pages`)."""
        populate_pages(self._map, start, length)

    def _pin(self) -> None:
        err = torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(
                f"cudaHostRegister of {self.nbytes} bytes failed with CUDA error {int(err)}; "
                "lower host_bytes or raise the locked-memory limit (ulimit -l)"
            )
        self.pinned = True

    def close(self) -> None:
        """Unpin and unmap. Views taken from this buffer must no longer be used."""
        if self._map.closed:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False
        self.view.release()
        del self.tensor
        try:
            self._map.close()
        except BufferError:
            # A torch view still exports the buffer; the mapping is freed when that view dies.
            pass
