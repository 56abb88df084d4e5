"""Training: ``engine.AdamW`` bound to a wrapped model: gradient offload, the step, zero_grad, resume.

``engine.wrap(model, optimizer=engine.AdamW(...))`` binds the optimizer over ``model.parameters()``
and routes its ``step()`` here (so LR schedulers and step hooks see every step):

1. wait for the gradient puts still in flight (``GradOffload``);
2. give optimizer state to shards that got a gradient and have none yet: fp32 master upcast from
   the training-dtype shard, zero moments, in slot 0 (``optimizer_step.init_state``), and commit;
3. stream every shard through ``AdamW.run_step``: read the live slot's master and moments (those of
   the first groups were read during backward, ``engine/optim/prefetch.py``), write the new ones to
   the other slot and the new training-dtype shard to ``param/<name>``; with the state in host
   memory (``EngineConfig.updates_in_place``) update the live slot where it lies instead;
4. commit: put the step record (``engine/step``, durable on nvme) naming the new slots and step
   counts, then delete the superseded slot's keys (in place: the record keeps the slots).

With ``EngineConfig.loss_scaling`` (``engine/optim/loss_scaler.py``), ``eng.backward(loss)`` scales the
loss; the step first takes the global norm of the stored (scaled) gradients, from the per-shard
norms taken at offload. Not finite: the step is skipped (gradients and prefetched state dropped,
the scale lowered, the record rewritten with the scaler's new state). Finite: step 3 multiplies
every gradient by 1/scale before clipping and AdamW, and the record carries the scaler's state.

A crash anywhere leaves a record whose slots are whole (state in host memory is lost by a crash
anyway; a step that raises keeps the groups it updated in place, and rewrites ``param/<name>`` from
the masters as below). ``param/<name>`` of a trainable shard is
overwritten in place during the step, so resuming (``EngineConfig(resume=True)``) rewrites it from
the live master (cast to the training dtype: exactly what the step wrote). A step that raises does
the same before re-raising, so the model keeps the last completed step's values.

For checkpoints (``engine/checkpoint/sharded.py``): :meth:`Training.live_shards` gives the store keys of the
current state; to install loaded state atomically, write each shard's master and moments to
:meth:`Training.staging_keys` and call :meth:`Training.commit_staged`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Mapping, Optional, Sequence

import torch
from torch import nn

from engine.config import EngineConfig
from engine.errors import StepRecordError
from engine.optim.adamw import AdamW
from engine.optim.clip import AllReduceSum, total_norm
from engine.optim.grad_offload import GradOffload
from engine.optim.loss_scaler import LossScaler
from engine.optim.prefetch import StatePrefetch
from engine.optim.step import EventHook, init_state
from engine.optim.step_io import gather_all, plan_groups, run_sync
from engine.optim.step_record import NO_STATE, STEP_RECORD_KEY, ShardState, StepRecord
from engine.optim.types import OptimShard, OptimStepStats
from engine.paging.handle import ParamHandle
from engine.paging.layout import GRAD_KEY_PREFIX, OPTIM_KEY_PREFIX, grad_key, optim_keys
from engine.paging.pager import Pager
from engine.paging.shard_io import ShardIO, delete_keys
from tiered import ChecksumError, TieredStore


@dataclasses.dataclass
class TrainCounters:
    """Totals over the optimizer steps run by this engine (this process)."""

    steps: int = 0
    seconds: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    stall_seconds: float = 0.0
    last: Optional[OptimStepStats] = None

    def add(self, stats: OptimStepStats, seconds: float) -> None:
        """Count one finished step (``seconds``: the whole step, commit included)."""
        self.steps += 1
        self.seconds += seconds
        self.bytes_read += stats.bytes_read
        self.bytes_written += stats.bytes_written
        self.stall_seconds += stats.io_stall_seconds
        self.last = stats


@dataclasses.dataclass(frozen=True)
class _Param:
    """A trainable parameter's shard as the optimizer sees it."""

    name: str
    numel: int
    dtype: torch.dtype
    param_key: str
    group: int


