"""The report: a table for stdout and the JSON file with every run."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from tiered.bench.results import SHORT_SWEEP, BenchResult, Figure


def _num(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def table(result: BenchResult) -> str:
    """Every figure (median, min, max over its runs, ratio to fio), then tools, notes and targets."""
    short = result.fio_reference == SHORT_SWEEP
    header = ("contender", "op", "median", "min", "max", "unit", "vs fio*" if short else "vs fio", "ok", "note")
    lines: list[str] = []
    phases: list[str] = []
    for f in result.figures:
        if f.phase not in phases:
            phases.append(f.phase)
    for phase in phases:
        rows = [_row(f) for f in result.figures if f.phase == phase]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header[:-1])]
        lines.append("")
        lines.append(f"== {phase}")
        lines.append("  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))
                     + "  note")
        for r in rows:
            cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r[:-1], widths))]
            lines.append("  ".join(cells) + "  " + r[-1])
    if short:
        lines.append("* fio's short grid on a small file, NOT the disk's limit (see the notes)")
    lines.append("")
    lines.append("tools:")
    for t in result.tools.values():
        state = "skipped" if t.skipped else ("present" if t.present else "absent")
        lines.append(f"  {t.name}: {state} {t.version}".rstrip() + (f" - {t.note}" if t.note else ""))
    if result.notes:
        lines.append("notes:")
        lines += [f"  - {n}" for n in result.notes]
    if result.targets:
        unchecked = result.options.get("checksum") is False
        lines.append("targets (the store without its checksums, --no-checksum):" if unchecked else "targets:")
        for t in result.targets:
            mark = {True: "MET   ", False: "MISSED", None: "-     "}[t.met]
            lines.append(f"  {mark} {t.name}: wanted {t.wanted}, measured {_num(t.measured)}"
                         + (f" ({t.note})" if t.note else ""))
    if result.sweep:
        lines.append("best setting of the sweep:")
        lines += ["    " + s for s in result.sweep["snippet"].splitlines()]
    lines.append(f"total time {result.seconds:.1f} s")
    return "\n".join(lines)


def _row(f: Figure) -> list[str]:
    ok = {True: "yes", False: "NO", None: ""}[f.verified]
    ratio = "" if f.ratio_to_fio is None else f"{f.ratio_to_fio:.2f}"
    return [f.tool, f.op, _num(f.median), _num(f.min), _num(f.max), f.unit, ratio, ok, f.note]


def write_json(result: BenchResult, path: str) -> None:
    """Write the result with every run to ``path`` (atomically)."""
    data: dict[str, Any] = result.as_dict()
    tmp = f"{path}.tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str, allow_nan=True)
        f.write("\n")
    os.replace(tmp, path)
