"""``tiered bench`` / ``python -m tiered.bench``: argument parsing and output."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch

from tiered.bench.options import PHASES, TOOLS, BenchOptions, parse_size, parse_sizes, quick_overrides
from tiered.bench.plot import write_plot
from tiered.bench.report import table, write_json
from tiered.bench.runner import run_bench
from tiered.cli import make_work_directory, remove_made_directories
from tiered.config import StoreConfig


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:  # argparse shows only ArgumentTypeError's message
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else _size(text)


def _sizes(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser(prog: str = "tiered bench") -> argparse.ArgumentParser:
    """The command line of the benchmark."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Measure the tiered store's write, cold read, small-tensor and prefetch performance through "
        "its public API, side by side with fio, torch.save/load and DeepSpeed's aio handle, in one directory.",
    )
    p.add_argument("--dir", default=".", help="directory on the disk to measure (a scratch folder is made and "
                   "removed in it; default: the current directory)")
    p.add_argument("--size", type=_size, default=None, help="bytes of large tensors per run (default 2GiB; "
                   "--quick: 256MiB)")
    p.add_argument("--tensor-sizes", type=_sizes, default=None, help="large tensor sizes, comma-separated, "
                   "used in turn (default 256MiB; --quick: 128MiB)")
    p.add_argument("--small-sizes", type=_sizes, default=None, help="small tensor sizes mixed in the "
                   "small-tensor phase (default 4KiB,16KiB,64KiB,256KiB,1MiB)")
    p.add_argument("--small-count", type=int, default=None, help="small tensors per run (default 2000)")
    p.add_argument("--concurrency", type=int, default=64, help="small-tensor operations in flight (default 64)")
    p.add_argument("--block-size", type=_size, default=StoreConfig.block_size, help="store block size "
                   "(default %(default)s bytes)")
    p.add_argument("--queue-depth", type=int, default=StoreConfig.queue_depth, help="store queue depth "
                   "(default %(default)s)")
    p.add_argument("--io-threads", type=int, default=StoreConfig.io_threads, help="store I/O threads "
                   "(default %(default)s)")
    p.add_argument("--coalesce-bytes", type=_size_or_zero, default=StoreConfig.coalesce_bytes, help="store "
                   "coalesce_bytes (default %(default)s; 0 runs every small transfer alone)")
    compression = p.add_mutually_exclusive_group()
    compression.add_argument(
        "--compress", action="store_true", help="run the compressed phases (ratio and effective GB/s; the default)"
    )
    compression.add_argument("--no-compress", action="store_true", help="leave out the compressed phases")
    p.add_argument("--no-checksum", action="store_true", help="run the store without its CRC-32 per block "
                   "(StoreConfig.checksum=False), to price the check against a run without this option")
    p.add_argument("--repeats", type=int, default=None, help="runs per figure, >= 3 (default 5, --quick 3); "
                   "targets are judged only from >= 5")
    p.add_argument("--fio-size", type=_size, default=None, help="bytes each setting of fio's sweep moves "
                   "(default 512MiB; --quick: 128MiB)")
    p.add_argument("--fio-block-sizes", type=_sizes, default=None, help="fio's sweep: block sizes (default "
                   "1MiB,4MiB,8MiB,16MiB; --quick: 1MiB,8MiB)")
    p.add_argument("--fio-queue-depths", type=_ints, default=None, help="fio's sweep: queue depths (default "
                   "4,16,64,128; --quick: 16,64)")
    p.add_argument("--fio-jobs", type=_ints, default=None, help="fio's sweep: job counts (default 1,4)")
    p.add_argument("--fio-cache", default="", metavar="PATH", help="where a run sweeping fio's full grid keeps its "
                   "best settings for this disk, which --quick runs then use instead of their short grid (default "
                   "~/.cache/tiered/fio-best.json; 'none': neither read nor write it)")
    p.add_argument("--device", default=None, help="also time puts from and gets into this device's memory "
                   "(e.g. cuda) beside host memory; cpu checks the phase on a machine without a GPU")
    p.add_argument("--prefetch-count", type=int, default=None, help="tensors in the prefetch phase (default 16)")
    p.add_argument("--prefetch-size", type=_size, default=None, help="their size (default 64MiB)")
    p.add_argument("--compute-ms", type=float, default=None, help="fixed compute delay between gets (default 40)")
    p.add_argument("--sweep", action="store_true", help="also tune block size x queue depth x io threads and "
                   "print the best setting as a StoreConfig snippet")
    p.add_argument("--sweep-size", type=_size, default=None, help="bytes per sweep setting (default 512MiB)")
    p.add_argument("--sweep-block-sizes", type=_sizes, default=None, help="block sizes to sweep (default "
                   "1MiB,4MiB,8MiB,16MiB)")
    p.add_argument("--sweep-queue-depths", type=_ints, default=None, help="queue depths to sweep (default "
                   f"{','.join(map(str, BenchOptions.sweep_queue_depths))})")
    p.add_argument("--sweep-io-threads", type=_ints, default=None, help="io thread counts to sweep (default "
                   f"{','.join(map(str, BenchOptions.sweep_io_threads))})")
    p.add_argument("--quick", action="store_true", help="a short run (about a minute): 256 MiB, 128 small "
                   "tensors, 3 runs per figure, every phase and contender; fio at the best settings a full run "
                   "kept for this disk (--fio-cache), else its short grid, which is not the disk's limit; quote "
                   "figures from a full run")
    p.add_argument("--skip", default="", help=f"contenders to leave out, comma-separated: {', '.join(TOOLS)}")
    p.add_argument("--only", default="", help=f"phases to run, comma-separated: {', '.join(PHASES)}, sweep "
                   "(default: all but sweep)")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before reads (needs root)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write every run as JSON to PATH")
    p.add_argument("--plot", dest="plot_path", metavar="PATH", help="write a PNG plot to PATH (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return p


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """BenchOptions from parsed arguments; --quick sets defaults that explicit options override."""
    fields: dict = quick_overrides() if args.quick else {}
    explicit = {
        "total_bytes": args.size, "tensor_sizes": tuple(args.tensor_sizes) if args.tensor_sizes else None,
        "small_sizes": tuple(args.small_sizes) if args.small_sizes else None, "small_count": args.small_count,
        "prefetch_count": args.prefetch_count, "prefetch_bytes": args.prefetch_size,
        "compute_seconds": None if args.compute_ms is None else args.compute_ms / 1000.0,
        "sweep_bytes": args.sweep_size,
        "sweep_block_sizes": tuple(args.sweep_block_sizes) if args.sweep_block_sizes else None,
        "sweep_queue_depths": tuple(args.sweep_queue_depths) if args.sweep_queue_depths else None,
        "sweep_io_threads": tuple(args.sweep_io_threads) if args.sweep_io_threads else None,
        "repeats": args.repeats, "fio_sweep_bytes": args.fio_size,
        "fio_block_sizes": tuple(args.fio_block_sizes) if args.fio_block_sizes else None,
        "fio_queue_depths": tuple(args.fio_queue_depths) if args.fio_queue_depths else None,
        "fio_jobs": tuple(args.fio_jobs) if args.fio_jobs else None,
    }
    fields.update({k: v for k, v in explicit.items() if v is not None})
    skip = tuple(s.strip() for s in args.skip.split(",") if s.strip())
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    if only:
        fields["only"] = only
    return BenchOptions(
        directory=args.dir, block_size=args.block_size, queue_depth=args.queue_depth, io_threads=args.io_threads,
        coalesce_bytes=args.coalesce_bytes, checksum=not args.no_checksum,
        small_concurrency=args.concurrency, compress=not args.no_compress, sweep=args.sweep, device=args.device,
        drop_caches=args.drop_caches, skip=skip, json_path=args.json_path, plot_path=args.plot_path,
        fio_cache=args.fio_cache,
        quiet=args.quiet, quick=args.quick, seed=args.seed, **fields,
    )


def main(argv: Optional[Sequence[str]] = None, prog: str = "tiered bench") -> int:
    """Run the benchmark; print the table; write JSON and plot when asked. Returns the exit status."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if options.device is not None and torch.device(options.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {options.device}: CUDA is not available on this machine")
    try:
        made = make_work_directory(options.directory)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_bench(options)
    finally:
        remove_made_directories(made)
    if options.plot_path:
        why = write_plot(result, options.plot_path)
        result.notes.append(why or f"plot written to {options.plot_path}")
    if options.json_path:
        write_json(result, options.json_path)
    print(table(result))
    failed = [f.name for f in result.figures if f.verified is False]
    if failed:
        print(f"ERROR: data did not round-trip in: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
