"""The crash-safe manifest: one SQLite database (WAL, synchronous=FULL) beside the swap files.

A record is written only after its bytes are durable, in the same transaction that removes the
record it replaces, so a reopened store sees either the old or the new version, never a torn one.
All methods block; the store calls them on its manifest thread.
"""

from __future__ import annotations

import array
import dataclasses
import json
import os
import sqlite3
from typing import Iterable, Optional, Sequence

import torch

from tiered.backends.nvme import FileExtent
from tiered.config import ALIGNMENT
from tiered.entry import RAW
from tiered.errors import CapacityError, ManifestError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.sqlite"
#: What to do about a manifest that cannot be read (appended to every such ManifestError).
RECOVERY_ADVICE = (
    "the swap files cannot be read without it. Restore the store directory from a backup, or move the "
    "directory aside and open an empty store there; `tiered fsck DIR` reports what is readable"
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    dtype TEXT NOT NULL,
    shape TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    stored_nbytes INTEGER NOT NULL,
    codec TEXT NOT NULL,
    codec_meta BLOB NOT NULL,
    chunk INTEGER NOT NULL,
    extents BLOB NOT NULL,
    crcs BLOB,
    generation INTEGER NOT NULL
);
"""


@dataclasses.dataclass(frozen=True)
class Record:
    """Everything needed to find, check and decode one committed tensor."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    stored_nbytes: int
    codec: str
    codec_meta: bytes
    chunk: int
    extents: tuple[FileExtent, ...]
    crcs: Optional[tuple[int, ...]]
    generation: int


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """torch.float32 for 'float32'; ManifestError for names this torch lacks."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"manifest names dtype {name!r}, which this PyTorch ({torch.__version__}) lacks")
    return dtype


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
            rows = self._db.execute(
                "SELECT key, dtype, shape, nbytes, stored_nbytes, codec, codec_meta, chunk, extents, crcs, generation "
                "FROM entries"
            ).fetchall()
        except sqlite3.DatabaseError as exc:
            raise ManifestError(f"cannot read the manifest {self.path}: {exc}; {RECOVERY_ADVICE}") from exc
        records = []
        for row in rows:
            try:
                records.append(_record_from_row(row))
            except (ValueError, TypeError, OverflowError, ManifestError) as exc:
                raise ManifestError(
                    f"the record of {row[0]!r} in {self.path} is damaged ({exc}); `tiered fsck "
                    f"{os.path.dirname(self.path)} --delete-damaged` removes it and keeps the other entries, or "
                    "restore the store directory from a backup"
                ) from exc
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
                self._db.executemany(
                    "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [_row_from_record(r) for r in upserts],
                )
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


def _row_from_record(r: Record) -> tuple:
    ext = array.array("q", [v for e in r.extents for v in (e.file, e.offset, e.length)])
    crcs = array.array("I", r.crcs).tobytes() if r.crcs is not None else None
    return (
        r.key,
        dtype_name(r.dtype),
        json.dumps(list(r.shape)),
        r.nbytes,
        r.stored_nbytes,
        r.codec,
        r.codec_meta,
        r.chunk,
        ext.tobytes(),
        crcs,
        r.generation,
    )


def _record_from_row(row: tuple) -> Record:
    """Parse one row, checking that its fields agree, so a damaged record can never be read as a
    tensor of another size; ValueError/TypeError/ManifestError otherwise."""
    key, dtype, shape, nbytes, stored, codec, codec_meta, chunk, ext_blob, crc_blob, generation = row
    if not isinstance(key, str):
        raise TypeError(f"key is {type(key).__name__}, not text")
    ext = array.array("q")
    ext.frombytes(ext_blob)
    if len(ext) % 3:
        raise ValueError(f"extents blob of {len(ext_blob)} bytes is not a list of (file, offset, length)")
    extents = tuple(FileExtent(ext[i], ext[i + 1], ext[i + 2]) for i in range(0, len(ext), 3))
    crcs: Optional[tuple[int, ...]] = None
    if crc_blob is not None:
        a = array.array("I")
        a.frombytes(crc_blob)
        crcs = tuple(a)
    parsed_shape = json.loads(shape)
    if not isinstance(parsed_shape, list) or not all(type(d) is int and d >= 0 for d in parsed_shape):
        raise ValueError(f"shape {shape!r} is not a list of sizes")
    record = Record(
        key, dtype_from_name(dtype), tuple(parsed_shape), nbytes, stored, codec, bytes(codec_meta), chunk,
        extents, crcs, generation,
    )
    numel = 1
    for d in record.shape:
        numel *= d
    if not all(type(v) is int for v in (nbytes, stored, chunk, generation)) or nbytes != numel * record.dtype.itemsize:
        raise ValueError(f"nbytes {nbytes!r} does not match dtype {dtype} and shape {record.shape}")
    if any(e.file < 0 or e.offset < 0 or e.length <= 0 or (e.offset | e.length) % ALIGNMENT for e in extents):
        raise ValueError(f"extents {extents} are not positive, {ALIGNMENT}-aligned ranges")
    if not 0 <= stored <= sum(e.length for e in extents) or (stored and chunk <= 0):
        raise ValueError(f"{stored} stored bytes do not fit its extents {extents} (chunk {chunk})")
    if codec == RAW and stored != nbytes:
        raise ValueError(f"a raw record stores {stored} bytes of a {nbytes}-byte tensor")
    if crcs is not None and len(crcs) != _chunk_count(extents, stored, chunk):
        raise ValueError(f"{len(crcs)} checksums for {_chunk_count(extents, stored, chunk)} chunks")
    return record


def _chunk_count(extents: Sequence[FileExtent], stored: int, chunk: int) -> int:
    """Checksummed chunks of a record: each extent's share of ``stored`` cut into ``chunk`` bytes."""
    count, left = 0, stored
    for e in extents:
        n = min(e.length, left)
        count += -(-n // chunk) if n > 0 else 0
        left -= n
    return count
