"""put_many / get_many: bit-exact round trips, coalesced I/O, budgets, failures per entry, crashes."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import random
import signal
import threading
import time

import pytest
import torch

import test_conformance as conformance
import tiered
from tiered import Tier
from tiered.io import Syscalls
from tiered.util.keylocks import KeyLocks

from conftest import KiB, MiB, random_tensor, same_bytes

tier = conformance.tier  # the conformance suite's fixture: every tier


def batch_config(path, **changes) -> tiered.StoreConfig:
    """1 MiB blocks, so a batch of small tensors fits in one coalesced block."""
    settings = dict(path=str(path), device_bytes=1 * MiB, host_bytes=2 * MiB, block_size=1 * MiB, queue_depth=8,
                    io_threads=4, swap_grow_bytes=4 * MiB, result_pool_bytes=0)
    settings.update(changes)
    return tiered.StoreConfig(**settings)


def mixed_items(seed: int = 0) -> dict[str, torch.Tensor]:
    """Mixed dtypes and sizes: empty, scalar, odd byte counts, non-contiguous views, multi-block."""
    base = random_tensor((40, 60), torch.bfloat16, seed=seed + 1)
    items = {
        "empty": torch.empty(0),
        "empty-2d": torch.empty(4, 0, 3, dtype=torch.int64),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "odd-bytes": random_tensor((4097,), torch.uint8, seed=seed + 2),
        "bool": random_tensor((999,), torch.bool, seed=seed + 3),
        "complex": random_tensor((33, 7), torch.complex64, seed=seed + 4),
        "float8": random_tensor((5000,), torch.float8_e4m3fn, seed=seed + 5),
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "expanded": base.expand(2, 40, 60)[1],
        "multi-block": random_tensor((50_123,), torch.float32, seed=seed + 6),  # > the fixtures' 64 KiB blocks
    }
    for i in range(20):
        items[f"small/{i}"] = random_tensor((1000 + 517 * i,), torch.float16, seed=seed + 10 + i)
    return items


async def test_round_trip_is_bit_exact_for_every_tier(store, tier):
    items = mixed_items()
    await store.put_many(items, tier=tier)
    got = await store.get_many(list(items))
    for (key, want), have in zip(items.items(), got):
        assert same_bytes(want.contiguous(), have), key
        assert store.info(key).tiers == (tier,)


async def test_pairs_and_mapping_and_the_sync_facade(tmp_path):
    items = mixed_items(seed=40)
    with tiered.TieredStore.open(batch_config(tmp_path / "s")) as store:
        store.sync.put_many(list(items.items()))  # a sequence of pairs
        keys = list(items)[::-1]
        outs = [torch.empty_like(items[k].contiguous()) if i % 2 else None for i, k in enumerate(keys)]
        got = store.sync.get_many(keys, out=outs)
        for i, (key, have) in enumerate(zip(keys, got)):
            assert same_bytes(items[key].contiguous(), have), key
            if outs[i] is not None:
                assert have is outs[i]
        store.sync.put_many({k: t + 1 for k, t in (("a", torch.ones(3)), ("b", torch.zeros(2)))})
        assert store.sync.get_many(["b", "a"])[1].tolist() == [2.0, 2.0, 2.0]


async def test_small_entries_share_one_write_one_read_one_sync_one_commit(tmp_path):
    items = {f"k{i}": random_tensor((4096 + 100 * i,), torch.uint8, seed=i) for i in range(64)}
    async with await tiered.TieredStore.open_async(batch_config(tmp_path / "s", swap_grow_bytes=16 * MiB)) as store:
        await store.put("warm-up", torch.ones(1))  # the swap file exists and has room
        before = store.stats()
        await store.put_many(items)
        after = store.stats()
        # 64 entries of 4-10 KiB, back to back: well under one 1 MiB block.
        assert after.write_requests - before.write_requests == 1
        assert after.syncs - before.syncs == 1
        assert after.manifest_commits - before.manifest_commits == 1
        assert after.puts - before.puts == 64
        got = await store.get_many(list(items))
        assert store.stats().read_requests - after.read_requests == 1
        assert all(same_bytes(items[k], g) for k, g in zip(items, got))
        # In another order the same extents are found and still read together.
        keys = sorted(items, key=lambda k: -int(k[1:]))
        got = await store.get_many(keys)
        assert all(same_bytes(items[k], g) for k, g in zip(keys, got))
        assert store.stats().read_requests - after.read_requests == 2
    # Each entry has its own record and CRC: a reopened store reads them one by one.
    async with await tiered.TieredStore.open_async(batch_config(tmp_path / "s")) as store:
        for key, want in items.items():
            assert same_bytes(want, await store.get(key))
        space = store.nvme_space()
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes


async def test_striped_directories_and_large_entries_in_one_batch(tmp_path):
    cfg = batch_config(tmp_path / "s", nvme_paths=[str(tmp_path / "a"), str(tmp_path / "b")], block_size=64 * KiB)
    items = {f"big{i}": random_tensor((300 * KiB + i,), torch.uint8, seed=i) for i in range(3)}
    items.update({f"small{i}": random_tensor((3000,), torch.int32, seed=9 + i) for i in range(30)})
    async with await tiered.TieredStore.open_async(cfg) as store:
        await store.put_many(items)
        got = await store.get_many(list(items))
        assert all(same_bytes(items[k], g) for k, g in zip(items, got))
    async with await tiered.TieredStore.open_async(cfg) as store:
        got = await store.get_many(list(items))
        assert all(same_bytes(items[k], g) for k, g in zip(items, got))


async def test_overwrites_free_the_old_extents_and_keep_pins(store):
    await store.put_many({"a": torch.ones(5000), "b": torch.ones(3000)})
    await store.pin("a")
    space = store.nvme_space().allocated_bytes
    for i in range(5):
        await store.put_many({"a": torch.full((5000,), float(i)), "b": torch.full((3000,), -float(i))})
    assert store.nvme_space().allocated_bytes == space
    assert store.info("a").pinned and not store.info("b").pinned
    a, b = await store.get_many(["a", "b"])
    assert torch.equal(a, torch.full((5000,), 4.0)) and torch.equal(b, torch.full((3000,), -4.0))


async def test_compressed_batch(store):
    items = {f"k{i}": torch.randn(20_000).to(torch.bfloat16) for i in range(8)}
    await store.put_many(items, compress=True)
    assert all(store.info(k).codec != "raw" for k in items)
    got = await store.get_many(list(items))
    assert all(same_bytes(items[k], g) for k, g in zip(items, got))


async def test_reads_from_every_tier_in_one_call(store):
    await store.put("d", torch.arange(10.0), tier="device")
    await store.put("h", torch.arange(20.0), tier="host")
    await store.put("n", torch.arange(30.0), tier="nvme")
    d, n, h = await store.get_many(["d", "n", "h"])
    assert torch.equal(d, torch.arange(10.0)) and torch.equal(h, torch.arange(20.0))
    assert torch.equal(n, torch.arange(30.0))
    assert store.stats().gets == 3


async def test_bad_input_is_refused_before_anything_is_stored(store):
    with pytest.raises(ValueError, match="'a'"):
        await store.put_many([("a", torch.ones(1)), ("b", torch.ones(1)), ("a", torch.zeros(1))])
    with pytest.raises(TypeError, match="str"):
        await store.put_many({"a": torch.ones(1), 3: torch.ones(1)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="Tensor"):
        await store.put_many({"a": torch.ones(1), "b": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="pairs"):
        await store.put_many([("a", torch.ones(1), "extra")])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="mapping"):
        await store.put_many(torch.ones(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'warm'"):
        await store.put_many({"a": torch.ones(1)}, tier="warm")
    assert store.keys() == []
    await store.put_many({"a": torch.ones(1), "b": torch.ones(2)})
    with pytest.raises(ValueError, match="'b'"):
        await store.get_many(["b", "a", "b"])
    with pytest.raises(tiered.KeyNotFoundError, match="'x'.*'y'"):
        await store.get_many(["a", "x", "b", "y"])
    with pytest.raises(TypeError, match="sequence of keys"):
        await store.get_many("ab")
    with pytest.raises(ValueError, match="one tensor"):
        await store.get_many(["a", "b"], out=[None])
    with pytest.raises(ValueError, match="shape"):
        await store.get_many(["a", "b"], out=[None, torch.empty(5)])
    await store.put_many({})
    assert await store.get_many([]) == []


async def test_batched_put_over_the_host_budget_evicts_to_nvme(store):
    # 12 x 256 KiB into a 2 MiB host tier: earlier entries are written down to make room.
    items = {f"k{i}": random_tensor((64 * KiB,), torch.float32, seed=i) for i in range(12)}
    await store.put_many(items, tier="host")
    stats = store.stats()
    assert stats.tiers[Tier.HOST].used_bytes <= 2 * MiB
    assert stats.tiers[Tier.HOST].evictions >= 4
    assert sum(Tier.NVME in store.info(k).tiers for k in items) >= 4
    got = await store.get_many(list(items))
    assert all(same_bytes(items[k], g) for k, g in zip(items, got))
    await store.flush()
    assert not any(store.info(k).dirty for k in items)


async def test_batched_put_over_the_nvme_budget_fails_and_keeps_old_values(tmp_path):
    cfg = batch_config(tmp_path / "s", nvme_bytes=256 * KiB)
    async with await tiered.TieredStore.open_async(cfg) as store:
        await store.put_many({"a": torch.zeros(1000), "b": torch.zeros(1000)})
        with pytest.raises(tiered.CapacityError, match=r"'a'.*'b'.*'c'"):
            await store.put_many({f"{k}": torch.ones(30_000) for k in "abc"})  # 3 x 120 KB > 248 KiB free
        assert "c" not in store
        a, b = await store.get_many(["a", "b"])
        assert torch.equal(a, torch.zeros(1000)) and torch.equal(b, torch.zeros(1000))
        space = store.nvme_space()
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes == 8 * KiB


def _failing_file_writes(real, fd: int):
    def pwritev(f, views, offset):
        if f == fd:
            raise OSError(5, "Input/output error")
        return real(f, views, offset)

    return pwritev


async def test_a_failed_block_fails_only_its_keys(tmp_path):
    cfg = batch_config(tmp_path / "s", nvme_paths=[str(tmp_path / "a"), str(tmp_path / "b")], block_size=64 * KiB)
    async with await tiered.TieredStore.open_async(cfg) as store:
        old = {f"k{i}": torch.full((20_000,), -1.0) for i in range(6)}
        await store.put_many(old)
        new = {f"k{i}": torch.full((20_000,), float(i)) for i in range(6)}  # 80 KB each: striped over a/ and b/
        new["small"] = torch.ones(10)
        bad = store._nvme.files[2]  # the first swap file under b/
        real = store._io.syscalls
        store._io.syscalls = Syscalls(pwritev=_failing_file_writes(real.pwritev, bad.handle.fd))
        try:
            with pytest.raises(tiered.TransferError) as info:
                await store.put_many(new)
        finally:
            store._io.syscalls = real
        message = str(info.value)
        failed = [k for k in new if repr(k) in message.split("first error")[0]]
        assert failed, message
        for key in new:
            if key in failed:
                want = old.get(key)
                if want is None:
                    assert key not in store
                else:
                    assert torch.equal(await store.get(key), want)
            else:
                assert torch.equal(await store.get(key), new[key])
        space = store.nvme_space()
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes
        await store.put_many(new)  # the store is still usable
        assert all(torch.equal(g, new[k]) for k, g in zip(new, await store.get_many(list(new))))


async def test_an_atomic_batch_with_a_failed_block_stores_nothing(tmp_path):
    cfg = batch_config(tmp_path / "s", nvme_paths=[str(tmp_path / "a"), str(tmp_path / "b")], block_size=64 * KiB)
    async with await tiered.TieredStore.open_async(cfg) as store:
        old = {f"k{i}": torch.full((20_000,), -1.0) for i in range(6)}
        await store.put_many(old)
        new = {f"k{i}": torch.full((20_000,), float(i)) for i in range(6)}
        new["small"] = torch.ones(10)
        bad = store._nvme.files[2]
        real = store._io.syscalls
        store._io.syscalls = Syscalls(pwritev=_failing_file_writes(real.pwritev, bad.handle.fd))
        try:
            with pytest.raises(tiered.TransferError, match="stored nothing"):
                await store.put_many(new, atomic=True)
        finally:
            store._io.syscalls = real
        assert "small" not in store
        got = await store.get_many(list(old))
        assert all(torch.equal(g, old[k]) for k, g in zip(old, got))
        space = store.nvme_space()
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes
        commits = store.stats().manifest_commits
        await store.put_many(new, compress={"k1": True, "small": False}, atomic=True)
        assert store.stats().manifest_commits == commits + 1  # one transaction for the whole batch
        assert store.info("k1").codec == "bplane-zstd" and store.info("k0").codec == "raw"
        assert all(torch.equal(g, new[k]) for k, g in zip(new, await store.get_many(list(new))))


async def test_atomic_batches_refuse_memory_tiers_and_bad_compress_maps(store):
    with pytest.raises(ValueError, match="atomic=True"):
        await store.put_many({"a": torch.ones(3)}, tier="host", atomic=True)
    with pytest.raises(ValueError, match="not in the batch"):
        await store.put_many({"a": torch.ones(3)}, compress={"b": True})
    with pytest.raises(TypeError, match="compress"):
        store.sync.put_many({"a": torch.ones(3)}, compress={"a": "yes"})
    with pytest.raises(TypeError, match="atomic"):
        store.sync.put_many({"a": torch.ones(3)}, atomic=1)
    assert "a" not in store


async def test_flush_of_some_keys_writes_only_those_and_keeps_the_host_copies(store):
    await store.put_many({"a": torch.ones(1000), "b": torch.zeros(1000)}, tier="host")
    await store.flush(["a"])
    assert store.info("a").tiers == (Tier.HOST, Tier.NVME) and not store.info("a").dirty
    assert store.info("b").dirty
    with pytest.raises(tiered.KeyNotFoundError, match="'nope'"):
        store.sync.flush(["b", "nope"])
    with pytest.raises(TypeError, match="flush takes a sequence of keys"):
        await store.flush("a")


async def test_a_corrupt_entry_fails_only_its_own_key(tmp_path):
    items = {f"k{i}": random_tensor((3000,), torch.float32, seed=i) for i in range(10)}
    async with await tiered.TieredStore.open_async(batch_config(tmp_path / "s")) as store:
        await store.put_many(items)
        extent = store._versions.entries["k4"].copies[Tier.NVME].extents[0]
        path = store._nvme.files[extent.file].path
    with open(path, "r+b") as f:  # flip one byte of k4 on disk
        f.seek(extent.offset + 100)
        byte = f.read(1)
        f.seek(extent.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    async with await tiered.TieredStore.open_async(batch_config(tmp_path / "s")) as store:
        outs = [torch.empty(3000) for _ in items]
        with pytest.raises(tiered.ChecksumError, match="'k4'") as info:
            await store.get_many(list(items), out=outs)
        assert "'k3'" not in str(info.value) and "'k5'" not in str(info.value)
        for (key, want), out in zip(items.items(), outs):
            if key != "k4":
                assert same_bytes(want, out), key  # the rest of the block was delivered


async def test_concurrent_batches_and_single_calls_on_overlapping_keys(store):
    keys = [f"k{i}" for i in range(16)]

    async def batch(value: float) -> None:
        await store.put_many({k: torch.full((2000,), value) for k in reversed(keys)})

    async def single(key: str, value: float) -> None:
        await store.put(key, torch.full((2000,), value))

    await batch(-1.0)
    calls = [batch(float(v)) for v in range(6)] + [single(k, 100.0 + i) for i, k in enumerate(keys)]
    random.Random(3).shuffle(calls)
    await asyncio.gather(*calls, *(store.get_many(keys[:4]) for _ in range(3)), return_exceptions=False)
    got = await store.get_many(keys)
    for g in got:  # every key holds one whole value
        assert torch.equal(g, torch.full((2000,), g[0].item()))
    space = store.nvme_space()
    assert space.allocated_bytes == space.charged_bytes == space.entry_bytes


def test_sync_facade_from_many_threads(tmp_path):
    with tiered.TieredStore.open(batch_config(tmp_path / "s")) as store:
        errors: list[BaseException] = []

        def worker(w: int) -> None:
            try:
                for r in range(5):
                    items = {f"w{w}/k{i}": torch.full((1000 + i,), float(r)) for i in range(10)}
                    store.sync.put_many(items)
                    got = store.sync.get_many(list(items))
                    assert all(torch.equal(g, t) for g, t in zip(got, items.values()))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(store) == 40


async def test_key_locks_hand_over_in_order_and_survive_cancellation():
    locks = KeyLocks()
    await locks.acquire("a")
    order: list[int] = []

    async def waiter(n: int) -> None:
        await locks.acquire("a")
        order.append(n)
        await asyncio.sleep(0)
        locks.release("a")

    tasks = [asyncio.create_task(waiter(n)) for n in range(4)]
    await asyncio.sleep(0)
    tasks[1].cancel()  # cancelled while waiting
    locks.release("a")
    await asyncio.sleep(0)
    tasks[2].cancel()  # may already own the lock: it must pass it on
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert order[0] == 0 and 1 not in order and order[-1] == 3, order
    assert isinstance(results[1], asyncio.CancelledError)
    assert not locks.locked("a")
    assert await locks.acquire_all(["b", "a"]) == ["a", "b"]
    locks.release_all(["a", "b"])
    assert not locks.locked("a") and not locks.locked("b")


class TestBatchedConformance(conformance.TestStoreConformance):
    """The store's conformance suite with every put and get made through put_many / get_many."""

    @pytest.fixture
    async def store(self, config):
        s = await tiered.TieredStore.open_async(config)
        yield _Batched(s)
        await s.close()


