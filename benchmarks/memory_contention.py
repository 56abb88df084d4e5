"""What other work on the machine costs the disk: the same O_DIRECT writes and reads, alone and beside
a thread that computes in its own cache or that streams memory, alternated round by round.

    python benchmarks/memory_contention.py --dir /nvme/scratch --rounds 5 --json contention.json

Each round moves ``--size`` bytes as tensors of ``--tensor-size``, one after another, every block of
a tensor in flight on ``--threads`` Python threads (``os.pwritev``/``os.preadv`` on one preallocated
file; each tensor's writes end with an ``fdatasync``, as a durable put does), under each load:

- ``alone``: nothing else running;
- ``cpu``: one thread computing CRC-32s of a buffer that stays in its core's cache (CPU, no memory
  traffic);
- ``memory``: one thread computing CRC-32s over a buffer far larger than the caches (each byte read
  from memory once, as a checksum of the transferred tensors reads it);
- ``checksum``: no other thread, but each block's CRC-32 computed by its I/O thread (before its
  write, after its read), as the store does.

On a physical NVMe drive the disk moves bytes by DMA and the loads cost little. On a virtual disk the
hypervisor copies them through the same memory the guest uses, so a memory-bound load can slow the
disk where a CPU-bound one does not: then any pass over the transferred bytes (a checksum, a staging
copy) costs disk throughput, wherever it runs. The figures say which kind of machine this is.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from typing import Callable, Optional

from bench_output import add_alternation_arguments, paired_median, print_table, rotated, scratch_dir, write_json

from tiered.io.crc import CRC32_UPDATE

MiB = 1024 * 1024
LOADS = ("alone", "cpu", "memory", "checksum")
#: The cpu load's buffer: above the size below which a CRC call keeps the GIL (so the load never holds
#: it), well inside one core's L2 cache.
CPU_BUFFER = 512 * 1024


class Background:
    """A thread computing CRC-32s of ``buffer`` until stopped; counts the bytes it read."""

    def __init__(self, buffer: memoryview, piece: int) -> None:
        self._buffer = buffer
        self._piece = piece
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="tiered-load", daemon=True)
        self.bytes = 0
        self.seconds = 0.0

    def _work(self) -> None:
        start = time.perf_counter()
        while not self._stop.is_set():
            for at in range(0, len(self._buffer), self._piece):
                CRC32_UPDATE(0, self._buffer[at:at + self._piece])
                self.bytes += min(self._piece, len(self._buffer) - at)
        self.seconds = time.perf_counter() - start

    def __enter__(self) -> "Background":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Transfers:
    """One preallocated O_DIRECT file holding ``nbytes``, moved tensor by tensor from and to ``memory``."""

    def __init__(self, path: str, memory: memoryview, tensor: int, block: int, pool: concurrent.futures.Executor):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, len(memory))
        self.memory = memory
        self.tensor = tensor
        self.block = block
        self.pool = pool

    def run(self, write: bool, checksum: bool = False) -> float:
        """Seconds to write (each tensor then ``fdatasync``ed) or read every tensor, one after another."""
        def one(at: int) -> None:
            view = self.memory[at:at + self.block]
            if checksum and write:
                CRC32_UPDATE(0, view)
            done = os.pwritev(self.fd, [view], at) if write else os.preadv(self.fd, [view], at)
            if done != len(view):
                raise OSError(f"short {'write' if write else 'read'}: {done} of {len(view)} bytes at {at}")
            if checksum and not write:
                CRC32_UPDATE(0, view)

        start = time.perf_counter()
        for first in range(0, len(self.memory), self.tensor):
            list(self.pool.map(one, range(first, first + self.tensor, self.block)))
            if write:
                os.fdatasync(self.fd)
        return time.perf_counter() - start

    def close(self) -> None:
        os.close(self.fd)


def filled(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """Anonymous memory of ``nbytes``, every page written (no zero pages shared by the kernel)."""
    region = mmap.mmap(-1, nbytes)
    seed = os.urandom(MiB)
    for at in range(0, nbytes, MiB):
        region[at:at + MiB] = seed[: min(MiB, nbytes - at)]
    return region, memoryview(region)


def add_transfer_arguments(p: argparse.ArgumentParser, *, size_help: str, rounds: int) -> None:
    """The options of a script moving tensors through :class:`Transfers`: the alternation's and ``--threads``."""
    add_alternation_arguments(p, size_help=size_help, rounds=rounds)
    p.add_argument("--threads", type=int, default=32, help="I/O threads (every block of a tensor in flight)")


