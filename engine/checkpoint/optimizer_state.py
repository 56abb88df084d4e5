"""``engine.AdamW``'s whole state as a torch-style state dict: what ``optimizer.state_dict()`` returns
and ``optimizer.load_state_dict(sd)`` takes once the optimizer is bound to an engine, so a script
that checkpoints the torch way (``torch.save({"model": model.state_dict(), "optimizer":
opt.state_dict()})``) keeps its optimizer state.

[Note: The optimizer's state dict]
The state lives in the store, one shard per rank; the dict is torch's AdamW format, built from it::

    {"state": {i: {"step": tensor(n, dtype=float32), "exp_avg": fp32, "exp_avg_sq": fp32,
                   "master": fp32}},
     "param_groups": [...],                               # torch's, parameters by index
     "engine": {"completed_steps": n, "loss_scale": {...} or None}}

``i`` numbers the parameters in ``param_groups`` order, as torch does; a parameter that has taken
no step has no entry. Every tensor is whole, in the parameter's shape, on the CPU. ``master`` is
the fp32 weight the next step starts from, as DeepSpeed's optimizer state carries its fp32
partitions: a load sets the parameters from it. So the dict alone resumes exactly, also where the
model's own weights were not saved with it (accelerate's ``save_state`` leaves out a model kept out
of ``prepare``) or are a bf16 rounding of the masters. A load stages every tensor beside the live
state and commits it as one step record (as ``load_checkpoint`` does), after checking all of it: a
load that raises changes nothing. A torch ``AdamW``'s own state dict loads too (without masters:
they start from the parameters' values).

The cost is the whole state in memory at once: 12 bytes a trainable parameter,
against ``eng.save_checkpoint``, which streams it one entry at a time. A state larger than
:data:`MEMORY_SHARE` of the memory available is refused, naming ``eng.save_checkpoint``, and so is
any state at a world size above 1 (only a collective can gather the shards, and the Hugging Face
Trainer saves the optimizer from rank 0 alone); before the first step there is none, so the round
trip accelerate's ``prepare`` makes through ``state_dict`` / ``load_state_dict`` works everywhere.
Integrations that save the engine's checkpoint beside the optimizer's state dict (``EngineTrainer``,
``register_engine_state``) have ``state_dict()`` leave the state to that checkpoint
(``AdamW.leave_state_to_checkpoints``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from engine.checkpoint.sharded import EngineParts, check_between_steps
from engine.paging.handle import ParamHandle
from engine.paging.machine_memory import memory_sizes
from engine.paging.shard_io import delete_keys
from tiered.util import format_bytes

#: The most of the memory available that ``state_dict()`` may take for the optimizer's state.
MEMORY_SHARE = 0.5
#: Adam's moments, by the names torch's AdamW gives them (each entry also has ``step`` and ``master``).
MOMENTS = ("exp_avg", "exp_avg_sq")


def state_dict(parts: EngineParts, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole optimizer state of ``parts``' engine in torch's format (see [Note: The optimizer's
    state dict]); ``param_groups``: the optimizer's own, torch's format. RuntimeError, naming
    ``eng.save_checkpoint``, at world size > 1 or for a state larger than :data:`MEMORY_SHARE` of the
    memory available."""
    check_between_steps(parts, "read the optimizer's state")
    training = parts.training
    assert training is not None
    indexed = _indexed_handles(parts)
    with_state = [(i, h) for i, h in indexed if h is not None and training.has_state(h.name)]
    if with_state:
        _check_one_rank(parts, "opt.state_dict()")
        _check_fits(with_state)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, handle in with_state:
        shard = training.live_shard(handle.name)
        entry = {"step": torch.tensor(float(training.record.shards[handle.name].steps), dtype=torch.float32)}
        for name, key in zip((*MOMENTS, "master"), (shard.exp_avg_key, shard.exp_avg_sq_key, shard.master_key)):
            entry[name] = _whole(parts, handle, key)
        state[index] = entry
    scaler = training.scaler
    return {"state": state, "param_groups": param_groups,
            "engine": {"completed_steps": training.completed_steps,
                       "loss_scale": scaler.state_dict() if scaler is not None else None}}


def load_state_dict(parts: EngineParts, sd: Mapping[str, Any]) -> None:
    """Make ``sd`` (:func:`state_dict`'s format, or a torch ``AdamW``'s) the optimizer state of
    ``parts``' engine: moments, masters, step counts and loss scale, committed at once. The
    hyperparameters are the caller's (the optimizer loads ``param_groups`` itself). ValueError or
    TypeError naming what does not fit, before anything changes; RuntimeError at world size > 1."""
    check_between_steps(parts, "load the optimizer's state")  # a pending step waits aside until the checks pass
    training = parts.training
    assert training is not None
    entries = _checked_entries(parts, sd)
    if entries:
        _check_one_rank(parts, "opt.load_state_dict()")
    extra = sd.get("engine") or {}
    steps = {h.name: s for h, s, _ in entries}
    completed = extra.get("completed_steps", max(steps.values(), default=0))
    if isinstance(completed, bool) or not isinstance(completed, int) or completed < 0:
        raise ValueError(f"state_dict['engine']['completed_steps'] must be an int >= 0, got {completed!r}")
    scaler = training.scaler
    loss_scale = extra.get("loss_scale") if scaler is not None else None
    if loss_scale is not None:
        type(scaler)(scaler.policy).load_state_dict(loss_scale)  # checked on a copy: ValueError changes nothing
    training.complete_pending("discard")  # the load replaces the state a step under way started from
    store, config = parts.io.store, parts.config
    written: list[str] = []
    try:
        for handle, _, values in entries:
            master = values.get("master")
            if master is None:
                master = parts.io.read_copy(handle).to(torch.float32)  # the parameter is the master (fp32)
            one_copy = training.master_is_param(handle.name)
            for value, key, is_master in zip((master, values["exp_avg"], values["exp_avg_sq"]),
                                             training.staging_keys(handle.name), (True, False, False)):
                as_param = one_copy and is_master
                shard = parts.io.shard_of(handle, value.to(handle.layout.dtype if as_param else torch.float32))
                store.sync.put(key, shard, config.param_tier if as_param else config.optimizer_tier,
                               compress=None if as_param else (True if config.compress_optimizer else None))
                written.append(key)
    except BaseException:
        delete_keys(store, written)
        raise
    # As load_checkpoint: the scale first, so the step record the commit writes carries it; from here
    # on the step record decides what the state is.
    if loss_scale is not None:
        scaler.load_state_dict(loss_scale)
    training.commit_staged(completed, steps)


