"""store.modify: a stored tensor changed in place, on real stores over real swap files.

The block writes the store's own memory when the entry is one range of host memory, and a copy
that goes back on exit otherwise; either way the key's other callers wait for the block, the old
version never comes back after a reopen, and nothing is lost when the block or the store ends early.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import torch

import tiered
from tiered import CapacityError, KeyNotFoundError, StoreClosedError, Tier, TieredStore

KiB = 1024
MiB = 1024 * KiB

pytestmark = pytest.mark.timeout(120)


def make_config(tmp_path, **changes) -> tiered.StoreConfig:
    settings = dict(path=str(tmp_path / "store"), host_bytes=1 * MiB, device_bytes=0, block_size=16 * KiB,
                    queue_depth=4, io_threads=2, swap_grow_bytes=1 * MiB)
    settings.update(changes)
    return tiered.StoreConfig(**settings)


def test_a_host_entry_is_changed_where_it_lies(tmp_path):
    with TieredStore.open(make_config(tmp_path)) as store:
        store.sync.put("w", torch.arange(1000, dtype=torch.float32).reshape(10, 100), "host")
        gets = store.stats().gets
        block = store.sync.modify("w")
        with block as t:
            assert block.in_place and t.dtype == torch.float32 and t.shape == (10, 100)
            address = t.data_ptr()
            t.mul_(2)
        with store.sync.modify("w") as again:
            assert again.data_ptr() == address  # the same memory: nothing was copied
        assert store.stats().gets == gets  # and nothing was read
        assert torch.equal(store.sync.get("w"), torch.arange(1000, dtype=torch.float32).reshape(10, 100) * 2)
        info = store.info("w")
        assert info.tiers == (Tier.HOST,) and info.dirty


def test_an_nvme_entry_is_read_and_put_back_durably(tmp_path):
    config = make_config(tmp_path, flush_on_close=False)
    with TieredStore.open(config) as store:
        store.sync.put("w", torch.ones(5000, dtype=torch.bfloat16), "nvme", compress=True)
        block = store.sync.modify("w")
        with block as t:
            assert not block.in_place
            t.add_(1)
        info = store.info("w")
        assert info.tiers == (Tier.NVME,) and not info.dirty and info.codec == "bplane-zstd"  # compressed again
    with TieredStore.open(config) as store:  # no flush at close: the put back was durable by itself
        assert torch.equal(store.sync.get("w"), torch.full((5000,), 2, dtype=torch.bfloat16))


def test_an_nvme_entry_can_go_back_to_memory(tmp_path):
    with TieredStore.open(make_config(tmp_path)) as store:
        store.sync.put("w", torch.ones(100), "nvme")
        with store.sync.modify("w", "host") as t:
            t.add_(1)
        assert store.info("w").tiers == (Tier.HOST,)  # the committed nvme version was retired
        with pytest.raises(ValueError):
            store.sync.modify("w", "disk")
    with TieredStore.open(make_config(tmp_path)) as store:  # written down at close
        assert torch.equal(store.sync.get("w"), torch.full((100,), 2.0))


def test_a_scattered_host_entry_is_copied_back_without_new_room(tmp_path):
    with TieredStore.open(make_config(tmp_path, host_bytes=16 * KiB)) as store:
        for i in range(4):
            store.sync.put(f"page{i}", torch.full((1024,), float(i)), "host")  # one 4 KiB page each
        store.sync.delete("page1")
        store.sync.delete("page3")
        store.sync.put("two", torch.arange(2048, dtype=torch.float32), "host")  # pages 1 and 3: two ranges
        used = store.stats().tiers[Tier.HOST].used_bytes
        block = store.sync.modify("two")
        with block as t:
            assert not block.in_place
            t.neg_()
        assert store.stats().tiers[Tier.HOST].used_bytes == used and store.info("two").tiers == (Tier.HOST,)
        assert torch.equal(store.sync.get("two"), -torch.arange(2048, dtype=torch.float32))
        assert torch.equal(store.sync.get("page2"), torch.full((1024,), 2.0))


@pytest.mark.parametrize("flush_on_close", [True, False])
def test_a_committed_version_never_comes_back(tmp_path, flush_on_close):
    config = make_config(tmp_path, flush_on_close=flush_on_close)
    with TieredStore.open(config) as store:
        store.sync.put("w", torch.zeros(100), "host")
        store.sync.flush()  # committed on nvme, with its host copy kept
        assert store.info("w").tiers == (Tier.HOST, Tier.NVME)
        with store.sync.modify("w") as t:
            t.fill_(7)
        assert store.info("w").tiers == (Tier.HOST,)  # the stale nvme copy is gone
    with TieredStore.open(config) as store:
        if flush_on_close:
            assert torch.equal(store.sync.get("w"), torch.full((100,), 7.0))
        else:  # the new version lived in host memory only: the key is gone, not rolled back
            assert "w" not in store


def test_a_failed_tombstone_leaves_the_old_bytes_and_the_key_free(tmp_path, monkeypatch):
    with TieredStore.open(make_config(tmp_path)) as store:
        store.sync.put("w", torch.zeros(100), "host")
        store.sync.flush()  # committed: a block must retire that record durably first

        def refuse(*args, **kwargs):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(store._commits, "submit", refuse)
        with pytest.raises(OSError, match="Input/output error"):
            with store.sync.modify("w"):
                pytest.fail("the block must not run")
        monkeypatch.undo()
        assert torch.equal(store.sync.get("w"), torch.zeros(100))
        with store.sync.modify("w") as t:  # neither the key nor its memory is held
            t.fill_(1)
        assert torch.equal(store.sync.get("w"), torch.ones(100))


def test_a_get_from_another_thread_waits_for_the_block(tmp_path):
    with TieredStore.open(make_config(tmp_path)) as store:
        store.sync.put("w", torch.zeros(1000), "host")
        seen = []
        with store.sync.modify("w") as t:
            t.fill_(1)
            reader = threading.Thread(target=lambda: seen.append(store.sync.get("w")))
            reader.start()
            time.sleep(0.2)
            assert not seen  # still waiting
            t.fill_(2)
        reader.join(30)
        assert len(seen) == 1 and torch.equal(seen[0], torch.full((1000,), 2.0))


def test_a_block_that_raises_keeps_what_it_wrote(tmp_path):
    with TieredStore.open(make_config(tmp_path)) as store:
        for key, tier in (("host", "host"), ("nvme", "nvme")):
            store.sync.put(key, torch.zeros(10), tier)
            with pytest.raises(ZeroDivisionError):
                with store.sync.modify(key) as t:
                    t[:5] = 1
                    1 / 0
            assert torch.equal(store.sync.get(key), torch.tensor([1.0] * 5 + [0.0] * 5)), key


def test_a_held_entry_is_not_evicted_and_a_put_needing_its_room_fails(tmp_path):
    with TieredStore.open(make_config(tmp_path, host_bytes=64 * KiB)) as store:
        store.sync.put("held", torch.zeros(12 * 1024), "host")  # 48 KiB
        with store.sync.modify("held") as t:
            t.fill_(3)
            with pytest.raises(CapacityError, match="held by modify blocks"):
                store.sync.put("other", torch.zeros(8 * 1024), "host")  # 32 KiB: only evicting "held" would do
            assert store.info("held").tiers == (Tier.HOST,)
        store.sync.put("other", torch.zeros(8 * 1024), "host")  # the block ended: "held" may be written down
        assert torch.equal(store.sync.get("held"), torch.full((12 * 1024,), 3.0))


async def test_async_blocks_on_many_keys_at_once(tmp_path):
    store = await TieredStore.open_async(make_config(tmp_path))
    try:
        for i in range(8):
            await store.put(f"k{i}", torch.full((100,), float(i)), "host" if i % 2 else "nvme")
        async with contextlib.AsyncExitStack() as blocks:
            tensors = [await blocks.enter_async_context(store.modify(f"k{i}")) for i in range(8)]
            for t in tensors:
                t.add_(10)
        for i in range(8):
            assert torch.equal(await store.get(f"k{i}"), torch.full((100,), i + 10.0))
    finally:
        await store.close()


async def test_a_caller_cancelled_while_a_block_opens_leaves_the_key_usable(tmp_path):
    store = await TieredStore.open_async(make_config(tmp_path))
    try:
        await store.put("w", torch.zeros(4), "host")
        for turns in range(12):  # cancel at different moments of the opening
            block = store.modify("w")
            opening = asyncio.ensure_future(block.__aenter__())
            for _ in range(turns):
                await asyncio.sleep(0)
            opening.cancel()
            try:
                t = await opening
            except asyncio.CancelledError:
                pass
            else:  # it opened before the cancel arrived: the caller owns the block
                t.add_(1)
                await block.__aexit__(None, None, None)
            await asyncio.wait_for(store.get("w"), 10)  # not locked for ever
        async with store.modify("w") as t:
            t.add_(1)
        assert float((await store.get("w"))[0]) >= 1
    finally:
        await store.close()


def test_misuse_is_refused_with_the_reason(tmp_path):
    store = TieredStore.open(make_config(tmp_path))
    store.sync.put("w", torch.zeros(4), "host")
    with pytest.raises(KeyNotFoundError):
        with store.sync.modify("absent"):
            pass
    block = store.sync.modify("w")
    with pytest.raises(RuntimeError, match="not open"):
        block.in_place
    with block:
        with pytest.raises(RuntimeError, match="already open"):
            block.__enter__()
    with pytest.raises(TypeError):
        store.modify(3)  # type: ignore[arg-type]
    store.sync.close()
    with pytest.raises(StoreClosedError):
        store.modify("w")


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_close_during_a_block_ends_it(tmp_path, tier):
    config = make_config(tmp_path)
    store = TieredStore.open(config)
    store.sync.put("w", torch.zeros(8), tier)
    block = store.sync.modify("w")
    t = block.__enter__()
    t.fill_(5)
    store.sync.close()  # does not wait for the block
    with pytest.raises(StoreClosedError, match="kept" if tier == "host" else "not stored"):
        block.__exit__(None, None, None)
    with TieredStore.open(config) as store:
        assert torch.equal(store.sync.get("w"), torch.full((8,), 5.0 if tier == "host" else 0.0))
