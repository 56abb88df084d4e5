"""Training: ``engine.AdamW`` bound to a wrapped model: gradient offload, the step, zero_grad, resume.

``engine.wrap(model, optimizer=engine.AdamW(...))`` binds the optimizer over ``model.parameters()``
and routes its ``step()`` here (so LR schedulers and step hooks see every step). After waiting for
the gradient puts still in flight (``GradOffload``) and, with loss scaling, checking the stored
gradients' norm for an overflow (skip: gradients and prefetched state dropped, the scale lowered,
the record rewritten with the scaler's new state), the step depends on where the state lives:

- **nvme** (``optimizer_tier="nvme"``, crash-safe): every gradient shard is made durable, the step
  record is rewritten with the step's :class:`~engine.optim.step_record.Applying` section, and each
  group's new state is written once, in place of the old, with one atomic store call that also
  marks the group done; the record then commits the step ([Note: Rolling a step forward]).
- **host, in place** (``EngineConfig.updates_in_place``): AdamW runs on the store's own memory
  (``store.modify``); a step that raises keeps the groups it updated, as a torch optimizer would.
- **host, not in place**: the new state goes to the other of two key sets (slots) and the record
  names the new slots; a step that raises leaves the previous one whole, its partial writes
  deleted and the parameters rewritten from the masters.

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

import asyncio
import dataclasses
import math
import time
from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from engine.config import EngineConfig
from engine.config.engine_config import updates_in_backward_ruled_out
from engine.errors import StepRecordError
from engine.optim.adamw import AdamW
from engine.optim.backward_step import BackwardUpdates
from engine.optim.clip import AllReduceSum, clip_coefficient, shard_norms, total_norm
from engine.optim.grad_offload import GradOffload, exact_dtype
from engine.optim.loss_scaler import LossScaler
from engine.optim.prefetch import StatePrefetch
from engine.optim.step import EventHook, init_state
from engine.optim.step_io import gather_all, plan_groups, run_sync
from engine.optim.step_progress import PROGRESS_KEY_PREFIX, done_shards, progress_entry, progress_keys
from engine.optim.speculation import (
    StepInBackward,
    StepModePolicy,
    discard_kept,
    entries_named,
    entries_of,
    put_back,
    roll_back,
    set_aside,
)
from engine.optim.step_record import NO_STATE, STEP_RECORD_KEY, Applying, InBackward, ShardState, StepRecord
from engine.optim.types import OptimShard, OptimStepStats
from engine.paging.handle import HandleState, ParamHandle
from engine.paging.layout import (
    GRAD_KEY_PREFIX,
    OPTIM_KEY_PREFIX,
    grad_key,
    optim_keys,
    staged_key,
)
from engine.paging.pager import Pager
from engine.paging.shard_io import ShardIO, delete_keys
from tiered import ChecksumError, TieredStore


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


@dataclasses.dataclass(frozen=True)
class _Param:
    """A trainable parameter's shard as the optimizer sees it."""

    name: str
    numel: int
    dtype: torch.dtype
    param_key: str
    group: int


def discard_training_state(store: TieredStore) -> None:
    """Delete gradient shards, optimizer state, progress entries and the step record an earlier run
    left in ``store`` (a fresh, non-resuming wrap: its parameters replace that run's, so its state
    no longer fits)."""
    stale = [k for k in store.keys()
             if k.startswith((GRAD_KEY_PREFIX, OPTIM_KEY_PREFIX, PROGRESS_KEY_PREFIX)) or k == STEP_RECORD_KEY]
    delete_keys(store, stale)


def check_resumable(store: TieredStore) -> None:
    """ValueError unless ``store`` holds a step record to resume from."""
    if STEP_RECORD_KEY not in store:
        raise ValueError(
            f"EngineConfig(resume=True), but the store at {store.config.path} has no step record: no training with "
            "engine.AdamW ran there (or a later wrap started afresh); wrap without resume"
        )


