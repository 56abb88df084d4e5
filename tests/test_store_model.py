"""A randomized model-based test of every operation at once, checked against a reference model.

Asyncio tasks and threads (through ``store.sync``) draw operations at random on a few overlapping
keys: put (every tier, compressed or not, with or without a kept copy), put_many (atomic or not),
get, get_many, delete, rename, rename_many, modify, evict, flush and prefetch, with budgets so
small that puts evict and write down all the time. A reference model says, for every key, which
values it may hold (see ``Model``); every read is checked against it, bit for bit, and no call may
raise anything but what its arguments and the model allow (an AssertionError never). Between
rounds the store must agree with the model exactly, its tiers' and swap files' accounting must be
exact, and a close and reopen must give back every value with no extent orphaned.

SIGKILL is the crash harness's part (tests/crash_harness.py: the same operations, a writer killed
at random moments, every reopen checked against its journal; tests/test_reliability_crash.py).
``TIERED_MODEL_OPS`` (calls per task and thread and round, default 120), ``TIERED_MODEL_ROUNDS``
(default 2) and ``TIERED_MODEL_SEEDS`` (default 3) make it a soak.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import random
import threading
from typing import Any, Optional

import numpy as np
import pytest
import torch

import tiered
from crash_harness import ValueSpec, make_value, manifest_extent_bytes, matches, modify_in_place, random_spec
from tiered import Tier

KiB = 1024
MiB = 1024 * KiB

KEYS = ["a", "b", "c", "d", "ключ/ü", "e e"]
TASKS = 6
THREADS = 3
OPS = int(os.environ.get("TIERED_MODEL_OPS", "120"))  # per task and per thread, each round
ROUNDS = int(os.environ.get("TIERED_MODEL_ROUNDS", "2"))
SEEDS = int(os.environ.get("TIERED_MODEL_SEEDS", "3"))
DEVICE_BYTES = 128 * KiB
ABSENT = None

pytestmark = pytest.mark.timeout(300)


# ----------------------------------------------------------------------------------- the model


@dataclasses.dataclass(eq=False)
class Op:
    """One call, from just before it was issued to just after it returned."""

    kind: str
    begin: int
    #: key -> values this call may leave there (a rename's destination: what its source may hold).
    writes: dict[str, set] = dataclasses.field(default_factory=dict)
    #: key -> every value the key may have held while the call was in flight.
    seen: dict[str, set] = dataclasses.field(default_factory=dict)
    #: (source, destination) of renames: while in flight, what the source may take, so may the destination.
    flows: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    end: Optional[int] = None


class Model:
    """For every key, the set of values it may hold now (``ABSENT`` among them): sound for any
    interleaving of calls from any thread, so a value outside it is a wrong answer.

    A call's values join its keys' sets when it begins; while a rename is in flight, whatever its
    source may take its destination may take too. When a call returns, each key it wrote holds its
    value or that of a call on the key that overlapped it (in flight then, or returned since it
    began), since any of those may have taken effect last; a call that raised narrows nothing.
    Every call records what its keys may have held while it was in flight (``Op.seen``): a get
    must return one of those, a modify block must be lent one of them.
    """

    def __init__(self, keys: list[str]) -> None:
        self._lock = threading.Lock()
        self._clock = itertools.count()
        self.possible: dict[str, set] = {k: {ABSENT} for k in keys}
        self._ops: list[Op] = []  # in flight, or returned while one still in flight had begun
        #: Modify blocks: how many are open, and how many have opened (a lent copy may fill a tier).
        self.blocks_open = 0
        self.blocks_opened = 0

    def begin(self, kind: str, keys: list[str], writes: Optional[dict[str, set]] = None,
              flows: Optional[list[tuple[str, str]]] = None) -> Op:
        with self._lock:
            op = Op(kind, next(self._clock), flows=list(flows or ()))
            op.seen = {k: set(self.possible[k]) for k in keys}
            for key, values in (writes or {}).items():
                op.writes[key] = set(values)
            for src, dst in op.flows:
                op.writes[src] = {ABSENT}
                op.writes[dst] = op.seen[src] - {ABSENT}
            for key, values in op.writes.items():  # before the call counts as in flight: not in its own seen
                self._add(key, values)
            self._ops.append(op)
            return op

    def wrote(self, op: Op, key: str, value: Any) -> None:
        """A modify block knows now what it writes."""
        with self._lock:
            op.writes[key] = {value}
            self._add(key, {value})

    def seen(self, op: Op) -> dict[str, set]:
        """What ``op``'s keys may have held while it was in flight, so far (a copy)."""
        with self._lock:
            return {k: set(v) for k, v in op.seen.items()}

    def end(self, op: Op, ok: bool) -> None:
        """``op`` returned (``ok``) or raised; a call that raised may have written some of its keys
        (put_many), so it leaves every value possible and still counts for calls it overlapped."""
        with self._lock:
            op.end = next(self._clock)
            if ok:
                for key, values in op.writes.items():
                    self._settle(op, key, values)
            oldest = min((o.begin for o in self._ops if o.end is None), default=op.end)
            self._ops = [o for o in self._ops if o.end is None or o.end > oldest]

    def block(self, opened: bool) -> None:
        """A modify block opened (True) or ended (False)."""
        with self._lock:
            self.blocks_open += 1 if opened else -1
            self.blocks_opened += opened

    def observe(self, key: str, value: Any) -> None:
        """With nothing in flight, the store showed ``key``'s value: the model agrees, now exactly."""
        with self._lock:
            assert value in self.possible[key], (key, value, self.possible[key])
            self.possible[key] = {value}

    def _add(self, key: str, values: set) -> None:
        todo = [(key, set(values))]
        while todo:
            key, values = todo.pop()
            new = values - self.possible[key]
            self.possible[key] |= values
            for op in self._ops:
                if op.end is None and key in op.seen:
                    op.seen[key] |= values
                    for src, dst in op.flows:
                        if src == key:
                            op.writes[dst] |= values - {ABSENT}
            if new:
                todo.extend((dst, new - {ABSENT}) for op in self._ops if op.end is None
                            for src, dst in op.flows if src == key)

    def _settle(self, op: Op, key: str, values: set) -> None:
        settled = set(values)
        for other in self._ops:
            if other is not op and key in other.writes and (
                    other.end is None or other.end > op.begin):
                settled |= other.writes[key]
        self.possible[key] = settled
        for other in self._ops:
            if other.end is None and key in other.seen:
                other.seen[key] |= settled


