"""Training: ``engine.AdamW`` bound to a wrapped model: gradient offload, the step, zero_grad, resume.

``engine.wrap(model, optimizer=engine.AdamW(...))`` binds the optimizer over ``model.parameters()``
and routes its ``step()`` here (so LR schedulers and step hooks see every step). A step runs one of
two ways: its updates inside backward, each the moment its gradient is final, validated and
committed (or rolled back, or redone) by ``eng.step()`` (engine/optim/inside_backward.py,
[Note: Speculative updates] in engine/optim/speculation.py); or after backward, from the gradients
backward stored (engine/optim/after_backward.py). ``EngineConfig.step_in_backward`` and what the
loop does choose (``StepModePolicy``). Both share a :class:`~engine.optim.training_state.TrainingState`;
the state the store keeps between steps is engine/optim/stored_state.py's.

An fp32 shard whose parameter lives in the optimizer's tier is its own master ([Note: One copy of
fp32 weights]). With ``EngineConfig.loss_scaling`` (``engine/optim/loss_scaler.py``), the step
multiplies every gradient by 1/scale before clipping and AdamW, and the record carries the scaler's
state.

For checkpoints (``engine/checkpoint/sharded.py``): :meth:`Training.live_shards` gives the store keys of the
current state; to install loaded state atomically, write each shard's master and moments to
:meth:`Training.staging_keys` (a one-copy shard's parameter too: :meth:`Training.param_staging_key`)
and call :meth:`Training.commit_staged`.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from engine.config import EngineConfig
from engine.optim import stored_state
from engine.optim.adamw import AdamW
from engine.optim.after_backward import StepAfterBackward
from engine.optim.clip import AllReduceSum
from engine.optim.grad_offload import GradOffload
from engine.optim.inside_backward import Outcome, UpdatesInsideBackward
from engine.optim.loss_scaler import LossScaler
from engine.optim.step import EventHook
from engine.optim.step_record import StepRecord
from engine.optim.training_state import TrainCounters, TrainedParam, TrainingState
from engine.optim.types import OptimShard
from engine.paging.handle import ParamHandle
from engine.paging.pager import Pager
from engine.paging.shard_io import ShardIO

__all__ = ["Training", "TrainCounters"]


# [Note: One copy of fp32 weights]
# When a shard trains in fp32 and its parameter lives in the optimizer's tier (``param_tier ==
# optimizer_tier``, with state on nvme or updated in place), the parameter entry ``param/<name>``
# is the fp32 master: there is no ``optim/<name>/master``, the step reads the master from the
# parameter and writes it once, with the moments. The record says so (``master_in_param``), so a
# resume under a config that lays the state out the other way moves it over first. Everything that
# reads masters (checkpoints, ``full_fp32_param``, ``save_weights(master_weights=True)``) reads
# ``OptimShard.master_key``, which is the parameter's key here. A checkpoint load cannot write the
# parameter in place (a crash half way would leave a mix of the old and loaded weights, with no
# master to rewrite them from): it stages the loaded master under ``optim/<name>/staged``, the
# record commits with the shard marked staged, and a rename (no I/O) makes it the parameter; a
# resume finishes the renames a crash interrupted.
#
# [Note: Rolling a step forward]
# With the state on nvme a step never writes a second copy of it. At the start of ``step()`` the
# gradient shards are made durable (``store.flush``: those in the host tier are written down and
# stay cached), and the record is rewritten with an ``applying`` section: the step it completes,
# the shards it updates (those with a gradient), each parameter group's hyperparameters, the
# gradient scale and the clip coefficient, and the loss scaler's state after it. Each group of the
# pipeline then writes its shards' new master (the parameter, in one-copy layout) and moments in
# place of the old ones with one ``put_many(atomic=True)``, together with a small progress entry
# (``engine/step/done/<first shard>``) listing the group's shards: a group is wholly new and marked
# done, or wholly old. The record of step t+1 commits last; then the progress entries go.
# A step that stops part way (a crash, an error) is finished, not undone: resuming, or calling
# ``eng.step()`` again, updates the shards no progress entry names from their stored gradients
# with the recorded values (so with the same bits), then commits. Until it is finished the
# parameters are a mix of the two steps, so a forward, ``zero_grad``, a checkpoint call and the
# ``full_*`` calls finish it first. With a separate master (bf16, fp16) the new parameter shard is
# written after its group's state commits, so a finished step rewrites its parameters from the
# masters. On nvme the state takes its size once during a step, plus one group in flight, plus
# the gradients.


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
        *,
        updates_buffer_bytes: int = 0,
        pool_bounds: Optional[tuple[int, int]] = None,
        on_gradients_dropped: Optional[Callable[[], None]] = None,
    ) -> None:
        """``updates_buffer_bytes``: the memory plan's bound on the buffers of the updates inside backward
        (``MemoryPlan.updates_buffer_bytes``; 0 keeps them to the settings' sizes); ``pool_bounds``: the
        store's pool bound in forward and backward of a step whose updates run inside backward and of
        one after it, where the plan bounds them apart (``MemoryPlan.after_backward_pool_bytes``);
        ``on_gradients_dropped``: called when a failed step drops its gradients and its batch must run
        again from the first micro-batch (the engine restarts its accumulation window)."""
        if optimizer.bound:
            raise ValueError("this engine.AdamW is already bound to a model; create one optimizer per engine.wrap")
        self._handles = list(by_id.values())
        params = list(model.parameters())  # model order, tied parameters once: the order clip_grad_norm_ sees
        handles = [by_id[id(p)] for p in params]
        groups = optimizer.group_of((h.name, p) for h, p in zip(handles, params))
        trained = [TrainedParam(h.name, h.layout.shard_numel, h.layout.dtype, h.key, groups[h.name])
                   for h in handles if h.trainable]
        for handle in handles:
            if handle.trainable:
                handle.mark_grads_in_store(config.max_grad_norm)
        durable = config.optimizer_tier == "nvme" and not config.updates_in_place
        grads = GradOffload(shard_io, config.grad_tier, inflight_bytes=config.optimizer_group_bytes,
                            on_offload=self._on_offload)
        self._state = TrainingState(
            store=shard_io.store, config=config, params=trained, optimizer=optimizer, pager=pager, io=shard_io,
            grads=grads, scaler=LossScaler(config.loss_scaling) if config.loss_scaling is not None else None,
            # fp32 shards are their own masters ([Note: One copy of fp32 weights])
            master_in_param=config.param_tier == config.optimizer_tier and (durable or config.updates_in_place),
            all_reduce=_all_reduce_sum(shard_io),
        )
        self._after = StepAfterBackward(self._state)
        self._inside = UpdatesInsideBackward(self._state, self._after, updates_buffer_bytes=updates_buffer_bytes,
                                             pool_bounds=pool_bounds, on_dropped=on_gradients_dropped)
        self._comm = shard_io.collectives if shard_io.world > 1 else None
        #: True while ``eng.backward`` runs a scaled backward (gradients of any other backward are refused).
        self.scaled_backward = False
        self._micro_batch: set[str] = set()  # shards with a final gradient since the last eng.step() call
        optimizer._bind(params, self._step, self._zero_grad, state_in_store=True)

    # ------------------------------------------------------------------ shared state, by its public names

    @property
    def grads(self) -> GradOffload:
        """The gradient shards in the store between backward and the step."""
        return self._state.grads

    @property
    def scaler(self) -> Optional[LossScaler]:
        """The running loss scale (None without ``EngineConfig.loss_scaling``)."""
        return self._state.scaler

    @property
    def record(self) -> StepRecord:
        """The last committed step record (engine/optim/step_record.py)."""
        return self._state.record

    @property
    def counters(self) -> TrainCounters:
        """Totals over the optimizer steps this engine ran."""
        return self._state.counters

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global gradient 2-norm of the last step (unscaled, before clipping); None before the first."""
        return self._state.last_grad_norm

    @property
    def on_event(self) -> Optional[EventHook]:
        """Tracing hook for tests (see ``TrainingState.on_event``)."""
        return self._state.on_event

    @on_event.setter
    def on_event(self, hook: Optional[EventHook]) -> None:
        self._state.on_event = hook

    @property
    def all_reduce(self) -> Optional[AllReduceSum]:
        """Sums a rank's sum of squared gradients over ranks for clipping (multi-rank training)."""
        return self._state.all_reduce

    @all_reduce.setter
    def all_reduce(self, fn: Optional[AllReduceSum]) -> None:
        self._state.all_reduce = fn

    # ------------------------------------------------------------------ lifecycle

    def start(self, resume: bool) -> None:
        """Fresh: commit an empty record (step 0). Resume: take up the store's record, finish a step it
        was applying ([Note: Rolling a step forward]) and a load it was installing, and drop the
        gradients and anything the record does not name."""
        state = self._state
        if not resume:
            state.commit(state.record)
            return
        stored_state.adopt_record(state, stored_state.read_record(state, self._comm))
        if state.record.applying is not None:
            self._after.finish_applying(first_attempt=False)
        stored_state.install_staged(state)
        self._after.restore_params()
        stored_state.migrate_layout(state)
        state.grads.discard_stored()
        stored_state.delete_inactive(state)

    def close(self) -> None:
        """Wait for gradient puts still in flight (errors are dropped: the engine is closing); later
        steps raise and zero_grad does nothing more than torch's. Updates inside backward that no
        ``eng.step()`` took are rolled back (as the gradients of a step never taken are lost); a step
        after backward left part way is finished by the next resume."""
        self._inside.close()
        self._state.closed = True
        try:
            self.grads.flush()
        except RuntimeError:
            pass
        finally:
            self._after.prefetch.discard()

    # ------------------------------------------------------------------ queries

    @property
    def completed_steps(self) -> int:
        """Optimizer steps completed on this store (a resumed run counts the earlier ones)."""
        return self._state.record.step

    def live_shards(self) -> list[OptimShard]:
        """Every trainable shard with the store keys of its current state (a shard that never took
        a step has none yet: its slot-0 moments are absent from the store)."""
        return self._state.live_shards()

    def live_shard(self, name: str) -> OptimShard:
        """:meth:`live_shards`' entry for the trainable shard ``name`` alone."""
        return self._state.live_shard(name)

    def has_state(self, name: str) -> bool:
        """True when the trainable shard ``name`` has taken a step (it has moments, and a master)."""
        return self._state.has_state(name)

    def master_is_param(self, name: str) -> bool:
        """True when the trainable shard ``name`` is its own fp32 master ([Note: One copy of fp32 weights])."""
        return self._state.one_copy(self._state.by_name[name])

    @property
    def step_in_backward(self) -> bool:
        """True when updates inside backward may run in this engine (``EngineConfig.step_in_backward``
        True, or None where the configuration allows them)."""
        return self._inside.possible

    @property
    def step_mode(self) -> str:
        """Which way the next step runs, and why (one line, for logs and ``tiered train``)."""
        self._inside.policy.decide()
        return self._inside.policy.reason

    # ------------------------------------------------------------------ loads and written parameters

    def staging_keys(self, name: str) -> tuple[str, str, str]:
        """Where to write loaded master, exp_avg, exp_avg_sq of ``name`` before :meth:`commit_staged`."""
        return stored_state.staging_keys(self._state, name)

    def param_staging_key(self, name: str) -> Optional[str]:
        """Where a load writes the trainable parameter ``name`` for :meth:`commit_staged` to install it,
        or None when it is written in place (its master, staged apart, can rewrite it). A staged
        parameter is its fp32 master: write the loaded master there when there is one."""
        return self.staging_keys(name)[0] if self.master_is_param(name) else None

    def commit_staged(self, step: int, shard_steps: Mapping[str, int]) -> None:
        """Install state written to :meth:`staging_keys`: a shard whose staged moments are in the store
        takes ``shard_steps[name]``; the others have no state (and must have 0 steps). Commits the
        record at ``step``, rewrites the trainable parameters from their masters (a staged one-copy
        parameter is renamed into place), drops the old state and every gradient shard."""
        state = self._state
        self.complete_pending("discard")
        self._after.prefetch.discard()  # it read the state this replaces
        state.grads.discard_stored()
        state.pager.drop_prefetched()
        stored_state.commit_staged(state, step, shard_steps)
        if state.on_event is not None:
            state.on_event("staged", -1)
        stored_state.install_staged(state)
        self._after.restore_params()
        stored_state.delete_inactive(state)  # the replaced state, and anything staged for a shard left without state

    def masters_follow_params(self, names: Iterable[str]) -> None:
        """The parameters ``names`` were written from outside a step: their fp32 masters follow the
        values that changed ([Note: Masters of written parameters] in engine/optim/stored_state.py)."""
        stored_state.masters_follow_params(self._state, names)

    def complete_pending(self, intent: str = "read") -> None:
        """Bring the store to one step's state before a call between steps: deal with updates inside
        backward waiting for ``eng.step()`` ([Note: Speculative updates]) as ``intent`` needs, and
        finish a step after backward that stopped part way ([Note: Rolling a step forward]). "read"
        (a forward, a save, a ``full_*`` read) sets the updates aside so the call sees the last
        committed step; "write" (a ``set_full_*``, ``load_state_dict``) rolls them back so that
        ``eng.step()`` redoes them from the stored gradients, or raises RuntimeError (changing nothing)
        where no gradient was kept; "discard" (``zero_grad``, a checkpoint load) rolls them back and
        drops the step."""
        if self._state.closed:
            return
        self._inside.before_call(intent)
        if self._state.record.applying is not None:
            self._state.pager.drop_prefetched()
            self._after.finish_applying(first_attempt=False)

    def gradients_readable(self, what: str) -> None:
        """Before ``full_grad`` / ``set_full_grad`` (``what``): RuntimeError when updates inside backward
        used the step's gradients without keeping them; else notes that this loop reads gradients
        between backward and step, so later steps keep them."""
        self._inside.gradients_readable(what)

    # ------------------------------------------------------------------ hooks

    def on_forward(self, inputs: tuple) -> None:
        """The wrapped model's forward starts (outside backward) with ``inputs``, its ``(args, kwargs)``."""
        if self._inside.failed:
            self._inside.drop_failed_step()
        self.complete_pending("read")
        if torch.is_grad_enabled():
            self._inside.decide()

    def end_micro_batch(self) -> None:
        """An ``eng.step()`` call ended a micro-batch: the next backward's gradients are another's."""
        self._micro_batch.clear()

    def on_final_grad(self, handle: ParamHandle, boundary: bool) -> None:
        """``handle``'s gradient is final for this backward (``boundary``: the accumulation window's last):
        its update runs now, inside backward, or its shard goes to the store for the step."""
        if handle.param.grad is None:
            return
        if handle.name in self._micro_batch:
            self._inside.policy.second_backward()  # the loop adds up backwards by itself
        self._micro_batch.add(handle.name)
        self._inside.used_up = False
        if boundary and self._inside.decide():
            self._check_backward()
            if self._inside.update(handle):
                return
        elif boundary:
            self._inside.saw_final(handle.name)
        self.grads.offload(handle)  # to the store as an fp32 shard; param.grad = None

    # ------------------------------------------------------------------ norms and clipping

    def pending_grad_norm(self) -> float:
        """The 2-norm of the gradients the next step will use, unscaled (non-finite when loss scaling
        will skip it); the step reports the same value. Collective at world size > 1."""
        scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        return float(self._state.grad_norm(self._inside.norms())) * scale

    def clip_next_step(self, max_norm: float) -> float:
        """Have the next step clip the gradients it will use to the 2-norm ``max_norm`` (math.inf:
        no clipping), as ``clip_grad_norm_`` right before a plain model's step; returns
        :meth:`pending_grad_norm`. Asked twice, the step clips to the smaller norm, as two clips in
        a row would. A backward adding gradients before that step is refused, since the clipping
        would then cover gradients that did not exist when it was asked for. Updates that ran inside
        backward are validated against it by the step ([Note: Speculative updates])."""
        self._inside.policy.keep_grads()
        norm = self.pending_grad_norm()
        if not math.isinf(max_norm):
            state = self._state
            state.clip_to = float(max_norm) if state.clip_to is None else min(state.clip_to, float(max_norm))
        return norm

    # ------------------------------------------------------------------ the step (AdamW.step -> here)

    def _step(self) -> None:
        started = time.perf_counter()
        self._check_stepping()
        state = self._state
        self._micro_batch.clear()
        try:
            if state.record.applying is not None:  # the step that failed part way: this call finishes it
                self._after.finish_applying(first_attempt=False, started=started)
                return
            if self._inside.pending is not None and self._inside.commit(started) is not Outcome.REDO:
                return
            self._inside.check_gradients_left()
            if self._after.hyperparameters_changed():
                self._inside.policy.keep_grads()
            bound = self._after.run(started)
            self._inside.policy.after_step(bound=bound)
        finally:
            self._inside.step_ended()  # the next step decides its way afresh

    def _check_stepping(self) -> None:
        """RuntimeError when the engine is closed or the model is running; drops what was prefetched."""
        if self._state.closed:
            raise RuntimeError(
                "the engine this engine.AdamW is bound to was closed or unwrapped; wrap the model again with a new "
                "engine.AdamW (EngineConfig(resume=True) continues from the store)"
            )
        pager = self._state.pager
        with pager.lock:
            busy = [h.name for h in self._handles if h.held]
            if busy:
                raise RuntimeError(
                    f"eng.step() was called while the model is running (parameters in use: {busy[:3]}); step after "
                    "backward() has returned"
                )
            pager.drop_prefetched()

    def _zero_grad(self, set_to_none: bool) -> None:
        state = self._state
        state.clip_to = None
        self._inside.used_up = False
        self._after.hyperparameters_changed()  # forgets the step's first hyperparameters
        self._micro_batch.clear()
        if not state.closed:
            self.complete_pending("discard")  # a step after backward stopped part way still needs its gradients
            self._inside.step_ended()
            state.grads.zero(set_to_none)

    def _on_offload(self) -> None:
        """A gradient is final and goes to the store for a step after backward (called from backward)."""
        self._check_backward()
        self._after.on_offload()

    def _check_backward(self) -> None:
        """RuntimeError when a gradient may not become final now (called from backward)."""
        state = self._state
        if state.scaler is not None and not self.scaled_backward:
            raise RuntimeError(
                "EngineConfig.loss_scaling is set, so the loss must be scaled before backward: call "
                "eng.backward(loss) instead of loss.backward(), or, where other code calls backward, pass it "
                "eng.with_loss_scale(loss) (unscaled fp16 gradients underflow, and the step would divide them "
                "by the scale)"
            )
        if state.clip_to is not None:
            raise RuntimeError(
                f"a backward added gradients after eng.clip_grad_norm_({state.clip_to}) and before the step it clips: "
                "call it once the accumulation window's last backward has returned, right before the optimizer "
                "step (under accelerate: `if accelerator.sync_gradients: eng.clip_grad_norm_(...)`)"
            )
        if state.record.applying is not None:
            raise RuntimeError(
                f"step {state.record.applying.step} stopped part way and a backward started before it was finished: "
                "call eng.step() to finish it first (its gradients are the ones in the store)"
            )


def _all_reduce_sum(shard_io: ShardIO) -> Optional[AllReduceSum]:
    """The sum over ranks of a 0-dim tensor, through the engine's collectives (None on one rank)."""
    comm = getattr(shard_io, "collectives", None)
    if comm is None:
        return None

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        comm.run(comm.all_reduce_sum, tensor)
        return tensor

    return all_reduce
