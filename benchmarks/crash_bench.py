"""Crash consistency at length: SIGKILL a store writer ``--kills`` times and check every reopen.

Runs tests/crash_harness.py's kill loop (the CI suite runs the same loop for a few dozen kills):
each kill forks a writer that puts, overwrites, deletes, evicts, prefetches and flushes across
every tier, kills it with SIGKILL at a random moment, reopens the store and checks that every
returned put/delete holds bit-exact, that keys in flight hold their old or new value, and that
nvme space matches the manifest. The kills are split evenly over the layouts, each layout one
store directory that lives through all of its kills.

Prints a table and writes JSON (``--json``, default stdout only). Exits 1 on the first failed
check of any layout, with the evidence.

    python benchmarks/crash_bench.py --kills 1000
    python benchmarks/crash_bench.py --kills 200 --seed 7 --layouts striped --json crash.json

``--engine`` runs tests/engine_crash_harness.py instead: training processes (engine.AdamW, state on
nvme, two variants) SIGKILLed in forward, backward, step(), checkpoint saves, between steps and while
resuming; each next process resumes from the store or the latest checkpoint and every loss must
equal an uninterrupted plain-torch run's.

    python benchmarks/crash_bench.py --engine --kills 200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crash_harness  # noqa: E402  (lives in tests/, shared with the CI suite)
import engine_crash_harness  # noqa: E402


def summarize(layout: str, records: list[crash_harness.KillRecord], failure: str | None, seconds: float) -> dict:
    """One row of the table: totals and means over a layout's kills."""
    n = len(records)
    return {
        "layout": layout,
        "kills": n,
        "killed_before_open": sum(not r.opened for r in records),
        "ops_returned": sum(r.returned for r in records),
        "ops_in_flight": sum(r.in_flight for r in records),
        "in_flight_showed_new": sum(r.in_flight_new for r in records),
        "in_flight_showed_old": sum(r.in_flight_old for r in records),
        "max_swap_file_bytes": max((r.swap_file_bytes for r in records), default=0),
        "mean_writer_s": statistics.fmean(r.writer_s for r in records) if n else 0.0,
        "mean_verify_s": statistics.fmean(r.verify_s for r in records) if n else 0.0,
        "seconds": seconds,
        "failure": failure,
    }


def print_table(rows: list[dict]) -> None:
    """A fixed-width table of the per-layout summaries."""
    cols = [
        ("layout", "layout", "{}"), ("kills", "kills", "{}"), ("pre-open", "killed_before_open", "{}"),
        ("returned", "ops_returned", "{}"), ("in flight", "ops_in_flight", "{}"),
        ("new", "in_flight_showed_new", "{}"), ("old", "in_flight_showed_old", "{}"),
        ("swap MiB", "max_swap_file_bytes", "{:.2f}"), ("writer s", "mean_writer_s", "{:.3f}"),
        ("verify s", "mean_verify_s", "{:.3f}"), ("result", "failure", "{}"),
    ]
    cells = [[h for h, _, _ in cols]]
    for row in rows:
        line = []
        for _, key, fmt in cols:
            value = row[key]
            if key == "max_swap_file_bytes":
                value = value / 2**20
            if key == "failure":
                value = "ok" if value is None else "FAILED"
            line.append(fmt.format(value))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    for line in cells:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))


def summarize_engine(variant: str, records: list[engine_crash_harness.KillRecord], failure: str | None,
                     seconds: float) -> dict:
    """One row of the engine table: a variant's children, kills and what was in flight."""
    killed = [r for r in records if r.killed]
    return {
        "variant": variant,
        "kills": len(killed),
        "children": len(records),
        "chains_finished": sum(not r.killed for r in records),
        "from_store": sum(r.source == "store" for r in records),
        "from_checkpoint": sum(r.source == "checkpoint" for r in records),
        "killed_in_step": sum(r.in_flight == "step" for r in killed),
        "killed_in_save": sum(r.in_flight == "save" for r in killed),
        "killed_resuming": sum(r.in_flight == "resume" for r in killed),
        "losses_checked": sum(r.losses_checked for r in records),
        "mean_child_s": statistics.fmean(r.seconds for r in records) if records else 0.0,
        "seconds": seconds,
        "failure": failure,
    }


