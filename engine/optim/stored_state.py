"""The optimizer state a store keeps between steps: taken up at resume, replaced by a checkpoint load,
kept in step with parameters written from outside a step, and cleared of what nothing names.

Functions of a :class:`~engine.optim.training_state.TrainingState`, besides three that run on a bare
store before an engine exists (a fresh wrap discarding an earlier run's state, and a resume checking
for a record and rolling back a step a crash cut short).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch

from engine.errors import StepRecordError
from engine.optim.speculation import discard_kept, entries_named, roll_back
from engine.optim.step_progress import PROGRESS_KEY_PREFIX, progress_keys
from engine.optim.step_record import NO_STATE, STEP_RECORD_KEY, ShardState, StepRecord
from engine.optim.training_state import TrainingState
from engine.paging.collectives import Collectives
from engine.paging.layout import GRAD_KEY_PREFIX, OPTIM_KEY_PREFIX, optim_keys, staged_key
from engine.paging.shard_io import delete_keys
from tiered import ChecksumError, TieredStore

# ---------------------------------------------------------------------------- a bare store


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
        return  # the resume reports it, with the way out
    if record is None or record.in_backward is None:
        return
    fresh = {name for name, state in record.shards.items() if state.slot == NO_STATE}
    roll_back(store, [entries_named(name, max(state.slot, 0)) for name, state in record.shards.items()], fresh)
    record.replace(in_backward=None).write(store)


# ---------------------------------------------------------------------------- resume


def read_record(state: TrainingState, comm: Optional[Collectives]) -> StepRecord:
    """The store's record, once every rank read one of the same step (StepRecordError with the way
    out otherwise: a record that is missing, damaged, or of another step than another rank's)."""
    store = state.store
    failure: Optional[BaseException] = None
    record: Optional[StepRecord] = None
    try:
        check_resumable(store)
        record = StepRecord.read(store)
    except (StepRecordError, ChecksumError) as exc:
        failure = StepRecordError(
            f"cannot resume from the store at {store.config.path}: {exc}. Resume from a checkpoint instead "
            "(wrap without resume, then eng.load_checkpoint(...)), or wrap without resume to start afresh"
        )
        failure.__cause__ = exc
    except BaseException as exc:  # noqa: BLE001 - raised below, after every rank has reported
        failure = exc
    # A step being applied counts as done: resuming finishes it.
    _agree_on_step(comm, None if record is None else record.applying.step if record.applying else record.step)
    if failure is not None:
        raise failure
    assert record is not None
    return record


def adopt_record(state: TrainingState, record: StepRecord) -> None:
    """Make ``record`` the state's: its shards must be the model's, their state present, its loss scale
    readable. Leftovers of updates inside backward after a commit go."""
    names = [p.name for p in state.params]
    missing = sorted(set(names) - set(record.shards))
    extra = sorted(set(record.shards) - set(names))
    if missing or extra:
        raise StepRecordError(
            f"the store's step record does not match the model's trainable parameters: the model has "
            f"{missing[:5]} that the record lacks and the record has {extra[:5]} that the model lacks"
        )
    state.record = record.replace(shards={n: record.shards[n] for n in names})
    if record.applying is None:
        discard_kept(state.store, state.entries())  # what a crash after a commit left
    for p in state.params:
        if state.has_state(p.name):
            absent = [k for k in state.live_shard(p.name).state_keys() if k not in state.store]
            if absent:
                raise StepRecordError(
                    f"optimizer state of {p.name!r} from step {record.step} is missing from the store "
                    f"({absent[0]!r}): it was in the host tier (optimizer_tier='host'), which does not survive "
                    "a crash; crash resume needs optimizer_tier='nvme'"
                )
    if state.scaler is not None and record.loss_scale is not None:
        try:
            state.scaler.load_state_dict(record.loss_scale)
        except ValueError as exc:
            raise StepRecordError(f"cannot resume the loss scale from the store's step record: {exc}") from exc
    state.record = state.record.replace(loss_scale=state.scaler_state())
    state.set_shard_steps()


def _agree_on_step(comm: Optional[Collectives], step: Optional[int]) -> None:
    """With several ranks, check that every rank's store completed the same step (each rank commits
    its own record, so a crash between two ranks' commits leaves them one step apart, and resuming
    would silently mix two steps). Every rank calls this, even one whose record could not be read
    (None), so none is left waiting in the collective."""
    if comm is None:
        return
    steps = comm.run(comm.all_gather_object, step)
    if len(set(steps)) > 1:
        raise StepRecordError(
            f"the ranks' stores completed different steps {dict(enumerate(steps))} (None: unreadable): a crash "
            "came between the ranks' commits, so no step exists on every rank. Resume from a checkpoint "
            "instead (wrap without resume, then eng.load_checkpoint(...))"
        )


# ---------------------------------------------------------------------------- loads


def staging_keys(state: TrainingState, name: str) -> tuple[str, str, str]:
    """Where to write the loaded master, exp_avg, exp_avg_sq of ``name`` before :func:`commit_staged`."""
    master, exp_avg, exp_avg_sq = optim_keys(name, state.other(state.record.shards[name].slot))
    return (staged_key(name) if state.one_copy(state.by_name[name]) else master), exp_avg, exp_avg_sq


