"""Counters the store keeps and the snapshot it reports."""

from __future__ import annotations

import dataclasses
from typing import Optional

from tiered.tier import TIERS_TOP_DOWN, Tier


@dataclasses.dataclass
class TierStats:
    """One tier's occupancy and traffic."""

    budget_bytes: Optional[int] = None
    used_bytes: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclasses.dataclass(frozen=True)
class NvmeSpace:
    """Where the nvme tier's bytes are (:meth:`TieredStore.nvme_space`).

    ``file_bytes``: swap-file capacity. ``allocated_bytes``: what the extent allocators have handed
    out. ``charged_bytes``: what the tier charges against its budget. ``entry_bytes``: extents of
    the current entries' nvme copies. With nothing in flight all three of the last are equal;
    anything more is leaked space.
    """

    file_bytes: int
    allocated_bytes: int
    charged_bytes: int
    entry_bytes: int


@dataclasses.dataclass(frozen=True)
class SwapExtent:
    """``length`` of an entry's stored bytes at ``offset`` of the swap file ``path``
    (:meth:`TieredStore.nvme_layout`)."""

    path: str
    offset: int
    length: int


@dataclasses.dataclass
class StoreStats:
    """A snapshot of :meth:`TieredStore.stats`. ``io_wait_seconds`` is time callers spent awaiting
    transfers; ``io_busy_seconds`` is time worker threads spent inside read/write syscalls,
    ``checksum_seconds`` computing the CRC-32s of blocks written and read, and ``staging_seconds``
    copying blocks into and out of staging buffers (with the CRC-32s of small tensors that share a
    block, computed as they are copied). The last three are summed over the I/O threads."""

    tiers: dict[Tier, TierStats] = dataclasses.field(default_factory=lambda: {t: TierStats() for t in TIERS_TOP_DOWN})
    entries: int = 0
    puts: int = 0
    gets: int = 0
    deletes: int = 0
    prefetches: int = 0
    prefetches_coalesced: int = 0
    transfers: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_requests: int = 0
    write_requests: int = 0
    syncs: int = 0
    manifest_commits: int = 0
    bytes_before_codec: int = 0
    bytes_after_codec: int = 0
    #: Puts that left compression to the config and were written raw because it would not pay.
    compress_skipped: int = 0
    #: The compression policy's recent estimates (bytes/s; None until measured): codec throughput
    #: in original bytes, nvme throughput in stored bytes, and the compressed/original ratio.
    codec_encode_bps: Optional[float] = None
    codec_decode_bps: Optional[float] = None
    codec_ratio: Optional[float] = None
    nvme_write_bps: Optional[float] = None
    nvme_read_bps: Optional[float] = None
    io_wait_seconds: float = 0.0
    io_busy_seconds: float = 0.0
    checksum_seconds: float = 0.0
    staging_seconds: float = 0.0
    #: The buffer pool of large get results and ``host_buffer``s (``StoreConfig.result_pool_bytes``):
    #: bytes lent out in tensors alive now, bytes freed and waiting for reuse, and how many takes
    #: reused a waiting buffer (hits) or mapped a new one (misses).
    pool_lent_bytes: int = 0
    pool_waiting_bytes: int = 0
    pool_hits: int = 0
    pool_misses: int = 0

    def as_dict(self) -> dict:
        """Plain JSON-ready dict (tiers keyed by name)."""
        out = dataclasses.asdict(self)
        out["tiers"] = {t.value: dataclasses.asdict(s) for t, s in self.tiers.items()}
        return out
