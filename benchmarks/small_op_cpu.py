"""Where a small operation's CPU goes: CPU time per op of each thread of the process, puts and gets apart.

    python benchmarks/small_op_cpu.py --dir /nvme/scratch --rounds 5 --json small_cpu.json

The bench's small rows as one process sees them: ``--count`` tensors of ``--tensor-size`` bytes
put to nvme (durable), then got back, with ``--concurrency`` calls in flight from one caller loop
(one worker coroutine per slot, as ``tiered bench`` does). Each thread's CPU time is read from
``/proc/self/task`` around each half and grouped by thread name: the store's loop, its I/O
threads, its manifest thread and the caller. ``cores busy`` is all threads' CPU over wall time;
on a machine with more cores than that, the threads wait on each other (the GIL, the disk, or
wakeups), not on a core. ``gc`` is the share of wall time spent in Python's cyclic garbage
collector, which holds the GIL while it walks every tracked object (torch alone holds ~170k);
``--gc-freeze`` calls ``gc.freeze()`` once the tensors and the store exist, as an application
may (docs/tuning.md), so later collections skip everything made before.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import gc
import os
import re
import shutil
import statistics
import sys
import threading
import time
from typing import Callable, Optional, TypeVar

import torch

import tiered
from tiered.bench.store import run_in_flight
from bench_output import print_table, scratch_dir, with_load, write_json

KiB = 1 << 10
T = TypeVar("T")
PHASES = ("put", "get")


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
    """tid -> (kernel thread name, user + system CPU seconds) for every thread of this process."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_group(name: str) -> str:
    """A thread's group: its Python name without the pool index (``tiered-io_3`` -> ``tiered-io``)
    or the store directory (``tiered-store:x`` -> ``tiered-store``); the caller is ``MainThread``."""
    return re.sub(r"(_\d+|:.*)$", "", name)


