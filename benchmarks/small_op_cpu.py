"""Where a small operation's CPU goes: CPU time per op of each thread of the process, puts and gets apart.

    python benchmarks/small_op_cpu.py --dir /nvme/scratch --rounds 5 --json small_cpu.json

The bench's small rows as one process sees them: ``--count`` tensors of ``--tensor-size`` bytes
put to nvme (durable), then got back, with ``--concurrency`` calls in flight from one caller loop
(one worker coroutine per slot, as ``tiered bench`` does). Each thread's CPU time is read from
``/proc/self/task`` around each half and grouped by thread name: the store's loop, its I/O
threads, its manifest thread and the caller. ``cores busy`` is all threads' CPU over wall time;
on a machine with more cores than that, the threads wait on each other (the GIL, the disk, or
wakeups), not on a core.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

import torch

import tiered
from bench_output import print_table, with_load, write_json

KiB = 1 << 10
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


def measured(run: Callable[[], None]) -> tuple[float, dict[str, float]]:
    """Run ``run``; return its wall seconds and the CPU seconds each thread group spent meanwhile."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    before = thread_cpu_seconds()
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    after = thread_cpu_seconds()
    names.update({t.native_id: t.name for t in threading.enumerate()})
    cpu: dict[str, float] = collections.Counter()
    for tid, (comm, seconds) in after.items():
        cpu[thread_group(names.get(tid, comm))] += seconds - before.get(tid, (comm, 0.0))[1]
    return wall, dict(cpu)


def one_round(loop: asyncio.AbstractEventLoop, store: tiered.TieredStore, tensors: list[torch.Tensor],
              concurrency: int) -> dict[str, dict]:
    """Put every tensor, then get every one back, calling from ``loop``; per phase wall seconds and
    CPU seconds per thread group."""
    keys = [f"small/{i:06d}" for i in range(len(tensors))]
    got: list[Optional[torch.Tensor]] = [None] * len(tensors)

    async def bounded(call: Callable[[int], "asyncio.Future"]) -> None:
        todo = iter(range(len(tensors)))

        async def worker() -> None:
            for i in todo:
                await call(i)
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(tensors)))))

    async def get(i: int) -> None:
        got[i] = await store.get(keys[i])

    calls = {"put": lambda i: store.put(keys[i], tensors[i], tier="nvme"), "get": get}
    out = {}
    for phase in PHASES:
        wall, cpu = measured(lambda: loop.run_until_complete(bounded(calls[phase])))
        out[phase] = {"seconds": wall, "cpu_seconds": cpu}
    assert all(torch.equal(a, b) for a, b in zip(got, tensors)), "a tensor came back changed"

    async def delete_all() -> None:  # not measured: the next round writes into the freed extents
        await asyncio.gather(*(store.delete(k) for k in keys))

    loop.run_until_complete(delete_all())
    return out


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()
    tensors = [torch.randn(args.tensor_size // 4, generator=torch.Generator().manual_seed(i))
               for i in range(args.count)]
    workdir = tempfile.mkdtemp(prefix="tiered-small-cpu-", dir=args.dir)
    cfg = tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=0, device_bytes=0)
    rounds = []
    loop = asyncio.new_event_loop()  # the caller's loop, as the bench's harness thread runs one
    try:
        with tiered.TieredStore.open(cfg) as store:
            one_round(loop, store, tensors, args.concurrency)  # warm-up: swap file growth, pools, caches
            for r in range(args.rounds):
                rounds.append(one_round(loop, store, tensors, args.concurrency))
                print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{p} {args.count / rounds[-1][p]['seconds']:,.0f} ops/s" for p in PHASES), file=sys.stderr)
    finally:
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
        })
    shown = [g for g in groups if any(g in r["cpu_us_per_op"] for r in rows)]
    print(f"\n{args.count} x {args.tensor_size // KiB} KiB, {args.concurrency} in flight, {args.rounds} rounds "
          f"(medians); CPU microseconds per op by thread, on {os.cpu_count()} cores")
    print_table(["phase", "ops/s", "cores busy", *shown, "all threads"],
                [(r["phase"], r["ops_per_s"], r["cores_busy"], *(r["cpu_us_per_op"].get(g, 0.0) for g in shown),
                  sum(r["cpu_us_per_op"].values())) for r in rows])
    return with_load({"count": args.count, "tensor_size": args.tensor_size, "concurrency": args.concurrency,
                      "rounds": rounds, "rows": rows, "cpus": os.cpu_count()}, load_before)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--count", type=int, default=2000, help="tensors per phase (default 2000)")
    p.add_argument("--tensor-size", type=int, default=64 * KiB, help="bytes per tensor (default 64 KiB)")
    p.add_argument("--concurrency", type=int, default=64, help="calls in flight (default 64)")
    p.add_argument("--rounds", type=int, default=5)
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
