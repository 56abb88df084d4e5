"""Giving a swap file's free space back when its store closes cleanly.

[Note: free space at close]
While a store runs, extents freed by replaced or deleted versions keep their stale bytes, and the
files keep the room they grew into: the store reuses both. At a clean close (every write done,
every record committed, nothing lost at close) the store gives back what it will not need: each
file is cut after its last byte in use, and the free ranges before that are made to hold no data,
keeping their blocks reserved for reuse (``FALLOC_FL_ZERO_RANGE``, metadata only; holes where the
filesystem has only ``FALLOC_FL_PUNCH_HOLE``; left as they are where it has neither). ``tiered
inspect`` and ``tiered fsck`` then find only free space beside the records: data no record
references ("orphaned") is left only by a store that did not close cleanly.

Only space this store has known to be free is touched: ranges that held records it read at open
or that it allocated since, never freed by a committed record that still points there (rule 2 of
[Note: crash safety] in tiered.store.versions). Ranges already free at open and never
allocated since are left as they are, with the file's length over them: they may hold what a crash
left, or the bytes of a record a damaged manifest no longer names, which ``tiered fsck`` reports
and only ``--reclaim`` drops.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
from typing import Sequence

from tiered.manifest.extents import Extent

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE, _FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10


class UntouchedRanges:
    """The ranges of one swap file that were free when its store opened and that it has not allocated
    since: sorted, disjoint, only ever shrinking."""

    def __init__(self, free_at_open: Sequence[Extent]) -> None:
        self._starts = [e.offset for e in free_at_open]
        self._ends = [e.end for e in free_at_open]

    def ranges(self) -> list[Extent]:
        """The ranges, by address."""
        return [Extent(s, e - s) for s, e in zip(self._starts, self._ends)]

    def allocated(self, offset: int, length: int) -> None:
        """Take ``[offset, offset + length)`` out: the store has allocated it."""
        if not self._starts:
            return
        end = offset + length
        i = bisect.bisect_right(self._ends, offset)  # the first range ending after offset
        pieces: list[tuple[int, int]] = []
        j = i
        while j < len(self._starts) and self._starts[j] < end:
            if self._starts[j] < offset:
                pieces.append((self._starts[j], offset))
            if self._ends[j] > end:
                pieces.append((end, self._ends[j]))
            j += 1
        self._starts[i:j] = [p[0] for p in pieces]
        self._ends[i:j] = [p[1] for p in pieces]


def give_back(fd: int, free: Sequence[Extent], untouched: Sequence[Extent], capacity: int) -> None:
    """Cut the file after its last allocated or untouched byte and drop the data of the other free
    ranges (``free`` and ``untouched`` by address, ``untouched`` within ``free``)."""
    known = _subtract(free, untouched)
    keep = max(untouched[-1].end if untouched else 0, _last_used_end(free, capacity))
    if keep < capacity:
        os.ftruncate(fd, keep)
    known = [Extent(e.offset, min(e.end, keep) - e.offset) for e in known if e.offset < keep]
    for mode in (_FALLOC_FL_ZERO_RANGE, _FALLOC_FL_PUNCH_HOLE):
        try:
            for ext in known:
                _fallocate(fd, mode | _FALLOC_FL_KEEP_SIZE, ext.offset, ext.length)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise


def _last_used_end(free: Sequence[Extent], capacity: int) -> int:
    """One past the last allocated byte of a file of ``capacity`` bytes with these free ranges."""
    if free and free[-1].end == capacity:
        return free[-1].offset
    return capacity


def _subtract(ranges: Sequence[Extent], minus: Sequence[Extent]) -> list[Extent]:
    """The bytes of ``ranges`` not in ``minus`` (both sorted and disjoint)."""
    out: list[Extent] = []
    j = 0
    for r in ranges:
        start, end = r.offset, r.end
        while j < len(minus) and minus[j].end <= start:
            j += 1
        k = j
        while k < len(minus) and minus[k].offset < end:
            if minus[k].offset > start:
                out.append(Extent(start, minus[k].offset - start))
            start = max(start, minus[k].end)
            k += 1
        if start < end:
            out.append(Extent(start, end - start))
    return out


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = libc.fallocate64 if hasattr(libc, "fallocate64") else libc.fallocate
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int
    if fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
