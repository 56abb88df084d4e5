"""Concurrency: many callers at once, from asyncio tasks, threads and several event loops.

Every test runs a real store over real swap files with budgets tight enough that concurrent
operations race with evictions and write-downs. Results are checked for content, not timing: a
get must return bit-exactly one of the values that were put under its key, a key a single caller
owns must return exactly that caller's last value, and a closed store must reopen to the same data.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import random
import threading
import time

import numpy as np
import pytest
import torch

import tiered
from tiered import KeyNotFoundError, Tier, TieredStore

KiB = 1024
MiB = 1024 * KiB

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16, torch.complex64, torch.bool]
MEMORY_TIERS = (Tier.DEVICE, Tier.HOST)
PINNABLE = "pinnable"

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------- helpers


def make_config(path, **changes) -> tiered.StoreConfig:
    """Small budgets and blocks, so a few tensors overflow a tier and transfers span several blocks."""
    settings = dict(
        path=str(path),
        device_bytes=256 * KiB,
        host_bytes=512 * KiB,
        block_size=16 * KiB,
        queue_depth=4,
        io_threads=4,
        cpu_threads=2,
        swap_grow_bytes=1 * MiB,
    )
    settings.update(changes)
    return tiered.StoreConfig(**settings)


def random_tensor(rng: random.Random, max_bytes: int, min_bytes: int = 0) -> torch.Tensor:
    """Random dtype and shape (0-d and empty included), random bytes (NaN payloads and all)."""
    dtype = rng.choice(DTYPES)
    item = torch.empty(0, dtype=dtype).element_size()
    lo, hi = -(-min_bytes // item), max_bytes // item
    numel = rng.choice([lo, min(max(lo, 1), hi)]) if rng.random() < 0.1 else rng.randint(lo, hi)
    gen = np.random.default_rng(rng.getrandbits(64))
    if dtype is torch.bool:
        flat = torch.from_numpy(gen.integers(0, 2, size=numel, dtype=np.uint8)).view(torch.bool)
    elif numel:
        flat = torch.from_numpy(gen.integers(0, 256, size=numel * item, dtype=np.uint8)).view(dtype)
    else:
        flat = torch.empty(0, dtype=dtype)
    if numel == 1 and rng.random() < 0.5:
        return flat.reshape(())
    if numel % 4 == 0 and numel and rng.random() < 0.5:
        return flat.reshape(4, numel // 4).t()  # non-contiguous: the store must copy it logically
    return flat


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def digest(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """Identity of a value: dtype, shape and a hash of its bytes."""
    return str(t.dtype), tuple(t.shape), hashlib.sha1(raw(t).numpy().tobytes()).hexdigest()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def check_accounting(store: TieredStore) -> None:
    """With nothing in flight, each tier's occupancy is exactly the footprint of its resident copies."""
    stats = store.stats()
    infos = [store.info(k) for k in store.keys()]
    for tier in Tier:
        s = stats.tiers[tier]
        resident = [i for i in infos if tier in i.tiers]
        assert s.entries == len(resident), (tier, s)
        footprint = store._tiers.backends[tier].footprint
        expected = sum(footprint(i.stored_nbytes if tier is Tier.NVME else i.nbytes) for i in resident)
        assert s.used_bytes == expected, (tier, s.used_bytes, expected)
        if s.budget_bytes is not None:
            assert s.used_bytes <= s.budget_bytes, (tier, s)


# ------------------------------------------------------------- (a) one loop, hundreds of operations


