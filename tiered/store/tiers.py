"""Tier budgets, eviction and the bookkeeping of copies between tiers.

A mixin of TieredStore: every method runs on the store's loop and uses its state (see
[Note: one loop owns the state] in tiered.store.tiered_store).

[Note: admission and eviction]
Space in a tier is taken only through ``_admit``. A tensor larger than the tier's whole budget is
refused at once (CapacityError with the numbers). nvme evicts nothing: its allocation checks the
budget and the disk itself. In device or host memory, under that tier's lock, ``_admit`` picks
victims in the policy's order (skipping pinned entries, copies being read or written down, and
versions in modify blocks) until the tensor fits. ``_make_room`` drops a victim's copy outright
when a slower copy exists; otherwise it writes the entry one tier down first (host, or nvme when
the tensor is larger than the whole host budget), so eviction cascades device -> host -> nvme.

A holder of the device tier's lock may wait for the host tier's (a write-down into host admits
there), a holder of the host tier's never waits for the device tier's, and nvme has only its
allocation lock: the lock graph has no cycle. When no victim is left, ``_admit`` waits only while
some of the bytes in use are not pinned: those are transient (copies allocated but not installed
yet, copies being read or written down, released copies waiting for their last reader), and
``_wake`` runs at every drop, install, discard, retire, end of a read and unpin. When every byte
in use is pinned (a copy lent to a modify block counts), it raises CapacityError rather than wait
for something that may never come.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Optional, Sequence

from tiered.backends import Copy
from tiered.store.entry import Entry
from tiered.errors import CapacityError, TieredError
from tiered.store.error_messages import naming_key
from tiered.tier import Tier

if TYPE_CHECKING:
    from tiered.io.spans import Span


# [Note: Kept copies]
# ``get(..., keep=tier)`` and ``put(..., keep=tier)`` offer the store a clean copy of what they just
# read or wrote, from the memory they already hold, so keeping it costs a copy and no I/O. The
# store keeps it when the tier has room, or when the eviction policy values it over the victim
# that would make room (``EvictionPolicy.keeps``: with the future access order, Belady's rule with
# bypass, so a copy used later than everything resident is dropped instead of evicting something
# used sooner); it never waits for room and never fails the call for it. A caller that reads and
# rewrites the same entries in a repeating order (a training step) thus keeps the ones it will
# read soonest in the faster tier across iterations.


class _NotKept(Exception):
    """An optional copy is not worth the room it would take (see [Note: Kept copies])."""


class TierBookkeeping:
    """Admission into tiers, victims, and attaching/detaching copies (mixed into TieredStore)."""

    # ------------------------------------------------------------------ budgets and eviction

    async def _admit(self, tier: Tier, nbytes: int, *, optional_for: Optional[str] = None) -> Copy:
        """Allocate ``nbytes`` in ``tier``, evicting victims (writing dirty ones down) as needed
        (see [Note: admission and eviction]).

        Waits while the only bytes that could be freed belong to transfers in flight; raises
        CapacityError when even evicting everything evictable could not make room. With
        ``optional_for`` (a copy of that key the store may skip), raises _NotKept instead of waiting
        or of evicting a victim the policy values more (see [Note: Kept copies]).
        """
        backend = self._backends[tier]
        if tier is Tier.NVME:  # no eviction below nvme; allocate() checks the budget itself
            copy = await backend.allocate(nbytes)
            self._inflight[tier] += copy.footprint
            return copy
        backend.check_fits_budget(nbytes)
        async with self._tier_locks[tier]:
            while not backend.has_room(nbytes):
                victim = self._pick_victim(tier)
                if optional_for is not None and (victim is None or not self._policy.keeps(optional_for, victim.key)):
                    raise _NotKept()
                if victim is not None:
                    await self._make_room(victim, tier)
                    continue
                pinned = self._pinned_bytes(tier)
                if backend.used > pinned:
                    waiter = asyncio.get_running_loop().create_future()
                    self._space_waiters[tier].append(waiter)
                    await waiter
                    continue
                raise CapacityError(
                    f"{tier.value} tier: {nbytes} bytes do not fit; {backend.used} of {backend.budget} bytes are "
                    f"in use and {pinned} of them are pinned or held by modify blocks; unpin entries, end the blocks "
                    "or raise the budget"
                )
            copy = await backend.allocate(nbytes)
            self._inflight[tier] += copy.footprint
            return copy

    async def _keep_copy(self, entry: Entry, tier: Tier, src: "Sequence[Span]") -> None:
        """Give ``entry`` a clean copy in ``tier`` from ``src`` (its bytes, in memory) when the tier has
        room or the policy values it over what would go for it; else nothing ([Note: Kept copies])."""
        if tier in entry.copies or tier in entry.moving or self._entries.get(entry.key) is not entry:
            return
        try:
            copy = await self._admit(tier, entry.nbytes, optional_for=entry.key)
        except (_NotKept, CapacityError):
            return
        try:
            await self._store_memory(tier, copy, src)
        except BaseException:
            self._discard(tier, copy)
            raise
        self._stats.tiers[tier].bytes_in += entry.nbytes
        self._install(entry, tier, copy)
        self._policy.touch(entry.key, access=False)

    def _pick_victim(self, tier: Tier) -> Optional[Entry]:
        resident = self._resident[tier]
        for key in self._policy.victims(resident):
            entry = self._entries.get(key)
            if entry is None or tier not in entry.copies:
                continue
            if entry.pinned or tier in entry.leaving or entry.copies[tier].readers or entry.editing is not None:
                continue
            return entry
        return None

    def _pinned_bytes(self, tier: Tier) -> int:
        return sum(
            e.copies[tier].footprint for k in self._resident[tier]
            if (e := self._entries[k]).pinned or e.editing is not None  # see [Note: modify blocks]
        )

    async def _make_room(self, entry: Entry, tier: Tier) -> None:
        """Remove ``entry``'s copy from ``tier``: a plain drop when a slower copy exists, else a write down."""
        self._stats.tiers[tier].evictions += 1
        if any(t.rank > tier.rank for t in entry.copies):
            self._drop_copy(entry, tier)
            return
        entry.leaving.add(tier)
        try:
            dest = tier.below()
            assert dest is not None
            host = self._backends[Tier.HOST]
            if dest is Tier.HOST and host.budget is not None and host.footprint(entry.nbytes) > host.budget:
                dest = Tier.NVME
            task = self._materialize(entry, dest)
            if task is not None:
                await asyncio.shield(task)
        finally:
            entry.leaving.discard(tier)
        if self._entries.get(entry.key) is entry and tier in entry.copies:
            self._drop_copy(entry, tier)

    def _wake(self, tier: Tier) -> None:
        waiters, self._space_waiters[tier] = self._space_waiters[tier], []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    # ------------------------------------------------------------------ copy bookkeeping

    def _begin_read(self, entry: Entry, tier: Tier) -> Copy:
        copy = entry.copies[tier]
        copy.readers += 1
        return copy

    def _end_read(self, tier: Tier, copy: Copy) -> None:
        self._backends[tier].end_read(copy)
        self._wake(tier)

    def _add_copy(self, entry: Entry, tier: Tier, copy: Copy) -> None:
        entry.copies[tier] = copy
        self._resident[tier].add(entry.key)

    def _drop_copy(self, entry: Entry, tier: Tier) -> None:
        copy = entry.copies.pop(tier)
        if self._entries.get(entry.key) is entry or entry.key not in self._entries:
            self._resident[tier].discard(entry.key)
        self._backends[tier].release(copy)
        self._wake(tier)

    def _settle(self, tier: Tier, copy: Copy) -> None:
        """A copy allocated by _admit stops counting as in flight."""
        self._inflight[tier] -= copy.footprint

    def _install(self, entry: Entry, tier: Tier, copy: Copy) -> None:
        """Attach a finished copy to its entry, or free it if the entry was replaced meanwhile."""
        self._settle(tier, copy)
        if self._entries.get(entry.key) is entry and tier not in entry.copies:
            self._add_copy(entry, tier, copy)
            self._wake(tier)
        else:
            self._backends[tier].release(copy)
            self._wake(tier)

    def _discard(self, tier: Tier, copy: Copy) -> None:
        self._settle(tier, copy)
        self._backends[tier].release(copy)
        self._wake(tier)

    def _retire(self, entry: Entry) -> None:
        """Release every copy of a replaced or deleted entry (freed once their readers finish)."""
        current = self._entries.get(entry.key)
        for tier in list(entry.copies):
            copy = entry.copies.pop(tier)
            if current is None or tier not in current.copies:
                self._resident[tier].discard(entry.key)
            self._backends[tier].release(copy)
            self._wake(tier)

    async def _commit_tombstone(self, key: str, generation: int, doing: str) -> None:
        """Commit the removal of ``key``'s record at ``generation``. A failure raises an error naming
        the key (``doing`` says what the caller was doing) and removes nothing."""
        try:
            await self._commits.submit(key, generation, None, None)
        except BaseException as exc:
            if isinstance(exc, (OSError, TieredError)):
                raise naming_key(exc, doing, key) from exc
            raise

    async def _retire_durably(self, entry: Entry, generation: int) -> None:
        """Retire an entry whose record may be committed: remove the record first, and only then
        free its extents, so committed extents are never reused while a record points at them
        (see [Note: crash safety] in tiered.store.tiered_store)."""
        nvme = entry.copies.pop(Tier.NVME, None)
        current = self._entries.get(entry.key)
        if nvme is not None and (current is None or Tier.NVME not in current.copies):
            self._resident[Tier.NVME].discard(entry.key)
        self._retire(entry)
        try:
            await self._commits.submit(entry.key, generation, None, None)
        except BaseException as exc:
            # The old record may still be committed, pointing at these extents: keep them allocated
            # (until the next open) so no later put overwrites them. A delete that failed leaves the
            # key as committed; after a put, the new version's put or delete must try again.
            if current is not None:
                current.persisted = True
            elif nvme is not None and entry.key not in self._entries:
                self._entries[entry.key] = entry
                self._add_copy(entry, Tier.NVME, nvme)
                self._policy.touch(entry.key)
            if isinstance(exc, (OSError, TieredError)):
                raise naming_key(exc, "removing the committed record of", entry.key) from exc
            raise
        if nvme is not None:
            self._backends[Tier.NVME].release(nvme)