class EngineWholeState:
    """The reader and loader a bound ``engine.AdamW`` calls (``engine.optim.adamw.WholeState``), over
    ``parts()``: the engine's parts, which raises once the engine is closed."""

    def __init__(self, parts: Callable[[], EngineParts]) -> None:
        self._parts = parts

    def read(self, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
        """:func:`state_dict` of the engine."""
        return state_dict(self._parts(), param_groups)

    def load(self, state_dict: Mapping[str, Any]) -> None:
        """:func:`load_state_dict` into the engine."""
        load_state_dict(self._parts(), state_dict)


# ---------------------------------------------------------------------------- helpers


def _check_one_rank(parts: EngineParts, call: str) -> None:
    if parts.io.world > 1:
        raise RuntimeError(
            f"{call} of engine.AdamW holds the whole optimizer state in one process, but it is sharded over "
            f"{parts.io.world} ranks: save and load it with eng.save_checkpoint(dir) / eng.load_checkpoint(dir), "
            "which every rank calls (each writes its own shards); under accelerate, call "
            "register_engine_state(accelerator, eng) before prepare, and save_state / load_state carry it"
        )


def _indexed_handles(parts: EngineParts) -> list[tuple[int, Optional[ParamHandle]]]:
    """(torch's index, handle) of every parameter in the optimizer's groups, in their order."""
    by_id = {id(h.param): h for h in parts.handles}
    params = [p for group in parts.optimizer.param_groups for p in group["params"]]  # type: ignore[union-attr]
    return [(i, by_id.get(id(p))) for i, p in enumerate(params)]


def _check_fits(with_state: list[tuple[int, ParamHandle]]) -> None:
    nbytes = sum(h.layout.numel * 4 * 3 for _, h in with_state)
    sizes = memory_sizes()
    if sizes is not None and nbytes > MEMORY_SHARE * sizes[1]:
        raise RuntimeError(
            f"opt.state_dict() would hold the whole optimizer state in memory: {format_bytes(nbytes)} of fp32 "
            f"moments and masters, more than {MEMORY_SHARE:.0%} of the {format_bytes(sizes[1])} available. Save "
            "it with eng.save_checkpoint(dir) (streamed from the store, one entry at a time) and resume with "
            "eng.load_checkpoint(dir); under accelerate, call register_engine_state(accelerator, eng) before prepare"
        )


def _whole(parts: EngineParts, handle: ParamHandle, key: str) -> torch.Tensor:
    return parts.io.read_copy(handle, key, torch.float32).to("cpu")


def _checked_entries(parts: EngineParts, sd: Mapping[str, Any]
                     ) -> list[tuple[ParamHandle, int, dict[str, torch.Tensor]]]:
    """(handle, step count, {exp_avg, exp_avg_sq[, master]}) per parameter ``sd`` has state for,
    every value checked."""
    state = sd.get("state", {})
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict['state'] must map parameter indices to their state, got {type(state).__name__}")
    indexed = dict(_indexed_handles(parts))
    out = []
    for index, values in state.items():
        handle = indexed.get(index) if isinstance(index, int) else None
        if handle is None:
            raise ValueError(f"state_dict['state'] has an entry {index!r} that is not the index of one of the "
                             f"optimizer's {len(indexed)} parameters")
        if not handle.trainable:
            raise ValueError(f"state_dict['state'][{index}] is for {handle.name!r}, which takes no gradient")
        if not isinstance(values, Mapping) or not all(k in values for k in ("step", *MOMENTS)):
            got = sorted(values) if isinstance(values, Mapping) else values
            raise ValueError(f"state_dict['state'][{index}] ({handle.name!r}) must have 'step', 'exp_avg' and "
                             f"'exp_avg_sq' (AdamW's state), got {got!r}")
        step = values["step"]
        step = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
        if isinstance(step, bool) or not isinstance(step, (int, float)) or step < 0 or step != int(step):
            raise ValueError(f"state_dict['state'][{index}]['step'] ({handle.name!r}) must be a whole number of "
                             f"steps >= 0, got {values['step']!r}")
        tensors = {}
        for name in (*MOMENTS, "master"):
            value = values.get(name)
            if value is None and name == "master":
                continue
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise TypeError(f"state_dict['state'][{index}][{name!r}] ({handle.name!r}) must be a floating "
                                f"tensor, got {type(value).__name__}")
            if tuple(value.shape) != tuple(handle.layout.shape):
                raise ValueError(f"state_dict['state'][{index}][{name!r}] has shape {tuple(value.shape)}, but "
                                 f"{handle.name!r} has shape {tuple(handle.layout.shape)}")
            tensors[name] = value.detach()
        out.append((handle, int(step), tensors))
    return out


__all__ = ["MEMORY_SHARE", "EngineWholeState", "load_state_dict", "state_dict"]
