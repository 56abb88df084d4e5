"""Crash consistency: writers killed with SIGKILL at random moments, every reopen checked.

The harness (tests/crash_harness.py) forks writer processes that put, overwrite, delete, evict,
prefetch and flush over every tier (tiny to multi-block tensors, compressed and not, one swap
directory or two), journals what returned, kills them at a random moment, then reopens the store
and checks it against the journal: returned puts/deletes hold bit-exact, a key in flight holds its
old or new value and never a torn one, and nvme space matches the manifest's records exactly.
benchmarks/crash_bench.py runs the same loop with ``--kills 1000``.
"""

from __future__ import annotations

import os

import pytest
import torch

import crash_harness
import tiered
from crash_harness import ABSENT, CrashCheckError, KeyModel, ValueSpec

MiB = 1024 * 1024
KILLS_PER_LAYOUT = 25  # two layouts: 50 kills in CI


@pytest.fixture(scope="module")
def forkserver():
    return crash_harness.forkserver_context()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout, seed", [("one-dir", 8101), ("striped", 8102)])
def test_sigkill_at_random_moments_loses_nothing_that_returned(tmp_path, forkserver, layout, seed):
    records = crash_harness.run_chain(str(tmp_path), layout, KILLS_PER_LAYOUT, seed, ctx=forkserver)
    assert len(records) == KILLS_PER_LAYOUT
    # The kills landed on writers doing real work: operations returned, others were cut short.
    assert sum(r.returned for r in records) >= 10 * KILLS_PER_LAYOUT, records
    assert sum(r.in_flight for r in records) >= KILLS_PER_LAYOUT, records
    # Space freed by killed writers is reused: the swap files do not keep growing kill after kill.
    assert max(r.swap_file_bytes for r in records) <= 8 * MiB, [r.swap_file_bytes for r in records]
    crash_harness.drain_and_check_space(os.path.join(str(tmp_path), f"store-{layout}"), layout)


# The checker itself must be able to fail: feed it stores that break the rules on purpose.


def _store_with(path: str, key: str, spec: ValueSpec) -> None:
    with tiered.TieredStore.open(crash_harness.store_config(path, "one-dir")) as store:
        store.sync.put(key, crash_harness.make_value(spec))


def _model(**allowed: set) -> dict[str, KeyModel]:
    model = {k: KeyModel({ABSENT}, ABSENT) for k in crash_harness.ALL_KEYS}
    for i, values in enumerate(allowed.values()):
        model[crash_harness.ALL_KEYS[i]] = KeyModel(values, next(iter(values)))
    return model


def test_checker_catches_a_lost_put_a_stale_value_and_a_stranger(tmp_path):
    path = str(tmp_path / "s")
    key = crash_harness.ALL_KEYS[0]
    old = ValueSpec("float32", (1000,), 1, False)
    new = ValueSpec("float32", (1000,), 2, False)
    _store_with(path, key, old)
    # The journal says a put of `new` to nvme returned, but the store shows `old`.
    with pytest.raises(CrashCheckError, match="matching none of the allowed values"):
        crash_harness.verify(path, "one-dir", _model(a={new.encode()}), [])
    # A delete returned, but the key is still there.
    with pytest.raises(CrashCheckError, match="matching none"):
        crash_harness.verify(path, "one-dir", _model(a={ABSENT}), [])
    # Old or new are both fine while the put was in flight.
    obs = crash_harness.verify(path, "one-dir", _model(a={old.encode(), new.encode()}),
                               [{"op": "put", "key": key, "v": new.encode(), "tier": "nvme"}])
    assert obs.state[key] == old.encode() and obs.in_flight_old == 1
    # A key that nobody put.
    with tiered.TieredStore.open(crash_harness.store_config(path, "one-dir")) as store:
        store.sync.put("stranger", torch.ones(3))
    with pytest.raises(CrashCheckError, match="stranger"):
        crash_harness.verify(path, "one-dir", _model(a={old.encode()}), [])


def test_checker_catches_a_missing_key_and_torn_bytes(tmp_path):
    path = str(tmp_path / "s")
    key = crash_harness.ALL_KEYS[0]
    spec = ValueSpec("int64", (5000,), 3, False)
    with pytest.raises(CrashCheckError, match="missing after reopen"):
        crash_harness.verify(path, "one-dir", _model(a={spec.encode()}), [])
    _store_with(path, key, spec)
    swap = max((os.path.join(path, n) for n in os.listdir(path) if n.startswith("swap-")), key=os.path.getsize)
    with open(swap, "r+b") as f:  # the only record sits at the start of the largest swap file
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CrashCheckError, match="torn"):
        crash_harness.verify(path, "one-dir", _model(a={spec.encode()}), [])