# ----------------------------------------------------------------------------------- one worker


class Worker:
    """Draws operations on the store and checks each outcome against the model."""

    def __init__(self, store: tiered.TieredStore, model: Model, rng: random.Random, seeds: Any) -> None:
        self.store = store
        self.model = model
        self.rng = rng
        self.seeds = seeds
        self.done: dict[str, int] = {}

    def value(self) -> ValueSpec:
        spec = random_spec(self.rng)
        return dataclasses.replace(spec, seed=next(self.seeds))  # distinct values, distinct bytes

    def plan(self) -> tuple[str, dict]:
        """One operation: its kind and arguments."""
        rng, keys = self.rng, KEYS
        kind = rng.choices(
            ["put", "put_many", "get", "get_many", "delete", "rename", "rename_many", "modify", "evict", "flush",
             "prefetch"], weights=[18, 7, 14, 5, 5, 10, 4, 5, 9, 4, 6])[0]
        key = rng.choice(keys)
        if kind == "put":
            spec = self.value()
            tier = rng.choice(["nvme", "nvme", "host", "host", "device"])
            keep = rng.choice([None, None, "host", "device"]) if tier == "nvme" else None
            return kind, {"key": key, "spec": spec, "tier": tier, "compress": rng.choice([None, True, False]),
                          "keep": keep}
        if kind == "put_many":
            specs = {k: self.value() for k in rng.sample(keys, rng.randint(1, 3))}
            atomic = rng.random() < 0.5
            tier = "nvme" if atomic else rng.choice(["nvme", "host"])
            keep = rng.choice([None, "host"]) if tier == "nvme" else None
            return kind, {"specs": specs, "tier": tier, "atomic": atomic, "keep": keep,
                          "compress": rng.choice([None, True, False])}
        if kind in ("rename", "rename_many"):
            picked = rng.sample(keys, 2 if kind == "rename" else 2 * rng.randint(1, 2))
            return kind, {"pairs": list(zip(picked[::2], picked[1::2]))}
        if kind == "get_many":
            return kind, {"keys": rng.sample(keys, rng.randint(1, 4))}
        if kind == "flush":
            return kind, {"keys": None if rng.random() < 0.5 else rng.sample(keys, 2)}
        if kind in ("evict", "prefetch"):
            tiers = ["host", "nvme", "nvme"] if kind == "evict" else ["host", "device"]
            return kind, {"key": key, "tier": rng.choice(tiers)}
        return kind, {"key": key}

    def begin(self, kind: str, args: dict) -> Op:
        m = self.model
        if kind == "put":
            return m.begin(kind, [args["key"]], {args["key"]: {args["spec"]}})
        if kind == "put_many":
            return m.begin(kind, list(args["specs"]), {k: {v} for k, v in args["specs"].items()})
        if kind == "delete":
            return m.begin(kind, [args["key"]], {args["key"]: {ABSENT}})
        if kind in ("rename", "rename_many"):
            return m.begin(kind, [k for pair in args["pairs"] for k in pair], flows=args["pairs"])
        if kind in ("get_many",):
            return m.begin(kind, args["keys"])
        if kind == "flush":
            return m.begin(kind, args["keys"] or [])
        return m.begin(kind, [args["key"]])

    def judge(self, kind: str, args: dict, op: Op, error: Optional[BaseException], got: Any, mark: int) -> None:
        """Check an outcome against what the model allows; record the call's end."""
        seen = self.model.seen(op)
        allowed: tuple[type, ...] = ()
        if kind in ("get", "delete", "modify", "evict", "prefetch") and ABSENT in seen[args["key"]]:
            allowed += (tiered.KeyNotFoundError,)
        if kind in ("rename", "rename_many") and any(ABSENT in seen[src] for src, _ in args["pairs"]):
            allowed += (tiered.KeyNotFoundError,)
        if kind in ("get_many", "flush") and any(ABSENT in values for values in seen.values()):
            allowed += (tiered.KeyNotFoundError,)
        lent = mark == -1 or self.model.blocks_open or mark != self.model.blocks_opened
        if kind in ("put", "put_many", "prefetch", "evict") and (lent or self._too_big(kind, args, seen)):
            allowed += (tiered.CapacityError,)  # a lent copy counts as pinned ([Note: modify blocks])
        if error is not None and not isinstance(error, allowed):
            self.model.end(op, ok=False)
            raise AssertionError(f"{kind}({args}) raised {type(error).__name__}: {error}") from error
        if kind in ("get", "get_many") and error is None:
            keys = [args["key"]] if kind == "get" else args["keys"]
            values = [got] if kind == "get" else got
            for key, value in zip(keys, values):
                if not any(spec is not ABSENT and matches(value, spec) for spec in seen[key]):
                    self.model.end(op, ok=False)
                    raise AssertionError(f"{kind} of {key!r} returned {value.dtype} {tuple(value.shape)}, none of "
                                         f"the values it may hold: {sorted(map(str, seen[key]))}")
        self.model.end(op, ok=error is None)
        self.done[kind] = self.done.get(kind, 0) + (error is None)

    @staticmethod
    def _too_big(kind: str, args: dict, seen: dict[str, set]) -> bool:
        """The call puts or brings a value larger than the whole device tier there."""
        if kind == "put":
            return args["tier"] == "device" and nbytes(args["spec"]) > DEVICE_BYTES
        return kind == "prefetch" and args["tier"] == "device" and any(
            spec is not ABSENT and nbytes(spec) > DEVICE_BYTES for spec in seen[args["key"]])

    def mark(self) -> int:
        return -1 if self.model.blocks_open else self.model.blocks_opened

    def modified(self, op: Op, key: str, t: torch.Tensor) -> None:
        """Inside a modify block: the tensor is one of the key's values; rotate its bytes."""
        spec = next((s for s in self.model.seen(op)[key] if s is not ABSENT and matches(t, s)), None)
        assert spec is not None, f"modify of {key!r} lent bytes of none of its values"
        self.model.wrote(op, key, spec.modified())
        modify_in_place(t)

    # ------------------------------------------------------------------ the two ways to call

    async def run_async(self, count: int) -> None:
        store = self.store
        for _ in range(count):
            kind, args = self.plan()
            mark = self.mark()
            op = self.begin(kind, args)
            got, error = None, None
            try:
                got = await self._call_async(store, kind, args, op)
            except Exception as exc:  # noqa: BLE001 - judged against the model
                error = exc
            self.judge(kind, args, op, error, got, mark)

    async def _call_async(self, store: tiered.TieredStore, kind: str, args: dict, op: Op) -> Any:
        if kind == "put":
            return await store.put(args["key"], make_value(args["spec"], contiguous=False), args["tier"],
                                   args["compress"], keep=args["keep"])
        if kind == "put_many":
            return await store.put_many({k: make_value(v, contiguous=False) for k, v in args["specs"].items()},
                                        args["tier"], args["compress"], atomic=args["atomic"], keep=args["keep"])
        if kind == "get":
            return await store.get(args["key"], keep=self.rng.choice([None, "host"]))
        if kind == "get_many":
            return await store.get_many(args["keys"])
        if kind == "delete":
            return await store.delete(args["key"])
        if kind == "rename":
            return await store.rename(*args["pairs"][0])
        if kind == "rename_many":
            return await store.rename_many(args["pairs"])
        if kind == "evict":
            return await store.evict(args["key"], args["tier"])
        if kind == "flush":
            return await store.flush(args["keys"])
        if kind == "prefetch":
            return await store.prefetch(args["key"], args["tier"])
        self.model.block(opened=True)
        try:
            async with store.modify(args["key"]) as t:
                await asyncio.sleep(0)  # other calls run while the block is open
                self.modified(op, args["key"], t)
        finally:
            self.model.block(opened=False)

    def run_sync(self, count: int) -> None:
        store = self.store.sync
        for _ in range(count):
            kind, args = self.plan()
            mark = self.mark()
            op = self.begin(kind, args)
            got, error = None, None
            try:
                got = self._call_sync(store, kind, args, op)
            except Exception as exc:  # noqa: BLE001 - judged against the model
                error = exc
            self.judge(kind, args, op, error, got, mark)

    def _call_sync(self, store: tiered.SyncStore, kind: str, args: dict, op: Op) -> Any:
        if kind == "put":
            return store.put(args["key"], make_value(args["spec"], contiguous=False), args["tier"], args["compress"],
                             keep=args["keep"])
        if kind == "put_many":
            return store.put_many({k: make_value(v, contiguous=False) for k, v in args["specs"].items()},
                                  args["tier"], args["compress"], atomic=args["atomic"], keep=args["keep"])
        if kind == "get":
            return store.get(args["key"])
        if kind == "get_many":
            return store.get_many(args["keys"])
        if kind == "delete":
            return store.delete(args["key"])
        if kind == "rename":
            return store.rename(*args["pairs"][0])
        if kind == "rename_many":
            return store.rename_many(args["pairs"])
        if kind == "evict":
            return store.evict(args["key"], args["tier"])
        if kind == "flush":
            return store.flush(args["keys"])
        if kind == "prefetch":
            return store.prefetch(args["key"], args["tier"]).result(60)
        self.model.block(opened=True)
        try:
            with store.modify(args["key"]) as t:
                self.modified(op, args["key"], t)
        finally:
            self.model.block(opened=False)


