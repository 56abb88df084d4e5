"""What one nvme write stores for an entry, and the manifest record it commits."""

from __future__ import annotations

from typing import Any, Sequence

from tiered.backends import NvmeCopy
from tiered.io.spans import Span
from tiered.manifest.records import Record, dtype_name
from tiered.store.entry import RAW, Entry


class Payload:
    """What an nvme write stores for one entry: its own bytes, or a codec's output (closed after the write)."""

    __slots__ = ("spans", "nbytes", "codec", "meta", "_encoded")

    def __init__(self, spans: Sequence[Span], nbytes: int, codec: str = RAW, meta: bytes = b"",
                 encoded: Any = None) -> None:
        self.spans = spans
        self.nbytes = nbytes
        self.codec = codec
        self.meta = meta
        self._encoded = encoded

    def record(self, entry: Entry, copy: NvmeCopy) -> Record:
        """The manifest record of ``entry`` written to ``copy``."""
        return Record(
            entry.key, dtype_name(entry.dtype), entry.shape, entry.nbytes, self.nbytes, self.codec, self.meta,
            copy.chunk, tuple(copy.extents), tuple(copy.crcs) if copy.crcs is not None else None, entry.generation,
        )

    def close(self) -> None:
        """Free the codec's buffers, if any."""
        if self._encoded is not None:
            self._encoded.close()
            self._encoded = None
