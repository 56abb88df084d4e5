"""BenchOptions: what one run of ``tiered bench`` measures, with sizes parsed from text."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from tiered.config import GiB, KiB, MiB, StoreConfig
from tiered.util import parse_size

#: Contenders that can be left out with --skip.
TOOLS = ("fio", "torch", "deepspeed")
#: Phases in the order they run; --only picks some (--sweep adds "sweep"; "device" runs with --device).
PHASES = ("large", "compress", "small", "prefetch", "device")

#: fio's sweep grid (fio's bs, iodepth, numjobs): 32 settings per direction, depth up to 128.
FIO_BLOCK_SIZES = (1 * MiB, 4 * MiB, 8 * MiB, 16 * MiB)
FIO_QUEUE_DEPTHS = (4, 16, 64, 128)
FIO_JOB_COUNTS = (1, 4)
#: The grid of ``--quick``: 8 settings per direction.
FIO_QUICK_BLOCK_SIZES = (1 * MiB, 8 * MiB)
FIO_QUICK_QUEUE_DEPTHS = (16, 64)
FIO_QUICK_JOB_COUNTS = (1, 4)
#: Runs a figure needs before a target is judged met or missed (fewer: reported, not judged).
VERDICT_RUNS = 5


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes."""
    return [parse_size(part) for part in text.split(",") if part.strip()]


def format_size(n: int) -> str:
    """Bytes as the shortest exact binary unit (``268435456`` -> ``"256MiB"``)."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """Every knob of a benchmark run. ``directory`` must be on the disk under test."""

    directory: str
    #: Bytes of large tensors written and read per run (>= 1 GiB for figures worth quoting).
    total_bytes: int = 2 * GiB
    #: Sizes of the large tensors, used in turn until ``total_bytes`` is reached.
    tensor_sizes: tuple[int, ...] = (256 * MiB,)
    #: Sizes mixed in the small-tensor phase; 64 KiB also runs alone (the ops/s target).
    small_sizes: tuple[int, ...] = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB)
    small_count: int = 2000
    #: Small-tensor operations in flight in the concurrent variant.
    small_concurrency: int = 64
    block_size: int = StoreConfig.block_size
    queue_depth: int = StoreConfig.queue_depth
    io_threads: int = StoreConfig.io_threads
    coalesce_bytes: int = StoreConfig.coalesce_bytes
    #: The store computes and verifies a CRC-32 per block (False: ``--no-checksum``, to price the check).
    checksum: bool = True
    #: Also measure puts with compress=True (on realistic bf16 data).
    compress: bool = True
    #: Prefetch phase: tensors, their size and the fixed compute delay between gets.
    prefetch_count: int = 16
    prefetch_bytes: int = 64 * MiB
    compute_seconds: float = 0.04
    prefetch_ahead: int = 2
    #: Runs per figure; targets are judged from >= VERDICT_RUNS of them.
    repeats: int = VERDICT_RUNS
    #: fio's sweep: bytes per setting and the grid; the best setting of each direction is the limit.
    fio_sweep_bytes: int = 512 * MiB
    fio_block_sizes: tuple[int, ...] = FIO_BLOCK_SIZES
    fio_queue_depths: tuple[int, ...] = FIO_QUEUE_DEPTHS
    fio_jobs: tuple[int, ...] = FIO_JOB_COUNTS
    #: Where full runs keep fio's best settings per disk for --quick runs (tiered.bench.fio_cache);
    #: "none" neither reads nor writes it. Default: fio_cache.default_cache_path().
    fio_cache: str = ""
    #: The device phase: puts from and gets into this device's memory beside host memory (None: no phase).
    device: Optional[str] = None
    sweep: bool = False
    sweep_block_sizes: tuple[int, ...] = (1 * MiB, 4 * MiB, 8 * MiB, 16 * MiB)
    # The grids bracket StoreConfig's defaults (queue_depth 64, io_threads 64) from both sides.
    sweep_queue_depths: tuple[int, ...] = (16, 32, 64, 128)
    sweep_io_threads: tuple[int, ...] = (16, 64, 128)
    sweep_bytes: int = 512 * MiB
    drop_caches: bool = False
    skip: tuple[str, ...] = ()
    only: tuple[str, ...] = PHASES
    json_path: Optional[str] = None
    plot_path: Optional[str] = None
    quiet: bool = False
    quick: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.repeats < 3:
            raise ValueError(f"--repeats must be >= 3 (each figure is a median of >= 3 runs), got {self.repeats}")
        for name in ("total_bytes", "small_count", "small_concurrency", "prefetch_count", "prefetch_bytes",
                     "queue_depth", "io_threads", "sweep_bytes", "prefetch_ahead", "fio_sweep_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.tensor_sizes or not self.small_sizes:
            raise ValueError("tensor and small sizes must not be empty")
        for name in ("fio_block_sizes", "fio_queue_depths", "fio_jobs"):
            values = getattr(self, name)
            if not values or min(values) <= 0:
                raise ValueError(f"{name} must be positive values, got {values!r}")
        if not self.fio_cache:
            from tiered.bench.fio_cache import default_cache_path

            object.__setattr__(self, "fio_cache", default_cache_path())
        if self.compute_seconds < 0:
            raise ValueError(f"the compute delay must be >= 0, got {self.compute_seconds}")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                raise ValueError(f"--device takes a torch device such as cuda or cpu, got {self.device!r}") from None
        unknown = set(self.skip) - set(TOOLS)
        if unknown:
            raise ValueError(f"--skip takes {', '.join(TOOLS)}; unknown: {', '.join(sorted(unknown))}")
        unknown = set(self.only) - set(PHASES) - {"sweep"}
        if "device" in self.only and self.only != PHASES and self.device is None:
            raise ValueError("--only device needs --device (e.g. --device cuda)")
        if unknown:
            raise ValueError(f"--only takes {', '.join(PHASES)}, sweep; unknown: {', '.join(sorted(unknown))}")
        StoreConfig(path=self.directory, block_size=self.block_size, queue_depth=self.queue_depth,
                    io_threads=self.io_threads, coalesce_bytes=self.coalesce_bytes)  # validates early, clearly

    def full_fio_sweep(self) -> bool:
        """Whether fio's sweep covers its full grid on at least the full size: a result worth keeping."""
        return (not self.quick and set(FIO_BLOCK_SIZES) <= set(self.fio_block_sizes)
                and set(FIO_QUEUE_DEPTHS) <= set(self.fio_queue_depths) and set(FIO_JOB_COUNTS) <= set(self.fio_jobs)
                and min(self.fio_sweep_bytes, self.total_bytes) >= BenchOptions.fio_sweep_bytes)

    def uses(self, tool: str) -> bool:
        """Whether contender ``tool`` takes part."""
        return tool not in self.skip

    def runs(self, phase: str) -> bool:
        """Whether ``phase`` runs ("compress" also needs compression on, "sweep" needs --sweep,
        "device" needs --device)."""
        if phase == "sweep":
            return self.sweep or "sweep" in self.only
        if phase == "device" and self.device is None:
            return False
        return phase in self.only and (phase != "compress" or self.compress)

    def large_sizes(self) -> list[int]:
        """The large tensors' sizes: ``tensor_sizes`` in turn, the last one cut to hit ``total_bytes``."""
        return fill(self.tensor_sizes, self.total_bytes)

    def small_mix(self) -> list[int]:
        """``small_count`` sizes cycling through ``small_sizes``."""
        return [self.small_sizes[i % len(self.small_sizes)] for i in range(self.small_count)]