def discard_training_state(store: TieredStore) -> None:
    """Delete gradient shards, optimizer state and the step record an earlier run left in ``store``
    (a fresh, non-resuming wrap: its parameters replace that run's, so its state no longer fits)."""
    stale = [k for k in store.keys() if k.startswith((GRAD_KEY_PREFIX, OPTIM_KEY_PREFIX)) or k == STEP_RECORD_KEY]
    delete_keys(store, stale)


def check_resumable(store: TieredStore) -> None:
    """ValueError unless ``store`` holds a step record to resume from."""
    if STEP_RECORD_KEY not in store:
        raise ValueError(
            f"EngineConfig(resume=True), but the store at {store.config.path} has no step record: no training with "
            "engine.AdamW ran there (or a later wrap started afresh); wrap without resume"
        )


class Training:
    """The engine's side of ``engine.AdamW``: one per wrapped model."""

    def __init__(
        self,
        model: nn.Module,
        by_id: Mapping[int, ParamHandle],
        optimizer: AdamW,
        shard_io: ShardIO,
        pager: Pager,
        config: EngineConfig,
    ) -> None:
        if optimizer.bound:
            raise ValueError("this engine.AdamW is already bound to a model; create one optimizer per engine.wrap")
        self._store: TieredStore = shard_io.store
        self._optimizer = optimizer
        self._pager = pager
        self._config = config
        self._handles = list(by_id.values())
        params = list(model.parameters())  # model order, tied parameters once: the order clip_grad_norm_ sees
        handles = [by_id[id(p)] for p in params]
        groups = optimizer.group_of((h.name, p) for h, p in zip(handles, params))
        self._params = [
            _Param(h.name, h.layout.shard_numel, h.layout.dtype, h.key, groups[h.name]) for h in handles if h.trainable
        ]
        self._by_name = {p.name: p for p in self._params}
        for handle in handles:
            if handle.trainable:
                handle.mark_grads_in_store(config.max_grad_norm)
        # State updated in place is read by nobody: the step works on the store's memory directly.
        prefetch_groups = 0 if config.updates_in_place else config.optimizer_prefetch_groups
        self._prefetch = StatePrefetch(self._store, prefetch_groups, config.optimizer_group_bytes)
        #: The running loss scale (None without ``EngineConfig.loss_scaling``).
        self.scaler: Optional[LossScaler] = (
            LossScaler(config.loss_scaling) if config.loss_scaling is not None else None
        )
        #: True while ``eng.backward`` runs a scaled backward (gradients of any other backward are refused).
        self.scaled_backward = False
        self.grads = GradOffload(
            shard_io, config.grad_tier, inflight_bytes=config.optimizer_group_bytes,
            on_offload=self._on_offload,
        )
        #: The global gradient 2-norm of the last step (unscaled, before clipping); None before the first.
        self.last_grad_norm: Optional[float] = None
        #: The norm ``clip_next_step`` asked the next step to clip to (None: only the config's clipping).
        self._clip_to: Optional[float] = None
        self.record = StepRecord.empty([p.name for p in self._params]).replace(loss_scale=self._scaler_state())
        self.counters = TrainCounters()
        #: Tracing hook passed to every step's ``run_step`` (tests use it to stop a step half way).
        self.on_event: Optional[EventHook] = None
        self._closed = False
        #: A failed step's rollback could not rewrite the parameters (the store kept failing): the next step does.
        self._restore_pending = False
        #: Sums a rank's sum of squared gradients over ranks for clipping (multi-rank training).
        self.all_reduce: Optional[AllReduceSum] = _all_reduce_sum(shard_io)
        self._comm = shard_io.collectives if shard_io.world > 1 else None
        optimizer._bind(params, self._step, self._zero_grad, state_in_store=True)

    # ------------------------------------------------------------------ lifecycle

    def _agree_on_step(self, step: Optional[int]) -> None:
        """With several ranks, check that every rank's store completed the same step (each rank
        commits its own record, so a crash between two ranks' commits leaves them one step
        apart, and resuming would silently mix two steps). Every rank calls this, even one whose
        record could not be read (None), so none is left waiting in the collective."""
        comm = self._comm
        if comm is None:
            return
        steps = comm.run(comm.all_gather_object, step)
        if len(set(steps)) > 1:
            raise StepRecordError(
                f"the ranks' stores completed different steps {dict(enumerate(steps))} (None: unreadable): a crash "
                "came between the ranks' commits, so no step exists on every rank. Resume from a checkpoint "
                "instead (wrap without resume, then eng.load_checkpoint(...))"
            )

    def start(self, resume: bool) -> None:
        """Fresh: commit an empty record (step 0). Resume: take up the store's record (see module doc)."""
        if not resume:
            self.record.write(self._store)
            return
        failure: Optional[BaseException] = None
        record: Optional[StepRecord] = None
        try:
            check_resumable(self._store)
            record = StepRecord.read(self._store)
        except (StepRecordError, ChecksumError) as exc:
            failure = StepRecordError(
                f"cannot resume from the store at {self._store.config.path}: {exc}. Resume from a checkpoint instead "
                "(wrap without resume, then eng.load_checkpoint(...)), or wrap without resume to start afresh"
            )
            failure.__cause__ = exc
        except BaseException as exc:  # noqa: BLE001 - raised below, after every rank has reported
            failure = exc
        self._agree_on_step(None if record is None else record.step)
        if failure is not None:
            raise failure
        assert record is not None
        names = [p.name for p in self._params]
        missing = sorted(set(names) - set(record.shards))
        extra = sorted(set(record.shards) - set(names))
        if missing or extra:
            raise StepRecordError(
                f"the store's step record does not match the model's trainable parameters: the model has "
                f"{missing[:5]} that the record lacks and the record has {extra[:5]} that the model lacks"
            )
        for p in self._params:
            state = record.shards[p.name]
            if state.slot != NO_STATE:
                absent = [k for k in optim_keys(p.name, state.slot) if k not in self._store]
                if absent:
                    raise StepRecordError(
                        f"optimizer state of {p.name!r} from step {record.step} is missing from the store "
                        f"({absent[0]!r}): it was in the host tier (optimizer_tier='host'), which does not survive "
                        "a crash; crash resume needs optimizer_tier='nvme'"
                    )
        if self.scaler is not None and record.loss_scale is not None:
            try:
                self.scaler.load_state_dict(record.loss_scale)
            except ValueError as exc:
                raise StepRecordError(f"cannot resume the loss scale from the store's step record: {exc}") from exc
        self.record = StepRecord(record.step, {n: record.shards[n] for n in names}, self._scaler_state())
        self._optimizer._set_shard_steps({n: s.steps for n, s in self.record.shards.items()})
        self._restore_params()
        self.grads.discard_stored()
        self._delete_inactive()

    def close(self) -> None:
        """Wait for gradient puts still in flight (errors are dropped: the engine is closing); later
        steps raise and zero_grad does nothing more than torch's."""
        self._closed = True
        try:
            self.grads.flush()
        except RuntimeError:
            pass
        finally:
            self._prefetch.discard()

    # ------------------------------------------------------------------ queries

    @property
    def completed_steps(self) -> int:
        """Optimizer steps completed on this store (a resumed run counts the earlier ones)."""
        return self.record.step

    def live_shards(self) -> list[OptimShard]:
        """Every trainable shard with the store keys of its current state (a shard that never took
        a step has none yet: its slot-0 keys are absent from the store)."""
        return [self.live_shard(p.name) for p in self._params]

    def live_shard(self, name: str) -> OptimShard:
        """:meth:`live_shards`' entry for the trainable shard ``name`` alone."""
        p = self._by_name[name]
        return self._shard(p, max(self.record.shards[name].slot, 0))

    def staging_keys(self, name: str) -> tuple[str, str, str]:
        """Where to write loaded master, exp_avg, exp_avg_sq of ``name`` before :meth:`commit_staged`."""
        return optim_keys(name, self._other(self.record.shards[name].slot))

    def commit_staged(self, step: int, shard_steps: Mapping[str, int]) -> None:
        """Install state written to :meth:`staging_keys`: a shard whose staged master is in the store
        takes ``shard_steps[name]``; the others have no state (and must have 0 steps). Commits the
        record at ``step``, rewrites the trainable parameters from their masters, drops the old state
        and every gradient shard."""
        self._prefetch.discard()  # it read the state this replaces
        self.grads.discard_stored()
        shards = {}
        for p in self._params:
            slot = self._other(self.record.shards[p.name].slot)
            count = int(shard_steps.get(p.name, 0))
            staged = optim_keys(p.name, slot)
            if all(k in self._store for k in staged):
                shards[p.name] = ShardState(count, slot)
            elif count:
                raise StepRecordError(f"{p.name!r} has taken {count} steps but no state was staged at {staged}")
            else:
                shards[p.name] = ShardState(0, NO_STATE)
        record = StepRecord(step, shards, self._scaler_state())
        record.write(self._store)
        self.record = record
        self._optimizer._set_shard_steps({n: s.steps for n, s in self.record.shards.items()})
        self._restore_params()
        self._delete_inactive()  # the replaced state, and anything staged for a shard left without state

    # ------------------------------------------------------------------ the step (AdamW.step -> here)

    def pending_grad_norm(self) -> float:
        """The 2-norm of the gradients the next step will use, unscaled (non-finite when loss scaling
        will skip it); the step reports the same value. Collective at world size > 1."""
        scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        return float(self._stored_grad_norm()) * scale

    def clip_next_step(self, max_norm: float) -> float:
        """Have the next step clip the gradients it will use to the 2-norm ``max_norm`` (math.inf:
        no clipping), as ``clip_grad_norm_`` right before a plain model's step; returns
        :meth:`pending_grad_norm`. Asked twice, the step clips to the smaller norm, as two clips in
        a row would. A backward adding gradients before that step is refused, since the clipping
        would then cover gradients that did not exist when it was asked for."""
        norm = self.pending_grad_norm()
        if not math.isinf(max_norm):
            self._clip_to = float(max_norm) if self._clip_to is None else min(self._clip_to, float(max_norm))
        return norm

    def _stored_grad_norm(self) -> torch.Tensor:
        """The stored (loss-scaled) gradients' global norm, summed in parameter order over every
        rank, once every gradient shard has reached the store."""
        self.grads.flush()
        # Norms taken on the compute device (CUDA) join the step's CPU math as CPU scalars.
        norms = {n: t.cpu() for n, t in self.grads.norms.items()} if self.grads.norms else {}
        return total_norm([norms[p.name] for p in self._params if p.name in norms], self.all_reduce)

    def _step(self) -> None:
        if self._closed:
            raise RuntimeError(
                "the engine this engine.AdamW is bound to was closed or unwrapped; wrap the model again with a new "
                "engine.AdamW (EngineConfig(resume=True) continues from the store)"
            )
        started = time.perf_counter()
        with self._pager.lock:
            busy = [h.name for h in self._handles if h.held]
            if busy:
                raise RuntimeError(
                    f"eng.step() was called while the model is running (parameters in use: {busy[:3]}); step after "
                    "backward() has returned"
                )
            self._pager.drop_prefetched()
        if self._restore_pending:
            self._restore_params()
            self._restore_pending = False
        cfg = self._config
        grad_scale = 1.0
        scaler_before = self._scaler_state()
        # The step clips with this norm and reports it; every rank takes part in the sum, so all of
        # them agree on skipping.
        stored_norm = self._stored_grad_norm()
        if self.scaler is not None:
            if not bool(torch.isfinite(stored_norm)):
                self.last_grad_norm = float(stored_norm)
                self._skip_step()
                return
            grad_scale = 1.0 / self.scaler.scale
        with_grad = [p for p in self._params if self.grads.has_grad(p.name)]
        self._init_new_state([p for p in with_grad if self.record.shards[p.name].slot == NO_STATE])
        in_place = cfg.updates_in_place
        shards = [self._shard(p, max(self.record.shards[p.name].slot, 0), write_other=not in_place)
                  for p in self._params]
        store = self._prefetch.take(self._store)
        try:
            stats = self._optimizer.run_step(
                store, shards, config=cfg, all_reduce=self.all_reduce, on_event=self.on_event, grad_scale=grad_scale,
                grad_norm=stored_norm, clip_to=self._clip_to,
            )
        except BaseException as exc:
            store.close()
            self._rollback(exc)
            raise
        store.close()
        counts = self._optimizer.shard_steps
        previous = self.record
        updated = {p.name for p in with_grad}
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        record = StepRecord(previous.step + 1, {
            name: ShardState(counts.get(name, 0), self._other(s.slot) if name in updated and not in_place else s.slot)
            for name, s in previous.shards.items()
        }, self._scaler_state())
        try:
            record.write(self._store)  # the commit point
        except BaseException as exc:
            self._optimizer._set_shard_steps({n: s.steps for n, s in previous.shards.items()})
            self._restore_scaler(scaler_before)
            self._rollback(exc)
            raise
        self.record = record
        self.grads.mark_consumed()
        self._clip_to = None
        self.last_grad_norm = float(stored_norm) * grad_scale  # a power of two: exactly the unscaled norm
        if not in_place:
            delete_keys(self._store, [k for name in updated for k in optim_keys(name, previous.shards[name].slot)])
        self.counters.add(stats, time.perf_counter() - started)

    def _zero_grad(self, set_to_none: bool) -> None:
        self._clip_to = None
        if not self._closed:
            self.grads.zero(set_to_none)

    def _skip_step(self) -> None:
        """An inf or NaN gradient: no update. The gradients go (as DeepSpeed drops them: kept, they
        would overflow every later step too), the scale is lowered and the record commits it."""
        assert self.scaler is not None
        before = self.scaler.state_dict()
        self._prefetch.discard()
        self._clip_to = None
        self.grads.zero(set_to_none=True)
        self.scaler.update(overflow=True)
        record = self.record.replace(loss_scale=self._scaler_state())
        try:
            record.write(self._store)
        except BaseException:
            self._restore_scaler(before)
            raise
        self.record = record

    def _scaler_state(self) -> Optional[dict]:
        return self.scaler.state_dict() if self.scaler is not None else None

    def _restore_scaler(self, state: Optional[dict]) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)

    def _on_offload(self) -> None:
        """A gradient is final (called from backward, before it is stored)."""
        if self.scaler is not None and not self.scaled_backward:
            raise RuntimeError(
                "EngineConfig.loss_scaling is set, so the loss must be scaled before backward: call "
                "eng.backward(loss) instead of loss.backward(), or, where other code calls backward, pass it "
                "eng.with_loss_scale(loss) (unscaled fp16 gradients underflow, and the step would divide them "
                "by the scale)"
            )
        if self._clip_to is not None:
            raise RuntimeError(
                f"a backward added gradients after eng.clip_grad_norm_({self._clip_to}) and before the step it clips: "
                "call it once the accumulation window's last backward has returned, right before the optimizer "
                "step (under accelerate: `if accelerator.sync_gradients: eng.clip_grad_norm_(...)`)"
            )
        self._start_prefetch()

    # ------------------------------------------------------------------ internals

    def _shard(self, p: _Param, slot: int, *, write_other: bool = False) -> OptimShard:
        master, exp_avg, exp_avg_sq = optim_keys(p.name, slot)
        return OptimShard(
            p.name, p.numel, p.dtype, p.param_key, grad_key(p.name), master, exp_avg, exp_avg_sq,
            group=p.group, state_out_keys=optim_keys(p.name, 1 - slot) if write_other else None,
        )

    @staticmethod
    def _other(slot: int) -> int:
        return 0 if slot == NO_STATE else 1 - slot

    def _init_new_state(self, params: list[_Param]) -> None:
        """State for shards stepping for the first time, committed before the step can touch their
        parameters (so a crash in the step finds their pre-step values in the master)."""
        if not params:
            return
        cfg = self._config
        # Slot-0 keys of a shard without state are leftovers of an init that failed half way (init_state
        # skips a shard whose master exists, so a master without its moments would stay so).
        delete_keys(self._store, [k for p in params for k in optim_keys(p.name, 0)])
        init_state(self._store, [self._shard(p, 0) for p in params], state_tier=cfg.optimizer_tier,
                   compress=cfg.compress_optimizer, group_bytes=cfg.optimizer_group_bytes)
        fresh = {p.name for p in params}
        record = self.record.replace(shards={
            name: ShardState(s.steps, 0) if name in fresh else s for name, s in self.record.shards.items()
        })
        record.write(self._store)
        self.record = record

    def _start_prefetch(self) -> None:
        """A gradient is final (called from backward): start reading the step's first groups of
        optimizer state, unless already started since the last step (engine/optim/prefetch.py)."""
        if self._closed or self._prefetch.started or self._restore_pending:
            return
        shards = self.live_shards()
        self._prefetch.start(shards, [self.record.shards[p.name].slot != NO_STATE for p in self._params])

    def _rollback(self, error: BaseException) -> None:
        """After a failed step: parameters back to the live masters (the step's error is what the caller
        sees; if the store fails this too, the next step does it first, and ``error`` says so)."""
        try:
            self._delete_inactive()  # the failed step's partial state writes: frees their space for the rewrite
            self._restore_params()
        except Exception as exc:  # noqa: BLE001 - the original error is re-raised by the caller
            self._restore_pending = True
            error.add_note(
                f"eng.step() could not restore the parameters of the last completed step either ({exc}); until the "
                "next eng.step() (which restores them first) or a resume, some parameters hold the failed step's values"
            )

    def _restore_params(self) -> None:
        """Rewrite every trainable shard that has state from its live master, cast to the training
        dtype, one group at a time."""
        shards = [s for s, p in zip(self.live_shards(), self._params) if self.record.shards[p.name].slot != NO_STATE]
        if shards:
            run_sync(_restore(self._store, shards, self._config.param_tier, self._config.optimizer_group_bytes))

    def _delete_inactive(self) -> None:
        """Delete state keys of the slots the record does not name (a crashed step's partial writes)."""
        stale = []
        for p in self._params:
            live = self.record.shards[p.name].slot
            for slot in (0, 1):
                if slot != live:
                    stale += optim_keys(p.name, slot)
        delete_keys(self._store, stale)


def _all_reduce_sum(shard_io: ShardIO) -> Optional[AllReduceSum]:
    """The sum over ranks of a 0-dim tensor, through the engine's collectives (None on one rank)."""
    comm = getattr(shard_io, "collectives", None)
    if comm is None:
        return None

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        comm.run(comm.all_reduce_sum, tensor)
        return tensor

    return all_reduce


async def _restore(store: TieredStore, shards: Sequence[OptimShard], tier: str, group_bytes: int) -> None:
    loop = asyncio.get_running_loop()
    for group in plan_groups(shards, group_bytes):
        masters = await gather_all(store.get(s.master_key) for s in group)
        params = await loop.run_in_executor(None, _cast, group, masters)
        await gather_all(store.put(s.param_key, p, tier) for s, p in zip(group, params))


def _cast(group: list[OptimShard], masters: list[torch.Tensor]) -> list[torch.Tensor]:
    return [m.view(-1) if s.train_dtype == torch.float32 else m.view(-1).to(s.train_dtype)
            for s, m in zip(group, masters)]

