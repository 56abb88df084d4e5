"""tiered: an async key -> tensor store over device memory, host buffers and NVMe swap files.

The public names below are imported on first use of any of them, so ``import tiered.cli`` (the
``tiered`` command's ``--help``) and ``import tiered.config`` load no torch.
"""

from typing import Any

__version__ = "0.1.0"

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
    """A public name, importing them all the first time one is asked for."""
    if name not in __all__:
        raise AttributeError(f"module 'tiered' has no attribute {name!r}")
    globals().update(_public_names())
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _public_names() -> dict[str, Any]:
    from tiered.codecs import measure_codec, round_trip_seconds
    from tiered.config import StoreConfig
    from tiered.entry import EntryInfo
    from tiered.errors import (
        CapacityError,
        ChecksumError,
        KeyNotFoundError,
        ManifestError,
        StoreClosedError,
        StoreLockedError,
        TieredError,
        TransferError,
    )
    from tiered.io.host_memory import empty_aligned
    from tiered.policy import EvictionPolicy, FutureOrderPolicy, LRUPolicy
    from tiered.stats import NvmeSpace, StoreStats, SwapExtent, TierStats
    from tiered.store import Modification, Prefetch, SyncStore, TieredStore
    from tiered.tier import Tier

    return {name: value for name, value in locals().items() if name in __all__}
