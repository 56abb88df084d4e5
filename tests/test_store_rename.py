"""rename / rename_many: values move between keys without I/O, atomically, across reopen and crashes."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import signal
import threading
import time

import pytest
import torch

import tiered
from tiered import Tier

from conftest import KiB, MiB, random_tensor, same_bytes


def rename_config(path, **changes) -> tiered.StoreConfig:
    settings = dict(path=str(path), device_bytes=0, host_bytes=1 * MiB, block_size=256 * KiB, queue_depth=8,
                    io_threads=2, swap_grow_bytes=1 * MiB, result_pool_bytes=0)
    settings.update(changes)
    return tiered.StoreConfig(**settings)


def test_a_rename_moves_the_value_without_io_and_survives_a_reopen(tmp_path):
    a, b = random_tensor((50_000,), torch.float32, seed=1), random_tensor((7,), torch.int64, seed=2)
    with tiered.TieredStore.open(rename_config(tmp_path / "s")) as store:
        store.sync.put_many({"a": a, "b": b, "c": torch.ones(3)})
        z = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
        store.sync.put("z", z, tier="nvme", compress=True)
        layout = store.nvme_layout("a")
        before = store.stats()
        store.sync.rename("a", "b")  # b's old value is replaced
        store.sync.rename_many([("z", "y"), ("c", "new")])
        after = store.stats()
        assert after.bytes_read == before.bytes_read and after.bytes_written == before.bytes_written
        assert "a" not in store and "z" not in store and "c" not in store
        assert store.nvme_layout("b") == layout
        assert same_bytes(store.sync.get("b"), a) and store.info("y").codec == "bplane-zstd"
        space = store.nvme_space()
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes  # b's old extents were freed
    with tiered.TieredStore.open(rename_config(tmp_path / "s")) as store:
        assert sorted(store.keys()) == ["b", "new", "y"]
        assert same_bytes(store.sync.get("b"), a)
        assert store.info("y").codec == "bplane-zstd"
        assert same_bytes(store.sync.get("y"), z) and torch.equal(store.sync.get("new"), torch.ones(3))
        space = store.nvme_space()
        assert space.allocated_bytes == space.entry_bytes


def test_a_rename_without_a_flush_moves_at_once_and_is_flushed_by_the_next_durable_change(tmp_path):
    """``durable=False``: the transaction is written without flushing the manifest's log; the next
    durable change flushes it (SQLite's WAL keeps them in order), and a reopen finds the keys moved."""
    a, b = random_tensor((50_000,), torch.float32, seed=1), random_tensor((300,), torch.float64, seed=2)
    with tiered.TieredStore.open(rename_config(tmp_path / "s")) as store:
        store.sync.put_many({"a": a, "b": b})
        manifest = store._commits._manifest
        flushes: list[bool] = []
        commit = manifest.commit

        def spy(upserts, deletes=(), *, flush=True):
            flushes.append(flush)
            commit(upserts, deletes, flush=flush)

        manifest.commit = spy
        try:
            store.sync.rename_many([("a", "a2"), ("b", "b2")], durable=False)
            assert flushes == [False]
            assert "a" not in store and same_bytes(store.sync.get("a2"), a) and same_bytes(store.sync.get("b2"), b)
            future = store.sync.rename_many_future([("b2", "b3")], durable=False)
            future.result(30)
            store.sync.put("c", torch.ones(8))  # durable: flushes what came before it too
            assert flushes == [False, False, True]
            with pytest.raises(TypeError, match="pairs"):
                store.sync.rename_many_future("ab")  # refused before anything is queued
            with pytest.raises(TypeError, match="durable must be True or False, got 'no'"):
                store.sync.rename_many([("c", "d")], durable="no")
            assert "c" in store and "d" not in store
        finally:
            manifest.commit = commit
    with tiered.TieredStore.open(rename_config(tmp_path / "s")) as store:
        assert sorted(store.keys()) == ["a2", "b3", "c"]
        assert same_bytes(store.sync.get("a2"), a) and same_bytes(store.sync.get("b3"), b)
        space = store.nvme_space()
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes


def test_bad_renames_change_nothing(tmp_path):
    with tiered.TieredStore.open(rename_config(tmp_path / "s")) as store:
        store.sync.put_many({"a": torch.ones(4), "b": torch.zeros(4)})
        with pytest.raises(tiered.KeyNotFoundError, match="'missing'"):
            store.sync.rename_many([("a", "x"), ("missing", "y")])
        with pytest.raises(ValueError, match="to itself"):
            store.sync.rename("a", "a")
        with pytest.raises(ValueError, match="more than once"):
            store.sync.rename_many([("a", "x"), ("b", "x")])
        with pytest.raises(TypeError, match="pairs"):
            store.sync.rename_many(["ab"])
        with pytest.raises(TypeError, match="keys are strings"):
            store.sync.rename("a", 3)
        assert sorted(store.keys()) == ["a", "b"] and torch.equal(store.sync.get("a"), torch.ones(4))


def test_memory_entries_move_in_memory_and_tombstone_what_they_replace(tmp_path):
    # flush_on_close=False: the close writes nothing down, as a crash would not
    with tiered.TieredStore.open(rename_config(tmp_path / "s", flush_on_close=False)) as store:
        store.sync.put("old", torch.ones(10))  # committed on nvme
        store.sync.put("h", torch.full((10,), 2.0), tier="host")
        store.sync.pin("h")
        store.sync.rename("h", "old")
        info = store.info("old")
        assert info.tiers == (Tier.HOST,) and info.pinned and "h" not in store
        assert torch.equal(store.sync.get("old"), torch.full((10,), 2.0))
    with tiered.TieredStore.open(rename_config(tmp_path / "s")) as store:
        assert "old" not in store and "h" not in store  # never the older value


async def test_a_read_racing_a_rename_gets_the_whole_value(tmp_path):
    a = random_tensor((200_000,), torch.float32, seed=3)
    async with await tiered.TieredStore.open_async(rename_config(tmp_path / "s", host_bytes=2 * MiB)) as store:
        await store.put("a", a)
        reading = store.sync.get_future("a")
        await store.rename("a", "b")
        assert same_bytes(reading.result(), a) and same_bytes(await store.get("b"), a)
        prefetch = store.prefetch("b", "host")
        await store.rename("b", "c")
        await prefetch
        assert same_bytes(await store.get("c"), a)
        space = store.nvme_space()
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes


# ------------------------------------------------------------------------------- renames against write-downs


class GatedManifest:
    """The store's manifest, whose commit of a batch that ``stops`` picks waits for :attr:`release`
    (on the manifest thread: the store's loop runs on meanwhile)."""

    def __init__(self, real, stops) -> None:
        self._real = real
        self._stops = stops
        self.reached = threading.Event()
        self.release = threading.Event()

    def commit(self, upserts, deletes=(), **flush):
        if not self.release.is_set() and self._stops([r.key for r in upserts], list(deletes)):
            self.reached.set()
            self.release.wait(60)
        return self._real.commit(upserts, deletes, **flush)

    def __getattr__(self, name):
        return getattr(self._real, name)


def gate_commits(store: tiered.TieredStore, stops) -> GatedManifest:
    gate = GatedManifest(store._commits._manifest, stops)
    store._commits._manifest = gate
    return gate


async def reached(gate: GatedManifest) -> None:
    assert await asyncio.to_thread(gate.reached.wait, 60), "the gated commit never came"


def assert_consistent(store: tiered.TieredStore, key: str, compressed: bool) -> None:
    """What info says about a key's nvme copy is what the copy is; no extent is orphaned."""
    info = store.info(key)
    if not info.dirty:
        assert info.stored_nbytes is not None, info
        assert (info.codec != "raw") == compressed, info
    space = store.nvme_space()
    assert space.allocated_bytes == space.charged_bytes == space.entry_bytes, space


async def start_write_down(store: tiered.TieredStore, how: str, key: str):
    """Make ``key``'s host copy go down to nvme: by evict, flush, or a host put that evicts it."""
    if how == "evict":
        return asyncio.ensure_future(store.evict(key, "nvme"))
    if how == "flush":
        return asyncio.ensure_future(store.flush())
    return asyncio.ensure_future(store.put("crowd", torch.randn(40_000), tier="host"))


@pytest.mark.parametrize("how", ["evict", "flush", "host put"])
async def test_a_write_down_starting_during_a_rename_follows_the_value(tmp_path, how):
    # The rename decided what to commit (src had no record); a write-down of src starts while that
    # commit is on its way. It must not leave a record of src behind (src would come back after a
    # reopen) nor keep extents nobody names.
    value = torch.randn(40_000, generator=torch.Generator().manual_seed(5))
    cfg = rename_config(tmp_path / "s", host_bytes=256 * KiB)
    async with await tiered.TieredStore.open_async(cfg) as store:
        await store.put("dst", torch.zeros(1000))
        await store.put("src", value, tier="host", compress=True)
        gate = gate_commits(store, lambda upserts, deletes: "dst" in deletes)
        renaming = asyncio.ensure_future(store.rename("src", "dst"))
        await reached(gate)
        writing = await start_write_down(store, how, "src")
        await asyncio.sleep(0.3)  # long enough for a write-down to commit, were it not held
        gate.release.set()
        await renaming
        await writing
        assert "src" not in store and same_bytes(await store.get("dst"), value)
        assert not store.info("dst").dirty, "the write-down asked for src must follow it to dst"
        assert_consistent(store, "dst", compressed=True)
    async with await tiered.TieredStore.open_async(cfg) as store:
        assert "src" not in store, "a key renamed away came back"
        assert "dst" not in store or same_bytes(await store.get("dst"), value)
        space = store.nvme_space()
        assert space.allocated_bytes == space.entry_bytes, space


@pytest.mark.parametrize("how", ["evict", "flush"])
@pytest.mark.parametrize("compress", [True, False])
async def test_a_write_down_committing_during_a_rename_moves_with_it(tmp_path, how, compress):
    # The write-down of src is committing when the rename starts: the renamed entry must take its
    # nvme copy with the codec it was written with, and its record.
    value = torch.randn(40_000, generator=torch.Generator().manual_seed(6))
    cfg = rename_config(tmp_path / "s")
    async with await tiered.TieredStore.open_async(cfg) as store:
        await store.put("dst", torch.zeros(1000))
        await store.put("src", value, tier="host", compress=compress)
        gate = gate_commits(store, lambda upserts, deletes: "src" in upserts)
        writing = await start_write_down(store, how, "src")
        await reached(gate)
        renaming = asyncio.ensure_future(store.rename("src", "dst"))
        await asyncio.sleep(0.3)  # the rename has started, and waits
        gate.release.set()
        await writing
        await renaming
        assert_consistent(store, "dst", compressed=compress)
        assert same_bytes(await store.get("dst"), value), "get returned bytes other than the value"
        await store.rename("dst", "again")  # no AssertionError
        await store.rename("again", "dst")
    async with await tiered.TieredStore.open_async(cfg) as store:
        assert store.keys() == ["dst"], "the renamed key is lost after a reopen"
        assert same_bytes(await store.get("dst"), value)
        assert_consistent(store, "dst", compressed=compress)


def racing_renamer(path: str, journal: str, count: int) -> None:
    """Rename count host keys onto committed ones, each beside an evict of its source; journal what
    returned, then die without closing."""
    async def run() -> None:
        store = await tiered.TieredStore.open_async(rename_config(path))
        for i in range(count):
            await store.put(f"dst{i}", torch.zeros(1000))
            await store.put(f"src{i}", torch.full((1000,), float(i)), tier="host")

        async def pair(i: int) -> bool:
            renamed, evicted = await asyncio.gather(store.rename(f"src{i}", f"dst{i}"),
                                                    store.evict(f"src{i}", "nvme"), return_exceptions=True)
            assert renamed is None, renamed
            return evicted is None

        evicted = await asyncio.gather(*(pair(i) for i in range(count)))
        with open(journal, "w") as f:
            json.dump(evicted, f)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(run())


@pytest.mark.timeout(120)
def test_renames_acknowledged_before_a_crash_stay_renamed(tmp_path):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tiered", __name__])
    path, journal, count = str(tmp_path / "store"), str(tmp_path / "journal"), 50
    proc = ctx.Process(target=racing_renamer, args=(path, journal, count))
    proc.start()
    proc.join(90)
    assert proc.exitcode == -signal.SIGKILL and os.path.exists(journal), proc.exitcode
    with open(journal) as f:
        evicted = json.load(f)
    with tiered.TieredStore.open(rename_config(path)) as store:
        assert not [k for k in store.keys() if k.startswith("src")], "acknowledged renames came undone"
        for i in range(count):
            if f"dst{i}" in store:
                assert torch.equal(store.sync.get(f"dst{i}"), torch.full((1000,), float(i))), i
            else:  # the moved value was in memory only: it may be lost, the old one never comes back
                assert not evicted[i], f"dst{i}: its source's evict to nvme had returned"
        space = store.nvme_space()
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes


# ------------------------------------------------------------------------------- crashes

KEYS = 12


def renamer(path: str, journal: str, durable: bool = True) -> None:
    """Move every key from side x to side y and back, one rename_many per round; journal each round."""
    fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with tiered.TieredStore.open(rename_config(path)) as store:
        side = "x" if "x0" in store else "y"
        for r in range(10**9):
            other = "y" if side == "x" else "x"
            os.write(fd, f"begin {r}\n".encode())
            store.sync.rename_many([(f"{side}{i}", f"{other}{i}") for i in range(KEYS)], durable=durable)
            os.write(fd, f"end {r}\n".encode())
            side = other


@pytest.mark.timeout(120)
@pytest.mark.parametrize("durable", [True, False], ids=["durable", "without-a-flush"])
def test_a_rename_many_killed_mid_way_moves_every_key_or_none(tmp_path, durable):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tiered", __name__])
    rng = random.Random(11)
    path = str(tmp_path / "store")
    values = {i: random_tensor((1000 * (i + 1),), torch.float32, seed=i) for i in range(KEYS)}
    with tiered.TieredStore.open(rename_config(path)) as store:
        store.sync.put_many({f"x{i}": v for i, v in values.items()})
    for kill in range(5):
        journal = str(tmp_path / f"journal-{kill}")
        proc = ctx.Process(target=renamer, args=(path, journal, durable))
        proc.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (os.path.exists(journal) and "end 1" in open(journal).read()):
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.02))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        with tiered.TieredStore.open(rename_config(path)) as store:
            keys = sorted(store.keys())
            assert keys in (sorted(f"x{i}" for i in range(KEYS)), sorted(f"y{i}" for i in range(KEYS))), keys
            for key in keys:
                assert same_bytes(store.sync.get(key), values[int(key[1:])]), key
            space = store.nvme_space()
            assert space.allocated_bytes == space.charged_bytes == space.entry_bytes
