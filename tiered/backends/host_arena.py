"""The host tier's memory: one address range reserved for the whole budget, filled slab by slab.

[Note: host slabs]
The budget is a ceiling, not a reservation. At open the arena maps the whole budget as one private
anonymous range, which costs address space only: no page is touched, so opening takes the same
time and memory at any budget. Memory becomes usable a slab (``SLAB_BYTES``, or what is left of the
budget) at a time, when an allocation finds too few free bytes in the slabs taken so far; a new
slab is populated in one kernel call (``MADV_POPULATE_WRITE``, on a cpu-pool thread, never on the
loop) and, under CUDA, page-locked with ``cudaHostRegister``, before any copy uses it. A slab is
kept once taken, for the life of the store: a warm hot path neither maps memory nor takes a page
fault, while a store holding little uses little. The resident set is the slabs taken, so at most
one slab more than the most the tier has held at once.

No range handed out crosses a slab boundary (allocations are split there), so every piece of a
host copy lies in one page-locked registration and copies to and from the GPU stay asynchronous.
With ``prefault=False`` (``StoreConfig.prefault_host``) a slab is not populated when taken; its
pages are faulted in one by one as copies first touch them (slower first transfers, the same
memory in the end).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import mmap
from typing import Optional

import torch

from tiered.config import ALIGNMENT, MiB
from tiered.manifest.extents import Extent, ExtentAllocator
from tiered.io.aligned import AlignedBuffer

#: Bytes the arena takes at a time (a multiple of the page size and of ALIGNMENT).
SLAB_BYTES = 64 * MiB


class HostArena:
    """``budget`` bytes of host memory handed out as 4 KiB-aligned extents, taken slab by slab
    ([Note: host slabs]). Driven from one event loop; population and pinning run on ``pool``."""

    def __init__(self, budget: int, pool: concurrent.futures.Executor, *, pin: bool, prefault: bool) -> None:
        assert budget >= 0 and budget % ALIGNMENT == 0
        self.budget = budget
        self.pin = pin
        self.prefault = prefault
        self._pool = pool
        self.buffer: Optional[AlignedBuffer] = AlignedBuffer(budget) if budget else None
        self._alloc = ExtentAllocator(0)
        #: One future per slab taken, in address order: done when the slab is populated (and pinned).
        self._slabs: list[asyncio.Future] = []
        self._pinned: list[tuple[int, int]] = []  # (offset, length) registered with CUDA

    @property
    def taken_bytes(self) -> int:
        """Bytes of the slabs taken so far (the arena's share of the resident set)."""
        return self._alloc.capacity

    def take(self, nbytes: int) -> Optional[list[Extent]]:
        """Extents holding ``nbytes`` (rounded up to ALIGNMENT), none crossing a slab boundary, taking
        new slabs as needed; None when they do not fit in the budget's free bytes. Copies may use
        them once :meth:`ready` returns."""
        need = -(-nbytes // ALIGNMENT) * ALIGNMENT
        if need - self._alloc.free_bytes > self.budget - self._alloc.capacity:
            return None
        while self._alloc.free_bytes < need:
            self._take_slab()
        extents = self._alloc.allocate(need)
        assert extents is not None
        return _split_at_slabs(extents)

    def free(self, extents: list[Extent]) -> None:
        """Give extents from :meth:`take` back (their slabs stay taken)."""
        self._alloc.free(extents)

    async def close(self) -> None:
        """Wait for slabs being populated, unpin and unmap. Extents must no longer be used."""
        if self._slabs:
            await asyncio.gather(*self._slabs, return_exceptions=True)
        if self.buffer is None:
            return
        for offset, length in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.address + offset)
        self._pinned.clear()
        self.buffer.close()
        self.buffer = None

    def _take_slab(self) -> None:
        start = self._alloc.capacity
        length = min(SLAB_BYTES, self.budget - start)
        self._alloc.grow(start + length)
        future = asyncio.get_running_loop().run_in_executor(self._pool, self._prepare, start, length)
        self._slabs.append(future)

    def _prepare(self, start: int, length: int) -> None:
        """Populate (``prefault``) and page-lock (``pin``) one slab; on a pool thread."""
        assert self.buffer is not None
        if self.prefault:
            self.buffer.populate(start, length)
        if self.pin:  # registering populates the pages too
            err = int(torch.cuda.cudart().cudaHostRegister(self.buffer.address + start, length, 0))
            if err != 0:
                raise RuntimeError(
                    f"cudaHostRegister of a {length}-byte slab of the host tier failed with CUDA error {err}; "
                    "lower host_bytes or raise the locked-memory limit (ulimit -l)"
                )
            self._pinned.append((start, length))

    async def ready(self, extents: list[Extent]) -> None:
        """Wait until every slab ``extents`` lie in is populated (and pinned), re-raising the error of
        one that could not be; at once when they are."""
        if not extents:
            return
        first = extents[0].offset // SLAB_BYTES
        last = (extents[-1].end - 1) // SLAB_BYTES
        for slab in self._slabs[first : last + 1]:
            if not slab.done():
                await asyncio.shield(slab)
            elif slab.exception() is not None:
                raise slab.exception()  # type: ignore[misc]


def _split_at_slabs(extents: list[Extent]) -> list[Extent]:
    """``extents`` with each one crossing a slab boundary cut there."""
    out: list[Extent] = []
    for e in extents:
        offset, end = e.offset, e.end
        while offset < end:
            cut = min(end, (offset // SLAB_BYTES + 1) * SLAB_BYTES)
            out.append(Extent(offset, cut - offset))
            offset = cut
    return out


assert SLAB_BYTES % mmap.PAGESIZE == 0 and SLAB_BYTES % ALIGNMENT == 0
