"""SyncStore: the blocking facade of a TieredStore (``store.sync``)."""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Optional, Sequence

import torch

from tiered.store.batch import Batches
from tiered.store.calls import Calls
from tiered.store.operations import Operations
from tiered.store.prefetch import Prefetch
from tiered.store.renames import Renames, check_durable, rename_pairs
from tiered.store.validation import (
    batch_compress,
    batch_items,
    batch_keys,
    check_atomic,
    check_keep,
    key_list,
    ready_event,
)
from tiered.tier import Tier

if TYPE_CHECKING:
    from tiered.store.modify import Modification


class SyncStore:
    """Blocking versions of the store's coroutines, for code without an event loop (module hooks).

    Works from any thread except the store's own loop thread.
    """

    def __init__(self, calls: Calls, operations: Operations, batches: Batches, renames: Renames,
                 prefetch: Callable[[str, "Tier | str"], Prefetch],
                 modify: "Callable[[str, Tier | str | None], Modification]", close: Callable[[], None]) -> None:
        self._calls = calls
        self._ops = operations
        self._batches = batches
        self._renames = renames
        self._prefetch = prefetch
        self._modify = modify
        self._close = close

    def put(
        self, key: str, tensor: torch.Tensor, tier: "Tier | str" = Tier.NVME, compress: Optional[bool] = None, *,
        keep: "Tier | str | None" = None,
    ) -> None:
        """Blocking :meth:`TieredStore.put`."""
        check_keep(keep, tier)
        self._calls.call_sync(self._ops.put, key, tensor, tier, compress, ready_event(tensor), keep)

    def get(
        self, key: str, device: "torch.device | str" = "cpu", *, out: Optional[torch.Tensor] = None,
        keep: "Tier | str | None" = None,
    ) -> torch.Tensor:
        """Blocking :meth:`TieredStore.get`."""
        check_keep(keep)
        return self._calls.call_sync(self._ops.get, key, device, out, ready_event(out), keep)

    def put_many(
        self, items: "Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]", tier: "Tier | str" = Tier.NVME,
        compress: "Optional[bool] | Mapping[str, Optional[bool]]" = None, *, atomic: bool = False,
        keep: "Tier | str | None" = None,
    ) -> None:
        """Blocking :meth:`TieredStore.put_many`."""
        self.put_many_future(items, tier, compress, atomic=atomic, keep=keep).result()

    def put_many_future(
        self, items: "Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]", tier: "Tier | str" = Tier.NVME,
        compress: "Optional[bool] | Mapping[str, Optional[bool]]" = None, *, atomic: bool = False,
        keep: "Tier | str | None" = None,
    ) -> "concurrent.futures.Future[None]":
        """Start :meth:`TieredStore.put_many` and return at once (bad input raises here, before anything
        is queued); the tensors must stay unchanged until the future is done."""
        pairs = batch_items(items)
        compresses = batch_compress(compress, pairs)
        check_atomic(atomic, tier)
        check_keep(keep, tier)
        return self._calls.submit_sync(self._batches.put_many, pairs, tier, compresses,
                                        [ready_event(t) for _, t in pairs], atomic, keep)

    def get_many(
        self, keys: Sequence[str], device: "torch.device | str" = "cpu", *,
        out: Optional[Sequence[Optional[torch.Tensor]]] = None,
    ) -> list[torch.Tensor]:
        """Blocking :meth:`TieredStore.get_many`."""
        keys, outs = batch_keys(keys, out)
        return self._calls.call_sync(self._batches.get_many, keys, device, outs, [ready_event(o) for o in outs or ()])

    def get_future(
        self, key: str, device: "torch.device | str" = "cpu", *, out: Optional[torch.Tensor] = None,
        keep: "Tier | str | None" = None,
    ) -> "concurrent.futures.Future[torch.Tensor]":
        """Start :meth:`TieredStore.get` and return at once; the future holds the result (``out`` when given).

        ``out`` must not be read or written until the future is done. A CUDA ``out`` is written only after
        the work queued so far on the caller's current stream has finished (memory the caching allocator
        handed back may still be read by queued kernels).
        """
        check_keep(keep)
        return self._calls.submit(self._ops.get, key, device, out, ready_event(out), keep)

    def put_future(
        self, key: str, tensor: torch.Tensor, tier: "Tier | str" = Tier.NVME, compress: Optional[bool] = None, *,
        keep: "Tier | str | None" = None,
    ) -> "concurrent.futures.Future[None]":
        """Start :meth:`TieredStore.put` and return at once; ``tensor`` must stay unchanged until the future is done."""
        check_keep(keep, tier)
        return self._calls.submit(self._ops.put, key, tensor, tier, compress, ready_event(tensor), keep)

    def prefetch(self, key: str, tier: "Tier | str" = Tier.HOST) -> Prefetch:
        """Same as :meth:`TieredStore.prefetch` (it never blocks)."""
        return self._prefetch(key, tier)

    def evict(self, key: str, tier: "Tier | str" = Tier.NVME) -> None:
        """Blocking :meth:`TieredStore.evict`."""
        self._calls.call_sync(self._ops.evict, key, tier)

    def delete(self, key: str) -> None:
        """Blocking :meth:`TieredStore.delete`."""
        self._calls.call_sync(self._ops.delete, key)

    def delete_future(self, key: str) -> "concurrent.futures.Future[None]":
        """Start :meth:`TieredStore.delete` and return at once; the future raises ``KeyError`` for a missing key."""
        return self._calls.submit(self._ops.delete, key)

    def pin(self, key: str, tier: "Tier | str | None" = None) -> None:
        """Blocking :meth:`TieredStore.pin`."""
        self._calls.call_sync(self._ops.pin, key, tier)

    def unpin(self, key: str) -> None:
        """Blocking :meth:`TieredStore.unpin`."""
        self._calls.call_sync(self._ops.unpin, key)

    def modify(self, key: str, tier: "Tier | str | None" = None) -> "Modification":
        """:meth:`TieredStore.modify` as a plain context manager: ``with store.sync.modify(key) as t: ...``."""
        return self._modify(key, tier)

    def flush(self, keys: Optional[Sequence[str]] = None) -> None:
        """Blocking :meth:`TieredStore.flush`."""
        checked = None if keys is None else key_list(keys, "flush")
        self._calls.call_sync(self._ops.flush, checked)

    def rename(self, src: str, dst: str) -> None:
        """Blocking :meth:`TieredStore.rename`."""
        self.rename_many([(src, dst)])

    def rename_many(self, pairs: Iterable[tuple[str, str]], *, durable: bool = True) -> None:
        """Blocking :meth:`TieredStore.rename_many`."""
        self._calls.call_sync(self._renames.rename_many, rename_pairs(pairs), check_durable(durable))

    def rename_many_future(self, pairs: Iterable[tuple[str, str]], *, durable: bool = True
                           ) -> "concurrent.futures.Future[None]":
        """Start :meth:`TieredStore.rename_many` and return at once (bad pairs raise here, before anything
        is queued); the future is done once every pair has moved, or raises as the call would."""
        return self._calls.submit_sync(self._renames.rename_many, rename_pairs(pairs), check_durable(durable))

    def close(self) -> None:
        """Blocking :meth:`TieredStore.close`."""
        self._close()
