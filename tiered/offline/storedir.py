"""A store directory opened without starting a store: its lock, layout, committed records and swap files.

The manifest is read with SQLite alone: a store that was closed cleanly is read as an immutable
file (SQLite creates no side files), one with a write-ahead log (a crash, or a store running now)
through a read-only connection that sees every committed transaction. Rows are parsed defensively:
a field that cannot be parsed becomes a problem of its record, not an exception, so ``fsck`` can
report it. Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import sqlite3
import urllib.parse
from typing import Optional, Sequence

from tiered.backends.nvme import swap_file_path
from tiered.codecs import READABLE_CODECS
from tiered.errors import ManifestError, StoreLockedError
from tiered.manifest import FORMAT_VERSION, MANIFEST_NAME
from tiered.records import SELECT_ROWS, Row, parse_row
from tiered.store import LOCK_NAME



@dataclasses.dataclass(frozen=True)
class SwapFileInfo:
    """One swap file the layout names: where it is and how large it is (0 when it is missing)."""

    index: int
    path: str
    exists: bool
    size: int
    disk_bytes: int


def stores_in(path: str) -> list[str]:
    """The store directories a command given ``path`` works on: ``path`` itself when it is one (or
    is none and holds none, for the error to name it), else the store directories directly inside
    it, in natural order (a sharded engine run keeps one store per rank: ``rank0``, ``rank1``, ...)."""
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)) or not os.path.isdir(path):
        return [path]
    inside = [os.path.join(path, name) for name in os.listdir(path)
              if os.path.isfile(os.path.join(path, name, MANIFEST_NAME))]
    return sorted(inside, key=_natural) or [path]


def _natural(path: str) -> list:
    """Sort key putting ``rank2`` before ``rank10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", os.path.basename(path))]


