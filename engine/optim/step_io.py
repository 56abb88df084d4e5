"""Store I/O helpers of the optimizer step: shard groups, byte and stall accounting, and a runner
that gives the step's coroutines an event loop of their own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import time
from typing import (
    Any, Awaitable, Callable, Coroutine, Iterable, Mapping, Optional, ParamSpec, Protocol, Sequence, TypeVar,
)

import torch

from engine.optim.types import OptimShard

T = TypeVar("T")
P = ParamSpec("P")


class AsyncTensorStore(Protocol):
    """The part of :class:`tiered.TieredStore` the optimizer step uses."""

    async def get(self, key: str, device: "torch.device | str" = "cpu", *, out: Optional[torch.Tensor] = None
                  ) -> torch.Tensor:
        """:meth:`tiered.TieredStore.get`."""
        ...

    async def put(self, key: str, tensor: torch.Tensor, tier: Any = ..., compress: Optional[bool] = None, *,
                  keep: Any = None) -> None:
        """:meth:`tiered.TieredStore.put`."""
        ...

    async def put_many(self, items: Mapping[str, torch.Tensor], tier: Any = ...,
                       compress: "Optional[bool] | Mapping[str, Optional[bool]]" = None, *, atomic: bool = False,
                       keep: Any = None) -> None:
        """:meth:`tiered.TieredStore.put_many`."""
        ...

    def modify(self, key: str, tier: Any = None) -> Any:
        """:meth:`tiered.TieredStore.modify`."""
        ...

    def info(self, key: str) -> Any:
        """:meth:`tiered.TieredStore.info`."""
        ...

    def __contains__(self, key: object) -> bool: ...


def plan_groups(shards: Sequence[OptimShard], group_bytes: int) -> list[list[OptimShard]]:
    """Split ``shards`` (in order) into consecutive groups of at most ``group_bytes`` fp32 bytes each.

    A shard larger than ``group_bytes`` is a group of its own: a store entry is read whole.
    """
    if isinstance(group_bytes, bool) or not isinstance(group_bytes, int) or group_bytes < 1:
        raise ValueError(f"group_bytes must be an int >= 1, got {group_bytes!r}")
    groups: list[list[OptimShard]] = []
    current: list[OptimShard] = []
    size = 0
    for shard in shards:
        if current and size + shard.fp32_bytes > group_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(shard)
        size += shard.fp32_bytes
    if current:
        groups.append(current)
    return groups


def check_shards(shards: Sequence[OptimShard], groups: int) -> None:
    """ValueError unless shard names and store keys are unique and every shard's group exists."""
    names: set[str] = set()
    keys: set[str] = set()
    for shard in shards:
        if not isinstance(shard, OptimShard):
            raise TypeError(f"shards must be OptimShard, got {type(shard).__name__}")
        if shard.name in names:
            raise ValueError(f"two shards are named {shard.name!r}; shard names must be unique")
        names.add(shard.name)
        for key in shard.all_keys():
            if key in keys:
                raise ValueError(f"store key {key!r} is used by two shards (or twice by {shard.name!r})")
            keys.add(key)
        if shard.group >= groups:
            raise ValueError(f"shard {shard.name!r} is in group {shard.group}, but only {groups} groups were given")