def roll_back_interrupted_step(store: TieredStore) -> None:
    """When the store's record says a step's updates inside backward were under way (a crash came
    before its commit), roll them back: the store then holds the last committed step, every parameter
    under its key, before a resume adopts them ([Note: Speculative updates] in
    engine/optim/speculation.py). Renames and deletes only."""
    try:
        record = StepRecord.read(store)
    except (StepRecordError, ChecksumError):
        return  # Training.start reports it, with the way out
    if record is None or record.in_backward is None:
        return
    fresh = {name for name, state in record.shards.items() if state.slot == NO_STATE}
    roll_back(store, [entries_named(name) for name in record.shards], fresh)
    record.replace(in_backward=None).write(store)


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
    ) -> None:
        """``updates_buffer_bytes``: the memory plan's bound on the buffers of the updates inside backward
        (``MemoryPlan.updates_buffer_bytes``; 0 keeps them to the settings' sizes)."""
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
        #: State on nvme: one copy, each group committed atomically, rolled forward ([Note: Rolling a step forward]).
        self._durable = config.optimizer_tier == "nvme" and not config.updates_in_place
        #: fp32 shards are their own masters ([Note: One copy of fp32 weights]).
        self._master_in_param = config.param_tier == config.optimizer_tier and (
            self._durable or config.updates_in_place)
        #: Which way each step runs ([Note: Speculative updates] in engine/optim/speculation.py).
        self._policy = StepModePolicy(config.step_in_backward, updates_in_backward_ruled_out(config),
                                      clipping=config.max_grad_norm is not None)
        #: The worker of the updates inside backward ([Note: Updates inside backward]); None when no step
        #: of this run can take them.
        self._updates: Optional[BackwardUpdates] = None
        if self._policy.inside:
            group = config.optimizer_group_bytes
            self._updates = BackwardUpdates(
                self._store, compress=config.compress_optimizer, batch_bytes=group, inflight_bytes=2 * group,
                window_bytes=2 * group * max(1, config.optimizer_prefetch_groups), keep=config.cache_tier,
                hold_bytes=updates_buffer_bytes,
            )
        self._io = shard_io
        if self._updates is not None and any(p.dtype != torch.float32 for p in self._params):
            pager.master_source = self._master_for_backward
        #: The step whose updates run inside backward (None: none under way).
        self._inside: Optional[StepInBackward] = None
        #: Whether the step under way runs inside backward (None: not decided until its first final gradient).
        self._inside_this_step: Optional[bool] = None
        self._backward_failed = False  # an update inside backward failed: the step must be run again
        self._micro_batch: set[str] = set()  # shards with a final gradient since the last eng.step() call
        self._step_hypers: Optional[tuple] = None  # hyperparameters at the step's first final gradient
        self._ahead_order: list[str] = []  # the order the last step inside backward took its gradients in
        #: The last step's updates ran inside backward and kept no gradient, and no gradient came since:
        #: a step or a gradient read now cannot see what torch would (that step's gradients, again).
        self._used_up = False
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
        self.record = StepRecord.empty([p.name for p in self._params], master_in_param=self._master_in_param).replace(
            loss_scale=self._scaler_state())
        self.counters = TrainCounters()
        #: Tracing hook passed to every step's ``run_step`` (tests use it to stop a step half way),
        #: called with ("staged", -1) once a load's record has committed and before its renames, and
        #: by the updates inside backward ("renamed" / "written", batch).
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
        """Fresh: commit an empty record (step 0). Resume: take up the store's record, finish a step it
        was applying ([Note: Rolling a step forward]) and a load it was installing, and drop the
        gradients and anything the record does not name."""
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
        # A step being applied counts as done: resuming finishes it.
        self._agree_on_step(None if record is None else record.applying.step if record.applying else record.step)
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
        self.record = record.replace(shards={n: record.shards[n] for n in names})
        if record.applying is None:
            discard_kept(self._store, self._entries(self.live_shards()))  # what a crash after a commit left
        for p in self._params:
            state = self.record.shards[p.name]
            if state.slot != NO_STATE:
                absent = [k for k in self.live_shard(p.name).state_keys() if k not in self._store]
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
        self.record = self.record.replace(loss_scale=self._scaler_state())
        self._optimizer._set_shard_steps({n: s.steps for n, s in self.record.shards.items()})
        if self.record.applying is not None:
            self._finish_applying(first_attempt=False)
        self._install_staged()
        self._restore_params()
        self._migrate_layout()
        self.grads.discard_stored()
        self._delete_inactive()

    def close(self) -> None:
        """Wait for gradient puts still in flight (errors are dropped: the engine is closing); later
        steps raise and zero_grad does nothing more than torch's. Updates inside backward that no
        ``eng.step()`` took are rolled back (as the gradients of a step never taken are lost); a step
        after backward left part way is finished by the next resume."""
        try:
            if self._inside is not None or self._backward_failed:
                self._roll_back_in_backward()
        except Exception:  # noqa: BLE001 - the engine is closing: the next resume rolls it back instead
            pass
        self._closed = True
        try:
            self.grads.flush()
        except RuntimeError:
            pass
        finally:
            self._prefetch.discard()
            if self._updates is not None:
                self._updates.close()
            self._inside = None

    # ------------------------------------------------------------------ queries

    @property
    def completed_steps(self) -> int:
        """Optimizer steps completed on this store (a resumed run counts the earlier ones)."""
        return self.record.step

    def live_shards(self) -> list[OptimShard]:
        """Every trainable shard with the store keys of its current state (a shard that never took
        a step has none yet: its slot-0 moments are absent from the store)."""
        return [self.live_shard(p.name) for p in self._params]

    def live_shard(self, name: str) -> OptimShard:
        """:meth:`live_shards`' entry for the trainable shard ``name`` alone."""
        p = self._by_name[name]
        state = self.record.shards[name]
        return self._shard(p, max(state.slot, 0), staged=state.staged)

    def has_state(self, name: str) -> bool:
        """True when the trainable shard ``name`` has taken a step (it has moments, and a master)."""
        return self.record.shards[name].slot != NO_STATE

    def master_is_param(self, name: str) -> bool:
        """True when the trainable shard ``name`` is its own fp32 master ([Note: One copy of fp32 weights])."""
        return self._one_copy(self._by_name[name])

    def staging_keys(self, name: str) -> tuple[str, str, str]:
        """Where to write loaded master, exp_avg, exp_avg_sq of ``name`` before :meth:`commit_staged`."""
        p = self._by_name[name]
        master, exp_avg, exp_avg_sq = optim_keys(name, self._other(self.record.shards[name].slot))
        return (staged_key(name) if self._one_copy(p) else master), exp_avg, exp_avg_sq

    def param_staging_key(self, name: str) -> Optional[str]:
        """Where a load writes the trainable parameter ``name`` for :meth:`commit_staged` to install it,
        or None when it is written in place (its master, staged apart, can rewrite it). A staged
        parameter is its fp32 master: write the loaded master there when there is one."""
        return staged_key(name) if self._one_copy(self._by_name[name]) else None

    def commit_staged(self, step: int, shard_steps: Mapping[str, int]) -> None:
        """Install state written to :meth:`staging_keys`: a shard whose staged moments are in the store
        takes ``shard_steps[name]``; the others have no state (and must have 0 steps). Commits the
        record at ``step``, rewrites the trainable parameters from their masters (a staged one-copy
        parameter is renamed into place), drops the old state and every gradient shard."""
        self.complete_pending("discard")
        self._prefetch.discard()  # it read the state this replaces
        self.grads.discard_stored()
        self._pager.drop_prefetched()
        shards = {}
        for p in self._params:
            slot = self._other(self.record.shards[p.name].slot)
            count = int(shard_steps.get(p.name, 0))
            staged = self.staging_keys(p.name)
            one_copy = self._one_copy(p)
            parked = one_copy and staged[0] in self._store  # the loaded parameter, waiting to be renamed
            if all(k in self._store for k in staged[1 if one_copy else 0:]):
                shards[p.name] = ShardState(count, slot, staged=parked)
            elif count:
                raise StepRecordError(f"{p.name!r} has taken {count} steps but no state was staged at {staged}")
            else:
                shards[p.name] = ShardState(0, NO_STATE, staged=parked)
        record = StepRecord(step, shards, self._scaler_state(), self.record.master_in_param)
        record.write(self._store)
        self.record = record
        self._optimizer._set_shard_steps({n: s.steps for n, s in self.record.shards.items()})
        if self.on_event is not None:
            self.on_event("staged", -1)
        self._install_staged()
        self._restore_params()
        self._delete_inactive()  # the replaced state, and anything staged for a shard left without state

    def masters_follow_params(self, names: Iterable[str]) -> None:
        """The parameters ``names`` were written from outside a step (``load_state_dict``, a
        ``gathered(writeback=True)`` block): their fp32 masters take the new values, element by
        element where a value changed, so the next step does not undo the write; an element written
        with the value it had (bit for bit) keeps its master. See [Note: Masters of written parameters]."""
        wanted = set(names)
        store = self._store
        compress = True if self._config.compress_optimizer else None
        for shard in self.live_shards():
            if shard.name not in wanted or shard.master_is_param or shard.master_key not in store:
                continue
            param = store.sync.get(shard.param_key).reshape(-1)
            master = store.sync.get(shard.master_key).reshape(-1)
            unchanged = _same_bits(master.to(param.dtype), param)
            if bool(unchanged.all()):
                continue
            store.sync.put(shard.master_key, torch.where(unchanged, master, param.to(torch.float32)),
                           self._config.optimizer_tier, compress=compress)

    def complete_pending(self, intent: str = "read") -> None:
        """Bring the store to one step's state before a call between steps: finish a step that stopped
        part way ([Note: Rolling a step forward]), and deal with updates inside backward waiting for
        ``eng.step()`` ([Note: Speculative updates]) as ``intent`` needs: "read" (a forward, a save,
        a ``full_*`` read) sets them aside so the call sees the last committed step; "write" (a load,
        a ``set_full_*``) rolls them back so that ``eng.step()`` redoes them from the stored gradients,
        or raises RuntimeError (changing nothing) where no gradient was kept; "discard"
        (``zero_grad``) rolls them back and drops the step."""
        if self._closed:
            return
        inside = self._inside
        if inside is not None and not self._backward_failed:
            if intent == "read":
                if not inside.set_aside:
                    self._wait_for_updates()
                    set_aside(self._store, self._entries(self._updated_shards()))
                    inside.set_aside = True
                    self._pager.drop_prefetched()
                    if self.on_event is not None:
                        self.on_event("set aside", 0)
            elif intent == "discard":
                self._roll_back_in_backward()
            elif intent == "write":
                if inside.updated and not inside.keeps_grads:
                    raise RuntimeError(
                        f"step {inside.step}'s updates ran inside backward without keeping their gradients, so they "
                        "cannot be redone once this changes the state: call it after eng.step(), or before backward "
                        "(EngineConfig.step_in_backward=False runs every step after backward)"
                    )
                self._policy.keep_grads()
                self._redo_after_backward()
            else:
                raise ValueError(f"complete_pending: intent must be 'read', 'write' or 'discard', got {intent!r}")
        if self.record.applying is not None:
            self._pager.drop_prefetched()
            self._finish_applying(first_attempt=False)

    @property
    def step_in_backward(self) -> bool:
        """True when updates inside backward may run in this engine (``EngineConfig.step_in_backward``
        True, or None where the configuration allows them)."""
        return self._updates is not None

    @property
    def step_mode(self) -> str:
        """Which way the next step runs, and why (one line, for logs and ``tiered train``)."""
        self._policy.decide()
        return self._policy.reason

    def gradients_readable(self, what: str) -> None:
        """Before ``full_grad`` / ``set_full_grad`` (``what``): RuntimeError when updates inside backward
        used the step's gradients without keeping them; else notes that this loop reads gradients
        between backward and step, so later steps keep them."""
        inside = self._inside
        self._policy.keep_grads()
        if inside is not None and inside.updated and not inside.keeps_grads:
            raise RuntimeError(
                f"cannot {what}: step {inside.step}'s updates ran inside backward and kept no gradient (none is "
                "needed unless something reads them); later steps keep them now. Call it before backward or "
                "after eng.step(), or set EngineConfig.step_in_backward=False"
            )
        if self._used_up:
            raise RuntimeError(
                f"cannot {what}: step {self.record.step}'s updates ran inside backward and kept no gradient; later "
                "steps keep them now. Call it after a backward, or set EngineConfig.step_in_backward=False"
            )

    def on_forward(self, inputs: tuple) -> None:
        """The wrapped model's forward starts (outside backward) with ``inputs``, its ``(args, kwargs)``."""
        if self._backward_failed:
            self._roll_back_in_backward()
        self.complete_pending("read")
        if torch.is_grad_enabled() and self._inside_this_step is None and self._updates is not None:
            # Decided before the step's first fetch: backward then reads masters ([Note: Masters read in
            # backward] in engine/paging/pager.py).
            self._inside_this_step = self._policy.decide()
            if self._inside_this_step and self._ahead_order:
                # Read now, not when the last step committed: anything between the steps (a step after
                # backward, a load, a set_full_*) may have changed the state.
                self._updates.read_ahead(self._shards_of(self._ahead_order), self.has_state)

    def end_micro_batch(self) -> None:
        """An ``eng.step()`` call ended a micro-batch: the next backward's gradients are another's."""
        self._micro_batch.clear()

    def on_final_grad(self, handle: ParamHandle, boundary: bool) -> None:
        """``handle``'s gradient is final for this backward (``boundary``: the accumulation window's last):
        its update runs now, inside backward, or its shard goes to the store for the step."""
        if handle.param.grad is None:
            return
        if handle.name in self._micro_batch:
            self._policy.second_backward()  # the loop adds up backwards by itself
        self._micro_batch.add(handle.name)
        self._used_up = False
        if boundary and self._inside_this_step is None and not self._backward_failed:
            self._inside_this_step = self._updates is not None and self._policy.decide()
        if boundary and self._inside_this_step:
            self.update_in_backward(handle)
        else:
            self.grads.offload(handle)  # to the store as an fp32 shard; param.grad = None

    def update_in_backward(self, handle: ParamHandle) -> None:
        """``handle``'s gradient is final for the step (the window's last backward): hand its update to
        the worker ([Note: Updates inside backward]); ``param.grad`` is None afterwards."""
        assert self._updates is not None
        self._check_backward()
        inside = self._inside if self._inside is not None else self._begin_in_backward()
        name = handle.name
        if inside.seen(name) or inside.set_aside:
            self._second_backward(name)
            self.grads.offload(handle)
            return
        grad = handle.param.grad
        master = handle.take_master_copy()  # read by backward's fetch, or None
        shard = self._io.grad_shard(handle, grad).to("cpu")
        handle.param.grad = None
        del grad
        if self.grads.current(name):  # the window's earlier micro-batches: their sum is in the store
            shard = self._store.sync.get(grad_key(name)).float().add_(shard)
            accumulated = True
        else:
            accumulated = False
        norm = shard_norms([shard])[0]
        run_now = inside.admit(name, norm)
        if inside.keeps_grads and not inside.overflow:
            self.grads.keep(name, shard, exact_dtype(handle, accumulated, self._io.world), norm)
        if not run_now:
            return
        p = self._by_name[name]
        if master is None and handle.state is HandleState.READY and self._one_copy(p):
            master = self._store.host_buffer(handle.layout.shard_numel * 4).view(torch.float32)
            self._io.local_shard(handle, out=master)  # backward's copy of the parameter is the master
        state = self.record.shards[name]
        self._updates.on_event = self.on_event
        try:
            self._updates.submit(self._shard(p, max(state.slot, 0)), shard, master, state.steps, inside.hypers,
                                 grad_scale=inside.grad_scale, grad_shared=inside.keeps_grads)
        except BaseException as exc:
            self._backward_failed = True
            exc.add_note(f"step {inside.step} was not applied: run its batch again (forward and backward; the "
                         "forward puts the last completed step's parameters back), then eng.step()")
            raise

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
        would then cover gradients that did not exist when it was asked for. Updates that ran inside
        backward are validated against it by the step ([Note: Speculative updates])."""
        self._policy.keep_grads()
        norm = self.pending_grad_norm()
        if not math.isinf(max_norm):
            self._clip_to = float(max_norm) if self._clip_to is None else min(self._clip_to, float(max_norm))
        return norm

    def _stored_grad_norm(self) -> torch.Tensor:
        """The stored (loss-scaled) gradients' global norm, summed in parameter order over every
        rank, once every gradient shard has reached the store (with updates inside backward, the
        norms of the final gradients they took count too)."""
        self.grads.flush()
        # Norms taken on the compute device (CUDA) join the step's CPU math as CPU scalars.
        norms = {n: t.cpu() for n, t in self.grads.norms.items()} if self.grads.norms else {}
        if self._inside is not None:
            norms.update(self._inside.norms())
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
        if self.record.applying is not None:  # the step that failed part way: this call finishes it
            self._finish_applying(first_attempt=False, started=started)
            return
        self._micro_batch.clear()
        self._inside_this_step = None
        if self._inside is not None:
            self._commit_in_backward(started)
            return
        if self._used_up:
            self._policy.keep_grads()
            raise RuntimeError(
                f"eng.step() again with no backward since step {self.record.step}, whose updates ran inside "
                "backward and kept no gradient: a torch optimizer would apply the same gradients again, which "
                "are gone. Call eng.zero_grad() (a step then changes nothing, as in torch) or run a backward "
                "first; later steps keep their gradients for this"
            )
        self._check_hyperparameters_kept()
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
        if self._durable:
            self._start_applying(with_grad, stored_norm, grad_scale, started)
            return
        in_place = cfg.updates_in_place
        # Two slots: the first step's masters exist before the step can touch a parameter; in place:
        # state to lend to the step exists before it.
        self._init_new_state([p for p in with_grad if self.record.shards[p.name].slot == NO_STATE])
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
            if not in_place:
                self._rollback(exc)
            raise
        store.close()
        counts = self._optimizer.shard_steps
        previous = self.record
        updated = {p.name for p in with_grad}
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        record = StepRecord(previous.step + 1, {
            name: ShardState(counts.get(name, 0), (max(s.slot, 0) if in_place else self._other(s.slot))
                             if name in updated else s.slot)
            for name, s in previous.shards.items()
        }, self._scaler_state(), previous.master_in_param)
        try:
            record.write(self._store)  # the commit point
        except BaseException as exc:
            self._optimizer._set_shard_steps({n: s.steps for n, s in previous.shards.items()})
            self._restore_scaler(scaler_before)
            if not in_place:
                self._rollback(exc)
            raise
        self.record = record
        self.grads.mark_consumed()
        self._clip_to = None
        self.last_grad_norm = float(stored_norm) * grad_scale  # a power of two: exactly the unscaled norm
        if not in_place:
            delete_keys(self._store, [k for name in updated for k in optim_keys(name, previous.shards[name].slot)])
        self.counters.add(stats, time.perf_counter() - started)

    def _clip_norm(self) -> Optional[float]:
        """The norm the next step clips to: the smaller of ``max_grad_norm`` and ``clip_grad_norm_``'s, or None."""
        max_norm = self._config.max_grad_norm
        if self._clip_to is not None:
            max_norm = self._clip_to if max_norm is None else min(self._clip_to, max_norm)
        return max_norm

    def _start_applying(self, with_grad: list["_Param"], stored_norm: torch.Tensor, grad_scale: float,
                        started: float, inside: tuple[str, ...] = ()) -> None:
        """The step with the state on nvme: durable gradients, the ``applying`` record, then the groups
        ([Note: Rolling a step forward]). ``inside``: shards whose update already ran inside backward
        and stands ([Note: Speculative updates]); the step counts them and updates the others."""
        max_norm = self._clip_norm()
        # A power-of-two scale scales the norm exactly: this is the norm of the unscaled gradients.
        norm = stored_norm * grad_scale if grad_scale != 1.0 else stored_norm
        coef = clip_coefficient(norm, max_norm) if max_norm is not None else None
        self._policy.after_step(inside=False, bound=coef is not None and float(coef) < 1.0)
        self._store.sync.flush([grad_key(p.name) for p in with_grad])
        scaler_after = None
        if self.scaler is not None:
            after = LossScaler(self.scaler.policy)
            after.load_state_dict(self.scaler.state_dict())
            after.update(overflow=False)
            scaler_after = after.state_dict()
        applying = Applying(
            self.record.step + 1, tuple(p.name for p in with_grad), tuple(self._optimizer.hyperparameters()),
            float(grad_scale), None if coef is None else float(coef), scaler_after, inside,
        )
        delete_keys(self._store, progress_keys(self._store))  # leftovers of no step in flight
        record = self.record.replace(applying=applying, in_backward=None)
        record.write(self._store)  # from here on the step is finished, never undone
        self.record = record
        self._clip_to = None
        self.last_grad_norm = float(norm)
        self._finish_applying(first_attempt=True, started=started)

    def _finish_applying(self, *, first_attempt: bool, started: Optional[float] = None) -> None:
        """Update every shard of the record's ``applying`` step that no progress entry names, then
        commit the step (see [Note: Rolling a step forward])."""
        applying = self.record.applying
        assert applying is not None
        started = time.perf_counter() if started is None else started
        stepping = set(applying.shards) | set(applying.inside)
        done = done_shards(self._store, applying.step) if not first_attempt else set()
        done |= set(applying.inside)
        todo = [p for p in self._params if p.name in stepping and p.name not in done]
        lost = [p.name for p in todo if grad_key(p.name) not in self._store]
        if lost:
            raise StepRecordError(
                f"step {applying.step} stopped part way and cannot be finished: the gradients of {lost[:3]} are not "
                "in the store. Resume from a checkpoint instead (wrap without resume, then eng.load_checkpoint(...))"
            )
        cfg = self._config
        shards = [self._shard(p, max(self.record.shards[p.name].slot, 0)) for p in todo]
        if not first_attempt:
            self._prefetch.discard()  # read for a step that did not run as planned
        store = self._prefetch.take(self._store)
        try:
            stats = self._optimizer.run_step(
                store, shards, config=cfg, on_event=self.on_event, grad_scale=applying.grad_scale,
                hypers=applying.hypers, clip_coef=applying.clip_tensor(), atomic=True,
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
        shards_after = {
            name: ShardState(s.steps + 1, max(s.slot, 0)) if name in stepping else s
            for name, s in self.record.shards.items()
        }
        record = StepRecord(applying.step, shards_after, applying.loss_scale, self.record.master_in_param)
        record.write(self._store)  # the commit point
        self.record = record
        self._optimizer._set_shard_steps({n: s.steps for n, s in record.shards.items()})
        if self.scaler is not None and applying.loss_scale is not None:
            self.scaler.load_state_dict(applying.loss_scale)
        if not first_attempt:  # a separate master's parameter may lag behind it: rewrite those
            self._restore_params([p for p in self._params if p.name in stepping])
        delete_keys(self._store, progress_keys(self._store))
        discard_kept(self._store, self._entries(self._shards_of(applying.inside)))
        self.grads.mark_consumed()
        self.counters.add(stats, time.perf_counter() - started)

    # ------------------------------------------------------------------ updates inside backward

    def _begin_in_backward(self) -> StepInBackward:
        """The step's first final gradient, with its updates inside backward: record that a step is under
        way (a crash from here on is rolled back at resume, [Note: Speculative updates])."""
        self.grads.drop_consumed()  # the last step's, which no update inside backward would delete
        record = self.record.replace(in_backward=InBackward(self.record.step + 1))
        record.write(self._store)
        self.record = record
        scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        self._inside = StepInBackward(
            step=record.step + 1, keeps_grads=self._policy.keeps_grads, max_norm=self._clip_norm(),
            grad_scale=scale, hypers=tuple(self._optimizer.hyperparameters()),
        )
        return self._inside

    def _commit_in_backward(self, started: float) -> None:
        """``eng.step()`` after updates inside backward: wait for them, validate them against the global
        norm, an overflow and the hyperparameters, and commit, roll back or redo ([Note: Speculative
        updates])."""
        inside = self._inside
        assert inside is not None and self._updates is not None
        if self._backward_failed:
            self._roll_back_in_backward()
            raise RuntimeError(
                f"an optimizer update inside backward of step {inside.step} failed, so the step was not applied: "
                "the parameters are back at the last completed step. Run that step's batch again (forward and "
                "backward), then eng.step()"
            )
        self._wait_for_updates()
        if inside.set_aside:
            put_back(self._store, self._entries(self._updated_shards()))
            inside.set_aside = False
            self._pager.drop_prefetched()
        for p in self._params:  # a gradient from an earlier micro-batch only: its update waits for the step
            if not inside.seen(p.name) and self.grads.current(p.name):
                inside.waiting[p.name] = self.grads.norms[p.name]
        stored_norm = self._stored_grad_norm()
        if self.scaler is not None and not bool(torch.isfinite(stored_norm)):
            self.last_grad_norm = float(stored_norm)
            self._roll_back_in_backward()
            self._skip_step()
            return
        max_norm = self._clip_norm()
        norm = stored_norm * inside.grad_scale if inside.grad_scale != 1.0 else stored_norm
        binds = max_norm is not None and float(clip_coefficient(norm, max_norm)) < 1.0
        changed = tuple(self._optimizer.hyperparameters()) != inside.hypers
        if (binds or changed) and inside.updated:
            if not inside.keeps_grads:
                self._roll_back_in_backward()
                self._policy.keep_grads()
                self._clip_to = None
                self.grads.zero(set_to_none=True)
                raise RuntimeError(
                    f"step {inside.step} was not applied: its updates ran inside backward before "
                    + ("clip_grad_norm_ asked for clipping that binds" if binds else
                       "the hyperparameters changed (an LR scheduler stepped before the optimizer?)")
                    + ", and no gradient was kept to redo them. The parameters are back at the last completed step; "
                    "run that step's batch again (forward and backward), then eng.step(). Later steps keep the "
                    "gradients a redo needs"
                )
            self._redo_after_backward()
            self._step()
            return
        waiting = [p for p in self._params if p.name in inside.waiting]
        if waiting:  # the running norm stopped the updates, as it turned out without need
            self._inside = None
            self._start_applying(waiting, stored_norm, inside.grad_scale, started, tuple(inside.updated))
            self.counters.steps_inside += bool(inside.updated)
            self._end_step_in_backward(inside, started)
            return
        counts = {n: s.steps + 1 if n in inside.updated else s.steps for n, s in self.record.shards.items()}
        record = StepRecord(self.record.step + 1, {
            n: ShardState(counts[n], max(s.slot, 0)) if n in inside.updated else s for n, s in self.record.shards.items()
        }, self._scaler_state(), self.record.master_in_param)
        if self.scaler is not None:
            self.scaler.update(overflow=False)
            record = record.replace(loss_scale=self._scaler_state())
        record.write(self._store)  # the commit point
        self.record = record
        self._inside = None
        self._clip_to = None
        self._optimizer._set_shard_steps(counts)
        discard_kept(self._store, self._entries(self._shards_of(inside.updated)))
        self.grads.mark_consumed()
        self.last_grad_norm = float(norm)
        self._policy.after_step(inside=True, bound=False)
        self.counters.steps_inside += 1
        self._used_up = not inside.keeps_grads
        self._end_step_in_backward(inside, started)

    def _end_step_in_backward(self, inside: StepInBackward, started: float) -> None:
        """After a step with updates inside backward committed: remember the order its gradients became
        final in (the next such step reads ahead along it), count it."""
        assert self._updates is not None
        self._ahead_order = list(inside.norms())
        c = self._updates.take_counters()
        seconds = time.perf_counter() - (c.first_update if c.first_update is not None else started)
        self.counters.add(OptimStepStats(
            seconds=seconds, bytes_read=c.bytes_read, bytes_written=c.bytes_written, io_stall_seconds=c.stall_seconds,
            update_seconds=c.update_seconds, groups=c.batches, shards_updated=len(inside.updated),
            shards_skipped=len(self._params) - len(inside.updated), grad_norm=self.last_grad_norm, clip_coef=None,
            step_counts=self._optimizer.shard_steps,
        ), time.perf_counter() - started)

    def _roll_back_in_backward(self) -> None:
        """Undo the updates inside backward of the step under way (or a crash left): the store holds the
        last committed step again, and the record says no step is under way ([Note: Speculative updates])."""
        if self._updates is not None:
            try:
                self._updates.wait()
            except RuntimeError:
                pass  # the failure that brought us here
            self._updates.take_counters()
        fresh = {p.name for p in self._params if self.record.shards[p.name].slot == NO_STATE}
        roll_back(self._store, self._entries(self.live_shards()), fresh)
        self._pager.drop_prefetched()
        self._inside = None
        self._inside_this_step = None
        self._backward_failed = False
        if self.record.in_backward is not None:
            record = self.record.replace(in_backward=None)
            record.write(self._store)
            self.record = record

    def _redo_after_backward(self) -> None:
        """Roll the updates inside backward back and leave the step to run after backward from the stored
        gradients (every final gradient was kept)."""
        inside = self._inside
        assert inside is not None and inside.keeps_grads
        self._wait_for_updates()
        self._roll_back_in_backward()
        if inside.updated:
            self.counters.steps_redone += 1
        self._inside_this_step = False  # the rest of this step's gradients go to the store

    def _second_backward(self, name: str) -> None:
        """A gradient reached ``name`` again before ``eng.step()``: the loop adds backwards up by itself.
        Redo the step after backward when the gradients were kept; else refuse (the updates used only
        the first)."""
        self._policy.second_backward()
        inside = self._inside
        assert inside is not None
        if inside.keeps_grads:
            self._redo_after_backward()
            return
        raise RuntimeError(
            f"a second backward reached {name!r} before eng.step(), but step {inside.step}'s updates already ran "
            "inside backward with the first backward's gradients alone: call eng.step() after each backward, or "
            "set EngineConfig.gradient_accumulation_steps and call eng.backward / eng.step per micro-batch (later "
            "steps of this run go after backward)"
        )

    def _wait_for_updates(self) -> None:
        """Wait for the worker; on a failed update, roll the step back and raise."""
        assert self._updates is not None
        try:
            self._updates.wait()
        except BaseException as exc:
            self._backward_failed = True
            exc.add_note(f"step {self.record.step + 1} was not applied; the next forward puts the last completed "
                         "step's parameters back: run that step's batch again (forward and backward), then eng.step()")
            raise

    def _master_for_backward(self, handle: ParamHandle) -> Optional[str]:
        """The store key of ``handle``'s fp32 master for backward's last fetch of it to read, when this
        step's updates run inside backward and it has a master of its own ([Note: Masters read in
        backward] in engine/paging/pager.py); else None."""
        p = self._by_name.get(handle.name)
        if not self._inside_this_step or p is None or self._one_copy(p) or not self.has_state(p.name):
            return None
        if self._inside is not None and (self._inside.set_aside or self._inside.binds or self._inside.overflow):
            return None  # its update will wait for the step
        return self.live_shard(p.name).master_key

    def _updated_shards(self) -> list[OptimShard]:
        inside = self._inside
        return self._shards_of(inside.updated) if inside is not None else []

    def _shards_of(self, names: "Mapping[str, object] | Sequence[str]") -> list[OptimShard]:
        return [self.live_shard(n) for n in names]

    @staticmethod
    def _entries(shards: Sequence[OptimShard]) -> list:
        return [entries_of(s) for s in shards]

    def _zero_grad(self, set_to_none: bool) -> None:
        self._clip_to = None
        self._used_up = False
        self._step_hypers = None
        self._micro_batch.clear()
        if not self._closed:
            self.complete_pending("discard")  # a step stopped part way still needs its gradients
            self._inside_this_step = None
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
        """A gradient is final and goes to the store for a step after backward (called from backward)."""
        self._check_backward()
        if self._step_hypers is None:
            self._step_hypers = tuple(self._optimizer.hyperparameters())
        self._start_prefetch()

    def _check_hyperparameters_kept(self) -> None:
        """A step after backward: when the hyperparameters changed since its first gradient, later
        steps with updates inside backward keep the gradients a redo needs."""
        if self._step_hypers is not None and self._step_hypers != tuple(self._optimizer.hyperparameters()):
            self._policy.keep_grads()
        self._step_hypers = None

    def _check_backward(self) -> None:
        """RuntimeError when a gradient may not become final now (called from backward)."""
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
        if self.record.applying is not None:
            raise RuntimeError(
                f"step {self.record.applying.step} stopped part way and a backward started before it was finished: "
                "call eng.step() to finish it first (its gradients are the ones in the store)"
            )

    # ------------------------------------------------------------------ internals

    def _one_copy(self, p: "_Param") -> bool:
        return self.record.master_in_param and p.dtype == torch.float32

    def _shard(self, p: "_Param", slot: int, *, write_other: bool = False, staged: bool = False) -> OptimShard:
        master, exp_avg, exp_avg_sq = optim_keys(p.name, slot)
        if self._one_copy(p):
            master = staged_key(p.name) if staged else p.param_key
        return OptimShard(
            p.name, p.numel, p.dtype, p.param_key, grad_key(p.name), master, exp_avg, exp_avg_sq,
            group=p.group, state_out_keys=optim_keys(p.name, 1 - slot) if write_other else None,
        )

    @staticmethod
    def _other(slot: int) -> int:
        return 0 if slot == NO_STATE else 1 - slot

    def _init_new_state(self, params: list["_Param"]) -> None:
        """State for shards stepping for the first time, committed before the step can touch their
        parameters (so a failure in the step finds their pre-step values in the master)."""
        if not params:
            return
        cfg = self._config
        # Slot-0 keys of a shard without state are leftovers of an init that failed half way (init_state
        # skips a shard whose exp_avg exists, so an exp_avg without the rest would stay so).
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
        """After a failed step with two slots: parameters back to the live masters (the step's error is
        what the caller sees; if the store fails this too, the next step does it first, and ``error``
        says so)."""
        try:
            self._delete_inactive()  # the failed step's partial state writes: frees their space for the rewrite
            self._restore_params()
        except Exception as exc:  # noqa: BLE001 - the original error is re-raised by the caller
            self._restore_pending = True
            error.add_note(
                f"eng.step() could not restore the parameters of the last completed step either ({exc}); until the "
                "next eng.step() (which restores them first) or a resume, some parameters hold the failed step's values"
            )

    def _restore_params(self, params: Optional[Sequence["_Param"]] = None) -> None:
        """Rewrite every trainable shard (of ``params``) that has state and a master of its own from
        that master, cast to the training dtype, one group at a time (a shard that is its own master
        needs nothing)."""
        chosen = self._params if params is None else params
        shards = [self.live_shard(p.name) for p in chosen
                  if self.record.shards[p.name].slot != NO_STATE and not self._one_copy(p)]
        if shards:
            run_sync(_restore(self._store, shards, self._config.param_tier, self._config.optimizer_group_bytes))

    def _install_staged(self) -> None:
        """Make the staged masters of a committed load the parameters (renames, no I/O; a rename a
        crash interrupted is finished here), then record that nothing is staged."""
        staged = [p for p in self._params if self.record.shards[p.name].staged]
        if not staged:
            return
        pairs = [(staged_key(p.name), p.param_key) for p in staged if staged_key(p.name) in self._store]
        if pairs:
            self._store.sync.rename_many(pairs)
        record = self.record.replace(shards={
            n: ShardState(s.steps, s.slot) if s.staged else s for n, s in self.record.shards.items()
        })
        record.write(self._store)
        self.record = record

    def _migrate_layout(self) -> None:
        """A resume under a config that lays fp32 masters out the other way ([Note: One copy of fp32
        weights]): give them their own keys (from the parameters, exact in fp32) or drop them (the
        parameters were just rewritten from them), then record the layout."""
        if self.record.master_in_param == self._master_in_param:
            return
        fp32 = [p for p in self._params if p.dtype == torch.float32 and self.record.shards[p.name].slot != NO_STATE]
        if not self._master_in_param:
            cfg = self._config
            for p in fp32:
                master = optim_keys(p.name, self.record.shards[p.name].slot)[0]
                self._store.sync.put(master, self._store.sync.get(p.param_key), cfg.optimizer_tier,
                                     compress=True if cfg.compress_optimizer else None)
        record = self.record.replace(master_in_param=self._master_in_param)
        record.write(self._store)
        self.record = record  # the masters a one-copy layout no longer names go with _delete_inactive

    def _delete_inactive(self) -> None:
        """Delete optimizer keys the record does not name (a crashed step's partial writes, replaced
        slots, masters a one-copy layout does not keep) and, with no step being applied, progress entries."""
        live: set[str] = set()
        for p in self._params:
            state = self.record.shards[p.name]
            if state.staged:
                live.add(staged_key(p.name))
            if state.slot != NO_STATE:
                live.update(self.live_shard(p.name).state_keys())
        stale = [k for k in self._store.keys() if k.startswith(OPTIM_KEY_PREFIX) and k not in live]
        if self.record.applying is None:
            stale += progress_keys(self._store)
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


# [Note: Masters of written parameters]
# A parameter in a training dtype below fp32 (bf16, fp16) is the rounding of its fp32 master. A
# write from outside a step (``model.load_state_dict``, ``eng.gathered(writeback=True)``) changes
# the parameter, and the next step must start from what was written, so the master follows it; but
# only where the written value differs from the parameter's rounding of its master. An element
# written with the very bits it had keeps its master: loading the model's own state dict back (what
# the Hugging Face Trainer does when it resumes, after the engine's checkpoint restored the masters)
# changes nothing, and a block that changes one row rounds no other row's master. A master equal to
# the written bf16 value everywhere takes ``eng.set_full_fp32_param``.


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: ``a`` and ``b`` (one dtype) hold the same bits (so -0.0 differs from 0.0, and a
    NaN equals the same NaN)."""
    if a.element_size() == 1 or not a.is_floating_point():
        return a == b
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.view(as_int) == b.view(as_int)
