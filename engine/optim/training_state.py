"""TrainingState: what the parts of ``engine.AdamW``'s training share (engine/optim/training.py).

The step after backward (engine/optim/after_backward.py), the updates inside backward
(engine/optim/inside_backward.py) and the state kept between steps (engine/optim/stored_state.py)
all read the store, the config, the trainable shards and the step record. The record, the one piece
of durable state they all change, changes only through :meth:`TrainingState.commit`; each part owns
the rest of what it changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import torch

from engine.config import EngineConfig
from engine.optim.adamw import AdamW
from engine.optim.clip import AllReduceSum, total_norm
from engine.optim.grad_offload import GradOffload
from engine.optim.loss_scaler import LossScaler
from engine.optim.speculation import Entries, entries_of
from engine.optim.step import EventHook
from engine.optim.step_record import NO_STATE, StepRecord
from engine.optim.types import OptimShard, OptimStepStats
from engine.paging.layout import grad_key, optim_keys, staged_key
from engine.paging.pager import Pager
from engine.paging.shard_io import ShardIO
from tiered import TieredStore


@dataclasses.dataclass(frozen=True)
class TrainedParam:
    """A trainable parameter's shard as the optimizer sees it."""

    name: str
    numel: int
    dtype: torch.dtype
    param_key: str
    group: int


@dataclasses.dataclass
class TrainCounters:
    """Totals over the optimizer steps run by this engine (this process)."""

    steps: int = 0
    seconds: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    stall_seconds: float = 0.0
    update_seconds: float = 0.0
    #: Steps whose updates ran inside backward and stood ([Note: Speculative updates]).
    steps_inside: int = 0
    #: Steps whose updates ran inside backward and were redone after it (the clip norm bound, or the
    #: hyperparameters changed, or the loop added a backward).
    steps_redone: int = 0
    last: Optional[OptimStepStats] = None

    def add(self, stats: OptimStepStats, seconds: float) -> None:
        """Count one finished step (``seconds``: the whole step, commit included)."""
        self.steps += 1
        self.seconds += seconds
        self.bytes_read += stats.bytes_read
        self.bytes_written += stats.bytes_written
        self.stall_seconds += stats.io_stall_seconds
        self.update_seconds += stats.update_seconds
        self.last = stats


