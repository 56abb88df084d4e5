"""The engine's counters, its materialized-bytes meter and the snapshot ``Engine.stats()`` returns."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from tiered import StoreStats, Tier


class MemoryMeter:
    """Bytes of parameter storage currently materialized by (or handed to) the engine, and the peak."""

    def __init__(self, start: int = 0) -> None:
        self.current = start
        self.peak = start

    def add(self, nbytes: int) -> None:
        """``nbytes`` of parameter storage were allocated."""
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current

    def sub(self, nbytes: int) -> None:
        """``nbytes`` of parameter storage were freed."""
        self.current -= nbytes
        assert self.current >= 0, self.current

    def reset_peak(self) -> int:
        """Start a new peak at the current value; return the old peak."""
        old, self.peak = self.peak, self.current
        return old


@dataclasses.dataclass
class EngineCounters:
    """Mutable counters, updated by the hooks (one thread at a time)."""

    steps: int = 0
    fetches: int = 0
    prefetch_issued: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    prefetch_wasted: int = 0
    on_demand_fetches: int = 0
    stall_seconds: float = 0.0
    rerecords: int = 0
    writebacks: int = 0


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of :meth:`engine.Engine.stats`.

    ``bytes_fetched`` maps each tier name to the bytes of parameter reads the store served from it
    since wrap. A *need* is the moment a parameter must be materialized (a module is about to run,
    backward unpacks it, code reads it): a prefetch hit is a need whose fetch had already been
    started ahead along the recorded order, a miss one that had to be fetched then.
    ``stall_seconds`` is time the hooks spent blocked waiting for parameter bytes.
    ``on_demand_fetches`` counts parameters found by the access mode: read outside every module
    that holds them. ``rerecords`` counts steps that departed from the recorded order.
    Materialized bytes are parameter storage currently allocated (held by running modules, by
    backward, or prefetched; see [Note: Memory bound] in engine.paging.pager);
    ``wrap_peak_materialized_bytes`` is the peak during :func:`engine.wrap`.

    With ``engine.AdamW`` (0 otherwise): ``optimizer_steps`` run by this engine, their total
    ``optimizer_seconds`` (commit included), ``optimizer_bytes_read``/``optimizer_bytes_written``
    (logical tensor bytes the steps moved through the store, before compression),
    ``optimizer_stall_seconds`` (time the steps waited on store I/O that the pipeline did not hide),
    ``optimizer_update_seconds`` (time in AdamW's math, inside backward too with
    ``EngineConfig.step_in_backward``),
    ``grad_bytes_offloaded`` (fp32 gradient shard bytes put to the store by backward). With
    ``EngineConfig.loss_scaling``: ``skipped_steps`` (steps dropped for an overflowing gradient, over
    the whole run, a resumed one included) and the current ``loss_scale`` (None without scaling).
    ``grad_norm``: the global gradient 2-norm of the last step (``eng.get_global_grad_norm()``).

    With ``EngineConfig.activation_tier`` (0 otherwise): ``activation_bytes_offloaded`` (bytes of
    saved storages put to the store), ``activation_bytes_read`` (read back for backward),
    ``activation_stall_seconds`` (forward waiting for the write window, backward for reads) and
    ``activation_peak_write_bytes`` (most bytes of saved tensors held for unfinished puts at once).
    """

    steps: int
    fetches: int
    prefetch_issued: int
    prefetch_hits: int
    prefetch_misses: int
    prefetch_wasted: int
    on_demand_fetches: int
    stall_seconds: float
    rerecords: int
    writebacks: int
    bytes_fetched: Mapping[str, int]
    materialized_bytes: int
    peak_materialized_bytes: int
    wrap_peak_materialized_bytes: int
    store: StoreStats
    optimizer_steps: int = 0
    optimizer_seconds: float = 0.0
    optimizer_bytes_read: int = 0
    optimizer_bytes_written: int = 0
    optimizer_stall_seconds: float = 0.0
    optimizer_update_seconds: float = 0.0
    grad_bytes_offloaded: int = 0
    activation_bytes_offloaded: int = 0
    activation_bytes_read: int = 0
    activation_stall_seconds: float = 0.0
    activation_peak_write_bytes: int = 0
    skipped_steps: int = 0
    loss_scale: Optional[float] = None
    grad_norm: Optional[float] = None

    @property
    def prefetch_hit_rate(self) -> float:
        """Hits over needs (hits + misses); 0.0 before any need."""
        needs = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / needs if needs else 0.0

    def as_dict(self) -> dict:
        """Plain JSON-ready dict (the store's snapshot included, and the hit rate)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "store"}
        out["bytes_fetched"] = dict(self.bytes_fetched)
        out["prefetch_hit_rate"] = self.prefetch_hit_rate
        out["store"] = self.store.as_dict()
        return out


def bytes_out_by_tier(stats: StoreStats) -> dict[str, int]:
    """Bytes read by gets served from each tier, by tier name."""
    return {tier.value: stats.tiers[tier].bytes_out for tier in Tier}