class _Batched:
    """A store whose put and get go through the batched calls, one key at a time."""

    def __init__(self, store: tiered.TieredStore) -> None:
        self._store = store

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def __contains__(self, key: object) -> bool:
        return key in self._store

    async def put(self, key, tensor, tier=Tier.NVME, compress=None):  # noqa: ANN001, ANN201
        await self._store.put_many([(key, tensor)], tier=tier, compress=compress)

    async def get(self, key, device="cpu", *, out=None):  # noqa: ANN001, ANN201
        return (await self._store.get_many([key], device, out=[out]))[0]


# ------------------------------------------------------------------------------- crashes

CRASH_KEYS = 24


def crash_value(key: int, generation: int) -> torch.Tensor:
    """Key ``key``'s value in round ``generation``: sizes change every round, some are empty."""
    n = (key * 977 + generation * 4099) % 20_000
    if key % 7 == 0:
        n = 0 if generation % 2 else n
    return torch.arange(n, dtype=torch.int32) * (generation + 1) + key


def crash_config(path: str) -> tiered.StoreConfig:
    return batch_config(path, block_size=256 * KiB, swap_grow_bytes=1 * MiB, host_bytes=0, device_bytes=0)


def crash_writer(path: str, journal: str, first: int, atomic: bool = False) -> None:
    """Round after round, put_many every key with the round's values; journal each round's start and end."""
    fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with tiered.TieredStore.open(crash_config(path)) as store:
        for g in itertools.count(first):
            os.write(fd, f"begin {g}\n".encode())
            store.sync.put_many({f"k{i}": crash_value(i, g) for i in range(CRASH_KEYS)}, atomic=atomic)
            os.write(fd, f"end {g}\n".encode())


