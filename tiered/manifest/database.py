"""The crash-safe manifest: one SQLite database (WAL, synchronous=FULL) in the store's directory.

A record is written only after its bytes are durable, in the same transaction that removes the
record it replaces, so a reopened store sees either the old or the new version, never a torn one
(see [Note: group commit] in tiered.manifest.commits and [Note: crash safety] in tiered.store.versions).
Each record carries a checksum of its own (records.py); a row that fails it is reported, never
served, and the rest of the store stays usable. The meta table (manifest_meta.py) holds the
store's id and the layout of its swap files. SQLite opens the database by path, so the manifest
and its ``-wal``/``-shm``/``-journal`` files are checked not to be symlinks or foreign files both
before it does and after. All methods block; the store calls them on its manifest thread.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import uuid
import warnings
from typing import Callable, Iterable, Optional, Sequence

from tiered.errors import CapacityError, ManifestError
from tiered.manifest.meta import FORMAT_VERSION, LEGACY_FORMAT, Meta, new_meta, parse_meta
from tiered.manifest.ownership import OwnedDirectory
from tiered.manifest.records import (
    COLUMN_NAMES,
    COLUMNS,
    LEGACY_COLUMN_NAMES,
    SELECT_LEGACY_ROWS,
    SELECT_ROWS,
    Record,
    Row,
    parse_row,
    to_row,
)

__all__ = ["FORMAT_VERSION", "MANIFEST_NAME", "Loaded", "Manifest", "RECOVERY_ADVICE", "SQLITE_FAILURES", "side_files"]

MANIFEST_NAME = "manifest.sqlite"
#: What to do about a manifest that cannot be read (appended to every such ManifestError).
RECOVERY_ADVICE = (
    "the swap files cannot be read without it. Restore the store directory from a backup, or move the "
    "directory aside and open an empty store there; `tiered fsck DIR` reports what is readable"
)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    f"CREATE TABLE IF NOT EXISTS entries ({', '.join(f'{name} {decl}' for name, decl in COLUMNS)})",
)
#: What reading a damaged database raises: SQLite's errors, and a UnicodeDecodeError when the text of
#: one (a damaged schema quoted in it) is not UTF-8.
SQLITE_FAILURES = (sqlite3.Error, UnicodeDecodeError)
_INSERT = f"INSERT OR REPLACE INTO entries ({', '.join(COLUMN_NAMES)}) VALUES ({', '.join('?' * len(COLUMNS))})"


def side_files() -> tuple[str, ...]:
    """The manifest's file and the files SQLite keeps beside it."""
    return tuple(MANIFEST_NAME + suffix for suffix in ("", "-wal", "-shm", "-journal"))


@dataclasses.dataclass(frozen=True)
class Loaded:
    """The manifest's rows, sorted out: the records a store serves, and the damaged rows it reports."""

    records: list[Record]
    damaged: list[Row]


