"""Tools that work on a store directory without opening a store: ``tiered inspect`` and ``tiered fsck``.

They read the manifest with SQLite alone (never unpickling anything) and the swap files with plain
reads, so they also work on a store whose process crashed, and they take the same directory locks
a store takes (shared, or exclusive to repair), never following a link inside them.
"""

from tiered.offline.fsck import Damage, FsckReport, check_store, repair_store
from tiered.offline.inspection import InspectReport, inspect_store
from tiered.offline.storedir import StoreDirectory, SwapFileInfo

__all__ = [
    "Damage",
    "FsckReport",
    "InspectReport",
    "StoreDirectory",
    "SwapFileInfo",
    "check_store",
    "inspect_store",
    "repair_store",
]
