"""Which version each key holds, and replacing one durably.

This is the one place that makes a version its key's value or takes it away (``entries``), and
that marks a version retired (see [Note: versions and copies] in tiered.store.entry). Every
method runs on the store's loop.

[Note: key locks]
Puts, deletes, renames and modify blocks of one key take that key's lock (``KeyLocks``: first
come, first served) and run one at a time. ``put_many`` and ``rename_many`` take all of their keys
at once, in sorted order so that two calls sharing keys cannot deadlock, and hold them until
every entry is written, committed and installed. Gets, prefetches, pins, evictions, write-downs
and flushes take no key lock: they work on the version they found, and what they make for a
version retired meanwhile is discarded. Transfers wait while a version is held (see
[Note: holding a version]); gets wait only for a modify block, which changes the bytes.

[Note: holding a version]
Two kinds of work change a version. Operations holding its key's lock replace or remove it: put,
put_many, delete, a modify block, and a rename at both of its keys. Transfers, which take no key
lock, add copies to it, and a write-down gives it a record: ``persisted`` before its first byte,
then the nvme copy and its codec. A replacement commits what the version's state calls for: a
tombstone when it has a record or may get one, the moved record when a rename carries an nvme
copy. One rule keeps those decisions true: a replacement decides from the state the version has
at the instant it replaces it.

A put and a delete need no hold. Either they find no record (``persisted`` is false) and
replace in the same step, with no await between, so a write-down that starts later finds the
version retired and writes nothing; or they commit a tombstone, which stays right whatever the
version does meanwhile: its generation is newer than any record of the version, and a write-down
whose record committed first waits for it before freeing its extents (``Transfers``). A rename
must commit, before it replaces, what depends on the version's state (the record of its nvme copy
and codec under the new key; a tombstone if it has a record), so it holds the versions at both
keys (``hold``): it waits until no transfer of them is in flight, then sets ``Entry.held`` until
they are moved or the call failed. A transfer asked for meanwhile (an evict, a flush, an eviction's
write-down, a prefetch) waits for the hold before it starts, and eviction passes a held version
over, so its record, copies and codec stay as decided. A modify block holds its version the same
way, for its own reason: the bytes change while the block is open (``editing``: gets wait too).

A rename moves the version itself to the new key, with a new generation (``move``), so a
transfer that waited for it continues on the moved version: an evict or flush of the old key that
overlapped the rename writes the value down under the new key, as if it had run first. A put, a
delete and a modify block leave the old version retired, and such a transfer stops.

[Note: crash safety]
A process killed at any instant leaves every key with its old or its new value, bit-exact,
because of two rules:

1. a record is committed only after the bytes it names are durable (see [Note: group commit] in
   tiered.manifest.commits);
2. extents that a committed record points at are never written. A new version always gets new
   extents (``Transfers.write_nvme``), and old ones are freed only once the record replacing them
   has committed: a put to nvme commits its record in place of the old one, and ``replace`` then
   retires the old version. A delete, a put to host or device memory and a modify block lending a
   memory copy, over a key that has a record (``persisted``), commit a tombstone first
   (``commit_tombstone``, ``retire_durably``); else a crash would bring the older value back.
   ``persisted`` is set before a write-down writes its first byte, so a delete or put racing it
   commits a tombstone too, and a write-down whose record committed just before its version was
   replaced waits for that tombstone (``CommitLog.barrier``) before freeing its extents. When a
   tombstone fails to commit, the extents it would have freed stay allocated (at worst until the
   next open).

So space written by work that never committed is free again at the next open, with no scan:
``adopt`` marks the committed records' extents used (one that overlaps another or lies past the
end of its file is a ManifestError) and the rest of each swap file is free. Generations continue
after the largest committed one. ``StoreConfig(durable=False)`` skips the ``fdatasync`` of rule 1:
records still commit, but after a crash one may name bytes that fail their checksums.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Sequence

from tiered.backends import Copy, NvmeCopy
from tiered.errors import KeyNotFoundError, ManifestError, TieredError
from tiered.manifest.commits import CommitLog
from tiered.manifest.records import Record, Row
from tiered.stats import StoreStats
from tiered.store.entry import Entry
from tiered.store.error_messages import naming_key
from tiered.store.tiers import Tiers
from tiered.store.validation import check_key
from tiered.tier import Tier
from tiered.util.keylocks import KeyLocks


class Versions:
    """The current version of every key, the damaged records that hide keys, the generation
    counter and the key locks (store loop state)."""

    def __init__(self, path: str, tiers: Tiers, commits: CommitLog, stats: StoreStats, *,
                 damaged: Sequence[Row] = (), first_generation: int = 0) -> None:
        self._path = path
        self.tiers = tiers
        self.commits = commits
        self.stats = stats
        #: key -> its current version.
        self.entries: dict[str, Entry] = {}
        #: key -> its damaged manifest row, never served (see tiered.manifest.records).
        self.damaged: dict[str, Row] = {row.record.key: row for row in damaged}
        self.locks = KeyLocks()  # see [Note: key locks]
        self._generation = itertools.count(first_generation)

    def next_generation(self) -> int:
        return next(self._generation)

    # ------------------------------------------------------------------ lookups

    def entry(self, key: str) -> Entry:
        """The current entry of ``key``; TypeError for a non-string key, else :meth:`missing`'s error."""
        entry = self.entries.get(key)
        if entry is None:
            check_key(key)
            raise self.missing(key)
        return entry

    def entries_of(self, keys: Sequence[str]) -> list[Entry]:
        """The current entries of ``keys``; KeyNotFoundError naming every missing key."""
        entries = [self.entries.get(k) for k in keys]
        missing = [k for k, e in zip(keys, entries) if e is None]
        if missing:
            raise KeyNotFoundError(f"{len(missing)} of {len(keys)} keys are not in the store: {missing!r}")
        return entries  # type: ignore[return-value]

    def missing(self, key: str) -> TieredError:
        """The error for a key without an entry: ManifestError when its manifest record is damaged
        (it is never served), else KeyNotFoundError (saying when damaged records might hold it)."""
        row = self.damaged.get(key)
        fsck = f"tiered fsck {self._path}"
        if row is not None:
            return ManifestError(
                f"the manifest record of {key!r} (row {row.rowid}) is damaged ({'; '.join(row.problems)}), so it is "
                f"not served; put or delete the key to replace the record, or `{fsck} --delete-damaged` removes it"
            )
        if self.damaged:
            return KeyNotFoundError(
                f"key {key!r} is not in the store; {len(self.damaged)} damaged manifest record(s) are not served, "
                f"and one of them may have been this key (`{fsck}` lists them)"
            )
        return KeyNotFoundError(f"key {key!r} is not in the store")

    def current(self, entry: Entry, key: str) -> Entry:
        """The version to read for ``key``, found earlier as ``entry``: ``entry`` while it is a
        key's value (a rename may have moved it since: the read comes before the rename), else what
        ``key`` holds now."""
        return self.entry(key) if entry.retired else entry

    async def unedited(self, entry: Entry, key: str) -> Entry:
        """:meth:`current`, once no modify block is changing it."""
        entry = self.current(entry, key)
        while (held := entry.changing) is not None:
            await asyncio.wait([held])
            entry = self.current(entry, key)
        return entry

    # ------------------------------------------------------------------ holding versions

    async def hold(self, entries: Sequence[Entry]) -> "asyncio.Future[None]":
        """Wait until no transfer of ``entries`` is in flight, then hold them until :meth:`release`
        (see [Note: holding a version]). The caller holds their keys' locks."""
        while moving := [task for e in entries for task in e.moving.values()]:
            await asyncio.wait(moving)
        held = asyncio.get_running_loop().create_future()
        for entry in entries:
            entry.held = held
        return held

    def release(self, entries: Sequence[Entry], held: "asyncio.Future[None]") -> None:
        """End :meth:`hold`: transfers waiting for it start, eviction may take the versions again."""
        for entry in entries:
            if entry.held is held:
                entry.held = None
                entry.editing = False
        if not held.done():
            held.set_result(None)
        self.tiers.wake_all()

    # ------------------------------------------------------------------ installing and retiring versions

    def adopt(self, rec: Record) -> None:
        """Rebuild an entry from its committed record at open; its extents become used, all else is
        free (see [Note: crash safety])."""
        copy = NvmeCopy(
            nbytes=rec.stored_nbytes,
            footprint=sum(e.length for e in rec.extents),
            extents=list(rec.extents),
            chunk=rec.chunk,
            crcs=list(rec.crcs) if rec.crcs is not None else None,
        )
        try:
            self.tiers.backends[Tier.NVME].mark_used(copy)  # type: ignore[attr-defined]
        except ValueError as exc:
            raise ManifestError(
                f"entry {rec.key!r} in the manifest is inconsistent with the swap files: {exc}; the swap files were "
                f"truncated or replaced, or the manifest is damaged. `tiered fsck {self._path} --delete-damaged` "
                "removes such records and keeps the rest"
            ) from exc
        entry = Entry(
            rec.key, rec.torch_dtype(), rec.shape, rec.nbytes, rec.generation,  # type: ignore[arg-type]
            codec=rec.codec, codec_meta=rec.codec_meta, stored_nbytes=rec.stored_nbytes, persisted=True,
        )
        self.entries[rec.key] = entry
        self.tiers.add_copy(entry, Tier.NVME, copy)
        self.tiers.policy.touch(rec.key)

    def move(self, entry: Entry, dst: str, generation: int) -> None:
        """Make the held, current version ``entry`` the value of ``dst`` (whose record, if it has an
        nvme copy, committed at ``generation``), and retire what ``dst`` held before."""
        src = entry.key
        del self.entries[src]
        self.tiers.policy.forget(src)
        old = self.entries.get(dst)
        entry.key, entry.generation = dst, generation
        entry.persisted = Tier.NVME in entry.copies
        self.entries[dst] = entry
        self.tiers.rekey(entry, src)
        if self.damaged.pop(dst, None) is not None:
            entry.persisted = True  # the tombstone removed the damaged row; stay on the safe side
        self.tiers.policy.touch(dst, access=False)
        if old is not None:
            old.retired = True
            self.tiers.retire(old)

    def swap(self, old: Entry, new: Entry) -> None:
        """Make ``new`` its key's value in place of ``old`` (now retired, its copies still on it)."""
        self.entries[new.key] = new
        old.retired = True
        if self.damaged.pop(new.key, None) is not None:
            new.persisted = True  # a damaged row of the key is on disk: a delete must remove it

    async def replace(self, entry: Entry, tier: Tier, copy: Copy) -> None:
        """Make a written ``entry`` (its one copy: ``copy`` in ``tier``) the key's current version and
        retire the old one.

        Awaits only for a memory-tier put over a persisted key (its tombstone must commit first).
        """
        key = entry.key
        old = self.entries.get(key)
        if old is not None and old.persisted and tier is not Tier.NVME:
            # The old version must not come back after a crash once a newer one was put: its
            # tombstone commits first, and when it cannot, the put fails and the old version stays
            # (see [Note: crash safety]).
            try:
                await self.commit_tombstone(key, entry.generation, "putting")
            except BaseException:
                self.tiers.discard(tier, copy)
                raise
        self.entries[key] = entry
        if self.damaged.pop(key, None) is not None:
            entry.persisted = True  # a damaged row of the key is on disk: a delete must remove it
        self.tiers.install(entry, tier, copy)
        self.stats.puts += 1
        if tier is not Tier.NVME:  # write_nvme counted nvme's bytes_in
            self.stats.tiers[tier].bytes_in += entry.nbytes
        self.tiers.policy.touch(key, access=False)  # recent, but not a step of the (read) order
        if old is not None:
            entry.pinned = old.pinned
            old.retired = True
            self.tiers.retire(old)

    async def remove(self, key: str) -> None:
        """Delete ``key``: its record first when it may have one; the caller holds its lock."""
        if key not in self.entries and key in self.damaged:  # the damaged record goes
            await self.commit_tombstone(key, self.next_generation(), "deleting")
            del self.damaged[key]
            return
        entry = self.entry(key)
        del self.entries[key]
        entry.retired = True
        self.tiers.policy.forget(key)
        self.stats.deletes += 1
        if entry.persisted:
            await self.retire_durably(entry, self.next_generation())
        else:
            self.tiers.retire(entry)

    async def commit_tombstone(self, key: str, generation: int, doing: str) -> None:
        """Commit the removal of ``key``'s record at ``generation``. A failure raises an error naming
        the key (``doing`` says what the caller was doing) and removes nothing."""
        try:
            await self.commits.submit(key, generation, None, None)
        except BaseException as exc:
            if isinstance(exc, (OSError, TieredError)):
                raise naming_key(exc, doing, key) from exc
            raise

    async def retire_durably(self, entry: Entry, generation: int) -> None:
        """Retire a version whose record may be committed: remove the record first, and only then
        free its extents, so committed extents are never reused while a record points at them
        (see [Note: crash safety])."""
        tiers = self.tiers
        nvme = tiers.detach(entry, Tier.NVME)
        current = self.entries.get(entry.key)
        tiers.retire(entry)
        try:
            await self.commits.submit(entry.key, generation, None, None)
        except BaseException as exc:
            # The old record may still be committed, pointing at these extents: keep them allocated
            # (until the next open) so no later put overwrites them. A delete that failed leaves the
            # key as committed; after a put, the new version's put or delete must try again.
            if current is not None:
                current.persisted = True
            elif nvme is not None:
                self.entries[entry.key] = entry
                entry.retired = False
                tiers.add_copy(entry, Tier.NVME, nvme)
                tiers.policy.touch(entry.key)
            if isinstance(exc, (OSError, TieredError)):
                raise naming_key(exc, "removing the committed record of", entry.key) from exc
            raise
        if nvme is not None:
            tiers.backends[Tier.NVME].release(nvme)
