"""The targets docs/benchmarks.md sets, checked against one run's figures.

Each store figure is held against the peers' figure of the same direction. Like for like: fio's
single stream and DeepSpeed's ``async_pwrite`` x N then ``wait()`` keep the disk busy across
tensors, as puts awaited together do; DeepSpeed reads into buffers it already has, as
``get(out=)`` does. The plain sequential put and the get into a new tensor are checked too.
"""

from __future__ import annotations

from typing import Optional

from tiered.bench.results import BenchResult, Figure, Target

FIO_FRACTION = 0.95
SMALL_OPS = 5000.0

_STORE_WRITES = ("write", "write, puts in flight")
_STORE_READS = ("read", "read into out=")


def check_targets(result: BenchResult) -> list[Target]:
    """Store vs fio (>= 0.95), store vs DeepSpeed aio (>= 1.0), small 64 KiB put+get (>= 5,000 ops/s)."""
    large = next((f.phase for f in result.figures if f.phase.startswith("large (")), None)
    out: list[Target] = []
    for peer, fraction in (("fio", FIO_FRACTION), ("deepspeed", 1.0)):
        for peer_op, ops in (("write", _STORE_WRITES), ("read", _STORE_READS)):
            ref = _fig(result, large, peer, peer_op)
            for op in ops:
                store = _fig(result, large, "store", op)
                if store is None and ref is None:
                    continue
                ratio = store.median / ref.median if store and ref else None
                out.append(Target(f"store {op} vs {peer} {peer_op}", f">= {fraction} x {peer}", ratio,
                                  None if ratio is None else ratio >= fraction,
                                  "" if ref else f"{peer} not measured"))
    small = [f for f in result.figures if f.phase == "small 64KiB" and f.runs]
    best = max(small, key=lambda f: f.median, default=None)
    out.append(Target("small 64 KiB put+get", f">= {SMALL_OPS:,.0f} ops/s", best.median if best else None,
                      None if best is None else best.median >= SMALL_OPS, best.op if best else "not measured"))
    return out


def _fig(result: BenchResult, phase: Optional[str], tool: str, op: str) -> Optional[Figure]:
    if phase is None:
        return None
    f = result.figure(phase, tool, op)
    return f if f is not None and f.runs else None
