"""What a benchmark run produces: runs, figures (median, min, max of runs), tool notes, targets."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Optional

#: Values of BenchResult.fio_reference: what the fio figures are. Only the first two are the disk's limit.
FULL_SWEEP, CACHED_SWEEP, SHORT_SWEEP = "full sweep", "best settings of a kept full sweep", "short grid"
GBPS = "GB/s"
OPS = "ops/s"
SECONDS = "s"


@dataclasses.dataclass
class Run:
    """One timed repetition. ``value`` is in its figure's unit; ``verified`` says whether every tensor
    read back equalled what was written (None where the run reads nothing back)."""

    value: float
    seconds: float
    nbytes: int = 0
    ops: int = 0
    verified: Optional[bool] = None
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Figure:
    """One measured quantity: every run of it and their median, min and max."""

    phase: str
    tool: str
    op: str
    unit: str
    runs: list[Run] = dataclasses.field(default_factory=list)
    note: str = ""
    #: Figures of the same phase and op are compared with the fio figure of that op.
    ratio_to_fio: Optional[float] = None

    @property
    def name(self) -> str:
        """``"<phase> / <tool> <op>"``, unique within a result."""
        return f"{self.phase} / {self.tool} {self.op}"

    def values(self) -> list[float]:
        """Each run's value."""
        return [r.value for r in self.runs]

    @property
    def median(self) -> float:
        """Median of the runs' values (NaN without runs)."""
        return statistics.median(self.values()) if self.runs else float("nan")

    @property
    def min(self) -> float:
        """Smallest run value."""
        return min(self.values()) if self.runs else float("nan")

    @property
    def max(self) -> float:
        """Largest run value."""
        return max(self.values()) if self.runs else float("nan")

    @property
    def verified(self) -> Optional[bool]:
        """True when every run that checks its data did so successfully; None when none checks."""
        flags = [r.verified for r in self.runs if r.verified is not None]
        return all(flags) if flags else None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form with every run."""
        return {
            "name": self.name, "phase": self.phase, "tool": self.tool, "op": self.op, "unit": self.unit,
            "median": self.median, "min": self.min, "max": self.max, "ratio_to_fio": self.ratio_to_fio,
            "verified": self.verified, "note": self.note, "runs": [dataclasses.asdict(r) for r in self.runs],
        }


@dataclasses.dataclass
class ToolStatus:
    """Whether a contender took part, its version, and why not when it did not."""

    name: str
    present: bool
    skipped: bool = False
    version: str = ""
    note: str = ""


@dataclasses.dataclass
class Target:
    """One target of docs/benchmarks.md judged from this run's figures: ``measured`` is the median of
    the runs' values (``low``-``high`` their range, ``runs`` their count)."""

    name: str
    wanted: str
    measured: Optional[float]
    met: Optional[bool]  # None: a figure it needs was not measured, or too few runs to judge
    note: str = ""
    low: Optional[float] = None
    high: Optional[float] = None
    runs: int = 0


@dataclasses.dataclass
class BenchResult:
    """Everything one run of the benchmark measured."""

    options: dict[str, Any]
    machine: dict[str, Any]
    tools: dict[str, ToolStatus] = dataclasses.field(default_factory=dict)
    figures: list[Figure] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    sweep: Optional[dict[str, Any]] = None
    #: fio's sweep (tiered.bench.fio_sweep.fio_best's details) when fio ran, or the kept full sweep
    #: whose settings it ran at (``{"cached": ..., "cache": path}``).
    fio_sweep: Optional[dict[str, Any]] = None
    #: How fio's settings were found: FULL_SWEEP, CACHED_SWEEP (both the disk's limit) or SHORT_SWEEP
    #: (not its limit: the store is not judged against it); "" when fio did not run.
    fio_reference: str = ""
    targets: list[Target] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def figure(self, phase: str, tool: str, op: str) -> Optional[Figure]:
        """The figure of ``tool``'s ``op`` in ``phase``, if measured."""
        return next((f for f in self.figures if (f.phase, f.tool, f.op) == (phase, tool, op)), None)

    def add(self, figure: Figure) -> Figure:
        """Append ``figure``, or return the existing one with the same name so runs accumulate."""
        found = self.figure(figure.phase, figure.tool, figure.op)
        if found is not None:
            return found
        self.figures.append(figure)
        return figure

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "format": 1,
            "seconds": self.seconds,
            "phase_seconds": dict(self.phase_seconds),
            "options": self.options,
            "machine": self.machine,
            "tools": {k: dataclasses.asdict(v) for k, v in self.tools.items()},
            "phases": sorted({f.phase for f in self.figures}),
            "figures": [f.as_dict() for f in self.figures],
            "notes": list(self.notes),
            "sweep": self.sweep,
            "fio_sweep": self.fio_sweep,
            "fio_reference": self.fio_reference,
            "targets": [dataclasses.asdict(t) for t in self.targets],
        }
