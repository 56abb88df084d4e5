"""The store under test, driven only through its public API (StoreConfig, TieredStore and its
put/get/put_many/get_many/prefetch/evict/delete/info)."""

from __future__ import annotations

import asyncio
import shutil
import time
import warnings
from typing import Awaitable, Callable, Optional, Sequence, TypeVar

import torch

from tiered import StoreConfig, Tier, TieredStore
from tiered.bench.results import Run
from tiered.bench.tensors import same

T = TypeVar("T")


class StoreUnderTest:
    """A store in its own directory with an event loop of its own, so phases call it synchronously.

    ``direct`` is False when the store warned that it fell back to buffered I/O (no O_DIRECT).
    """

    def __init__(self, config: StoreConfig, *, keep: bool = False) -> None:
        self.config = config
        self.keep = keep
        self.loop = asyncio.new_event_loop()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.store = self.run(TieredStore.open_async(config))
        except BaseException:
            self.loop.close()
            raise
        self.direct = config.direct_io and not any("O_DIRECT" in str(w.message) for w in caught)

    def run(self, coro: Awaitable[T]) -> T:
        """Run a coroutine on this object's loop."""
        return self.loop.run_until_complete(coro)

    def clear(self, keys: Optional[Sequence[str]] = None) -> None:
        """Delete ``keys`` (default: every key; not timed), so the next run writes into reused extents."""
        async def go() -> None:
            doomed = self.store.keys() if keys is None else [k for k in keys if k in self.store]
            await asyncio.gather(*(self.store.delete(k) for k in doomed))
        self.run(go())

    def placements(self, keys: Sequence[str]) -> list[list[tuple[str, int, int]]]:
        """Where the store holds each key now, as (path, offset, length) ranges of its swap files
        (``TieredStore.nvme_layout``; it moves with every put)."""
        out = [[(e.path, e.offset, e.length) for e in self.store.nvme_layout(k)] for k in keys]
        missing = [k for k, p in zip(keys, out) if not p]
        if missing:
            raise RuntimeError(f"the store holds no nvme copy of {missing[:3]}; put them before asking where they are")
        return out

    def close(self) -> None:
        """Close the store and remove its directory (unless made with ``keep=True``)."""
        try:
            if self.keep:
                self.clear()  # the next store over this directory reuses the extents
            self.run(self.store.close())
        finally:
            self.loop.close()
            if not self.keep:
                self.remove(self.config)

    @staticmethod
    def remove(config: StoreConfig) -> None:
        """Delete a store's directory (the benchmark's own scratch stores only)."""
        shutil.rmtree(config.path, ignore_errors=True)


