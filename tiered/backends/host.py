"""The host tier: page-aligned (and, under CUDA, pinned) memory under a budget, taken slab by slab.

[Note: host arena]
The host tier's memory is one address range reserved for the whole budget, whose slabs are
populated (and pinned with ``cudaHostRegister`` under CUDA, so copies to and from the GPU are
asynchronous DMA) when first needed and kept after ([Note: host slabs] in
tiered.backends.host_arena). An ``ExtentAllocator`` hands out 4 KiB-aligned ranges of it, one
contiguous range when it can and several otherwise, rather than slabs of fixed sizes: there are no
size classes to tune, nothing is wasted beyond the round-up to 4 KiB, and any request no larger
than the free total fits, so fragmentation never forces an extra eviction. The price is that a
host copy is a list of spans, which every copy routine handles anyway. The ranges double as
O_DIRECT buffers, so moving a copy between host memory and the disk needs no staging copy (see
[Note: in-place O_DIRECT] in tiered.io.spans), and pages are reused across copies: the hot path never
maps memory, and a page is first touched at most once per store. The arena is not asked for huge
pages: finding them may have the kernel compact memory, which makes taking a slab slow and its
time erratic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Sequence

from tiered.backends.base import Copy, TierBackend
from tiered.config import ALIGNMENT
from tiered.errors import CapacityError
from tiered.backends.host_arena import HostArena
from tiered.io.aligned import round_up
from tiered.io.spans import Span, copy_spans
from tiered.manifest.extents import Extent
from tiered.tier import Tier


@dataclasses.dataclass(eq=False)
class HostCopy(Copy):
    """A copy held in one or more page-aligned ranges of the host pool."""

    extents: list[Extent] = dataclasses.field(default_factory=list)


class HostBackend(TierBackend):
    """Host memory served from an arena of ``budget`` bytes whose slabs are kept once taken, so the
    warm hot path never allocates (see [Note: host arena])."""

    tier = Tier.HOST

    def __init__(
        self, budget: int, pool: concurrent.futures.Executor, *, pin: bool = False, prefault: bool = False
    ) -> None:
        super().__init__()
        self.budget = budget - budget % ALIGNMENT
        self._pool = pool
        self._arena = HostArena(self.budget, pool, pin=pin, prefault=prefault)
        self.pinned = pin

    def footprint(self, nbytes: int) -> int:
        return round_up(nbytes)

    async def allocate(self, nbytes: int) -> HostCopy:
        self.check_fits_budget(nbytes)
        extents = self._arena.take(nbytes)
        if extents is None:
            raise CapacityError(
                f"host tier: {nbytes} bytes do not fit ({self.used} of {self.budget} bytes in use)"
            )
        copy = HostCopy(nbytes=nbytes, footprint=sum(e.length for e in extents), extents=extents)
        self.used += copy.footprint  # before waiting for a new slab, so has_room counts it meanwhile
        try:
            await self._arena.ready(extents)
        except BaseException:
            self._free(copy)
            raise
        return copy

    def _free(self, copy: Copy) -> None:
        assert isinstance(copy, HostCopy)
        self._arena.free(copy.extents)
        self.used -= copy.footprint
        copy.extents = []

    def spans(self, copy: Copy) -> list[Span]:
        assert isinstance(copy, HostCopy) and not (copy.released and copy.readers == 0)
        buffer = self._arena.buffer
        assert buffer is not None or copy.nbytes == 0
        out: list[Span] = []
        left = copy.nbytes
        for ext in copy.extents:
            n = min(left, ext.length)
            if n == 0:
                break
            out.append(
                Span(
                    buffer.tensor[ext.offset : ext.offset + n],  # type: ignore[union-attr]
                    buffer.view[ext.offset : ext.end],  # type: ignore[union-attr]
                )
            )
            left -= n
        return out

    async def store(self, copy: Copy, src: Sequence[Span]) -> None:
        if copy.nbytes:
            await asyncio.get_running_loop().run_in_executor(self._pool, copy_spans, self.spans(copy), src)

    async def load(self, copy: Copy, dst: Sequence[Span]) -> None:
        if copy.nbytes:
            await asyncio.get_running_loop().run_in_executor(self._pool, copy_spans, dst, self.spans(copy))

    @property
    def resident_bytes(self) -> int:
        """Bytes of host memory the tier has taken so far (its slabs; at most the budget)."""
        return self._arena.taken_bytes

    async def close(self) -> None:
        await self._arena.close()