@pytest.mark.parametrize(
    "seed, layout",
    [(1, "one-dir"), (2, "one-dir"), (3, "two-dirs"), (4, "two-dirs")],
)
async def test_gather_of_many_operations_on_overlapping_keys(tmp_path, seed, layout):
    dirs = {"nvme_paths": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]} if layout == "two-dirs" else {}
    cfg = make_config(tmp_path / "store", **dirs)
    store = await TieredStore.open_async(cfg)
    rng = random.Random(seed)
    #: PINNABLE is pinned and unpinned as the storm goes on; it stays small so pins never starve a tier.
    keys = [f"k{i}" for i in range(9)] + [PINNABLE]
    written: dict[str, set] = collections.defaultdict(set)
    counts = collections.Counter()

    async def put(key: str, tensor: torch.Tensor, tier: Tier) -> None:
        if key == PINNABLE:
            tensor = tensor.reshape(-1)[: 8 * KiB // tensor.element_size()]
        written[key].add(digest(tensor))  # before the put: a racing get may already see it
        try:
            await store.put(key, tensor, tier)
        except tiered.CapacityError:
            assert counts["modify-entered"], "only modify blocks, holding memory as pins do, fill a tier"
            counts["put-full"] += 1
            return
        counts["put"] += 1

    async def get(key: str) -> None:
        try:
            value = await store.get(key)
        except KeyNotFoundError:
            counts["get-missing"] += 1
            return
        assert digest(value) in written[key], f"get({key!r}) returned a value never put under it"
        counts["get"] += 1

    async def prefetch(key: str, tier: Tier) -> None:
        try:
            handle = store.prefetch(key, tier)
        except KeyNotFoundError:
            return
        try:
            await handle
        except KeyNotFoundError:  # deleted before the transfer started
            return
        except tiered.CapacityError:
            assert counts["modify-entered"], "only modify blocks, holding memory as pins do, fill a tier"
            counts["prefetch-full"] += 1
            return
        counts["prefetch"] += 1

    async def evict(key: str, tier: Tier) -> None:
        try:
            await store.evict(key, tier)
        except KeyNotFoundError:
            return
        except ValueError:
            assert key == PINNABLE, "only a pinned key refuses an evict"
            return
        counts["evict"] += 1

    async def pin(key: str, tier: Tier | None) -> None:
        try:
            await store.pin(key, tier)
        except KeyNotFoundError:
            return
        except tiered.CapacityError:
            assert counts["modify-entered"], "only modify blocks, holding memory as pins do, fill a tier"
            counts["pin-full"] += 1
            return
        counts["pin"] += 1

    async def unpin(key: str) -> None:
        try:
            await store.unpin(key)
        except KeyNotFoundError:
            return
        counts["unpin"] += 1

    async def modify(key: str) -> None:
        try:
            async with store.modify(key) as t:
                counts["modify-entered"] += 1
                new = raw(t).roll(1).clone()  # other bytes, valid for every dtype (bools stay 0 or 1)
                written[key].add(digest(new.view(t.dtype).reshape(t.shape)))
                await asyncio.sleep(0)  # other operations run while the block is open
                raw(t).copy_(new)
        except KeyNotFoundError:
            return
        counts["modify"] += 1

    async def delete(key: str) -> None:
        try:
            await store.delete(key)
        except KeyNotFoundError:
            return
        counts["delete"] += 1

    def random_op():
        key = rng.choice(keys)
        kind = rng.choices(["put", "get", "prefetch", "evict", "delete", "pin", "modify"],
                           weights=[5, 4, 3, 2, 1, 1, 2])[0]
        if kind == "pin":
            return pin(PINNABLE, rng.choice([None, *Tier])) if rng.random() < 0.5 else unpin(PINNABLE)
        if kind == "put":
            return put(key, random_tensor(rng, 96 * KiB), rng.choice(list(Tier)))
        if kind == "get":
            return get(key)
        if kind == "prefetch":
            return prefetch(key, rng.choice(list(Tier)))
        if kind == "evict":
            return evict(key, rng.choice(list(Tier)))
        if kind == "modify":
            return modify(key)
        return delete(key)

    try:
        # Seed every key, then four tasks each launch 60 operations at once.
        await asyncio.gather(*(put(k, random_tensor(rng, 64 * KiB), rng.choice(MEMORY_TIERS)) for k in keys))

        async def worker() -> None:
            await asyncio.gather(*(random_op() for _ in range(60)))

        await asyncio.gather(*(asyncio.create_task(worker()) for _ in range(4)))
        assert counts["put"] > 10 and counts["get"] > 10 and counts["modify"] > 3, counts
        # Whether the random phase evicted depends on the interleaving; ten 96 KiB puts into the
        # 256 KiB device tier, one after another, must.
        evictions = sum(store.stats().tiers[t].evictions for t in MEMORY_TIERS)
        for key in keys:
            await put(key, random_tensor(rng, 96 * KiB, min_bytes=64 * KiB), Tier.DEVICE)
        assert sum(store.stats().tiers[t].evictions for t in MEMORY_TIERS) > evictions

        # Whatever interleaving happened, every surviving key holds one of its values, intact.
        assert set(store.keys()) <= set(keys)
        for key in store.keys():
            assert digest(await store.get(key)) in written[key]
        check_accounting(store)
        if PINNABLE in store:
            await store.unpin(PINNABLE)

        # Sequentially, the last put wins, in every tier.
        final = {}
        for key in keys:
            final[key] = random_tensor(rng, 64 * KiB)
            await store.put(key, final[key], rng.choice(list(Tier)))
        for key in keys:
            assert same(await store.get(key), final[key])
        check_accounting(store)
    finally:
        await store.close()

    reopened = await TieredStore.open_async(cfg)
    try:
        assert sorted(reopened.keys()) == sorted(keys)
        for key in keys:
            assert same(await reopened.get(key), final[key]), key
        check_accounting(reopened)
    finally:
        await reopened.close()


# ---------------------------------------------------------------------- (b) the sync facade, 8 threads


def test_sync_facade_from_eight_threads(tmp_path):
    cfg = make_config(tmp_path / "store", device_bytes=128 * KiB, host_bytes=256 * KiB)
    store = TieredStore.open(cfg)
    shared_keys = [f"shared{i}" for i in range(4)]
    shared_written: dict[str, set] = collections.defaultdict(set)
    lock = threading.Lock()
    start = threading.Barrier(8)

    def worker(n: int) -> dict[str, torch.Tensor | None]:
        rng = random.Random(1000 + n)
        mine = {f"t{n}-{i}": None for i in range(3)}  # key -> last value this thread put (None: absent)
        start.wait()
        for _ in range(40):
            op = rng.choices(
                ["put", "get", "shared-put", "shared-get", "prefetch", "evict", "delete"], weights=[4, 4, 2, 3, 2, 2, 1]
            )[0]
            if op in ("put", "get", "prefetch", "evict", "delete"):
                key = rng.choice(sorted(mine))
            else:
                key = rng.choice(shared_keys)
            if op == "put":
                value = random_tensor(rng, 48 * KiB)
                store.sync.put(key, value, rng.choice(list(Tier)))
                mine[key] = value.contiguous().clone()
            elif op == "get":
                if mine[key] is None:
                    with pytest.raises(KeyNotFoundError):
                        store.sync.get(key)
                else:
                    got = store.sync.get(key)
                    assert same(got, mine[key]), f"thread {n}: {key} is not what it last put"
            elif op == "shared-put":
                value = random_tensor(rng, 48 * KiB)
                with lock:
                    shared_written[key].add(digest(value))
                store.sync.put(key, value, rng.choice(list(Tier)))
            elif op == "shared-get":
                try:
                    got = store.sync.get(key)
                except KeyNotFoundError:
                    continue
                with lock:
                    assert digest(got) in shared_written[key], f"thread {n}: {key} holds a value never put"
            elif op == "prefetch" and mine[key] is not None:
                store.sync.prefetch(key, rng.choice(list(Tier))).result(timeout=60)
            elif op == "evict" and mine[key] is not None:
                store.sync.evict(key, rng.choice(list(Tier)))
            elif op == "delete" and mine[key] is not None:
                store.sync.delete(key)
                mine[key] = None
        return mine

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(worker, range(8)))  # re-raises a worker's assertion
        expected = {k: v for mine in results for k, v in mine.items() if v is not None}
        for key, value in expected.items():
            assert same(store.sync.get(key), value), key
        for key in shared_keys:
            if key in store:
                assert digest(store.sync.get(key)) in shared_written[key]
        assert store.stats().tiers[Tier.DEVICE].evictions + store.stats().tiers[Tier.HOST].evictions > 0
        check_accounting(store)
    finally:
        store.sync.close()

    with TieredStore.open(cfg) as reopened:
        for key, value in expected.items():
            assert same(reopened.sync.get(key), value), key
        absent = {f"t{n}-{i}" for n in range(8) for i in range(3)} - set(expected)
        assert not absent & set(reopened.keys())