class LargeTensors:
    """Sequential puts of large tensors to nvme (durable on return) and cold gets of them."""

    def __init__(self, sut: StoreUnderTest, tensors: Sequence[torch.Tensor], *, compress: bool = False,
                 prefix: str = "large") -> None:
        self.sut = sut
        self.tensors = list(tensors)
        self.compress = compress
        self.keys = [f"{prefix}/{i:05d}" for i in range(len(self.tensors))]
        #: Where gets into new tensors put them: the device the tensors live on.
        self.device = str(self.tensors[0].device) if self.tensors else "cpu"
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)

    def write(self) -> Run:
        """put every tensor to nvme, one after another; durable when each call returns."""
        store = self.sut.store
        self.sut.clear(self.keys)

        async def go() -> float:
            start = time.perf_counter()
            for key, t in zip(self.keys, self.tensors):
                await store.put(key, t, tier=Tier.NVME, compress=self.compress)
            return time.perf_counter() - start

        seconds = self.sut.run(go())
        stored = sum(store.info(k).stored_nbytes or 0 for k in self.keys)
        return Run(self.nbytes / seconds / 1e9, seconds, self.nbytes, len(self.keys),
                   detail={"stored_bytes": stored, "stored_ratio": stored / self.nbytes})

    def write_concurrently(self) -> Run:
        """put every tensor to nvme with all the puts in flight at once (asyncio.gather)."""
        store = self.sut.store
        self.sut.clear(self.keys)

        async def go() -> float:
            start = time.perf_counter()
            await asyncio.gather(*(store.put(k, t, tier=Tier.NVME, compress=self.compress)
                                   for k, t in zip(self.keys, self.tensors)))
            return time.perf_counter() - start

        seconds = self.sut.run(go())
        return Run(self.nbytes / seconds / 1e9, seconds, self.nbytes, len(self.keys))

    def read(self, *, into: Optional[list[torch.Tensor]] = None) -> Run:
        """get every tensor from nvme, one after another (each awaited before the next starts),
        each into a new tensor on the tensors' device (checked, then dropped before the next get, as a loop streaming
        tensors in would; only the gets are timed) or into ``into``: back to back, checked after
        the last, as DeepSpeed's reads one tensor at a time are timed and checked (a check between
        two gets leaves the disk idle for it, which cost the next get ~3% here)."""
        store = self.sut.store

        async def go() -> tuple[float, bool]:
            if into is not None:
                start = time.perf_counter()
                for key, out in zip(self.keys, into):
                    await store.get(key, out=out)
                seconds = time.perf_counter() - start
                return seconds, all(same(out, want) for out, want in zip(into, self.tensors))
            seconds, ok = 0.0, True
            for key, want in zip(self.keys, self.tensors):
                start = time.perf_counter()
                got = await store.get(key, device=self.device)  # complete when the call returns
                seconds += time.perf_counter() - start
                ok = ok and same(got, want)
                del got
            return seconds, ok

        seconds, ok = self.sut.run(go())
        return Run(self.nbytes / seconds / 1e9, seconds, self.nbytes, len(self.keys), verified=ok)

    def read_concurrently(self, into: list[torch.Tensor]) -> Run:
        """get every tensor from nvme into ``into`` with all the gets in flight at once
        (asyncio.gather), as DeepSpeed's ``async_pread`` x N + ``wait()``; then check them."""
        store = self.sut.store

        async def go() -> float:
            start = time.perf_counter()
            await asyncio.gather(*(store.get(k, out=out) for k, out in zip(self.keys, into)))
            return time.perf_counter() - start

        seconds = self.sut.run(go())
        ok = all(same(got, want) for got, want in zip(into, self.tensors))
        return Run(self.nbytes / seconds / 1e9, seconds, self.nbytes, len(self.keys), verified=ok)


async def run_in_flight(calls: Sequence[Callable[[], Awaitable[T]]], concurrency: int) -> list[T]:
    """Await every call, ``concurrency`` at a time, and return their results in order.

    ``concurrency`` workers each make the next call when their last one returns (fio's iodepth):
    one coroutine per slot, not a task and a semaphore wait per call, so the harness takes as
    little as it can of the CPU the store's loop needs.
    """
    results: list = [None] * len(calls)
    todo = iter(enumerate(calls))

    async def worker() -> None:
        for i, call in todo:
            results[i] = await call()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(calls)))))
    return results


def small_round(
    sut: StoreUnderTest, tensors: Sequence[torch.Tensor], *, concurrency: int, compress: bool = False
) -> Run:
    """put every small tensor to nvme, then get every one back; ``concurrency`` operations in flight.

    The value is put+get operations per second over both halves; GB/s of each half is in the detail.
    """
    store = sut.store
    keys = [f"small/{i:06d}" for i in range(len(tensors))]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    sut.clear()

    async def go() -> tuple[float, float, list[torch.Tensor]]:
        start = time.perf_counter()
        await run_in_flight([lambda k=k, t=t: store.put(k, t, tier=Tier.NVME, compress=compress)
                             for k, t in zip(keys, tensors)], concurrency)
        mid = time.perf_counter()
        got = await run_in_flight([lambda k=k: store.get(k) for k in keys], concurrency)
        return mid - start, time.perf_counter() - mid, got

    put_s, get_s, got = sut.run(go())
    return _put_get_run(tensors, got, nbytes, put_s, get_s, concurrency=concurrency)


