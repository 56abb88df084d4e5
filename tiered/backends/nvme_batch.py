"""Batched nvme transfers: the chunks of many copies in few vectored syscalls, one CRC per chunk.

Chunks that lie back to back in one swap file (the copies of one ``put_many`` are allocated as one
run) are coalesced into one staged block of at most ``block_size`` bytes: one ``pwritev`` or
``preadv`` for all of them. Each chunk keeps its own CRC-32, computed or verified on the worker
thread while its bytes are copied in or out of the staging slot, so the records are exactly what
one put per copy would have written, and a bad chunk fails only its own copy. A chunk whose memory
can take O_DIRECT in place (large page-aligned tensors) goes alone, without a copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Optional, Sequence

from tiered.config import ALIGNMENT
from tiered.errors import ChecksumError
from tiered.io import BlockRead, BlockWrite, IOEngine, round_up
from tiered.io.crc import crc32
from tiered.io.spans import Span, aligned_views, copy_in, copy_out

_ZEROS = bytes(ALIGNMENT)
#: Coalesced runs stop at this size (or ``block_size`` when smaller): a batch of a few MiB then
#: becomes a few blocks in flight at once, so copying one overlaps the syscalls of the others.
RUN_BYTES = 1024 * 1024

#: ``(index, file, file_offset, logical_start, length)`` of one checksummed chunk, as
#: ``NvmeBackend._chunks`` plans them; ``file`` has ``.index`` and ``.handle``.
Chunk = tuple


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One chunk of copy number ``copy`` placed in the batch."""

    copy: int
    index: int
    file: object
    offset: int
    pos: int
    length: int


def carve(run: Sequence, needs: Sequence[int]) -> list[list]:
    """Split a run of extents (``FileExtent``s, in order) into consecutive pieces of ``needs`` bytes.

    A piece that crosses from one extent into the next gets one extent in each.
    """
    out: list[list] = []
    i, used = 0, 0  # extent index, bytes of it already handed out
    for need in needs:
        mine = []
        while need > 0:
            ext = run[i]
            take = min(need, ext.length - used)
            mine.append(dataclasses.replace(ext, offset=ext.offset + used, length=take))
            need -= take
            used += take
            if used == ext.length:
                i, used = i + 1, 0
        out.append(mine)
    assert sum(e.length for e in run[i:]) - used == 0, "the run is larger than the pieces"
    return out


def _split(
    plans: Sequence[Sequence[Chunk]], bufs: Sequence[Sequence[Span]], memory_alignment: Optional[int]
) -> tuple[list[tuple[_Piece, list]], list[_Piece]]:
    """Every copy's chunks as pieces: those whose memory O_DIRECT can use in place (with its views),
    each a block of its own, and the rest, to be coalesced into staged runs. ``memory_alignment``:
    what O_DIRECT needs of a buffer's address; None without O_DIRECT (everything is staged)."""
    solo: list[tuple[_Piece, list]] = []
    pieces: list[_Piece] = []
    for c, plan in enumerate(plans):
        for index, f, offset, pos, n in plan:
            p = _Piece(c, index, f, offset, pos, n)
            views = aligned_views(bufs[c], pos, pos + n, ALIGNMENT, memory_alignment) if memory_alignment else None
            if views is not None:
                solo.append((p, views))
            else:
                pieces.append(p)
    return solo, pieces


def _expected(expected: Sequence[Optional[Sequence[int]]], p: _Piece) -> Optional[int]:
    want = expected[p.copy]
    return None if want is None else want[p.index]


def _runs(pieces: list[_Piece], block_size: int) -> list[list[_Piece]]:
    """Group pieces lying back to back in one file into runs of at most ``block_size`` bytes."""
    runs: list[list[_Piece]] = []
    end = -1
    for p in sorted(pieces, key=lambda p: (p.file.index, p.offset)):
        cur = runs[-1] if runs else None
        if cur is not None and p.file is cur[0].file and p.offset == end and \
                end + round_up(p.length) - cur[0].offset <= block_size:
            cur.append(p)
        else:
            runs.append([p])
        end = p.offset + round_up(p.length)
    return runs


