"""How much device memory, host memory and disk one rank needs for a model under an EngineConfig.

The counterpart of DeepSpeed's ``estimate_zero3_model_states_mem_needs_all_live`` and accelerate's
``estimate-memory``, computed from the model's parameter shapes alone (a model on the meta device
works) with docs/training.md's memory model: what the engine puts in each tier, where the store's
budgets push the overflow, what a step adds (on nvme the gradients made durable and one group's new
state before the old is freed; in host memory not updated in place, a second slot), and the host
memory plan (engine/paging/memory_plan.py) whose total tests/test_engine_memory.py holds a real run
to. It also finds what ``wrap`` or the first step would fail on (a budget below the model's
minimum, a shard larger than its tier's whole budget), which ``wrap`` refuses up front.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch
from torch import nn

from engine.config import EngineConfig
from engine.config.engine_config import updates_in_backward_ruled_out
from engine.paging.memory_plan import MemoryPlan, plan_memory
from engine.paging.placement import model_device
from tiered.util import format_bytes, round_up

MiB = 1024 * 1024
#: Stored / original bytes of fp32 master weights and Adam moments under ``compress_optimizer``:
#: 0.811-0.850 measured (docs/compression.md), so an estimate, rounded up.
COMPRESSED_STATE_RATIO = 0.85
_TIERS = ("device", "host", "nvme")


@dataclasses.dataclass(frozen=True)
class TierBytes:
    """Bytes per tier, for one rank."""

    device: int = 0
    host: int = 0
    nvme: int = 0

    def __getitem__(self, tier: str) -> int:
        return getattr(self, tier)

    @property
    def total(self) -> int:
        """All three tiers together."""
        return self.device + self.host + self.nvme


@dataclasses.dataclass(frozen=True)
class EstimatePart:
    """One kind of entry the engine keeps in the store: where it is put and how many bytes it takes."""

    what: str
    #: The tier the engine puts these entries in (before budgets move any of them down).
    tier: str
    #: Bytes of all of them at rest, per rank, as the tier charges them (nvme and host round each
    #: entry up to 4 KiB; compressed state at COMPRESSED_STATE_RATIO).
    nbytes: int
    #: The largest single entry and the parameter it belongs to.
    largest: int
    largest_name: str


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """What one rank needs for a model under a config: per tier at rest and during a step, the host
    RSS bound, and what would fail. Built by :func:`estimate_memory`; :meth:`render` is the table
    ``tiered estimate`` prints."""

    world_size: int
    #: Parameter elements of the whole model (tied parameters once), and of them those engine.AdamW
    #: trains (with gradients; 0 for an inference estimate).
    parameters: int
    trainable: int
    #: Whether the estimate includes engine.AdamW's gradients and state (False: inference).
    training: bool
    parts: tuple[EstimatePart, ...]
    #: Each tier's bytes between steps once the budgets are applied: what a tier cannot hold is
    #: written down to the next (device -> host -> nvme).
    at_rest: TierBytes
    #: The same while ``step()`` runs: with the state on nvme, the gradients are made durable there
    #: and one group's new state is written before its old state is freed; with the state in host
    #: memory and not updated in place, the new state goes to a second slot, so that tier holds it twice.
    during_step: TierBytes
    #: Host memory the engine and its store hold at most, above the process's size before wrap: the
    #: plan's pieces and its host tier (docs/training.md, "One budget for host memory"). torch's and Python's own
    #: growth (the autograd graph, the batch's activations) comes on top.
    host_rss_bound: int
    #: The least ``StoreConfig.host_bytes`` the model needs under the config (``host_budget="total"``).
    minimum_host_bytes: int
    #: How the host budget is divided (engine/paging/memory_plan.py).
    plan: MemoryPlan
    #: Parameter bytes materialized on the compute device at once: the largest module and the
    #: prefetch window (the plan's); in host memory (inside the bound) when computing on the CPU.
    materialized_bytes: int
    compute_device: str
    #: What ``wrap`` or training would fail on; ``wrap`` raises ValueError with these.
    problems: tuple[str, ...]
    #: What is likely to fail, from estimates (the nvme budget against the bytes a step needs).
    warnings: tuple[str, ...]
    #: Which way the optimizer steps run under the config, and why (``EngineConfig.step_in_backward``).
    step_mode: str = ""

    @property
    def fits(self) -> bool:
        """True when nothing is known to fail."""
        return not self.problems

    def render(self) -> str:
        """A plain-text table: the entries, each tier at rest and during a step, and the verdict."""
        lines = [f"parameters: {self.parameters:,} ({self.trainable:,} trainable); per rank of {self.world_size}"
                 + ("" if self.training else "; inference (no gradients or optimizer state)")]
        w = max([len("held in the device tier")] + [len(p.what) for p in self.parts])
        lines.append(f"  {'entries':<{w}} {'tier':<6} {'bytes':>10}  largest")
        for p in self.parts:
            lines.append(f"  {p.what:<{w}} {p.tier:<6} {format_bytes(p.nbytes):>10}  "
                         f"{format_bytes(p.largest)} ({p.largest_name})")
        lines.append(f"  {'':<{w}} {'':<6} {'at rest':>10}  {'during a step':>13}")
        for tier in _TIERS:
            lines.append(f"  {'held in the ' + tier + ' tier':<{w}} {'':<6} {format_bytes(self.at_rest[tier]):>10}  "
                         f"{format_bytes(self.during_step[tier]):>13}")
        plan = self.plan
        budget = "host_bytes" if plan.mode == "total" else "host_bytes (the host tier alone)"
        lines.append(f"host memory: {budget} {format_bytes(plan.budget)}; minimum "
                     f"{format_bytes(self.minimum_host_bytes)} ({self.minimum_host_bytes} bytes)")
        for piece in (*plan.pieces, dataclasses.replace(plan.host_tier_minimum, nbytes=plan.host_tier_bytes,
                                                        why="what the rest leaves" if plan.mode == "total"
                                                        else "host_bytes")):
            lines.append(f"  {piece.what:<{w}} {'':<6} {format_bytes(piece.nbytes):>10}  {piece.why}")
        lines.append(f"host RSS bound: {format_bytes(self.host_rss_bound)} above the process before wrap "
                     f"(compute on {self.compute_device}; {format_bytes(self.materialized_bytes)} of parameters "
                     "materialized at once; torch's own growth and the batch's activations come on top)")
        if self.training and self.step_mode:
            lines.append(f"optimizer steps: {self.step_mode}")
        lines.extend(f"PROBLEM: {p}" for p in self.problems)
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def estimate_memory(
    model: nn.Module, config: EngineConfig, *, world_size: int = 1, training: bool = True
) -> MemoryEstimate:
    """Bytes one rank of ``world_size`` needs to run ``model`` under ``config``.

    ``training``: with ``engine.AdamW`` (fp32 gradient shards, master weights and two moments per
    trainable element); False for inference, parameters only. Reads shapes and dtypes only, so
    the model may be on the meta device. Uses docs/training.md's memory model; compressed state is
    estimated at :data:`COMPRESSED_STATE_RATIO`, so those figures are approximate.

    Returns:
        The estimate; its ``problems`` name what ``engine.wrap`` would refuse (it raises them).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``config`` not an EngineConfig, or
            ``training`` not a bool.
        ValueError: ``world_size`` is not an int >= 1.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"estimate_memory takes an nn.Module, got {type(model).__name__}")
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an engine.EngineConfig, got {type(config).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(training, bool):
        raise TypeError(f"training must be True or False, got {training!r}")
    train_dtype = getattr(torch, config.train_dtype) if config.train_dtype is not None else None
    parts, sizes = _count_entries(model, config, train_dtype, world_size, training)
    store = config.store
    compute = torch.device(config.compute_device) if config.compute_device is not None else model_device(model)
    plan = plan_memory(model, config, world_size=world_size, training=training, compute_device=compute)
    budgets = {"device": store.device_bytes, "host": plan.host_tier_bytes, "nvme": store.nvme_bytes}
    placed = {t: sum(p.charged for p in parts if p.tier == t) for t in _TIERS}
    during = dict(placed)
    if training and sizes.trainable and not config.updates_in_place:
        group = min(max(config.optimizer_group_bytes, sizes.largest_fp32_shard), sizes.fp32_bytes)
        after = dict(during)
        if config.optimizer_tier == "nvme":
            if config.grad_tier != "nvme":
                after["nvme"] += parts[1].charged  # the gradients, made durable at the step's start
            # one group's new state (and parameters) in flight beside the old
            after["nvme"] += 3 * group + group * sizes.extra_itemsize // 4
        else:
            after[config.optimizer_tier] += parts[2].charged  # the new slot beside the old one
        inside = dict(during)
        accumulating = config.gradient_accumulation_steps > 1
        if not accumulating:
            inside[parts[1].tier] -= parts[1].charged  # no gradient goes to grad_tier in such a step
        # Every entry an update replaces, kept until the step commits (parameters, masters, moments), one
        # batch's new values beside them, and with clipping the gradients kept for a redo (in bf16 or
        # fp16 where that holds them exactly: engine/optim/grad_offload.py). With accumulation the earlier
        # micro-batches' sums stay in grad_tier until the step, and a kept gradient replaces its sum there.
        inside["nvme"] += parts[0].charged + parts[2].charged + 3 * group + group * sizes.extra_itemsize // 4
        if config.max_grad_norm is not None and not (accumulating and parts[1].tier == "nvme"):
            narrow = sizes.extra_itemsize == 2 and world_size == 1 and not accumulating
            inside["nvme"] += sizes.fp32_bytes // 2 if narrow else sizes.fp32_bytes
        ways = [w for name, w in (("after", after), ("inside", inside)) if name in _step_ways(config)]
        during = {t: max(_apply_budgets(w, budgets)[t] for w in ways) for t in during}
    at_rest, during_step = _apply_budgets(placed, budgets), _apply_budgets(during, budgets)
    largest_module = max((_module_bytes(m, train_dtype) for m in model.modules()), default=0)
    materialized = largest_module + plan.settings.prefetch_bytes
    problems = _problems(config, parts, budgets)
    if not plan.fits:
        problems.insert(0, plan.problem())
    warnings = []
    if store.nvme_bytes is not None and during_step.nvme > store.nvme_bytes:
        warnings.append(f"the nvme tier needs about {format_bytes(during_step.nvme)} during a step but "
                        f"StoreConfig.nvme_bytes is {format_bytes(store.nvme_bytes)}: raise it or give the "
                        "host tier more")
    if _gradients_spill(config, parts, budgets["host"]):
        warnings.append(f"the gradients ({format_bytes(parts[1].charged)}) do not fit in the host tier "
                        f"({format_bytes(budgets['host'] or 0)}): each goes to nvme in backward and comes back in "
                        "the step, 8 bytes a parameter; with EngineConfig.step_in_backward left at None (the "
                        "default) each update runs inside backward and no gradient is stored (docs/training.md, "
                        "'Updates inside backward')")
    return MemoryEstimate(
        world_size=world_size, parameters=sizes.params, trainable=sizes.trainable, training=training,
        parts=tuple(p.freeze() for p in parts if p.entries), at_rest=at_rest, during_step=during_step,
        host_rss_bound=plan.total_bytes, minimum_host_bytes=plan.minimum_bytes, plan=plan,
        materialized_bytes=materialized, compute_device=str(compute),
        problems=tuple(problems), warnings=tuple(warnings), step_mode=describe_step_mode(config),
    )


def describe_step_mode(config: EngineConfig) -> str:
    """Which way ``config``'s optimizer steps run (with ``engine.AdamW``), and why, in one line."""
    ruled_out = updates_in_backward_ruled_out(config)
    if config.step_in_backward is False:
        return "the step after backward (EngineConfig.step_in_backward=False)"
    if ruled_out is not None:
        return f"the step after backward ({ruled_out})"
    kept = (", each gradient also kept on nvme for a redo when clipping binds (max_grad_norm)"
            if config.max_grad_norm is not None else "")
    if config.step_in_backward:
        return "updates inside backward from the first step (EngineConfig.step_in_backward=True)" + kept
    return ("updates inside backward from the second step (the default: the first runs after backward while the "
            "engine watches the loop; a step after one whose clip norm bound runs after backward)" + kept)


def _step_ways(config: EngineConfig) -> tuple[str, ...]:
    """The ways ``config``'s steps may run: "after" backward, "inside" it, or both."""
    if config.step_in_backward is False or updates_in_backward_ruled_out(config) is not None:
        return ("after",)
    return ("inside",) if config.step_in_backward else ("after", "inside")


class _Part:
    """An EstimatePart being summed."""

    def __init__(self, what: str, tier: str, setting: str) -> None:
        self.what, self.tier, self.setting = what, tier, setting
        self.charged = self.entries = self.largest = 0
        self.largest_name = ""

    def add(self, name: str, nbytes: int, *, copies: int) -> None:
        footprint = nbytes if self.tier == "device" else round_up(max(nbytes, 1))
        self.charged += copies * footprint
        self.entries += copies
        if footprint > self.largest:
            self.largest, self.largest_name = footprint, name

    def freeze(self) -> EstimatePart:
        return EstimatePart(self.what, self.tier, self.charged, self.largest, self.largest_name)


@dataclasses.dataclass
class _Sizes:
    """Parameter elements counted besides the entries."""

    params: int = 0
    trainable: int = 0
    largest_fp32_shard: int = 0
    extra_itemsize: int = 0  # bytes per element of a training dtype other than fp32 (the step's new shard)
    own_masters: int = 0  # trainable fp32 parameters that are their own masters
    fp32_bytes: int = 0  # every trainable fp32 shard once, as a tier charges it


def _count_entries(
    model: nn.Module, config: EngineConfig, train_dtype: Optional[torch.dtype], world_size: int, training: bool
) -> tuple[list["_Part"], _Sizes]:
    """Every entry the engine puts in the store for ``model``, summed by kind."""
    compressed = config.compress_optimizer and config.optimizer_tier == "nvme"
    # fp32 parameters in the optimizer's tier are their own masters (engine/optim/training.py)
    one_copy = config.param_tier == config.optimizer_tier and (
        config.optimizer_tier == "nvme" or config.updates_in_place)
    parts = [_Part("parameter shards", config.param_tier, "param_tier")]
    if training:
        parts += [_Part("fp32 gradient shards", config.grad_tier, "grad_tier"),
                  _Part("fp32 master weights + 2 Adam moments", config.optimizer_tier, "optimizer_tier")]
    sizes = _Sizes()
    for name, p in model.named_parameters():  # tied parameters once, under their first name
        dtype = train_dtype if train_dtype is not None and p.is_floating_point() else p.dtype
        shard_numel = -(-p.numel() // world_size)  # engine.paging.layout.ShardLayout: padded to a multiple of world
        sizes.params += p.numel()
        parts[0].add(name, shard_numel * dtype.itemsize, copies=1)
        if training and p.requires_grad:
            sizes.trainable += p.numel()
            fp32 = shard_numel * 4
            sizes.largest_fp32_shard = max(sizes.largest_fp32_shard, fp32)
            if dtype.itemsize != 4:
                sizes.extra_itemsize = max(sizes.extra_itemsize, dtype.itemsize)
            sizes.fp32_bytes += round_up(max(fp32, 1))
            parts[1].add(name, fp32, copies=1 if config.stores_gradients else 0)
            own_master = one_copy and dtype == torch.float32
            sizes.own_masters += own_master
            stored = int(fp32 * COMPRESSED_STATE_RATIO) if compressed else fp32
            parts[2].add(name, stored, copies=2 if own_master else 3)
    if training:
        parts[2].what += (" (fp32 parameters are their own masters)" if sizes.own_masters else "") + (
            ", ~compressed" if compressed else "")
    return parts, sizes


def _module_bytes(module: nn.Module, train_dtype: Optional[torch.dtype]) -> int:
    """Bytes of a module's own parameters as materialized for compute (whole, in the training dtype)."""
    total = 0
    for p in module.parameters(recurse=False):
        dtype = train_dtype if train_dtype is not None and p.is_floating_point() else p.dtype
        total += p.numel() * dtype.itemsize
    return total


def _apply_budgets(placed: dict[str, int], budgets: dict[str, Optional[int]]) -> TierBytes:
    """Each tier keeps what its budget allows and writes the rest down to the next one."""
    held: dict[str, int] = {}
    spill = 0
    for tier in _TIERS:
        want = placed[tier] + spill
        budget = budgets[tier]
        held[tier] = want if budget is None or tier == "nvme" else min(want, budget)
        spill = want - held[tier]
    return TierBytes(**held)


def _gradients_spill(config: EngineConfig, parts: list["_Part"], host_tier: Optional[int]) -> bool:
    """Whether gradients overflow the host tier where ``step_in_backward=False`` stores every one but updates
    inside backward would store none."""
    return (len(parts) > 1 and config.step_in_backward is False and config.grad_tier == "host"
            and updates_in_backward_ruled_out(config) is None and config.max_grad_norm is None
            and host_tier is not None and parts[1].charged > host_tier)


def _problems(config: EngineConfig, parts: Iterable[_Part], budgets: dict[str, Optional[int]]) -> list[str]:
    """What is certain to fail: a tier with no budget that parameters or activations must go to, and
    any entry larger than its tier's whole budget (the store refuses it) but a gradient shard, which
    goes to nvme instead (engine/optim/grad_offload.py)."""
    found = []
    if config.param_tier in ("device", "host") and budgets[config.param_tier] == 0:
        found.append(f"EngineConfig.param_tier is {config.param_tier!r} but the store's {config.param_tier}_bytes "
                     "is 0; give that tier a budget or choose another param_tier")
        return found
    if config.activation_tier == "host" and budgets["host"] == 0:
        found.append("EngineConfig.activation_tier is 'host' but the store's host_bytes is 0; give the host tier a "
                     "budget or set activation_tier='nvme'")
    for part in parts:
        budget = budgets[part.tier]
        if part.setting == "grad_tier":
            continue
        if part.entries and budget is not None and part.largest > budget:
            field = {"device": "device_bytes", "host": "host_bytes", "nvme": "nvme_bytes"}[part.tier]
            below = {"device": "host", "host": "nvme"}.get(part.tier)
            lower = f" or set {part.setting}={below!r}" if below else ""
            found.append(f"{part.what} go to the {part.tier} tier ({part.setting}={part.tier!r}), and the one of "
                         f"{part.largest_name!r} takes {format_bytes(part.largest)} ({part.largest} bytes), more than "
                         f"the tier's whole budget, StoreConfig.{field}={budget}: raise {field} to at least "
                         f"{part.largest}{lower}")
    return found
