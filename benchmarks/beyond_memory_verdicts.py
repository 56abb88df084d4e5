"""The beyond-memory benchmark's targets and verdicts: the engine's steps judged per kind (the clip
norm bound or not), against the floors, and beside DeepSpeed.

Bytes a parameter a steady step moves over the disk, by design (docs/training.md, "Updates inside
backward"), which the targets are:

- updates inside backward, no clipping: parameters read in forward, masters and moments read in
  backward, parameters, masters and moments written: 28 (fp32: 16 read, 12 written; bf16: 14 and 14);
- with clipping, where the norm does not bind, each final gradient is kept for a possible redo:
  fp32 +4 written (32), bf16 +2 (30);
- the step after backward (where the norm binds): parameters read in forward and in backward, fp32
  gradients written and read back, masters and moments read, parameters, masters and moments
  written: fp32 4+4+4+4+12 read, 4+12 written = 40; bf16 2+2+4+4+12 read, 4+2+12 written = 38.
"""

from __future__ import annotations

import json
import statistics
from typing import Any, Optional, Sequence

from bench_output import verdict

MiB = 1 << 20
#: Targets for the steps after the first.
TARGET_FOOTPRINT = 1.1
TARGET_FLOOR_RATIO = 1.15
#: Peak RSS growth allowed over the budget: 1.1 x host_bytes + this (torch's and Python's own growth).
RSS_ALLOWANCE = 256 * MiB
#: The engine's default beside DeepSpeed: its step at most this fraction of DeepSpeed's ...
TARGET_STEP_VS_DEEPSPEED = 0.67
#: ... at most this fraction of DeepSpeed's peak RSS.
TARGET_RSS_VS_DEEPSPEED = 0.25
#: Bytes of training state a parameter, by dtype: fp32 parameter (its own master), gradient, two moments;
#: bf16 parameter, fp32 master, fp32 gradient, two fp32 moments.
STATE_BYTES_PER_PARAM = {"float32": 16, "bfloat16": 18}
#: The step after backward's bytes a parameter, by dtype (the module's docstring).
AFTER_BACKWARD_BYTES = {"float32": 40, "bfloat16": 38}
#: The manifest's commit records (SQLite rows and their write-ahead log, about 0.006 bytes a parameter a
#: step) add a little to the bytes written, and so to the bytes moved, beyond the tensors'.
RECORDS_ALLOWANCE = 0.1


def moved_target(dtype: str, clipping: bool) -> float:
    """Bytes moved a parameter on a step whose norm does not bind (no clipping: every step): the design's
    tensor bytes, and the commit records."""
    if not clipping:
        return 28 + RECORDS_ALLOWANCE
    return (32 if dtype == "float32" else 30) + RECORDS_ALLOWANCE


def written_target(dtype: str, clipping: bool) -> Optional[float]:
    """Bytes written a parameter on such a step, judged without clipping only (None: not judged)."""
    if clipping:
        return None
    return (12 if dtype == "float32" else 14) + RECORDS_ALLOWANCE


def after_backward_reference(dtype: str, path: Optional[str]) -> dict[str, Any]:
    """What the step after backward moves a parameter: the median over the steady steps of a run's
    JSON at ``path`` (a ``--step-in-backward false`` run of this benchmark, same model and dtype),
    else the design's figure. ``{"bytes_per_param", "source"}``.

    Raises:
        ValueError: the JSON at ``path`` is not such a run.
    """
    if path is None:
        return {"bytes_per_param": AFTER_BACKWARD_BYTES[dtype],
                "source": f"the design: {AFTER_BACKWARD_BYTES[dtype]} B/param in {dtype} (beyond_memory_verdicts)"}
    with open(path) as f:
        run = json.load(f)
    if run.get("step_in_backward") != "false" or run.get("dtype", "float32") != dtype:
        raise ValueError(f"{path} is not a --step-in-backward false run in {dtype} of this benchmark")
    steps = [s for r in run["engine"]["runs"] for s in r["steps"][1:]]
    return {"bytes_per_param": statistics.median(s["bytes_per_param"] for s in steps),
            "source": f"measured: the median of {len(steps)} steps of {path}"}


