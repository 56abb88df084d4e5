"""MemoryPlan: one host memory budget, ``StoreConfig.host_bytes``, divided among everything the engine
and its store hold, computed once from the config and the model's shapes.

``wrap`` computes it before anything is written (and refuses a budget below the model's minimum,
naming what takes it), opens the store with the sizes it chose and builds the engine's pieces with
them; ``engine.estimate_memory`` and ``tiered estimate`` report the same plan.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import nn

from engine.config import EngineConfig
from engine.config.engine_config import updates_in_backward_ruled_out
from engine.errors import MemoryBudgetError
from tiered import StoreConfig
from tiered.util import format_bytes, round_up

MiB = 1024 * 1024
#: Optimizer groups shrink to this before the prefetch window does, then to the least.
SMALL_GROUP_BYTES = 16 * MiB
MIN_GROUP_BYTES = 1 * MiB
#: The activation window the plan shrinks to (``activation_window_bytes``).
MIN_ACTIVATION_WINDOW = 4 * MiB
#: The staging the plan keeps at least (blocks).
MIN_STAGING_BUFFERS = 2
#: fp32 bytes of each tensor torch's AdamW is given per call in the optimizer step (engine/optim/step.py,
#: [Note: Chunked AdamW math]): its temporaries are at most two such chunks, below the allocator's mmap
#: threshold (engine/paging/allocator.py) so that they reuse heap memory instead of faulting in new pages.
MATH_CHUNK_BYTES = 512 * 1024
#: Staging gets at most this share of the budget (the engine's bulk transfers use aligned memory
#: that needs none: the host tier, the buffer pool; small tensors and unaligned caller memory do).
STAGING_SHARE = 32

# [Note: One memory budget]
# With ``EngineConfig.host_budget="total"`` (the default) ``StoreConfig.host_bytes`` is the budget of
# every byte of host memory the engine and its store hold, above the process's size before wrap:
#
#   host_bytes = staging + codec cache and payloads + device tier (when it is host memory)
#                + working set + host tier (the cache: what is left)
#
# The working set has two phases that never overlap. Forward and backward hold the parameters
# materialized (the largest module + the prefetch window), the optimizer state read ahead during
# backward, the gradients in flight (the put window, the whole gradient autograd made and its fp32
# shard when that is a copy) and the activation window when activations go to the store. The step
# holds its groups in flight (read i+1, update i, write i-1: three consecutive groups of gradient,
# master and two moments, plus the new training-dtype shard) and AdamW's temporaries (two chunks:
# engine/optim/step.py, [Note: Chunked AdamW math]). A step whose updates run inside backward holds its
# updates' working set in backward instead, and nothing in the step ([Note: Updates inside backward, in
# memory]); where steps may run either way (``step_in_backward=None``), each phase is the larger of
# the two.
# Parameters and the step's groups are buffers of the store's pool (``StoreConfig.result_pool_bytes``:
# [Note: Result pool bound] in tiered/io/results.py); gradients and temporaries are torch's
# allocations, which wrap has glibc give back when freed (engine/paging/allocator.py,
# [Note: Heap retention]). Two ways to bound them:
#
# - shared: the pool is the larger of the phases' buffers and the transients the larger of their
#   allocations; a phase's freed buffers wait in the pool for the other (in fp32 training a
#   parameter's buffer is exactly its state's size), so no step maps memory anew;
# - by phase (when the budget is too small for that): the working set is the larger of the two
#   phases whole, and the engine moves the pool's bound between them (``resize_result_pool`` when a
#   step starts and ends), so the step's freed buffers are unmapped before backward's gradients come.
#   The price is mapping the step's buffers anew every step.
#
# The host tier gets what is left and must hold the largest entry the config sends there (a parameter
# shard with ``param_tier="host"``, optimizer state with ``optimizer_tier="host"``; a gradient shard
# larger than the host tier goes to nvme instead). The pieces take the config's sizes when they fit;
# otherwise they shrink, sharing first and then by phase, in this order until they do: the state
# read ahead during backward (``optimizer_prefetch_groups`` to 0), staging (to 2 blocks), the
# optimizer group (``optimizer_group_bytes``, halved down to 16 MiB), the prefetch window
# (``prefetch_bytes``, halved down to 0), the activation window (``activation_window_bytes``, down to
# 4 MiB), the optimizer group again (down to 1 MiB: three groups are then the three largest
# consecutive shards), the codec's idle cache; then each piece shrunk on the way gets back as much of
# its size as still fits, the prefetch window first. The minimum is the budget with every piece at
# its floor, by phase; below it ``wrap`` raises MemoryBudgetError naming the minimum and what takes
# it. What the budget does not cover is torch's and Python's own: the autograd graph, the batch's
# activations (unless ``activation_tier`` moves them), allocator slack, thread stacks.
#
# With CUDA the host tier and staging are page-locked (pinned) and counted here like the rest, and
# the engine allocates no other pinned memory; parameters and gradients are then GPU memory, so
# forward and backward hold no host memory of theirs, while the step's groups are still host memory.
#
# ``host_budget="host_tier"`` keeps the older meaning: host_bytes is the host tier alone and the
# pieces come on top at their configured sizes, shared (the plan then only reports them).


@dataclasses.dataclass(frozen=True)
class MemoryPiece:
    """One use of host memory in a plan: what it is, its bytes, and what sets its size."""

    what: str
    nbytes: int
    why: str

    def describe(self) -> str:
        """``what`` with its bytes and reason, for messages and tables."""
        return f"{self.what} {format_bytes(self.nbytes)} ({self.why})"


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """The sizes a plan chose (what it passes to the store and the engine)."""

    staging_buffers: int
    prefetch_bytes: int
    optimizer_group_bytes: int
    optimizer_prefetch_groups: int
    codec_cache_bytes: int
    activation_window_bytes: int
    #: Bound the working set phase by phase ([Note: One memory budget]) rather than shared.
    by_phase: bool = False


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How one rank's host budget is divided. Built by :func:`plan_memory`.

    ``pieces`` are the uses besides the host tier at the chosen sizes; ``minimum_pieces`` the same at
    their floors, whose sum with ``host_tier_minimum`` is ``minimum_bytes``.
    """

    #: "total" or "host_tier" (``EngineConfig.host_budget``).
    mode: str
    #: ``StoreConfig.host_bytes`` as the user gave it.
    budget: int
    settings: PlanSettings
    pieces: tuple[MemoryPiece, ...]
    #: The store's buffer pool bound in forward and backward (``result_pool_bytes`` at open), and in
    #: the optimizer step (the same unless ``settings.by_phase``).
    pool_bytes: int
    step_pool_bytes: int
    #: The host tier (the store's ``host_bytes``): in "total" mode what the pieces leave.
    host_tier_bytes: int
    #: The least the host tier must hold (its largest entry), and why.
    host_tier_minimum: MemoryPiece
    #: The least ``host_bytes`` this model needs under this config ("total" mode), and its parts.
    minimum_bytes: int
    minimum_pieces: tuple[MemoryPiece, ...]
    #: With ``step_in_backward``: the most the updates' worker may hold in buffers (moments and
    #: parameters read ahead, being updated and being written), as counted in the working set; else 0.
    updates_buffer_bytes: int = 0
    #: By phase, where steps may run either way: the pool's bound in forward and backward of a step that
    #: runs after backward (``pool_bytes`` is then the bound of one whose updates run inside it); None
    #: when one bound serves both.
    after_backward_pool_bytes: Optional[int] = None

    @property
    def fits(self) -> bool:
        """Whether the budget covers the minimum (always True in "host_tier" mode)."""
        return self.mode == "host_tier" or self.budget >= self.minimum_bytes

    @property
    def total_bytes(self) -> int:
        """Every piece and the host tier: what the plan lets the engine and store hold at most."""
        return sum(p.nbytes for p in self.pieces) + self.host_tier_bytes

    def problem(self) -> Optional[str]:
        """Why the budget does not fit (None when it does): the minimum and what takes it."""
        if self.fits:
            return None
        parts = sorted((*self.minimum_pieces, self.host_tier_minimum), key=lambda p: -p.nbytes)
        return (f"StoreConfig.host_bytes={self.budget} ({format_bytes(self.budget)}) is below the minimum this model "
                f"needs under this config, {self.minimum_bytes} ({format_bytes(self.minimum_bytes)}): "
                + "; ".join(p.describe() for p in parts if p.nbytes)
                + f". Raise host_bytes to at least {self.minimum_bytes} (docs/tuning.md, '1. Budgets')")

    def check(self) -> None:
        """Raise :class:`engine.MemoryBudgetError` (a ValueError) when the budget does not fit."""
        problem = self.problem()
        if problem is not None:
            raise MemoryBudgetError(problem)

    def store_config(self, store: StoreConfig) -> StoreConfig:
        """``store`` with the sizes of this plan: the host tier, staging, buffer pool and codec cache."""
        return store.replace(host_bytes=self.host_tier_bytes, staging_buffers=self.settings.staging_buffers,
                             result_pool_bytes=self.pool_bytes, codec_cache_bytes=self.settings.codec_cache_bytes)

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        """``config`` with the engine's sizes of this plan (its ``store`` is left as given)."""
        s = self.settings
        return config.replace(prefetch_bytes=s.prefetch_bytes, optimizer_group_bytes=s.optimizer_group_bytes,
                              optimizer_prefetch_groups=s.optimizer_prefetch_groups,
                              activation_window_bytes=s.activation_window_bytes)


