"""Checking a store directory offline: every committed record's fields, extents and checksums, and
the space no record references; on request, deleting damaged records and reclaiming orphaned space.

A record is *damaged* when its own bytes fail their check: its record checksum, a field that does
not parse or disagrees with the others, a codec or dtype this version cannot decode, an extent
outside its swap file or in one that is gone, extents that overlap another record's (the older
record is blamed: committed extents are never reused, so the newer write is the one on disk), or a
chunk whose CRC-32 does not match. A store with an overlap or an extent past the end of its file
refuses to open until the record is deleted. A record whose swap file is *unavailable* (its
directory is missing, or holds another store's files) is not checked, and never deleted: the
store's swap directories are elsewhere, and ``--nvme-path`` names them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import threading
from typing import Callable, ContextManager, Iterator, Optional, Protocol, Sequence

from tiered.config import ALIGNMENT
from tiered.io.aligned import AlignedBuffer, round_up
from tiered.io.crc import crc32
from tiered.io.files import FileHandle, Syscalls, pread_full
from tiered.manifest.records import Record, Row
from tiered.offline.space import FileSpace, Reclaimed, account_space, reclaim
from tiered.offline.storedir import StoreDirectory


class ProgressSink(Protocol):
    """Anything that counts bytes done (:class:`tiered.offline.progress.ByteProgress`)."""

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` more bytes verified."""


@dataclasses.dataclass(frozen=True)
class Damage:
    """A record that cannot be read back intact, with every reason found."""

    row: Row
    reasons: tuple[str, ...]

    @property
    def key(self) -> str:
        """The damaged record's key."""
        return self.row.record.key


@dataclasses.dataclass(frozen=True)
class FsckReport:
    """What :func:`check_store` found and :func:`repair_store` did."""

    path: str
    entries: int
    verified_entries: int
    verified_bytes: int
    #: Keys whose records carry no checksums (written with ``checksum=False``): read, not verified.
    unverified: tuple[str, ...]
    damaged: tuple[Damage, ...]
    spaces: tuple[FileSpace, ...]
    deleted: tuple[str, ...] = ()
    reclaimed: Optional[Reclaimed] = None
    #: Records not checked because their swap files are unavailable (never deleted).
    unavailable: tuple[Damage, ...] = ()
    #: SQLite's ``PRAGMA integrity_check`` of the manifest: ``("ok",)`` when the database file is sound.
    integrity: tuple[str, ...] = ("ok",)
    #: The manifest is of the earlier format (no record checksums; opening the store upgrades it).
    legacy: bool = False

    @property
    def orphaned_bytes(self) -> int:
        """Bytes of the swap files that hold data no record references."""
        return sum(s.orphaned_bytes or 0 for s in self.spaces)

    @property
    def orphaned_ranges(self) -> int:
        """How many separate orphaned ranges there are."""
        return sum(len(s.orphaned or ()) for s in self.spaces)

    @property
    def clean(self) -> bool:
        """Healthy, and no orphaned space is left."""
        return self.healthy and self.orphaned_bytes == 0

    @property
    def healthy(self) -> bool:
        """No damaged or unchecked record, and SQLite found the database file sound. Orphaned space
        alone is harmless: the store allocates it again after a reopen (``--reclaim`` only hands it
        back to the filesystem sooner)."""
        return not self.damaged and not self.unavailable and self.integrity_ok

    @property
    def integrity_ok(self) -> bool:
        """SQLite's integrity check found nothing wrong."""
        return self.integrity == ("ok",)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "path": self.path,
            "clean": self.clean,
            "healthy": self.healthy,
            "entries": self.entries,
            "verified_entries": self.verified_entries,
            "verified_bytes": self.verified_bytes,
            "unverified": list(self.unverified),
            "damaged": [
                {"key": d.key, "generation": d.row.record.generation, "reasons": list(d.reasons)} for d in self.damaged
            ],
            "unavailable": [{"key": d.key, "reasons": list(d.reasons)} for d in self.unavailable],
            "integrity_check": list(self.integrity),
            "format": "legacy" if self.legacy else "current",
            "deleted": list(self.deleted),
            "orphaned_bytes": self.orphaned_bytes,
            "orphaned": [
                {"path": s.path, "offset": start, "length": end - start}
                for s in self.spaces
                for start, end in (s.orphaned or ())
            ],
            "reclaimed": dataclasses.asdict(self.reclaimed) if self.reclaimed is not None else None,
        }


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """One checksummed chunk of a record: the CRC at ``index`` covers ``length`` bytes at ``offset``."""

    record: int  # position in the list of records being verified
    index: int
    file: int
    offset: int
    length: int


