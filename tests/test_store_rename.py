"""rename / rename_many: values move between keys without I/O, atomically, across reopen and crashes."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
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


# ------------------------------------------------------------------------------- crashes

KEYS = 12


def renamer(path: str, journal: str) -> None:
    """Move every key from side x to side y and back, one rename_many per round; journal each round."""
    fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with tiered.TieredStore.open(rename_config(path)) as store:
        side = "x" if "x0" in store else "y"
        for r in range(10**9):
            other = "y" if side == "x" else "x"
            os.write(fd, f"begin {r}\n".encode())
            store.sync.rename_many([(f"{side}{i}", f"{other}{i}") for i in range(KEYS)])
            os.write(fd, f"end {r}\n".encode())
            side = other


@pytest.mark.timeout(120)
def test_a_rename_many_killed_mid_way_moves_every_key_or_none(tmp_path):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tiered", __name__])
    rng = random.Random(11)
    path = str(tmp_path / "store")
    values = {i: random_tensor((1000 * (i + 1),), torch.float32, seed=i) for i in range(KEYS)}
    with tiered.TieredStore.open(rename_config(path)) as store:
        store.sync.put_many({f"x{i}": v for i, v in values.items()})
    for kill in range(5):
        journal = str(tmp_path / f"journal-{kill}")
        proc = ctx.Process(target=renamer, args=(path, journal))
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
