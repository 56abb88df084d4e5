"""How the swap files' bytes divide into allocated, free and orphaned space, and giving orphaned space back.

*Allocated* bytes lie in extents that committed records reference. Of the rest, *orphaned* bytes
still hold data (versions that were deleted or replaced, or writes that a crash left without a
record): the filesystem maps them to written blocks (``FIEMAP``; ``SEEK_DATA`` where it lacks
that). *Free* bytes hold none: space reserved by ``fallocate`` but never written, or holes. A
running store reuses both kinds; a clean close drops the stale bytes of the space it used, so
only a store that did not close cleanly leaves orphaned space ([Note: free space at close] in
tiered.backends.free_space); reclaiming orphaned space returns it to the filesystem (and drops
the stale bytes).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import os
import struct
from typing import Iterable, Optional, Sequence

from tiered.config import ALIGNMENT
from tiered.errors import ManifestError
from tiered.manifest.records import Row
from tiered.offline.storedir import StoreDirectory, SwapFileInfo

Range = tuple[int, int]  # [start, end) in bytes

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


@dataclasses.dataclass(frozen=True)
class FileSpace:
    """One swap file's bytes: ``allocated_bytes`` used by records, ``orphaned`` ranges of stale data
    (None when unknown: a running store's writes in flight would look orphaned), the rest free."""

    index: int
    path: str
    exists: bool
    size: int
    disk_bytes: int
    allocated_bytes: int
    orphaned: Optional[tuple[Range, ...]]
    #: Why the file is not taken for this store's (SwapFileInfo.unavailable); its space is then not accounted.
    unavailable: Optional[str] = None

    @property
    def orphaned_bytes(self) -> Optional[int]:
        """Bytes in :attr:`orphaned`."""
        return None if self.orphaned is None else sum(end - start for start, end in self.orphaned)

    @property
    def free_bytes(self) -> Optional[int]:
        """Bytes of the file neither allocated nor orphaned."""
        orphaned = self.orphaned_bytes
        return None if orphaned is None else self.size - self.allocated_bytes - orphaned


@dataclasses.dataclass(frozen=True)
class Reclaimed:
    """What :func:`reclaim` gave back: orphaned bytes dropped, and disk usage before and after."""

    orphaned_bytes: int
    truncated_bytes: int
    disk_bytes_before: int
    disk_bytes_after: int


def merge(ranges: Iterable[Range]) -> list[Range]:
    """Sorted, non-overlapping ranges covering the same bytes (touching ranges are joined)."""
    out: list[Range] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def subtract(ranges: Sequence[Range], minus: Sequence[Range]) -> list[Range]:
    """The bytes of merged ``ranges`` that are not in merged ``minus``."""
    out: list[Range] = []
    j = 0
    for start, end in ranges:
        while j < len(minus) and minus[j][1] <= start:
            j += 1
        k = j
        while k < len(minus) and minus[k][0] < end:
            if minus[k][0] > start:
                out.append((start, minus[k][0]))
            start = max(start, minus[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def allocated_ranges(records: Iterable[Row], index: int, size: int) -> list[Range]:
    """Merged byte ranges of swap file ``index`` that records reference, clipped to ``size``."""
    return merge(
        (max(e.offset, 0), min(e.offset + e.length, size))
        for r in records
        for e in r.record.extents
        if e.file == index and e.length > 0
    )


def data_ranges(path: str, size: int) -> list[Range]:
    """Ranges of the file that hold data: written extents by ``FIEMAP`` (space reserved by fallocate
    but never written is not data); ``SEEK_DATA``/``SEEK_HOLE`` where the filesystem has no FIEMAP,
    and the whole file where it can tell neither."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        try:
            return merge(_fiemap_data(fd, size))
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
                raise
        return _seek_data(fd, size)
    finally:
        os.close(fd)


# struct fiemap (linux/fiemap.h): a 32-byte header, then struct fiemap_extent records of 56 bytes.
_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_FLAG_SYNC = 0x1
_FIEMAP_EXTENT_LAST = 0x1
_FIEMAP_EXTENT_UNWRITTEN = 0x800
_FIEMAP_HEADER = struct.Struct("=QQIIII")
_FIEMAP_EXTENT = struct.Struct("=QQQ16xI12x")
_FIEMAP_BATCH = 256


def _fiemap_data(fd: int, size: int) -> list[Range]:
    """Written (not merely reserved) extents of the open file, clipped to ``size``."""
    out: list[Range] = []
    start = 0
    while start < size:
        request = bytearray(_FIEMAP_HEADER.size + _FIEMAP_BATCH * _FIEMAP_EXTENT.size)
        _FIEMAP_HEADER.pack_into(request, 0, start, size - start, _FIEMAP_FLAG_SYNC, 0, _FIEMAP_BATCH, 0)
        fcntl.ioctl(fd, _FS_IOC_FIEMAP, request)
        mapped = _FIEMAP_HEADER.unpack_from(request, 0)[3]
        if mapped == 0:
            break
        last = False
        for i in range(mapped):
            at = _FIEMAP_HEADER.size + i * _FIEMAP_EXTENT.size
            logical, _, length, flags = _FIEMAP_EXTENT.unpack_from(request, at)
            if not flags & _FIEMAP_EXTENT_UNWRITTEN:
                out.append((logical, min(logical + length, size)))
            start = max(start, logical + length)
            last = bool(flags & _FIEMAP_EXTENT_LAST)
        if last:
            break
    return out


def _seek_data(fd: int, size: int) -> list[Range]:
    out: list[Range] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after pos
                break
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return [(0, size)] if size else []
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end > start:
            out.append((start, end))
        pos = max(end, start + 1)
    return out


def account_space(directory: StoreDirectory, *, find_orphans: bool = True) -> list[FileSpace]:
    """Allocated and orphaned space of every swap file in the directory's layout."""
    return [_file_space(f, directory.rows, find_orphans) for f in directory.swap_files]


def _file_space(f: SwapFileInfo, records: Sequence[Row], find_orphans: bool) -> FileSpace:
    allocated = allocated_ranges(records, f.index, f.size)
    orphaned: Optional[tuple[Range, ...]] = None
    if find_orphans and f.unavailable is None:  # another store's file is never taken for orphaned space
        orphaned = tuple(subtract(merge(data_ranges(f.path, f.size)), allocated)) if f.exists else ()
    return FileSpace(
        index=f.index,
        path=f.path,
        exists=f.exists,
        size=f.size,
        disk_bytes=f.disk_bytes,
        allocated_bytes=sum(end - start for start, end in allocated),
        orphaned=orphaned,
        unavailable=f.unavailable,
    )


def reclaim(directory: StoreDirectory, spaces: Sequence[FileSpace]) -> Reclaimed:
    """Give orphaned space back to the filesystem: truncate each file after its last allocated byte,
    and punch holes in the orphaned ranges before it. Needs the store's exclusive lock.

    Raises ManifestError when a record's extent list cannot be parsed (its bytes would look
    orphaned), OSError when the filesystem cannot punch holes (the message says which file).
    """
    assert directory.exclusive, "reclaim needs the store's exclusive lock"
    unknown = [r.record.key for r in directory.rows if not r.extents_known]
    if unknown:
        raise ManifestError(
            f"cannot reclaim space: the extent lists of {len(unknown)} record(s) are unreadable (the first is "
            f"{unknown[0]!r}), so their space cannot be told from orphaned space; --delete-damaged removes them"
        )
    orphaned = truncated = before = after = 0
    for space in spaces:
        if not space.exists or not space.orphaned:
            continue
        last = max((end for start, end in allocated_ranges(directory.rows, space.index, space.size)), default=0)
        keep = -(-last // ALIGNMENT) * ALIGNMENT
        fd = os.open(space.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            before += os.fstat(fd).st_blocks * 512
            for start, end in space.orphaned:
                if start < keep:
                    _punch_hole(fd, start, min(end, keep) - start, space.path)
                orphaned += end - start
            if keep < space.size:
                os.ftruncate(fd, keep)
                truncated += space.size - keep
            os.fsync(fd)
            after += os.fstat(fd).st_blocks * 512
        finally:
            os.close(fd)
    return Reclaimed(orphaned, truncated, before, after)


def _punch_hole(fd: int, offset: int, length: int, path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = libc.fallocate64 if hasattr(libc, "fallocate64") else libc.fallocate
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int
    if fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot punch a hole of {length} bytes at offset {offset} of {path}: {os.strerror(err)}")