def check_store(
    directory: StoreDirectory,
    *,
    threads: int = 8,
    progress: Optional[Callable[[int], ContextManager[ProgressSink]]] = None,
) -> FsckReport:
    """Check every record of ``directory`` and account its swap files' space; change nothing.

    Chunks are read with O_DIRECT where the filesystem allows, on ``threads`` threads. ``progress``
    is called with the number of bytes to verify and returns a context manager that counts them.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    rows = directory.rows
    records = [row.record for row in rows]
    reasons: dict[int, list[str]] = collections.defaultdict(list)
    elsewhere: dict[int, list[str]] = {}
    readable: list[int] = []
    for i, row in enumerate(rows):
        missing = _unavailable(row, directory)
        if missing and row.ok:
            elsewhere[i] = missing
            continue
        layout = _extent_problems(row, directory)
        reasons[i].extend(list(row.problems) + layout)
        if not layout and row.ok:
            readable.append(i)
    # A row whose checksum failed has untrustworthy extents and generation: it must not get an
    # intact record blamed for an overlap.
    trusted = [i for i, row in enumerate(rows) if row.intact and i not in elsewhere]
    for j, reason in _overlaps([records[i] for i in trusted]):
        reasons[trusted[j]].append(reason)
    checked = [i for i in readable if records[i].crcs is not None]
    total = sum(records[i].stored_nbytes for i in checked)
    mismatches = _verify(directory, records, checked, threads, total, progress)
    for i, reason in mismatches.items():
        reasons[i].append(reason)
    damaged = tuple(Damage(rows[i], tuple(r)) for i, r in sorted(reasons.items()) if r)
    return FsckReport(
        unavailable=tuple(Damage(rows[i], tuple(r)) for i, r in sorted(elsewhere.items())),
        integrity=directory.integrity,
        legacy=directory.legacy,
        path=directory.path,
        entries=len(records),
        verified_entries=len(checked),
        verified_bytes=total,
        unverified=tuple(records[i].key for i in readable if records[i].crcs is None),
        damaged=damaged,
        spaces=tuple(account_space(directory)),
    )


def repair_store(
    directory: StoreDirectory, report: FsckReport, *, delete_damaged: bool, reclaim_space: bool
) -> FsckReport:
    """Delete the damaged records of ``report`` (one durable manifest transaction), then give orphaned
    space back to the filesystem, as asked; return ``report`` updated with what was done and the
    space as it is now. ``directory`` must hold the store's exclusive lock."""
    if not directory.exclusive:
        raise ValueError("repair_store needs a StoreDirectory opened with exclusive=True")
    deleted: tuple[str, ...] = ()
    if delete_damaged and report.damaged:
        directory.delete_records([d.row for d in report.damaged])
        deleted = tuple(d.key for d in report.damaged)
    reclaimed = None
    if reclaim_space:
        reclaimed = reclaim(directory, account_space(directory))
    return dataclasses.replace(
        report, spaces=tuple(account_space(directory)), deleted=deleted, reclaimed=reclaimed
    )


def _unavailable(row: Row, directory: StoreDirectory) -> list[str]:
    """Why the record's swap files cannot be checked as this store's (empty when they can)."""
    reasons = []
    for index in sorted({e.file for e in row.record.extents}):
        f = directory.swap_file(index)
        if f is not None and f.unavailable is not None:
            reasons.append(f"its swap file {f.path} is unavailable: {f.unavailable}")
    return reasons


def _extent_problems(row: Row, directory: StoreDirectory) -> list[str]:
    """Reasons the record's bytes cannot be read where its extents say: a swap file the layout
    lacks or that is missing, an extent past the end of its file."""
    problems = []
    for e in row.record.extents:
        f = directory.swap_file(e.file)
        if f is None:
            problems.append(f"an extent is in swap file #{e.file}, but the layout has {len(directory.swap_files)}")
        elif not f.exists:
            problems.append(f"its swap file {f.path} is missing")
        elif e.offset + e.length > f.size - f.size % ALIGNMENT:
            problems.append(
                f"extent ({e.length} bytes at offset {e.offset}) lies past the end of {f.path} ({f.size} bytes)"
            )
    return problems


