"""A progress bar on stderr, drawn only on a terminal (and at most ten times a second)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    """``with Progress("store write", total=12) as p: ... p.advance()`` draws ``label [####  ] 3/12``.

    With ``enabled=False`` or a ``stream`` (default stderr) that is not a terminal, every call is
    a no-op. Subclasses change the text after the bar by overriding :meth:`status`.
    """

    WIDTH = 30
    #: Labels are padded to this many characters, so the bars of consecutive phases line up.
    LABEL_WIDTH = 34

    def __init__(self, label: str, total: int, *, enabled: bool = True, stream: Optional[TextIO] = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and bool(getattr(self._stream, "isatty", lambda: False)())
        self._last = 0.0
        self._started = time.perf_counter()

    def __enter__(self) -> "Progress":
        self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.done = self.total if exc[0] is None else self.done
        self._draw(force=True)
        if self.enabled:
            self._stream.write("\n")
            self._stream.flush()

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more units done."""
        self.done = min(self.total, self.done + n)
        self._draw()

    def status(self, elapsed: float) -> str:
        """The text after the bar."""
        return f"{self.done}/{self.total} {elapsed:6.1f}s"

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self._stream.write(f"\r{self.label:<{self.LABEL_WIDTH}} [{bar}] {self.status(now - self._started)}\x1b[K")
        self._stream.flush()
