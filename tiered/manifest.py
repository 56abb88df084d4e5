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
from tiered.errors import ManifestError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.sqlite"

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

    def __init__(self, directory: str, layout: dict[str, object]) -> None:
        path = os.path.join(directory, MANIFEST_NAME)
        fresh = not os.path.exists(path)
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise ManifestError(f"cannot open the manifest {path}: {exc}") from exc
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.chmod(path + suffix, 0o600)
        self.path = path
        self._check_layout(layout, fresh)

    def _check_layout(self, layout: dict[str, object], fresh: bool) -> None:
        stored = dict(self._db.execute("SELECT name, value FROM meta").fetchall())
        wanted = {"format": str(FORMAT_VERSION), **{k: json.dumps(v) for k, v in layout.items()}}
        if fresh or not stored:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", wanted.items())
            return
        if stored.get("format") != wanted["format"]:
            raise ManifestError(
                f"{self.path} has format {stored.get('format')}, this version of tiered reads {FORMAT_VERSION}"
            )
        for name, value in wanted.items():
            if stored.get(name) != value:
                raise ManifestError(
                    f"{self.path} was written with {name}={stored.get(name)}, but the store is opened with "
                    f"{name}={value}; open it with the original setting"
                )

    def load(self) -> list[Record]:
        """Every committed record."""
        rows = self._db.execute(
            "SELECT key, dtype, shape, nbytes, stored_nbytes, codec, codec_meta, chunk, extents, crcs, generation "
            "FROM entries"
        ).fetchall()
        return [_record_from_row(row) for row in rows]

    def commit(self, upserts: Sequence[Record], deletes: Iterable[str] = ()) -> None:
        """Write records and remove keys in one durable transaction."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in deletes])
            self._db.executemany(
                "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [_row_from_record(r) for r in upserts],
            )

    def close(self) -> None:
        """Checkpoint the WAL into the database and close."""
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
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
    key, dtype, shape, nbytes, stored, codec, codec_meta, chunk, ext_blob, crc_blob, generation = row
    ext = array.array("q")
    ext.frombytes(ext_blob)
    extents = tuple(FileExtent(ext[i], ext[i + 1], ext[i + 2]) for i in range(0, len(ext), 3))
    crcs: Optional[tuple[int, ...]] = None
    if crc_blob is not None:
        a = array.array("I")
        a.frombytes(crc_blob)
        crcs = tuple(a)
    return Record(
        key, dtype_from_name(dtype), tuple(json.loads(shape)), nbytes, stored, codec, bytes(codec_meta), chunk,
        extents, crcs, generation,
    )
