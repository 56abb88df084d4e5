"""UpdatesInsideBackward: which steps run their updates inside backward, and the step under way:
its updates, then its commit, rollback, redo or setting aside ([Note: Speculative updates] in
engine/optim/speculation.py; the worker that runs the updates is engine/optim/backward_step.py).
"""

from __future__ import annotations

import enum
import time
from typing import Callable, Optional

import torch

from engine.config.engine_config import updates_in_backward_ruled_out
from engine.optim.after_backward import StepAfterBackward
from engine.optim.backward_step import BackwardUpdates
from engine.optim.clip import clip_coefficient, shard_norms
from engine.optim.grad_offload import exact_dtype
from engine.optim.speculation import StepInBackward, StepModePolicy, discard_kept, put_back, roll_back, set_aside
from engine.optim.step_record import InBackward, ShardState, StepRecord
from engine.optim.training_state import TrainedParam, TrainingState
from engine.optim.types import OptimStepStats
from engine.paging.handle import HandleState, ParamHandle
from engine.paging.layout import grad_key


class Outcome(enum.Enum):
    """How ``eng.step()`` ended a step whose updates ran inside backward."""

    COMMITTED = "committed"  # the updates stood (a shard that waited was updated after backward)
    SKIPPED = "skipped"  # an overflow: rolled back, the loss scale lowered
    REDO = "redo"  # rolled back: the step runs after backward from the kept gradients


