"""Ratio and throughput of the bplane-zstd codec on the six synthetic auxiliary-data tensors.

Prints a table and writes JSON. Throughput is in GB/s (1e9 bytes of the original tensor) and is
the median of ``--repeats`` runs after one warm-up run: "per core" divides by the CPU seconds the
process used with one codec thread; "wall" uses ``--threads`` codec threads and wall time.

With ``--store DIR`` it also puts and gets each tensor through a store in DIR (nvme tier,
``cpu_threads=--threads``), raw and compressed, and reports the effective GB/s of each: original
bytes over the wall time of the put (durable on return) or of the get.

The targets are ratios (stored / original bytes, the same in every run): each kind's at most its
target in ``tiered.codecs.samples.TARGETS``. Every round trip is checked bit for bit (a mismatch
raises); the script exits 1 when a ratio misses its target.

    python benchmarks/codec_bench.py --mib 64 --repeats 5 --json codec.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tiered  # noqa: E402
from tiered.codecs import ZstdCodec, measure_codec  # noqa: E402
from tiered.bench.system import machine_info  # noqa: E402
from tiered.codecs.samples import KINDS, TARGETS, entropy_floor, synthetic  # noqa: E402


def plain_zstd_ratio(tensor: torch.Tensor) -> float:
    """Ratio of the store's former codec (zstd level 1 on raw bytes, 4 MiB frames)."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8)

    async def go() -> float:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            encoded = await ZstdCodec(pool).encode(data)
        if encoded is None:
            return 1.0
        encoded.close()
        return encoded.nbytes / data.numel()

    return asyncio.run(go())


def store_rates(tensor: torch.Tensor, directory: str, threads: int, repeats: int) -> dict[str, float]:
    """Effective put and get GB/s through a store's nvme tier, raw and compressed (medians)."""
    path = os.path.join(directory, "codec-bench-store")
    shutil.rmtree(path, ignore_errors=True)
    config = tiered.StoreConfig(path=path, host_bytes=64 * 1024 * 1024, cpu_threads=threads)
    nbytes = tensor.numel() * tensor.element_size()
    out = torch.empty_like(tensor)
    rates: dict[str, float] = {}
    try:
        with tiered.TieredStore.open(config) as store:
            for compress in (False, True):
                puts, gets = [], []
                for i in range(repeats + 1):  # the first round grows the swap files and warms up
                    t0 = time.perf_counter()
                    store.sync.put("t", tensor, compress=compress)
                    t1 = time.perf_counter()
                    store.sync.get("t", out=out)
                    t2 = time.perf_counter()
                    if i:
                        puts.append(t1 - t0)
                        gets.append(t2 - t1)
                name = "compressed" if compress else "raw"
                rates[f"put_gbps_{name}"] = nbytes / statistics.median(puts) / 1e9
                rates[f"get_gbps_{name}"] = nbytes / statistics.median(gets) / 1e9
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="size of each tensor in MiB (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (default 5)")
    parser.add_argument("--threads", type=int, default=2, help="codec threads for the wall-clock rates (default 2)")
    parser.add_argument("--json", default="codec_bench.json", help="where to write the results")
    parser.add_argument("--store", metavar="DIR", help="also measure puts and gets through a store in DIR")
    args = parser.parse_args()
    machine = machine_info(args.store or ".")
    if args.repeats < 3:
        parser.error(f"--repeats must be >= 3 for a median, got {args.repeats}")

    rows = []
    for kind in KINDS:
        tensor = synthetic(kind, args.mib * 1024 * 1024)
        core = measure_codec(tensor, repeats=args.repeats, threads=1)
        wall = measure_codec(tensor, repeats=args.repeats, threads=args.threads)
        rows.append({
            "kind": kind,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "ratio": core["ratio"],
            "target": TARGETS[kind],
            "met": core["ratio"] <= TARGETS[kind],
            "entropy_floor": entropy_floor(tensor),
            "plain_zstd_ratio": plain_zstd_ratio(tensor),
            "compress_gbps_per_core": core["compress_gbps_per_core"],
            "decompress_gbps_per_core": core["decompress_gbps_per_core"],
            "compress_gbps_wall": wall["compress_gbps"],
            "decompress_gbps_wall": wall["decompress_gbps"],
            **(store_rates(tensor, args.store, args.threads, args.repeats) if args.store else {}),
        })

    header = (
        f"{'kind':<18} {'dtype':<9} {'ratio':>6} {'target':>6} {'floor':>6} {'zstd':>6} "
        f"{'comp/core':>9} {'dec/core':>9} {'comp@' + str(args.threads):>8} {'dec@' + str(args.threads):>8}"
    )
    print(f"{args.mib} MiB tensors, median of {args.repeats} runs, GB/s of original bytes")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['kind']:<18} {r['dtype']:<9} {r['ratio']:6.3f} {r['target']:6.3f} {r['entropy_floor']:6.3f} "
            f"{r['plain_zstd_ratio']:6.3f} {r['compress_gbps_per_core']:9.2f} {r['decompress_gbps_per_core']:9.2f} "
            f"{r['compress_gbps_wall']:8.2f} {r['decompress_gbps_wall']:8.2f}"
        )
    if args.store:
        print(f"\nthrough a store in {args.store}: effective GB/s of original bytes, raw -> compressed")
        for r in rows:
            print(
                f"{r['kind']:<18} put {r['put_gbps_raw']:5.2f} -> {r['put_gbps_compressed']:5.2f}   "
                f"get {r['get_gbps_raw']:5.2f} -> {r['get_gbps_compressed']:5.2f}"
            )
    result = {
        "mib": args.mib,
        "repeats": args.repeats,
        "threads": args.threads,
        "machine": {**machine, "loadavg_after": list(os.getloadavg())},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rows": rows,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    missed = [r["kind"] for r in rows if not r["met"]]
    if missed:
        print(f"ERROR: ratio above its target for {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