class Manifest:
    """Committed records of one store directory."""

    def __init__(self, directory: OwnedDirectory, swap_paths: Sequence[str], files_per_dir: int, *,
                 swap_bytes: int = 0) -> None:
        """Open (or create) the manifest in ``directory`` (locked by the caller) for a store whose swap
        files lie in ``swap_paths``, ``files_per_dir`` in each.

        ``swap_bytes`` is how much those swap files already hold: a manifest that is missing or
        empty while they hold data was lost, not new. Raises ManifestError when the manifest is
        unreadable, damaged, of an unknown format or of another layout; OSError when it (or a file
        SQLite keeps beside it) is a symlink or not the store's own file. Changes nothing on disk
        unless the manifest is new; :meth:`upgrade` and :meth:`record_location` write what they say.
        """
        self.path = directory.join(MANIFEST_NAME)
        self._directory = directory
        self._store_path = directory.path
        self._swap_paths = list(swap_paths)
        main = self._check_files()
        if swap_bytes and main is None:
            raise ManifestError(
                f"the manifest {self.path} is missing but the swap files hold {swap_bytes} bytes; {RECOVERY_ADVICE}"
            )
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except SQLITE_FAILURES as exc:
            raise ManifestError(f"cannot open the manifest {self.path}: {exc}; {RECOVERY_ADVICE}") from exc
        # Keys are TEXT; a damaged one that is not valid UTF-8 must still load (as a damaged row).
        self._db.text_factory = lambda raw: raw.decode("utf-8", "surrogateescape")
        try:
            if swap_bytes and not self._has_meta():  # checked before anything is written to the file
                raise ManifestError(
                    f"the manifest {self.path} is empty but the swap files hold {swap_bytes} bytes; {RECOVERY_ADVICE}"
                )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            if not self._has_meta():
                self._create(files_per_dir)
            self.meta = self._check_layout(files_per_dir)
            after = self._check_files()
            if main is not None and (after is None or (after.st_dev, after.st_ino) != (main.st_dev, main.st_ino)):
                raise ManifestError(f"the manifest {self.path} was replaced while it was being opened")
            for name in side_files():
                if directory.status(name) is not None:
                    os.chmod(name, 0o600, dir_fd=directory.fd)
        except BaseException as exc:
            self._db.close()
            if isinstance(exc, SQLITE_FAILURES):
                raise ManifestError(f"cannot read the manifest {self.path}: {exc}; {RECOVERY_ADVICE}") from exc
            raise

    @property
    def store_id(self) -> str:
        """The id every swap file of this store carries (swap_ids.py)."""
        assert self.meta.store_id is not None
        return self.meta.store_id

    def _check_files(self) -> Optional[os.stat_result]:
        """Refuse a manifest, WAL, shared-memory or journal file that is a symlink or not ours; the
        manifest's own status (None when it does not exist)."""
        found = [self._directory.check_file(name) for name in side_files()]
        return found[0]

    def _has_meta(self) -> bool:
        """Whether the database already holds a layout (read-only)."""
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return "meta" in tables and self._db.execute("SELECT COUNT(*) FROM meta").fetchone()[0] > 0

    def _create(self, files_per_dir: int) -> None:
        rows = new_meta(uuid.uuid4().hex, self._store_path, self._swap_paths, files_per_dir)

        def create() -> None:
            for statement in _SCHEMA:
                self._db.execute(statement)
            self._replace_meta(rows)

        self._transaction("creating", create)

    def _check_layout(self, files_per_dir: int) -> Meta:
        meta = parse_meta(dict(self._db.execute("SELECT name, value FROM meta").fetchall()), self.path)
        if meta.files_per_dir != files_per_dir:
            raise ManifestError(
                f"{self.path} was written with swap_files_per_dir={meta.files_per_dir}, but the store is opened "
                f"with swap_files_per_dir={files_per_dir}; open it with the original setting"
            )
        if len(meta.swap_dirs) != len(self._swap_paths):
            recorded = meta.swap_paths(self._store_path)
            raise ManifestError(
                f"{self.path} was written over {len(recorded)} swap director{'y' if len(recorded) == 1 else 'ies'} "
                f"({', '.join(recorded)}), but the store is opened with nvme_paths={self._swap_paths}; give the "
                "store's swap directories (wherever they are now) in their original order"
            )
        if meta.legacy:
            recorded = [os.path.abspath(p) for p in meta.swap_dirs]
            if recorded != self._swap_paths:
                raise ManifestError(
                    f"{self.path} was written with nvme_paths={recorded} by an earlier version of tiered, but the "
                    f"store is opened with nvme_paths={self._swap_paths}; open it once with the original setting "
                    "(that upgrades it, after which its directories may move)"
                )
            if meta.store_id is None:  # recorded first, so an upgrade cut short names the same id again
                store_id = f'"{uuid.uuid4().hex}"'
                self._transaction("upgrading", lambda: self._db.execute("INSERT INTO meta VALUES ('store_id', ?)",
                                                                        (store_id,)))
                meta = parse_meta(dict(self._db.execute("SELECT name, value FROM meta").fetchall()), self.path)
        return meta

    def load(self, codecs: Optional[Iterable[str]] = None) -> Loaded:
        """Every committed record, and the rows that are damaged (a checksum or field that fails,
        a codec not in ``codecs``). Of two intact rows of one key (only a damaged index makes them),
        the newer generation counts. ManifestError (with recovery advice) when the table cannot be read.
        """
        known = tuple(codecs) if codecs is not None else None
        try:
            rows = self._db.execute(SELECT_LEGACY_ROWS if self.meta.legacy else SELECT_ROWS).fetchall()
        except SQLITE_FAILURES as exc:
            raise ManifestError(f"cannot read the manifest {self.path}: {exc}; {RECOVERY_ADVICE}") from exc
        records: dict[str, Record] = {}
        damaged = []
        for rowid, *values in rows:
            row = parse_row(values, rowid=rowid, codecs=known, legacy=self.meta.legacy)
            if not row.ok:
                damaged.append(row)
            elif row.record.key not in records or records[row.record.key].generation < row.record.generation:
                records[row.record.key] = row.record
        return Loaded(list(records.values()), damaged)

    def upgrade(self, records: Sequence[Record]) -> None:
        """Bring a format-1 manifest to this format in one transaction: checksum every intact
        record as it is (``records``, from :meth:`load`), record the layout, and warn once. Rows
        that were damaged stay without a checksum, so they stay reported as damaged.

        The caller first gives every swap file its id (swap_ids.py), so a crash between the two
        steps leaves a format-1 manifest whose swap files already carry its id.
        """
        if not self.meta.legacy:
            return
        rows = new_meta(self.store_id, self._store_path, self._swap_paths, self.meta.files_per_dir)

        def upgrade() -> None:
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(entries)")}
            for name, decl in COLUMNS[len(LEGACY_COLUMN_NAMES):]:
                if name not in columns:
                    self._db.execute(f"ALTER TABLE entries ADD COLUMN {name} {decl}")
            self._db.executemany(_INSERT, [to_row(r) for r in records])
            self._replace_meta(rows)

        self._transaction("upgrading", upgrade)
        self.meta = parse_meta(rows, self.path)
        warnings.warn(
            f"upgraded the store manifest {self.path} from format {LEGACY_FORMAT} to {FORMAT_VERSION}: its "
            f"{len(records)} records now carry checksums (taken over the records as they were found) and its "
            "swap files carry the store's id; earlier versions of tiered cannot open it any more",
            RuntimeWarning,
            stacklevel=2,
        )

    def record_location(self) -> None:
        """Record where the store's directories are now, when it was copied or moved since it was last
        opened (nothing is written otherwise)."""
        current = new_meta(self.store_id, self._store_path, self._swap_paths, self.meta.files_per_dir)
        if parse_meta(current, self.path) == self.meta:
            return
        self._transaction("recording where the store is", lambda: self._replace_meta(current))
        self.meta = parse_meta(current, self.path)

    def _replace_meta(self, rows: dict[str, str]) -> None:
        self._db.execute("DELETE FROM meta")
        self._db.executemany("INSERT INTO meta VALUES (?, ?)", rows.items())

    def commit(self, upserts: Sequence[Record], deletes: Iterable[str] = (), *, flush: bool = True) -> None:
        """Write records and remove keys in one durable transaction (all or nothing).

        ``flush=False`` leaves out the flush of the log: the transaction is applied, in order after
        every earlier one, and becomes durable with the next flushed one (or the checkpoint at close);
        a power loss before that may lose it, whole, with what came after it and nothing before
        (SQLite's WAL with ``synchronous=NORMAL``).

        A full disk raises CapacityError, any other SQLite failure ManifestError; either way the
        transaction is rolled back and what was committed before stays as it was.
        """
        def write() -> None:
            self._db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in deletes])
            self._db.executemany(_INSERT, [to_row(r) for r in upserts])

        if flush:
            self._transaction("writing", write)
            return
        self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            self._transaction("writing", write)
        finally:
            self._db.execute("PRAGMA synchronous=FULL")

    def _transaction(self, doing: str, body: Callable[[], None]) -> None:
        """Run ``body`` in one durable transaction; CapacityError on a full disk, ManifestError on any
        other SQLite failure, either way after rolling back (what was committed before stays)."""
        try:
            with self._db:
                self._db.execute("BEGIN")
                body()
        except SQLITE_FAILURES as exc:
            if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
                raise CapacityError(
                    f"the manifest {self.path} cannot grow: {exc}; free disk space on its filesystem"
                ) from exc
            raise ManifestError(f"{doing} the manifest {self.path} failed: {exc}") from exc

    def close(self) -> None:
        """Checkpoint the WAL into the database and close. A checkpoint that fails (a full disk) is
        skipped: the WAL holds the same committed transactions and the next open replays it."""
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except SQLITE_FAILURES:
            pass
        finally:
            self._db.close()