def nbytes(spec: ValueSpec) -> int:
    return int(np.prod(spec.shape, dtype=np.int64)) * getattr(torch, spec.dtype).itemsize


# ----------------------------------------------------------------------------------- checks between rounds


def model_config(path, *, striped: bool, compress: bool) -> tiered.StoreConfig:
    """Small budgets: puts evict and write down; values span several 16 KiB blocks."""
    dirs = {"nvme_paths": [os.path.join(path, "nvme0"), os.path.join(path, "nvme1")]} if striped else {}
    return tiered.StoreConfig(path=str(path), device_bytes=DEVICE_BYTES, host_bytes=256 * KiB, block_size=16 * KiB,
                              queue_depth=4, io_threads=2, cpu_threads=2, swap_grow_bytes=256 * KiB,
                              result_pool_bytes=0, compress=compress, **dirs)


async def agree(store: tiered.TieredStore, model: Model) -> None:
    """With nothing in flight: every key holds a value the model allows (which it keeps from now
    on), what info says of its copies is true, and every tier's accounting is exact."""
    assert set(store.keys()) <= set(KEYS)
    for key in KEYS:
        try:
            got = await store.get(key)
        except tiered.KeyNotFoundError:
            model.observe(key, ABSENT)
            continue
        spec = next((s for s in model.possible[key] if s is not ABSENT and matches(got, s)), None)
        assert spec is not None, f"{key!r} holds none of {sorted(map(str, model.possible[key]))}"
        model.observe(key, spec)
        info = store.info(key)
        if not info.dirty:
            assert info.stored_nbytes is not None and (info.codec != "raw" or info.stored_nbytes == info.nbytes), info
    stats = store.stats()
    for tier in Tier:
        resident = [store.info(k) for k in store.keys() if tier in store.info(k).tiers]
        footprint = store._tiers.backends[tier].footprint
        used = sum(footprint(i.stored_nbytes if tier is Tier.NVME else i.nbytes) for i in resident)
        assert stats.tiers[tier].used_bytes == used and stats.tiers[tier].entries == len(resident), (tier, stats)
    space = store.nvme_space()
    assert space.allocated_bytes == space.charged_bytes == space.entry_bytes, space