# ---------------------------------------------------------- (c) the sync facade on the store's loop


def test_sync_facade_on_the_store_loop_thread_raises(tmp_path):
    store = TieredStore.open(make_config(tmp_path / "store"))
    try:
        value = torch.arange(100, dtype=torch.int64)
        store.sync.put("k", value, "host")
        outcome: concurrent.futures.Future = concurrent.futures.Future()

        def on_loop() -> None:
            errors = []
            for call in (
                lambda: store.sync.get("k"),
                lambda: store.sync.put("k", torch.zeros(3), "host"),
                lambda: store.sync.flush(),
                lambda: store.sync.close(),
            ):
                try:
                    call()
                except BaseException as exc:  # noqa: BLE001 - hand everything to the test thread
                    errors.append(exc)
                else:
                    errors.append(None)
            outcome.set_result(errors)

        store._loop_thread.loop.call_soon_threadsafe(on_loop)
        errors = outcome.result(timeout=30)
        assert all(isinstance(e, RuntimeError) for e in errors), errors
        assert "loop thread" in str(errors[0])
        # Nothing happened and the store still works from a proper thread.
        assert same(store.sync.get("k"), value)
        assert store.info("k").tiers == (Tier.HOST,)
    finally:
        store.sync.close()


# ------------------------------------------------------------------ (d) cancelled prefetch, then close


