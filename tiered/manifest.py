"""The crash-safe manifest: one SQLite database (WAL, synchronous=FULL) beside the swap files.

A record is written only after its bytes are durable, in the same transaction that removes the
record it replaces, so a reopened store sees either the old or the new version, never a torn one.
All methods block; the store calls them on its manifest thread.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Iterable, Sequence

from tiered.errors import CapacityError, ManifestError
from tiered.records import COLUMN_NAMES, COLUMNS, SELECT_ROWS, Record, parse_row, to_row

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.sqlite"
#: What to do about a manifest that cannot be read (appended to every such ManifestError).
RECOVERY_ADVICE = (
    "the swap files cannot be read without it. Restore the store directory from a backup, or move the "
    "directory aside and open an empty store there; `tiered fsck DIR` reports what is readable"
)

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries ({", ".join(f"{name} {decl}" for name, decl in COLUMNS)});
"""
_INSERT = f"INSERT OR REPLACE INTO entries ({', '.join(COLUMN_NAMES)}) VALUES ({', '.join('?' * len(COLUMNS))})"


class Manifest:
    """Committed records of one store directory."""

    def __init__(self, directory: str, layout: dict[str, object], *, swap_bytes: int = 0) -> None:
        """Open (or create) the manifest of ``directory``. ``swap_bytes`` is how much the swap files
        already hold: a manifest that is missing or empty while they hold data was lost, not new."""
        path = os.path.join(directory, MANIFEST_NAME)
        self.path = path
        if swap_bytes and not os.path.exists(path):
            raise ManifestError(
                f"the manifest {path} is missing but the swap files hold {swap_bytes} bytes; {RECOVERY_ADVICE}"
            )
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.DatabaseError as exc:
            raise ManifestError(f"cannot open the manifest {path}: {exc}; {RECOVERY_ADVICE}") from exc
        try:
            if swap_bytes and not self._has_layout():  # checked before anything is written to the file
                raise ManifestError(
                    f"the manifest {path} is empty but the swap files hold {swap_bytes} bytes; {RECOVERY_ADVICE}"
                )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(path + suffix):
                    os.chmod(path + suffix, 0o600)
            self._check_layout(layout, swap_bytes)
        except BaseException as exc:
            self._db.close()
            if isinstance(exc, sqlite3.DatabaseError):
                raise ManifestError(f"cannot read the manifest {path}: {exc}; {RECOVERY_ADVICE}") from exc
            raise

    def _has_layout(self) -> bool:
        """Whether the database already holds a layout (read-only)."""
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return "meta" in tables and self._db.execute("SELECT COUNT(*) FROM meta").fetchone()[0] > 0

    def _check_layout(self, layout: dict[str, object], swap_bytes: int) -> None:
        stored = dict(self._db.execute("SELECT name, value FROM meta").fetchall())
        wanted = {"format": str(FORMAT_VERSION), **{k: json.dumps(v) for k, v in layout.items()}}
        if not stored:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", wanted.items())
            return
        if stored.get("format") != wanted["format"]:
            raise ManifestError(
                f"{self.path} has format {stored.get('format')}, this version of tiered reads {FORMAT_VERSION}; "
                "open it with the version of tiered that wrote it"
            )
        for name, value in wanted.items():
            if stored.get(name) != value:
                raise ManifestError(
                    f"{self.path} was written with {name}={stored.get(name)}, but the store is opened with "
                    f"{name}={value}; open it with the original setting"
                )

    def load(self) -> list[Record]:
        """Every committed record; ManifestError (with recovery advice) when any is unreadable."""
        try:
            rows = self._db.execute(SELECT_ROWS).fetchall()
        except sqlite3.DatabaseError as exc:
            raise ManifestError(f"cannot read the manifest {self.path}: {exc}; {RECOVERY_ADVICE}") from exc
        records = []
        for rowid, *values in rows:
            row = parse_row(values, rowid=rowid)
            if not row.ok:
                raise ManifestError(
                    f"the record of {row.record.key!r} in {self.path} is damaged ({'; '.join(row.problems)}); "
                    f"`tiered fsck {os.path.dirname(self.path)} --delete-damaged` removes it and keeps the other "
                    "entries, or restore the store directory from a backup"
                )
            records.append(row.record)
        return records

    def commit(self, upserts: Sequence[Record], deletes: Iterable[str] = ()) -> None:
        """Write records and remove keys in one durable transaction (all or nothing).

        A full disk raises CapacityError, any other SQLite failure ManifestError; either way the
        transaction is rolled back and what was committed before stays as it was.
        """
        try:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in deletes])
                self._db.executemany(_INSERT, [to_row(r) for r in upserts])
        except sqlite3.Error as exc:
            if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
                raise CapacityError(
                    f"the manifest {self.path} cannot grow: {exc}; free disk space on its filesystem"
                ) from exc
            raise ManifestError(f"writing the manifest {self.path} failed: {exc}") from exc

    def close(self) -> None:
        """Checkpoint the WAL into the database and close. A checkpoint that fails (a full disk) is
        skipped: the WAL holds the same committed transactions and the next open replays it."""
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass
        finally:
            self._db.close()