def check_transfer_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A parser error for options :func:`add_transfer_arguments` added that cannot work together."""
    if args.rounds < 1 or args.threads < 1:
        p.error(f"--rounds and --threads must be >= 1, got {args.rounds} and {args.threads}")
    if args.block_size % 4096 or args.tensor_size % args.block_size:
        p.error(f"--block-size must be a multiple of 4096 dividing --tensor-size, got {args.block_size} "
                f"and {args.tensor_size}")
    if args.size < args.tensor_size:
        p.error(f"--size {args.size} holds no whole tensor of --tensor-size {args.tensor_size}")


def run(args: argparse.Namespace) -> dict:
    nbytes = args.size - args.size % args.tensor_size
    workdir = scratch_dir(args.dir, "tiered-contention-")
    regions = [filled(n) for n in (nbytes, CPU_BUFFER, args.stream_size)]
    (_, memory), (_, hot), (_, cold) = regions
    loads: dict[str, Callable[[], Optional[Background]]] = {
        "alone": lambda: None,
        "cpu": lambda: Background(hot, CPU_BUFFER),
        "memory": lambda: Background(cold, 8 * MiB),
        "checksum": lambda: None,
    }
    names = [name for name in LOADS if name in args.loads]
    runs: dict[str, dict[str, list[float]]] = {op: {name: [] for name in names} for op in ("write", "read")}
    load_rates: dict[str, list[float]] = {name: [] for name in names}
    pool = concurrent.futures.ThreadPoolExecutor(args.threads)
    transfers = Transfers(os.path.join(workdir, "data.bin"), memory, args.tensor_size, args.block_size, pool)
    try:
        transfers.run(write=True)  # allocate every block: timed writes are overwrites
        for r in range(args.rounds):
            for op in ("write", "read"):
                for name in rotated(names, r):
                    background = loads[name]()
                    if background is None:
                        seconds = transfers.run(op == "write", checksum=name == "checksum")
                    else:
                        with background:
                            seconds = transfers.run(op == "write")
                        load_rates[name].append(background.bytes / max(background.seconds, 1e-9) / 1e9)
                    runs[op][name].append(nbytes / seconds / 1e9)
            print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        transfers.close()
        pool.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
        for region, view in regions:
            view.release()
            region.close()

    rows = []
    table = []
    for op, group in runs.items():
        alone = group.get("alone")
        for name, values in group.items():
            paired = paired_median(values, alone) if name != "alone" else None
            rate = statistics.median(load_rates[name]) if load_rates[name] else None
            rows.append({"op": op, "load": name, "runs": values, "median": statistics.median(values),
                         "min": min(values), "max": max(values), "paired_to_alone": paired,
                         "load_gb_per_s": rate})
            table.append([op, name, statistics.median(values), min(values), max(values), paired, rate])
    print(f"\n{nbytes / 2**30:.2f} GiB as {nbytes // args.tensor_size} x {args.tensor_size // MiB} MiB, "
          f"{args.block_size // MiB} MiB blocks, {args.threads} threads, O_DIRECT, {args.rounds} rounds; "
          f"memory load over {args.stream_size // MiB} MiB")
    print_table(["op", "load", "median GB/s", "min", "max", "paired / alone", "load's own GB/s"], table)
    return {"bytes": nbytes, "tensor_size": args.tensor_size, "block_size": args.block_size, "threads": args.threads,
            "rounds": args.rounds, "stream_size": args.stream_size, "loadavg": os.getloadavg(), "rows": rows}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_transfer_arguments(p, size_help="bytes moved per load per round", rounds=5)
    p.add_argument("--stream-size", type=int, default=1024 * MiB,
                   help="bytes the memory load streams over (far above the caches)")
    p.add_argument("--loads", type=lambda s: s.split(","), default=list(LOADS),
                   help=f"loads to run, comma-separated (default {','.join(LOADS)})")
    args = p.parse_args(argv)
    check_transfer_arguments(p, args)
    unknown = [name for name in args.loads if name not in LOADS]
    if unknown or "alone" not in args.loads:
        p.error(f"--loads takes {', '.join(LOADS)} and must include alone, got {','.join(args.loads)}")
    if args.stream_size < 8 * MiB:
        p.error(f"--stream-size must be at least 8 MiB, got {args.stream_size}")
    write_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