def _overlaps(records: Sequence[Record]) -> Iterator[tuple[int, str]]:
    """``(record position, reason)`` for every record with an extent overlapping another record's
    (the older of the two is blamed) or another of its own."""
    spans = sorted(
        (e.file, e.offset, e.offset + e.length, i) for i, r in enumerate(records) for e in r.extents if e.length > 0
    )
    pairs: set[tuple[int, int]] = set()
    active: list[tuple[int, int, int]] = []  # (file, end, record) of earlier extents that may reach this one
    for file, start, end, i in spans:
        active = [a for a in active if a[0] == file and a[1] > start]
        pairs.update((min(j, i), max(j, i)) for _, _, j in active)
        active.append((file, end, i))
    for a, b in sorted(pairs):
        if a == b:
            yield a, "two of its own extents overlap"
            continue
        ra, rb = records[a], records[b]
        for blamed, other in ((a, rb), (b, ra)):
            if records[blamed].generation <= other.generation:
                yield blamed, (
                    f"its extents overlap those of '{other.key}' (generation {other.generation}, newer or equal), "
                    "so its bytes were overwritten"
                )


def _chunks(r: Record, position: int) -> Iterator[_Chunk]:
    """The record's checksummed chunks in CRC order, as NvmeBackend._chunks numbers them."""
    left = r.stored_nbytes
    index = 0
    for e in r.extents:
        in_extent = min(e.length, left)
        off = 0
        while off < in_extent:
            n = min(r.chunk, in_extent - off)
            yield _Chunk(position, index, e.file, e.offset + off, n)
            index += 1
            off += n
        left -= in_extent


def _verify(
    directory: StoreDirectory,
    records: Sequence[Record],
    positions: Sequence[int],
    threads: int,
    total: int,
    progress: Optional[Callable[[int], ContextManager[ProgressSink]]],
) -> dict[int, str]:
    """Read every chunk of the records at ``positions`` and compare its CRC; a reason per failed record."""
    failures: dict[int, list[tuple[_Chunk, str]]] = collections.defaultdict(list)
    chunks = (c for i in positions for c in _chunks(records[i], i))
    with _ChunkReader(directory) as reader, concurrent.futures.ThreadPoolExecutor(
        threads, thread_name_prefix="tiered-fsck"
    ) as pool, (progress(total) if progress else _NoProgress()) as bar:
        window: collections.deque = collections.deque()

        def settle() -> None:
            chunk, future = window.popleft()
            error = future.result()
            if error is not None:
                failures[chunk.record].append((chunk, error))
            bar.advance(chunk.length)

        for chunk in chunks:
            expected = records[chunk.record].crcs[chunk.index]  # type: ignore[index]
            window.append((chunk, pool.submit(reader.check, chunk, expected)))
            if len(window) >= 2 * threads:
                settle()
        while window:
            settle()
    reasons = {}
    for i, failed in failures.items():
        chunk, error = failed[0]
        total_chunks = sum(1 for _ in _chunks(records[i], i))
        where = directory.swap_files[chunk.file].path
        reasons[i] = (
            f"{error} in {len(failed)} of {total_chunks} chunks (the first at offset {chunk.offset} of {where})"
        )
    return reasons


class _NoProgress:
    def __enter__(self) -> "_NoProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass


class _ChunkReader:
    """Reads chunks into per-thread aligned buffers (O_DIRECT where possible) and checks their CRC."""

    def __init__(self, directory: StoreDirectory) -> None:
        self._handles: dict[int, FileHandle] = {}
        self._local = threading.local()
        self._buffers: list[AlignedBuffer] = []
        self._lock = threading.Lock()
        self._syscalls = Syscalls()
        try:
            for f in directory.swap_files:
                if f.exists and f.unavailable is None:
                    self._handles[f.index] = _open_for_reading(f.path)
        except BaseException:
            self.__exit__()
            raise

    def __enter__(self) -> "_ChunkReader":
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles.values():
            handle.close()
        for buffer in self._buffers:
            buffer.close()

    def check(self, chunk: _Chunk, expected: int) -> Optional[str]:
        """None when the chunk reads back with CRC ``expected``, else what went wrong."""
        n = round_up(chunk.length)
        buffer = self._buffer(n)
        try:
            pread_full(self._syscalls, self._handles[chunk.file], [buffer.view[:n]], chunk.offset)
        except OSError as exc:
            return f"read error ({exc})"
        if crc32([buffer.view], chunk.length) != expected:
            return "checksum mismatch"
        return None

    def _buffer(self, nbytes: int) -> AlignedBuffer:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = AlignedBuffer(nbytes, prefault=True)
            with self._lock:
                self._buffers.append(buffer)
            self._local.buffer = buffer
        return buffer


def _open_for_reading(path: str) -> FileHandle:
    """Open read-only, with O_DIRECT unless the filesystem refuses it (then the page cache is used)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    if hasattr(os, "O_DIRECT"):
        try:
            return FileHandle(os.open(path, flags | os.O_DIRECT), path, True)
        except OSError as exc:
            if exc.errno != 22:  # EINVAL: no O_DIRECT on this filesystem
                raise
    return FileHandle(os.open(path, flags), path, False)
