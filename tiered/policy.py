"""Eviction policies: which copies a full tier gives up first.

[Note: what the policy sees]
A policy sees keys, never tensors or tiers. The store calls ``touch(key)`` at every access: a put,
a get, the start of a modify block, and each record adopted when the store opens. It calls
``touch(key, access=False)`` after a prefetch, a pin or an eviction made a copy in host or device
memory: recent, but not a step in the access order. It calls ``forget(key)`` on delete. A
transfer that finds the copy already there touches nothing. When a tier is full, the store walks
``victims`` over the keys with a copy there and takes the first one it may evict (see
[Note: admission and eviction] in tiered.store.transfers). ``TieredStore.set_access_order`` hands the
policy the caller's future access order (the engine's recorded step), which ``FutureOrderPolicy``,
the default, follows.
"""

from __future__ import annotations

import abc
import bisect
import collections
from typing import Collection, Iterator, Optional, Sequence


class EvictionPolicy(abc.ABC):
    """Orders eviction candidates. The store reports every access and removal; the policy never
    sees tensors, only keys."""

    @abc.abstractmethod
    def touch(self, key: str, *, access: bool = True) -> None:
        """``key`` was just used: read or written by the caller (``access``), or only promoted
        by a prefetch (``access=False``), which counts as recent but is not a step in the order."""

    @abc.abstractmethod
    def forget(self, key: str) -> None:
        """``key`` left the store."""

    @abc.abstractmethod
    def victims(self, resident: Collection[str]) -> Iterator[str]:
        """Keys of ``resident`` (the keys with a copy in the full tier), best victim first, lazily."""

    def set_future_order(self, keys: Optional[Sequence[str]]) -> None:
        """Accept the expected future access order (repeating); None withdraws it.

        Policies that cannot use it ignore it.
        """

    def keeps(self, key: str, instead_of: str) -> bool:
        """Whether a copy of ``key`` that a caller offers to keep is worth evicting ``instead_of``
        (the policy's best victim) for; True unless the policy knows better."""
        return True


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._recency: collections.OrderedDict[str, None] = collections.OrderedDict()

    def touch(self, key: str, *, access: bool = True) -> None:
        self._recency[key] = None
        self._recency.move_to_end(key)

    def forget(self, key: str) -> None:
        self._recency.pop(key, None)

    def victims(self, resident: Collection[str]) -> Iterator[str]:
        for key in list(self._recency):
            if key in resident:
                yield key
        # Keys never touched (the store touches every key it admits, so normally none).
        yield from (k for k in list(resident) if k not in self._recency)

    def recency_rank(self) -> dict[str, int]:
        """Key -> position in recency order (0 = least recent)."""
        return {k: i for i, k in enumerate(self._recency)}


class FutureOrderPolicy(EvictionPolicy):
    """Belady's rule: evict the entry whose next use is furthest in the future.

    Given the access order of one iteration (which repeats, as a training step does), the policy
    follows a cursor through it as keys are touched. Keys absent from the order go first, and
    without an order it is LRU.
    """

    def __init__(self, order: Optional[Sequence[str]] = None) -> None:
        self._lru = LRUPolicy()
        self._positions: dict[str, list[int]] = {}
        self._length = 0
        self._cursor = 0
        self.set_future_order(order)

    def set_future_order(self, keys: Optional[Sequence[str]]) -> None:
        self._positions = {}
        for i, key in enumerate(keys or ()):
            self._positions.setdefault(key, []).append(i)
        self._length = len(keys or ())
        self._cursor = 0

    def touch(self, key: str, *, access: bool = True) -> None:
        self._lru.touch(key)
        pos = self._positions.get(key)
        if pos and access:
            i = bisect.bisect_left(pos, self._cursor)
            at = pos[i] if i < len(pos) else pos[0]
            self._cursor = (at + 1) % self._length

    def forget(self, key: str) -> None:
        self._lru.forget(key)

    def next_use(self, key: str) -> float:
        """Accesses until ``key`` is used again (infinity when it is not in the order)."""
        pos = self._positions.get(key)
        if not pos:
            return float("inf")
        i = bisect.bisect_left(pos, self._cursor)
        return pos[i] - self._cursor if i < len(pos) else pos[0] + self._length - self._cursor

    def keeps(self, key: str, instead_of: str) -> bool:
        """With an order: only when ``key`` is used again before ``instead_of`` (Belady's rule with
        bypass: a copy used later than everything resident is not worth keeping). Without one: True."""
        return not self._length or self.next_use(key) < self.next_use(instead_of)

    def victims(self, resident: Collection[str]) -> Iterator[str]:
        if not self._length:
            yield from self._lru.victims(resident)
            return
        rank = self._lru.recency_rank()
        yield from sorted(resident, key=lambda k: (-self.next_use(k), rank.get(k, -1)))
