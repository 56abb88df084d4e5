"""What a store directory holds: its committed entries and how its swap files' space is used."""

from __future__ import annotations

import dataclasses
from typing import Optional

from tiered.manifest.records import Record
from tiered.offline.space import FileSpace, account_space
from tiered.offline.storedir import StoreDirectory
from tiered.tier import Tier


@dataclasses.dataclass(frozen=True)
class InspectReport:
    """Entries, layout and space of one store directory. Space figures that depend on telling
    orphaned from free bytes are None while a store process holds the directory."""

    path: str
    in_use_by: Optional[str]
    nvme_paths: tuple[str, ...]
    files_per_dir: int
    #: The committed records, sorted by key (a damaged row's fields as far as they could be read).
    entries: tuple[Record, ...]
    spaces: tuple[FileSpace, ...]
    #: Tiers holding an entry at rest: a committed record is an nvme copy. (A running store's
    #: memory-tier copies live in its process and are not visible from outside.)
    tiers: tuple[str, ...] = (Tier.NVME.value,)
    #: Keys (as read) of the rows that are damaged: listed among the entries, never served.
    damaged: tuple[str, ...] = ()

    @property
    def logical_bytes(self) -> int:
        """Sum of the entries' tensor sizes."""
        return sum(e.nbytes for e in self.entries)

    @property
    def stored_bytes(self) -> int:
        """Sum of the entries' stored (possibly compressed) sizes."""
        return sum(e.stored_nbytes for e in self.entries)

    @property
    def ratio(self) -> Optional[float]:
        """Overall logical / stored bytes (None when nothing is stored)."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else None

    @property
    def allocated_bytes(self) -> int:
        """Swap-file bytes in extents that records reference."""
        return sum(s.allocated_bytes for s in self.spaces)

    @property
    def orphaned_bytes(self) -> Optional[int]:
        """Swap-file bytes holding data no record references (None while the store is in use)."""
        values = [s.orphaned_bytes for s in self.spaces]
        return None if None in values else sum(v for v in values if v is not None)

    @property
    def free_bytes(self) -> Optional[int]:
        """Swap-file bytes neither allocated nor orphaned (None while the store is in use)."""
        values = [s.free_bytes for s in self.spaces]
        return None if None in values else sum(v for v in values if v is not None)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "path": self.path,
            "in_use_by": self.in_use_by,
            "layout": {"nvme_paths": list(self.nvme_paths), "swap_files_per_dir": self.files_per_dir},
            "entries": [
                {
                    "key": e.key,
                    "dtype": e.dtype,
                    "shape": list(e.shape) if e.shape is not None else None,
                    "nbytes": e.nbytes,
                    "stored_nbytes": e.stored_nbytes,
                    "codec": e.codec,
                    "ratio": ratio(e),
                    "tiers": list(self.tiers),
                    "generation": e.generation,
                    "extents": len(e.extents),
                    "damaged": e.key in self.damaged,
                }
                for e in self.entries
            ],
            "summary": {
                "entries": len(self.entries),
                "logical_bytes": self.logical_bytes,
                "stored_bytes": self.stored_bytes,
                "ratio": self.ratio,
                "swap_files": [
                    {
                        "path": s.path,
                        "exists": s.exists,
                        "size": s.size,
                        "disk_bytes": s.disk_bytes,
                        "allocated_bytes": s.allocated_bytes,
                        "free_bytes": s.free_bytes,
                        "orphaned_bytes": s.orphaned_bytes,
                        "unavailable": s.unavailable,
                    }
                    for s in self.spaces
                ],
                "swap_bytes": sum(s.size for s in self.spaces),
                "disk_bytes": sum(s.disk_bytes for s in self.spaces),
                "allocated_bytes": self.allocated_bytes,
                "free_bytes": self.free_bytes,
                "orphaned_bytes": self.orphaned_bytes,
            },
        }


def ratio(record: Record) -> Optional[float]:
    """Logical bytes per stored byte of one entry (None for an empty entry)."""
    return record.nbytes / record.stored_nbytes if record.stored_nbytes else None


def inspect_store(directory: StoreDirectory) -> InspectReport:
    """The entries of ``directory`` sorted by key, and its space (orphans only when no store holds it)."""
    return InspectReport(
        path=directory.path,
        in_use_by=directory.in_use_by,
        nvme_paths=tuple(directory.nvme_paths),
        files_per_dir=directory.files_per_dir,
        entries=tuple(sorted((row.record for row in directory.rows), key=lambda r: r.key)),
        spaces=tuple(account_space(directory, find_orphans=directory.in_use_by is None)),
        damaged=tuple(row.record.key for row in directory.rows if not row.ok),
    )