def print_engine_table(rows: list[dict]) -> None:
    """A fixed-width table of the per-variant engine summaries."""
    cols = [("variant", "variant"), ("kills", "kills"), ("children", "children"), ("finished", "chains_finished"),
            ("from store", "from_store"), ("from ckpt", "from_checkpoint"), ("in step", "killed_in_step"),
            ("in save", "killed_in_save"), ("resuming", "killed_resuming"), ("losses", "losses_checked"),
            ("child s", "mean_child_s"), ("result", "failure")]
    cells = [[h for h, _ in cols]]
    for row in rows:
        cells.append([("ok" if row[k] is None else "FAILED") if k == "failure" else
                      (f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k])) for _, k in cols])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    for line in cells:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))


def main_engine(kills: int, seed: int, workdir_parent: str | None, json_path: str | None) -> int:
    """The --engine mode: kill training processes ``kills`` times, split over the harness's variants."""
    ctx = engine_crash_harness.forkserver_context()
    rows, children = [], []
    with tempfile.TemporaryDirectory(prefix="crash-bench-engine-", dir=workdir_parent) as workdir:
        for n, variant in enumerate(engine_crash_harness.VARIANTS):
            share = kills // len(engine_crash_harness.VARIANTS) + (n < kills % len(engine_crash_harness.VARIANTS))
            started = time.monotonic()
            failure = None
            records: list[engine_crash_harness.KillRecord] = []
            try:
                engine_crash_harness.run_engine_chains(workdir, share, seed * 1000 + n,
                                                       variants=(variant,), ctx=ctx, on_kill=records.append)
            except engine_crash_harness.EngineCrashError as exc:
                failure = str(exc)
            rows.append(summarize_engine(variant.name, records, failure, time.monotonic() - started))
            children.extend(dataclasses.asdict(r) for r in records)
    print_engine_table(rows)
    for row in rows:
        if row["failure"]:
            print(f"\n{row['variant']}: FAILED after {row['kills']} verified kills: {row['failure']}")
    result = {
        "benchmark": "crash_bench --engine", "kills": kills, "seed": seed,
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "variants": rows, "per_child": children,
    }
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "per_child"}, indent=1))
    return 1 if any(row["failure"] for row in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=None,
                        help="total kills, split over the layouts (default 1000; with --engine 200, over the variants)")
    parser.add_argument("--engine", action="store_true", help="kill engine training processes instead of store writers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layouts", default=",".join(crash_harness.LAYOUTS),
                        help=f"comma-separated, of {', '.join(crash_harness.LAYOUTS)}")
    parser.add_argument("--max-delay", type=float, default=0.25, help="latest kill, seconds after the store opened")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed at the end)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    if args.engine:
        kills = 200 if args.kills is None else args.kills
        if kills < len(engine_crash_harness.VARIANTS):
            parser.error(f"--kills must be at least {len(engine_crash_harness.VARIANTS)} with --engine, got {kills}")
        return main_engine(kills, args.seed, args.dir, args.json)
    if args.kills is None:
        args.kills = 1000
    layouts = [name for name in args.layouts.split(",") if name]
    for name in layouts:
        if name not in crash_harness.LAYOUTS:
            parser.error(f"unknown layout {name!r}; choose from {', '.join(crash_harness.LAYOUTS)}")
    if args.kills < len(layouts):
        parser.error(f"--kills must be at least the number of layouts ({len(layouts)}), got {args.kills}")

    ctx = crash_harness.forkserver_context()
    rows, kills = [], []
    with tempfile.TemporaryDirectory(prefix="crash-bench-", dir=args.dir) as workdir:
        for n, layout in enumerate(layouts):
            share = args.kills // len(layouts) + (n < args.kills % len(layouts))
            started = time.monotonic()
            failure = None
            records: list[crash_harness.KillRecord] = []
            try:
                crash_harness.run_chain(
                    workdir, layout, share, seed=args.seed * 1000 + n, ctx=ctx, max_delay_s=args.max_delay,
                    on_kill=records.append,
                )
                crash_harness.drain_and_check_space(os.path.join(workdir, f"store-{layout}"), layout)
            except crash_harness.CrashCheckError as exc:
                failure = str(exc)
            rows.append(summarize(layout, records, failure, time.monotonic() - started))
            kills.extend(dataclasses.asdict(r) for r in records)
    print_table(rows)
    for row in rows:
        if row["failure"]:
            print(f"\n{row['layout']}: FAILED after {row['kills']} verified kills: {row['failure']}")
    result = {
        "benchmark": "crash_bench",
        "kills": args.kills,
        "seed": args.seed,
        "max_delay_s": args.max_delay,
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "layouts": rows,
        "per_kill": kills,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "per_kill"}, indent=1))
    return 1 if any(row["failure"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
