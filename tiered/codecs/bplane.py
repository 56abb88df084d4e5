"""``bplane-zstd``: lossless byte-plane compression of tensors (layout in :mod:`tiered.codecs.format`).

Floats: only the plane holding the sign and high exponent bits has much redundancy; the mantissa
planes are close to random. So each element's bytes are split into planes, the planes a sample
shows to compress are coded with zstd level 1 and a 64-entry hash table (it finds almost no
matches in float data, so it acts as a fast order-0 Huffman coder), and the others are copied
raw. Integers and bool are one plane of plain bytes under ordinary zstd level 1.

Work is cut into frames of about ``frame_bytes`` that worker threads code in parallel (zstd
releases the GIL). Frames write raw planes straight into the output buffer and decode straight
into the destination; plane buffers and zstd contexts are per thread and reused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Optional, Sequence

import numpy as np
import torch
import zstandard

from tiered.codecs.buffers import BufferPool, Encoded
from tiered.codecs.format import STORED, Layout, decode_meta, encode_meta
from tiered.codecs.jobs import run_all
from tiered.codecs.planes import Part, merge, split
from tiered.io.spans import Span, copy_in, pieces, total_bytes

FRAME_BYTES = 4 * 1024 * 1024
#: An entry whose encoding saves less than this fraction is stored raw.
MIN_SAVING = 0.05
#: A plane is packed only if its sample shrinks by at least this fraction.
PLANE_MIN_SAVING = 0.05
#: The sample: this many windows of ``SAMPLE_ELEMS`` elements, spread over the tensor.
SAMPLE_WINDOWS = 4
SAMPLE_ELEMS = 16384
#: Idle codec buffers a codec keeps for reuse by default.
CACHE_BYTES = 128 * 1024 * 1024

FLOAT = "float"
PLAIN = "plain"


def plane_width(dtype: torch.dtype) -> int:
    """Bytes per element for the plane split: a float's size, a complex component's, 1 otherwise."""
    if dtype.is_complex:
        return dtype.itemsize // 2
    if dtype.is_floating_point:
        return dtype.itemsize
    return 1


def _params(kind: str) -> zstandard.ZstdCompressionParameters:
    if kind == FLOAT:
        # Level 1 with a tiny hash table: on float planes matches are rare, so this is a fast
        # entropy coder. Levels >= 2 and larger tables were slower and no smaller here; negative
        # levels skip Huffman coding of literals and lose most of the gain.
        return zstandard.ZstdCompressionParameters.from_level(1, hash_log=6, min_match=7)
    return zstandard.ZstdCompressionParameters.from_level(1)


class _ThreadState(threading.local):
    """Per worker thread: zstd contexts and scratch arrays, reused across frames and entries."""

    def __init__(self) -> None:
        self.compressors: dict[str, zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()
        self.arrays: dict[str, np.ndarray] = {}

    def compressor(self, kind: str) -> zstandard.ZstdCompressor:
        c = self.compressors.get(kind)
        if c is None:
            c = self.compressors[kind] = zstandard.ZstdCompressor(compression_params=_params(kind))
        return c

    def decompress(self, piece: np.ndarray, name: str, k: int, what: str) -> np.ndarray:
        """Decode one zstd frame of exactly ``k`` bytes into the scratch array ``name``.

        Into memory this thread owns and reuses: ``decompress()`` would allocate the output
        afresh for every frame.
        """
        out = self.array(name, k)
        got = 0
        with self.decompressor.stream_reader(piece, read_size=max(len(piece), 1)) as reader:
            view = memoryview(out)
            while got < k:
                n = reader.readinto(view[got:])
                if n == 0:
                    break
                got += n
            extra = len(reader.read(1)) if got == k else 0
        if got != k or extra:
            raise ValueError(f"{what} decoded to {got + extra}{'+' if extra else ''} bytes, expected {k}")
        return out

    def array(self, name: str, n: int, dtype: type = np.uint8) -> np.ndarray:
        a = self.arrays.get(name)
        if a is None or a.size < n:
            a = self.arrays[name] = np.empty(max(n, 1), dtype)
        return a[:n]


class BytePlaneCodec:
    """The ``bplane-zstd`` codec. ``encode`` and ``decode`` run their work on ``pool``.

    An entry is stored raw unless encoding saves ``min_saving`` of it; a plane is packed only if
    a sample of it shrinks by ``plane_min_saving`` (negative values force packing, for tests).
    """

    name = "bplane-zstd"

    def __init__(
        self,
        pool: concurrent.futures.Executor,
        buffers: Optional[BufferPool] = None,
        frame_bytes: int = FRAME_BYTES,
        *,
        min_saving: float = MIN_SAVING,
        plane_min_saving: float = PLANE_MIN_SAVING,
    ) -> None:
        if isinstance(frame_bytes, bool) or not isinstance(frame_bytes, int) or not 8 <= frame_bytes < STORED:
            raise ValueError(f"frame_bytes must be an int in [8, 2**31), got {frame_bytes!r}")
        if frame_bytes % 8:
            raise ValueError(f"frame_bytes must be a multiple of 8, got {frame_bytes}")
        self._pool = pool
        self._buffers = buffers if buffers is not None else BufferPool(CACHE_BYTES)
        self.frame_bytes = frame_bytes
        self.min_saving = float(min_saving)
        self.plane_min_saving = float(plane_min_saving)
        self._local = _ThreadState()

    # ------------------------------------------------------------------ encode

    async def encode(self, data: torch.Tensor, dtype: torch.dtype) -> Optional[Encoded]:
        """Compress the bytes of a tensor of ``dtype`` (``data``: 1-D contiguous CPU uint8).

        Returns None when it would save less than ``min_saving``: the caller stores it raw.
        """
        src = _as_array(data)
        if src.size == 0:
            return None
        loop = asyncio.get_running_loop()
        plan = await loop.run_in_executor(self._pool, self.plan, src, dtype)
        if plan is None:
            return None
        layout, kind = plan
        buf = await loop.run_in_executor(self._pool, self._buffers.take, src.size)
        try:
            out = buf.tensor.numpy()
            frames = await run_all(
                self._pool, self._encode_frame, ((layout, kind, src, out, f) for f in range(layout.nframes))
            )
            total = layout.raw_bytes + sum(len(piece) for frame in frames for _, piece in frame)
            meta = None
            if total <= src.size * (1 - self.min_saving):
                meta = await loop.run_in_executor(self._pool, self._pack, layout, out, frames)
        except BaseException:
            self._buffers.give(buf)
            raise
        if meta is None:
            self._buffers.give(buf)
            return None
        return Encoded(self.name, buf, total, meta, self._buffers.give)

    def plan(self, src: np.ndarray, dtype: torch.dtype) -> Optional[tuple[Layout, str]]:
        """Choose the planes to pack from a sample; None when the sample says it will not pay."""
        kind = FLOAT if dtype.is_floating_point or dtype.is_complex else PLAIN
        width = plane_width(dtype)
        if src.size % width:
            raise ValueError(f"{src.size} bytes are not a whole number of {dtype} elements")
        sample = _sample(src, width)
        m = sample.size // width
        planes = [(j, self._local.array(f"sample{j}", m)) for j in range(width)]
        split(sample, width, planes)
        cctx = self._local.compressor(kind)
        mask = saved = 0
        for j, plane in planes:
            size = len(cctx.compress(plane))
            if size <= m * (1 - self.plane_min_saving):
                mask |= 1 << j
                saved += m - size
        if not mask or saved < self.min_saving * sample.size:
            return None
        return Layout(width, mask, self.frame_bytes // width, src.size), kind

    def _encode_frame(
        self, layout: Layout, kind: str, src: np.ndarray, out: np.ndarray, frame: int
    ) -> list[tuple[bool, bytes]]:
        """Split one frame: raw planes into ``out``, packed planes compressed; returns the pieces."""
        k, w = layout.frame_len(frame), layout.width
        start = frame * layout.frame_elems * w
        chunk = src[start : start + k * w]
        parts = _raw_parts(layout, out, frame)
        packed = [(j, chunk if w == 1 else self._local.array(f"plane{j}", k)) for j in layout.packed]
        split(chunk, w, parts + packed)
        cctx = self._local.compressor(kind)
        result = []
        for _, plane in packed:
            blob = cctx.compress(plane)
            result.append((False, blob) if len(blob) < k else (True, plane.tobytes()))
        return result

    @staticmethod
    def _pack(layout: Layout, out: np.ndarray, frames: Sequence[Sequence[tuple[bool, bytes]]]) -> bytes:
        """Append the pieces after the raw section; returns the meta."""
        pos = layout.raw_bytes
        words = []
        for frame in frames:
            for stored, piece in frame:
                n = len(piece)
                out[pos : pos + n] = np.frombuffer(piece, np.uint8)
                pos += n
                words.append(STORED | n if stored else n)
        return encode_meta(layout, words)

    # ------------------------------------------------------------------ decode

    async def decode(self, payload: memoryview, meta: bytes, dst: Sequence[Span]) -> None:
        """Decode ``payload`` into ``dst`` (spans on any device totalling the original size)."""
        layout, words = decode_meta(meta, len(payload))
        if total_bytes(dst) != layout.nbytes:
            raise ValueError(f"destination holds {total_bytes(dst)} bytes, the entry has {layout.nbytes}")
        offsets = []
        pos = layout.raw_bytes
        for word in words:
            offsets.append(pos)
            pos += word & ~STORED
        src = np.frombuffer(payload, np.uint8) if len(payload) else np.empty(0, np.uint8)
        jobs = ((layout, words, offsets, src, dst, f) for f in range(layout.nframes))
        await run_all(self._pool, self._decode_frame, jobs)

    def _decode_frame(
        self,
        layout: Layout,
        words: Sequence[int],
        offsets: Sequence[int],
        src: np.ndarray,
        dst: Sequence[Span],
        frame: int,
    ) -> None:
        k, w = layout.frame_len(frame), layout.width
        parts = _raw_parts(layout, src, frame)
        first = frame * len(layout.packed)
        for i, j in enumerate(layout.packed):
            word, pos = words[first + i], offsets[first + i]
            piece = src[pos : pos + (word & ~STORED)]
            if word & STORED:
                parts.append((j, piece))
                continue
            parts.append((j, self._local.decompress(piece, f"plane{j}", k, f"frame {frame} plane {j}")))
        start = frame * layout.frame_elems * w
        spans = list(pieces(dst, start, start + k * w))
        direct = len(spans) == 1 and spans[0][0].tensor.device.type == "cpu"
        if direct:
            span, lo, hi = spans[0]
            target = span.tensor[lo:hi].numpy()
        else:
            target = self._local.array("frame", k * w)
        merge(target, w, parts, self._local.array("merge", 2 * k, np.uint16))
        if not direct:
            copy_in(dst, start, memoryview(target))


def _raw_parts(layout: Layout, payload: np.ndarray, frame: int) -> list[Part]:
    """Views of ``frame``'s raw groups in ``payload``: uint8 planes and uint16 plane pairs."""
    k = layout.frame_len(frame)
    pos = layout.raw_offset(frame)
    parts: list[Part] = []
    for first, size in layout.raw_groups:
        view = payload[pos : pos + size * k]
        parts.append((first, view.view(np.uint16) if size == 2 else view))
        pos += size * k
    return parts


def _as_array(data: torch.Tensor) -> np.ndarray:
    if data.dtype != torch.uint8 or data.dim() != 1 or data.device.type != "cpu" or not data.is_contiguous():
        raise TypeError(
            f"codecs take a 1-D contiguous CPU uint8 tensor, got {data.dtype} {tuple(data.shape)} on {data.device}"
        )
    return data.numpy() if data.numel() else np.empty(0, np.uint8)


def _sample(src: np.ndarray, width: int) -> np.ndarray:
    """Up to ``SAMPLE_WINDOWS`` windows of whole elements, spread evenly over ``src``."""
    nelems = src.size // width
    if nelems <= SAMPLE_WINDOWS * SAMPLE_ELEMS:
        return src
    starts = [(nelems - SAMPLE_ELEMS) * i // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)]
    return np.concatenate([src[s * width : (s + SAMPLE_ELEMS) * width] for s in starts])
