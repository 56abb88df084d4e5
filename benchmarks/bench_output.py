"""What the benchmarks share: the machine and load record, verdicts, the JSON file, a headless
pyplot, the ``--device`` a run computes on, and for the ones that alternate contenders round by
round, the rotation, paired ratios and a markdown table."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any, Optional, Sequence, TypeVar

import torch

from tiered.bench import FioError, fio_best
from tiered.bench.options import FIO_QUICK_BLOCK_SIZES, FIO_QUICK_JOB_COUNTS, FIO_QUICK_QUEUE_DEPTHS
from tiered.bench.system import machine_info  # noqa: F401  (the scripts take it from here)

T = TypeVar("T")


#: Runs a verdict needs: fewer are reported, not judged.
VERDICT_RUNS = 5


def with_machine(result: dict[str, Any], machine: dict[str, Any]) -> dict[str, Any]:
    """``result`` with the machine (``machine_info(directory)`` as the run started: cores, memory,
    CPU, the disk, kernel, versions, the load average then) and the load average before and now
    added, so a reader sees what else the machine was doing; the change is printed."""
    before = tuple(machine["loadavg"])
    after = os.getloadavg()
    result = {**result, "machine": {**machine, "loadavg_after": list(after)},
              "loadavg_before": list(before), "loadavg_after": list(after)}
    disk = machine.get("disk", {})
    print(f"machine: {machine.get('cpus')} cores, {machine.get('memory_bytes', 0) / 2**30:.1f} GiB, disk "
          f"{disk.get('model') or disk.get('device') or 'unknown'}; load average {before[0]:.1f} -> {after[0]:.1f}")
    return result


def add_fio_arguments(p: argparse.ArgumentParser) -> None:
    """``--fio-size`` (bytes each setting of fio's sweep moves; 0: no fio, no floor) and
    ``--fio-quick`` (fio's quick grid, 8 settings a direction instead of 32)."""
    p.add_argument("--fio-size", type=int, default=512 * 1024 * 1024,
                   help="bytes each setting of fio's sweep moves (default 512 MiB); 0 leaves fio, and the floor "
                        "it gives, out")
    p.add_argument("--fio-quick", action="store_true", help="fio's quick grid (block sizes 1 and 8 MiB, depths 16 "
                   "and 64, 1 and 4 jobs) instead of the full one")


def disk_limit(args: argparse.Namespace, directory: str, *, nbytes: Optional[int] = None,
               repeats: int = 3) -> Optional[dict[str, Any]]:
    """fio's best read and write bandwidth on ``directory``'s disk (``tiered.bench.fio_best`` on
    ``nbytes``, default ``--fio-size``; each direction's best setting run ``repeats`` times), as
    ``{"read_bytes_per_s", "write_bytes_per_s", "sweep"}``; None when ``--fio-size 0``, fio is
    missing or no setting fits ``nbytes`` (said on stderr). Prints the result."""
    if args.fio_size <= 0:
        return None
    grid = {} if not args.fio_quick else {"block_sizes": FIO_QUICK_BLOCK_SIZES, "queue_depths": FIO_QUICK_QUEUE_DEPTHS,
                                          "jobs": FIO_QUICK_JOB_COUNTS}
    try:
        read, write, details = fio_best(directory, nbytes=nbytes or args.fio_size, repeats=repeats, **grid)
    except (FioError, ValueError) as exc:
        print(f"no disk limit: {exc}", file=sys.stderr)
        return None
    print(f"fio at its best on this disk: read {read / 1e9:.2f} GB/s ({details['best_read']['describe']}), write "
          f"{write / 1e9:.2f} GB/s ({details['best_write']['describe']}); {len(details['grid'])} settings swept")
    return {"read_bytes_per_s": read, "write_bytes_per_s": write, "sweep": details}


def verdict(name: str, values: Sequence[float], target: float, *, at_most: bool) -> dict[str, Any]:
    """A target judged from every run: the median of ``values`` with their range, ``met`` only when
    there are >= VERDICT_RUNS of them and the median is at most (``at_most``) or at least ``target``;
    None (not judged) with fewer runs. Printed as one line."""
    if not values:
        raise ValueError(f"verdict {name!r}: no values")
    median = statistics.median(values)
    judged = len(values) >= VERDICT_RUNS
    met = (median <= target if at_most else median >= target) if judged else None
    out = {"name": name, "target": target, "at_most": at_most, "values": list(values), "runs": len(values),
           "median": median, "min": min(values), "max": max(values), "met": met}
    word = {True: "met", False: "MISSED", None: f"not judged (a verdict needs >= {VERDICT_RUNS} runs)"}[met]
    print(f"verdict: {name}: median {median:.2f} over {len(values)} runs (range {min(values):.2f}-"
          f"{max(values):.2f}), target {'<=' if at_most else '>='} {target}: {word}")
    return out


def scratch_dir(parent: str, prefix: str) -> str:
    """A new directory under ``parent`` (the ``--dir`` given, created when missing) for one run's files."""
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def write_json(result: dict[str, Any], path: Optional[str]) -> None:
    """Write ``result`` to ``path``, creating its directory (nothing when ``path`` is None)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def rotated(items: Sequence[T], k: int) -> list[T]:
    """``items`` rotated left by ``k``: round ``k`` of an alternation starts with a different contender."""
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def paired_median(values: Sequence[float], ref: Optional[Sequence[float]]) -> Optional[float]:
    """The median over rounds of ``values[i] / ref[i]`` (None without a reference): a ratio taken within
    each round, so the disk's drift between rounds cancels out."""
    if not ref:
        return None
    return statistics.median(v / r for v, r in zip(values, ref))


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A markdown table on stdout; floats with two decimals, None as "-"."""
    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(cell(v) for v in row) + " |")


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (matplotlib is an optional extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def compute_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """The ``--device`` ``name`` as a device, a GPU numbered (NCCL binds a rank to one); a parser
    error, before any work, where it asks for CUDA on a machine without it."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {name}: CUDA is not available on this machine")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the kernels queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
