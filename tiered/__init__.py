"""tiered: an async key -> tensor store over device memory, host buffers and NVMe swap files.

Each public name is imported from its module on first use, so ``import tiered.cli`` (the ``tiered``
command's ``--help``) and ``import tiered.config`` load no torch.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

#: Where each public name lives.
_HOMES = {
    "CapacityError": "tiered.errors",
    "ChecksumError": "tiered.errors",
    "EntryInfo": "tiered.store.entry",
    "EvictionPolicy": "tiered.policy",
    "FutureOrderPolicy": "tiered.policy",
    "KeyNotFoundError": "tiered.errors",
    "LRUPolicy": "tiered.policy",
    "ManifestError": "tiered.errors",
    "Modification": "tiered.store",
    "NvmeSpace": "tiered.stats",
    "Prefetch": "tiered.store",
    "StoreClosedError": "tiered.errors",
    "StoreConfig": "tiered.config",
    "StoreForkedError": "tiered.errors",
    "StoreLockedError": "tiered.errors",
    "StoreStats": "tiered.stats",
    "SwapExtent": "tiered.stats",
    "SyncStore": "tiered.store",
    "Tier": "tiered.tier",
    "TierStats": "tiered.stats",
    "TieredError": "tiered.errors",
    "TieredStore": "tiered.store",
    "TransferError": "tiered.errors",
    "empty_aligned": "tiered.io.host_memory",
    "measure_codec": "tiered.codecs",
    "round_trip_seconds": "tiered.codecs",
}

__all__ = [
    "CapacityError",
    "ChecksumError",
    "EntryInfo",
    "EvictionPolicy",
    "FutureOrderPolicy",
    "KeyNotFoundError",
    "LRUPolicy",
    "ManifestError",
    "Modification",
    "NvmeSpace",
    "Prefetch",
    "StoreClosedError",
    "StoreConfig",
    "StoreForkedError",
    "StoreLockedError",
    "StoreStats",
    "SwapExtent",
    "SyncStore",
    "Tier",
    "TierStats",
    "TieredError",
    "TieredStore",
    "TransferError",
    "empty_aligned",
    "measure_codec",
    "round_trip_seconds",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module when first asked for."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tiered' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
