"""The codecs one store uses: the one it writes, every one it can read, and their buffers."""

from __future__ import annotations

import concurrent.futures
from typing import Optional, Sequence

import torch

from tiered.codecs.bplane import CACHE_BYTES, FRAME_BYTES, BytePlaneCodec
from tiered.codecs.buffers import BufferPool, Encoded
from tiered.codecs.zstd import ZstdCodec
from tiered.io.aligned import AlignedBuffer
from tiered.io.spans import Span

#: Codecs a store reads (besides ``raw``): the one it writes first.
READABLE_CODECS = (BytePlaneCodec.name, ZstdCodec.name)


class Codecs:
    """Writes ``bplane-zstd``; reads it and the older ``zstd``. Work runs on ``pool``."""

    def __init__(
        self,
        pool: concurrent.futures.Executor,
        *,
        frame_bytes: int = FRAME_BYTES,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.buffers = BufferPool(cache_bytes)
        self.writer = BytePlaneCodec(pool, self.buffers, frame_bytes)
        self._readers = {self.writer.name: self.writer, ZstdCodec.name: ZstdCodec(pool)}
        assert tuple(self._readers) == READABLE_CODECS

    @property
    def names(self) -> tuple[str, ...]:
        """Codec names this store can read (besides ``raw``)."""
        return tuple(self._readers)

    async def encode(self, data: torch.Tensor, dtype: torch.dtype) -> Optional[Encoded]:
        """Compress ``data`` (the bytes of a ``dtype`` tensor); None when storing it raw pays more."""
        return await self.writer.encode(data, dtype)

    async def decode(self, codec: str, payload: memoryview, meta: bytes, dst: Sequence[Span]) -> None:
        """Decode a payload written by ``codec`` into ``dst``."""
        reader = self._readers.get(codec)
        if reader is None:
            raise ValueError(f"unknown codec {codec!r}; this version reads {sorted(self._readers)}")
        await reader.decode(payload, meta, dst)

    def buffer(self, nbytes: int) -> AlignedBuffer:
        """An aligned buffer of at least ``nbytes`` (> 0) for a payload; give it back with :meth:`release`."""
        return self.buffers.take(nbytes)

    def release(self, buffer: AlignedBuffer) -> None:
        """Give back a buffer from :meth:`buffer`."""
        self.buffers.give(buffer)

    def close(self) -> None:
        """Unmap idle buffers."""
        self.buffers.close()
