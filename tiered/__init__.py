"""tiered: an async key -> tensor store over device memory, host buffers and NVMe swap files."""

from tiered.codecs import measure_codec, round_trip_seconds
from tiered.config import StoreConfig
from tiered.errors import (
    CapacityError,
    ChecksumError,
    KeyNotFoundError,
    ManifestError,
    StoreClosedError,
    StoreForkedError,
    StoreLockedError,
    TieredError,
    TransferError,
)
from tiered.io.host_memory import empty_aligned
from tiered.policy import EvictionPolicy, FutureOrderPolicy, LRUPolicy
from tiered.stats import NvmeSpace, StoreStats, SwapExtent, TierStats
from tiered.store import Modification, Prefetch, SyncStore, TieredStore
from tiered.store.entry import EntryInfo
from tiered.tier import Tier

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
