"""One parameter's whole training state, read or set between steps: the engine's counterpart of
DeepSpeed's ZeRO-3 debugging calls in ``deepspeed.utils`` (``safe_get_full_fp32_param``,
``safe_get_full_grad``, ``safe_get_full_optimizer_state`` and the ``safe_set_full_*`` ones), which
``Engine`` exposes as methods.

With ``engine.AdamW`` the state is in the store, one shard per rank: the fp32 master weight, the
fp32 gradient the next step will use (``grad/<name>``) and the two Adam moments. A read gathers
every rank's shard (a collective at world size > 1: every rank calls it for the same parameters in
the same order, as DeepSpeed requires); a set writes this rank's shard of the whole value each rank
passes. With a torch optimizer the state is where torch keeps it: ``param.grad`` and
``optimizer.state[param]``.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.checkpoint.sharded import EngineParts, check_between_steps
from engine.paging.handle import ParamHandle
from engine.paging.layout import grad_key

#: The optimizer state ``engine.AdamW`` keeps per parameter (the names torch's AdamW uses).
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def full_fp32_param(parts: EngineParts, handle: ParamHandle) -> Optional[torch.Tensor]:
    """The fp32 weights the next step starts from: the master weight, or, before the parameter's
    first step (or with a torch optimizer), its value in fp32. None for a frozen parameter."""
    check_between_steps(parts, "read a parameter's fp32 weights")
    if not handle.trainable:
        return None
    master = _master_key(parts, handle)
    if master is not None:
        return parts.io.read_copy(handle, master, torch.float32)
    return parts.io.read_copy(handle).to(torch.float32)


def full_grad(parts: EngineParts, handle: ParamHandle) -> Optional[torch.Tensor]:
    """The fp32 gradient the next step will use (accumulated, averaged over ranks, without the loss
    scale), or None when there is none (a frozen parameter, or none since the last step or
    ``zero_grad``)."""
    if parts.training is not None:
        parts.training.gradients_readable("read a parameter's gradient")
    check_between_steps(parts, "read a parameter's gradient")
    if parts.training is None:
        grad = handle.param.grad
        return None if grad is None else grad.detach().to(torch.float32, copy=True)
    grads = parts.training.grads
    if not handle.trainable or not grads.current(handle.name):
        return None
    grad = parts.io.read_copy(handle, grad_key(handle.name), torch.float32).float()
    scaler = parts.training.scaler
    return grad.div_(scaler.scale) if scaler is not None else grad


def full_optimizer_state(parts: EngineParts, handle: ParamHandle, key: str) -> Optional[torch.Tensor]:
    """The optimizer's state ``key`` of the parameter, whole. ``engine.AdamW``: ``"exp_avg"`` or
    ``"exp_avg_sq"``, zeros before the parameter's first step (what that step starts from). A torch
    optimizer: a copy of ``optimizer.state[param][key]`` (None where it has none yet). None for a
    frozen parameter or without an optimizer."""
    check_between_steps(parts, "read a parameter's optimizer state")
    if parts.training is None:
        value = parts.optimizer.state.get(handle.param, {}).get(key) if parts.optimizer is not None else None
        return value.detach().clone() if isinstance(value, torch.Tensor) else None
    _check_adam_key(key)
    if not handle.trainable:
        return None
    if _master_key(parts, handle) is None:
        return torch.zeros(handle.layout.shape, dtype=torch.float32, device=handle.flat.device)
    return parts.io.read_copy(handle, _state_keys(parts, handle)[key], torch.float32)


def set_full_fp32_param(parts: EngineParts, handle: ParamHandle, value: torch.Tensor) -> None:
    """Make ``value`` (checked: the parameter's shape) the fp32 master weight, where the next step
    starts. The caller writes the parameter itself (cast to the training dtype: the next forward
    uses it), which it holds meanwhile, and calls this from that write-back. Before the parameter's
    first step there is no master yet: that step makes it from the parameter."""
    master = _master_key(parts, handle)
    if master is not None and master != handle.key:  # a parameter that is its own master was just written
        shard = parts.io.shard_of(handle, value.detach().to(torch.float32))
        parts.io.store.sync.put(master, shard, parts.config.optimizer_tier, compress=_compress(parts))


def set_full_grad(parts: EngineParts, handle: ParamHandle, value: torch.Tensor) -> None:
    """Make ``value`` (the parameter's shape) the gradient the next step uses, as
    ``param.grad.copy_(value)`` before a plain step; a later backward adds to it."""
    if parts.training is not None:
        parts.training.gradients_readable("set a parameter's gradient")
    check_between_steps(parts, "set a parameter's gradient", intent="write")
    check_value(handle, value)
    _check_trainable(handle, "a gradient")
    if parts.training is None:
        grad = value.detach().to(handle.param.dtype, copy=True).to(handle.param.device)
        handle.param.grad = grad
        return
    shard = parts.io.shard_of(handle, value.detach().to(torch.float32))
    scaler = parts.training.scaler
    parts.training.grads.replace(handle, shard.mul(scaler.scale) if scaler is not None else shard.clone())


def set_full_optimizer_state(parts: EngineParts, handle: ParamHandle, value: torch.Tensor, key: str) -> None:
    """Make ``value`` (the parameter's shape) the optimizer's state ``key`` of the parameter. With
    ``engine.AdamW`` the state exists once the parameter has taken a step (RuntimeError before)."""
    check_between_steps(parts, "set a parameter's optimizer state", intent="write")
    check_value(handle, value)
    _check_trainable(handle, "optimizer state")
    if parts.training is None:
        state = parts.optimizer.state.get(handle.param, {}) if parts.optimizer is not None else {}
        if not isinstance(state.get(key), torch.Tensor):
            raise RuntimeError(f"the optimizer has no state {key!r} for {handle.name!r} (yet): torch optimizers make "
                               f"it at the parameter's first step")
        with torch.no_grad():
            state[key].copy_(value)
        return
    _check_adam_key(key)
    if _master_key(parts, handle) is None:
        raise RuntimeError(f"{handle.name!r} has no optimizer state yet: engine.AdamW makes it at the parameter's "
                           f"first step (zeros); set it after that step, or load a checkpoint")
    shard = parts.io.shard_of(handle, value.detach().to(torch.float32))
    parts.io.store.sync.put(_state_keys(parts, handle)[key], shard, parts.config.optimizer_tier,
                            compress=_compress(parts))


def check_value(handle: ParamHandle, value: object) -> torch.Tensor:
    """``value`` if it is a tensor of the parameter's shape; TypeError or ValueError otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"the value for {handle.name!r} must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(handle.layout.shape):
        raise ValueError(f"{handle.name!r} has shape {tuple(handle.layout.shape)}; got a value of shape "
                         f"{tuple(value.shape)}")
    return value


def _master_key(parts: EngineParts, handle: ParamHandle) -> Optional[str]:
    """The store key of the parameter's fp32 master, None when it has none (no engine.AdamW, frozen,
    or no step taken yet). The same answer on every rank: each holds a shard of every state."""
    if parts.training is None or not handle.trainable or not parts.training.has_state(handle.name):
        return None
    key = _state_keys(parts, handle)["master"]
    return key if key in parts.io.store else None


def _state_keys(parts: EngineParts, handle: ParamHandle) -> dict[str, str]:
    shard = parts.training.live_shard(handle.name)
    return {"master": shard.master_key, "exp_avg": shard.exp_avg_key, "exp_avg_sq": shard.exp_avg_sq_key}


def _compress(parts: EngineParts) -> Optional[bool]:
    return True if parts.config.compress_optimizer else None


def _check_adam_key(key: str) -> None:
    if key not in ADAM_STATE_KEYS:
        raise ValueError(f"engine.AdamW keeps the optimizer states {ADAM_STATE_KEYS}; got {key!r}")


def _check_trainable(handle: ParamHandle, what: str) -> None:
    if not handle.trainable:
        raise ValueError(f"{handle.name!r} takes no gradient (requires_grad=False), so it has no {what}")


__all__ = [
    "ADAM_STATE_KEYS", "check_value", "full_fp32_param", "full_grad", "full_optimizer_state", "set_full_fp32_param",
    "set_full_grad", "set_full_optimizer_state",
]
