"""Crash-consistency harness: a writer process is SIGKILLed at a random moment, then the store is
reopened and checked against what the writer's journal says had returned.

Used by tests/test_reliability_crash.py (CI: a few dozen kills) and benchmarks/crash_bench.py
(``--kills 1000``). No pytest here: failures are ``CrashCheckError`` with the evidence in the message.

How it works
- Writers are forked from a multiprocessing *forkserver* that has already imported torch and tiered,
  so a writer starts in tens of milliseconds instead of the seconds an import takes.
- A writer opens the store and runs a few asyncio workers, each owning a disjoint set of keys, that
  put (every tier, compressed or not, tiny to multi-block), put_many (atomic or not), get (checked),
  delete, rename and rename_many (within the worker's keys), modify (in place, checked), evict,
  prefetch and flush in a loop until killed. Budgets are tight, so puts also cause evictions and
  write-downs, and a flush or an eviction writes down other workers' keys as they are renamed.
- Every call is journaled: a ``begin`` line before it is issued and an ``end`` line only after it
  returned (or raised). Lines go to an O_APPEND file with one ``write`` each; a SIGKILL cannot lose
  a line the kernel accepted, and a half-written last line is ignored.
- The parent replays the journal into a model: for each key, the set of values a reopen may show.
  A returned put to nvme allows exactly its value; a returned put to host/device allows "absent"
  or its value (never the older one: a tombstone committed before it returned); a returned delete
  allows only "absent"; a returned rename moves the source's allowed values to the destination and
  leaves "absent" at the source; a returned modify allows "absent" or the modified value; a returned
  ``evict(key, "nvme")`` or ``flush()`` pins the current value. An operation still in flight adds
  its new values (and "absent" for memory-tier puts, deletes, modifies and a rename's source).
- The parent reopens the store and checks every key bit-exact against its allowed set, that no
  unknown key exists, and that nvme space accounting matches the manifest's records exactly.
  What it observed becomes the known state the next writer starts from, on the same directory.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import json
import multiprocessing
import os
import random
import signal
import sqlite3
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

import tiered
from tiered import Tier

KiB = 1024
MiB = 1024 * KiB

#: dtypes the writer draws from: floats (incl. float8), ints, complex and bool.
DTYPES = ("float32", "bfloat16", "float16", "int64", "uint8", "complex64", "bool", "float8_e4m3fn", "int32")
LAYOUTS = ("one-dir", "striped")
WORKERS = 3
KEYS_PER_WORKER = 4
ABSENT = None
DEVICE_BYTES = 128 * KiB
#: How long the parent waits for anything a writer or a reopen should do in well under a second.
PATIENCE_S = 60.0


class CrashCheckError(AssertionError):
    """A reopened store disagreed with what the killed writer's journal says had returned."""


# ----------------------------------------------------------------------------------- values


def keys_of(worker: int) -> list[str]:
    """Keys owned by one writer worker; odd names on purpose (they never reach the filesystem)."""
    return [f"w{worker}/k{i}" if i % 2 else f"../w{worker}/ключ {i}" for i in range(KEYS_PER_WORKER)]


ALL_KEYS = tuple(k for w in range(WORKERS) for k in keys_of(w))


@dataclasses.dataclass(frozen=True)
class ValueSpec:
    """A value the writer can put and the parent can rebuild: dtype, shape and a seed."""

    dtype: str
    shape: tuple[int, ...]
    seed: int
    smooth: bool  # compressible (a float's exponent plane, small ints) rather than random bytes
    transposed: bool = False  # a 2-D value made as the transpose of its mirror shape
    rolls: int = 0  # the value's bytes rotated by this many places (what a modify block makes of it)

    def encode(self) -> str:
        return json.dumps([self.dtype, list(self.shape), self.seed, self.smooth, self.transposed, self.rolls])

    @classmethod
    def decode(cls, text: str) -> "ValueSpec":
        dtype, shape, seed, smooth, transposed, *rolls = json.loads(text)
        return cls(dtype, tuple(shape), seed, smooth, transposed, *rolls)

    def modified(self) -> "ValueSpec":
        """The value a modify block makes of this one (:func:`modify_in_place`)."""
        return dataclasses.replace(self, rolls=self.rolls + 1)


