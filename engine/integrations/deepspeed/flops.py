"""DeepSpeed's ``flops_profiler`` for ``engine.initialize``'s engine: at the config's
``profile_step``, count the forward's floating-point operations (torch's ``FlopCounterMode``, by
module), time the step's forward, backward and optimizer step, and print DeepSpeed's profile
summary (flops, latencies, FLOPS, samples/second) with the busiest modules at each depth."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping, Optional

from torch import nn
from torch.utils.flop_counter import FlopCounterMode

#: DeepSpeed's line format: a label padded to 70 characters, then the value.
LINE = "{:<70}  {}"
RULE = "-" * 78


@dataclasses.dataclass(frozen=True)
class FlopsProfilerSettings:
    """The config's ``flops_profiler`` section, with DeepSpeed's defaults."""

    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    recompute_fwd_factor: float = 0.0
    output_file: Optional[str] = None

    @classmethod
    def from_config(cls, ds: Mapping[str, Any]) -> Optional["FlopsProfilerSettings"]:
        """The settings when the config turns the profiler on, else None."""
        section = ds.get("flops_profiler")
        if not isinstance(section, Mapping) or section.get("enabled") is not True:
            return None
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in section.items() if k in fields and v != "auto"})


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """What the profiled step measured, besides the flops: seconds per phase and on the store."""

    fwd_seconds: float
    bwd_seconds: float
    step_seconds: float
    io_wait_seconds: float
    world_size: int
    micro_batch: Optional[int]
    samples: Optional[int]


class FlopsProfile:
    """The forward flops of one profiled step, counted over each of its forwards."""

    def __init__(self, settings: FlopsProfilerSettings) -> None:
        self.settings = settings
        self._counter = FlopCounterMode(display=False, depth=None)
        self._entered = False

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the flops of the ``with`` body (a forward), adding to the step's."""
        # FlopCounterMode starts its counts afresh on each entry: keep them across the step's forwards
        saved = {name: dict(ops) for name, ops in self._counter.flop_counts.items()} if self._entered else {}
        with self._counter:
            yield
        for name, ops in saved.items():
            merged = self._counter.flop_counts[name]
            for op, count in ops.items():
                merged[op] = merged.get(op, 0) + count
        self._entered = True

    def report(self, model: nn.Module, step: int, figures: StepFigures) -> str:
        """DeepSpeed's profile summary, then the busiest modules (and, ``detailed``, torch's table)."""
        counts = {name: sum(ops.values()) for name, ops in self._counter.flop_counts.items()}
        flops = counts.get("Global", 0)
        params = sum(p.numel() for p in model.parameters())
        bwd_factor = 2 + self.settings.recompute_fwd_factor
        fwd, bwd, opt = figures.fwd_seconds, figures.bwd_seconds, figures.step_seconds
        iteration = fwd + bwd + opt
        lines = [
            "", "-------------------------- DeepSpeed Flops Profiler --------------------------",
            f"Profile Summary at step {step}:",
            LINE.format("world size: ", figures.world_size),
            LINE.format("data parallel size: ", figures.world_size),
            LINE.format("batch size per GPU: ", figures.micro_batch if figures.micro_batch is not None else "-"),
            LINE.format("params per GPU: ", _scaled(params, "")),
            LINE.format("fwd MACs per GPU: ", _scaled(flops / 2, "MACs")),
            LINE.format("fwd flops per GPU: ", _scaled(flops, "")),
            LINE.format("fwd latency: ", _duration(fwd)),
            LINE.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", _rate(flops, fwd)),
            LINE.format("bwd latency: ", _duration(bwd)),
            LINE.format(f"bwd FLOPS per GPU = {bwd_factor:g} * fwd flops per GPU / bwd latency: ",
                        _rate(bwd_factor * flops, bwd)),
            LINE.format(f"fwd+bwd FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                        _rate((bwd_factor + 1) * flops, fwd + bwd)),
            LINE.format("step latency: ", _duration(opt)),
            LINE.format("iter latency: ", _duration(iteration)),
            LINE.format(f"FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / iter latency: ",
                        _rate((bwd_factor + 1) * flops, iteration)),
        ]
        if figures.samples is not None and iteration > 0:
            lines.append(LINE.format("samples/second: ", f"{figures.samples / iteration:.2f}"))
        lines.append(LINE.format("waiting on the store (io_wait, within the latencies): ",
                                 _duration(figures.io_wait_seconds)))
        lines += self._aggregated(counts)
        if self.settings.detailed:
            lines += self._detailed(model, flops)
        lines.append(RULE)
        return "\n".join(lines)

    def _detailed(self, model: nn.Module, total: int) -> list[str]:
        """Each module's fwd flops, its share of the total and its operators', indented by depth, in
        the model's module order (the counter names them ``<model class>.<path>``)."""
        lines = ["", "------------------------------ Detailed Profile per GPU ------------------------------",
                 "fwd flops of each module (share of the total) and of its operators (torch.utils.flop_counter):"]
        root = type(model).__name__
        order = {f"{root}.{path}" if path else root: i for i, (path, _) in enumerate(model.named_modules())}
        counts = self._counter.flop_counts
        for name in sorted((n for n in counts if n != "Global"), key=lambda n: (order.get(n, len(order)), n)):
            ops, depth = counts[name], name.count(".")
            if 0 <= self.settings.module_depth < depth:
                continue
            flops = sum(ops.values())
            share = f"{100 * flops / total:.2f}%" if total else "-"
            lines.append(f"{'  ' * depth}{name}: {_scaled(flops, '')} ({share})")
            lines += [f"{'  ' * (depth + 1)}{op}: {_scaled(count, '')}" for op, count in ops.items()]
        return lines

    def _aggregated(self, counts: Mapping[str, int]) -> list[str]:
        """DeepSpeed's "Aggregated Profile": the ``top_modules`` modules with the most fwd flops at
        each depth (the model is depth 0), down to ``module_depth`` (-1: every depth)."""
        by_depth: dict[int, list[tuple[int, str]]] = {}
        for name, flops in counts.items():
            if name != "Global":
                by_depth.setdefault(name.count("."), []).append((flops, name))
        limit = self.settings.module_depth
        lines = ["", "----------------------------- Aggregated Profile per GPU -----------------------------",
                 f"Top {self.settings.top_modules} modules in terms of fwd flops at each depth:"]
        for depth in sorted(by_depth):
            if 0 <= limit < depth:
                break
            top = sorted(by_depth[depth], key=lambda item: (-item[0], item[1]))[: self.settings.top_modules]
            lines.append(f"depth {depth}:    " + ", ".join(f"{name}: {_scaled(flops, '')}" for flops, name in top))
        return lines


def _scaled(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".rstrip()


def _rate(flops: float, seconds: float) -> str:
    return _scaled(flops / seconds, "FLOPS") if seconds > 0 else "-"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


__all__ = ["FlopsProfile", "FlopsProfilerSettings", "StepFigures"]