def steady(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps after the first of every run that trained."""
    return [s for r in runs for s in r.get("steps", [])[1:]]


def maybe_verdict(name: str, values: Sequence[float], target: Optional[float], *, at_most: bool = True
                  ) -> Optional[dict[str, Any]]:
    """A verdict, or None (said in one line) where there is no value or no target."""
    if target is None:
        return None
    if not values:
        print(f"verdict: {name}: no such steps, not judged")
        return {"name": name, "target": target, "at_most": at_most, "values": [], "runs": 0, "met": None}
    return verdict(name, values, target, at_most=at_most)


def summarize_engine(runs: Sequence[dict[str, Any]], floors: dict[str, float], state_bytes: int, host_bytes: int,
                     dtype: str, max_grad_norm: Optional[float], reference: dict[str, Any],
                     estimated_disk: int) -> dict[str, Any]:
    """Each target judged from the steps after the first of every run: median, range, whether met.
    The bytes per kind of step: where the clip norm did not bind (or there is no clipping), and where
    it bound (against the step after backward's bytes, ``reference``); the nvme footprint against what
    ``engine.estimate_memory`` told the run to have free (``estimated_disk``)."""
    steps = steady(runs)
    clipping = max_grad_norm is not None
    free = [s for s in steps if not s["clip_bound"]]
    bound = [s for s in steps if s["clip_bound"]]
    compute = counted_compute_floor(runs, floors["compute_s"])
    floor = [max(s["io_floor_s"], compute) for s in steps]
    print(f"steps after the first: {len(free)} where the clip norm did not bind"
          + (" (or no clipping)" if not clipping else "") + f", {len(bound)} where it bound")
    for s in bound:
        print(f"  binding: round {s['round']} step {s['step']}: grad norm {s['grad_norm']:.4g} > {max_grad_norm:g}, "
              f"{s['mode']}, {s['bytes_per_param']:.1f} B/param ({s['written_per_param']:.1f} written)")
    kind = "steps where the clip norm did not bind" if clipping else "steps"
    verdicts = [
        maybe_verdict(f"bytes moved per parameter, {kind}", [s["bytes_per_param"] for s in free],
                      moved_target(dtype, clipping)),
        maybe_verdict(f"bytes written per parameter, {kind}", [s["written_per_param"] for s in free],
                      written_target(dtype, clipping)),
        maybe_verdict("bytes moved per parameter, steps where the clip norm bound (target: the step after "
                      f"backward's, {reference['source']})", [s["bytes_per_param"] for s in bound],
                      reference["bytes_per_param"]) if clipping else None,
        maybe_verdict("nvme footprint / engine.estimate_memory's figure for a step",
                      [s["peak_disk_bytes"] / estimated_disk for s in steps], TARGET_FOOTPRINT),
        maybe_verdict("step / max(I/O floor, compute floor)", [s["seconds"] / f for s, f in zip(steps, floor)],
                      TARGET_FLOOR_RATIO),
        maybe_verdict("peak RSS growth / (1.1 x host_bytes + 256 MiB)",
                      [s["peak_rss_growth"] / (1.1 * host_bytes + RSS_ALLOWANCE) for s in steps], 1.0),
    ]
    modes: dict[str, int] = {}
    for s in steps:
        modes[s["mode"]] = modes.get(s["mode"], 0) + 1
    return {
        "state_bytes": state_bytes, "steps_by_mode": modes, "reference_after_backward": reference,
        "estimated_disk_bytes": estimated_disk, "compute_floor_counted": compute > 0,
        "footprint_per_state": [s["peak_disk_bytes"] / state_bytes for s in steps],
        "binding_steps": [{k: s[k] for k in ("round", "step", "grad_norm", "mode", "bytes_per_param",
                                              "written_per_param", "seconds")} for s in bound],
        "verdicts": [v for v in verdicts if v is not None],
    }


def counted_compute_floor(runs: Sequence[dict[str, Any]], compute_s: float) -> float:
    """The compute floor the steps are held against: ``compute_s``, or 0 where it is above the fastest
    step the engine took. That step did the same compute and its I/O besides, so such a figure is
    not a floor: the in-memory step ran slower than the engine's compute (torch's AdamW makes eight
    passes over memory where the engine's makes one, engine/optim/adamw_kernel.py), or the 2-layer
    copy's steps met a slow spell of the machine and their difference to the 1-layer copy's was
    multiplied by the layers beyond the first. The steps are then held against the I/O floor alone,
    as printed."""
    fastest = min((s["seconds"] for run in runs for s in run.get("steps", [])), default=float("inf"))
    if compute_s <= fastest:
        return compute_s
    print(f"compute floor {compute_s:.1f} s is above the engine's fastest step ({fastest:.1f} s), which did that "
          f"compute and its I/O: not counted, the steps are held against the I/O floor alone")
    return 0.0


def median_steady(run: dict[str, Any], key: str) -> Optional[float]:
    """The median of ``key`` over a run's steps after the first (None without such steps)."""
    values = [s[key] for s in run.get("steps", [])[1:]]
    return statistics.median(values) if values else None


def compare_with_deepspeed(engine_runs: Sequence[dict[str, Any]], ds_runs: Sequence[dict[str, Any]]
                           ) -> dict[str, Any]:
    """The engine beside DeepSpeed round by round (each round's ratio of median steady steps, and of
    whole-process peak RSS), judged over the rounds both finished."""
    pairs = [(e, d) for e, d in zip(engine_runs, ds_runs)
             if e["failure"] is None and d["failure"] is None and len(e["steps"]) > 1 and len(d["steps"]) > 1]
    out: dict[str, Any] = {"rounds_compared": len(pairs),
                           "deepspeed_failures": [d["failure"] for d in ds_runs if d["failure"] is not None]}
    if not pairs:
        print("beside DeepSpeed: no round where both finished, not compared")
        return out
    out["step_ratio"] = [median_steady(e, "seconds") / median_steady(d, "seconds") for e, d in pairs]
    out["rss_ratio"] = [e["peak_rss"] / d["peak_rss"] for e, d in pairs]
    out["bytes_ratio"] = [median_steady(e, "bytes_per_param") / median_steady(d, "bytes_per_param") for e, d in pairs]
    out["verdicts"] = [
        verdict("engine step / DeepSpeed step (medians of each round's steps after the first)", out["step_ratio"],
                TARGET_STEP_VS_DEEPSPEED, at_most=True),
        verdict("engine peak RSS / DeepSpeed peak RSS (whole processes)", out["rss_ratio"], TARGET_RSS_VS_DEEPSPEED,
                at_most=True),
    ]
    return out
