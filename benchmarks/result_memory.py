"""Gets into new tensors: results in the store's recycled result mappings vs in torch's heap memory.

A ``get`` without ``out=`` on the CPU returns a new tensor. Results of ``tiered.spans.DIRECT_RESULT_BYTES``
and more come from the store's ``ResultPool`` (page-aligned mappings handed back when the caller
frees a result, already faulted in, and read into with O_DIRECT in place); smaller ones from
``torch.empty``. This script times gets of each ``--sizes`` from the host and nvme tiers with every
result pooled and with every result from ``torch.empty`` (the threshold moved below the smallest
size and past the largest), alternated round by round in one process, and counts minor page
faults per get: where pooling pays is where the threshold belongs.

    python benchmarks/result_memory.py --dir /nvme/scratch --rounds 5 --json result_memory.json

Each round gets every key ``--gets`` times, keeping the last three results alive (as a caller
holding a few tensors at a time would), so freed results can be reused.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from typing import Optional

import torch
from bench_output import paired_median, print_table, rotated, scratch_dir, write_json

import tiered
import tiered.spans

MiB = 1024 * 1024
POOL, HEAP = "pooled mapping", "torch.empty"


def gets(store: tiered.TieredStore, key: str, count: int) -> tuple[float, float]:
    """GB/s and minor page faults per get over ``count`` gets of ``key`` into new tensors."""
    kept: list[torch.Tensor] = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    nbytes = 0
    for _ in range(count):
        result = store.sync.get(key)
        nbytes += result.numel() * result.element_size()
        kept = (kept + [result])[-3:]
    seconds = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return nbytes / seconds / 1e9, faults / count


def run(args: argparse.Namespace) -> dict:
    default = tiered.spans.DIRECT_RESULT_BYTES
    thresholds = {POOL: 1, HEAP: max(args.sizes) * MiB + 1}
    workdir = scratch_dir(args.dir, "tiered-results-")
    rows = []
    try:
        config = tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=4 * max(args.sizes) * MiB)
        with tiered.TieredStore.open(config) as store:
            keys = []
            for size in args.sizes:
                tensor = torch.randn(size * MiB // 4)
                for tier in ("host", "nvme"):
                    key = f"{tier}-{size}"
                    store.sync.put(key, tensor, tier)
                    keys.append((key, tier, size, tensor))
            runs = {(k, name): ([], []) for k, *_ in keys for name in thresholds}
            for r in range(args.rounds):
                for name in rotated(list(thresholds), r):
                    tiered.spans.DIRECT_RESULT_BYTES = thresholds[name]
                    for key, *_ in keys:
                        gbps, faults = gets(store, key, args.gets)
                        runs[key, name][0].append(gbps)
                        runs[key, name][1].append(faults)
                print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
            for key, tier, size, tensor in keys:  # the bytes come back whichever memory holds them
                for name, threshold in thresholds.items():
                    tiered.spans.DIRECT_RESULT_BYTES = threshold
                    if not torch.equal(store.sync.get(key), tensor):
                        raise RuntimeError(f"{key}: a get with {name} returned other bytes than were put")
    finally:
        tiered.spans.DIRECT_RESULT_BYTES = default
        shutil.rmtree(workdir, ignore_errors=True)
    for key, tier, size, _ in keys:
        heap = runs[key, HEAP][0]
        for name in thresholds:
            gbps, faults = runs[key, name]
            rows.append({"tier": tier, "size_mib": size, "results": name, "gbps": gbps,
                         "median_gbps": statistics.median(gbps), "faults_per_get": statistics.median(faults),
                         "paired_to_heap": paired_median(gbps, heap)})
    print(f"\ngets into new tensors, {args.gets} per key per round, {args.rounds} rounds; paired ratios to "
          f"torch.empty results; the store pools results from {default / MiB:g} MiB (tiered.spans.DIRECT_RESULT_BYTES)")
    print_table(["tier", "MiB", "results", "median GB/s", "faults / get", "paired / torch.empty"],
                [[r["tier"], r["size_mib"], r["results"], r["median_gbps"], r["faults_per_get"], r["paired_to_heap"]]
                 for r in rows])
    return {"threshold_bytes": default, "rounds": args.rounds, "gets": args.gets, "rows": rows,
            "loadavg": os.getloadavg()}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 16],
                   help="comma list of tensor sizes in MiB (default 1,2,4,16)")
    p.add_argument("--gets", type=int, default=16, help="gets of each key per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write every run here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.gets < 1 or not args.sizes or min(args.sizes) < 1:
        p.error(f"--rounds, --gets and every size must be >= 1, got {args.rounds}, {args.gets}, {args.sizes}")
    write_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
