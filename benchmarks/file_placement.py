"""How much where a file lands on the disk changes its O_DIRECT speed: the same writes and reads, from
the same memory and the same threads, on several files created one after another, alternated round
by round in one process.

    python benchmarks/file_placement.py --dir /nvme/scratch --rounds 7 --json placement.json

Each layout is a set of preallocated files holding ``--size`` bytes (``--files`` per set: one file,
or one per tensor as ZeRO-Infinity lays them out); every set is written once before the clock
starts, so every timed write overwrites allocated blocks. The order rotates each round, so a disk
whose speed drifts slows every set alike. On a physical NVMe drive the sets should tie; on a
virtual disk they need not, and then any benchmark whose contenders keep files of their own
compares file placement as much as I/O engines (why ``tiered bench`` has DeepSpeed write the
store's own swap file).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import shutil
import statistics
import sys
import time
from typing import Optional

from bench_output import print_table, rotated, scratch_dir, write_json

MiB = 1024 * 1024


class FileSet:
    """``files`` preallocated O_DIRECT files holding ``nbytes`` together, cut into ``block`` transfers."""

    def __init__(self, directory: str, name: str, nbytes: int, files: int, block: int) -> None:
        per_file = nbytes // files
        self.fds = []
        for i in range(files):
            fd = os.open(os.path.join(directory, f"{name}.{i}"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            os.posix_fallocate(fd, 0, per_file)
            self.fds.append(fd)
        # (fd, file offset, memory offset) per block, in the order of the bytes.
        self.blocks = [(self.fds[pos // per_file], pos % per_file, pos) for pos in range(0, nbytes, block)]
        self.block = block

    def run(self, pool: concurrent.futures.Executor, memory: memoryview, write: bool) -> float:
        """Seconds to write (then fdatasync every file) or read every block."""
        def one(job: tuple[int, int, int]) -> None:
            fd, offset, at = job
            view = memory[at:at + self.block]
            done = os.pwritev(fd, [view], offset) if write else os.preadv(fd, [view], offset)
            if done != self.block:
                raise OSError(f"short {'write' if write else 'read'}: {done} of {self.block} bytes at {offset}")

        start = time.perf_counter()
        list(pool.map(one, self.blocks))
        if write:
            for fd in self.fds:
                os.fdatasync(fd)
        return time.perf_counter() - start

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def run(args: argparse.Namespace) -> dict:
    nbytes = args.size - args.size % (args.block_size * max(args.files))
    if nbytes <= 0:
        raise SystemExit(f"--size {args.size} holds no whole block per file")
    memory = mmap.mmap(-1, nbytes)
    seed = os.urandom(MiB)
    for at in range(0, nbytes, MiB):
        memory[at:at + MiB] = seed[: min(MiB, nbytes - at)]
    view = memoryview(memory)
    workdir = scratch_dir(args.dir, "tiered-placement-")
    sets: dict[str, FileSet] = {}
    runs: dict[str, dict[str, list[float]]] = {"write": {}, "read": {}}
    pool = concurrent.futures.ThreadPoolExecutor(args.threads)
    try:
        for files in args.files:
            for copy in range(args.copies):
                name = f"{files} file{'s' if files > 1 else ''}, set {chr(ord('A') + copy)}"
                sets[name] = FileSet(workdir, f"f{files}-{copy}", nbytes, files, args.block_size)
        for s in sets.values():
            s.run(pool, view, write=True)  # allocate every block: timed writes are overwrites
        names = list(sets)
        for op in runs:
            runs[op] = {name: [] for name in names}
        for r in range(args.rounds):
            for op in ("write", "read"):
                for name in rotated(names, r):
                    runs[op][name].append(nbytes / sets[name].run(pool, view, write=op == "write") / 1e9)
            print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        pool.shutdown()
        for s in sets.values():
            s.close()
        shutil.rmtree(workdir, ignore_errors=True)
        view.release()
        memory.close()

    rows = []
    table = []
    for op, group in runs.items():
        slowest = min(statistics.median(v) for v in group.values())
        for name, values in group.items():
            median = statistics.median(values)
            rows.append({"op": op, "set": name, "runs": values, "median": median, "min": min(values),
                         "max": max(values)})
            table.append([op, name, median, min(values), max(values), median / slowest])
    print(f"\n{nbytes / 2**30:.2f} GiB per set, {args.block_size // MiB} MiB blocks, {args.threads} threads, O_DIRECT, "
          f"{args.rounds} rounds")
    print_table(["op", "file set", "median GB/s", "min", "max", "median / slowest set's"], table)
    return {"bytes": nbytes, "block_size": args.block_size, "threads": args.threads, "rounds": args.rounds,
            "loadavg": os.getloadavg(), "rows": rows}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--size", type=int, default=2048 * MiB, help="bytes per file set")
    p.add_argument("--files", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8],
                   help="files per set, comma-separated (default 1,8)")
    p.add_argument("--copies", type=int, default=2, help="sets of each file count, created one after another")
    p.add_argument("--block-size", type=int, default=8 * MiB)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", help="write every run here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.copies < 1 or min(args.files) < 1 or args.threads < 1:
        p.error("--rounds, --copies, --files and --threads must be >= 1")
    if args.block_size % 4096:
        p.error(f"--block-size must be a multiple of 4096, got {args.block_size}")
    write_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
