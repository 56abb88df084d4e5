"""Value types of the offloaded optimizer step: shard descriptors, hyperparameters, step stats."""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Union

import torch

FP32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class OptimShard:
    """One rank's shard of one parameter, as the optimizer step sees it: where its pieces live in
    the store. Every key is a store key; the caller picks the names.

    ``param_key`` holds the shard in the training dtype (read to create the fp32 master on the
    first step, written with the updated values after every step). ``grad_key`` holds the fp32
    gradient shard; a missing grad key means the parameter got no gradient this step and is
    skipped, as torch skips parameters whose ``.grad`` is None. ``master_key``, ``exp_avg_key``
    and ``exp_avg_sq_key`` hold the fp32 master weights and Adam moments. ``group`` indexes the
    hyperparameter groups (``AdamW.param_groups``) the shard belongs to.

    ``master_key`` may be ``param_key`` itself when the training dtype is fp32: the parameter is
    then its own master ([Note: One copy of fp32 weights]) and the step writes it once, with the
    moments. ``state_out_keys``: where the step writes the updated master, ``exp_avg`` and
    ``exp_avg_sq`` (None: back into the keys it read); the engine uses it only for state in host
    memory that is not updated in place (two key sets, so a step that raises leaves the last one whole).
    """

    name: str
    numel: int
    train_dtype: torch.dtype
    param_key: str
    grad_key: str
    master_key: str
    exp_avg_key: str
    exp_avg_sq_key: str
    group: int = 0
    state_out_keys: Optional[tuple[str, str, str]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"OptimShard.name must be a non-empty string, got {self.name!r}")
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 1:
            raise ValueError(f"OptimShard {self.name!r}: numel must be an int >= 1, got {self.numel!r}")
        if not isinstance(self.train_dtype, torch.dtype) or not self.train_dtype.is_floating_point:
            raise ValueError(
                f"OptimShard {self.name!r}: train_dtype must be a floating torch.dtype, got {self.train_dtype!r}"
            )
        keys = self.keys()
        for key in keys:
            if not isinstance(key, str) or not key:
                raise ValueError(f"OptimShard {self.name!r}: store keys must be non-empty strings, got {key!r}")
        distinct = keys[1:] if self.master_is_param else keys
        if len(set(distinct)) != len(distinct):
            raise ValueError(f"OptimShard {self.name!r}: its store keys must differ (only the master may be the "
                             f"parameter's key), got {keys}")
        if self.master_is_param and self.train_dtype != torch.float32:
            raise ValueError(f"OptimShard {self.name!r}: the master may be the parameter's own key only when it is "
                             f"fp32, but train_dtype is {self.train_dtype}")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 0:
            raise ValueError(f"OptimShard {self.name!r}: group must be an int >= 0, got {self.group!r}")
        if self.state_out_keys is not None:
            out = self.state_out_keys
            if not isinstance(out, tuple) or len(out) != 3 or not all(isinstance(k, str) and k for k in out):
                raise ValueError(
                    f"OptimShard {self.name!r}: state_out_keys must be None or three non-empty strings, got {out!r}"
                )
            if self.master_is_param:
                raise ValueError(f"OptimShard {self.name!r}: a master that is the parameter's key is written in "
                                 "place, so state_out_keys must be None")
            if len(set(out)) != 3 or set(out) & {self.param_key, self.grad_key}:
                raise ValueError(
                    f"OptimShard {self.name!r}: state_out_keys must differ from each other and from the param and "
                    f"grad keys, got {out}"
                )

    @property
    def master_is_param(self) -> bool:
        """True when the fp32 master is the parameter's own entry (``master_key == param_key``)."""
        return self.master_key == self.param_key

    def keys(self) -> tuple[str, str, str, str, str]:
        """The shard's store keys: param, grad, master, exp_avg, exp_avg_sq."""
        return (self.param_key, self.grad_key, self.master_key, self.exp_avg_key, self.exp_avg_sq_key)

    @property
    def out_keys(self) -> tuple[str, str, str]:
        """Where the step writes the updated master, exp_avg and exp_avg_sq."""
        if self.state_out_keys is not None:
            return self.state_out_keys
        return (self.master_key, self.exp_avg_key, self.exp_avg_sq_key)

    def all_keys(self) -> tuple[str, ...]:
        """Every store key the shard reads or writes, each once."""
        return tuple(dict.fromkeys((*self.keys(), *self.out_keys)))

    def state_keys(self) -> tuple[str, ...]:
        """The keys of the optimizer state the step reads beside the gradient: the master (unless it is
        the parameter), exp_avg and exp_avg_sq."""
        keys = (self.master_key, self.exp_avg_key, self.exp_avg_sq_key)
        return keys[1:] if self.master_is_param else keys

    @property
    def fp32_bytes(self) -> int:
        """Bytes of one fp32 tensor of this shard (the master, a moment or the gradient)."""
        return self.numel * FP32_BYTES


@dataclasses.dataclass(frozen=True)
class AdamHyper:
    """AdamW hyperparameters of one parameter group, read from ``AdamW.param_groups`` at each step
    (so an LR scheduler's changes take effect). ``foreach``/``fused`` pick torch's math path exactly
    as they do for ``torch.optim.AdamW``; None is torch's default (the single-tensor path on CPU)."""

    lr: Union[float, torch.Tensor] = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-2
    foreach: Optional[bool] = None
    fused: Optional[bool] = None

    def __post_init__(self) -> None:
        lr = float(self.lr) if isinstance(self.lr, torch.Tensor) else self.lr
        _check_number("lr", lr, low=0.0)
        _check_number("beta1", self.beta1, low=0.0, high=1.0)
        _check_number("beta2", self.beta2, low=0.0, high=1.0)
        _check_number("eps", self.eps, low=0.0)
        _check_number("weight_decay", self.weight_decay, low=0.0)
        if self.foreach and self.fused:
            raise ValueError("AdamHyper: foreach and fused cannot both be True")


def _check_number(name: str, value: object, *, low: float, high: Optional[float] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"AdamW {name} must be a number, got {value!r}")
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"AdamW {name} must be {bound}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class OptimStepStats:
    """What one offloaded optimizer step did and what it cost.

    ``bytes_read``/``bytes_written`` are logical tensor bytes moved through the store (before any
    compression); ``io_stall_seconds`` is the part of ``seconds`` the step spent waiting for reads
    or writes that had not finished (0 when the pipeline hid all I/O behind the AdamW math).
    ``step_counts`` maps every shard name to the number of updates it has taken after this step
    (pass it back as ``steps`` next time).
    """

    seconds: float
    bytes_read: int
    bytes_written: int
    io_stall_seconds: float
    update_seconds: float
    groups: int
    shards_updated: int
    shards_skipped: int
    grad_norm: Optional[float]
    clip_coef: Optional[float]
    step_counts: Mapping[str, int]