async def reopen_agrees(cfg: tiered.StoreConfig, model: Model) -> None:
    """A closed store reopens to exactly the model's values, its space exactly its records' extents."""
    async with await tiered.TieredStore.open_async(cfg) as store:
        for key in KEYS:
            (want,) = model.possible[key]
            if want is ABSENT:
                assert key not in store, f"{key!r} came back after a reopen"
            else:
                assert matches(await store.get(key), want), f"{key!r} after a reopen is not its last value"
        space = store.nvme_space()
        _, extent_bytes = manifest_extent_bytes(cfg.path)
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes == extent_bytes, (space, extent_bytes)


# ----------------------------------------------------------------------------------- the test


@pytest.mark.parametrize("seed", range(SEEDS))
async def test_every_operation_at_once_agrees_with_the_model(tmp_path, seed):
    cfg = model_config(tmp_path / "store", striped=seed % 2 == 1, compress=seed % 3 == 2)
    model = Model(KEYS)
    seeds = itertools.count(seed * 1_000_000)  # value seeds, distinct across workers
    seed_lock = threading.Lock()

    def next_seed() -> int:
        with seed_lock:
            return next(seeds)

    value_seeds = iter(next_seed, None)
    done: dict[str, int] = {}
    for round_ in range(ROUNDS):
        store = await tiered.TieredStore.open_async(cfg)
        try:
            workers = [Worker(store, model, random.Random(f"{seed}/{round_}/{w}"), value_seeds)
                       for w in range(TASKS + THREADS)]
            threads = [asyncio.to_thread(w.run_sync, OPS) for w in workers[TASKS:]]
            await asyncio.gather(*(w.run_async(OPS) for w in workers[:TASKS]), *threads)
            await agree(store, model)
            for w in workers:
                for kind, n in w.done.items():
                    done[kind] = done.get(kind, 0) + n
        finally:
            await store.close()
        await reopen_agrees(cfg, model)
    # The storm did what it is for: every kind of call succeeded somewhere, values moved and the
    # small budgets evicted.
    assert all(done.get(kind, 0) for kind in ("put", "put_many", "get", "get_many", "delete", "rename",
                                              "rename_many", "modify", "evict", "flush", "prefetch")), done
