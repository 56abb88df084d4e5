"""The tiers' state: their backends, which version holds a copy in each, the bytes in flight, and
who waits for room.

Every method runs on the store's loop (see [Note: one loop owns the state] in
tiered.store.tiered_store). This is the one place that attaches copies to versions and detaches
them (``Entry.copies``), so the resident sets and the backends' charges always agree with them.
How room is made (admission, eviction): [Note: admission and eviction] in tiered.store.transfers.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from tiered.backends import Copy, TierBackend
from tiered.policy import EvictionPolicy
from tiered.store.entry import Entry
from tiered.tier import TIERS_TOP_DOWN, Tier


class Tiers:
    """Copies of versions in the three tiers, and the tiers' budgets (store loop state)."""

    def __init__(self, backends: dict[Tier, TierBackend], policy: EvictionPolicy) -> None:
        self.backends = backends
        self.policy = policy
        #: Per tier, key -> the version whose copy is there (only current versions are resident).
        self.resident: dict[Tier, dict[str, Entry]] = {t: {} for t in TIERS_TOP_DOWN}
        #: Per tier, bytes allocated by admissions whose copies are not attached yet.
        self.inflight: dict[Tier, int] = {t: 0 for t in TIERS_TOP_DOWN}
        #: One admission at a time per tier (see [Note: admission and eviction]).
        self.locks = {t: asyncio.Lock() for t in TIERS_TOP_DOWN}
        self._waiters: dict[Tier, list[asyncio.Future[None]]] = {t: [] for t in TIERS_TOP_DOWN}

    # ------------------------------------------------------------------ readers and room

    def begin_read(self, entry: Entry, tier: Tier) -> Copy:
        """Take a reader of ``entry``'s copy in ``tier``: it is not freed (nor chosen as a victim) until
        :meth:`end_read`."""
        copy = entry.copies[tier]
        copy.readers += 1
        return copy

    def end_read(self, tier: Tier, copy: Copy) -> None:
        self.backends[tier].end_read(copy)
        self.wake(tier)

    async def wait_for_change(self, tier: Tier) -> None:
        """Wait until something in ``tier`` is dropped, installed, discarded, retired, read to the
        end or unpinned (every such change calls :meth:`wake`)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[tier].append(waiter)
        await waiter

    def wake(self, tier: Tier) -> None:
        waiters, self._waiters[tier] = self._waiters[tier], []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def wake_all(self) -> None:
        for tier in TIERS_TOP_DOWN:
            self.wake(tier)

    # ------------------------------------------------------------------ attaching and detaching copies

    def add_copy(self, entry: Entry, tier: Tier, copy: Copy) -> None:
        entry.copies[tier] = copy
        self.resident[tier][entry.key] = entry

    def detach(self, entry: Entry, tier: Tier) -> Optional[Copy]:
        """Take ``entry``'s copy in ``tier`` off it without freeing it (the caller owns it now)."""
        copy = entry.copies.pop(tier, None)
        if copy is not None and self.resident[tier].get(entry.key) is entry:
            del self.resident[tier][entry.key]
        return copy

    def rekey(self, entry: Entry, old_key: str) -> None:
        """``entry`` moved from ``old_key`` to ``entry.key``: its copies are resident under the new key."""
        for tier in entry.copies:
            resident = self.resident[tier]
            if resident.get(old_key) is entry:
                del resident[old_key]
            resident[entry.key] = entry

    def drop_copy(self, entry: Entry, tier: Tier) -> None:
        """Free ``entry``'s copy in ``tier`` (once its readers finish)."""
        copy = self.detach(entry, tier)
        assert copy is not None, "drop_copy of a tier the version has no copy in"
        self.backends[tier].release(copy)
        self.wake(tier)

    def settle(self, tier: Tier, copy: Copy) -> None:
        """A copy allocated by an admission stops counting as in flight."""
        self.inflight[tier] -= copy.footprint

    def install(self, entry: Entry, tier: Tier, copy: Copy) -> None:
        """Attach a finished copy to its version, or free it if the version was retired meanwhile."""
        self.settle(tier, copy)
        if not entry.retired and tier not in entry.copies:
            self.add_copy(entry, tier, copy)
        else:
            self.backends[tier].release(copy)
        self.wake(tier)

    def discard(self, tier: Tier, copy: Copy) -> None:
        """Free a copy allocated by an admission that will never be attached."""
        self.settle(tier, copy)
        self.backends[tier].release(copy)
        self.wake(tier)

    def retire(self, entry: Entry) -> None:
        """Free every copy of a retired version (once their readers finish)."""
        for tier in list(entry.copies):
            self.backends[tier].release(self.detach(entry, tier))  # type: ignore[arg-type]
            self.wake(tier)

    # ------------------------------------------------------------------ victims

    def pick_victim(self, tier: Tier) -> Optional[Entry]:
        """The policy's best victim in ``tier`` that may go now: not pinned, not being read or written
        down, not held (see [Note: holding a version] in tiered.store.versions)."""
        resident = self.resident[tier]
        for key in self.policy.victims(resident):
            entry = resident.get(key)
            if entry is None:
                continue
            if entry.pinned or tier in entry.leaving or entry.copies[tier].readers or entry.holder is not None:
                continue
            return entry
        return None

    def pinned_bytes(self, tier: Tier) -> int:
        """Bytes in ``tier`` that no admission can free by waiting: pinned copies and those lent to
        modify blocks (see [Note: modify blocks] in tiered.store.modify)."""
        return sum(e.copies[tier].footprint for e in self.resident[tier].values()
                   if e.pinned or e.changing is not None)
