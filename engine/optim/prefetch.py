"""StatePrefetch: read the optimizer state of the step's first groups while backward still runs.

The step (``engine/optim/step.py``) streams shards in groups of ``optimizer_group_bytes`` and
reads its first groups before its pipeline has anything to overlap them with. The disk is mostly
idle during backward, so at the first gradient offload of a backward the engine starts reading the
master and both moments (not the gradients: they are final only at the end of backward) of the
step's first ``groups`` groups. The step then gets them through :meth:`StatePrefetch.take`, a store
view whose ``get`` of a prefetched key returns the tensor already read (or waits for its read).

Memory: at most ``groups`` groups of state, 12 bytes per element, are held from the first
gradient of a backward until the step, a subset of what the step itself holds for those groups.
Prefetched reads of keys the step does not ask for (a shard that got no gradient) are dropped
after the step. What is read is the live slot's state, which only a step or a commit of staged
state (checkpoint load) replaces; the caller discards the prefetch before the latter.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from engine.optim.step_io import AsyncTensorStore, plan_groups
from engine.optim.types import OptimShard
from tiered import TieredStore


class StatePrefetch:
    """Background reads of the optimizer state of the step's first groups (one per Training)."""

    def __init__(self, store: TieredStore, groups: int, group_bytes: int) -> None:
        self._store = store
        self._groups = groups
        self._group_bytes = group_bytes
        self._futures: dict[str, "concurrent.futures.Future[torch.Tensor]"] = {}
        self._started = False

    @property
    def started(self) -> bool:
        """True after :meth:`start` until :meth:`take` or :meth:`discard`."""
        return self._started

    def start(self, shards: Sequence[OptimShard], has_state: Sequence[bool]) -> None:
        """Start reading master and moments of the shards with state in the first groups of
        ``shards`` (all trainable shards in the step's order, grouped as the step groups them)."""
        if self._started:
            return
        self._started = True
        if self._groups == 0:
            return
        stateful = {s.name for s, ok in zip(shards, has_state) if ok}
        for group in plan_groups(shards, self._group_bytes)[: self._groups]:
            for shard in group:
                if shard.name in stateful:
                    for key in (shard.master_key, shard.exp_avg_key, shard.exp_avg_sq_key):
                        self._futures[key] = self._store.sync.get_future(key)

    def take(self, store: AsyncTensorStore) -> "PrefetchedStore":
        """A view of ``store`` serving the prefetched keys; this prefetch is empty afterwards."""
        futures, self._futures = self._futures, {}
        self._started = False
        return PrefetchedStore(store, futures)

    def discard(self) -> None:
        """Wait for the reads in flight and drop them (their errors too)."""
        futures, self._futures = self._futures, {}
        self._started = False
        _wait_all(futures.values())


class PrefetchedStore:
    """An :class:`AsyncTensorStore` whose ``get`` of a prefetched key returns the read already started."""

    def __init__(self, store: AsyncTensorStore, futures: "dict[str, concurrent.futures.Future[torch.Tensor]]") -> None:
        self._store = store
        self._futures = futures

    async def get(self, key: str, device: "torch.device | str" = "cpu", *, out: Optional[torch.Tensor] = None
                  ) -> torch.Tensor:
        """The prefetched tensor of ``key`` (read again if that read failed), else ``store.get``."""
        future = self._futures.pop(key, None) if out is None and torch.device(device).type == "cpu" else None
        if future is not None:
            try:
                return await asyncio.wrap_future(future)
            except Exception:  # noqa: BLE001 - read again below: a lasting failure raises there
                pass
        return await self._store.get(key, device, out=out)

    async def put(self, key: str, tensor: torch.Tensor, tier: Any = "nvme", compress: Optional[bool] = None, *,
                  keep: Any = None) -> None:
        """``store.put``."""
        await self._store.put(key, tensor, tier, compress, keep=keep)

    async def put_many(self, items: Mapping[str, torch.Tensor], tier: Any = "nvme",
                       compress: "Optional[bool] | Mapping[str, Optional[bool]]" = None, *, atomic: bool = False,
                       keep: Any = None) -> None:
        """``store.put_many``."""
        await self._store.put_many(items, tier, compress, atomic=atomic, keep=keep)

    def modify(self, key: str, tier: Any = None) -> Any:
        """``store.modify`` (a prefetched read of ``key``, which it makes stale, is dropped)."""
        self._futures.pop(key, None)
        return self._store.modify(key, tier)

    def info(self, key: str) -> Any:
        """``store.info``."""
        return self._store.info(key)

    def __contains__(self, key: object) -> bool:
        return key in self._store

    def close(self) -> None:
        """Wait for the prefetched reads the step did not use, and drop them."""
        futures, self._futures = self._futures, {}
        _wait_all(futures.values())


def _wait_all(futures: "Iterable[concurrent.futures.Future[Any]]") -> None:
    for future in list(futures):
        try:
            future.result()
        except Exception:  # noqa: BLE001 - unused reads: their outcome does not matter
            pass
