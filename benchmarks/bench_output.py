"""What the benchmarks share: the load-average record, the JSON file, a headless pyplot, the
``--device`` a run computes on, and for the ones that alternate contenders round by round, the
rotation, paired ratios and a markdown table."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from typing import Any, Optional, Sequence, TypeVar

import torch

T = TypeVar("T")


def with_load(result: dict[str, Any], load_before: tuple[float, float, float]) -> dict[str, Any]:
    """``result`` with the load average before and now added (the machine may be shared), and the
    change printed."""
    result = {**result, "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    print(f"load average {load_before[0]:.1f} -> {result['loadavg_after'][0]:.1f} ({os.cpu_count()} cores)")
    return result


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