@dataclasses.dataclass
class _Facts:
    """What a plan needs from the model: sizes in bytes, per rank."""

    largest_module: int = 0
    largest_module_name: str = ""
    largest_param: int = 0  # whole, in the training dtype (a full gradient has its size)
    shards: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # trainable fp32 shard bytes, in order
    whole_grads: list[int] = dataclasses.field(default_factory=list)  # their whole gradients' bytes, in that order
    extra_itemsize: int = 0  # bytes per element of a new training-dtype shard when that is not fp32
    grad_shard_copies: bool = False  # the fp32 gradient shard is a new tensor, not a view of the gradient
    host_entry: int = 0  # the largest entry the config sends to the host tier
    host_total: int = 0  # every entry the config sends there
    host_entry_why: str = "nothing is sent to the host tier"


@dataclasses.dataclass(frozen=True)
class _Needs:
    """Bytes of each use at some settings: the fixed pieces, and each phase's buffers (the store's
    pool) and allocations (torch's)."""

    fixed: tuple[MemoryPiece, ...]
    forward_buffers: int
    forward_buffers_why: str
    forward_allocations: int
    forward_allocations_why: str
    step_buffers: int
    step_buffers_why: str
    step_allocations: int
    host_min: MemoryPiece
    #: The step updates state in place (no copies of it in the working set).
    lent: bool
    #: Steps may run either way ([Note: Updates inside backward, in memory]): forward and backward's
    #: buffers and allocations above are each the larger way's, and these are each way's own (buffers,
    #: allocations), after backward and inside it. None: one way only.
    after_forward: Optional[tuple[int, int]] = None
    inside_forward: Optional[tuple[int, int]] = None


