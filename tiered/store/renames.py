"""rename / rename_many on the store's loop: move entries to other keys without moving a byte.

[Note: Renames]
A rename moves a version to a new key; no byte moves. On nvme the new key's record names the same
extents, CRCs and codec as the old one's, under a new generation; it is committed together with
the old key's tombstone (and with every other pair of the call) in one manifest transaction
(CommitLog.submit_many), so after a crash either every pair has moved or none has. Only once that
transaction has committed does the store's memory change: the version becomes the new key's value
(``Versions.move``), the old key disappears and the value the new key had before is retired (its
extents freed, since no committed record names them any more). A version without an nvme copy
moves in memory alone; tombstones still commit first for the old key and for a destination that
had a record, as a put to host does, so a crash never brings back a value older than what the
call replaced. The keys' locks are held throughout, so puts, deletes and modify blocks of these
keys wait; the versions at both keys are held (see [Note: holding a version] in
tiered.store.versions), so what the transaction says about them stays true until it lands. Gets
keep reading the old keys until the commit; a transfer asked for on the old key meanwhile starts
once the rename is done, on the version at its new key.
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
        self.commits = versions.commits

    async def rename_many(self, pairs: list[tuple[str, str]], durable: bool = True) -> None:
        versions = self.versions
        locked = await versions.locks.acquire_all([k for pair in pairs for k in pair])
        try:
            moving = [versions.entry(src) for src, _ in pairs]
            replaced = [e for _, dst in pairs if (e := versions.entries.get(dst)) is not None]
            held = await versions.hold(moving + replaced)  # see [Note: holding a version]
            try:
                changes, generations = self._changes(pairs, moving)
                if changes:
                    await self._commit(changes, pairs, durable)
                for (_, dst), entry, generation in zip(pairs, moving, generations):
                    versions.move(entry, dst, generation)
            finally:
                versions.release(moving + replaced, held)
        finally:
            versions.locks.release_all(locked)

    def _changes(self, pairs: list[tuple[str, str]], moving: list[Entry]
                 ) -> tuple[list[tuple[str, int, Optional[Record], None]], list[int]]:
        """The manifest changes that move every pair at once, and each moved version's new
        generation: the source's record under the destination key, tombstones for what each
        source and each destination had or may have had ([Note: Renames])."""
        versions = self.versions
        changes: list[tuple[str, int, Optional[Record], None]] = []
        generations = []
        for (src, dst), entry in zip(pairs, moving):
            generation = versions.next_generation()
            generations.append(generation)
            old = versions.entries.get(dst)
            nvme = entry.copies.get(Tier.NVME)
            if nvme is not None:
                changes.append((dst, generation, _record(entry, dst, generation, nvme), None))  # type: ignore[arg-type]
            elif (old is not None and old.persisted) or dst in versions.damaged:
                changes.append((dst, generation, None, None))
            if entry.persisted:
                changes.append((src, versions.next_generation(), None, None))
        return changes, generations

    async def _commit(self, changes: list[tuple[str, int, Optional[Record], None]],
                      pairs: list[tuple[str, str]], durable: bool) -> None:
        """Commit ``changes`` in one transaction (flushed when ``durable``); an error names every pair
        and changes nothing."""
        results = await asyncio.gather(*self.commits.submit_many(changes, flush=durable), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            what = ", ".join(f"{s!r} -> {d!r}" for s, d in pairs)
            if isinstance(failed, (OSError, TieredError)):
                raise naming_key(failed, "renaming", what) from failed
            raise failed


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


def check_durable(durable: object) -> bool:
    """rename_many's ``durable``, checked on the caller's thread: TypeError unless a bool."""
    if not isinstance(durable, bool):
        raise TypeError(f"durable must be True or False, got {durable!r}")
    return durable


def _record(entry: Entry, key: str, generation: int, copy: "NvmeCopy") -> Record:
    """The manifest record of ``entry``'s nvme copy (written and committed under its old key) under
    ``key`` at ``generation``."""
    return Record(
        key, dtype_name(entry.dtype), entry.shape, entry.nbytes, copy.nbytes, entry.codec, entry.codec_meta,
        copy.chunk, tuple(copy.extents), tuple(copy.crcs) if copy.crcs is not None else None, generation,
    )