def make_value(spec: ValueSpec, contiguous: bool = True) -> torch.Tensor:
    """The tensor a spec stands for, identical in every process. With ``contiguous=False`` a
    transposed spec comes as the non-contiguous view the writer puts."""
    if spec.rolls:
        value = make_value(dataclasses.replace(spec, rolls=0))
        for _ in range(spec.rolls):
            modify_in_place(value)
        return value
    if spec.transposed:
        base = make_value(dataclasses.replace(spec, shape=spec.shape[::-1], transposed=False))
        view = base.t()
        return view.contiguous() if contiguous else view
    dtype = getattr(torch, spec.dtype)
    numel = int(np.prod(spec.shape, dtype=np.int64))
    gen = np.random.default_rng(spec.seed)
    if numel == 0:
        flat = torch.empty(0, dtype=dtype)  # numpy gives empty arrays stride 0, which .view() refuses
    elif dtype is torch.bool:
        flat = torch.from_numpy(gen.integers(0, 2, size=numel, dtype=np.uint8)).view(torch.bool)
    elif spec.smooth and (dtype.is_floating_point or dtype.is_complex):
        real = torch.from_numpy(gen.standard_normal(numel * (2 if dtype.is_complex else 1)).astype(np.float32))
        flat = real.view(torch.complex64).to(dtype) if dtype.is_complex else real.to(dtype)
    elif spec.smooth:
        flat = torch.from_numpy(gen.integers(0, 16, size=numel, dtype=np.uint8)).to(dtype)
    else:
        flat = torch.from_numpy(gen.integers(0, 256, size=numel * dtype.itemsize, dtype=np.uint8)).view(dtype)
    return flat.reshape(spec.shape)


def modify_in_place(t: torch.Tensor) -> None:
    """Rotate a contiguous tensor's bytes by one place: other bytes, valid for every dtype."""
    flat = t.reshape(-1).view(torch.uint8)
    flat.copy_(flat.roll(1))


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes (comparison is bit-exact: NaN payloads and -0.0 included)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def matches(t: torch.Tensor, spec: ValueSpec) -> bool:
    """Bit-exact equality of dtype, shape and bytes."""
    want = make_value(spec)
    return t.dtype == want.dtype and tuple(t.shape) == tuple(want.shape) and raw_bytes(t) == raw_bytes(want)


