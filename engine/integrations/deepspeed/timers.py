"""DeepSpeed's timers for ``engine.initialize``'s engine: ``wall_clock_breakdown`` (wall time of
each forward, ``model_engine(batch)``, ``backward`` and ``step``, per call and summed over an
accumulation window, in DeepSpeed's line format, ``time (ms) | fwd: ... | bwd: ... | step: ...``)
and the throughput timer (samples per second, printed with the progress line)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

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
        synchronize(self._device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self._device)
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


class ThroughputMeter:
    """DeepSpeed's throughput timer: each micro-step timed from its forward to the end of its
    ``step()`` call (loading the next batch in between is not counted), summed per optimizer step;
    the running average leaves out the first :attr:`WARMUP_STEPS` optimizer steps, as DeepSpeed's."""

    WARMUP_STEPS = 2

    def __init__(self, device: torch.device, *, synchronized: bool) -> None:
        self._device = device
        self._synchronized = synchronized
        self._start: Optional[float] = None
        self.micro_steps = 0
        self.steps = 0
        self._step_seconds = 0.0
        self._timed_seconds = 0.0
        self.last_step_seconds: Optional[float] = None

    def start(self) -> None:
        """A forward begins: start the micro-step's clock unless it runs (after the warm-up)."""
        if self._start is None and self.steps >= self.WARMUP_STEPS:
            synchronize(self._device, self._synchronized)
            self._start = time.perf_counter()

    def stop(self, boundary: bool) -> None:
        """A ``step()`` call ended; ``boundary``: it was an optimizer step."""
        self.micro_steps += 1
        if self._start is not None:
            synchronize(self._device, self._synchronized)
            elapsed = time.perf_counter() - self._start
            self._start = None
            self._step_seconds += elapsed
            self._timed_seconds += elapsed
        if boundary:
            self.steps += 1
            if self._step_seconds:
                self.last_step_seconds, self._step_seconds = self._step_seconds, 0.0

    def line(self, global_steps: int, samples_per_step: int) -> str:
        """DeepSpeed's throughput line (``-`` for figures the warm-up has not given yet)."""
        timed = self.steps - self.WARMUP_STEPS
        average = f"{samples_per_step * timed / self._timed_seconds:.2f}" if timed > 0 and self._timed_seconds else "-"
        current = f"{samples_per_step / self.last_step_seconds:.2f}" if self.last_step_seconds else "-"
        line = (f"micro_step={self.micro_steps}/global_step={global_steps}, RunningAvgSamplesPerSec={average}, "
                f"CurrSamplesPerSec={current}")
        if self._device.type == "cuda":
            line += (f", MemAllocated={torch.cuda.memory_allocated(self._device) / 2**30:.2f}GB, "
                     f"MaxMemAllocated={torch.cuda.max_memory_allocated(self._device) / 2**30:.2f}GB")
        return line


def synchronize(device: torch.device, enabled: bool = True) -> None:
    """Wait for the work queued on a CUDA ``device`` before a clock is read (nothing elsewhere)."""
    if enabled and device.type == "cuda":
        torch.cuda.synchronize(device)


def window_line(window: dict[str, float], io_wait_ms: float) -> str:
    """DeepSpeed's per-step line, with the time the engine waited on the store in the window."""
    return "time (ms)" + "".join(f" | {phase}: {ms:.2f}" for phase, ms in window.items()) + \
        f" | io_wait: {io_wait_ms:.2f}"


__all__ = ["PHASES", "ThroughputMeter", "WallClockBreakdown", "synchronize", "window_line"]
