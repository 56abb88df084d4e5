"""Large tensors between the disk and GPU memory through the store, beside the same tensors between
the disk and host memory, alternated round by round in one process.

    python benchmarks/device_transfer.py --dir /nvme/scratch --rounds 5 --json transfer.json

A put from GPU memory copies each staged block off the GPU before its write, a get into GPU memory
copies each block up after its read (docs/architecture.md section 12); this puts a price on those
copies against the disk's own speed. Every round writes ``--size`` bytes once from each side (a put
to the nvme tier, durable when it returns) and reads them back once into each side (O_DIRECT, so
cold without dropping the page cache), in an order rotated from round to round; the table gives
the median (min-max) over rounds and the median of the GPU/host ratio within each round. Every
tensor read back is compared with what was written. ``--device cpu`` runs the same steps on a
machine without a GPU (both sides are then host memory: a check of the script, not a figure).
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
from bench_output import paired_median, print_table, rotated, scratch_dir, synchronize, with_load, write_json

import tiered

MiB = 1024 * 1024
#: (name, side the tensor lives on, operation)
CONTENDERS = (("put from GPU", "device", "put"), ("put from host", "host", "put"),
              ("get into GPU", "device", "get"), ("get into host", "host", "get"))


def run_round(store: tiered.TieredStore, sources: dict[str, torch.Tensor], order: list[tuple[str, str, str]],
              round_index: int) -> dict[str, float]:
    """Seconds for each contender in ``order``; gets read back what this round's puts wrote."""
    seconds = {}
    for name, side, op in sorted(order, key=lambda c: c[2] == "get"):  # a round's puts before its gets
        key = f"{side}-{round_index}"
        source = sources[side]
        synchronize(source.device)
        started = time.perf_counter()
        if op == "put":
            store.sync.put(key, source, "nvme")
        else:
            got = store.sync.get(key, source.device)
            synchronize(source.device)
        seconds[name] = time.perf_counter() - started
        if op == "get":
            assert torch.equal(got, source), f"{name}: the tensor read back differs from the one written"
            del got
            store.sync.delete(key)
    return seconds


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--size", type=int, default=1024 * MiB, help="bytes of the tensor moved by each contender")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cuda", help="the GPU side (default cuda; cpu checks the script)")
    p.add_argument("--json", help="write every run here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.size < 1:
        p.error(f"--rounds and --size must be >= 1, got {args.rounds} and {args.size}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("device_transfer: no CUDA device here; --device cpu runs the same steps on host memory",
              file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    generator = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (args.size,), dtype=torch.uint8, generator=generator)
    sources = {"device": host.to(device), "host": host}
    scratch = scratch_dir(args.dir, "device-transfer-")
    times: dict[str, list[float]] = {name: [] for name, _, _ in CONTENDERS}
    try:
        config = tiered.StoreConfig(path=scratch, device=str(device), host_bytes=64 * MiB, prefault_host=False)
        with tiered.TieredStore.open(config) as store:
            for r in range(args.rounds):
                for name, seconds in run_round(store, sources, rotated(CONTENDERS, r), r).items():
                    times[name].append(seconds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def rate(seconds: float) -> float:
        return args.size / seconds / 1e9

    rows, runs = [], []
    for name, side, op in CONTENDERS:
        rates = [rate(s) for s in times[name]]
        host_name = f"{op} {'from' if op == 'put' else 'into'} host"
        ratio = paired_median(rates, [rate(s) for s in times[host_name]]) if side == "device" else None
        rows.append((name, statistics.median(rates), f"{min(rates):.2f}-{max(rates):.2f}", ratio))
        runs.append({"name": name, "side": side, "op": op, "seconds": times[name], "gb_per_s": rates,
                     "ratio_to_host": ratio})
    print(f"{args.size / 1e9:.2f} GB per contender, {args.rounds} rounds, GPU side on {device}")
    print_table(["contender", "GB/s (median)", "min-max", "GPU / host (paired median)"], rows)
    result = {"size": args.size, "rounds": args.rounds, "device": str(device), "runs": runs,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__}
    write_json(with_load(result, load_before), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
