"""An entry (one key's current version) and the public snapshot of it.

[Note: versions and copies]
An ``Entry`` is one version of one key. Its copies, one per tier at most, hold the same bytes
(inclusive caching): dropping an upper copy while a slower one exists costs no I/O, and only a
dirty entry (no nvme copy) is written down before its last copy goes. A put makes a new ``Entry``
with the next generation of a store-wide counter (it keeps the old version's ``pinned``) and
retires the old one (``retired``), so work still in flight on the old one discards what it made:
``Tiers.install`` frees the new copy instead of attaching it, a transfer stops before it reads,
an eviction drops nothing. Retiring a version releases its copies, and a copy being read is freed
only when its last reader finishes (``Copy.readers``), so a get that races a put or a delete
still reads intact bytes of the version it started on. A rename does not make a new version: it
moves this one to its new key (see [Note: holding a version] in tiered.store.versions), so what
is in flight on it follows it there. A version with a committed record (``persisted``) is
retired durably: see [Note: crash safety] in tiered.store.versions.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional

import torch

from tiered.backends import Copy
from tiered.manifest.records import RAW
from tiered.tier import TIERS_TOP_DOWN, Tier

__all__ = ["RAW", "Entry", "EntryInfo"]


@dataclasses.dataclass(eq=False)
class Entry:
    """One version of one key; all its copies hold the same bytes, and it is dirty while it has no
    nvme copy (see [Note: versions and copies])."""

    #: The key whose value this version is (a rename changes it, with the generation).
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    #: Orders this version's manifest changes after every older change of its key.
    generation: int
    copies: dict[Tier, Copy] = dataclasses.field(default_factory=dict)
    codec: str = RAW
    codec_meta: bytes = b""
    stored_nbytes: Optional[int] = None
    pinned: bool = False
    #: Compress the nvme copy when this version is written down: True (asked for), False, or
    #: None (the config default; the store's compression policy decides at write time).
    compress: Optional[bool] = False
    #: A manifest record for this key is committed or on its way (set by the write-down before its
    #: first byte, so a replacement knows to commit a tombstone).
    persisted: bool = False
    #: Transfers creating a copy in a tier; gets and duplicate prefetches wait on these.
    moving: dict[Tier, "asyncio.Task[None]"] = dataclasses.field(default_factory=dict)
    #: Tiers whose copy is being written down right now (not eligible as a victim again).
    leaving: set[Tier] = dataclasses.field(default_factory=set)
    #: Set while an operation holding the key's lock owns this version (a rename, a modify block):
    #: transfers of it wait for the future, eviction passes it over ([Note: holding a version]).
    held: "Optional[asyncio.Future[None]]" = None
    #: True while the holder is a modify block changing the bytes: gets wait for ``held`` too, and
    #: its memory copy counts as pinned.
    editing: bool = False
    #: This version is no longer a key's value (replaced or deleted); set once, by Versions.
    retired: bool = False

    @property
    def dirty(self) -> bool:
        """True while no nvme copy exists: dropping the last upper copy would need a write."""
        return Tier.NVME not in self.copies

    @property
    def holder(self) -> "Optional[asyncio.Future[None]]":
        """The hold on this version while it lasts, else None ([Note: holding a version] in
        tiered.store.versions)."""
        held = self.held
        return held if held is not None and not held.done() else None

    @property
    def changing(self) -> "Optional[asyncio.Future[None]]":
        """The hold of a modify block changing this version's bytes while it lasts, else None."""
        return self.holder if self.editing else None

    def top(self) -> Optional[Tier]:
        """The fastest tier holding a copy."""
        copies = self.copies
        if len(copies) == 1:  # the common case: skip hashing every tier
            return next(iter(copies))
        return next((t for t in TIERS_TOP_DOWN if t in copies), None)

    def info(self) -> "EntryInfo":
        """A snapshot for callers."""
        return EntryInfo(
            key=self.key,
            dtype=self.dtype,
            shape=self.shape,
            nbytes=self.nbytes,
            stored_nbytes=self.stored_nbytes,
            tiers=tuple(t for t in TIERS_TOP_DOWN if t in self.copies),
            codec=self.codec,
            dirty=self.dirty,
            pinned=self.pinned,
        )


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    """What the store knows about one key.

    ``stored_nbytes`` is the size on disk after any codec (None while no nvme copy exists);
    ``tiers`` lists the tiers holding a valid copy, fastest first; ``dirty`` means no nvme copy.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    stored_nbytes: Optional[int]
    tiers: tuple[Tier, ...]
    codec: str
    dirty: bool
    pinned: bool
