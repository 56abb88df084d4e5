"""fork() beside an open store: the store stays the opening process's; a child gets a typed error
at once from every call, exits without waiting for the store, and holds none of its locks."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
import torch

import tiered

from conftest import KiB, MiB

pytestmark = pytest.mark.timeout(120)

#: Seconds a child gets for what takes milliseconds; beyond it, it hangs.
PATIENCE_S = 30


def fork_config(path) -> tiered.StoreConfig:
    return tiered.StoreConfig(path=str(path), device_bytes=0, host_bytes=1 * MiB, block_size=64 * KiB,
                              io_threads=2, swap_grow_bytes=1 * MiB, result_pool_bytes=0)


def touch_store(store: tiered.TieredStore, results) -> None:
    """In a forked child: every kind of call raises StoreForkedError at once; report what each did."""
    calls = {
        "get": lambda: store.sync.get("k"),
        "put": lambda: store.sync.put("k", torch.ones(3)),
        "async get": lambda: __import__("asyncio").run(store.get("k")),
        "prefetch": lambda: store.prefetch("k"),
        "info": lambda: store.info("k"),
        "keys": lambda: store.keys(),
        "close": lambda: store.sync.close(),
    }
    for name, call in calls.items():
        try:
            call()
        except tiered.StoreForkedError as exc:
            results.put((name, "StoreForkedError", str(exc)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            results.put((name, type(exc).__name__, str(exc)))
        else:
            results.put((name, "returned", ""))


def test_a_forked_child_gets_a_typed_error_and_exits(tmp_path):
    ctx = multiprocessing.get_context("fork")
    with tiered.TieredStore.open(fork_config(tmp_path / "s")) as store:
        store.sync.put("k", torch.arange(10.0))
        results = ctx.Queue()
        child = ctx.Process(target=touch_store, args=(store, results))
        child.start()
        got = {}
        try:
            for _ in range(7):
                name, kind, message = results.get(timeout=PATIENCE_S)
                got[name] = (kind, message)
            child.join(PATIENCE_S)
        finally:
            if child.exitcode is None:
                os.kill(child.pid, signal.SIGKILL)
                child.join()
        assert child.exitcode == 0, f"the child did not exit by itself (exit code {child.exitcode})"
        assert {name: kind for name, (kind, _) in got.items()} == dict.fromkeys(got, "StoreForkedError"), got
        assert str(os.getpid()) in got["get"][1], got["get"]
        assert torch.equal(store.sync.get("k"), torch.arange(10.0))  # the parent's store is untouched


def wait_for(event, results) -> None:
    """A child that does nothing with the store: it lives until told to exit."""
    results.put("started")
    event.wait(PATIENCE_S * 2)


def test_the_parent_reopens_its_store_while_a_child_lives(tmp_path):
    ctx = multiprocessing.get_context("fork")
    cfg = fork_config(tmp_path / "s")
    store = tiered.TieredStore.open(cfg)
    store.sync.put("k", torch.ones(4))
    stop, results = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=wait_for, args=(stop, results))
    child.start()
    try:
        assert results.get(timeout=PATIENCE_S) == "started"
        store.sync.close()
        with tiered.TieredStore.open(cfg) as again:  # no descriptor in the child keeps the lock
            assert torch.equal(again.sync.get("k"), torch.ones(4))
    finally:
        stop.set()
        child.join(PATIENCE_S)
        if child.exitcode is None:
            os.kill(child.pid, signal.SIGKILL)
            child.join()
    assert child.exitcode == 0, f"the child did not exit by itself (exit code {child.exitcode})"


class StoreBackedData(torch.utils.data.Dataset):
    """Indices, and one index that reads the store (which belongs to the parent)."""

    def __init__(self, store: tiered.TieredStore, touches: int) -> None:
        self.store = store
        self.touches = touches

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.touches:
            return self.store.sync.get("k")
        return torch.tensor([i], dtype=torch.float32)


def test_a_dataloader_with_fork_workers_beside_an_open_store(tmp_path):
    cfg = fork_config(tmp_path / "s")
    store = tiered.TieredStore.open(cfg)
    try:
        store.sync.put("k", torch.ones(4))
        loader = torch.utils.data.DataLoader(StoreBackedData(store, touches=-1), batch_size=4, num_workers=2,
                                             multiprocessing_context="fork", persistent_workers=True)
        seen = [b for b in loader]
        assert torch.equal(torch.cat(seen).reshape(-1), torch.arange(64.0))
        store.sync.close()  # the workers live on (persistent): the parent closes and reopens beside them
        store = tiered.TieredStore.open(cfg)
        assert torch.equal(store.sync.get("k"), torch.ones(4))
        assert len([b for b in loader]) == 16
        del loader
        touching = torch.utils.data.DataLoader(StoreBackedData(store, touches=5), batch_size=4, num_workers=2,
                                               multiprocessing_context="fork")
        with pytest.raises(tiered.StoreForkedError, match="forked"):
            for _ in touching:
                pass
        store.sync.put("k", torch.zeros(4))
        assert torch.equal(store.sync.get("k"), torch.zeros(4))
    finally:
        store.sync.close()
