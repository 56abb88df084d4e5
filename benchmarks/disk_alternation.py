"""Large-tensor writes and cold reads, alternated round by round in one process: the store's
aligned puts and gets, plain Python threads issuing the same O_DIRECT syscalls, fio and
DeepSpeed's aio handle on its page-locked tensors, both on the store's own swap file (at the ranges
holding the same tensors, ``TieredStore.nvme_layout``) and on files of its own.

    python benchmarks/disk_alternation.py --dir /nvme/scratch --rounds 7 --json alt.json

Each round runs every contender once, in an order rotated from round to round, so the disk's drift
hits all of them alike; the table gives the median (min-max) over rounds and, per contender, the
median over rounds of its ratio to fio and to DeepSpeed *within the same round* (paired ratios).
The Python-thread rows are the floor the store's I/O layer builds on: ``--threads`` threads of
``os.pwritev``/``os.preadv`` of ``--block-size`` blocks on one preallocated O_DIRECT file,
one ``fdatasync`` at the end; "one reused buffer" (``--reused``) writes every block from a single
buffer of fio's size (block size x queue depth), as fio does; "memory faulted by a copy"
(``--faulted``) uses the same bytes in page-aligned memory that was not populated at allocation
but faulted in page by page by the copy that filled it (what ``tiered.empty_aligned`` did before
it populated its pages); "+ CRC-32" (``--crc``) is the plain rows' threads, memory and file
computing the store's checksum of every block, which puts a price on it. Every contender uses
O_DIRECT, so reads are cold without dropping the page cache.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import functools
import mmap
import os
import shutil
import statistics
import sys
import time
from typing import Callable, Optional

import torch
from bench_output import paired_median, print_table, rotated, scratch_dir, write_json

import tiered
from tiered.bench.deepspeed_aio import DeepSpeedAio, load_aio
from tiered.bench.fio import Fio, fio_status
from tiered.bench.results import Run
from tiered.bench.store import LargeTensors, StoreUnderTest
from tiered.bench.tensors import TensorFactory, same
from tiered.io.aligned import anonymous_map
from tiered.io.crc import crc32

MiB = 1024 * 1024


class RawThreads:
    """``threads`` Python threads of O_DIRECT ``pwritev``/``preadv`` over one preallocated file."""

    def __init__(self, directory: str, tensors: list[torch.Tensor], *, block_size: int, threads: int,
                 reused_bytes: int = 0) -> None:
        self.block_size = block_size
        self.crc = False
        self.views = [memoryview(t.view(-1).view(torch.uint8).numpy()) for t in tensors]
        self.nbytes = sum(len(v) for v in self.views)
        self.path = os.path.join(directory, "raw.dat")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        os.posix_fallocate(self.fd, 0, self.nbytes)
        self.reused = mmap.mmap(-1, reused_bytes) if reused_bytes else None
        self.pool = concurrent.futures.ThreadPoolExecutor(threads)
        self.blocks = [(i, off) for i, v in enumerate(self.views) for off in range(0, len(v), block_size)]
        self.starts = [sum(len(v) for v in self.views[:i]) for i in range(len(self.views))]

    def checksummed(self) -> "RawThreads":
        """The same threads, memory and file, computing a CRC-32 of every block as the store does
        (before a write, after a read); close only the original."""
        other = copy.copy(self)
        other.crc = True
        return other

    def _memory(self, index: int, off: int, n: int) -> memoryview:
        if self.reused is None:
            return self.views[index][off : off + n]
        slot = (self.starts[index] + off) % len(self.reused)
        return memoryview(self.reused)[slot : slot + n]

    def _one(self, write: bool, index: int, off: int) -> None:
        n = min(self.block_size, len(self.views[index]) - off)
        mem, at = self._memory(index, off, n), self.starts[index] + off
        if self.crc and write:
            crc32([mem], n)
        done = os.pwritev(self.fd, [mem], at) if write else os.preadv(self.fd, [mem], at)
        if done != n:
            raise OSError(f"short {'write' if write else 'read'}: {done} of {n} bytes at {at} of {self.path}")
        if self.crc and not write:
            crc32([mem], n)

    def write(self) -> float:
        start = time.perf_counter()
        list(self.pool.map(lambda b: self._one(True, *b), self.blocks))
        os.fdatasync(self.fd)
        return self.nbytes / (time.perf_counter() - start) / 1e9

    def read(self) -> float:
        start = time.perf_counter()
        list(self.pool.map(lambda b: self._one(False, *b), self.blocks))
        return self.nbytes / (time.perf_counter() - start) / 1e9

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


def run(args: argparse.Namespace) -> dict:
    workdir = scratch_dir(args.dir, "tiered-alternation-")
    n = max(1, args.size // args.tensor_size)
    factory = TensorFactory()
    tensors = [factory.make(args.tensor_size) for _ in range(n)]
    aligned = []
    for t in tensors:
        a = tiered.empty_aligned(t.shape, t.dtype)
        a.copy_(t)
        aligned.append(a)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    closers: list[Callable[[], None]] = []
    writers: dict[str, Callable[[], float]] = {}
    readers: dict[str, Callable[[], float]] = {}
    try:
        sut = StoreUnderTest(tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=0, device_bytes=0,
                                                block_size=args.block_size, queue_depth=args.queue_depth,
                                                io_threads=args.threads, swap_files_per_dir=args.swap_files))
        closers.append(sut.close)
        store = LargeTensors(sut, aligned)
        outs = [tiered.empty_aligned(t.shape, t.dtype) for t in tensors]

        def checked(read: Callable[[list[torch.Tensor]], Run]) -> Callable[[], float]:
            def go() -> float:
                for o in outs:
                    o.zero_()
                r = read(outs)
                if not all(same(a, b) for a, b in zip(outs, tensors)):
                    raise RuntimeError("a store read returned other bytes than were written")
                return r.value
            return go

        writers["store, sequential puts"] = lambda: store.write().value
        writers["store, puts in flight"] = lambda: store.write_concurrently().value
        readers["store, sequential gets"] = checked(lambda o: store.read(into=o))
        readers["store, gets in flight"] = checked(store.read_concurrently)
        raw = RawThreads(os.path.join(workdir), aligned, block_size=args.block_size, threads=args.threads)
        closers.append(raw.close)
        writers["python threads"] = raw.write
        readers["python threads"] = raw.read
        if args.crc:
            checked_raw = raw.checksummed()
            writers["python threads + CRC-32"] = checked_raw.write
            readers["python threads + CRC-32"] = checked_raw.read
        if args.faulted:
            faulted = []
            for t in tensors:
                region = anonymous_map(t.numel() * t.element_size(), populate=False)
                f = torch.frombuffer(region, dtype=t.dtype, count=t.numel())
                f.copy_(t)
                faulted.append(f)
            os.makedirs(os.path.join(workdir, "faulted"))
            by_copy = RawThreads(os.path.join(workdir, "faulted"), faulted, block_size=args.block_size,
                                 threads=args.threads)
            closers.append(by_copy.close)
            writers["python threads, memory faulted by a copy"] = by_copy.write
            readers["python threads, memory faulted by a copy"] = by_copy.read
        if args.reused:
            os.makedirs(os.path.join(workdir, "reused"))
            reused = RawThreads(os.path.join(workdir, "reused"), aligned, block_size=args.block_size,
                                threads=args.threads, reused_bytes=args.block_size * 32)
            closers.append(reused.close)
            writers["python threads, one reused buffer"] = reused.write
        if fio_status().present:
            fio_dir = os.path.join(workdir, "fio")
            os.makedirs(fio_dir)
            fio = Fio(fio_dir, nbytes, args.block_size, args.queue_depth)
            closers.append(fio.close)
            writers["fio"] = lambda: fio.write().value
            readers["fio"] = lambda: fio.read().value
        module, status = load_aio()
        if module is not None:
            ds = DeepSpeedAio(module, os.path.join(workdir, "ds"), tensors, block_size=args.block_size,
                              queue_depth=args.queue_depth, threads=min(args.threads, 4), locked=True)
            closers.append(ds.close)
            in_store = functools.partial(sut.placements, store.keys)
            writers["deepspeed, locked"] = lambda: ds.write(in_store()).value
            readers["deepspeed, locked"] = lambda: ds.read(in_store()).value
            writers["deepspeed, locked, own files"] = lambda: ds.write(ds.own_files()).value
            readers["deepspeed, locked, own files"] = lambda: ds.read(ds.own_files()).value
        else:
            print(f"deepspeed: {status.note}", file=sys.stderr)
        runs: dict[str, dict[str, list[float]]] = {"write": {k: [] for k in writers}, "read": {k: [] for k in readers}}
        for r in range(args.rounds):
            for name in rotated(list(writers), r):
                runs["write"][name].append(writers[name]())
            for name in rotated(list(readers), r):
                runs["read"][name].append(readers[name]())
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                f"{op} {name} {values[-1]:.2f}" for op, group in runs.items() for name, values in group.items()
                if name.startswith("store")), file=sys.stderr)
    finally:
        for close in reversed(closers):
            close()
        shutil.rmtree(workdir, ignore_errors=True)

    rows = []
    for op, group in runs.items():
        for name, values in group.items():
            rows.append({"op": op, "contender": name, "runs": values, "median": statistics.median(values),
                         "min": min(values), "max": max(values),
                         "paired_ratio_to_fio": paired_median(values, group.get("fio")),
                         "paired_ratio_to_deepspeed": paired_median(values, group.get("deepspeed, locked"))})
    print(f"\n{nbytes / 2**30:.2f} GiB as {n} x {args.tensor_size // MiB} MiB bf16, {args.rounds} rounds, "
          f"{args.block_size // MiB} MiB blocks, queue depth {args.queue_depth}, {args.threads} threads, O_DIRECT")
    print_table(["op", "contender", "median GB/s", "min", "max", "paired / fio", "paired / deepspeed"],
                [[r["op"], r["contender"], r["median"], r["min"], r["max"], r["paired_ratio_to_fio"],
                  r["paired_ratio_to_deepspeed"]] for r in rows])
    return {"bytes": nbytes, "tensors": n, "rounds": args.rounds, "block_size": args.block_size,
            "queue_depth": args.queue_depth, "threads": args.threads,
            "loadavg": os.getloadavg(), "rows": rows}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--size", type=int, default=1024 * MiB, help="bytes per contender per round")
    p.add_argument("--tensor-size", type=int, default=256 * MiB)
    p.add_argument("--block-size", type=int, default=8 * MiB)
    p.add_argument("--queue-depth", type=int, default=tiered.StoreConfig.queue_depth)
    p.add_argument("--threads", type=int, default=tiered.StoreConfig.io_threads,
                   help="the store's io_threads and the Python-thread rows' threads")
    p.add_argument("--swap-files", type=int, default=tiered.StoreConfig.swap_files_per_dir,
                   help="the store's swap files (StoreConfig.swap_files_per_dir)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--crc", action="store_true", help="add Python threads computing the store's CRC-32 of every "
                                                      "block, on the same file as the plain Python-thread rows")
    p.add_argument("--reused", action="store_true", help="add Python threads writing from one reused buffer")
    p.add_argument("--faulted", action="store_true", help="add Python threads on memory faulted in by a copy")
    p.add_argument("--json", help="write every run here")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error(f"--rounds must be >= 3, got {args.rounds}")
    write_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
