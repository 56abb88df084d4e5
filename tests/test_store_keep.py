"""put / put_many / get with keep=: a clean copy kept in a faster tier when the eviction policy finds
it worth the room (Belady with bypass given the access order), never at the cost of the call."""

from __future__ import annotations

import pytest
import torch

import tiered
from tiered import Tier

from conftest import KiB, MiB

ENTRY = 256 * KiB  # 64 Ki fp32 elements


def keep_config(path, **changes) -> tiered.StoreConfig:
    settings = dict(path=str(path), device_bytes=0, host_bytes=4 * ENTRY, block_size=256 * KiB, queue_depth=8,
                    io_threads=2, swap_grow_bytes=4 * MiB, result_pool_bytes=0, prefault_host=False)
    settings.update(changes)
    return tiered.StoreConfig(**settings)


def value(i: int) -> torch.Tensor:
    return torch.full((ENTRY // 4,), float(i))


def test_write_through_keeps_a_clean_host_copy_and_reads_it_without_io(tmp_path):
    with tiered.TieredStore.open(keep_config(tmp_path / "s")) as store:
        store.sync.put("a", value(1), keep="host")
        store.sync.put_many({"b": value(2), "c": value(3)}, keep="host", atomic=True)
        for key in "abc":
            info = store.info(key)
            assert info.tiers == (Tier.HOST, Tier.NVME) and not info.dirty  # durable, and cached
        read = store.stats().bytes_read
        assert torch.equal(store.sync.get("b"), value(2)) and store.stats().bytes_read == read  # from host memory
        with pytest.raises(ValueError, match="keep must be a tier faster"):
            store.sync.put("x", value(0), tier="host", keep="host")
        with pytest.raises(ValueError, match="keep must be a tier faster"):
            store.sync.get("a", keep="nvme")
        assert "x" not in store


def test_a_read_keeps_what_is_read_again_soonest_in_a_repeating_order(tmp_path):
    """Eight entries read in a repeating order through a host tier that holds four: with the order
    given, the kept copies are the entries read again soonest, and the ones read later are passed by
    (not kept at the cost of a sooner one), so every cycle after the first reads half of them from memory;
    without keep=, nothing is promoted."""
    keys = [f"k{i}" for i in range(8)]
    with tiered.TieredStore.open(keep_config(tmp_path / "s")) as store:
        store.sync.put_many({k: value(i) for i, k in enumerate(keys)})
        for k in keys:
            store.sync.get(k)
        assert store.stats().tiers[Tier.HOST].entries == 0  # a plain get does not promote
        order = keys + keys[::-1]  # forward, then backward: the engine's pattern
        store.set_access_order(order)
        hits = []
        for cycle in range(4):
            before = store.stats().tiers[Tier.HOST].hits
            for k in order:
                assert torch.equal(store.sync.get(k, keep="host"), value(int(k[1:])))
            hits.append(store.stats().tiers[Tier.HOST].hits - before)
        assert store.stats().tiers[Tier.HOST].used_bytes <= 4 * ENTRY
        # Belady keeps four entries at a time; in a mirrored order each kept entry is hit on both passes.
        assert hits[1:] == [hits[1]] * 3 and hits[1] >= 8, hits


def test_a_kept_copy_never_fails_or_blocks_the_call(tmp_path):
    with tiered.TieredStore.open(keep_config(tmp_path / "s", host_bytes=ENTRY)) as store:
        store.sync.put("pinned", value(9), tier="host")
        store.sync.pin("pinned")  # the host tier is full and nothing in it can go
        store.sync.put("a", value(1), keep="host")
        assert store.info("a").tiers == (Tier.NVME,)
        assert torch.equal(store.sync.get("a", keep="host"), value(1))
        big = torch.zeros(2 * ENTRY // 4)  # larger than the whole host tier
        store.sync.put("big", big, keep="host")
        assert store.info("big").tiers == (Tier.NVME,)
