"""A byte-count progress bar on stderr, drawn only on a terminal."""

from __future__ import annotations

from tiered.offline.render import format_bytes
from tiered.util.progress import Progress


class ByteProgress(Progress):
    """``with ByteProgress("verifying", total) as p: p.advance(n)`` draws
    ``verifying [#######.......] 1.2 GiB / 3.0 GiB  850 MB/s``."""

    LABEL_WIDTH = 0

    def __exit__(self, *exc: object) -> None:
        # Leave the count as it stands: a bar that ends early shows how far it got.
        self._draw(force=True)
        if self.enabled:
            self._stream.write("\n")
            self._stream.flush()

    def status(self, elapsed: float) -> str:
        rate = self.done / max(elapsed, 1e-9) / 1e6
        return f"{format_bytes(self.done)} / {format_bytes(self.total)}  {rate:,.0f} MB/s"