class GcPauses:
    """Counts the cyclic collector's runs and the seconds they take, per generation, while entered."""

    def __init__(self) -> None:
        self.runs = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.runs[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._started

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def measured(run: Callable[[], T]) -> tuple[T, float, dict[str, float], GcPauses]:
    """Run ``run``; return its result, its wall seconds, the CPU seconds each thread group spent
    meanwhile, and the garbage collector's pauses."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    before = thread_cpu_seconds()
    start = time.perf_counter()
    with GcPauses() as pauses:
        result = run()
    wall = time.perf_counter() - start
    after = thread_cpu_seconds()
    names.update({t.native_id: t.name for t in threading.enumerate()})
    cpu: dict[str, float] = collections.Counter()
    for tid, (comm, seconds) in after.items():
        cpu[thread_group(names.get(tid, comm))] += seconds - before.get(tid, (comm, 0.0))[1]
    return result, wall, dict(cpu), pauses


def one_round(loop: asyncio.AbstractEventLoop, store: tiered.TieredStore, tensors: list[torch.Tensor],
              concurrency: int) -> dict[str, dict]:
    """Put every tensor, then get every one back, calling from ``loop``; per phase wall seconds, CPU
    seconds per thread group and the garbage collector's runs and seconds per generation."""
    keys = [f"small/{i:06d}" for i in range(len(tensors))]
    calls = {"put": [functools.partial(store.put, k, t, tier="nvme") for k, t in zip(keys, tensors)],
             "get": [functools.partial(store.get, k) for k in keys]}
    out, results = {}, {}
    for phase in PHASES:  # the bench's own in-flight harness, so the figures are the bench's
        results[phase], wall, cpu, pauses = measured(
            lambda: loop.run_until_complete(run_in_flight(calls[phase], concurrency)))
        out[phase] = {"seconds": wall, "cpu_seconds": cpu, "gc_runs": pauses.runs, "gc_seconds": pauses.seconds}
    changed = [keys[i] for i, (a, b) in enumerate(zip(results["get"], tensors)) if not torch.equal(a, b)]
    if changed:
        raise RuntimeError(f"{len(changed)} tensors came back changed, first {changed[0]!r}: the store is broken")

    async def delete_all() -> None:  # not measured: the next round writes into the freed extents
        await asyncio.gather(*(store.delete(k) for k in keys))

    loop.run_until_complete(delete_all())
    return out


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()
    tensors = [torch.randn(args.tensor_size // 4, generator=torch.Generator().manual_seed(i))
               for i in range(args.count)]
    workdir = scratch_dir(args.dir, "tiered-small-cpu-")
    cfg = tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=0, device_bytes=0)
    rounds = []
    frozen_before = gc.get_freeze_count()
    loop = asyncio.new_event_loop()  # the caller's loop, as the bench's harness thread runs one
    try:
        with tiered.TieredStore.open(cfg) as store:
            one_round(loop, store, tensors, args.concurrency)  # warm-up: swap file growth, pools, caches
            if args.gc_freeze:
                gc.collect()
                gc.freeze()
            for r in range(args.rounds):
                rounds.append(one_round(loop, store, tensors, args.concurrency))
                print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{p} {args.count / rounds[-1][p]['seconds']:,.0f} ops/s" for p in PHASES), file=sys.stderr)
    finally:
        if args.gc_freeze and not frozen_before:  # leave a freeze made before this run alone
            gc.unfreeze()
        loop.close()
        shutil.rmtree(workdir, ignore_errors=True)
    groups = sorted({g for rnd in rounds for p in PHASES for g in rnd[p]["cpu_seconds"]})
    rows = []
    for phase in PHASES:
        per_op = {g: statistics.median(rnd[phase]["cpu_seconds"].get(g, 0.0) / args.count * 1e6 for rnd in rounds)
                  for g in groups}
        rows.append({
            "phase": phase,
            "ops_per_s": statistics.median(args.count / rnd[phase]["seconds"] for rnd in rounds),
            "cores_busy": statistics.median(sum(rnd[phase]["cpu_seconds"].values()) / rnd[phase]["seconds"]
                                            for rnd in rounds),
            "cpu_us_per_op": {g: v for g, v in per_op.items() if v > 0},
            "gc_share": statistics.median(sum(rnd[phase]["gc_seconds"]) / rnd[phase]["seconds"] for rnd in rounds),
        })
    shown = [g for g in groups if any(g in r["cpu_us_per_op"] for r in rows)]
    print(f"\n{args.count} x {args.tensor_size // KiB} KiB, {args.concurrency} in flight, {args.rounds} rounds "
          f"(medians){', gc.freeze() after setup' if args.gc_freeze else ''}; CPU microseconds per op by thread, "
          f"on {os.cpu_count()} cores; gc: share of wall time in the garbage collector")
    print_table(["phase", "ops/s", "cores busy", "gc", *shown, "all threads"],
                [(r["phase"], r["ops_per_s"], r["cores_busy"], r["gc_share"],
                  *(r["cpu_us_per_op"].get(g, 0.0) for g in shown), sum(r["cpu_us_per_op"].values())) for r in rows])
    return with_load({"count": args.count, "tensor_size": args.tensor_size, "concurrency": args.concurrency,
                      "gc_freeze": args.gc_freeze, "rounds": rounds, "rows": rows, "cpus": os.cpu_count()},
                     load_before)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--count", type=int, default=2000, help="tensors per phase (default 2000)")
    p.add_argument("--tensor-size", type=int, default=64 * KiB, help="bytes per tensor (default 64 KiB)")
    p.add_argument("--concurrency", type=int, default=64, help="calls in flight (default 64)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once the tensors and the store exist")
    p.add_argument("--json", help="write every round here")
    args = p.parse_args(argv)
    for name in ("count", "concurrency", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.tensor_size < 4 or args.tensor_size % 4:
        p.error(f"--tensor-size must be a positive multiple of 4 bytes (float32), got {args.tensor_size}")
    write_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