def big_tensor(nbytes: int, seed: int) -> torch.Tensor:
    gen = np.random.default_rng(seed)
    return torch.from_numpy(gen.integers(0, 256, size=nbytes, dtype=np.uint8)).view(torch.float32)


def wait_until(condition, timeout: float = 30.0) -> None:
    """Poll for a state change made on the store's thread (no timing is asserted)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.001)


def test_cancelled_prefetch_then_close_and_reopen(tmp_path):
    cfg = make_config(tmp_path / "store", host_bytes=64 * MiB, block_size=1 * MiB, device_bytes=0)
    value = big_tensor(32 * MiB, seed=7)
    store = TieredStore.open(cfg)
    try:
        store.sync.put("big", value, "nvme")
        handle = store.sync.prefetch("big", "host")
        wait_until(lambda: store.stats().prefetches == 1)  # the transfer has started
        if handle.cancel():
            assert handle.done()
            with pytest.raises(concurrent.futures.CancelledError):
                handle.result()
        # Only the waiting was cancelled: the get waits for the transfer and reads its host copy.
        assert same(store.sync.get("big"), value)
        assert Tier.HOST in store.info("big").tiers
        stats = store.stats()
        assert stats.transfers == 1 and stats.tiers[Tier.HOST].hits == 1, stats

        # Cancel another one and close at once: close waits for the transfer, not for the handle.
        store.sync.evict("big", "nvme")
        assert store.info("big").tiers == (Tier.NVME,)
        store.sync.prefetch("big", "host").cancel()
    finally:
        store.sync.close()

    with TieredStore.open(cfg) as reopened:
        assert reopened.keys() == ["big"]
        assert same(reopened.sync.get("big"), value)
        check_accounting(reopened)


async def test_cancelled_awaiter_of_prefetch_and_put(tmp_path):
    """Cancelling the caller's task stops its waiting only: the store finishes or never starts
    the operation, and never leaves it half applied."""
    cfg = make_config(tmp_path / "store", host_bytes=64 * MiB, block_size=1 * MiB, device_bytes=0)
    value = big_tensor(16 * MiB, seed=8)
    store = await TieredStore.open_async(cfg)
    try:
        await store.put("big", value, "nvme")
        waiter = asyncio.ensure_future(store.prefetch("big", "host"))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # Either the cancel came before the prefetch started, or the transfer runs on regardless
        # (and the get below waits for it).
        started = store.stats().prefetches == 1
        other = big_tensor(16 * MiB, seed=9)
        putter = asyncio.ensure_future(store.put("other", other, "host"))
        await asyncio.sleep(0)
        putter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await putter
        assert same(await store.get("big"), value)
        if started:
            assert Tier.HOST in store.info("big").tiers
        await store.flush()
        if "other" in store:
            assert same(await store.get("other"), other)
    finally:
        await store.close()
    reopened = await TieredStore.open_async(cfg)
    try:
        assert same(await reopened.get("big"), value)
        if "other" in reopened:
            assert same(await reopened.get("other"), other)
        check_accounting(reopened)
    finally:
        await reopened.close()


# ------------------------------------------------- (e) a get and a duplicate prefetch join a transfer


def test_get_and_duplicate_prefetch_join_the_transfer_in_flight(tmp_path):
    """Scheduled from one callback on the store's loop, so the order is fixed: the first prefetch
    starts the transfer, the second and the get find it in flight. One read of the disk serves all."""
    cfg = make_config(tmp_path / "store", host_bytes=64 * MiB, block_size=1 * MiB, device_bytes=0)
    value = big_tensor(32 * MiB, seed=11)
    with TieredStore.open(cfg) as store:
        store.sync.put("big", value, "nvme")
        before = store.stats()
        loop = store._loop_thread.loop
        started: concurrent.futures.Future = concurrent.futures.Future()

        def on_loop() -> None:
            first = store.prefetch("big", "host")
            second = store.prefetch("big", "host")
            got = asyncio.run_coroutine_threadsafe(store.get("big"), loop)
            started.set_result((first, second, got))

        loop.call_soon_threadsafe(on_loop)
        first, second, got = started.result(timeout=30)
        result = got.result(timeout=60)
        first.result(timeout=60)
        second.result(timeout=60)
        assert same(result, value)

        after = store.stats()
        assert after.prefetches - before.prefetches == 2
        assert after.prefetches_coalesced - before.prefetches_coalesced == 1
        assert after.transfers - before.transfers == 1
        assert after.bytes_read - before.bytes_read == value.numel() * value.element_size()
        # The get waited for the host copy instead of reading the disk a second time.
        assert after.tiers[Tier.HOST].hits - before.tiers[Tier.HOST].hits == 1
        assert after.tiers[Tier.NVME].hits == before.tiers[Tier.NVME].hits
        assert store.info("big").tiers == (Tier.HOST, Tier.NVME)


def test_get_during_prefetch_from_another_thread(tmp_path):
    """The same race from a caller's thread, where the order is not fixed: only correctness."""
    cfg = make_config(tmp_path / "store", host_bytes=64 * MiB, block_size=1 * MiB, device_bytes=0)
    value = big_tensor(32 * MiB, seed=12)
    with TieredStore.open(cfg) as store:
        store.sync.put("big", value, "nvme")
        first = store.sync.prefetch("big", "host")
        second = store.sync.prefetch("big", "host")
        assert same(store.sync.get("big"), value)
        first.result(timeout=60)
        second.result(timeout=60)
        assert Tier.HOST in store.info("big").tiers
        stats = store.stats()
        assert stats.prefetches == 2 and stats.transfers == 1
        # The second prefetch either joined the first or found its copy already installed.
        assert stats.prefetches_coalesced <= 1
        assert same(store.sync.get("big"), value)


