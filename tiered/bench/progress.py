"""A minimal progress bar on stderr, silent when stderr is not a terminal or when asked."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    """``with Progress("store write", total=12) as p: ... p.advance()`` draws ``label [####  ] 3/12``.

    Draws at most every 0.1 s; with ``enabled=False`` (or a non-TTY stream) every call is a no-op.
    """

    WIDTH = 30

    def __init__(self, label: str, total: int, *, enabled: bool = True, stream: Optional[TextIO] = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled and bool(getattr(self._stream, "isatty", lambda: False)())
        self._last = 0.0
        self._started = time.perf_counter()

    def __enter__(self) -> "Progress":
        self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.done = self.total if exc[0] is None else self.done
        self._draw(force=True)
        if self._enabled:
            self._stream.write("\n")
            self._stream.flush()

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more steps done."""
        self.done = min(self.total, self.done + n)
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self._enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self._stream.write(f"\r{self.label:<34} [{bar}] {self.done}/{self.total} {now - self._started:6.1f}s")
        self._stream.flush()
