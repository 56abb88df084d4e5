"""A free-list allocator of aligned byte ranges, used for host slabs and swap-file space."""

from __future__ import annotations

import bisect
from typing import NamedTuple

from tiered.config import ALIGNMENT


class Extent(NamedTuple):
    """A byte range ``[offset, offset + length)``."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.offset + self.length


class ExtentAllocator:
    """Hands out ``ALIGNMENT``-aligned ranges of ``[0, capacity)`` and takes them back, coalescing.

    An allocation prefers one contiguous range (first fit by address, so files stay compact) and
    otherwise scatters over several ranges, largest first, so fragmentation never refuses a request
    that the free total could hold.
    """

    def __init__(self, capacity: int) -> None:
        assert capacity >= 0 and capacity % ALIGNMENT == 0
        self.capacity = capacity
        self._starts: list[int] = []  # sorted starts of free ranges
        self._lengths: dict[int, int] = {}
        self.free_bytes = 0
        if capacity:
            self._insert(0, capacity)

    @property
    def used_bytes(self) -> int:
        """Bytes currently allocated."""
        return self.capacity - self.free_bytes

    def high_water(self) -> int:
        """One past the last allocated byte (0 when nothing is allocated)."""
        if not self._starts:
            return self.capacity
        last = self._starts[-1]
        return last if last + self._lengths[last] == self.capacity else self.capacity

    def allocate(self, nbytes: int, *, contiguous: bool = False) -> list[Extent] | None:
        """Reserve ``nbytes`` rounded up to the alignment; None if it does not fit."""
        need = _round(nbytes)
        if need == 0:
            return []
        if need > self.free_bytes:
            return None
        for start in self._starts:
            if self._lengths[start] >= need:
                self._take(start, need)
                return [Extent(start, need)]
        if contiguous:
            return None
        pieces: list[Extent] = []
        for start in sorted(self._starts, key=lambda s: -self._lengths[s]):
            take = min(self._lengths[start], need)
            self._take(start, take)
            pieces.append(Extent(start, take))
            need -= take
            if need == 0:
                break
        assert need == 0
        return sorted(pieces)

    def free(self, extents: list[Extent]) -> None:
        """Return ranges obtained from :meth:`allocate` (or marked with :meth:`mark_used`)."""
        for ext in extents:
            if ext.length:
                self._insert(ext.offset, ext.length)

    def mark_used(self, ext: Extent) -> None:
        """Remove a specific range from the free list (rebuilding state on reopen)."""
        assert ext.offset % ALIGNMENT == 0 and ext.length % ALIGNMENT == 0
        i = bisect.bisect_right(self._starts, ext.offset) - 1
        if i < 0 or self._starts[i] + self._lengths[self._starts[i]] < ext.end:
            raise ValueError(f"extent {ext} overlaps an allocated range")
        start = self._starts[i]
        length = self._lengths.pop(start)
        del self._starts[i]
        self.free_bytes -= length
        if ext.offset > start:
            self._insert(start, ext.offset - start)
        if start + length > ext.end:
            self._insert(ext.end, start + length - ext.end)

    def free_ranges(self) -> list[Extent]:
        """The free ranges, by address."""
        return [Extent(start, self._lengths[start]) for start in self._starts]

    def grow(self, new_capacity: int) -> None:
        """Extend the managed range to ``new_capacity`` bytes."""
        assert new_capacity >= self.capacity and new_capacity % ALIGNMENT == 0
        if new_capacity > self.capacity:
            old = self.capacity
            self.capacity = new_capacity
            self._insert(old, new_capacity - old)

    def _take(self, start: int, length: int) -> None:
        have = self._lengths.pop(start)
        i = bisect.bisect_left(self._starts, start)
        del self._starts[i]
        self.free_bytes -= have
        if have > length:
            self._insert(start + length, have - length)

    def _insert(self, start: int, length: int) -> None:
        end = start + length
        i = bisect.bisect_left(self._starts, start)
        if i > 0:
            prev = self._starts[i - 1]
            assert prev + self._lengths[prev] <= start, f"double free of [{start}, {end})"
            if prev + self._lengths[prev] == start:
                self.free_bytes -= self._lengths[prev]
                start, length = prev, self._lengths.pop(prev) + length
                del self._starts[i - 1]
                i -= 1
        if i < len(self._starts):
            nxt = self._starts[i]
            assert end <= nxt, f"double free of [{start}, {end})"
            if nxt == end:
                self.free_bytes -= self._lengths[nxt]
                length += self._lengths.pop(nxt)
                del self._starts[i]
        self._starts.insert(i, start)
        self._lengths[start] = length
        self.free_bytes += length


def _round(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT
