"""Page-aligned memory from anonymous mmap, optionally page-locked for CUDA."""

from __future__ import annotations

import mmap

import torch

from tiered.config import ALIGNMENT


#: madvise(MADV_POPULATE_WRITE), Linux 5.14+; Python's mmap module names it only from 3.13.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def round_up(n: int, multiple: int = ALIGNMENT) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def anonymous_map(nbytes: int, *, populate: bool, huge_pages: bool = False) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` rounded up to whole pages (so page-aligned).

    ``populate`` gives it every page now, in one kernel call (``MADV_POPULATE_WRITE``), rather than
    one fault per 4 KiB page on first touch, as DeepSpeed's locked tensors are populated when they
    are locked: no fault is left for the middle of a transfer. (On the development VM, alternated
    runs of raw O_DIRECT threads from populated memory against memory faulted in by a copy came out
    +10-23% in one session and -18% in another: there the speed of a region of memory appears to
    depend more on where it lands than on how it was populated; ``benchmarks/disk_alternation.py
    --faulted`` measures it.) ``huge_pages`` asks for
    transparent huge pages first (``MADV_HUGEPAGE``; refused quietly where THP is off).
    """
    size = round_up(max(nbytes, 1), mmap.PAGESIZE)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # kernels without THP refuse the advice; the memory works the same
            pass
    if populate:
        try:
            region.madvise(_MADV_POPULATE_WRITE)
        except OSError:  # a kernel before 5.14: touch one byte per page instead
            pages = memoryview(region).cast("B")[:: mmap.PAGESIZE]
            for i in range(len(pages)):
                pages[i] = 0
    return region


class AlignedBuffer:
    """A page-aligned byte region (anonymous mmap) usable for O_DIRECT.

    ``torch.empty`` is only 64-byte aligned, so O_DIRECT buffers come from here. Under CUDA the
    region can be registered as pinned memory so host<->device copies run asynchronously.
    """

    def __init__(self, nbytes: int, *, pin: bool = False, prefault: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError(f"AlignedBuffer size must be positive, got {nbytes}")
        self.nbytes = round_up(nbytes, mmap.PAGESIZE)
        self._map = anonymous_map(self.nbytes, populate=prefault)
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        assert self.address % ALIGNMENT == 0, "mmap returned memory that is not page-aligned"
        self.pinned = False
        if pin:
            self._pin()

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
