"""modify: change a stored tensor in place, with no copy out and back when it lives in CPU memory.

``Modification`` is the handle callers get; ``Modifications`` opens and ends the blocks on the
store's loop.

[Note: modify blocks]
An entry whose fastest copy is in host or device memory is lent: the store swaps the entry for a
new version that owns that copy (retiring the old version's other copies, durably when it was
committed), and the block writes that memory directly when it is one contiguous CPU range (the
host pool; the device tier without a GPU), or else a CPU copy that goes back into the same memory
on exit, so a block never needs room in a tier, which other blocks could be holding. An entry held
only on nvme is read into a new tensor and put on exit (back to nvme unless the caller names a
tier). Either way the key is locked and its version held for the block's duration (see
[Note: holding a version] in tiered.store.versions): its gets wait for the block, and so do its
puts, deletes, renames, prefetches, flushes and evictions.

A lent copy has a reader, so eviction never picks it, and admission counts it as pinned: a put
that only its memory could make room for fails with CapacityError instead of waiting for a block
that may be open in the same task. ``close()`` ends the open blocks before it waits for anything
else (a lent copy keeps the bytes written so far; a CPU copy of the value is never written back),
and their exit then raises StoreClosedError.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from types import TracebackType
from typing import Optional

import torch

from tiered.backends import Copy
from tiered.errors import StoreClosedError
from tiered.io.spans import Span, new_result, spans_of_tensor, typed_view
from tiered.store.calls import Calls
from tiered.store.entry import Entry
from tiered.store.operations import Operations
from tiered.tier import Tier


@dataclasses.dataclass(eq=False)
class _Edit:
    """One open modification (store loop state)."""

    entry: Entry  # the version held while the block runs
    tensor: torch.Tensor
    tier: Tier  # where the lent copy is, or where an nvme entry's value is put on exit
    lent: Optional[Copy]  # the memory copy this version owns; None: an nvme entry, put back on exit
    done: "asyncio.Future[None]"  # the hold: done when the block ends
    in_place: bool = False  # the tensor is the lent copy's memory (else a copy of it, copied back on exit)
    abandoned: bool = False  # the store closed first


class Modification:
    """What :meth:`TieredStore.modify` and ``store.sync.modify`` return: a context manager (``async
    with`` or ``with``) whose value is the entry's tensor, to change in place.

    ``in_place`` says, once entered, whether the tensor is the store's own memory (True) or a copy
    that is written back on exit (False).
    """

    def __init__(self, calls: Calls, blocks: "Modifications", key: str, tier: Optional[Tier]) -> None:
        self._calls = calls
        self._blocks = blocks
        self._key = key
        self._tier = tier
        self._edit: Optional[_Edit] = None

    @property
    def in_place(self) -> bool:
        """True when the block writes the store's memory directly (valid once entered)."""
        if self._edit is None:
            raise RuntimeError(f"modification of {self._key!r} is not open")
        return self._edit.in_place

    async def __aenter__(self) -> torch.Tensor:
        self._check_unused()
        opening = asyncio.ensure_future(self._calls.call(self._blocks.begin, self._key, self._tier))
        try:
            self._edit = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(self._end_unclaimed)  # the block opens anyway: end it
            raise
        return self._edit.tensor

    async def __aexit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                        tb: Optional[TracebackType]) -> None:
        edit = self._release()
        await self._calls.call(self._blocks.end, edit)

    def __enter__(self) -> torch.Tensor:
        self._check_unused()
        opening = self._calls.submit_sync(self._blocks.begin, self._key, self._tier)
        try:
            self._edit = opening.result()
        except BaseException:  # KeyboardInterrupt while waiting: the block opens anyway, end it then
            opening.add_done_callback(self._end_unclaimed)
            raise
        return self._edit.tensor

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        edit = self._release()
        self._calls.call_sync(self._blocks.end, edit)

    def _end_unclaimed(self, opening: "asyncio.Future[_Edit] | concurrent.futures.Future[_Edit]") -> None:
        """End a block whose caller stopped waiting for it to open (else its key would stay locked)."""
        if opening.cancelled() or opening.exception() is not None:
            return
        try:
            self._calls.submit(self._blocks.end, opening.result())
        except StoreClosedError:
            pass  # the close ended it

    def _check_unused(self) -> None:
        if self._edit is not None:
            raise RuntimeError(f"modification of {self._key!r} is already open; a Modification is entered once")

    def _release(self) -> _Edit:
        edit, self._edit = self._edit, None
        if edit is None:
            raise RuntimeError(f"modification of {self._key!r} is not open: exit without enter")
        if edit.abandoned:
            raise StoreClosedError(
                f"the store closed while {self._key!r} was being modified; "
                + ("the bytes written before the close were kept" if edit.in_place
                   else "the change was not stored (reopen the store and modify again)")
            )
        return edit