def plan_memory(model: nn.Module, config: EngineConfig, *, world_size: int = 1, training: bool = True,
                compute_device: Optional[torch.device] = None) -> MemoryPlan:
    """Divide ``config.store.host_bytes`` among the pieces for ``model`` ([Note: One memory budget]).

    Reads parameter shapes and dtypes only (a model on the meta device works). ``training``: with
    ``engine.AdamW``; ``compute_device``: where parameters are materialized (None: the config's,
    else the CPU). The plan never raises for a small budget: :meth:`MemoryPlan.check` does.
    """
    facts = _facts(model, config, world_size, training)
    device = compute_device if compute_device is not None else torch.device(config.compute_device or "cpu")
    store = config.store
    settings = PlanSettings(
        staging_buffers=min(store.staging_buffers, store.queue_depth),
        prefetch_bytes=config.prefetch_bytes,
        optimizer_group_bytes=config.optimizer_group_bytes,
        optimizer_prefetch_groups=0 if config.updates_in_place else config.optimizer_prefetch_groups,
        codec_cache_bytes=store.codec_cache_bytes,
        activation_window_bytes=config.activation_window_bytes,
    )
    budget = store.host_bytes
    if config.host_budget == "host_tier":  # the pieces come on top, shared; parameters' buffers join the pool
        pieces, pool, _, host_min = _plan_at(config, facts, settings, device, training)
        waiting = store.result_pool_bytes
        pieces += (MemoryPiece("results waiting", waiting, "result_pool_bytes: freed get results kept for reuse"),)
        floor, _, _, floor_host = _plan_at(config, facts, _shrinking(settings)[-1], device, training)
        pool = waiting + _params_bytes(facts, settings, device)
        return MemoryPlan("host_tier", budget, settings, pieces, pool, pool, budget, host_min,
                          sum(p.nbytes for p in floor) + floor_host.nbytes, floor,
                          _updates_buffer_bytes(config, facts, settings, device))
    cap = max(MIN_STAGING_BUFFERS, budget // STAGING_SHARE // store.block_size)
    settings = dataclasses.replace(settings, staging_buffers=min(settings.staging_buffers, cap))
    candidates = _shrinking(settings)

    def fits(candidate: PlanSettings) -> bool:
        pieces, _, _, host_min = _plan_at(config, facts, candidate, device, training, budget)
        return sum(p.nbytes for p in pieces) + host_min.nbytes <= budget

    chosen = next((c for c in candidates if fits(c)), None)
    if chosen is not None:
        settings = _regrown(chosen, settings, fits)
    else:
        settings = candidates[-1]
    pieces, pool, step_pool, _ = _plan_at(config, facts, settings, device, training, budget)
    floor, _, _, floor_host = _plan_at(config, facts, candidates[-1], device, training, budget)
    host_tier = max(budget - sum(p.nbytes for p in pieces), 0)
    return MemoryPlan("total", budget, settings, pieces, pool, step_pool, host_tier, floor_host,
                      sum(p.nbytes for p in floor) + floor_host.nbytes, floor,
                      _updates_buffer_bytes(config, facts, settings, device),
                      _after_backward_pool(config, facts, settings, device, training))


def _halved(s: PlanSettings, field: str, floor: int, zero_at: int) -> list[PlanSettings]:
    """``s`` with ``field`` halved again and again down to ``floor`` (straight to it from ``zero_at`` or
    less), each step a setting."""
    out = []
    while getattr(s, field) > floor:
        value = getattr(s, field)
        s = dataclasses.replace(s, **{field: floor if value <= zero_at else max(floor, value // 2)})
        out.append(s)
    return out


def _regrown(chosen: PlanSettings, wanted: PlanSettings, fits: "Callable[[PlanSettings], bool]") -> PlanSettings:
    """``chosen`` (the first of the shrinking settings that fits) with each piece shrunk on the way
    given back as much of its configured size as still fits, the prefetch window first: shrinking
    in a fixed order can cut one piece further than the budget needs (a small model's three
    groups are all of it until groups get very small)."""
    for field in ("prefetch_bytes", "optimizer_prefetch_groups", "activation_window_bytes", "optimizer_group_bytes",
                  "staging_buffers", "codec_cache_bytes"):
        now, want = getattr(chosen, field), getattr(wanted, field)
        while want > now:
            candidate = dataclasses.replace(chosen, **{field: want})
            if fits(candidate):
                chosen = candidate
                break
            want = want // 2 if want // 2 > now else now
    return chosen


def _shrinking(settings: PlanSettings) -> list[PlanSettings]:
    """The settings to try, from the config's own down to every piece at its floor: shared first,
    then by phase ([Note: One memory budget])."""
    out = [dataclasses.replace(settings, optimizer_prefetch_groups=0)]
    for field, floor, zero_at in (("staging_buffers", MIN_STAGING_BUFFERS, 0),
                                  ("optimizer_group_bytes", SMALL_GROUP_BYTES, 0), ("prefetch_bytes", 0, MiB),
                                  ("activation_window_bytes", MIN_ACTIVATION_WINDOW, 0),
                                  ("optimizer_group_bytes", MIN_GROUP_BYTES, 0)):
        out += _halved(out[-1], field, floor, zero_at)
    s = out[-1]
    out.insert(0, settings)
    out.append(dataclasses.replace(s, codec_cache_bytes=0))
    return out + [dataclasses.replace(x, by_phase=True) for x in out]


def _plan_at(config: EngineConfig, facts: _Facts, s: PlanSettings, device: torch.device, training: bool,
             budget: Optional[int] = None) -> tuple[tuple[MemoryPiece, ...], int, int, MemoryPiece]:
    """The pieces at settings ``s`` (the host tier aside), the pool's bounds in forward/backward and in
    the step, and the least the host tier must hold. ``budget``: host_bytes as a total (None: it is
    the host tier alone)."""
    n = _needs_either_way(config, facts, s, device, training, lent=config.updates_in_place)
    if n.lent:  # state updated in place is the host tier's memory only while all of it fits there
        host_tier = config.store.host_bytes
        if budget is not None:
            host_tier = budget - sum(p.nbytes for p in _assemble(n, s)[0])
        if facts.host_total > host_tier:
            n = _needs_either_way(config, facts, s, device, training, lent=False)
    return _assemble(n, s)


def _needs_either_way(config: EngineConfig, facts: _Facts, s: PlanSettings, device: torch.device, training: bool, *,
                      lent: bool) -> "_Needs":
    """:func:`_needs` of the ways the config's steps may run: after backward, inside it, or either (each
    phase then takes the larger)."""
    inside_possible = config.step_in_backward is not False and updates_in_backward_ruled_out(config) is None
    if not inside_possible:
        return _needs(config, facts, s, device, training, lent=lent, inside=False)
    inside = _needs(config, facts, s, device, training, lent=lent, inside=True)
    if config.step_in_backward is True:
        return inside
    after = _needs(config, facts, s, device, training, lent=lent, inside=False)
    forward = max((after, inside), key=lambda n: n.forward_buffers + n.forward_allocations)
    return dataclasses.replace(
        after, forward_buffers=max(after.forward_buffers, inside.forward_buffers),
        forward_buffers_why=forward.forward_buffers_why + " (the larger way: after backward, or inside it)",
        forward_allocations=max(after.forward_allocations, inside.forward_allocations),
        forward_allocations_why=forward.forward_allocations_why,
        after_forward=(after.forward_buffers, after.forward_allocations),
        inside_forward=(inside.forward_buffers, inside.forward_allocations),
    )


def _after_backward_pool(config: EngineConfig, facts: _Facts, s: PlanSettings, device: torch.device,
                         training: bool) -> Optional[int]:
    """:attr:`MemoryPlan.after_backward_pool_bytes` at settings ``s``."""
    if not s.by_phase:
        return None
    n = _needs_either_way(config, facts, s, device, training, lent=config.updates_in_place)
    return n.after_forward[0] if n.after_forward is not None else None


def _assemble(n: "_Needs", s: PlanSettings) -> tuple[tuple[MemoryPiece, ...], int, int, MemoryPiece]:
    """The pieces of ``n``: shared, or by phase ([Note: One memory budget])."""
    temps = f"AdamW's temporaries {format_bytes(n.step_allocations)}"
    forward_why = n.forward_buffers_why + (f"; {n.forward_allocations_why}" if n.forward_allocations else "")
    if not n.step_buffers:  # no optimizer step: forward and backward are all there is
        work = MemoryPiece("working set", n.forward_buffers + n.forward_allocations, forward_why)
        return (*n.fixed, work), n.forward_buffers, n.forward_buffers, n.host_min
    if s.by_phase:
        forward = n.forward_buffers + n.forward_allocations
        if n.after_forward is not None and n.inside_forward is not None:
            # One way per step, the pool bound set to that way's at its start (after_backward_pool_bytes)
            after, inside = sum(n.after_forward), sum(n.inside_forward)
            forward = max(after, inside)
            forward_why = (f"the larger way: after backward {format_bytes(after)}, inside it {format_bytes(inside)}; "
                           + forward_why)
        step = n.step_buffers + n.step_allocations
        work = MemoryPiece("working set", max(forward, step),
                           f"by phase: the larger of forward/backward {format_bytes(forward)} ({forward_why}) and "
                           f"the optimizer step {format_bytes(step)} ({n.step_buffers_why}; {temps})")
        return (*n.fixed, work), n.forward_buffers, n.step_buffers, n.host_min
    pool = max(n.forward_buffers, n.step_buffers)
    pieces = [*n.fixed, MemoryPiece("buffer pool", pool, f"the larger of forward/backward's "
                                    f"{format_bytes(n.forward_buffers)} ({n.forward_buffers_why}) and the optimizer "
                                    f"step's {format_bytes(n.step_buffers)} ({n.step_buffers_why})")]
    transients = max(n.forward_allocations, n.step_allocations)
    if transients:
        pieces.append(MemoryPiece("transients", transients, f"the larger of backward's "
                                  f"{format_bytes(n.forward_allocations)} ({n.forward_allocations_why}) and the "
                                  f"step's {temps}"))
    return tuple(pieces), pool, pool, n.host_min


def _params_bytes(facts: _Facts, s: PlanSettings, device: torch.device) -> int:
    """Parameter bytes materialized in host memory at most: the largest module and the prefetch window."""
    return facts.largest_module + s.prefetch_bytes if device.type == "cpu" else 0


def _needs(config: EngineConfig, facts: _Facts, s: PlanSettings, device: torch.device, training: bool, *,
           lent: bool, inside: bool) -> _Needs:
    """What each use takes at settings ``s`` when the steps run after backward, or (``inside``) their
    updates inside it."""
    store = config.store
    on_cpu = device.type == "cpu"
    fixed = [MemoryPiece("staging", store.block_size * s.staging_buffers,
                         f"{s.staging_buffers} blocks of block_size {format_bytes(store.block_size)}")]
    store_device = torch.device(store.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if store_device.type == "cpu" and store.device_bytes:
        fixed.append(MemoryPiece("device tier", store.device_bytes, "device_bytes: host memory without a GPU"))
    params = _params_bytes(facts, s, device)
    buffers_why = [f"parameters: the largest module {facts.largest_module_name!r} "
                   f"{format_bytes(facts.largest_module)} + prefetch_bytes {format_bytes(s.prefetch_bytes)}"
                   if params else f"parameters on {device}"]
    allocations_why = []
    host_min = MemoryPiece("host tier", facts.host_entry, facts.host_entry_why)
    step = ahead = grads = temps = accumulate = 0
    step_why = "no optimizer step"
    groups = _group_bytes([b for _, b in facts.shards], s.optimizer_group_bytes) if training else []
    if groups:
        largest_name, largest = max(facts.shards, key=lambda nb: nb[1])
        window, at = _largest_window(groups, 3)
        # Per fp32 element of a group in flight: gradient, master and two moments (in place: the
        # gradient's unscaled copy; the state is the host tier's), and the new training-dtype shard.
        per_elem = (4 if lent else 16) + facts.extra_itemsize
        step = window * per_elem // 4
        step_why = (f"three groups in flight, {format_bytes(window)} of fp32 shards from group {at} on, {per_elem} "
                    f"bytes per element (the largest shard, {largest_name!r} {format_bytes(largest)}, is a group of "
                    "its own)")
        if config.updates_in_place:  # modify blocks hold the groups' state in the host tier
            held = window * 12 // 4
            if held > host_min.nbytes:
                host_min = MemoryPiece("host tier", held, "optimizer state of three groups in flight, updated in "
                                                          "place (optimizer_tier='host')")
        ahead = 12 * sum(groups[: s.optimizer_prefetch_groups]) // 4
        if ahead:
            buffers_why.append(f"state read ahead {format_bytes(ahead)}")
        # AdamW's temporaries: at most two chunks (one per tensor on the foreach path) of the shards.
        temps = min(2 * MATH_CHUNK_BYTES, max(2 * largest, max(groups)))
        if on_cpu:
            # The put window (at least one shard) and the whole gradient autograd is making, with its
            # fp32 shard when that is a copy; accumulation reads a stored shard back to add to.
            grads = min(max(s.optimizer_group_bytes, largest), sum(groups)) + facts.largest_param
            grads += largest if facts.grad_shard_copies else 0
            allocations_why.append(f"gradients in flight {format_bytes(grads)}")
            if config.gradient_accumulation_steps > 1:
                accumulate = largest
                buffers_why.append(f"a gradient read back to accumulate into {format_bytes(accumulate)}")
        if inside:
            worker, grads = _updates_inside_backward(facts, s, on_cpu)
            # fp32 masters backward reads in place of 16-bit parameters wait on their handles for the
            # update ([Note: Masters read in backward] in engine/paging/pager.py): twice their bytes.
            masters = 2 * params if facts.extra_itemsize == 2 else 0
            buffers_why[1:] = [f"the updates' moments and parameters {format_bytes(worker)} (read ahead, being "
                               "updated and being written)",
                               *([f"masters read by backward {format_bytes(masters)}"] if masters else []),
                               *([f"a gradient read back to accumulate into {format_bytes(accumulate)}"]
                                 if accumulate else [])]
            ahead = worker + masters
            grads += temps
            allocations_why[:] = [f"gradients waiting for their update or being made, and AdamW's temporaries "
                                  f"{format_bytes(grads)}"]
            step = temps = 0
            step_why = "no optimizer step: the updates run inside backward"
    activations = 2 * s.activation_window_bytes if config.activation_tier is not None else 0
    if activations:
        allocations_why.append(f"the activation window {format_bytes(activations)}")
    if (config.compress_optimizer and config.optimizer_tier == "nvme") or store.compress:
        coded = 2 * 12 * max(groups, default=0) // 4  # a group's state encoded for writing, one read compressed
        fixed.append(MemoryPiece("codec", s.codec_cache_bytes + coded,
                                 f"codec_cache_bytes {format_bytes(s.codec_cache_bytes)} + payloads in flight"))
    return _Needs(tuple(fixed), params + ahead + accumulate, " + ".join(buffers_why), grads + activations,
                  " + ".join(allocations_why), step, step_why, temps, host_min, lent)


# [Note: Updates inside backward, in memory]
# engine/optim/backward_step.py holds these bounds. With batches of at most G =
# ``optimizer_group_bytes`` of fp32 shards, the worker holds, as buffers: the reads ahead (a window of
# W = 2G x ``optimizer_prefetch_groups``, or one shard's moments and parameter beyond it, read into an
# empty window), the batch being updated and the one being written (parameter and two moments each)
# and the parameter copies of the gradients queued for it (G); as allocations: those gradients (G)
# and the one autograd is making. A shard larger than G is a batch of its own, counted alone (the
# worker pairs it only within the bound this count sets): while it is updated or written the worker
# holds its parameter, moments and gradient, the window beside it and what its neighbours queue;
# read ahead, it sits beside the small batches in flight.
# The gradients autograd makes while a large shard is in flight are its neighbours' (backward runs
# the parameters' order backwards; neighbours are taken on both sides, within 2G), so a model's
# embedding and head, at the two ends, are never counted together. Buffers and allocations are each
# the most of any phase: the pool keeps freed buffers up to its bound, so one phase's buffers may sit
# beside another phase's allocations. The most of the buffers is the worker's bound
# (``MemoryPlan.updates_buffer_bytes``); where it holds less, it uses the room to pair large batches:
# [Note: Using the room the plan leaves] in engine/optim/backward_step.py.


def _updates_inside_backward(facts: _Facts, s: PlanSettings, on_cpu: bool) -> tuple[int, int]:
    """Host bytes of the updates inside backward beside the parameters: the store's buffers (moments
    and parameter copies) and torch's allocations (gradients), each at its most.

    See [Note: Updates inside backward, in memory]."""
    shards = [b for _, b in facts.shards]
    group = s.optimizer_group_bytes
    window = 2 * group * max(1, s.optimizer_prefetch_groups)
    making = facts.largest_param if on_cpu else 0
    buffers = max(window, 3 * group) + 6 * group
    allocations = group + making
    for i, nbytes in enumerate(shards):
        if nbytes <= group:
            continue
        near = _neighbours(shards, i, 2 * group)
        read_beside = max(window, 3 * max((shards[j] for j in near), default=0))
        buffers = max(buffers, 3 * nbytes + max(read_beside + group, 6 * group))
        made = max((facts.whole_grads[j] for j in near), default=0) if on_cpu else 0
        allocations = max(allocations, nbytes + made)
    # Never more than the whole model's: its moments and new values, and a master copy per shard.
    total = sum(shards)
    return min(buffers, 4 * total), min(allocations, total + making)


def _updates_buffer_bytes(config: EngineConfig, facts: _Facts, s: PlanSettings, device: torch.device) -> int:
    """:attr:`MemoryPlan.updates_buffer_bytes` at settings ``s``."""
    if config.step_in_backward is False or updates_in_backward_ruled_out(config) is not None:
        return 0
    return _updates_inside_backward(facts, s, device.type == "cpu")[0]


def _neighbours(sizes: list[int], at: int, reach: int) -> list[int]:
    """Indices of the entries on each side of ``at``: on each side, those within ``reach`` bytes and
    the first one past it."""
    out = []
    for step in (-1, 1):
        total, j = 0, at + step
        while 0 <= j < len(sizes) and total <= reach:
            out.append(j)
            total += sizes[j]
            j += step
    return out


def _group_bytes(shards: list[int], group_bytes: int) -> list[int]:
    """fp32 bytes of each group of the step, grouped as engine/optim/step_io.plan_groups groups them."""
    groups: list[int] = []
    size = 0
    for nbytes in shards:
        if size and size + nbytes > group_bytes:
            groups.append(size)
            size = 0
        size += nbytes
    if size:
        groups.append(size)
    return groups


def _largest_window(groups: list[int], width: int) -> tuple[int, int]:
    """The largest sum of ``width`` consecutive groups, and where it starts."""
    best, at = 0, 0
    for i in range(max(1, len(groups) - width + 1)):
        total = sum(groups[i: i + width])
        if total > best:
            best, at = total, i
    return best, at


def _facts(model: nn.Module, config: EngineConfig, world_size: int, training: bool) -> _Facts:
    train_dtype = getattr(torch, config.train_dtype) if config.train_dtype is not None else None
    facts = _Facts()

    def dtype_of(p: torch.Tensor) -> torch.dtype:
        return train_dtype if train_dtype is not None and p.is_floating_point() else p.dtype

    for name, module in model.named_modules():
        nbytes = sum(p.numel() * dtype_of(p).itemsize for p in module.parameters(recurse=False))
        if nbytes > facts.largest_module:
            facts.largest_module, facts.largest_module_name = nbytes, name
    host_parts = []
    for name, p in model.named_parameters():  # tied parameters once, in the order the step takes them
        dtype = dtype_of(p)
        whole = p.numel() * dtype.itemsize
        facts.largest_param = max(facts.largest_param, whole)
        shard_numel = -(-p.numel() // world_size)
        if config.param_tier == "host":
            host_parts.append((round_up(max(shard_numel * dtype.itemsize, 1)), f"parameter shard {name!r} "
                                                                              "(param_tier='host')"))
        if training and p.requires_grad:
            facts.shards.append((name, shard_numel * 4))
            facts.whole_grads.append(whole)
            if dtype.itemsize != 4:
                facts.extra_itemsize = max(facts.extra_itemsize, dtype.itemsize)
            facts.grad_shard_copies |= world_size > 1 or dtype != torch.float32
            fp32 = round_up(max(shard_numel * 4, 1))
            if config.grad_tier == "host" and config.stores_gradients:
                # counted in what the tier holds, but no minimum: a gradient shard larger than the whole
                # host tier goes to nvme instead (engine/optim/grad_offload.py)
                facts.host_total += fp32
            if config.optimizer_tier == "host":
                host_parts.append((fp32, f"optimizer state of {name!r} (optimizer_tier='host')"))
                facts.host_total += 2 * fp32  # the two moments beside the master
    if host_parts:
        facts.host_total += sum(n for n, _ in host_parts)
        facts.host_entry, facts.host_entry_why = max(host_parts, key=lambda nw: nw[0])
        facts.host_entry_why = "the largest entry it must take: " + facts.host_entry_why
    return facts
