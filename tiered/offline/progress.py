"""A byte-count progress bar on stderr, drawn only on a terminal."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from tiered.offline.render import format_bytes


class ByteProgress:
    """``with ByteProgress("verifying", total) as p: p.advance(n)`` draws
    ``verifying [#######.......] 1.2 GiB / 3.0 GiB  850 MB/s`` at most ten times a second.

    Silent when ``enabled`` is False or ``stream`` (default stderr) is not a terminal.
    """

    WIDTH = 30

    def __init__(self, label: str, total: int, *, enabled: bool = True, stream: Optional[TextIO] = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and bool(getattr(self._stream, "isatty", lambda: False)())
        self._started = time.perf_counter()
        self._last = 0.0

    def __enter__(self) -> "ByteProgress":
        self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._draw(force=True)
        if self.enabled:
            self._stream.write("\n")
            self._stream.flush()

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` more bytes done."""
        self.done = min(self.total, self.done + nbytes)
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        filled = self.WIDTH * self.done // self.total
        rate = self.done / max(now - self._started, 1e-9) / 1e6
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self._stream.write(
            f"\r{self.label} [{bar}] {format_bytes(self.done)} / {format_bytes(self.total)}  {rate:,.0f} MB/s\x1b[K"
        )
        self._stream.flush()
