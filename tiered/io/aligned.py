"""Page-aligned memory from anonymous mmap, optionally page-locked for CUDA."""

from __future__ import annotations

import mmap

import torch

from tiered.config import ALIGNMENT


def round_up(n: int, multiple: int = ALIGNMENT) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


class AlignedBuffer:
    """A page-aligned byte region (anonymous mmap) usable for O_DIRECT.

    ``torch.empty`` is only 64-byte aligned, so O_DIRECT buffers come from here. Under CUDA the
    region can be registered as pinned memory so host<->device copies run asynchronously.
    """

    def __init__(self, nbytes: int, *, pin: bool = False, prefault: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError(f"AlignedBuffer size must be positive, got {nbytes}")
        self.nbytes = round_up(nbytes, mmap.PAGESIZE)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if prefault and hasattr(mmap, "MAP_POPULATE"):
            flags |= mmap.MAP_POPULATE
        self._map = mmap.mmap(-1, self.nbytes, flags=flags)
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