def test_replay_widens_only_what_was_in_flight():
    a, b = crash_harness.ALL_KEYS[:2]
    v1, v2, v3 = (ValueSpec("uint8", (4,), s, False).encode() for s in (1, 2, 3))
    model = {k: KeyModel({ABSENT}, ABSENT) for k in crash_harness.ALL_KEYS}
    lines = [
        {"opened": True},
        {"b": 0, "op": "put", "key": a, "tier": "nvme", "v": v1}, {"e": 0},
        {"b": 1, "op": "put", "key": a, "tier": "host", "v": v2}, {"e": 1},
        {"b": 2, "op": "put", "key": b, "tier": "host", "v": v3}, {"e": 2},
        {"b": 3, "op": "flush", "keys": [b]}, {"e": 3},
        {"b": 4, "op": "delete", "key": a},  # killed here
    ]
    rep = crash_harness.replay(lines, model)
    assert rep.opened and rep.returned == 4 and len(rep.in_flight) == 1
    assert model[a].allowed == {ABSENT, v2}  # never v1: the host put's tombstone had committed
    assert model[b].allowed == {v3}  # flushed


def test_replay_of_renames_put_many_and_modify():
    a, b, c, d = crash_harness.keys_of(0)
    v1, v2, v3 = (ValueSpec("uint8", (4,), s, False) for s in (1, 2, 3))
    model = {k: KeyModel({ABSENT}, ABSENT) for k in crash_harness.ALL_KEYS}
    lines = [
        {"opened": True},
        {"b": 0, "op": "put", "key": a, "tier": "nvme", "v": v1.encode()}, {"e": 0},
        {"b": 1, "op": "rename", "pairs": [[a, b]]}, {"e": 1},
        {"b": 2, "op": "modify", "key": b, "v": v1.modified().encode()}, {"e": 2},
        {"b": 3, "op": "put_many", "items": {a: v2.encode(), c: v3.encode()}, "tier": "nvme"}, {"e": 3},
        {"b": 4, "op": "rename", "pairs": [[a, b], [c, d]]},  # killed here: both pairs moved, or neither
    ]
    rep = crash_harness.replay(lines, model)
    assert rep.returned == 4 and len(rep.in_flight) == 1
    assert model[a].allowed == {v2.encode(), ABSENT} and model[c].allowed == {v3.encode(), ABSENT}
    assert model[b].allowed == {ABSENT, v1.modified().encode(), v2.encode()}  # never v1: it was modified
    assert model[d].allowed == {ABSENT, v3.encode()}


def test_a_modified_value_is_the_rotated_bytes():
    spec = ValueSpec("bfloat16", (5, 3), 4, True, transposed=True)
    value = crash_harness.make_value(spec)
    crash_harness.modify_in_place(value)
    assert crash_harness.matches(value, spec.modified()) and not crash_harness.matches(value, spec)
    assert ValueSpec.decode(spec.modified().encode()) == spec.modified()


def test_checker_catches_a_torn_rename_many_and_a_moved_value_lost():
    a, b, c, d = crash_harness.keys_of(0)
    v1, v2 = (ValueSpec("uint8", (4,), s, False).encode() for s in (1, 2))
    model = {k: KeyModel({ABSENT}, ABSENT) for k in crash_harness.ALL_KEYS}
    lines = [
        {"opened": True},
        {"b": 0, "op": "put_many", "items": {a: v1, c: v2}, "tier": "nvme"}, {"e": 0},
        {"b": 1, "op": "rename", "pairs": [[a, b], [c, d]]},  # killed here
    ]
    rep = crash_harness.replay(lines, model)
    (op,) = rep.in_flight
    crash_harness._check_all_or_none(op, {a: ABSENT, b: v1, c: ABSENT, d: v2})  # all moved
    crash_harness._check_all_or_none(op, {a: v1, b: ABSENT, c: v2, d: ABSENT})  # none moved
    with pytest.raises(crash_harness.CrashCheckError, match="torn"):
        crash_harness._check_all_or_none(op, {a: ABSENT, b: v1, c: v2, d: ABSENT})
    with pytest.raises(crash_harness.CrashCheckError, match="source is gone"):
        crash_harness._check_all_or_none(op, {a: ABSENT, b: ABSENT, c: ABSENT, d: v2})
