"""Concurrency soak: >= 10,000 operations from asyncio tasks and threads on overlapping keys.

Two threads each run an event loop with several tasks on the async API, two more threads use the
sync facade, all on the same 16 keys under budgets a few tensors fill, so puts, gets, deletes,
evictions, prefetches, pins and flushes race with each other and with the write-downs evictions
cause. Every operation is stamped with a global sequence number when issued and when it returned.

Checked against a model afterwards, per key: a get returns a value some put wrote (never a value
from a put that raised, never torn bytes) that was not already overwritten or deleted before the
get began; "absent" likewise. Every wait is bounded: an operation that takes longer than
``OP_TIMEOUT_S`` or a worker that does not finish fails the test (with every thread's stack)
instead of hanging it. At the end the store is idle: accounting is exact, and a reopen returns
exactly the last values.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import faulthandler
import hashlib
import itertools
import random
import sys
import threading
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch

import tiered
from tiered import CapacityError, KeyNotFoundError, Tier, TieredStore

KiB = 1024
KEYS = [f"key/{i}" for i in range(14)] + ["pinnable-0", "pinnable-1"]
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.complex64, torch.bool, torch.float8_e5m2]
ASYNC_THREADS, TASKS_PER_LOOP, OPS_PER_TASK = 2, 4, 750
SYNC_THREADS, OPS_PER_SYNC_THREAD = 2, 2000
TOTAL_OPS = ASYNC_THREADS * TASKS_PER_LOOP * OPS_PER_TASK + SYNC_THREADS * OPS_PER_SYNC_THREAD
OP_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 150.0
ABSENT = None


@dataclasses.dataclass(frozen=True)
class Event:
    """One operation: what, on which key, when issued and returned (global sequence numbers)."""

    op: str
    key: Optional[str]
    start: int
    end: int
    value: Optional[tuple] = None  # a put's or get's value digest; ABSENT for a get that found nothing
    ok: bool = True


class History:
    """Events from every thread; the counter is one global order of issue and return."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.events: list[Event] = []
        self.errors: list[str] = []

    def stamp(self) -> int:
        return next(self._seq)

    def add(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def fail(self, message: str) -> None:
        with self._lock:
            self.errors.append(message)


def digest(t: torch.Tensor) -> tuple:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(t.dtype), tuple(t.shape), hashlib.sha1(raw).hexdigest()


def make_tensor(rng: random.Random) -> torch.Tensor:
    """Random dtype, 0-d to multi-block (the block is 16 KiB), unique random bytes."""
    dtype = rng.choice(DTYPES)
    item = dtype.itemsize
    r = rng.random()
    numel = 1 if r < 0.1 else 0 if r < 0.13 else rng.randint(1, 24 * KiB // item)
    gen = np.random.default_rng(rng.getrandbits(64))
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    if dtype is torch.bool:
        flat = torch.from_numpy(gen.integers(0, 2, size=numel, dtype=np.uint8)).view(torch.bool)
    else:
        flat = torch.from_numpy(gen.integers(0, 256, size=numel * item, dtype=np.uint8)).view(dtype)
    if numel == 1 and r < 0.05:
        return flat.reshape(())
    if numel % 4 == 0 and rng.random() < 0.3:
        return flat.reshape(4, numel // 4).t()  # non-contiguous
    return flat


#: Errors an operation may raise under these budgets, by operation; anything else fails the test.
EXPECTED = {
    "put": (CapacityError,),  # every byte of a tier pinned
    "get": (KeyNotFoundError,),
    "delete": (KeyNotFoundError,),
    "evict": (KeyNotFoundError, ValueError),  # ValueError: the key is pinned
    "prefetch": (KeyNotFoundError, CapacityError),
    "pin": (KeyNotFoundError, CapacityError),
    "unpin": (KeyNotFoundError,),
    "flush": (CapacityError,),
}


class Worker:
    """Draws random operations; runs them through ``call`` (async or sync) and records them."""

    def __init__(self, store: TieredStore, history: History, seed: int) -> None:
        self.store = store
        self.history = history
        self.rng = random.Random(seed)

    def draw(self) -> tuple[str, Optional[str], tuple]:
        rng = self.rng
        r = rng.random()
        key = rng.choice(KEYS)
        if r < 0.35:
            return "put", key, (make_tensor(rng), rng.choice(list(Tier)), rng.random() < 0.2 or None)
        if r < 0.65:
            return "get", key, ()
        if r < 0.72:
            return "delete", key, ()
        if r < 0.82:
            return "evict", key, (rng.choice([Tier.HOST, Tier.NVME]),)
        if r < 0.92:
            return "prefetch", key, (rng.choice([Tier.DEVICE, Tier.HOST]),)
        if r < 0.96:
            pinnable = rng.choice(KEYS[-2:])
            return ("pin", pinnable, (rng.choice([None, Tier.HOST]),)) if r < 0.94 else ("unpin", pinnable, ())
        if r < 0.995:
            return "get", key, ()
        return "flush", None, ()

    def record(self, op: str, key: Optional[str], args: tuple, start: int, outcome: Any,
               error: Optional[BaseException]) -> None:
        end = self.history.stamp()
        if error is not None and not isinstance(error, EXPECTED[op]):
            self.history.fail(f"{op}({key!r}) raised {type(error).__name__}: {error}")
            return
        if op == "put":
            self.history.add(Event(op, key, start, end, digest(args[0]), ok=error is None))
        elif op == "get":
            value = digest(outcome) if error is None else ABSENT
            self.history.add(Event(op, key, start, end, value))
        else:
            self.history.add(Event(op, key, start, end, ok=error is None))


class AsyncWorker(Worker):
    async def run(self, ops: int) -> None:
        store = self.store
        for _ in range(ops):
            op, key, args = self.draw()
            start = self.history.stamp()
            if op == "put":
                call = store.put(key, args[0], tier=args[1], compress=args[2])
            elif op == "get":
                call = store.get(key)
            elif op == "delete":
                call = store.delete(key)
            elif op == "evict":
                call = store.evict(key, args[0])
            elif op == "prefetch":
                call = _prefetch(store, key, args[0])
            elif op == "pin":
                call = store.pin(key, args[0])
            elif op == "unpin":
                call = store.unpin(key)
            else:
                call = store.flush()
            outcome, error = None, None
            try:
                outcome = await asyncio.wait_for(call, OP_TIMEOUT_S)
            except asyncio.TimeoutError:
                self.history.fail(f"{op}({key!r}) did not finish within {OP_TIMEOUT_S} s: deadlock?")
                return
            except Exception as exc:  # noqa: BLE001 - judged in record()
                error = exc
            self.record(op, key, args, start, outcome, error)


async def _prefetch(store: TieredStore, key: str, tier: Tier) -> None:
    await store.prefetch(key, tier)  # raises KeyNotFoundError at once for a missing key


class SyncWorker(Worker):
    def run(self, ops: int) -> None:
        sync = self.store.sync
        for _ in range(ops):
            op, key, args = self.draw()
            start = self.history.stamp()
            outcome, error = None, None
            try:
                outcome = _sync_call(sync, op, key, args)
            except TimeoutError:
                self.history.fail(f"{op}({key!r}) did not finish within {OP_TIMEOUT_S} s: deadlock?")
                return
            except Exception as exc:  # noqa: BLE001 - judged in record()
                error = exc
            self.record(op, key, args, start, outcome, error)


def _sync_call(sync: tiered.SyncStore, op: str, key: Optional[str], args: tuple) -> Any:
    if op == "put":
        return sync.put(key, args[0], tier=args[1], compress=args[2])
    if op == "get":
        return sync.get(key)
    if op == "delete":
        return sync.delete(key)
    if op == "evict":
        return sync.evict(key, args[0])
    if op == "prefetch":
        return sync.prefetch(key, args[0]).result(timeout=OP_TIMEOUT_S)
    if op == "pin":
        return sync.pin(key, args[0])
    if op == "unpin":
        return sync.unpin(key)
    return sync.flush()


def check_history(history: History) -> None:
    """Every get saw a value that was current at some moment between its issue and its return.

    A write ``s`` (a put of the value seen, or a delete for "absent") can explain a get ``g`` if it
    began before ``g`` returned and no other write both began after ``s`` returned and returned
    before ``g`` began: that is, ``s.end`` is later than the latest start of any write that had
    returned when ``g`` began.
    """
    by_key: dict[str, list[Event]] = {k: [] for k in KEYS}
    for e in history.events:
        if e.key is not None:
            by_key[e.key].append(e)
    problems = []
    for key, events in by_key.items():
        writes = sorted((e for e in events if e.op in ("put", "delete") and e.ok), key=lambda e: e.end)
        ends = [w.end for w in writes]
        latest_start = list(itertools.accumulate((w.start for w in writes), max))
        sources: dict[Optional[tuple], list[Event]] = {ABSENT: [Event("initial", key, -1, -1)]}
        for w in writes:
            sources.setdefault(w.value if w.op == "put" else ABSENT, []).append(w)
        failed = {e.value for e in events if e.op == "put" and not e.ok} - set(sources)
        for g in (e for e in events if e.op == "get"):
            if g.value in failed:
                problems.append(f"{key}: a get returned the value of a put that raised: {g}")
                continue
            if g.value not in sources:
                problems.append(f"{key}: a get returned a value nobody put: {g}")
                continue
            i = bisect.bisect_left(ends, g.start)  # writes [0, i) had returned when g began
            overwritten_after = latest_start[i - 1] if i else -2
            if not any(s.start < g.end and s.end > overwritten_after for s in sources[g.value]):
                problems.append(f"{key}: {g} returned a value already overwritten or deleted before the get began")
    assert not problems, f"{len(problems)} violations, the first ones:\n" + "\n".join(problems[:10])


def check_idle_accounting(store: TieredStore) -> None:
    stats = store.stats()
    infos = [store.info(k) for k in store.keys()]
    for tier in Tier:
        resident = [i for i in infos if tier in i.tiers]
        footprint = store._tiers.backends[tier].footprint
        expected = sum(footprint(i.stored_nbytes if tier is Tier.NVME else i.nbytes) for i in resident)
        assert stats.tiers[tier].used_bytes == expected, (tier, stats.tiers[tier], expected)
    space = store.nvme_space()
    assert space.allocated_bytes == space.charged_bytes == space.entry_bytes, space


@pytest.mark.timeout(240)
def test_ten_thousand_operations_from_tasks_and_threads_on_overlapping_keys(tmp_path):
    assert TOTAL_OPS >= 10_000
    cfg = tiered.StoreConfig(
        path=str(tmp_path / "store"), device_bytes=64 * KiB, host_bytes=128 * KiB, block_size=16 * KiB,
        queue_depth=4, io_threads=4, cpu_threads=2, swap_grow_bytes=256 * KiB, result_pool_bytes=0,
    )
    store = TieredStore.open(cfg)
    history = History()
    crashed: list[BaseException] = []
    stuck: list[str] = []

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                crashed.append(exc)

        return run

    def loop_main(n: int) -> None:
        async def main() -> None:
            workers = [AsyncWorker(store, history, seed=1000 * n + t) for t in range(TASKS_PER_LOOP)]
            await asyncio.gather(*(w.run(OPS_PER_TASK) for w in workers))

        asyncio.run(main())

    threads = [threading.Thread(target=guarded(lambda n=n: loop_main(n)), name=f"soak-loop-{n}", daemon=True)
               for n in range(ASYNC_THREADS)]
    threads += [threading.Thread(target=guarded(lambda n=n: SyncWorker(store, history, seed=7 + n).run(
        OPS_PER_SYNC_THREAD)), name=f"soak-sync-{n}", daemon=True) for n in range(SYNC_THREADS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(RUN_TIMEOUT_S)
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            pytest.fail(f"workers {stuck} did not finish within {RUN_TIMEOUT_S} s: deadlock? (stacks on stderr)")
        assert not crashed, crashed
        assert not history.errors, history.errors[:10]
        assert len(history.events) == TOTAL_OPS
        counts = {op: sum(e.op == op for e in history.events) for op in EXPECTED}
        assert counts["put"] > 2000 and counts["get"] > 2500, counts
        stats = store.stats()
        assert stats.tiers[Tier.DEVICE].evictions > 0 and stats.tiers[Tier.HOST].evictions > 0, stats

        # Idle now: read every key once more, as the last operation on it.
        for key in KEYS:
            start = history.stamp()
            try:
                value = digest(store.sync.get(key))
            except KeyNotFoundError:
                value = ABSENT
            history.add(Event("get", key, start, history.stamp(), value))
        check_history(history)
        check_idle_accounting(store)
        final = {e.key: e.value for e in history.events[-len(KEYS):]}
    finally:
        closer = threading.Thread(target=store.sync.close, daemon=True)  # bounded: after a deadlock it may hang
        closer.start()
        closer.join(OP_TIMEOUT_S)
        assert stuck or not closer.is_alive(), f"close did not finish within {OP_TIMEOUT_S} s"

    with TieredStore.open(cfg) as reopened:
        for key, value in final.items():
            if value is ABSENT:
                assert key not in reopened, key
            else:
                assert digest(reopened.sync.get(key)) == value, key
        check_idle_accounting(reopened)


def test_the_history_check_catches_stale_torn_and_phantom_reads():
    k = KEYS[0]
    v1, v2, bad = ("float32", (1,), "a"), ("float32", (1,), "b"), ("float32", (1,), "c")
    ok = [Event("put", k, 0, 1, v1), Event("get", k, 2, 3, v1), Event("put", k, 4, 7, v2),
          Event("get", k, 5, 6, v1), Event("get", k, 5, 8, v2), Event("delete", k, 9, 10),
          Event("get", k, 11, 12, ABSENT), Event("get", k, -5, 0, ABSENT)]
    wrong = {
        "stale": Event("get", k, 8, 9, v1),  # v2 returned at 7, before this get began at 8
        "from the future": Event("get", k, 2, 3, v2),  # the put of v2 began at 4
        "resurrected": Event("get", k, 13, 14, v2),  # deleted at 10
        "phantom": Event("get", k, 2, 3, bad),
        "a failed put": Event("get", k, 20, 21, ("int8", (2,), "z")),
    }
    history = History()
    history.events = list(ok)
    check_history(history)
    for name, event in wrong.items():
        history.events = ok + [Event("put", k, 15, 16, ("int8", (2,), "z"), ok=False), event]
        try:
            check_history(history)
        except AssertionError as exc:
            assert "violations" in str(exc)
        else:
            pytest.fail(f"the check missed a {name} read")