class UpdatesInsideBackward:
    """The engine's side of the updates inside backward of one ``engine.AdamW``."""

    def __init__(self, state: TrainingState, after: StepAfterBackward, *, updates_buffer_bytes: int = 0,
                 pool_bounds: Optional[tuple[int, int]] = None,
                 on_dropped: Optional[Callable[[], None]] = None) -> None:
        """``updates_buffer_bytes``: the memory plan's bound on the worker's buffers
        (``MemoryPlan.updates_buffer_bytes``; 0 keeps them to the settings' sizes); ``pool_bounds``: the
        store's pool bound in forward and backward of a step inside backward and of one after it, where
        the plan bounds them apart (each step sets its own when its way is decided); ``on_dropped``: called
        when a failed step's gradients are dropped (its batch runs again from the first micro-batch)."""
        self._state = state
        self._on_dropped = on_dropped
        self._after = after
        self._pool_bounds = pool_bounds
        config = state.config
        #: Which way each step runs.
        self.policy = StepModePolicy(config.step_in_backward, updates_in_backward_ruled_out(config),
                                     clipping=config.max_grad_norm is not None)
        self._worker: Optional[BackwardUpdates] = None
        if self.policy.inside:
            group = config.optimizer_group_bytes
            self._worker = BackwardUpdates(
                state.store, compress=config.compress_optimizer, batch_bytes=group, inflight_bytes=2 * group,
                window_bytes=2 * group * max(1, config.optimizer_prefetch_groups), keep=config.cache_tier,
                hold_bytes=updates_buffer_bytes, kernel=state.optimizer.adamw_kernel(),
            )
            if any(p.dtype != torch.float32 for p in state.params):
                state.pager.master_source = self._master_for_backward
        #: The step whose updates run inside backward (None: none under way).
        self._step: Optional[StepInBackward] = None
        #: Whether the step under way runs inside backward (None: not decided yet).
        self.this_step: Optional[bool] = None
        #: An update failed: the step must be run again (the next forward rolls it back).
        self.failed = False
        #: The last step's updates ran inside backward and kept no gradient, and no gradient came since.
        self.used_up = False
        self._ahead_order: list[str] = []  # the order the last such step took its gradients in
        self._final_order: list[str] = []  # the order a step after backward's gradients became final in

    # ------------------------------------------------------------------ queries

    @property
    def possible(self) -> bool:
        """Whether any step of this run may take its updates inside backward."""
        return self._worker is not None

    @property
    def pending(self) -> Optional[StepInBackward]:
        """The step under way inside backward, or None."""
        return self._step

    def norms(self) -> dict[str, torch.Tensor]:
        """The final gradients' norms of the step under way (empty without one)."""
        return self._step.norms() if self._step is not None else {}

    # ------------------------------------------------------------------ deciding

    def decide(self) -> bool:
        """Whether the step under way runs inside backward, decided once per step (at its first
        training forward or final gradient): before backward's first fetch, which then reads masters."""
        if self.this_step is None and not self.failed:
            self.this_step = self.possible and self.policy.decide()
            if self._pool_bounds is not None:  # [Note: Updates inside backward, in memory]
                self._state.store.resize_result_pool(self._pool_bounds[0 if self.this_step else 1])
            # After a binding step the next one may bind at its first gradient too: state read ahead
            # would then be read for nothing (the step after backward reads it again).
            if self.this_step and self._ahead_order and not self.policy.last_bound:
                assert self._worker is not None
                # Read now, not when the last step committed: anything between the steps (a step after
                # backward, a load, a set_full_*) may have changed the state.
                self._worker.read_ahead(self._state.live_shards(self._ahead_order), self._state.has_state)
        return bool(self.this_step)

    def step_ended(self) -> None:
        """``eng.step()`` (or ``zero_grad``) ended the step: the next one decides afresh."""
        if self._final_order and not self.this_step:
            self._ahead_order = self._final_order
        self._final_order = []
        self.this_step = None

    def saw_final(self, name: str) -> None:
        """``name``'s gradient became final in a step that runs after backward: a step inside backward
        next reads ahead along the order they came in, as it would after one of its own kind."""
        if self.possible:
            self._final_order.append(name)

    # ------------------------------------------------------------------ in backward

    def update(self, handle: ParamHandle) -> bool:
        """``handle``'s gradient is final for the step: hand its update to the worker, or keep its
        gradient for the step when the update must wait ([Note: Updates inside backward]). Returns
        False, changing nothing, when the gradient cannot be taken here (a second backward into the
        step, whose updates the engine redoes after backward: the caller stores it)."""
        assert self._worker is not None
        state = self._state
        inside = self._step if self._step is not None else self._begin()
        name = handle.name
        if inside.seen(name) or inside.set_aside:
            self._second_backward(name)
            return False
        master = handle.take_master_copy()  # read by backward's fetch, or None
        shard, accumulated = self._final_shard(handle)
        norm = shard_norms([shard])[0]
        run_now = inside.admit(name, norm)
        if inside.keeps_grads or not run_now:  # a waiting update (or an overflow the step checks) needs it
            state.grads.keep(name, shard, exact_dtype(handle, accumulated, state.io.world), norm)
        if not run_now:
            return True
        p = state.by_name[name]
        if master is None and handle.state is HandleState.READY and state.one_copy(p):
            master = state.store.host_buffer(handle.layout.shard_numel * 4).view(torch.float32)
            state.io.local_shard(handle, out=master)  # backward's copy of the parameter is the master
        self._worker.on_event = state.on_event
        try:
            self._worker.submit(state.shard(p, max(state.record.shards[name].slot, 0)), shard, master,
                                state.record.shards[name].steps, inside.hypers, grad_scale=inside.grad_scale,
                                grad_shared=inside.keeps_grads)
        except BaseException as exc:
            self.failed = True
            exc.add_note(f"step {inside.step} was not applied: run its batch again (forward and backward; the "
                         "forward puts the last completed step's parameters back), then eng.step()")
            raise
        return True

    # ------------------------------------------------------------------ between backward and step

    def before_call(self, intent: str) -> None:
        """A call between backward and step ("read", "write" or "discard": see
        ``Training.complete_pending``) finds the step's updates waiting."""
        inside = self._step
        if inside is None or self.failed:
            return
        if intent == "read":
            if not inside.set_aside:
                self._wait()
                set_aside(self._state.store, self._state.entries(list(inside.updated)))
                inside.set_aside = True
                self._state.pager.drop_prefetched()
                if self._state.on_event is not None:
                    self._state.on_event("set aside", 0)
        elif intent == "discard":
            self.roll_back()
        elif intent == "write":
            if inside.updated and not inside.keeps_grads:
                raise RuntimeError(
                    f"step {inside.step}'s updates ran inside backward without keeping their gradients, so they "
                    "cannot be redone once this changes the state: call it after eng.step(), or before backward "
                    "(EngineConfig.step_in_backward=False runs every step after backward)"
                )
            self.policy.keep_grads()
            self._redo()
        else:
            raise ValueError(f"complete_pending: intent must be 'read', 'write' or 'discard', got {intent!r}")

    def gradients_readable(self, what: str) -> None:
        """Before ``full_grad`` / ``set_full_grad`` (``what``): RuntimeError when updates inside backward
        used the gradients without keeping them; later steps keep them either way."""
        inside = self._step
        self.policy.keep_grads()
        if (inside is not None and inside.updated and not inside.keeps_grads) or self.used_up:
            step = inside.step if inside is not None else self._state.record.step
            raise RuntimeError(
                f"cannot {what}: step {step}'s updates ran inside backward and kept no gradient (none is needed "
                "unless something reads them); later steps keep them now. Call it after a backward and before "
                "its step's updates run, or set EngineConfig.step_in_backward=False"
            )

    def check_gradients_left(self) -> None:
        """Before a step after backward: RuntimeError when the last step used up its gradients inside
        backward and no backward came since (torch would apply the same gradients again)."""
        if self.used_up:
            self.policy.keep_grads()
            raise RuntimeError(
                f"eng.step() again with no backward since step {self._state.record.step}, whose updates ran inside "
                "backward and kept no gradient: a torch optimizer would apply the same gradients again, which "
                "are gone. Call eng.zero_grad() (a step then changes nothing, as in torch) or run a backward "
                "first; later steps keep their gradients for this"
            )

    # ------------------------------------------------------------------ the step

    def commit(self, started: float) -> Outcome:
        """``eng.step()`` after updates inside backward: wait for them, validate them against the global
        norm, an overflow and the hyperparameters, and commit, skip or leave them to be redone."""
        inside = self._step
        assert inside is not None
        state = self._state
        self._raise_if_failed(inside)
        self._wait()
        if inside.set_aside:
            put_back(state.store, state.entries(list(inside.updated)))
            inside.set_aside = False
            state.pager.drop_prefetched()
        self._note_gradients_of_earlier_micro_batches(inside)
        stored_norm = state.grad_norm(inside.norms())
        if state.scaler is not None and not bool(torch.isfinite(stored_norm)):
            state.last_grad_norm = float(stored_norm)
            self.roll_back()
            self._after.skip()
            return Outcome.SKIPPED
        binds = inside.binds or self._binds(stored_norm * inside.grad_scale if inside.grad_scale != 1.0 else stored_norm)
        changed = tuple(state.optimizer.hyperparameters()) != inside.hypers
        # Every rank takes the same branch: binds and changed are global, and so is the share updated.
        updated_share = self._updated_share(inside) if binds or changed else 0.0
        if updated_share > 0:
            self._refuse_without_kept_gradients(inside, binds)
            self._redo()
            if binds:
                self.policy.redone_for_clipping(updated_share)
            return Outcome.REDO
        waiting = [p for p in state.params if p.name in inside.waiting]
        bound = False
        if waiting:  # updates stopped by the running norm (or the gradients of earlier micro-batches alone)
            bound = self._apply_waiting(inside, waiting, stored_norm, started)
        else:
            self._commit_record(inside)
        state.last_grad_norm = float(stored_norm) * inside.grad_scale  # a power of two: exactly unscaled
        self.policy.after_step(bound=bound)
        state.counters.steps_inside += bool(inside.updated)
        self.used_up = not inside.keeps_grads
        self._count(inside, started, alone=not waiting)
        return Outcome.COMMITTED

    def roll_back(self) -> None:
        """Undo the updates inside backward of the step under way (or an update that failed): the store
        holds the last committed step again, and the record says no step is under way."""
        state = self._state
        if self._worker is not None:
            try:
                self._worker.wait()
            except RuntimeError:
                pass  # the failure that brought us here
            self._worker.take_counters()
        roll_back(state.store, state.entries(), state.fresh())
        state.pager.drop_prefetched()
        self._step = None
        self.this_step = None
        self.failed = False
        if state.record.in_backward is not None:
            state.commit(state.record.replace(in_backward=None))

    def drop_failed_step(self) -> None:
        """After an update (or the start of the step) failed: roll the step back and drop its gradients,
        every micro-batch's, so that running its batch again does not count them twice."""
        self.roll_back()
        self._drop_gradients()

    def _drop_gradients(self) -> None:
        self._state.clip_to = None
        self._state.grads.zero(set_to_none=True)
        if self._on_dropped is not None:
            self._on_dropped()

    def close(self) -> None:
        """Roll back a step no ``eng.step()`` took (its gradients are lost, as in torch), stop the worker."""
        try:
            if self._step is not None or self.failed:
                self.roll_back()
        except Exception:  # noqa: BLE001 - the engine is closing: the next resume rolls it back instead
            pass
        if self._worker is not None:
            self._worker.close()
        self._step = None

    # ------------------------------------------------------------------ internals

    def _begin(self) -> StepInBackward:
        """The step's first final gradient, with its updates inside backward: record that a step is under
        way (a crash from here on is rolled back at resume, [Note: Speculative updates])."""
        state = self._state
        state.grads.drop_consumed()  # the last step's, which no update inside backward would delete
        self._after.forget_step()  # state read ahead in earlier micro-batches: the updates are about to change it
        state.commit(state.record.replace(in_backward=InBackward(state.record.step + 1)))
        scale = 1.0 / state.scaler.scale if state.scaler is not None else 1.0
        self._step = StepInBackward(
            step=state.record.step + 1, keeps_grads=self.policy.keeps_grads, max_norm=state.clip_norm(),
            grad_scale=scale, hypers=tuple(state.optimizer.hyperparameters()), scaled=state.scaler is not None,
        )
        return self._step

    def _final_shard(self, handle: ParamHandle) -> tuple[torch.Tensor, bool]:
        """``handle``'s final fp32 gradient shard (``param.grad`` is None afterwards), with the sum of the
        window's earlier micro-batches added; and whether anything was added."""
        state = self._state
        grad = handle.param.grad
        shard = state.io.grad_shard(handle, grad).to("cpu")
        handle.param.grad = None
        del grad
        if state.grads.current(handle.name):  # the window's earlier micro-batches: their sum is in the store
            return state.store.sync.get(grad_key(handle.name)).float().add_(shard), True
        return shard, False

    def _master_for_backward(self, handle: ParamHandle) -> Optional[str]:
        """The store key of ``handle``'s fp32 master for backward's last fetch of it to read, when this
        step's updates run inside backward and it has a master of its own ([Note: Masters read in
        backward] in engine/paging/pager.py); else None."""
        state = self._state
        p = state.by_name.get(handle.name)
        if not self.this_step or p is None or state.one_copy(p) or not state.has_state(p.name):
            return None
        inside = self._step
        if inside is not None and (inside.set_aside or inside.binds or inside.overflow):
            return None  # its update will wait for the step
        return state.live_shard(p.name).master_key

    def _second_backward(self, name: str) -> None:
        """A gradient reached ``name`` again before ``eng.step()``: the loop adds backwards up by itself.
        Redo the step after backward when the gradients were kept; else refuse (the updates used only
        the first)."""
        self.policy.second_backward()
        inside = self._step
        assert inside is not None
        if inside.keeps_grads:
            self._redo()
            return
        raise RuntimeError(
            f"a second backward reached {name!r} before eng.step(), but step {inside.step}'s updates already ran "
            "inside backward with the first backward's gradients alone: call eng.step() after each backward, or "
            "set EngineConfig.gradient_accumulation_steps and call eng.backward / eng.step per micro-batch (later "
            "steps of this run go after backward)"
        )

    def _redo(self) -> None:
        """Roll the updates inside backward back and leave the step to run after backward from the stored
        gradients (every final gradient was kept)."""
        inside = self._step
        assert inside is not None
        self._wait()
        self.roll_back()
        self.this_step = False  # the rest of this step's gradients go to the store
        if inside.updated:
            self._state.counters.steps_redone += 1

    def _wait(self) -> None:
        """Wait for the worker; on a failed update, mark the step failed and raise."""
        assert self._worker is not None
        try:
            self._worker.wait()
        except BaseException as exc:
            self.failed = True
            exc.add_note(f"step {self._state.record.step + 1} was not applied; the next forward puts the last "
                         "completed step's parameters back: run that step's batch again (forward and backward), "
                         "then eng.step()")
            raise

    def _raise_if_failed(self, inside: StepInBackward) -> None:
        if self.failed:
            self.drop_failed_step()
            raise RuntimeError(
                f"an optimizer update inside backward of step {inside.step} failed, so the step was not applied: "
                "the parameters are back at the last completed step. Run that step's batch again (forward and "
                "backward), then eng.step()"
            )

    def _note_gradients_of_earlier_micro_batches(self, inside: StepInBackward) -> None:
        """A shard whose gradient came from an earlier micro-batch alone waits for the step."""
        state = self._state
        for p in state.params:
            if not inside.seen(p.name) and state.grads.current(p.name):
                inside.waiting[p.name] = state.grads.norms[p.name]

    def _updated_share(self, inside: StepInBackward) -> float:
        """The share of the model's trainable elements that updates inside backward changed, over
        every rank (collectives at world size > 1)."""
        state = self._state
        counts = torch.tensor([float(sum(state.by_name[name].numel for name in inside.updated)),
                               float(sum(p.numel for p in state.params))], dtype=torch.float64)
        if state.all_reduce is not None:
            counts = state.all_reduce(counts)
        return float(counts[0]) / max(float(counts[1]), 1.0)

    def _binds(self, norm: torch.Tensor) -> bool:
        """Whether the clip coefficient at ``norm`` (the unscaled global norm) is below 1, or NaN (a
        non-finite norm: torch's clip_grad_norm_ multiplies every gradient by NaN)."""
        max_norm = self._state.clip_norm()
        return max_norm is not None and not float(clip_coefficient(norm, max_norm)) >= 1.0

    def _refuse_without_kept_gradients(self, inside: StepInBackward, binds: bool) -> None:
        """Roll back and raise when the step must be redone but no gradient was kept."""
        if inside.keeps_grads:
            return
        self.roll_back()
        self.policy.keep_grads()
        self._drop_gradients()
        raise RuntimeError(
            f"step {inside.step} was not applied: its updates ran inside backward before "
            + ("clip_grad_norm_ asked for clipping that binds" if binds else
               "the hyperparameters changed (an LR scheduler stepped before the optimizer?)")
            + ", and no gradient was kept to redo them. The parameters are back at the last completed step; run "
            "that step's batch again (forward and backward), then eng.step(). Later steps keep the gradients a "
            "redo needs"
        )

    def _apply_waiting(self, inside: StepInBackward, waiting: list[TrainedParam], stored_norm: torch.Tensor,
                       started: float) -> bool:
        """Run the step after backward for the shards whose updates waited, counting the updates inside
        backward as part of it; returns whether its clip norm bound. Once its ``applying`` record is
        committed the step is finished from it, never undone; a failure before that leaves the updates
        inside backward to be rolled back (the batch is run again)."""
        state = self._state
        try:
            bound = self._after.start_applying(waiting, stored_norm, inside.grad_scale, started,
                                               tuple(inside.updated))
        except BaseException as exc:
            if state.record.applying is not None:
                self._step = None  # the next eng.step() (or forward, or resume) finishes it from its record
                raise
            exc.add_note(f"step {inside.step} was not applied: the parameters are back at the last completed step; "
                         "run that step's batch again (forward and backward), then eng.step()")
            try:
                self.drop_failed_step()
            except Exception:  # noqa: BLE001 - the store fails still: the next forward rolls it back
                self.failed = True
            raise
        self._step = None
        return bound

    def _commit_record(self, inside: StepInBackward) -> None:
        """Commit the step whose every update ran inside backward, then drop the values kept aside."""
        state = self._state
        record = StepRecord(state.record.step + 1, {
            n: ShardState(s.steps + 1, max(s.slot, 0)) if n in inside.updated else s
            for n, s in state.record.shards.items()
        }, self._after.scaler_after(), state.record.master_in_param)
        state.commit(record)  # the commit point
        state.restore_scaler(record.loss_scale)
        self._step = None
        self._after.forget_step()
        state.clip_to = None
        state.set_shard_steps()
        discard_kept(state.store, state.entries(list(inside.updated)))
        state.grads.mark_consumed()

    def _count(self, inside: StepInBackward, started: float, *, alone: bool) -> None:
        """Remember the order the step took its gradients in (the next such step reads ahead along it),
        and count the step (``alone``: no step after backward counted it already)."""
        assert self._worker is not None
        state = self._state
        self._ahead_order = list(inside.norms())
        c = self._worker.take_counters()
        if not alone:
            return
        seconds = time.perf_counter() - (c.first_update if c.first_update is not None else started)
        state.counters.add(OptimStepStats(
            seconds=seconds, bytes_read=c.bytes_read, bytes_written=c.bytes_written, io_stall_seconds=c.stall_seconds,
            update_seconds=c.update_seconds, groups=c.batches, shards_updated=len(inside.updated),
            shards_skipped=len(state.params) - len(inside.updated), grad_norm=state.last_grad_norm, clip_coef=None,
            step_counts=state.optimizer.shard_steps,
        ), time.perf_counter() - started)
