"""DeepSpeed's ``wall_clock_breakdown`` for ``engine.initialize``'s engine: wall time of each
forward (``model_engine(batch)``), ``backward`` and ``step``, per call and summed over an
accumulation window, in DeepSpeed's line format (``time (ms) | fwd: ... | bwd: ... | step: ...``)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

#: DeepSpeed's timer names for the three calls (its ``fwd``, ``bwd`` and ``step`` global timers).
PHASES = ("fwd", "bwd", "step")


class WallClockBreakdown:
    """Milliseconds spent in each phase since the last micro-step line and since the last window
    line. On a CUDA device each interval starts and ends with a synchronize, as DeepSpeed's timers
    wait for their events: the figures are the GPU's work, at the cost of the overlap."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._micro = dict.fromkeys(PHASES, 0.0)
        self._window = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to ``phase``."""
        assert phase in PHASES, phase
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            elapsed_ms = (time.perf_counter() - start) * 1e3
            self._micro[phase] += elapsed_ms
            self._window[phase] += elapsed_ms

    def snapshot(self) -> dict[str, float]:
        """Milliseconds by DeepSpeed's timer name: this micro-step's (``fwd_microstep``, ...) and
        the window's so far (``fwd``, ...)."""
        return {**{f"{phase}_microstep": ms for phase, ms in self._micro.items()}, **self._window}

    def micro_line(self) -> str:
        """DeepSpeed's per-micro-step line (``fwd_microstep``, ...), and start the next micro-step."""
        line = "time (ms)" + "".join(f" | {phase}_microstep: {ms:.2f}" for phase, ms in self._micro.items())
        self._micro = dict.fromkeys(PHASES, 0.0)
        return line

    def take_window(self) -> dict[str, float]:
        """Milliseconds per phase over the accumulation window that ends now; starts the next one."""
        window, self._window = self._window, dict.fromkeys(PHASES, 0.0)
        return window

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)


def window_line(window: dict[str, float], io_wait_ms: float) -> str:
    """DeepSpeed's per-step line, with the time the engine waited on the store in the window."""
    return "time (ms)" + "".join(f" | {phase}: {ms:.2f}" for phase, ms in window.items()) + \
        f" | io_wait: {io_wait_ms:.2f}"


__all__ = ["PHASES", "WallClockBreakdown", "window_line"]