class Modifications:
    """The open modify blocks, and opening and ending them on the store's loop."""

    def __init__(self, operations: Operations) -> None:
        self.ops = operations
        self.versions = operations.versions
        self.tiers = operations.tiers
        self.transfers = operations.transfers
        self._edits: set[_Edit] = set()
        #: close() has begun: a block that opens now is ended at once (see [Note: modify blocks]).
        self.closing = False

    async def begin(self, key: str, put_to: Optional[Tier]) -> _Edit:
        versions, tiers = self.versions, self.tiers
        await versions.locks.acquire(key)
        held: "Optional[asyncio.Future[None]]" = None
        try:
            entry = versions.entry(key)
            # From here transfers and gets of this version wait for the block (see [Note: holding a
            # version] in tiered.store.versions); gets already reading its memory must finish before
            # it is lent.
            held = await versions.hold([entry])
            entry.editing = True
            while (tier := entry.top()) is not Tier.NVME and entry.copies[tier].readers:  # type: ignore[index]
                assert tier is not None
                await tiers.wait_for_change(tier)  # end_read wakes the tier's waiters
            assert tier is not None
            if tier is Tier.NVME:
                edit = await self._read_for_edit(entry, put_to or Tier.NVME, held)
            else:
                edit = await self._lend(entry, tier, held)
        except BaseException:  # nothing changed (a failed _lend leaves a new version with the old bytes)
            if held is not None:
                versions.release([versions.entries.get(key, entry), entry], held)
            versions.locks.release(key)
            raise
        self._edits.add(edit)
        if self.closing:  # the close has already ended the blocks open when it started
            edit.abandoned = True
            self._finish(edit)
            raise StoreClosedError(f"the store closed while {key!r} was being opened for modification")
        return edit

    async def _lend(self, entry: Entry, tier: Tier, held: "asyncio.Future[None]") -> _Edit:
        """Make a new version of ``entry`` that owns its ``tier`` copy, and lend that copy's memory:
        as it is when it is one CPU range, else as a CPU tensor copied back into it on exit (so the
        block never needs room in a tier, which other lent copies could be holding)."""
        versions, tiers = self.versions, self.tiers
        key = entry.key
        copy = tiers.detach(entry, tier)
        assert copy is not None
        new = Entry(key, entry.dtype, entry.shape, entry.nbytes, versions.next_generation(), compress=entry.compress)
        new.pinned = entry.pinned
        tiers.add_copy(new, tier, copy)
        tiers.begin_read(new, tier)  # a copy with a reader is never chosen as an eviction victim
        new.held, new.editing = held, True
        memory = self.transfers.memory_spans(tier, copy)
        view = _one_cpu_range(memory, entry)
        edit = _Edit(new, view if view is not None else torch.empty(0), tier, copy, held, in_place=view is not None)
        versions.swap(entry, new)  # waiters on the old version find it retired and look the key up
        entry.held, entry.editing = None, False
        tiers.policy.touch(key)
        try:
            if entry.persisted:
                # The old version must not come back after a crash once this one replaced it.
                await versions.retire_durably(entry, new.generation)
            else:
                tiers.retire(entry)
            if view is None:
                edit.tensor, dst = new_result(entry.shape, entry.dtype, "cpu", self.ops.results)
                await self.transfers.device.copy(dst, memory)
                self.ops.count_get(new, tier)
        except BaseException:
            tiers.end_read(tier, copy)  # the new version holds the old bytes, unchanged: nothing is lost
            raise
        return edit

    async def _read_for_edit(self, entry: Entry, put_to: Tier, held: "asyncio.Future[None]") -> _Edit:
        """Read an entry held only on nvme into a new CPU tensor, to be put to ``put_to`` on exit."""
        result, dst = new_result(entry.shape, entry.dtype, "cpu", self.ops.results)
        copy = self.tiers.begin_read(entry, Tier.NVME)
        try:
            await self.transfers.read_copy(entry, Tier.NVME, copy, dst)
        finally:
            self.tiers.end_read(Tier.NVME, copy)
        self.ops.count_get(entry, Tier.NVME)
        return _Edit(entry, result, put_to, None, held)

    async def end(self, edit: _Edit) -> None:
        """Put the block's value back (as a put of an nvme entry, or into its lent memory) and give
        the key up."""
        try:
            if edit.lent is None:
                await self.ops.put_locked(edit.entry.key, edit.tensor, edit.tier, edit.entry.compress)
            elif not edit.in_place:
                await self.transfers.device.copy(self.transfers.memory_spans(edit.tier, edit.lent),
                                                 spans_of_tensor(edit.tensor))
        finally:
            self._finish(edit)

    def _finish(self, edit: _Edit) -> None:
        """Wake the key's waiters and give the key up (lent memory: eviction may take it again)."""
        if edit.lent is not None:
            self.tiers.end_read(edit.tier, edit.lent)
        self.versions.release([edit.entry], edit.done)
        self._edits.discard(edit)
        self.versions.locks.release(edit.entry.key)

    def abandon_all(self) -> None:
        """At close: end every open block as it stands (a lent entry keeps the bytes written so
        far, which the close then writes down; a copy is never put back)."""
        self.closing = True
        for edit in list(self._edits):
            edit.abandoned = True
            self._finish(edit)


def _one_cpu_range(memory: Optional[list[Span]], entry: Entry) -> Optional[torch.Tensor]:
    """The entry's bytes as a tensor of its dtype and shape, when they are one CPU range."""
    if memory is None or len(memory) != 1 or memory[0].tensor.device.type != "cpu":
        return None
    return typed_view(memory[0].tensor, entry.dtype, entry.shape)
