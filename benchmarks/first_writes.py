"""Whether the disk writes blocks it never held before more slowly than blocks it did: the first write
into a newly preallocated file, then overwrites of the same blocks.

    python benchmarks/first_writes.py --dir /nvme/scratch --rounds 3 --json first_writes.json

Each round preallocates a new file (``posix_fallocate``: ext4 hands it blocks marked unwritten) and
writes it three ways, tensor after tensor with every block of a tensor in flight and an
``fdatasync`` per tensor, as durable puts do:

- ``first write``: into the newly allocated blocks;
- ``overwrite``: the same blocks again;
- ``after zero range``: the same blocks once ``FALLOC_FL_ZERO_RANGE`` has marked them unwritten
  again, so the filesystem converts its extents as on a first write while the disk's blocks are the
  ones it has just written.

A first write much slower than the third row is the disk's doing, not the filesystem's: a
thin-provisioned virtual disk allocates its backing store on a block's first write. Blocks freed by
a deleted file may come back to a new file already written, so the first row can vary by round.
Where it is slow, a store's swap space is slow the first time it is used: the store grows its swap
files as data arrives, so a first pass writes fresh blocks, later passes rewrite them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import errno
import os
import shutil
import statistics
import sys
from typing import Optional

from bench_output import paired_median, print_table, scratch_dir, write_json
from memory_contention import Transfers, add_transfer_arguments, check_transfer_arguments, filled

MiB = 1024 * 1024
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_ZERO_RANGE = 0x10
ROWS = ("first write", "overwrite", "after zero range")


def zero_range(fd: int, nbytes: int) -> Optional[str]:
    """Mark ``[0, nbytes)`` of the file unwritten (zeroes) in place; the reason when the filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, 0, nbytes) == 0:
        return None
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return f"FALLOC_FL_ZERO_RANGE is not supported here ({os.strerror(err)})"
    raise OSError(err, f"fallocate(FALLOC_FL_ZERO_RANGE) failed: {os.strerror(err)}")


def run(args: argparse.Namespace) -> dict:
    nbytes = args.size - args.size % args.tensor_size
    workdir = scratch_dir(args.dir, "tiered-first-writes-")
    region, memory = filled(nbytes)
    runs: dict[str, list[float]] = {name: [] for name in ROWS}
    note = None
    pool = concurrent.futures.ThreadPoolExecutor(args.threads)
    try:
        for r in range(args.rounds):
            path = os.path.join(workdir, f"round-{r}.bin")
            transfers = Transfers(path, memory, args.tensor_size, args.block_size, pool)
            try:
                for name in ROWS:
                    if name == "after zero range":
                        note = zero_range(transfers.fd, nbytes)
                        if note is not None:
                            continue
                        os.fsync(transfers.fd)
                    runs[name].append(nbytes / transfers.run(write=True) / 1e9)
            finally:
                transfers.close()
                os.unlink(path)
            print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        pool.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
        memory.release()
        region.close()

    rows = []
    table = []
    for name, values in runs.items():
        if not values:
            continue
        paired = paired_median(values, runs["overwrite"]) if name != "overwrite" else None
        rows.append({"write": name, "runs": values, "median": statistics.median(values), "min": min(values),
                     "max": max(values), "paired_to_overwrite": paired})
        table.append([name, statistics.median(values), min(values), max(values), paired])
    print(f"\n{nbytes / 2**30:.2f} GiB as {nbytes // args.tensor_size} x {args.tensor_size // MiB} MiB per write, "
          f"{args.block_size // MiB} MiB blocks, {args.threads} threads, O_DIRECT, a new file each of "
          f"{args.rounds} rounds")
    print_table(["write", "median GB/s", "min", "max", "paired / overwrite"], table)
    if note:
        print(note)
    return {"bytes": nbytes, "tensor_size": args.tensor_size, "block_size": args.block_size, "threads": args.threads,
            "rounds": args.rounds, "note": note, "loadavg": os.getloadavg(), "rows": rows}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_transfer_arguments(p, size_help="bytes per file (one file per round)", rounds=3)
    args = p.parse_args(argv)
    check_transfer_arguments(p, args)
    write_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
