"""rename / rename_many on the store's loop: move entries to other keys without moving a byte.

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

from tiered.errors import TieredError
from tiered.manifest.records import Record, dtype_name
from tiered.store.entry import Entry
from tiered.store.error_messages import naming_key
from tiered.store.validation import check_distinct, check_key
from tiered.store.versions import Versions
from tiered.tier import Tier

if TYPE_CHECKING:
    from tiered.backends import NvmeCopy


class Renames:
    """rename_many on the store's loop."""

    def __init__(self, versions: Versions) -> None:
        self.versions = versions
        self.tiers = versions.tiers
        self.commits = versions.commits

    async def rename_many(self, pairs: list[tuple[str, str]]) -> None:
        versions = self.versions
        keys = [k for pair in pairs for k in pair]
        locked = await versions.locks.acquire_all(keys)
        try:
            entries = [versions.entry(src) for src, _ in pairs]
            changes: list[tuple[str, int, Optional[Record], Optional["NvmeCopy"]]] = []
            moved: list[tuple[Entry, Entry]] = []
            for (src, dst), entry in zip(pairs, entries):
                new = Entry(dst, entry.dtype, entry.shape, entry.nbytes, versions.next_generation(),
                            codec=entry.codec, codec_meta=entry.codec_meta, stored_nbytes=entry.stored_nbytes,
                            pinned=entry.pinned, compress=entry.compress)
                old_dst = versions.entries.get(dst)
                nvme = entry.copies.get(Tier.NVME)
                if nvme is not None:
                    new.persisted = True
                    changes.append((dst, new.generation, _record(new, nvme), None))
                elif (old_dst is not None and old_dst.persisted) or dst in versions.damaged:
                    changes.append((dst, new.generation, None, None))
                if entry.persisted:
                    changes.append((src, versions.next_generation(), None, None))
                moved.append((entry, new))
            if changes:
                results = await asyncio.gather(*self.commits.submit_many(changes), return_exceptions=True)
                failed = next((r for r in results if isinstance(r, BaseException)), None)
                if failed is not None:
                    what = ", ".join(f"{s!r} -> {d!r}" for s, d in pairs)
                    if isinstance(failed, (OSError, TieredError)):
                        raise naming_key(failed, "renaming", what) from failed
                    raise failed
            for entry, new in moved:
                self._install_renamed(entry, new)
        finally:
            versions.locks.release_all(locked)

    def _install_renamed(self, entry: Entry, new: Entry) -> None:
        """Give ``entry``'s copies to ``new`` (committed already), make it its key's value and
        retire what that key held before."""
        versions, tiers = self.versions, self.tiers
        for tier in list(entry.copies):
            copy = tiers.detach(entry, tier)
            tiers.add_copy(new, tier, copy)  # type: ignore[arg-type]
        del versions.entries[entry.key]
        entry.retired = True
        tiers.policy.forget(entry.key)
        old_dst = versions.entries.get(new.key)
        versions.entries[new.key] = new
        if versions.damaged.pop(new.key, None) is not None:
            new.persisted = True
        tiers.policy.touch(new.key, access=False)
        if old_dst is not None:
            old_dst.retired = True
            tiers.retire(old_dst)


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