@dataclasses.dataclass
class IOCounter:
    """Bytes moved through the store and seconds spent waiting on transfers not yet finished."""

    bytes_read: int = 0
    bytes_written: int = 0
    stall_seconds: float = 0.0

    async def wait(self, awaitable: "Awaitable[T]") -> T:
        """Await ``awaitable``, counting the time as stalled unless it had already finished."""
        if isinstance(awaitable, asyncio.Future) and awaitable.done():
            return awaitable.result()
        started = time.perf_counter()
        try:
            return await awaitable
        finally:
            self.stall_seconds += time.perf_counter() - started

    async def get(self, store: AsyncTensorStore, key: str) -> torch.Tensor:
        """``store.get(key)``, counting its bytes."""
        tensor = await store.get(key)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    async def put(self, store: AsyncTensorStore, key: str, tensor: torch.Tensor, tier: str,
                  compress: Optional[bool], keep: Optional[str] = None) -> None:
        """``store.put(key, tensor, tier, compress, keep=keep)``, counting its bytes."""
        await store.put(key, tensor, tier, compress, keep=keep)
        self.bytes_written += tensor.numel() * tensor.element_size()

    async def put_many(self, store: AsyncTensorStore, items: Mapping[str, torch.Tensor], tier: str,
                       compress: Mapping[str, Optional[bool]], atomic: bool, keep: Optional[str] = None) -> None:
        """``store.put_many(items, tier, compress, atomic=atomic, keep=keep)``, counting its bytes."""
        await store.put_many(items, tier, compress, atomic=atomic, keep=keep)
        self.bytes_written += sum(t.numel() * t.element_size() for t in items.values())

    async def modify(self, blocks: "ModifyBlocks", store: AsyncTensorStore, key: str, tier: str) -> torch.Tensor:
        """Open ``store.modify(key, tier)`` in ``blocks``; counts bytes only when the store had to copy
        the value out and back (it was not in host memory in one piece)."""
        tensor, in_place = await blocks.enter(store, key, tier)
        if not in_place:
            nbytes = tensor.numel() * tensor.element_size()
            self.bytes_read += nbytes
            self.bytes_written += nbytes
        return tensor


class ModifyBlocks:
    """``store.modify`` blocks opened one by one and ended together, concurrently (a sequential exit
    would pay one round trip to the store's loop per block)."""

    def __init__(self) -> None:
        self._open: list[Any] = []

    async def enter(self, store: AsyncTensorStore, key: str, tier: str) -> tuple[torch.Tensor, bool]:
        """Open a block on ``key``: its tensor, and whether that is the store's own memory."""
        block = store.modify(key, tier)
        tensor = await block.__aenter__()
        self._open.append(block)
        return tensor, block.in_place

    async def close(self) -> None:
        """End every open block (all of them, even when one fails; then raise the first error)."""
        blocks, self._open = self._open, []
        await gather_all(block.__aexit__(None, None, None) for block in blocks)


async def gather_all(awaitables: Iterable["Awaitable[T]"]) -> list[T]:
    """Run every awaitable to its end, then raise the first error (so none is left running or
    with an unretrieved exception), or return the results in order."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


async def drain(tasks: Iterable[Optional["asyncio.Future[Any]"]], *, cancel: bool) -> None:
    """Wait for every task to end (cancelling them first if ``cancel``), ignoring their outcomes:
    used when the step fails, where the first error is what the caller sees."""
    pending = [t for t in tasks if t is not None]
    if cancel:
        for task in pending:
            task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


def run_sync(coro: "Coroutine[Any, Any, T]") -> T:
    """Run ``coro`` to completion from synchronous code, on a private event loop.

    In a thread that already runs an event loop (a notebook, an async trainer) the private loop
    runs on a helper thread instead (asyncio loops cannot nest); the caller's loop then waits for
    the step like for any blocking call, so async code should await the ``*_async`` functions.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-optim") as pool:
        return pool.submit(asyncio.run, coro).result()


def blocking(function: "Callable[P, Coroutine[Any, Any, T]]") -> "Callable[P, T]":
    """``function`` (a coroutine function, ``name_async``) as a blocking call ``name`` with the same
    arguments, run by :func:`run_sync`: one signature for both, so they cannot drift apart."""

    @functools.wraps(function)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return run_sync(function(*args, **kwargs))

    run.__name__ = function.__name__.removesuffix("_async")
    run.__qualname__ = function.__qualname__.removesuffix("_async")
    run.__doc__ = f"Blocking :func:`{function.__name__}` (same arguments), run on a private event loop."
    return run