def small_batched_round(
    sut: StoreUnderTest, tensors: Sequence[torch.Tensor], *, batch: int, compress: bool = False
) -> Run:
    """put every small tensor to nvme with put_many, ``batch`` per call, then get them back with get_many.

    One call at a time; each put_many is durable when it returns. Figures as :func:`small_round`.
    """
    store = sut.store
    keys = [f"small/{i:06d}" for i in range(len(tensors))]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    sut.clear()
    groups = [range(i, min(i + batch, len(keys))) for i in range(0, len(keys), batch)]

    async def go() -> tuple[float, float, list[torch.Tensor]]:
        start = time.perf_counter()
        for g in groups:
            await store.put_many([(keys[i], tensors[i]) for i in g], tier=Tier.NVME, compress=compress)
        mid = time.perf_counter()
        got: list[torch.Tensor] = []
        for g in groups:
            got.extend(await store.get_many([keys[i] for i in g]))
        return mid - start, time.perf_counter() - mid, got

    put_s, get_s, got = sut.run(go())
    return _put_get_run(tensors, got, nbytes, put_s, get_s, batch=batch)


def _put_get_run(
    tensors: Sequence[torch.Tensor], got: Sequence[torch.Tensor], nbytes: int, put_s: float, get_s: float,
    **setting: int,
) -> Run:
    """A small-tensor round's figure: put+get ops/s, with every tensor checked bit for bit."""
    ok = len(got) == len(tensors) and all(same(a, b) for a, b in zip(got, tensors))
    n = len(tensors)
    seconds = put_s + get_s
    return Run(2 * n / seconds, seconds, 2 * nbytes, 2 * n, verified=ok, detail={
        "put_seconds": put_s, "get_seconds": get_s, "put_ops_per_s": n / put_s, "get_ops_per_s": n / get_s,
        "put_gbps": nbytes / put_s / 1e9, "get_gbps": nbytes / get_s / 1e9, "put_get_gbps": 2 * nbytes / seconds / 1e9,
        "tensors": n, **setting})


def prefetch_round(
    sut: StoreUnderTest, keys: Sequence[str], tensors: Sequence[torch.Tensor], *, ahead: int, compute_seconds: float,
) -> Run:
    """Visit every key in order: get it, then "compute" for a fixed delay. With ``ahead > 0`` the
    next ``ahead`` keys are prefetched to host while computing, and each used host copy is evicted."""
    store = sut.store
    outs = [torch.empty_like(t) for t in tensors]  # reused buffers, as a training loop would have

    async def go() -> float:
        for k in keys:  # every key starts on nvme only
            await store.evict(k, Tier.NVME)
        start = time.perf_counter()
        for i in range(min(ahead, len(keys))):
            store.prefetch(keys[i], Tier.HOST)
        for i, k in enumerate(keys):
            if ahead > 0 and i + ahead < len(keys):
                store.prefetch(keys[i + ahead], Tier.HOST)
            await store.get(k, out=outs[i])  # waits for the key's prefetch when one is in flight
            if ahead > 0:
                await store.evict(k, Tier.NVME)  # a clean drop: no I/O
            await asyncio.sleep(compute_seconds)
        return time.perf_counter() - start

    seconds = sut.run(go())
    ok = all(same(a, b) for a, b in zip(outs, tensors))
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return Run(seconds, seconds, nbytes, len(keys), verified=ok,
               detail={"ahead": ahead, "compute_seconds": compute_seconds})


def put_all(sut: StoreUnderTest, keys: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Put tensors to nvme (setup, not timed)."""
    async def go() -> None:
        for k, t in zip(keys, tensors):
            await sut.store.put(k, t, tier=Tier.NVME)
    sut.run(go())