# -------------------------------------------------------------- (f) two event loops in two threads


def test_async_api_from_two_event_loops_in_two_threads(tmp_path):
    cfg = make_config(tmp_path / "store")
    store = TieredStore.open(cfg)
    shared_written: dict[str, set] = collections.defaultdict(set)
    lock = threading.Lock()
    start = threading.Barrier(2)

    def thread_main(n: int) -> dict[str, torch.Tensor]:
        async def main() -> dict[str, torch.Tensor]:
            rng = random.Random(77 + n)
            mine: dict[str, torch.Tensor] = {}
            loop_id = id(asyncio.get_running_loop())
            for i in range(30):
                key = f"loop{n}-{i % 4}"
                value = random_tensor(rng, 64 * KiB)
                await store.put(key, value, rng.choice(list(Tier)))
                mine[key] = value.contiguous().clone()
                # Concurrent operations from this loop too.
                other = f"loop{n}-{(i + 1) % 4}"
                results = await asyncio.gather(
                    store.get(key),
                    store.prefetch(key, rng.choice(list(Tier))),
                    store.evict(other, rng.choice(list(Tier))) if other in mine else asyncio.sleep(0),
                    store.get(other) if other in mine else asyncio.sleep(0),
                )
                assert same(results[0], mine[key])
                if other in mine:
                    assert same(results[3], mine[other])
                shared = f"shared{i % 2}"
                shared_value = random_tensor(rng, 32 * KiB)
                with lock:
                    shared_written[shared].add(digest(shared_value))
                await store.put(shared, shared_value, rng.choice(MEMORY_TIERS))
                got = await store.get(shared)
                with lock:
                    assert digest(got) in shared_written[shared]
                assert id(asyncio.get_running_loop()) == loop_id
            return mine

        start.wait()
        return asyncio.run(main())

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(thread_main, range(2)))
        expected = {k: v for r in results for k, v in r.items()}
        for key, value in expected.items():
            assert same(store.sync.get(key), value), key
        check_accounting(store)
    finally:
        # Closing from a third event loop works too.
        asyncio.run(store.close())
    with pytest.raises(tiered.StoreClosedError):
        store.sync.get("shared0")

    with TieredStore.open(cfg) as reopened:
        for key, value in expected.items():
            assert same(reopened.sync.get(key), value), key