class TrainingState:
    """The store, config, trainable shards and step record of one ``engine.AdamW``, and the layout of
    its keys ([Note: One copy of fp32 weights] in engine/optim/training.py)."""

    def __init__(self, *, store: TieredStore, config: EngineConfig, params: Sequence[TrainedParam], optimizer: AdamW,
                 pager: Pager, io: ShardIO, grads: GradOffload, scaler: Optional[LossScaler],
                 master_in_param: bool, all_reduce: Optional[AllReduceSum]) -> None:
        self.store = store
        self.config = config
        #: The trainable shards in ``model.parameters()`` order (tied once): the order clip_grad_norm_ sees.
        self.params = list(params)
        self.by_name = {p.name: p for p in self.params}
        self.optimizer = optimizer
        self.pager = pager
        self.io = io
        self.grads = grads
        #: The running loss scale (None without ``EngineConfig.loss_scaling``).
        self.scaler = scaler
        #: Sums a rank's sum of squared gradients over ranks for clipping (multi-rank training).
        self.all_reduce = all_reduce
        #: The last committed record (in memory, ahead of the store only between :meth:`commit` calls
        #: that resume and migration make); see engine/optim/step_record.py.
        self.record = StepRecord.empty([p.name for p in self.params], master_in_param=master_in_param).replace(
            loss_scale=self.scaler_state())
        #: State on nvme: one copy, each group committed atomically, rolled forward ([Note: Rolling a step forward]).
        self.durable = config.optimizer_tier == "nvme" and not config.updates_in_place
        #: Where this config lays fp32 masters: in the parameter ([Note: One copy of fp32 weights]).
        self.master_in_param = master_in_param
        self.counters = TrainCounters()
        #: Tracing hook for tests: passed to every step's ``run_step``, called with ("staged", -1) once a
        #: load's record has committed, and by the updates inside backward ("renamed", "written", "set aside").
        self.on_event: Optional[EventHook] = None
        #: The norm ``clip_grad_norm_`` asked the next step to clip to (None: only the config's clipping).
        self.clip_to: Optional[float] = None
        #: The global gradient 2-norm of the last step (unscaled, before clipping); None before the first.
        self.last_grad_norm: Optional[float] = None
        self.closed = False

    # ------------------------------------------------------------------ the record

    def commit(self, record: StepRecord) -> None:
        """Write ``record`` durably, then make it the state's: the commit point of whatever it records."""
        record.write(self.store)
        self.record = record

    def set_shard_steps(self) -> None:
        """Give the optimizer the record's per-shard step counts."""
        self.optimizer._set_shard_steps({n: s.steps for n, s in self.record.shards.items()})

    def scaler_state(self) -> Optional[dict]:
        """The loss scaler's state (None without loss scaling)."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def restore_scaler(self, state: Optional[Mapping[str, Any]]) -> None:
        """Put the loss scaler back to ``state`` (a :meth:`scaler_state`)."""
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)

    # ------------------------------------------------------------------ keys

    def one_copy(self, p: TrainedParam) -> bool:
        """Whether ``p`` is its own fp32 master ([Note: One copy of fp32 weights])."""
        return self.record.master_in_param and p.dtype == torch.float32

    def shard(self, p: TrainedParam, slot: int, *, write_other: bool = False, staged: bool = False) -> OptimShard:
        """``p``'s keys with its state in ``slot`` (``write_other``: the step writes the other slot)."""
        master, exp_avg, exp_avg_sq = optim_keys(p.name, slot)
        if self.one_copy(p):
            master = staged_key(p.name) if staged else p.param_key
        return OptimShard(
            p.name, p.numel, p.dtype, p.param_key, grad_key(p.name), master, exp_avg, exp_avg_sq,
            group=p.group, state_out_keys=optim_keys(p.name, 1 - slot) if write_other else None,
        )

    def live_shard(self, name: str) -> OptimShard:
        """The trainable shard ``name`` with the keys of its current state."""
        state = self.record.shards[name]
        return self.shard(self.by_name[name], max(state.slot, 0), staged=state.staged)

    def live_shards(self, names: Optional[Sequence[str]] = None) -> list[OptimShard]:
        """:meth:`live_shard` of every trainable shard (of ``names``, in that order)."""
        return [self.live_shard(n) for n in (names if names is not None else [p.name for p in self.params])]

    def has_state(self, name: str) -> bool:
        """Whether the trainable shard ``name`` has taken a step (it has moments, and a master)."""
        return self.record.shards[name].slot != NO_STATE

    def fresh(self) -> set[str]:
        """Trainable shards without optimizer state (no step taken yet)."""
        return {p.name for p in self.params if not self.has_state(p.name)}

    def entries(self, names: Optional[Sequence[str]] = None) -> list[Entries]:
        """The entries updates inside backward replace, of every shard (of ``names``)."""
        return [entries_of(s) for s in self.live_shards(names)]

    @staticmethod
    def other(slot: int) -> int:
        """The slot a step that writes the other slot writes, from the live ``slot``."""
        return 0 if slot == NO_STATE else 1 - slot

    # ------------------------------------------------------------------ norms

    def clip_norm(self) -> Optional[float]:
        """The norm the next step clips to: the smaller of ``max_grad_norm`` and ``clip_grad_norm_``'s, or None."""
        max_norm = self.config.max_grad_norm
        if self.clip_to is not None:
            max_norm = self.clip_to if max_norm is None else min(self.clip_to, max_norm)
        return max_norm

    def grad_norm(self, extra: Optional[Mapping[str, torch.Tensor]] = None) -> torch.Tensor:
        """The stored (loss-scaled) gradients' global norm, summed in parameter order over every rank,
        once every gradient shard has reached the store; ``extra``: norms of final gradients that are
        not (or not only) stored, by shard name (updates inside backward)."""
        self.grads.flush()
        # Norms taken on the compute device (CUDA) join the step's CPU math as CPU scalars.
        norms = {n: t.cpu() for n, t in self.grads.norms.items()} if self.grads.norms else {}
        norms.update(extra or {})
        return total_norm([norms[p.name] for p in self.params if p.name in norms], self.all_reduce)
