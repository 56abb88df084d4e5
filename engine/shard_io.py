"""ShardIO: moves a parameter between its materialized storage and its shard in the store.

Fetch path: get this rank's shard -> all-gather across ranks (world > 1) -> fill the parameter.
Write path: take this rank's slice of the parameter -> put it as the shard. At world size 1 the
shard is the whole parameter, so both are one store call on the parameter's own storage.
"""

from __future__ import annotations

import concurrent.futures

import torch

from engine.handle import ParamHandle
from tiered import TieredStore, Tier


class ShardIO:
    """Store traffic of parameter shards, for one rank."""

    def __init__(self, store: TieredStore, tier: "Tier | str") -> None:
        self.store = store
        self.tier = Tier.parse(tier)

    def fetch(self, handle: ParamHandle) -> "concurrent.futures.Future[torch.Tensor]":
        """Start filling ``handle``'s (allocated) storage from the store; never blocks."""
        if not handle.layout.is_whole:
            raise NotImplementedError("sharding across ranks (all-gather on fetch) comes with multi-rank training")
        return self.store.sync.get_future(handle.key, handle.flat.device, out=handle.flat)

    def read_copy(self, handle: ParamHandle) -> torch.Tensor:
        """A new tensor with the parameter's whole value, on its device (blocks)."""
        if not handle.layout.is_whole:
            raise NotImplementedError("sharding across ranks (all-gather on read) comes with multi-rank training")
        flat = self.store.sync.get(handle.key, handle.flat.device)
        return handle.layout.unflatten(flat)

    def write(self, handle: ParamHandle) -> "concurrent.futures.Future[None]":
        """Start writing ``handle``'s materialized value as its shard; the storage must stay as it is
        until the future is done."""
        if not handle.layout.is_whole:
            raise NotImplementedError("sharding across ranks (one slice per rank) comes with multi-rank training")
        return self.store.sync.put_future(handle.key, handle.flat, self.tier)


def wait_all(futures: "list[concurrent.futures.Future]") -> None:
    """Wait for every future, then raise the first error (so none is left running unobserved)."""
    first: "BaseException | None" = None
    for future in futures:
        try:
            future.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised below after the others finished
            first = first or exc
    if first is not None:
        raise first
