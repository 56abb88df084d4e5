"""SyncStore.get_future / put_future / delete_future: the non-blocking calls the engine's hooks use."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

import tiered
from engine_models import store_config


@pytest.fixture
def sync_store(tmp_path):
    store = tiered.TieredStore.open(store_config(tmp_path, host_bytes=16 * 1024))
    yield store
    store.sync.close()


def test_put_future_then_get_future_into_out(sync_store):
    tensors = {f"k{i}": torch.randn(1000 + i) for i in range(12)}
    puts = [sync_store.sync.put_future(k, t, tier="host") for k, t in tensors.items()]
    assert all(isinstance(f, concurrent.futures.Future) for f in puts)
    concurrent.futures.wait(puts)
    assert all(f.result() is None for f in puts)
    assert sync_store.stats().tiers["host"].evictions > 0  # 12 x 4 KiB+ over a 16 KiB host tier
    outs = {k: torch.empty_like(t) for k, t in tensors.items()}
    gets = {k: sync_store.sync.get_future(k, out=outs[k]) for k in tensors}
    for key, future in gets.items():
        assert future.result() is outs[key]
        assert torch.equal(outs[key], tensors[key])


def test_get_future_without_out_returns_a_new_tensor(sync_store):
    value = torch.arange(10, dtype=torch.int64)
    sync_store.sync.put_future("a", value, tier="nvme").result()
    got = sync_store.sync.get_future("a").result()
    assert torch.equal(got, value) and got.data_ptr() != value.data_ptr()


def test_errors_arrive_through_the_future(sync_store):
    future = sync_store.sync.get_future("missing")
    with pytest.raises(tiered.KeyNotFoundError):
        future.result()
    sync_store.sync.put("b", torch.ones(4))
    with pytest.raises(ValueError, match="out must be contiguous"):
        sync_store.sync.get_future("b", out=torch.empty(5)).result()


def test_delete_future_removes_the_key_durably(tmp_path):
    config = store_config(tmp_path)
    with tiered.TieredStore.open(config) as store:
        store.sync.put("a", torch.ones(1024), tier="nvme")
        future = store.sync.delete_future("a")
        assert future.result() is None and "a" not in store
        with pytest.raises(tiered.KeyNotFoundError):
            store.sync.delete_future("a").result()
    with tiered.TieredStore.open(config) as store:  # the delete was committed
        assert "a" not in store


def test_calls_after_close_raise_at_once(tmp_path):
    store = tiered.TieredStore.open(store_config(tmp_path))
    store.sync.close()
    with pytest.raises(tiered.StoreClosedError):
        store.sync.get_future("a")
    with pytest.raises(tiered.StoreClosedError):
        store.sync.put_future("a", torch.ones(1))
    with pytest.raises(tiered.StoreClosedError):
        store.sync.delete_future("a")