def _journal(path: str) -> tuple[int, int]:
    """(last round begun, last round ended); -1 when none."""
    begun = ended = -1
    with open(path) as f:
        for line in f.read().splitlines():
            parts = line.split()
            if len(parts) != 2 or not parts[1].isdigit():
                continue
            if parts[0] == "begin":
                begun = int(parts[1])
            elif parts[0] == "end":
                ended = int(parts[1])
    return begun, ended


@pytest.mark.timeout(120)
@pytest.mark.parametrize("atomic", [False, True])
def test_put_many_killed_mid_way_leaves_every_key_old_or_new(tmp_path, atomic):
    """Any batch: each key old or new. An atomic batch: every key from the same round."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tiered", __name__])
    rng = random.Random(5)
    path = str(tmp_path / "store")
    allowed: dict[int, set[int]] = {i: {-1} for i in range(CRASH_KEYS)}  # -1: absent
    first = 0
    for kill in range(5):
        journal = str(tmp_path / f"journal-{kill}")
        proc = ctx.Process(target=crash_writer, args=(path, journal, first, atomic))
        proc.start()
        deadline = time.monotonic() + 60
        while proc.exitcode is None and time.monotonic() < deadline:  # let a few rounds return first
            if os.path.exists(journal) and _journal(journal)[1] >= first + 1:
                break
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.03))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL, proc.exitcode
        begun, ended = _journal(journal)
        assert ended >= first + 1
        for i in range(CRASH_KEYS):
            allowed[i] = {ended} | ({begun} if begun > ended else set())
        with tiered.TieredStore.open(crash_config(path)) as store:
            seen = set()
            common = set(allowed[0])
            for i in range(CRASH_KEYS):
                got = store.sync.get(f"k{i}")
                match = [g for g in allowed[i] if same_bytes(got, crash_value(i, g))]
                assert match, f"k{i} after kill {kill}: neither of rounds {sorted(allowed[i])}"
                seen.add(match[0])
                common &= set(match)
            assert sorted(store.keys()) == sorted(f"k{i}" for i in range(CRASH_KEYS))
            if atomic:
                assert common, f"an atomic batch was torn by kill {kill}: keys from rounds {sorted(seen)}"
            space = store.nvme_space()
            assert space.allocated_bytes == space.charged_bytes == space.entry_bytes, space
        first = max(begun, ended) + 1
