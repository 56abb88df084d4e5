"""``zstd``: the store's first codec, plain zstd level 1 over 4 MiB frames of raw bytes.

Stores no longer write it (``bplane-zstd`` replaced it), but entries written with it still read.
``codec_meta``: u32 frame size, then one u32 compressed size per frame, little-endian.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import struct
from typing import Optional, Sequence

import torch
import zstandard

from tiered.codecs.buffers import Encoded
from tiered.codecs.jobs import run_all
from tiered.io.aligned import AlignedBuffer
from tiered.io.spans import Span, copy_in, pieces, total_bytes

FRAME_BYTES = 4 * 1024 * 1024
#: Compression that saves less than this fraction is not worth the CPU: the entry is stored raw.
MIN_SAVING = 0.05


class ZstdCodec:
    """Frames of ``FRAME_BYTES`` compressed with zstd level 1; ``meta`` lists the frame sizes."""

    name = "zstd"

    def __init__(self, pool: concurrent.futures.Executor, level: int = 1) -> None:
        self._pool = pool
        self._level = level

    async def encode(self, data: torch.Tensor, dtype: Optional[torch.dtype] = None) -> Optional[Encoded]:
        """Compress a CPU uint8 tensor; None when the saving is under ``MIN_SAVING``."""
        n = data.numel()
        if n == 0:
            return None
        view = memoryview(data.numpy())
        chunks = ((view[i : i + FRAME_BYTES],) for i in range(0, n, FRAME_BYTES))
        frames = await run_all(self._pool, self._compress, chunks)
        total = sum(len(f) for f in frames)
        if total > n * (1 - MIN_SAVING):
            return None
        out = await asyncio.get_running_loop().run_in_executor(self._pool, _join, frames, total)
        meta = struct.pack(f"<I{len(frames)}I", FRAME_BYTES, *(len(f) for f in frames))
        return Encoded(self.name, out, total, meta)

    async def decode(self, payload: memoryview, meta: bytes, dst: Sequence[Span]) -> None:
        """Decompress ``payload`` into ``dst``."""
        (frame_bytes,) = struct.unpack_from("<I", meta)
        sizes = struct.unpack_from(f"<{(len(meta) - 4) // 4}I", meta, 4)
        if sum(sizes) != len(payload):
            raise ValueError(f"zstd meta accounts for {sum(sizes)} bytes, the payload has {len(payload)}")
        calls = []
        pos = 0
        for i, size in enumerate(sizes):
            calls.append((payload[pos : pos + size], dst, i * frame_bytes, frame_bytes))
            pos += size
        await run_all(self._pool, self._decompress_into, calls)

    def _compress(self, chunk: memoryview) -> bytes:
        return zstandard.ZstdCompressor(level=self._level).compress(chunk)

    @staticmethod
    def _decompress_into(frame: memoryview, dst: Sequence[Span], start: int, frame_bytes: int) -> None:
        n = min(frame_bytes, total_bytes(dst) - start)
        parts = list(pieces(dst, start, start + n))
        direct = len(parts) == 1 and parts[0][0].tensor.device.type == "cpu"
        if direct:
            span, lo, hi = parts[0]
            target = memoryview(span.tensor[lo:hi].numpy())
        else:
            target = memoryview(bytearray(n))
        with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
            got = 0
            while got < n:
                k = reader.readinto(target[got:])
                if k == 0:
                    raise ValueError(f"zstd frame ended after {got} of {n} bytes")
                got += k
        if not direct:
            copy_in(dst, start, target)


def _join(frames: Sequence[bytes], total: int) -> AlignedBuffer:
    """Concatenate frames into one aligned buffer (on a worker thread: it is a big copy)."""
    out = AlignedBuffer(total)
    pos = 0
    for f in frames:
        out.view[pos : pos + len(f)] = f
        pos += len(f)
    return out
