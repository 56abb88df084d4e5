"""StepAfterBackward: the optimizer step that runs in ``eng.step()``, from the gradients backward stored.

Torch optimizers aside, this is how a step runs with ``EngineConfig.step_in_backward=False``, with
the state in host memory, for the first step by default, after a step whose clip norm bound, and to
redo updates that ran inside backward. After waiting for the gradient puts still in flight and, with
loss scaling, checking the stored gradients' norm for an overflow (skip: gradients and prefetched
state dropped, the scale lowered, the record rewritten with the scaler's new state), it depends on
where the state lives:

- **nvme** (``optimizer_tier="nvme"``, crash-safe): every gradient shard is made durable, the step
  record is rewritten with the step's :class:`~engine.optim.step_record.Applying` section, and each
  group's new state is written once, in place of the old, with one atomic store call that also
  marks the group done; the record then commits the step ([Note: Rolling a step forward] in
  engine/optim/training.py).
- **host, in place** (``EngineConfig.updates_in_place``): AdamW runs on the store's own memory
  (``store.modify``); a step that raises keeps the groups it updated, as a torch optimizer would.
- **host, not in place**: the new state goes to the other of two key sets (slots) and the record
  names the new slots; a step that raises leaves the previous one whole, its partial writes
  deleted and the parameters rewritten from the masters.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional, Sequence

import torch

from engine.optim.clip import clip_coefficient
from engine.optim.loss_scaler import LossScaler
from engine.optim.prefetch import StatePrefetch
from engine.optim.speculation import discard_kept
from engine.optim.step import init_state
from engine.optim.step_io import gather_all, plan_groups, run_sync
from engine.optim.step_progress import done_shards, progress_entry, progress_keys
from engine.optim.step_record import Applying, ShardState, StepRecord
from engine.optim.stored_state import delete_inactive
from engine.optim.training_state import TrainedParam, TrainingState
from engine.optim.types import OptimShard
from engine.paging.layout import grad_key, optim_keys
from engine.paging.shard_io import delete_keys
from engine.errors import StepRecordError
from tiered import TieredStore


class StepAfterBackward:
    """The step after backward of one ``engine.AdamW`` (see the module docstring)."""

    def __init__(self, state: TrainingState) -> None:
        self._state = state
        config = state.config
        # State updated in place is read by nobody: the step works on the store's memory directly.
        prefetch_groups = 0 if config.updates_in_place else config.optimizer_prefetch_groups
        self.prefetch = StatePrefetch(state.store, prefetch_groups, config.optimizer_group_bytes)
        #: A failed step's rollback could not rewrite the parameters (the store kept failing): the next step does.
        self.restore_pending = False
        self._hypers_at_first_grad: Optional[tuple] = None

    # ------------------------------------------------------------------ during backward

    def on_offload(self) -> None:
        """A gradient is final and goes to the store: note the hyperparameters of the step's first, and
        start reading the step's first groups of optimizer state (engine/optim/prefetch.py)."""
        state = self._state
        if self._hypers_at_first_grad is None:
            self._hypers_at_first_grad = tuple(state.optimizer.hyperparameters())
        if state.closed or self.prefetch.started or self.restore_pending:
            return
        self.prefetch.start(state.live_shards(), [state.has_state(p.name) for p in state.params])

    def forget_step(self) -> None:
        """The step runs (or ran) its updates inside backward: what was read ahead for a step after
        backward, and the hyperparameters of its first gradient, belong to no step."""
        self.prefetch.discard()
        self._hypers_at_first_grad = None

    def hyperparameters_changed(self) -> bool:
        """Whether the hyperparameters changed since this step's first gradient (then forgotten)."""
        before, self._hypers_at_first_grad = self._hypers_at_first_grad, None
        return before is not None and before != tuple(self._state.optimizer.hyperparameters())

    # ------------------------------------------------------------------ the step

    def run(self, started: float) -> bool:
        """One step from the stored gradients; returns whether its clip norm bound."""
        state = self._state
        if self.restore_pending:
            self.restore_params()
            self.restore_pending = False
        grad_scale = 1.0
        # The step clips with this norm and reports it; every rank takes part in the sum, so all of
        # them agree on skipping.
        stored_norm = state.grad_norm()
        if state.scaler is not None:
            if not bool(torch.isfinite(stored_norm)):
                state.last_grad_norm = float(stored_norm)
                self.skip()
                return False
            grad_scale = 1.0 / state.scaler.scale
        with_grad = [p for p in state.params if state.grads.has_grad(p.name)]
        if state.durable:
            return self.start_applying(with_grad, stored_norm, grad_scale, started)
        self._run_in_host_memory(with_grad, stored_norm, grad_scale, started)
        return False

    def start_applying(self, with_grad: Sequence[TrainedParam], stored_norm: torch.Tensor, grad_scale: float,
                       started: float, inside: tuple[str, ...] = ()) -> bool:
        """The step with the state on nvme: durable gradients, the ``applying`` record, then the groups
        ([Note: Rolling a step forward]). ``inside``: shards whose update already ran inside backward
        and stands ([Note: Speculative updates]); the step counts them and updates the others.
        Returns whether the clip norm bound."""
        state = self._state
        max_norm = state.clip_norm()
        # A power-of-two scale scales the norm exactly: this is the norm of the unscaled gradients.
        norm = stored_norm * grad_scale if grad_scale != 1.0 else stored_norm
        coef = clip_coefficient(norm, max_norm) if max_norm is not None else None
        state.store.sync.flush([grad_key(p.name) for p in with_grad])
        applying = Applying(
            state.record.step + 1, tuple(p.name for p in with_grad), tuple(state.optimizer.hyperparameters()),
            float(grad_scale), None if coef is None else float(coef), self.scaler_after(), inside,
        )
        delete_keys(state.store, progress_keys(state.store))  # leftovers of no step in flight
        state.commit(state.record.replace(applying=applying, in_backward=None))  # finished from here, never undone
        state.clip_to = None
        state.last_grad_norm = float(norm)
        self.finish_applying(first_attempt=True, started=started)
        return coef is not None and float(coef) < 1.0

    def finish_applying(self, *, first_attempt: bool, started: Optional[float] = None) -> None:
        """Update every shard of the record's ``applying`` step that no progress entry names, then
        commit the step (see [Note: Rolling a step forward])."""
        state = self._state
        applying = state.record.applying
        assert applying is not None
        started = time.perf_counter() if started is None else started
        stepping = set(applying.shards) | set(applying.inside)
        todo = self._left_to_apply(applying, first_attempt)
        if not first_attempt:
            self.prefetch.discard()  # read for a step that did not run as planned
        store = self.prefetch.take(state.store)
        try:
            stats = state.optimizer.run_step(
                store, [state.shard(p, max(state.record.shards[p.name].slot, 0)) for p in todo], config=state.config,
                on_event=state.on_event, grad_scale=applying.grad_scale, hypers=applying.hypers,
                clip_coef=applying.clip_tensor(), atomic=True,
                progress=lambda names: progress_entry(applying.step, names),
            )
        except BaseException as exc:
            store.close()
            exc.add_note(
                f"step {applying.step} stopped part way: some parameters and optimizer states hold its new values. "
                "eng.step() finishes it from the stored gradients (as does a resume, or the next forward); the "
                "gradients stay in the store until then"
            )
            raise
        store.close()
        state.commit(StepRecord(applying.step, {
            name: ShardState(s.steps + 1, max(s.slot, 0)) if name in stepping else s
            for name, s in state.record.shards.items()
        }, applying.loss_scale, state.record.master_in_param))  # the commit point
        state.set_shard_steps()
        state.restore_scaler(applying.loss_scale)
        if not first_attempt:  # a separate master's parameter may lag behind it: rewrite those
            self.restore_params([p for p in state.params if p.name in stepping])
        delete_keys(state.store, progress_keys(state.store))
        discard_kept(state.store, state.entries(list(applying.inside)))
        state.grads.mark_consumed()
        state.counters.add(stats, time.perf_counter() - started)

    def skip(self) -> None:
        """An inf or NaN gradient: no update. The gradients go (as DeepSpeed drops them: kept, they
        would overflow every later step too), the scale is lowered and the record commits it."""
        state = self._state
        assert state.scaler is not None
        before = state.scaler.state_dict()
        self.prefetch.discard()
        state.clip_to = None
        state.grads.zero(set_to_none=True)
        state.scaler.update(overflow=True)
        try:
            state.commit(state.record.replace(loss_scale=state.scaler_state()))
        except BaseException:
            state.restore_scaler(before)
            raise

    def restore_params(self, params: Optional[Sequence[TrainedParam]] = None) -> None:
        """Rewrite every trainable shard (of ``params``) that has state and a master of its own from
        that master, cast to the training dtype, one group at a time (a shard that is its own master
        needs nothing)."""
        state = self._state
        chosen = state.params if params is None else params
        shards = [state.live_shard(p.name) for p in chosen if state.has_state(p.name) and not state.one_copy(p)]
        if shards:
            run_sync(_restore(state.store, shards, state.config.param_tier, state.config.optimizer_group_bytes))

    # ------------------------------------------------------------------ internals

    def scaler_after(self) -> Optional[dict]:
        """The loss scaler's state once this step is applied (None without loss scaling)."""
        scaler = self._state.scaler
        if scaler is None:
            return None
        after = LossScaler(scaler.policy)
        after.load_state_dict(scaler.state_dict())
        after.update(overflow=False)
        return after.state_dict()

    def _left_to_apply(self, applying: Applying, first_attempt: bool) -> list[TrainedParam]:
        """The shards of ``applying`` no progress entry marks done; StepRecordError when one's gradient is gone."""
        state = self._state
        done = done_shards(state.store, applying.step) if not first_attempt else set()
        done |= set(applying.inside)
        todo = [p for p in state.params if p.name in applying.shards and p.name not in done]
        lost = [p.name for p in todo if grad_key(p.name) not in state.store]
        if lost:
            raise StepRecordError(
                f"step {applying.step} stopped part way and cannot be finished: the gradients of {lost[:3]} are not "
                "in the store. Resume from a checkpoint instead (wrap without resume, then eng.load_checkpoint(...))"
            )
        return todo

    def _run_in_host_memory(self, with_grad: list[TrainedParam], stored_norm: torch.Tensor, grad_scale: float,
                            started: float) -> None:
        """The step with the state in host memory: in place, or into the other slot (see the module
        docstring)."""
        state = self._state
        in_place = state.config.updates_in_place
        # Two slots: the first step's masters exist before the step can touch a parameter; in place:
        # state to lend to the step exists before it.
        self._init_new_state([p for p in with_grad if not state.has_state(p.name)])
        shards = [state.shard(p, max(state.record.shards[p.name].slot, 0), write_other=not in_place)
                  for p in state.params]
        scaler_before = state.scaler_state()
        store = self.prefetch.take(state.store)
        try:
            stats = state.optimizer.run_step(
                store, shards, config=state.config, all_reduce=state.all_reduce, on_event=state.on_event,
                grad_scale=grad_scale, grad_norm=stored_norm, clip_to=state.clip_to,
            )
        except BaseException as exc:
            store.close()
            if not in_place:
                self._rollback(exc)
            raise
        store.close()
        counts = state.optimizer.shard_steps
        previous = state.record
        updated = {p.name for p in with_grad}
        if state.scaler is not None:
            state.scaler.update(overflow=False)
        record = StepRecord(previous.step + 1, {
            name: ShardState(counts.get(name, 0), (max(s.slot, 0) if in_place else state.other(s.slot))
                             if name in updated else s.slot)
            for name, s in previous.shards.items()
        }, state.scaler_state(), previous.master_in_param)
        try:
            state.commit(record)  # the commit point
        except BaseException as exc:
            state.optimizer._set_shard_steps({n: s.steps for n, s in previous.shards.items()})
            state.restore_scaler(scaler_before)
            if not in_place:
                self._rollback(exc)
            raise
        state.grads.mark_consumed()
        state.clip_to = None
        state.last_grad_norm = float(stored_norm) * grad_scale  # a power of two: exactly the unscaled norm
        if not in_place:
            delete_keys(state.store, [k for name in updated for k in optim_keys(name, previous.shards[name].slot)])
        state.counters.add(stats, time.perf_counter() - started)

    def _init_new_state(self, params: list[TrainedParam]) -> None:
        """State for shards stepping for the first time, committed before the step can touch their
        parameters (so a failure in the step finds their pre-step values in the master)."""
        if not params:
            return
        state = self._state
        cfg = state.config
        # Slot-0 keys of a shard without state are leftovers of an init that failed half way (init_state
        # skips a shard whose exp_avg exists, so an exp_avg without the rest would stay so).
        delete_keys(state.store, [k for p in params for k in optim_keys(p.name, 0)])
        init_state(state.store, [state.shard(p, 0) for p in params], state_tier=cfg.optimizer_tier,
                   compress=cfg.compress_optimizer, group_bytes=cfg.optimizer_group_bytes)
        fresh = {p.name for p in params}
        state.commit(state.record.replace(shards={
            name: ShardState(s.steps, 0) if name in fresh else s for name, s in state.record.shards.items()
        }))

    def _rollback(self, error: BaseException) -> None:
        """After a failed step with two slots: parameters back to the live masters (the step's error is
        what the caller sees; if the store fails this too, the next step does it first, and ``error``
        says so)."""
        try:
            delete_inactive(self._state)  # the failed step's partial state writes: frees their space for the rewrite
            self.restore_params()
        except Exception as exc:  # noqa: BLE001 - the original error is re-raised by the caller
            self.restore_pending = True
            error.add_note(
                f"eng.step() could not restore the parameters of the last completed step either ({exc}); until the "
                "next eng.step() (which restores them first) or a resume, some parameters hold the failed step's values"
            )


async def _restore(store: TieredStore, shards: Sequence[OptimShard], tier: str, group_bytes: int) -> None:
    loop = asyncio.get_running_loop()
    for group in plan_groups(shards, group_bytes):
        masters = await gather_all(store.get(s.master_key) for s in group)
        params = await loop.run_in_executor(None, _cast, group, masters)
        await gather_all(store.put(s.param_key, p, tier) for s, p in zip(group, params))


def _cast(group: list[OptimShard], masters: list[torch.Tensor]) -> list[torch.Tensor]:
    return [m.view(-1) if s.train_dtype == torch.float32 else m.view(-1).to(s.train_dtype)
            for s, m in zip(group, masters)]