async def store_many(
    io: IOEngine, memory_alignment: Optional[int], plans: Sequence[Sequence[Chunk]], srcs: Sequence[Sequence[Span]]
) -> tuple[list[Optional[list[int]]], list[Optional[BaseException]]]:
    """Write ``srcs[i]`` into the chunks ``plans[i]`` of copy ``i``, for every copy at once (in place where
    ``memory_alignment``, O_DIRECT's need of an address, allows; None: every chunk staged).

    Returns each copy's CRC per chunk (None with checksums off) and each copy's error (None when all
    its chunks were written). A failed block fails only the copies with a chunk in it.
    """
    crcs: list[list[int]] = [[0] * len(plan) for plan in plans]
    errors: list[Optional[BaseException]] = [None] * len(plans)
    solo, pieces = _split(plans, srcs, memory_alignment)
    blocks: list[tuple[list[_Piece], BlockWrite]] = [
        ([p], BlockWrite(p.file.handle, p.offset, p.length, source=views)) for p, views in solo
    ]
    for run in _runs(pieces, min(io.block_size, RUN_BYTES)):
        length = run[-1].offset + run[-1].length - run[0].offset
        fill = functools.partial(_fill, run, srcs, crcs, io.checksum)
        blocks.append((run, BlockWrite(run[0].file.handle, run[0].offset, length, fill=fill, checksum=False)))
    results = await asyncio.gather(*(io.write([b]) for _, b in blocks), return_exceptions=True)
    for (run, block), result in zip(blocks, results):
        if isinstance(result, BaseException):
            for p in run:
                errors[p.copy] = errors[p.copy] or result
        elif block.fill is None and io.checksum:
            crcs[run[0].copy][run[0].index] = result[0]  # type: ignore[index]
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r  # cancellation and the like: not a per-copy failure
    return [c if io.checksum else None for c in crcs], errors


def _fill(run: list[_Piece], srcs: Sequence[Sequence[Span]], crcs: list[list[int]], checksum: bool,
          view: memoryview) -> None:
    """On a worker thread: copy each piece of a run into the staging slot and checksum it."""
    base = run[0].offset
    for i, p in enumerate(run):
        rel = p.offset - base
        mine = view[rel : rel + p.length]
        copy_out(srcs[p.copy], p.pos, mine)
        if checksum:
            crcs[p.copy][p.index] = crc32([mine], p.length)
        pad = round_up(p.length) - p.length
        if pad and i < len(run) - 1:  # the engine pads the block's own tail
            view[rel + p.length : rel + p.length + pad] = _ZEROS[:pad]


async def load_many(
    io: IOEngine, memory_alignment: Optional[int], plans: Sequence[Sequence[Chunk]], dsts: Sequence[Sequence[Span]],
    expected: Sequence[Optional[Sequence[int]]],
) -> list[Optional[BaseException]]:
    """Read every copy's chunks into ``dsts[i]``, verifying ``expected[i]`` (CRC per chunk) when given (in
    place where ``memory_alignment`` allows, as for :func:`store_many`).

    Returns each copy's error (None when all its chunks arrived intact). A corrupt chunk fails only
    its own copy: the other chunks of its block are still delivered.
    """
    errors: list[Optional[BaseException]] = [None] * len(plans)
    solo, pieces = _split(plans, dsts, memory_alignment)
    blocks: list[tuple[list[_Piece], BlockRead]] = [
        ([p], BlockRead(p.file.handle, p.offset, p.length, dest=views, expected_crc=_expected(expected, p)))
        for p, views in solo
    ]
    for run in _runs(pieces, min(io.block_size, RUN_BYTES)):
        length = run[-1].offset + run[-1].length - run[0].offset
        drain = functools.partial(_drain, run, dsts, expected, errors)
        blocks.append((run, BlockRead(run[0].file.handle, run[0].offset, length, drain=drain, checksum=False)))
    results = await io.read_each([b for _, b in blocks])
    for (run, _), result in zip(blocks, results):
        if isinstance(result, Exception):
            for p in run:
                errors[p.copy] = errors[p.copy] or result
    return errors


def _drain(run: list[_Piece], dsts: Sequence[Sequence[Span]], expected: Sequence[Optional[Sequence[int]]],
           errors: list[Optional[BaseException]], view: memoryview) -> None:
    """On a worker thread: verify each piece of a run against its CRC and copy it out of the slot."""
    base = run[0].offset
    for p in run:
        rel = p.offset - base
        mine = view[rel : rel + p.length]
        want = expected[p.copy]
        if want is not None:
            got = crc32([mine], p.length)
            if got != want[p.index]:
                errors[p.copy] = errors[p.copy] or ChecksumError(
                    f"checksum mismatch in {p.file.handle.path} at offset {p.offset} ({p.length} bytes): "
                    f"stored {want[p.index]:#010x}, read {got:#010x}"
                )
                continue
        copy_in(dsts[p.copy], p.pos, mine)
