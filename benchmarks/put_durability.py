"""What a durable put pays for: its data's flush, and then its manifest record's flush.

    python benchmarks/put_durability.py --dir /nvme/scratch --rounds 5 --json durability.json

Sequential puts of page-aligned tensors into one store directory (so every variant writes the same,
already allocated extents), three variants alternated round by round:

- ``durable``: the store's default; a put returns once its data is ``fdatasync``ed and its record
  is committed to the manifest and flushed.
- ``data flushed only``: ``durable=False`` plus an ``fdatasync`` of the swap files after each put,
  which is what a writer without a manifest (DeepSpeed's aio handle, one tensor at a time) does.
- ``no flush``: ``durable=False`` alone.

The gap between the first two is the manifest's flush; docs/benchmarks.md explains why its order
after the data's cannot be relaxed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from typing import Optional

import torch

import tiered
from bench_output import (
    add_alternation_arguments, paired_median, print_table, rotated, scratch_dir, with_load, write_json,
)

MiB = 1 << 20
VARIANTS = ("durable", "data flushed only", "no flush")


def aligned_tensors(size: int, tensor_size: int) -> list[torch.Tensor]:
    """Page-aligned float32 tensors of ``tensor_size`` bytes (the store writes them in place), ``size`` in all."""
    out = []
    for i in range(max(1, size // tensor_size)):
        t = tiered.empty_aligned((tensor_size // 4,), torch.float32)
        t.normal_(generator=torch.Generator().manual_seed(i))
        out.append(t)
    return out


def timed_puts(path: str, tensors: list[torch.Tensor], variant: str, block_size: int) -> float:
    """GB/s of one pass of sequential puts under ``variant``."""
    cfg = tiered.StoreConfig(path=path, host_bytes=0, block_size=block_size, durable=variant == "durable")
    with tiered.TieredStore.open(cfg) as store:
        files = sorted({e.path for i in range(len(tensors)) if f"t{i}" in store for e in store.nvme_layout(f"t{i}")})
        fds = [os.open(f, os.O_RDONLY) for f in files]
        try:
            start = time.perf_counter()
            for i, t in enumerate(tensors):
                store.sync.put(f"t{i}", t, tier="nvme")
                if variant == "data flushed only":
                    for fd in fds:
                        os.fdatasync(fd)
            seconds = time.perf_counter() - start
        finally:
            for fd in fds:
                os.close(fd)
    return sum(t.numel() * t.element_size() for t in tensors) / seconds / 1e9


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()
    tensors = aligned_tensors(args.size, args.tensor_size)
    workdir = scratch_dir(args.dir, "tiered-durability-")
    path = os.path.join(workdir, "store")
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        timed_puts(path, tensors, "durable", args.block_size)  # allocates the extents every variant rewrites
        for r in range(args.rounds):
            for variant in rotated(VARIANTS, r):
                runs[variant].append(timed_puts(path, tensors, variant, args.block_size))
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"{v} {runs[v][-1]:.2f}" for v in VARIANTS),
                  file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = [{"variant": v, "runs": runs[v], "median": statistics.median(runs[v]), "min": min(runs[v]),
             "max": max(runs[v]), "paired_to_durable": paired_median(runs[v], runs["durable"])} for v in VARIANTS]
    print(f"\n{len(tensors)} x {args.tensor_size // MiB} MiB aligned tensors put one after another, "
          f"{args.rounds} rounds; GB/s")
    print_table(["variant", "median GB/s", "min", "max", "paired / durable"],
                [(r["variant"], r["median"], r["min"], r["max"], r["paired_to_durable"]) for r in rows])
    return with_load({"size": args.size, "tensor_size": args.tensor_size, "rounds": args.rounds, "rows": rows},
                     load_before)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_alternation_arguments(p, size_help="bytes put per variant per round", rounds=5)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.tensor_size % 4096 or args.tensor_size <= 0:
        p.error(f"--rounds must be >= 1 and --tensor-size a positive multiple of 4096, got {args.rounds} and "
                f"{args.tensor_size}")
    write_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
