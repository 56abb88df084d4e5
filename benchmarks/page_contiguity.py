"""Cold reads into buffers whose pages lie differently in physical memory, alternated in one process.

    python benchmarks/page_contiguity.py --dir /nvme/scratch --rounds 5 --json contiguity.json

The question it answers: why do identical page-aligned buffers read at different speeds on the same
disk? Each O_DIRECT request is split into one segment per physically contiguous run of its
destination pages, so memory faulted in 4 KiB at a time (many threads faulting at once, or free
memory already scattered) makes more, smaller requests than memory in 2 MiB huge pages. Three kinds
of buffer of the tensors' size, each first faulted in by one read through the store:

- ``4 KiB pages, faulted by reads``: a plain anonymous mapping (what the result pool used to hand out);
- ``4 KiB pages, populated``: populated in one ``MADV_POPULATE_WRITE`` call before use (``empty_aligned``);
- ``huge pages``: ``MADV_HUGEPAGE``, faulted by reads (the result pool and staging buffers now).

(Under the kernel's ``always`` huge-page mode every kind gets huge pages: the runs column shows it.)
``--scatter BYTES`` first leaves that much free memory in 4 KiB pieces (touches it, then frees
every other page), as a long-running process's free memory can be; without it the kinds differ
only as much as free memory happens to be scattered at the time.
For each, the number of physically contiguous runs (``/proc/self/pagemap``: needs root to see frame
numbers, "-" otherwise), then rounds of cold ``get(key, out=buffer)`` of every tensor, kinds in
rotated order, the page cache dropped before each pass where permitted (O_DIRECT either way).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import time
from typing import Optional

import numpy as np
import torch
from bench_output import (
    add_alternation_arguments, paired_median, print_table, rotated, scratch_dir, with_load, write_json,
)

import tiered
from tiered.bench.system import drop_page_cache
from tiered.io.aligned import anonymous_map

MiB = 1 << 20
PAGE = 4096
KINDS = {
    "4 KiB pages, faulted by reads": {"populate": False, "huge_pages": False},
    "4 KiB pages, populated": {"populate": True, "huge_pages": False},
    "huge pages": {"populate": False, "huge_pages": True},
}


def physical_runs(tensor: torch.Tensor) -> Optional[int]:
    """How many physically contiguous runs ``tensor``'s pages lie in; None when the frame numbers
    are hidden (not root) or a page is not present."""
    address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(address // PAGE * 8)
            entries = np.frombuffer(f.read(-(-nbytes // PAGE) * 8), dtype=np.uint64)
    except OSError:
        return None
    present = (entries >> np.uint64(63)) & np.uint64(1)
    frames = (entries & np.uint64((1 << 55) - 1)).astype(np.int64)
    if not present.all() or not frames.any():
        return None
    return int((np.diff(frames) != 1).sum()) + 1


def scatter_free_memory(nbytes: int) -> mmap.mmap:
    """Touch ``nbytes`` of fresh memory, then give every other 4 KiB page back to the kernel: its free
    lists then hold those pages as isolated 4 KiB pieces, which the next small faults take first.
    The returned mapping keeps the other half; close it to free that too."""
    region = anonymous_map(nbytes, populate=True)
    for offset in range(0, len(region) - PAGE, 2 * PAGE):
        region.madvise(mmap.MADV_DONTNEED, offset, PAGE)
    return region


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()
    n = max(1, args.size // args.tensor_size)
    tensors = [torch.randn(args.tensor_size // 4, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    workdir = scratch_dir(args.dir, "tiered-contiguity-")
    holes = scatter_free_memory(args.scatter) if args.scatter else None
    buffers: dict[str, list[torch.Tensor]] = {}
    runs: dict[str, list[float]] = {kind: [] for kind in KINDS}
    pieces: dict[str, list[Optional[int]]] = {}
    try:
        with tiered.TieredStore.open(tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=0,
                                                        block_size=args.block_size)) as store:
            for i, t in enumerate(tensors):
                store.sync.put(f"t{i}", t, tier="nvme")
            for kind, how in KINDS.items():
                maps = [anonymous_map(args.tensor_size, **how) for _ in range(n)]
                buffers[kind] = [torch.frombuffer(m, dtype=torch.float32) for m in maps]
                for i, b in enumerate(buffers[kind]):  # the first read faults the pages in
                    store.sync.get(f"t{i}", out=b)
                pieces[kind] = [physical_runs(b) for b in buffers[kind]]
            for r in range(args.rounds):
                for kind in rotated(list(KINDS), r):
                    for b in buffers[kind]:
                        b.zero_()
                    drop_page_cache()
                    start = time.perf_counter()
                    for i, b in enumerate(buffers[kind]):
                        store.sync.get(f"t{i}", out=b)
                    runs[kind].append(n * args.tensor_size / (time.perf_counter() - start) / 1e9)
                    if not all(torch.equal(a, b) for a, b in zip(buffers[kind], tensors)):
                        raise RuntimeError(f"reads into {kind} returned other bytes than were written")
                print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        buffers.clear()
        if holes is not None:
            holes.close()
        shutil.rmtree(workdir, ignore_errors=True)
    ref = runs["4 KiB pages, faulted by reads"]
    rows = [{"buffer": kind, "physical_runs": pieces[kind], "runs": v, "median": statistics.median(v), "min": min(v),
             "max": max(v), "paired_to_faulted": paired_median(v, ref)} for kind, v in runs.items()]
    scattered = f", {args.scatter // MiB} MiB of free memory scattered first" if args.scatter else ""
    print(f"\n{n} x {args.tensor_size // MiB} MiB cold gets into out= buffers, {args.block_size // MiB} MiB blocks, "
          f"{args.rounds} rounds{scattered}; GB/s")

    def runs_cell(values: list[Optional[int]]) -> str:
        known = [v for v in values if v is not None]
        return f"{min(known)}-{max(known)}" if known else "-"

    print_table(["buffer", "physical runs per buffer", "median GB/s", "min", "max", "paired / faulted 4 KiB"],
                [(r["buffer"], runs_cell(r["physical_runs"]), r["median"], r["min"], r["max"], r["paired_to_faulted"])
                 for r in rows])
    return with_load({"size": n * args.tensor_size, "tensor_size": args.tensor_size, "block_size": args.block_size,
                      "rounds": args.rounds, "scatter": args.scatter, "rows": rows}, load_before)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_alternation_arguments(p, size_help="bytes read per kind of buffer per round", rounds=5)
    p.add_argument("--scatter", type=int, default=0, help="bytes of free memory to leave in 4 KiB pieces first "
                   "(0: none); more than the buffers' total, so they draw on it")
    args = p.parse_args(argv)
    sizes_ok = args.tensor_size > 0 and not args.tensor_size % PAGE and not args.block_size % PAGE
    if args.rounds < 1 or args.scatter < 0 or not sizes_ok:
        p.error(f"--rounds must be >= 1, --scatter >= 0 and --tensor-size and --block-size positive multiples of "
                f"{PAGE}; got {args.rounds}, {args.scatter}, {args.tensor_size} and {args.block_size}")
    write_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