class StoreDirectory:
    """The on-disk state of one store directory. Use :meth:`open` (a context manager).

    ``exclusive=True`` takes the store's lock exclusively (as an open store does, writing this
    process's pid into it) and fails if anyone holds it; otherwise the lock is taken shared for as
    long as this object is open, and with ``allow_in_use`` a store held by a running process is
    read anyway (``in_use_by`` then names its pid and nothing is locked).
    """

    def __init__(self, path: str, lock_fd: int, in_use_by: Optional[str], exclusive: bool) -> None:
        self.path = path
        self.manifest_path = os.path.join(path, MANIFEST_NAME)
        self.in_use_by = in_use_by
        self.exclusive = exclusive
        self._lock_fd = lock_fd
        self.nvme_paths: list[str] = []
        self.files_per_dir = 0
        self.rows: list[Row] = []
        self.swap_files: list[SwapFileInfo] = []

    @classmethod
    def open(cls, path: str, *, exclusive: bool = False, allow_in_use: bool = False) -> "StoreDirectory":
        """Lock ``path`` and read its layout, records and swap file sizes.

        Raises ValueError when ``path`` is not a store directory, StoreLockedError when another
        process holds the store (unless ``allow_in_use`` and not ``exclusive``), ManifestError when
        the manifest cannot be read.
        """
        path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(path):
            raise ValueError(f"{path!r} is not a directory; give the path a store was opened with (StoreConfig.path)")
        if not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            raise ValueError(f"{path!r} is not a tiered store directory: it has no {MANIFEST_NAME}")
        lock_fd, in_use_by = _lock(os.path.join(path, LOCK_NAME), exclusive=exclusive, allow_in_use=allow_in_use)
        directory = cls(path, lock_fd, in_use_by, exclusive)
        try:
            directory.reload()
        except BaseException:
            directory.close()
            raise
        return directory

    def __enter__(self) -> "StoreDirectory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def reload(self) -> None:
        """Read the layout, every record and the swap files' sizes again."""
        db = self._connect_read_only()
        try:
            meta = dict(db.execute("SELECT name, value FROM meta").fetchall())
            rows = db.execute(SELECT_ROWS).fetchall()
        except sqlite3.DatabaseError as exc:
            raise ManifestError(f"cannot read the manifest {self.manifest_path}: {exc}") from exc
        finally:
            db.close()
        self.nvme_paths, self.files_per_dir = _layout(meta, self.manifest_path)
        self.rows = [parse_row(values, rowid=rowid, codecs=READABLE_CODECS) for rowid, *values in rows]
        self.swap_files = [self._swap_file(i) for i in range(len(self.nvme_paths) * self.files_per_dir)]

    def swap_file(self, index: int) -> Optional[SwapFileInfo]:
        """The swap file numbered ``index`` in the layout, or None when the layout has no such file."""
        return self.swap_files[index] if 0 <= index < len(self.swap_files) else None

    def delete_records(self, records: Sequence[Row]) -> None:
        """Remove records from the manifest in one durable transaction, then reload.

        Needs the exclusive lock: no store may be running while its records change.
        """
        assert self.exclusive and self._lock_fd >= 0, "delete_records needs the store's exclusive lock"
        if not records:
            return
        try:
            db = sqlite3.connect(self.manifest_path, isolation_level=None)
            try:
                db.execute("PRAGMA synchronous=FULL")
                db.execute("BEGIN IMMEDIATE")
                db.executemany("DELETE FROM entries WHERE rowid = ?", [(r.rowid,) for r in records])
                db.execute("COMMIT")
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                db.close()
        except sqlite3.DatabaseError as exc:
            raise ManifestError(f"cannot remove records from the manifest {self.manifest_path}: {exc}") from exc
        self.reload()

    def _connect_read_only(self) -> sqlite3.Connection:
        wal = self.manifest_path + "-wal"
        has_log = os.path.exists(wal) and os.path.getsize(wal) > 0
        # Without a log (a clean close checkpoints and truncates it) the database file holds every
        # committed record, and immutable=1 reads it without creating -wal/-shm files beside it.
        option = "mode=ro" if has_log or self.in_use_by is not None else "immutable=1"
        uri = f"file:{urllib.parse.quote(self.manifest_path)}?{option}"
        try:
            db = sqlite3.connect(uri, uri=True, isolation_level=None)
        except sqlite3.Error as exc:
            raise ManifestError(f"cannot open the manifest {self.manifest_path}: {exc}") from exc
        # Keys are TEXT; a damaged row with invalid UTF-8 must still load, so decode losslessly.
        db.text_factory = lambda raw: raw.decode("utf-8", "surrogateescape")
        return db

    def _swap_file(self, index: int) -> SwapFileInfo:
        directory = self.nvme_paths[index // self.files_per_dir]
        path = swap_file_path(directory, index % self.files_per_dir)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return SwapFileInfo(index, path, False, 0, 0)
        return SwapFileInfo(index, path, True, st.st_size, st.st_blocks * 512)


def _lock(path: str, *, exclusive: bool, allow_in_use: bool) -> tuple[int, Optional[str]]:
    """Take the store's flock; return its descriptor (-1 when none was taken) and the holder's pid if in use."""
    if exclusive:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    else:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return -1, None  # no store ever ran here long enough to lock; nothing to respect
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if allow_in_use and not exclusive:
            return -1, owner
        raise StoreLockedError(
            f"the store {os.path.dirname(path)} is in use by another process (pid {owner}); close that store "
            "(or let the process end) first"
        ) from None
    if exclusive:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd, None


def _layout(meta: dict[str, str], where: str) -> tuple[list[str], int]:
    if meta.get("format") != str(FORMAT_VERSION):
        raise ManifestError(f"{where} has format {meta.get('format')!r}; this version of tiered reads {FORMAT_VERSION}")
    try:
        paths = json.loads(meta["nvme_paths"])
        per_dir = json.loads(meta["swap_files_per_dir"])
    except (KeyError, ValueError) as exc:
        raise ManifestError(f"{where} lacks a readable swap file layout: {exc}") from exc
    if not (isinstance(paths, list) and paths and all(isinstance(p, str) for p in paths)):
        raise ManifestError(f"{where} names nvme_paths {paths!r}, not a list of directories")
    if not (isinstance(per_dir, int) and per_dir >= 1):
        raise ManifestError(f"{where} names swap_files_per_dir {per_dir!r}, not a positive count")
    return paths, per_dir
