"""A store directory opened without starting a store: its locks, layout, committed records and swap files.

The manifest is read with SQLite alone: a store that was closed cleanly is read as an immutable
file (SQLite creates no side files), one with a write-ahead log (a crash, or a store running now)
through a read-only connection that sees every committed transaction. Rows are parsed as the
store parses them (tiered/manifest/records.py): a field that cannot be parsed, or a record checksum that
does not match, becomes a problem of its row, not an exception, so ``fsck`` can report it. SQLite's
own integrity check is run too. Nothing is ever unpickled.

The swap files are looked for where the store keeps them now: under the paths given (``--nvme-path``),
else where the manifest recorded them, relative to the store's directory when they lie inside it,
so a copied store is checked against its own swap files. A store moved since it was last opened
whose swap directories lie elsewhere must be given them. Each swap file's id (swap_ids.py) must name
this store and its place; a file that does not is *unavailable*, never taken for this store's.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sqlite3
import urllib.parse
from typing import Optional, Sequence

from tiered.backends.swap_ids import SwapFileId, read_id, swap_file_name
from tiered.codecs import READABLE_CODECS
from tiered.errors import ManifestError, StoreLockedError
from tiered.manifest.database import MANIFEST_NAME, SQLITE_FAILURES, side_files
from tiered.manifest.meta import Meta, parse_meta
from tiered.manifest.ownership import OwnedDirectory, read_owner
from tiered.manifest.records import SELECT_LEGACY_ROWS, SELECT_ROWS, Row, parse_row


_NO_ID = "it has no id file beside it, so nothing says it is this store's"


@dataclasses.dataclass(frozen=True)
class SwapFileInfo:
    """One swap file the layout names: where it is and how large it is (0 when it is missing)."""

    index: int
    path: str
    exists: bool
    size: int
    disk_bytes: int
    #: Why the file cannot be taken for this store's (its directory is missing, or its id names
    #: another store or place, or it has none); None when it is this store's or simply missing.
    unavailable: Optional[str] = None


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

    ``exclusive=True`` locks the store's directories exclusively (as an open store does) and fails
    if anyone holds them; otherwise they are locked shared for as long as this object is open, and
    with ``allow_in_use`` a store held by a running process is read anyway (``in_use_by`` then names
    its pid and nothing is locked).
    """

    def __init__(self, path: str, directory: Optional[OwnedDirectory], in_use_by: Optional[str], exclusive: bool,
                 nvme_paths: Optional[Sequence[str]]) -> None:
        self.path = path
        self.manifest_path = os.path.join(path, MANIFEST_NAME)
        self.in_use_by = in_use_by
        self.exclusive = exclusive
        self._directory = directory
        self._given = [os.path.abspath(os.fspath(p)) for p in nvme_paths] if nvme_paths else None
        self._swap_dirs: list[Optional[OwnedDirectory]] = []
        self.meta: Optional[Meta] = None
        self.nvme_paths: list[str] = []
        self.files_per_dir = 0
        self.rows: list[Row] = []
        self.swap_files: list[SwapFileInfo] = []
        #: What SQLite's ``PRAGMA integrity_check`` said: ``("ok",)`` for a sound database file.
        self.integrity: tuple[str, ...] = ()

    @classmethod
    def open(cls, path: str, *, exclusive: bool = False, allow_in_use: bool = False,
             nvme_paths: Optional[Sequence[str]] = None) -> "StoreDirectory":
        """Lock ``path`` and its swap directories and read its layout, records and swap files.

        ``nvme_paths`` says where the swap directories are now (in their original order), for a
        store moved since it was last opened. Raises ValueError when ``path`` is not a store
        directory, or the swap directories cannot be told (a moved store without ``nvme_paths``,
        or the wrong number of them); StoreLockedError when another process holds the store
        (unless ``allow_in_use`` and not ``exclusive``); ManifestError when the manifest cannot be
        read; OSError when a file of the store is a symlink or not its own.
        """
        path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(path):
            raise ValueError(f"{path!r} is not a directory; give the path a store was opened with (StoreConfig.path)")
        if not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            raise ValueError(f"{path!r} is not a tiered store directory: it has no {MANIFEST_NAME}")
        directory: Optional[OwnedDirectory] = None
        in_use_by = None
        try:
            directory = OwnedDirectory.open(path, role="the store directory", exclusive=exclusive, create=False)
        except StoreLockedError:
            if exclusive or not allow_in_use:
                raise
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                in_use_by = read_owner(fd)[0] or "unknown"
            finally:
                os.close(fd)
        store = cls(path, directory, in_use_by, exclusive, nvme_paths)
        try:
            store.reload()
        except BaseException:
            store.close()
            raise
        return store

    def __enter__(self) -> "StoreDirectory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the locks (idempotent)."""
        for d in self._swap_dirs:
            if d is not None and d is not self._directory:
                d.close()
        self._swap_dirs = []
        if self._directory is not None:
            self._directory.close()
            self._directory = None

    @property
    def legacy(self) -> bool:
        """Whether the manifest is of the earlier format (no record checksums; a store upgrades it)."""
        return self.meta is not None and self.meta.legacy

    def reload(self) -> None:
        """Read the layout, every record and the swap files again."""
        if self._directory is not None:
            for name in side_files():
                self._directory.check_file(name)
        db = self._connect_read_only()
        try:
            self.integrity = tuple(str(r[0]) for r in db.execute("PRAGMA integrity_check").fetchall())
            meta = parse_meta(dict(db.execute("SELECT name, value FROM meta").fetchall()), self.manifest_path)
            rows = db.execute(SELECT_LEGACY_ROWS if meta.legacy else SELECT_ROWS).fetchall()
        except (*SQLITE_FAILURES, ManifestError) as exc:
            verdict = "; ".join(self.integrity) if self.integrity else "not run"
            raise ManifestError(f"cannot read the manifest {self.manifest_path}: {exc} (SQLite's integrity check: "
                                f"{verdict})") from exc
        finally:
            db.close()
        self.meta, self.files_per_dir = meta, meta.files_per_dir
        self.nvme_paths = self._swap_paths(meta)
        self.rows = [parse_row(values, rowid=rowid, codecs=READABLE_CODECS, legacy=meta.legacy)
                     for rowid, *values in rows]
        self._lock_swap_dirs()
        self.swap_files = [info for d in range(len(self.nvme_paths)) for info in self._swap_files_of(d)]

    def _swap_paths(self, meta: Meta) -> list[str]:
        recorded = meta.swap_paths(self.path)
        if self._given is not None:
            if len(self._given) != len(recorded):
                raise ValueError(
                    f"the store {self.path} has {len(recorded)} swap director{'y' if len(recorded) == 1 else 'ies'}, "
                    f"but {len(self._given)} were given; give all of them, in their original order"
                )
            return list(self._given)
        moved_from = meta.moved_from(self.path)
        outside = [p for p, r in zip(recorded, meta.swap_dirs) if os.path.isabs(r)]
        if moved_from is not None and outside:
            raise ValueError(
                f"the store {self.path} was last opened at {moved_from}, and its swap directories {outside} lie "
                "outside it, so they may be the original's; give the copy's with --nvme-path (one per directory, "
                "in their original order)"
            )
        return recorded

    def _lock_swap_dirs(self) -> None:
        """Hold each swap directory (the lock the store takes, shared unless exclusive) while reading it."""
        if self._swap_dirs:
            return
        for i, path in enumerate(self.nvme_paths):
            if self._directory is not None and os.path.isdir(path) and os.path.samefile(path, self.path):
                self._swap_dirs.append(self._directory)
            elif self.in_use_by is not None or not os.path.isdir(path):
                self._swap_dirs.append(None)
            else:
                self._swap_dirs.append(OwnedDirectory.open(path, role=f"swap directory #{i}",
                                                           exclusive=self.exclusive, create=False))

    def _swap_files_of(self, d: int) -> list[SwapFileInfo]:
        """The swap files of swap directory ``d``, each with its size and whether it is this store's."""
        path, n = self.nvme_paths[d], self.files_per_dir
        if not os.path.isdir(path):
            why = f"its swap directory {path} does not exist"
            return [SwapFileInfo(d * n + i, os.path.join(path, swap_file_name(i)), False, 0, 0, why) for i in range(n)]
        checks = [self._id_problem(d, i) for i in range(n)]
        if not self.legacy and all(problem is not None for _, problem in checks):
            store_id = self.meta.store_id if self.meta is not None else None
            checks = [(st, f"{path} holds none of this store's swap files (no id file names store {store_id})")
                      for st, _ in checks]
        out = []
        for i, (st, problem) in enumerate(checks):
            name = os.path.join(path, swap_file_name(i))
            if st is None:
                out.append(SwapFileInfo(d * n + i, name, False, 0, 0, problem if problem != _NO_ID else None))
            else:
                out.append(SwapFileInfo(d * n + i, name, True, st.st_size, st.st_blocks * 512, problem))
        return out

    def _id_problem(self, d: int, i: int) -> tuple[Optional[os.stat_result], Optional[str]]:
        """The status of swap file ``i`` of directory ``d`` (None when missing) and why it is not this
        store's (None when it is, or the manifest is of the earlier format, which has no ids)."""
        directory = self._swap_dirs[d]
        name = os.path.join(self.nvme_paths[d], swap_file_name(i))
        st = os.lstat(name) if os.path.lexists(name) else None
        if self.legacy or directory is None:
            return st, None
        try:
            found = read_id(directory, i)
        except ManifestError as exc:
            return st, str(exc)
        if found is None:
            return st, _NO_ID
        wanted = SwapFileId(self.meta.store_id or "", d, i) if self.meta is not None else None
        return st, None if found == wanted else f"its id file says it is {found.describe()}"

    def swap_file(self, index: int) -> Optional[SwapFileInfo]:
        """The swap file numbered ``index`` in the layout, or None when the layout has no such file."""
        return self.swap_files[index] if 0 <= index < len(self.swap_files) else None

    def delete_records(self, records: Sequence[Row]) -> None:
        """Remove records from the manifest in one durable transaction, then reload.

        Needs the exclusive lock: no store may be running while its records change.
        """
        assert self.exclusive and self._directory is not None, "delete_records needs the store's exclusive lock"
        if not records:
            return
        for name in side_files():
            self._directory.check_file(name)
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
        except SQLITE_FAILURES as exc:
            raise ManifestError(f"cannot remove records from the manifest {self.manifest_path}: {exc}") from exc
        self.reload()

    def _connect_read_only(self) -> sqlite3.Connection:
        wal = self.manifest_path + "-wal"
        has_log = os.path.lexists(wal) and os.lstat(wal).st_size > 0
        # Without a log (a clean close checkpoints and truncates it) the database file holds every
        # committed record, and immutable=1 reads it without creating -wal/-shm files beside it.
        option = "mode=ro" if has_log or self.in_use_by is not None else "immutable=1"
        uri = f"file:{urllib.parse.quote(self.manifest_path)}?{option}"
        try:
            db = sqlite3.connect(uri, uri=True, isolation_level=None)
        except SQLITE_FAILURES as exc:
            raise ManifestError(f"cannot open the manifest {self.manifest_path}: {exc}") from exc
        # Keys are TEXT; a damaged row with invalid UTF-8 must still load, so decode losslessly.
        db.text_factory = lambda raw: raw.decode("utf-8", "surrogateescape")
        return db