def commit_staged(state: TrainingState, step: int, shard_steps: Mapping[str, int]) -> None:
    """Commit the record of a load whose state is written to :func:`staging_keys`: a shard whose
    staged moments are in the store takes ``shard_steps[name]``; the others have no state (and must
    have 0 steps)."""
    store = state.store
    shards = {}
    for p in state.params:
        slot = state.other(state.record.shards[p.name].slot)
        count = int(shard_steps.get(p.name, 0))
        staged = staging_keys(state, p.name)
        one_copy = state.one_copy(p)
        parked = one_copy and staged[0] in store  # the loaded parameter, waiting to be renamed
        if all(k in store for k in staged[1 if one_copy else 0:]):
            shards[p.name] = ShardState(count, slot, staged=parked)
        elif count:
            raise StepRecordError(f"{p.name!r} has taken {count} steps but no state was staged at {staged}")
        else:
            shards[p.name] = ShardState(0, NO_STATE, staged=parked)
    state.commit(StepRecord(step, shards, state.scaler_state(), state.record.master_in_param))
    state.set_shard_steps()


def install_staged(state: TrainingState) -> None:
    """Make the staged masters of a committed load the parameters (renames, no I/O; a rename a crash
    interrupted is finished here), then record that nothing is staged."""
    staged = [p for p in state.params if state.record.shards[p.name].staged]
    if not staged:
        return
    pairs = [(staged_key(p.name), p.param_key) for p in staged if staged_key(p.name) in state.store]
    if pairs:
        state.store.sync.rename_many(pairs)
    state.commit(state.record.replace(shards={
        n: ShardState(s.steps, s.slot) if s.staged else s for n, s in state.record.shards.items()
    }))


def migrate_layout(state: TrainingState) -> None:
    """A resume under a config that lays fp32 masters out the other way ([Note: One copy of fp32
    weights]): give them their own keys (from the parameters, exact in fp32) or drop them (the
    parameters were just rewritten from them), then record the layout."""
    if state.record.master_in_param == state.master_in_param:
        return
    if not state.master_in_param:
        cfg = state.config
        for p in state.params:
            if p.dtype == torch.float32 and state.has_state(p.name):
                master = optim_keys(p.name, state.record.shards[p.name].slot)[0]
                state.store.sync.put(master, state.store.sync.get(p.param_key), cfg.optimizer_tier,
                                     compress=True if cfg.compress_optimizer else None)
    # the masters a one-copy layout no longer names go with delete_inactive
    state.commit(state.record.replace(master_in_param=state.master_in_param))


def delete_inactive(state: TrainingState) -> None:
    """Delete optimizer keys the record does not name (a crashed step's partial writes, replaced slots,
    masters a one-copy layout does not keep) and, with no step being applied, progress entries."""
    live: set[str] = set()
    for p in state.params:
        if state.record.shards[p.name].staged:
            live.add(staged_key(p.name))
        if state.has_state(p.name):
            live.update(state.live_shard(p.name).state_keys())
    stale = [k for k in state.store.keys() if k.startswith(OPTIM_KEY_PREFIX) and k not in live]
    if state.record.applying is None:
        stale += progress_keys(state.store)
    delete_keys(state.store, stale)


# ---------------------------------------------------------------------------- written parameters

# [Note: Masters of written parameters]
# A parameter in a training dtype below fp32 (bf16, fp16) is the rounding of its fp32 master. A
# write from outside a step (``model.load_state_dict``, ``eng.gathered(writeback=True)``) changes
# the parameter, and the next step must start from what was written, so the master follows it; but
# only where the written value differs from the parameter's rounding of its master. An element
# written with the very bits it had keeps its master: loading the model's own state dict back (what
# the Hugging Face Trainer does when it resumes, after the engine's checkpoint restored the masters)
# changes nothing, and a block that changes one row rounds no other row's master. A master equal to
# the written bf16 value everywhere takes ``eng.set_full_fp32_param``.


def masters_follow_params(state: TrainingState, names: Iterable[str]) -> None:
    """The parameters ``names`` were written from outside a step (``load_state_dict``, a
    ``gathered(writeback=True)`` block): their fp32 masters take the new values, element by element
    where a value changed, so the next step does not undo the write; an element written with the
    value it had (bit for bit) keeps its master. See [Note: Masters of written parameters]."""
    wanted = set(names)
    store = state.store
    compress = True if state.config.compress_optimizer else None
    for shard in state.live_shards():
        if shard.name not in wanted or shard.master_is_param or shard.master_key not in store:
            continue
        param = store.sync.get(shard.param_key).reshape(-1)
        master = store.sync.get(shard.master_key).reshape(-1)
        unchanged = _same_bits(master.to(param.dtype), param)
        if bool(unchanged.all()):
            continue
        store.sync.put(shard.master_key, torch.where(unchanged, master, param.to(torch.float32)),
                       state.config.optimizer_tier, compress=compress)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: ``a`` and ``b`` (one dtype) hold the same bits (so -0.0 differs from 0.0, and a
    NaN equals the same NaN)."""
    if a.element_size() == 1 or not a.is_floating_point():
        return a == b
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.view(as_int) == b.view(as_int)
