"""The targets docs/benchmarks.md sets, judged from one run's figures.

Each store figure is held against the peers' figure of the same direction, like for like: fio's
single stream and DeepSpeed's ``async_pwrite``/``async_pread`` x N then ``wait()`` keep the disk
busy across tensors, as puts or gets awaited together do; DeepSpeed reads into buffers it already
has, as ``get(out=)`` does. fio is also held against the sequential put and get and the get into
a new tensor. Against DeepSpeed, the sequential puts and gets of aligned tensors (one awaited
before the next starts) meet DeepSpeed moving one tensor at a time (its requests, ``wait()``,
then the next), and those awaited together meet DeepSpeed's x N then ``wait()``.
Input is equal: the store's rows on page-aligned tensors (``empty_aligned``) are held against
DeepSpeed's page-locked tensors (``new_cpu_locked_tensor``, its fast path), and its rows on plain
``torch.empty`` tensors against DeepSpeed given the same plain tensors. fio is held against all,
when its figure is the disk's limit: not after a short sweep (``--quick`` without a kept full sweep: tiered.bench.fio_cache).
"""

from __future__ import annotations

import statistics
from typing import Optional

from tiered.bench.options import VERDICT_RUNS
from tiered.bench.results import SHORT_SWEEP, BenchResult, Figure, Target

FIO_FRACTION = 0.95
SMALL_OPS = 5000.0
#: How the small phase names its batched figures (put_many/get_many): reported beside the target,
#: which is for one call per tensor.
BATCHED_OP = "put_many+get_many"

_STORE_WRITES = ("write", "write, puts in flight")
_STORE_READS = ("read", "read into out=", "read into out=, gets in flight")
#: How the large phase names the store's rows on page-aligned tensors (tiered.empty_aligned).
ALIGNED = "aligned tensors"
_ALIGNED_WRITES = (f"write, {ALIGNED}", f"write, {ALIGNED}, puts in flight")
_ALIGNED_READS = (f"read into out=, {ALIGNED}", f"read into out=, {ALIGNED}, gets in flight")
#: How the large phase names DeepSpeed's figures moving one tensor at a time (requests, wait(), next).
ONE_AT_A_TIME = "one tensor at a time"
#: How the large phase names DeepSpeed's figures on files of its own (one per tensor); informative,
#: not a target: its "deepspeed" figures use the store's own swap file, as the target asks.
OWN_FILES = "own files"
#: (peer tool, fraction wanted, ((peer op, store ops held against it), ...)).
_PEERS = (
    ("fio", FIO_FRACTION, (("write", _STORE_WRITES + _ALIGNED_WRITES), ("read", _STORE_READS + _ALIGNED_READS))),
    ("deepspeed", 1.0, ((f"write, {ONE_AT_A_TIME}", _ALIGNED_WRITES[:1]), ("write", _ALIGNED_WRITES[1:]),
                        (f"read, {ONE_AT_A_TIME}", _ALIGNED_READS[:1]), ("read", _ALIGNED_READS[1:]))),
    ("deepspeed (plain tensors)", 1.0, (("write", _STORE_WRITES), ("read", _STORE_READS))),
)


def check_targets(result: BenchResult) -> list[Target]:
    """Store vs fio at its best (>= 0.95), store vs DeepSpeed aio (>= 1.0), small 64 KiB put+get one
    call per tensor (>= 5,000 ops/s, batched figures beside it).

    A ratio is taken within each repetition (the contenders of one repetition ran back to back, in
    rotated order), and the target's figure is the median of those ratios, with their range. It is
    judged met or missed only from >= VERDICT_RUNS repetitions (``met`` is None below that)."""
    large = next((f.phase for f in result.figures if f.phase.startswith("large (")), None)
    out: list[Target] = []
    for peer, fraction, pairs in _PEERS:
        for peer_op, ops in pairs:
            ref = _fig(result, large, peer, peer_op)
            for op in ops:
                store = _fig(result, large, "store", op)
                if store is None and ref is None:
                    continue
                name, wanted = f"store {op} vs {peer} {peer_op}", f">= {fraction} x {peer}"
                if store is None or ref is None:
                    out.append(Target(name, wanted, None, None, f"{peer if ref is None else 'store'} not measured"))
                    continue
                ratios = [a.value / b.value for a, b in zip(store.runs, ref.runs)]
                if peer == "fio" and result.fio_reference == SHORT_SWEEP:
                    out.append(_reported(name, wanted, ratios, "fio's short grid is not the disk's limit: no verdict"))
                    continue
                out.append(_judged(name, wanted, ratios, fraction))
    out.append(_small_target(result))
    return out


def _judged(name: str, wanted: str, values: list[float], threshold: float, note: str = "") -> Target:
    """A target from every run's value: the median with its range; met only from >= VERDICT_RUNS runs."""
    median = statistics.median(values)
    enough = len(values) >= VERDICT_RUNS
    spread = f"median of {len(values)} runs, range {_fmt(min(values))}-{_fmt(max(values))}"
    if not enough:
        spread += f"; not judged: a verdict needs >= {VERDICT_RUNS} runs"
    return Target(name, wanted, median, (median >= threshold) if enough else None,
                  f"{spread}; {note}" if note else spread, low=min(values), high=max(values), runs=len(values))


def _reported(name: str, wanted: str, values: list[float], why: str) -> Target:
    """A target's figure given, never judged (``why`` says why)."""
    median = statistics.median(values)
    note = f"median of {len(values)} runs, range {_fmt(min(values))}-{_fmt(max(values))}; {why}"
    return Target(name, wanted, median, None, note, low=min(values), high=max(values), runs=len(values))


def _small_target(result: BenchResult) -> Target:
    """The best 64 KiB put+get figure of one call per tensor, judged against SMALL_OPS; the batched
    figure (put_many/get_many) is given beside it and does not count toward the target."""
    small = [f for f in result.figures if f.phase == "small 64KiB" and f.runs]
    per_call = max((f for f in small if not f.op.startswith(BATCHED_OP)), key=lambda f: f.median, default=None)
    batched = max((f for f in small if f.op.startswith(BATCHED_OP)), key=lambda f: f.median, default=None)
    name, wanted = "small 64 KiB put+get, one call per tensor", f">= {SMALL_OPS:,.0f} ops/s"
    beside = "" if batched is None else (f"batched ({batched.op}): {batched.median:,.0f} ops/s, range "
                                         f"{batched.min:,.0f}-{batched.max:,.0f}")
    if per_call is None:
        return Target(name, wanted, None, None, "not measured" + (f"; {beside}" if beside else ""))
    return _judged(name, wanted, per_call.values(), SMALL_OPS, f"{per_call.op}" + (f"; {beside}" if beside else ""))


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}"


def _fig(result: BenchResult, phase: Optional[str], tool: str, op: str) -> Optional[Figure]:
    if phase is None:
        return None
    f = result.figure(phase, tool, op)
    return f if f is not None and f.runs else None
