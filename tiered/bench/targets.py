"""The targets docs/benchmarks.md sets, checked against one run's figures.

Each store figure is held against the peers' figure of the same direction, like for like: fio's
single stream and DeepSpeed's ``async_pwrite``/``async_pread`` x N then ``wait()`` keep the disk
busy across tensors, as puts or gets awaited together do; DeepSpeed reads into buffers it already
has, as ``get(out=)`` does. fio is also held against the sequential put and get and the get into
a new tensor. Against DeepSpeed, the sequential puts and gets of aligned tensors (one awaited
before the next starts) meet DeepSpeed moving one tensor at a time (its requests, ``wait()``,
then the next), and those awaited together meet DeepSpeed's x N then ``wait()``.
Input is equal: the store's rows on page-aligned tensors (``empty_aligned``) are held against
DeepSpeed's page-locked tensors (``new_cpu_locked_tensor``, its fast path), and its rows on plain
``torch.empty`` tensors against DeepSpeed given the same plain tensors. fio is held against all.
"""

from __future__ import annotations

from typing import Optional

from tiered.bench.results import BenchResult, Figure, Target

FIO_FRACTION = 0.95
SMALL_OPS = 5000.0
#: How the small phase names its batched figures (put_many/get_many), which count toward SMALL_OPS too.
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
    """Store vs fio (>= 0.95), store vs DeepSpeed aio (>= 1.0), small 64 KiB put+get (>= 5,000 ops/s, one call
    per tensor or batched)."""
    large = next((f.phase for f in result.figures if f.phase.startswith("large (")), None)
    out: list[Target] = []
    for peer, fraction, pairs in _PEERS:
        for peer_op, ops in pairs:
            ref = _fig(result, large, peer, peer_op)
            for op in ops:
                store = _fig(result, large, "store", op)
                if store is None and ref is None:
                    continue
                ratio = store.median / ref.median if store and ref else None
                out.append(Target(f"store {op} vs {peer} {peer_op}", f">= {fraction} x {peer}", ratio,
                                  None if ratio is None else ratio >= fraction,
                                  "" if ref else f"{peer} not measured"))
    out.append(_small_target(result))
    return out


def _small_target(result: BenchResult) -> Target:
    """The best 64 KiB put+get figure, one call per tensor or batched; met when either reaches SMALL_OPS."""
    small = [f for f in result.figures if f.phase == "small 64KiB" and f.runs]
    per_call = max((f for f in small if not f.op.startswith(BATCHED_OP)), key=lambda f: f.median, default=None)
    batched = max((f for f in small if f.op.startswith(BATCHED_OP)), key=lambda f: f.median, default=None)
    found = [(kind, f) for kind, f in (("per call", per_call), ("batched", batched)) if f is not None]
    if not found:
        return Target("small 64 KiB put+get", f">= {SMALL_OPS:,.0f} ops/s", None, None, "not measured")
    best = max(found, key=lambda kf: kf[1].median)[1]
    met_by = [kind for kind, f in found if f.median >= SMALL_OPS]
    note = "; ".join(f"{kind} {f.median:,.0f} ({f.op})" for kind, f in found)
    note += f"; met by {' and '.join(met_by)}" if met_by else "; met by neither"
    return Target("small 64 KiB put+get", f">= {SMALL_OPS:,.0f} ops/s", best.median, bool(met_by), note)


def _fig(result: BenchResult, phase: Optional[str], tool: str, op: str) -> Optional[Figure]:
    if phase is None:
        return None
    f = result.figure(phase, tool, op)
    return f if f is not None and f.runs else None
