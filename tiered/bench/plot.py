"""An optional PNG of the large-tensor comparison (matplotlib is an optional extra)."""

from __future__ import annotations

from tiered.bench.options import format_size
from tiered.bench.results import GBPS, SHORT_SWEEP, BenchResult


def write_plot(result: BenchResult, path: str) -> str:
    """Bar chart of write and cold-read GB/s per contender (median with min-max whiskers) for the
    large-tensor phases. Returns "" on success, else why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 'matplotlib is not installed (pip install -e ".[bench]"); no plot written'
    figs = [f for f in result.figures if f.unit == GBPS and f.phase.startswith("large") and f.runs]
    if not figs:
        return "no large-tensor figures to plot"
    short = result.fio_reference == SHORT_SWEEP
    labels = [f"{f.tool}\n{f.op}" + (" (zstd)" if "zstd" in f.phase else "")
              + ("\n(short grid: not the disk's limit)" if short and f.tool == "fio" else "") for f in figs]
    medians = [f.median for f in figs]
    low = [f.median - f.min for f in figs]
    high = [f.max - f.median for f in figs]
    colors = ["#1f77b4" if f.tool == "store" else "#7f7f7f" if f.tool == "fio" else "#ff7f0e" for f in figs]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(figs)), 3.6), dpi=90)
    ax.bar(range(len(figs)), medians, yerr=[low, high], color=colors, capsize=3)
    ax.set_xticks(range(len(figs)))
    ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("GB/s (median, min-max)")
    machine = result.machine
    total = format_size(int(result.options.get("total_bytes", 0)))
    ax.set_title(f"tiered bench: {total} of large tensors, {machine.get('cpus')} CPUs, "
                 f"{machine.get('filesystem', '')} (medians of {result.options.get('repeats')} runs)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return ""
