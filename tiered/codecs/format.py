"""The ``bplane-zstd`` format, version 1: what ``codec_meta`` holds and where the payload puts bytes.

A tensor of ``nbytes`` bytes is read as ``nelems`` elements of ``width`` bytes (a float's or a
complex component's size; 1 for integers and bool). Byte ``j`` of every element forms plane ``j``
(little-endian, so the last plane holds the sign and the high exponent bits). Elements are cut
into frames of ``frame_elems`` (the last one shorter); each frame is coded on its own.

``codec_meta``::

    offset size  field
    0      4     magic b"TBPZ"
    4      1     version (1)
    5      1     width: bytes per element, 1, 2, 4 or 8
    6      1     mask: bit j set = plane j is packed (zstd), clear = plane j is raw
    7      1     reserved, 0
    8      4     frame_elems (u32)
    12     8     nbytes (u64): the original size
    20     4     nframes (u32)
    24     4*m   one u32 per (frame, packed plane), frame-major, planes ascending:
                 bits 0-30 the piece's size, bit 31 set = stored as is (zstd did not shrink it)

Payload: the raw section, then the packed section.

- raw section: for each frame, its raw groups in plane order. Two raw planes ``2i`` and
  ``2i + 1`` form one group of 2 bytes per element (those two bytes of each element, in element
  order, so the group is the little-endian 16-bit slice of each element); any other raw plane is
  a group of 1 byte per element. A frame's raw part is ``k * raw planes`` bytes; every frame but
  the last has ``frame_elems`` elements, so frame ``f`` starts at ``f * frame_elems * raw planes``.
  Pairs exist so that a float32's two low bytes move as one 16-bit value: one pass fewer to split
  and two fewer to merge than as two byte planes.
- packed section: for each frame, for each packed plane, one piece: an independent zstd frame that
  decodes to ``k`` bytes, or the ``k`` bytes themselves when bit 31 is set.

All integers are little-endian.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Sequence

MAGIC = b"TBPZ"
VERSION = 1
HEADER = struct.Struct("<4sBBBBIQI")
#: Bit 31 of a piece's size: the piece holds the plane bytes as they are.
STORED = 1 << 31
WIDTHS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one tensor's bytes are cut into frames and planes (sizes of packed pieces aside)."""

    width: int
    mask: int
    frame_elems: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.width not in WIDTHS:
            raise ValueError(f"plane width must be one of {WIDTHS}, got {self.width}")
        if not 0 <= self.mask < 1 << self.width:
            raise ValueError(f"plane mask {self.mask:#x} names planes beyond width {self.width}")
        if not 0 < self.frame_elems < STORED:
            raise ValueError(f"frame_elems must be in [1, 2**31), got {self.frame_elems}")
        if self.nbytes < 0 or self.nbytes % self.width:
            raise ValueError(f"nbytes {self.nbytes} is not a whole number of {self.width}-byte elements")

    @property
    def nelems(self) -> int:
        """Elements in the tensor."""
        return self.nbytes // self.width

    @property
    def nframes(self) -> int:
        """Frames, each coded independently."""
        return -(-self.nelems // self.frame_elems)

    @property
    def packed(self) -> tuple[int, ...]:
        """Planes stored in the packed section, ascending."""
        return tuple(j for j in range(self.width) if self.mask >> j & 1)

    @property
    def raw(self) -> tuple[int, ...]:
        """Planes stored in the raw section, ascending."""
        return tuple(j for j in range(self.width) if not self.mask >> j & 1)

    @property
    def raw_groups(self) -> tuple[tuple[int, int], ...]:
        """The raw section's groups in order: (first plane, planes in the group: 1 or 2)."""
        raw = set(self.raw)
        groups = []
        j = 0
        while j < self.width:
            if j in raw and j % 2 == 0 and j + 1 in raw:
                groups.append((j, 2))
                j += 2
                continue
            if j in raw:
                groups.append((j, 1))
            j += 1
        return tuple(groups)

    @property
    def raw_bytes(self) -> int:
        """Size of the raw section."""
        return self.nelems * len(self.raw)

    def frame_len(self, frame: int) -> int:
        """Elements in ``frame``."""
        return min(self.frame_elems, self.nelems - frame * self.frame_elems)

    def raw_offset(self, frame: int) -> int:
        """Where ``frame``'s raw planes start in the payload."""
        return frame * self.frame_elems * len(self.raw)


def encode_meta(layout: Layout, sizes: Sequence[int]) -> bytes:
    """``codec_meta`` for ``layout`` with the packed pieces' size words (bit 31 = stored)."""
    expected = layout.nframes * len(layout.packed)
    if len(sizes) != expected:
        raise ValueError(f"{len(sizes)} piece sizes for {expected} packed pieces")
    head = HEADER.pack(MAGIC, VERSION, layout.width, layout.mask, 0, layout.frame_elems, layout.nbytes, layout.nframes)
    return head + struct.pack(f"<{len(sizes)}I", *sizes)


def decode_meta(meta: bytes, payload_nbytes: int) -> tuple[Layout, tuple[int, ...]]:
    """Parse and check ``codec_meta`` against the payload's size; returns the layout and size words."""
    if len(meta) < HEADER.size:
        raise ValueError(f"bplane-zstd meta is {len(meta)} bytes, shorter than its {HEADER.size}-byte header")
    magic, version, width, mask, _, frame_elems, nbytes, nframes = HEADER.unpack_from(meta)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not bplane-zstd version {VERSION} meta: magic {magic!r}, version {version}")
    layout = Layout(width, mask, frame_elems, nbytes)
    if nframes != layout.nframes:
        raise ValueError(f"meta says {nframes} frames, but {layout.nelems} elements make {layout.nframes}")
    count = nframes * len(layout.packed)
    if len(meta) != HEADER.size + 4 * count:
        raise ValueError(f"bplane-zstd meta is {len(meta)} bytes, expected {HEADER.size + 4 * count}")
    sizes = struct.unpack_from(f"<{count}I", meta, HEADER.size)
    packed = 0
    for i, word in enumerate(sizes):
        k = layout.frame_len(i // len(layout.packed))
        size = word & ~STORED
        if word & STORED and size != k:
            raise ValueError(f"stored piece {i} is {size} bytes, but its frame has {k} elements")
        packed += size
    if layout.raw_bytes + packed != payload_nbytes:
        raise ValueError(
            f"payload is {payload_nbytes} bytes, meta accounts for {layout.raw_bytes} raw + {packed} packed"
        )
    return layout, sizes