# ------------------------------------------- a get races the overwrite of its key and reuse of its space


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.NVME])
async def test_get_is_not_torn_by_overwrite_and_space_reuse(tmp_path, tier):
    """A get reads a big copy while a put replaces the key (freeing the copy) and a second put takes
    the freed space: the copy being read must stay intact until the read ends, so the get returns
    the old value or the new one, never one mixed with the third."""
    cfg = make_config(tmp_path / "store", host_bytes=96 * MiB, block_size=1 * MiB, device_bytes=0)
    store = await TieredStore.open_async(cfg)

    async def replace_then_reuse(new: torch.Tensor, other: torch.Tensor) -> None:
        await store.put("k", new, tier)
        await store.put("x", other, tier)

    try:
        for round_ in range(4):
            old = big_tensor(48 * MiB, seed=3 * round_)
            new = big_tensor(1 * MiB, seed=3 * round_ + 1)
            other = big_tensor(40 * MiB, seed=3 * round_ + 2)
            await store.put("k", old, tier)
            got, _ = await asyncio.gather(store.get("k"), replace_then_reuse(new, other))
            assert same(got, old) or same(got, new), f"round {round_}: the get returned torn bytes"
            assert same(await store.get("k"), new)
            assert same(await store.get("x"), other)
            check_accounting(store)
            await store.delete("x")
    finally:
        await store.close()


# ------------------------------------------------------------------------ close under load, no hang


def test_close_while_threads_are_busy(tmp_path):
    """Eight threads hammer the store while another closes it: every call either completes or
    raises StoreClosedError (none hangs), and whatever completed before the close is what a
    reopened store returns."""
    cfg = make_config(tmp_path / "store", device_bytes=128 * KiB, host_bytes=256 * KiB)
    store = TieredStore.open(cfg)
    started = threading.Barrier(9)

    def worker(n: int) -> dict[str, torch.Tensor]:
        rng = random.Random(500 + n)
        last: dict[str, torch.Tensor] = {}  # key -> value of the last put that returned
        started.wait()
        try:
            for i in range(10_000):
                key = f"t{n}-{i % 3}"
                if key in last and rng.random() < 0.4:
                    assert same(store.sync.get(key), last[key])
                    continue
                value = random_tensor(rng, 32 * KiB)
                tier = rng.choice(list(Tier))
                store.sync.put(key, value, tier)
                last[key] = value.contiguous().clone()
                if rng.random() < 0.2:
                    store.sync.prefetch(key, rng.choice(list(Tier))).result(timeout=60)
        except tiered.StoreClosedError:
            pass
        return last

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(worker, n) for n in range(8)]
        started.wait()
        wait_until(lambda: store.stats().puts >= 200)
        store.sync.close()
        results = [f.result(timeout=60) for f in futures]  # a hung caller fails here

    expected = {k: v for r in results for k, v in r.items()}
    assert len(expected) == 24
    with TieredStore.open(cfg) as reopened:
        assert sorted(reopened.keys()) == sorted(expected)
        for key, value in expected.items():
            assert same(reopened.sync.get(key), value), key
        check_accounting(reopened)
