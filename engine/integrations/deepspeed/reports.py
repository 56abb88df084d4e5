"""What a DeepSpeed config asks ``engine.initialize``'s engine to report, around its forward,
backward and step calls: the progress and throughput lines (``steps_per_print``, ``timers``), the
monitors' events (:mod:`engine.integrations.deepspeed.monitor`), ``wall_clock_breakdown``'s timings, the
``flops_profiler``'s profile, ``memory_breakdown``'s lines and ``dump_state``'s configuration.
Everything prints on rank 0 only, as DeepSpeed's; the timers run on every rank."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Mapping, Optional

from engine.config.deepspeed import micro_batch_size
from engine.engine import Engine
from engine.integrations.deepspeed.flops import FlopsProfile, FlopsProfilerSettings, StepFigures
from engine.integrations.deepspeed.memory import configuration_lines, memory_lines
from engine.integrations.deepspeed.monitor import DeepSpeedMonitor, Event
from engine.integrations.deepspeed.timers import ThroughputMeter, WallClockBreakdown, window_line

#: DeepSpeed's event names for the three timed phases.
ELAPSED_EVENTS = {"fwd": "Train/Samples/elapsed_time_ms_forward", "bwd": "Train/Samples/elapsed_time_ms_backward",
                  "step": "Train/Samples/elapsed_time_ms_step"}


class DeepSpeedReports:
    """The reports of one engine, made once it is wrapped; ``monitor`` is the config's monitors
    (``model_engine.monitor``), closed by :meth:`close`. ``engine`` is the
    :class:`~engine.integrations.deepspeed.engine.DeepSpeedEngine` that owns them (typed as its base
    class here, which that module's import of this one would otherwise make circular)."""

    def __init__(self, engine: Engine, ds: Mapping[str, Any], monitor: DeepSpeedMonitor) -> None:
        self._engine = engine
        self.monitor = monitor
        self._rank0 = engine.global_rank == 0
        self._memory_breakdown = ds.get("memory_breakdown") is True
        # The batch sizes are fixed for the engine's life; None when the config gives none.
        accumulation = engine.gradient_accumulation_steps()
        self._micro_batch = micro_batch_size(ds, accumulation, engine.world_size)
        self._samples_per_step = (None if self._micro_batch is None
                                  else self._micro_batch * accumulation * engine.world_size)
        self._timers: Optional[WallClockBreakdown] = None
        self._timer_snapshot: dict[str, float] = {}
        self._io_wait_mark = 0.0
        if ds.get("wall_clock_breakdown") is True:
            self._timers = WallClockBreakdown(engine.device)
            self._io_wait_mark = self._io_wait_seconds()
        throughput = _section(_section(ds, "timers"), "throughput")
        self._throughput: Optional[ThroughputMeter] = None
        if throughput.get("enabled", True) is not False:
            self._throughput = ThroughputMeter(engine.device, synchronized=throughput.get("synchronized") is not False)
        self._flops_settings = FlopsProfilerSettings.from_config(ds)
        self._flops_reported = False
        #: The profiled step's flops, timings and io_wait at its start, while it runs (rank 0).
        self._flops_profile: Optional[tuple[FlopsProfile, WallClockBreakdown, float]] = None
        if ds.get("dump_state") is True:
            self._print(configuration_lines("DeepSpeedEngine configuration", engine.config))

    @property
    def wall_clock_breakdown(self) -> bool:
        """Whether the config's ``wall_clock_breakdown`` is on."""
        return self._timers is not None

    def wall_clock_timers(self) -> dict[str, float]:
        """Milliseconds by DeepSpeed's timer name as of the last step() call (empty without
        ``wall_clock_breakdown``)."""
        return dict(self._timer_snapshot)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around ``model_engine(batch)``. An evaluation forward (the model in eval mode) is no part
        of a step's throughput or flops."""
        training = self._engine.module.training
        profile = self._step_profile() if training else None
        if self._throughput is not None and training:
            self._throughput.start()
        with self._timed("fwd", profiled=training), \
                profile[0].counting() if profile is not None else contextlib.nullcontext():
            yield
        self._print_memory("Engine after forward")

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around ``model_engine.backward(loss)``."""
        with self._timed("bwd"):
            yield
        self._print_memory("Engine after backward")

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around ``model_engine.step()``; the reports follow it (none when it raises)."""
        engine = self._engine
        boundary = engine.is_gradient_accumulation_boundary()
        profiled = self._flops_profile if boundary else None
        with self._timed("step"):
            yield
        if self._throughput is not None:
            self._throughput.stop(boundary)
        if profiled is not None:
            self._report_flops(*profiled)
        every = engine.steps_per_print()
        if boundary and every and engine.global_steps % every == 0:
            self._print([f"step={engine.global_steps}, skipped={engine.skipped_steps}, lr={engine.get_lr()}, "
                         f"mom={engine.get_mom()}"])
            if self._throughput is not None and self._samples_per_step is not None:
                self._print([self._throughput.line(engine.global_steps, self._samples_per_step)])
        events: list[Event] = []
        if boundary and self.monitor.enabled and self._rank0:
            events.append(("Train/Samples/lr", engine.get_lr()[0], engine.global_samples))
            if engine.fp16_enabled() and engine.loss_scale is not None:
                events.append(("Train/Samples/loss_scale", engine.loss_scale, engine.global_samples))
        if self._timers is not None:
            events += self._report_timings(boundary)
        self.monitor.write_events(events)  # nothing on other ranks
        self._print_memory("Engine after step")

    def close(self) -> None:
        """Flush and close the monitors."""
        self.monitor.close()

    def _timed(self, phase: str, *, profiled: bool = True) -> ContextManager[None]:
        """Time ``phase`` for ``wall_clock_breakdown`` and, with ``profiled``, for the flops profile."""
        stack = contextlib.ExitStack()
        if self._timers is not None:
            stack.enter_context(self._timers.timed(phase))
        if profiled and self._flops_profile is not None:
            stack.enter_context(self._flops_profile[1].timed(phase))
        return stack

    def _step_profile(self) -> Optional[tuple[FlopsProfile, WallClockBreakdown, float]]:
        """The flops profile of the step under way, started at its first forward when it is the
        config's ``profile_step`` (on rank 0); None otherwise."""
        settings = self._flops_settings
        if (self._flops_profile is None and settings is not None and self._rank0 and not self._flops_reported
                and self._engine.global_steps == settings.profile_step):
            self._flops_profile = (FlopsProfile(settings), WallClockBreakdown(self._engine.device),
                                   self._io_wait_seconds())
        return self._flops_profile

    def _report_flops(self, profile: FlopsProfile, timers: WallClockBreakdown, io_wait_start: float) -> None:
        """Print (or write to ``output_file``) the profile of the optimizer step just taken."""
        engine = self._engine
        self._flops_profile, self._flops_reported = None, True
        window = timers.take_window()
        figures = StepFigures(
            fwd_seconds=window["fwd"] / 1e3, bwd_seconds=window["bwd"] / 1e3, step_seconds=window["step"] / 1e3,
            io_wait_seconds=self._io_wait_seconds() - io_wait_start, world_size=engine.world_size,
            micro_batch=self._micro_batch, samples=self._samples_per_step)
        text = profile.report(engine.module, engine.global_steps - 1, figures)
        if profile.settings.output_file is None:
            print(text, flush=True)
        else:
            with open(profile.settings.output_file, "w", encoding="utf-8") as f:
                f.write(text + "\n")

    def _report_timings(self, boundary: bool) -> list[Event]:
        """After a step() call: the micro-step's line and, after an optimizer step, the window's,
        and DeepSpeed's events for the window when monitored."""
        assert self._timers is not None
        self._timer_snapshot = self._timers.snapshot()
        self._print([self._timers.micro_line()])
        if not boundary:
            return []
        window = self._timers.take_window()
        if not self._rank0:
            return []
        now = self._io_wait_seconds()
        io_wait_ms, self._io_wait_mark = (now - self._io_wait_mark) * 1e3, now
        self._print([window_line(window, io_wait_ms)])
        if not self.monitor.enabled:
            return []
        return [(ELAPSED_EVENTS[phase], ms, self._engine.global_samples) for phase, ms in window.items()]

    def _print_memory(self, label: str) -> None:
        if self._memory_breakdown and self._rank0:
            self._print(memory_lines(label, self._engine.device, self._engine.stats()))

    def _print(self, lines: list[str]) -> None:
        if self._rank0:
            for line in lines:
                print(f"[Rank 0] {line}", flush=True)

    def _io_wait_seconds(self) -> float:
        """Seconds the engine has waited on the store: parameters, optimizer state and activations."""
        stats = self._engine.stats()
        return stats.stall_seconds + stats.optimizer_stall_seconds + stats.activation_stall_seconds


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """``config[name]`` when it is a section; empty when absent (or ``"auto"``)."""
    section = config.get(name)
    return section if isinstance(section, Mapping) else {}


__all__ = ["DeepSpeedReports"]