def random_spec(rng: random.Random) -> ValueSpec:
    """Sizes from 0-d and empty through a few bytes to multi-block (the block is 16 KiB)."""
    dtype = rng.choice(DTYPES)
    item = getattr(torch, dtype).itemsize
    r = rng.random()
    if r < 0.08:
        shape: tuple[int, ...] = ()
    elif r < 0.12:
        shape = (rng.choice([0, 3]), 0)
    elif r < 0.3:
        shape = (rng.randint(1, 64 // item),)
    elif r < 0.7:
        shape = (rng.randint(1, 16 * KiB // item),)
    else:
        n = rng.randint(16 * KiB // item, 160 * KiB // item)
        if rng.random() < 0.4:
            return ValueSpec(dtype, (n // 4, 4), rng.getrandbits(31), rng.random() < 0.5, transposed=True)
        shape = (n,)
    return ValueSpec(dtype, shape, rng.getrandbits(31), rng.random() < 0.5)


# ----------------------------------------------------------------------------------- config


def store_config(path: str, layout: str) -> tiered.StoreConfig:
    """Small budgets and blocks: puts evict, write-downs cascade, tensors span several blocks."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    extra: dict[str, Any] = {}
    if layout == "striped":
        extra = {"nvme_paths": [os.path.join(path, "nvme0"), os.path.join(path, "nvme1")], "compress": True}
    return tiered.StoreConfig(
        path=path,
        device_bytes=DEVICE_BYTES,
        host_bytes=256 * KiB,
        block_size=16 * KiB,
        queue_depth=4,
        staging_buffers=4,
        io_threads=2,
        cpu_threads=1,
        swap_grow_bytes=256 * KiB,
        result_pool_bytes=0,
        **extra,
    )


# ----------------------------------------------------------------------------------- writer


class Journal:
    """Append-only journal: one ``os.write`` per line on an O_APPEND descriptor."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def log(self, **fields: Any) -> None:
        line = (json.dumps(fields, ensure_ascii=True) + "\n").encode()
        if os.write(self._fd, line) != len(line):
            raise OSError(f"short write to the journal ({len(line)} bytes)")


def writer_main(path: str, layout: str, seed: int, journal_path: str, known: dict[str, Optional[str]]) -> None:
    """Entry point of a writer process: run operations until killed. ``known`` maps every key to
    its value spec (or None) as the parent last observed it."""
    torch.set_num_threads(1)
    journal = Journal(journal_path)
    try:
        asyncio.run(_writer(path, layout, seed, journal, known))
    except BaseException as exc:  # noqa: BLE001 - the parent must hear of anything unexpected
        journal.log(fatal=f"{type(exc).__name__}: {exc}")
        os._exit(3)


async def _writer(path: str, layout: str, seed: int, journal: Journal, known: dict[str, Optional[str]]) -> None:
    store = await tiered.TieredStore.open_async(store_config(path, layout))
    journal.log(opened=True)
    ids = iter(range(1 << 62))
    current = {k: (ValueSpec.decode(v) if v is not None else None) for k, v in known.items()}
    lent = LentMemory()
    await asyncio.gather(*(_worker(store, w, random.Random(seed * 1000 + w), journal, ids, current, lent)
                           for w in range(WORKERS)))


@dataclasses.dataclass
class LentMemory:
    """The writer's modify blocks: while one is open, a memory tier whose room only its lent copy
    could make refuses an admission with CapacityError ([Note: modify blocks] in tiered.store.modify)."""

    open: int = 0
    opened: int = 0

    def mark(self) -> int:
        return -1 if self.open else self.opened

    def refusals(self, mark: int) -> tuple[str, ...]:
        """("CapacityError",) when a block was open at some moment since ``mark``."""
        return ("CapacityError",) if mark == -1 or self.open or self.opened != mark else ()


async def _worker(store: tiered.TieredStore, worker: int, rng: random.Random, journal: Journal, ids: Any,
                  current: dict[str, Optional[ValueSpec]], lent: LentMemory) -> None:
    keys = keys_of(worker)
    while True:
        op_id = next(ids)
        key = rng.choice(keys)
        r = rng.random()
        if r < 0.38:
            await _put(store, op_id, key, rng, journal, current, lent)
        elif r < 0.45:
            await _put_many(store, op_id, rng.sample(keys, rng.randint(1, 3)), rng, journal, current)
        elif r < 0.57:
            await _get(store, op_id, key, journal, current)
        elif r < 0.64:
            absent = ("KeyNotFoundError",) if current[key] is None else ()
            journal.log(b=op_id, op="delete", key=key)
            error = await _attempt(store.delete(key))
            if error is None:
                current[key] = None
            _end(journal, op_id, error, allowed=absent)
        elif r < 0.73:
            await _rename(store, op_id, rng.sample(keys, 4 if rng.random() < 0.3 else 2), journal, current)
        elif r < 0.77:
            await _modify(store, op_id, key, journal, current, lent)
        elif r < 0.85:
            tier = rng.choice(["host", "nvme", "nvme"])
            absent = ("KeyNotFoundError",) if current[key] is None else ()
            journal.log(b=op_id, op="evict", key=key, tier=tier)
            mark = lent.mark()
            error = await _attempt(store.evict(key, tier))
            _end(journal, op_id, error, allowed=absent + lent.refusals(mark))
        elif r < 0.95:
            tier = rng.choice(["host", "device"])
            absent = ("KeyNotFoundError",) if current[key] is None else ()
            journal.log(b=op_id, op="prefetch", key=key, tier=tier)
            mark = lent.mark()
            error = None
            try:
                await store.prefetch(key, tier)
            except Exception as exc:  # noqa: BLE001 - judged by _end
                error = exc
            _end(journal, op_id, error, allowed=absent + _too_big(current[key], tier) + lent.refusals(mark))
        else:
            journal.log(b=op_id, op="flush", keys=keys)
            _end(journal, op_id, await _attempt(store.flush()), allowed=())


async def _put(store: tiered.TieredStore, op_id: int, key: str, rng: random.Random, journal: Journal,
               current: dict[str, Optional[ValueSpec]], lent: LentMemory) -> None:
    spec = random_spec(rng)
    tier = rng.choice(["nvme", "nvme", "host", "device"])
    compress = rng.choice([None, True, False])
    journal.log(b=op_id, op="put", key=key, tier=tier, v=spec.encode())
    mark = lent.mark()
    error = await _attempt(store.put(key, make_value(spec, contiguous=False), tier=tier, compress=compress))
    if error is None:
        current[key] = spec
    _end(journal, op_id, error, allowed=_too_big(spec, tier) + lent.refusals(mark))


async def _put_many(store: tiered.TieredStore, op_id: int, keys: list[str], rng: random.Random, journal: Journal,
                    current: dict[str, Optional[ValueSpec]]) -> None:
    """To nvme, atomic or not, sometimes keeping a write-through copy in a memory tier."""
    specs = {key: random_spec(rng) for key in keys}
    journal.log(b=op_id, op="put_many", items={k: v.encode() for k, v in specs.items()}, tier="nvme")
    items = {k: make_value(v, contiguous=False) for k, v in specs.items()}
    error = await _attempt(store.put_many(items, compress=rng.choice([None, True, False]), atomic=rng.random() < 0.5,
                                          keep=rng.choice([None, None, "host", "device"])))
    if error is None:
        current.update(specs)
    _end(journal, op_id, error, allowed=())


async def _rename(store: tiered.TieredStore, op_id: int, keys: list[str], journal: Journal,
                  current: dict[str, Optional[ValueSpec]]) -> None:
    pairs = list(zip(keys[::2], keys[1::2]))
    absent = ("KeyNotFoundError",) if any(current[src] is None for src, _ in pairs) else ()
    journal.log(b=op_id, op="rename", pairs=pairs)
    error = await _attempt(store.rename_many(pairs) if len(pairs) > 1 else store.rename(*pairs[0]))
    if error is None:
        for src, dst in pairs:
            current[dst], current[src] = current[src], None
    _end(journal, op_id, error, allowed=absent)


async def _modify(store: tiered.TieredStore, op_id: int, key: str, journal: Journal,
                  current: dict[str, Optional[ValueSpec]], lent: LentMemory) -> None:
    spec = current[key]
    if spec is None:  # nothing to modify: a get must say so
        await _get(store, op_id, key, journal, current)
        return
    new = spec.modified()
    journal.log(b=op_id, op="modify", key=key, v=new.encode())
    lent.open += 1
    lent.opened += 1
    try:
        async with store.modify(key) as t:
            if not matches(t, spec):
                journal.log(e=op_id, error=f"modify lent wrong data: expected {spec}", unexpected=True)
                os._exit(3)
            modify_in_place(t)
    except Exception as exc:  # noqa: BLE001 - judged by _end
        _end(journal, op_id, exc, allowed=())
        return
    finally:
        lent.open -= 1
    current[key] = new
    _end(journal, op_id, None, allowed=())


def _too_big(spec: Optional[ValueSpec], tier: str) -> tuple[str, ...]:
    """CapacityError is expected only for a tensor larger than the whole device tier."""
    if spec is None or tier != "device":
        return ()
    nbytes = int(np.prod(spec.shape, dtype=np.int64)) * getattr(torch, spec.dtype).itemsize
    return ("CapacityError",) if nbytes > DEVICE_BYTES else ()


async def _get(store: tiered.TieredStore, op_id: int, key: str, journal: Journal,
               current: dict[str, Optional[ValueSpec]]) -> None:
    journal.log(b=op_id, op="get", key=key)
    try:
        got = await store.get(key)
    except tiered.KeyNotFoundError as exc:
        if current[key] is not None:
            journal.log(e=op_id, error=f"get lost the key: {exc}", unexpected=True)
            os._exit(3)
        journal.log(e=op_id, error="KeyNotFoundError")
        return
    spec = current[key]
    if spec is None or not matches(got, spec):
        journal.log(e=op_id, error=f"get returned wrong data: expected {spec}", unexpected=True)
        os._exit(3)
    journal.log(e=op_id)


async def _attempt(call: Any) -> Optional[BaseException]:
    try:
        await call
    except Exception as exc:  # noqa: BLE001 - judged by _end
        return exc
    return None


def _end(journal: Journal, op_id: int, error: Optional[BaseException], allowed: tuple[str, ...]) -> None:
    if error is None:
        journal.log(e=op_id)
        return
    name = type(error).__name__
    if name not in allowed:
        journal.log(e=op_id, error=f"{name}: {error}", unexpected=True)
        os._exit(3)
    journal.log(e=op_id, error=name)


# ----------------------------------------------------------------------------------- model


@dataclasses.dataclass
class KeyModel:
    """What a reopen may show for one key: ``allowed`` value specs (encoded) or ABSENT."""

    allowed: set[Optional[str]]
    current: Optional[str]  # the value the writer last saw returned (what a get must show)


@dataclasses.dataclass
class Replay:
    """The journal of one killed writer, applied to the model."""

    opened: bool = False
    returned: int = 0  # operations that returned
    in_flight: list[dict] = dataclasses.field(default_factory=list)  # begun, never returned
    fatal: Optional[str] = None


def replay(lines: list[dict], model: dict[str, KeyModel]) -> Replay:
    """Apply journal lines to ``model`` in order; what was still in flight widens the allowed sets."""
    out = Replay()
    begun: dict[int, dict] = {}
    for line in lines:
        if "opened" in line:
            out.opened = True
        elif "fatal" in line or line.get("unexpected"):
            out.fatal = line.get("fatal") or line.get("error")
        elif "b" in line:
            begun[line["b"]] = line
        elif "e" in line:
            op = begun.pop(line["e"])
            out.returned += 1
            if "error" not in line:
                _returned(op, model)
    for op in begun.values():
        out.in_flight.append(op)
        kind = op["op"]
        if kind in ("put", "put_many"):
            for key, value in _written(op).items():
                model[key].allowed.add(value)
                if op["tier"] != "nvme":
                    model[key].allowed.add(ABSENT)  # its tombstone may have committed
        elif kind in ("delete", "modify"):
            model[op["key"]].allowed.add(ABSENT)
            if kind == "modify":
                model[op["key"]].allowed.add(op["v"])
        elif kind == "rename":  # all pairs or none: each destination may hold its source's value
            op["sources_before"] = {src: set(model[src].allowed) for src, _ in op["pairs"]}
            for src, dst in op["pairs"]:
                model[dst].allowed |= model[src].allowed
                model[src].allowed.add(ABSENT)
    return out


def _written(op: dict) -> dict[str, str]:
    """key -> value spec of a put or put_many."""
    return op["items"] if op["op"] == "put_many" else {op["key"]: op["v"]}


def _returned(op: dict, model: dict[str, KeyModel]) -> None:
    kind = op["op"]
    if kind in ("put", "put_many"):
        for key, value in _written(op).items():
            m = model[key]
            m.current = value
            # A memory-tier put is not durable, but it durably removed the older value before returning.
            m.allowed = {value} if op["tier"] == "nvme" else {ABSENT, value}
    elif kind == "modify":  # a lent memory copy is not durable; the older value was removed durably
        m = model[op["key"]]
        m.current = op["v"]
        m.allowed = {ABSENT, op["v"]}
    elif kind == "rename":
        for src, dst in op["pairs"]:
            model[dst].current, model[dst].allowed = model[src].current, set(model[src].allowed)
            model[src].current, model[src].allowed = ABSENT, {ABSENT}
    elif kind == "delete":
        m = model[op["key"]]
        m.current = ABSENT
        m.allowed = {ABSENT}
    elif kind == "evict" and op["tier"] == "nvme":
        m = model[op["key"]]
        m.allowed = {m.current}
    elif kind == "flush":
        for key in op["keys"]:  # the flushing worker's own keys: nothing else touched them meanwhile
            model[key].allowed = {model[key].current}


def read_journal(path: str) -> list[dict]:
    """Every complete line (a SIGKILL may cut the last one short)."""
    with open(path, "rb") as f:
        data = f.read()
    return [json.loads(line) for line in data.split(b"\n")[:-1]]


# ----------------------------------------------------------------------------------- checks


@dataclasses.dataclass
class Observation:
    """What one reopen found."""

    state: dict[str, Optional[str]]  # key -> the spec found (None: absent)
    in_flight_new: int = 0  # keys with an operation in flight that now show its new value
    in_flight_old: int = 0  # ... that show the value from before it
    bytes_committed: int = 0
    swap_file_bytes: int = 0


def manifest_extent_bytes(path: str) -> tuple[int, int]:
    """(records, total extent bytes) read straight from the manifest, without the store."""
    db = sqlite3.connect(f"file:{os.path.join(path, 'manifest.sqlite')}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT extents FROM entries").fetchall()
    finally:
        db.close()
    total = 0
    for (blob,) in rows:
        ext = array.array("q")
        ext.frombytes(blob)
        total += sum(ext[i + 2] for i in range(0, len(ext), 3))
    return len(rows), total


def verify(path: str, layout: str, model: dict[str, KeyModel], in_flight: list[dict]) -> Observation:
    """Reopen the store and check it against the model; raise CrashCheckError on any difference."""
    changed: dict[str, Optional[str]] = {}  # key -> the value an operation in flight was giving it
    for op in in_flight:
        if op["op"] in ("put", "put_many"):
            changed.update(_written(op))
        elif op["op"] in ("delete", "modify"):
            changed[op["key"]] = op.get("v", ABSENT)
        elif op["op"] == "rename":
            changed.update((src, ABSENT) for src, _ in op["pairs"])
    obs = Observation(state={})
    with tiered.TieredStore.open(store_config(path, layout)) as store:
        unknown = set(store.keys()) - set(model)
        if unknown:
            raise CrashCheckError(f"keys nobody put appeared after reopen: {sorted(unknown)}")
        for key, m in model.items():
            found = _find(store, key, m)
            obs.state[key] = found
            if key in changed:
                new = changed[key]
                if found == new:
                    obs.in_flight_new += 1
                else:
                    obs.in_flight_old += 1
        space = store.nvme_space()
        stats = store.stats().tiers[Tier.NVME]
        records, extent_bytes = manifest_extent_bytes(path)
        if not (space.allocated_bytes == space.entry_bytes == stats.used_bytes == extent_bytes):
            raise CrashCheckError(
                f"nvme space does not match the manifest after reopen: {space}, stats used {stats.used_bytes}, "
                f"{records} records with {extent_bytes} bytes of extents"
            )
        if records != len(store):
            raise CrashCheckError(f"{len(store)} entries after reopen but {records} records in the manifest")
    for op in in_flight:
        if op["op"] == "rename":
            _check_all_or_none(op, obs.state)
        obs.bytes_committed = extent_bytes
        obs.swap_file_bytes = space.file_bytes
    return obs


def _check_all_or_none(op: dict, state: dict[str, Optional[str]]) -> None:
    """A rename in flight at the kill moved every pair or none: a pair whose source is still there
    beside one whose durable source is gone is a torn rename, and a source that is gone must have
    left its value at the destination."""
    moved, kept = [], []
    for src, dst in op["pairs"]:
        before = op["sources_before"][src]
        if state[src] is not ABSENT:
            kept.append(src)
        elif ABSENT not in before:  # it was durable: only the rename can have removed it
            if state[dst] not in before:
                raise CrashCheckError(f"rename {src!r} -> {dst!r} in flight: the source is gone and the destination "
                                      f"holds {state[dst]!r}, not its value ({_show(before)})")
            moved.append(src)
    if moved and kept:
        raise CrashCheckError(f"rename_many {op['pairs']} in flight was torn: {moved} moved, {kept} did not")


def _find(store: tiered.TieredStore, key: str, m: KeyModel) -> Optional[str]:
    if key not in store:
        if ABSENT not in m.allowed:
            raise CrashCheckError(f"{key!r} is missing after reopen; one of {_show(m.allowed)} had returned")
        return ABSENT
    try:
        got = store.sync.get(key)
    except tiered.ChecksumError as exc:
        raise CrashCheckError(f"{key!r} is torn after reopen: {exc}") from exc
    for spec in m.allowed:
        if spec is not None and matches(got, ValueSpec.decode(spec)):
            return spec
    raise CrashCheckError(
        f"{key!r} after reopen is {got.dtype} {tuple(got.shape)} with bytes matching none of the allowed values "
        f"{_show(m.allowed)}: torn, stale or from nowhere"
    )


def _show(allowed: set[Optional[str]]) -> str:
    return ", ".join(sorted("absent" if a is None else a for a in allowed))


# ----------------------------------------------------------------------------------- kill loop


@dataclasses.dataclass
class KillRecord:
    """One kill: when, what had returned, what was in flight, what the reopen found."""

    chain: str
    index: int
    delay_s: float
    during_open: bool
    opened: bool  # the writer had opened the store when it was killed
    returned: int
    in_flight: int
    in_flight_new: int
    in_flight_old: int
    present_keys: int
    committed_bytes: int
    swap_file_bytes: int
    writer_s: float
    verify_s: float


def forkserver_context() -> multiprocessing.context.BaseContext:
    """A forkserver whose server process has imported torch and tiered, so each writer forks ready."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tiered", __name__])
    return ctx


def run_chain(workdir: str, layout: str, kills: int, seed: int, *, ctx: Any = None,
              max_delay_s: float = 0.25, open_kill_fraction: float = 0.15,
              on_kill: Optional[Callable[[KillRecord], None]] = None) -> list[KillRecord]:
    """Kill ``kills`` writers in turn on one store directory, verifying after each kill
    (``on_kill`` hears of each verified kill as it happens).

    Most kills come a random time after the store opened (``max_delay_s`` at most); a fraction
    come a random time after the process started, which also hits a store that is still opening.
    """
    ctx = ctx or forkserver_context()
    rng = random.Random(seed)
    path = os.path.join(workdir, f"store-{layout}")
    state: dict[str, Optional[str]] = {k: ABSENT for k in ALL_KEYS}
    records: list[KillRecord] = []
    for i in range(kills):
        journal_path = os.path.join(workdir, f"journal-{layout}-{i:04d}.jsonl")
        during_open = rng.random() < open_kill_fraction
        delay = rng.uniform(0.0, 0.02 if during_open else max_delay_s)
        started = time.monotonic()
        proc = ctx.Process(target=writer_main, args=(path, layout, rng.getrandbits(31), journal_path, state))
        proc.start()
        try:
            if not during_open:
                _wait_for_open(proc, journal_path)
            time.sleep(delay)
        finally:
            if proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(PATIENCE_S)
        writer_s = time.monotonic() - started
        lines = read_journal(journal_path) if os.path.exists(journal_path) else []
        model = {k: KeyModel({v}, v) for k, v in state.items()}
        rep = replay(lines, model)
        if rep.fatal is not None or proc.exitcode != -signal.SIGKILL:
            raise CrashCheckError(
                f"writer {i} of chain {layout} failed on its own (exit {proc.exitcode}): {rep.fatal}"
            )
        checked = time.monotonic()
        obs = verify(path, layout, model, rep.in_flight)
        state = obs.state
        records.append(KillRecord(
            chain=layout, index=i, delay_s=delay, during_open=during_open, opened=rep.opened, returned=rep.returned,
            in_flight=len(rep.in_flight), in_flight_new=obs.in_flight_new, in_flight_old=obs.in_flight_old,
            present_keys=sum(v is not None for v in state.values()), committed_bytes=obs.bytes_committed,
            swap_file_bytes=obs.swap_file_bytes, writer_s=writer_s, verify_s=time.monotonic() - checked,
        ))
        if on_kill is not None:
            on_kill(records[-1])
        if os.path.exists(journal_path):
            os.unlink(journal_path)
    return records


def _wait_for_open(proc: Any, journal_path: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        if os.path.exists(journal_path) and os.path.getsize(journal_path) > 0:
            return
        if proc.exitcode is not None:
            return  # the caller reports how it ended
        time.sleep(0.002)
    raise CrashCheckError(f"writer pid {proc.pid} did not open the store within {PATIENCE_S} s")


def drain_and_check_space(path: str, layout: str) -> None:
    """After a chain: delete everything, and the nvme tier must be empty (nothing leaked)."""
    with tiered.TieredStore.open(store_config(path, layout)) as store:
        for key in store.keys():
            store.sync.delete(key)
        space = store.nvme_space()
        if space.allocated_bytes or store.stats().tiers[Tier.NVME].used_bytes:
            raise CrashCheckError(f"space still allocated after deleting every key: {space}")