def fill(sizes: Sequence[int], total: int) -> list[int]:
    """``sizes`` in turn until they add up to ``total``; the last one is cut to fit."""
    out: list[int] = []
    left = total
    i = 0
    while left > 0:
        n = min(sizes[i % len(sizes)], left)
        out.append(n)
        left -= n
        i += 1
    return out


def quick_overrides() -> dict:
    """What ``--quick`` changes: smaller sizes and counts, every phase, contender and target row kept.

    256 MiB of large tensors as 2 x 128 MiB, 128 small tensors (two batches of 64), a shorter prefetch
    phase, fio's quick grid on 128 MiB, 3 runs per figure (too few for a verdict: targets are
    reported, not judged). Quote figures from a full run.
    """
    return {"total_bytes": 256 * MiB, "tensor_sizes": (128 * MiB,), "small_count": 128, "prefetch_count": 6,
            "prefetch_bytes": 32 * MiB, "compute_seconds": 0.02, "sweep_bytes": 256 * MiB, "repeats": 3,
            "fio_sweep_bytes": 128 * MiB, "fio_block_sizes": FIO_QUICK_BLOCK_SIZES,
            "fio_queue_depths": FIO_QUICK_QUEUE_DEPTHS, "fio_jobs": FIO_QUICK_JOB_COUNTS}


def describe(sizes: Sequence[int]) -> str:
    """A short human description of a list of sizes."""
    distinct = sorted(set(sizes))
    return ",".join(format_size(s) for s in distinct)
