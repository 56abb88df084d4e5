"""The manifest's records: the one list of a record's fields, and the conversions between a record
and the SQLite row that stores it.

The store writes rows with :func:`to_row` and reads them with :func:`parse_row`; the offline tools
(``tiered inspect``, ``tiered fsck``) read them with the same function, so both agree on what a
damaged row is. Parsing never raises: a field that cannot be parsed, or that disagrees with the
others, becomes one of the row's ``problems``. Nothing is ever unpickled or evaluated.

[Note: record checksums]
Every row carries a checksum (BLAKE2b, 16 bytes) over all its other columns as SQLite returns
them, types included (:func:`row_checksum`): key, dtype, shape, sizes, codec and its metadata,
chunk, extents, the data CRCs, generation and flags. A bit flipped anywhere in a row (a key renamed, a
shape or dtype changed, an extent moved) fails it, so the row is reported and never served. The
``flags`` column says that an entry was written without data CRCs; ``crcs`` being NULL without
that flag is damage, so verification is never switched off by a damaged row.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import math
from typing import Collection, Optional, Sequence

import torch

from tiered.backends.nvme import FileExtent
from tiered.config import ALIGNMENT
from tiered.errors import ManifestError

#: The codec name of bytes stored as they are.
RAW = "raw"

#: The ``entries`` table: each column and its SQL declaration, in row order.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("key", "TEXT PRIMARY KEY"),
    ("dtype", "TEXT NOT NULL"),
    ("shape", "TEXT NOT NULL"),
    ("nbytes", "INTEGER NOT NULL"),
    ("stored_nbytes", "INTEGER NOT NULL"),
    ("codec", "TEXT NOT NULL"),
    ("codec_meta", "BLOB NOT NULL"),
    ("chunk", "INTEGER NOT NULL"),
    ("extents", "BLOB NOT NULL"),
    ("crcs", "BLOB"),
    ("generation", "INTEGER NOT NULL"),
    ("flags", "INTEGER NOT NULL DEFAULT 0"),
    ("checksum", "BLOB"),
)
COLUMN_NAMES = tuple(name for name, _ in COLUMNS)
#: The columns of a format-1 manifest (no flags, no checksum).
LEGACY_COLUMN_NAMES = COLUMN_NAMES[:-2]
#: ``flags``: the entry was written without data CRCs (``StoreConfig.checksum=False``).
UNVERIFIED = 1
KNOWN_FLAGS = UNVERIFIED
#: Every row with its rowid, in :data:`COLUMN_NAMES` order after the rowid.
SELECT_ROWS = f"SELECT rowid, {', '.join(COLUMN_NAMES)} FROM entries"
#: The same for a format-1 manifest.
SELECT_LEGACY_ROWS = f"SELECT rowid, {', '.join(LEGACY_COLUMN_NAMES)} FROM entries"
#: Bytes of one (file, offset, length) triple in the ``extents`` column.
EXTENT_BYTES = 24


@dataclasses.dataclass(frozen=True)
class Record:
    """Everything needed to find, check and decode one committed tensor: one row of the manifest."""

    key: str
    #: The torch dtype's name ("float32"); :meth:`torch_dtype` gives the dtype.
    dtype: str
    #: None only in a damaged row whose shape could not be parsed.
    shape: Optional[tuple[int, ...]]
    nbytes: int
    stored_nbytes: int
    codec: str
    codec_meta: bytes
    #: Bytes per checksummed chunk of each extent.
    chunk: int
    extents: tuple[FileExtent, ...]
    #: One CRC-32 per chunk; None when the entry was written without checksums.
    crcs: Optional[tuple[int, ...]]
    generation: int

    def torch_dtype(self) -> torch.dtype:
        """The dtype; ManifestError when this PyTorch has no dtype of that name."""
        return dtype_from_name(self.dtype)

    def chunk_count(self) -> int:
        """Checksummed chunks: each extent's share of ``stored_nbytes`` cut into ``chunk`` bytes."""
        count, left = 0, self.stored_nbytes
        for e in self.extents:
            n = min(e.length, left)
            count += -(-n // self.chunk) if n > 0 else 0
            left -= n
        return count


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the ``entries`` table as read: its record, as far as the fields could be parsed,
    and what is wrong with it (nothing, for a row the store may serve)."""

    rowid: int
    record: Record
    problems: tuple[str, ...] = ()
    #: False when the extent list could not be parsed: nobody can tell which swap-file bytes it uses.
    extents_known: bool = True
    #: The row is as it was written: its checksum matched (a format-1 row, which has none, counts as
    #: intact). Problems of an intact row come from its writer (a newer version), not from damage.
    intact: bool = True

    @property
    def ok(self) -> bool:
        """Whether every field parsed and agrees with the others."""
        return not self.problems


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """torch.float32 for 'float32'; ManifestError for names this torch lacks."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"manifest names dtype {name!r}, which this PyTorch ({torch.__version__}) lacks")
    return dtype


def to_row(r: Record) -> tuple:
    """The column values of ``r``, in :data:`COLUMN_NAMES` order, its checksum last."""
    ext = array.array("q", [v for e in r.extents for v in (e.file, e.offset, e.length)])
    crcs = array.array("I", r.crcs).tobytes() if r.crcs is not None else None
    shape = json.dumps(list(r.shape if r.shape is not None else ()))
    values = (r.key, r.dtype, shape, r.nbytes, r.stored_nbytes, r.codec, r.codec_meta, r.chunk, ext.tobytes(), crcs,
              r.generation, UNVERIFIED if r.crcs is None else 0)
    return (*values, row_checksum(values))


def row_checksum(values: Sequence[object]) -> bytes:
    """The checksum of a row's columns (all but the checksum itself), as SQLite stores and returns them.

    The columns are hashed as ``ascii()`` writes their tuple: one C call, and a form that tells
    text, bytes, integers, floats and NULL apart and does not depend on the Unicode database (every
    character outside ASCII is escaped), so it stays the same across Python versions.
    """
    return hashlib.blake2b(ascii(tuple(values)).encode("ascii"), digest_size=16, person=b"tiered-record").digest()


def parse_row(values: Sequence[object], *, rowid: int = 0, codecs: Optional[Collection[str]] = None,
              legacy: bool = False) -> Row:
    """Parse the column values of one row (in :data:`COLUMN_NAMES` order; :data:`LEGACY_COLUMN_NAMES`
    with ``legacy``, whose rows carry no checksum). Never raises: a checksum that does not match, a
    field that cannot be parsed or that disagrees with the others (a size that does not match the
    dtype and shape, extents that cannot hold the stored bytes, a checksum count that does not match
    the chunks, a codec not in ``codecs`` when given) is a problem of the row."""
    problems: list[str] = []
    intact = True
    if legacy:
        fields, flags = tuple(values), None
    else:
        fields, flags, checksum = tuple(values[:-2]), values[-2], values[-1]
        intact = checksum == row_checksum(values[:-1])
        if not intact:
            problems.append("its record checksum does not match its fields: the row was changed or damaged")
    row = dataclasses.replace(_parse_fields(fields, rowid, codecs, problems), intact=intact)
    if flags is not None and row.ok:
        crcs_missing = row.record.crcs is None
        if type(flags) is not int or flags & ~KNOWN_FLAGS:
            row = dataclasses.replace(row, problems=(f"flags {flags!r} are not ones this version knows",))
        elif crcs_missing != bool(flags & UNVERIFIED):
            row = dataclasses.replace(row, problems=("its data checksums are missing",))
    return row


def _parse_fields(values: Sequence[object], rowid: int, codecs: Optional[Collection[str]],
                  problems: list[str]) -> Row:
    """:func:`parse_row` of the record's own fields; their problems go after those already in ``problems``."""
    key, dtype, shape_text, nbytes, stored, codec, codec_meta, chunk, ext_blob, crc_blob, generation = values
    before = len(problems)

    def integer(name: str, value: object) -> int:
        if type(value) is int and value >= 0:
            return value
        problems.append(f"{name} is {value!r}, not a non-negative integer")
        return 0

    def text(name: str, value: object) -> str:
        if isinstance(value, str):
            return value
        problems.append(f"{name} is {type(value).__name__}, not text")
        return repr(value)

    key = text("key", key)
    dtype = text("dtype", dtype)
    codec = text("codec", codec)
    shape = _shape(shape_text, problems)
    nbytes, stored = integer("nbytes", nbytes), integer("stored_nbytes", stored)
    chunk, generation = integer("chunk", chunk), integer("generation", generation)
    extents_known = isinstance(ext_blob, bytes) and len(ext_blob) % EXTENT_BYTES == 0
    extents: tuple[FileExtent, ...] = ()
    if extents_known:
        ext = array.array("q")
        ext.frombytes(ext_blob)  # type: ignore[arg-type]
        extents = tuple(FileExtent(ext[i], ext[i + 1], ext[i + 2]) for i in range(0, len(ext), 3))
    else:
        problems.append("the extent list is not a whole number of (file, offset, length) triples")
    crcs: Optional[tuple[int, ...]] = None
    if crc_blob is not None:
        if isinstance(crc_blob, bytes) and len(crc_blob) % 4 == 0:
            sums = array.array("I")
            sums.frombytes(crc_blob)
            crcs = tuple(sums)
        else:
            problems.append("the checksum list is not a whole number of CRC-32 values")
    if not isinstance(codec_meta, bytes):
        problems.append(f"codec_meta is {type(codec_meta).__name__}, not bytes")
        codec_meta = b""
    record = Record(key, dtype, shape, nbytes, stored, codec, codec_meta, chunk, extents, crcs, generation)
    if len(problems) == before:  # every field parsed: do they agree?
        problems.extend(_disagreements(record, codecs))
    return Row(rowid, record, tuple(problems), extents_known)


def _shape(text: object, problems: list[str]) -> Optional[tuple[int, ...]]:
    try:
        parsed = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        parsed = None
    if isinstance(parsed, list) and all(type(d) is int and d >= 0 for d in parsed):
        return tuple(parsed)
    problems.append(f"shape {text!r} is not a list of sizes")
    return None


def _disagreements(r: Record, codecs: Optional[Collection[str]]) -> list[str]:
    """Fields of a fully parsed record that contradict each other."""
    problems = []
    if codecs is not None and r.codec != RAW and r.codec not in codecs:
        problems.append(f"unknown codec {r.codec!r} (this version reads {', '.join((RAW, *codecs))})")
    dtype = getattr(torch, r.dtype, None)
    if not isinstance(dtype, torch.dtype):
        problems.append(f"unknown dtype {r.dtype!r} (not in PyTorch {torch.__version__})")
    elif r.shape is not None and math.prod(r.shape) * dtype.itemsize != r.nbytes:
        problems.append(
            f"nbytes is {r.nbytes}, but shape {list(r.shape)} of {r.dtype} takes {math.prod(r.shape) * dtype.itemsize}"
        )
    if r.codec == RAW and r.stored_nbytes != r.nbytes:
        problems.append(f"stored raw in {r.stored_nbytes} bytes, but the tensor has {r.nbytes}")
    if any(e.file < 0 or e.offset < 0 or e.length <= 0 or (e.offset | e.length) % ALIGNMENT for e in r.extents):
        ranges = [(e.file, e.offset, e.length) for e in r.extents]
        problems.append(f"its extents (file, offset, length) {ranges} are not positive, {ALIGNMENT}-byte "
                        "aligned ranges")
        return problems
    held = sum(e.length for e in r.extents)
    if held < r.stored_nbytes:
        problems.append(f"its extents hold {held} bytes, fewer than the {r.stored_nbytes} stored")
    elif r.stored_nbytes and r.chunk <= 0:
        problems.append(f"chunk size is {r.chunk}")
    elif r.crcs is not None and len(r.crcs) != r.chunk_count():
        problems.append(f"it has {len(r.crcs)} checksums for {r.chunk_count()} chunks")
    return problems
