"""rename / rename_many: move entries to other keys without moving a byte.

A mixin of TieredStore: its methods run on the store's state, and the private ones on its loop.

[Note: Renames]
A rename gives an entry's copies to a new entry under the new key and retires the old key; the
bytes stay where they are. On nvme the new key's record names the same extents, CRCs and codec as
the old one's, under a new generation; it is committed together with the old key's tombstone (and
with every other pair of the call) in one manifest transaction (CommitLog.submit_many), so after a
crash either every pair has moved or none has. Only once that transaction has committed does the
store's memory change: the new entry takes the copies, the old key disappears and the value the
new key had before is retired (its extents freed, since no committed record names them any
more). An entry without an nvme copy moves in memory alone; tombstones still commit first for the
old key and for a destination that had a committed value, as a put to host does, so a crash never
brings back a value older than what the call replaced. The keys' locks are held throughout: puts,
deletes and modify blocks of these keys wait, and reads see the old keys until the commit.
Transfers of the old entry still in flight (a prefetch, a write-down) find it superseded when they
end and drop what they produced, as they do after a put.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Iterable, Optional

from tiered.store.entry import Entry
from tiered.errors import TieredError
from tiered.manifest.records import Record, dtype_name
from tiered.store.error_messages import naming_key
from tiered.store.validation import check_distinct, check_key
from tiered.tier import Tier

if TYPE_CHECKING:
    from tiered.backends import NvmeCopy
    from tiered.store.tiered_store import TieredStore


class Renames:
    """The rename calls of :class:`~tiered.TieredStore` (mixed into it)."""

    async def rename(self, src: str, dst: str) -> None:
        """Move the value of ``src`` to the key ``dst`` (replacing any value ``dst`` had); ``src`` is
        gone afterwards. No byte is read or written: the entry keeps its copies and extents.

        Durable when it returns, and atomic: after a crash at any moment either the value is under
        ``dst`` and ``src`` is absent, or both keys are as they were ([Note: Renames]).

        Raises:
            TypeError / ValueError: a key that is not a valid string, or ``src == dst``.
            KeyNotFoundError: ``src`` is not in the store (ManifestError: its record is damaged).
            CapacityError / ManifestError: the manifest could not commit; nothing changed.
        """
        await self.rename_many([(src, dst)])

    async def rename_many(self: "TieredStore", pairs: Iterable[tuple[str, str]]) -> None:
        """:meth:`rename` of several ``(src, dst)`` pairs as one transaction: every pair moves, or
        (when the call raises, or after a crash) none does. A key may appear once in the whole call."""
        checked = rename_pairs(pairs)
        return await self._call(self._rename_many, checked)

    async def _rename_many(self: "TieredStore", pairs: list[tuple[str, str]]) -> None:
        store = self
        keys = [k for pair in pairs for k in pair]
        locked = await store._key_locks.acquire_all(keys)
        try:
            entries = [store._entry(src) for src, _ in pairs]
            changes: list[tuple[str, int, Optional[Record], Optional["NvmeCopy"]]] = []
            moved: list[tuple[Entry, Entry]] = []
            for (src, dst), entry in zip(pairs, entries):
                new = Entry(dst, entry.dtype, entry.shape, entry.nbytes, next(store._generation),
                            codec=entry.codec, codec_meta=entry.codec_meta, stored_nbytes=entry.stored_nbytes,
                            pinned=entry.pinned, compress=entry.compress)
                old_dst = store._entries.get(dst)
                nvme = entry.copies.get(Tier.NVME)
                if nvme is not None:
                    new.persisted = True
                    changes.append((dst, new.generation, _record(new, nvme), None))
                elif (old_dst is not None and old_dst.persisted) or dst in store._damaged:
                    changes.append((dst, new.generation, None, None))
                if entry.persisted:
                    changes.append((src, next(store._generation), None, None))
                moved.append((entry, new))
            if changes:
                results = await asyncio.gather(*store._commits.submit_many(changes), return_exceptions=True)
                failed = next((r for r in results if isinstance(r, BaseException)), None)
                if failed is not None:
                    what = ", ".join(f"{s!r} -> {d!r}" for s, d in pairs)
                    if isinstance(failed, (OSError, TieredError)):
                        raise naming_key(failed, "renaming", what) from failed
                    raise failed
            for entry, new in moved:
                store._install_renamed(entry, new)
        finally:
            store._key_locks.release_all(locked)

    def _install_renamed(self: "TieredStore", entry: Entry, new: Entry) -> None:
        """Give ``entry``'s copies to ``new`` (committed already), make it its key's value and
        retire what that key held before."""
        store = self
        for tier in list(entry.copies):
            copy = entry.copies.pop(tier)
            store._resident[tier].discard(entry.key)
            new.copies[tier] = copy
            store._resident[tier].add(new.key)
        del store._entries[entry.key]
        store._policy.forget(entry.key)
        old_dst = store._entries.get(new.key)
        store._entries[new.key] = new
        if store._damaged.pop(new.key, None) is not None:
            new.persisted = True
        store._policy.touch(new.key, access=False)
        if old_dst is not None:
            store._retire(old_dst)


def rename_pairs(pairs: object) -> list[tuple[str, str]]:
    """Validate rename_many's pairs on the caller's thread: (src, dst) string pairs, every key once."""
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
        raise TypeError(f"rename_many takes (src, dst) pairs, got {type(pairs).__name__}")
    checked = []
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"rename_many takes (src, dst) pairs, got the item {pair!r}")
        src, dst = pair
        check_key(src)
        check_key(dst)
        if src == dst:
            raise ValueError(f"rename of {src!r} to itself; give another destination key")
        checked.append((src, dst))
    check_distinct([k for pair in checked for k in pair], "rename_many")
    return checked


def _record(entry: Entry, copy: "NvmeCopy") -> Record:
    """The manifest record of ``entry`` whose nvme copy is ``copy`` (already written and committed
    under another key)."""
    assert entry.stored_nbytes is not None
    return Record(
        entry.key, dtype_name(entry.dtype), entry.shape, entry.nbytes, entry.stored_nbytes, entry.codec,
        entry.codec_meta, copy.chunk, tuple(copy.extents), tuple(copy.crcs) if copy.crcs is not None else None,
        entry.generation,
    )
