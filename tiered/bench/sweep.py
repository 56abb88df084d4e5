"""--sweep: block size x queue depth x io threads, each setting measured on the same tensors; the
best one is printed as a StoreConfig snippet."""

from __future__ import annotations

import itertools
import math
from typing import Any

from tiered.bench.options import format_size
from tiered.bench.phases import Context
from tiered.bench.results import GBPS, Figure
from tiered.bench.store import LargeTensors, StoreUnderTest
from tiered.config import KiB, MiB


def sweep_phase(ctx: Context) -> None:
    """Measure every setting of the grid (write and cold read, median of the repeats) and record the
    best by the geometric mean of write and read GB/s.

    Repeats are the outer loop and the grid order rotates between them, so a disk whose speed
    drifts during the sweep slows every setting alike instead of whichever came last. All settings
    reopen one store directory, so each writes into the same, already allocated swap files.
    """
    opts = ctx.options
    per = min(256 * MiB, opts.sweep_bytes)
    tensors = ctx.factory.make_all([per] * max(opts.sweep_bytes // per, 1))
    grid = list(itertools.product(opts.sweep_block_sizes, opts.sweep_queue_depths, opts.sweep_io_threads))
    phase = f"sweep ({format_size(opts.sweep_bytes)})"
    figures: dict[tuple[int, int, int], tuple[Figure, Figure]] = {}
    for block, depth, threads in grid:
        setting = f"bs={format_size(block)} qd={depth} threads={threads}"
        figures[(block, depth, threads)] = (Figure(phase, "store", f"write {setting}", GBPS),
                                            Figure(phase, "store", f"read {setting}", GBPS))
    with ctx.progress("sweep", len(grid) * opts.repeats) as bar:
        for rep in range(opts.repeats):
            shift = rep * len(grid) // opts.repeats
            for key in grid[shift:] + grid[:shift]:
                block, depth, threads = key
                write, read = figures[key]
                sut = StoreUnderTest(ctx.store_config("store-sweep", block_size=block, queue_depth=depth,
                                                      io_threads=threads), keep=True)
                try:
                    large = LargeTensors(sut, tensors)
                    write.runs.append(large.write())
                    ctx.cold()
                    read.runs.append(large.read())
                finally:
                    sut.close()
                bar.advance()
    StoreUnderTest.remove(ctx.store_config("store-sweep"))
    rows: list[dict[str, Any]] = []
    for (block, depth, threads), (write, read) in figures.items():
        ctx.result.figures += [write, read]
        rows.append({"block_size": block, "queue_depth": depth, "io_threads": threads,
                     "write_gbps": write.median, "read_gbps": read.median,
                     "score": math.sqrt(write.median * read.median)})
    best = max(rows, key=lambda r: r["score"])
    ctx.result.sweep = {"grid": rows, "best": best, "snippet": config_snippet(best, checksum=ctx.options.checksum)}


def config_snippet(best: dict[str, Any], *, checksum: bool = True) -> str:
    """The best setting as Python for a StoreConfig (with ``checksum=False`` when it was measured so)."""
    return (
        "from tiered import StoreConfig\n"
        "from tiered.config import KiB, MiB\n\n"
        f"config = StoreConfig(\n"
        f"    path=...,\n"
        f"    block_size={_size_expr(best['block_size'])},\n"
        f"    queue_depth={best['queue_depth']},\n"
        f"    io_threads={best['io_threads']},\n"
        + ("" if checksum else "    checksum=False,\n")
        + f")  # write {best['write_gbps']:.2f} GB/s, cold read {best['read_gbps']:.2f} GB/s"
    )


def _size_expr(n: int) -> str:
    return f"{n // MiB} * MiB" if n % MiB == 0 else f"{n // KiB} * KiB" if n % KiB == 0 else str(n)
