"""DeepSpeed's warmup LR schedules as torch LR schedulers, giving the same learning rate as
DeepSpeed's own classes (``deepspeed/runtime/lr_schedules.py``) after the same number of steps.

DeepSpeed counts ``last_batch_iteration`` from -1 after construction; torch counts ``last_epoch``
from 0 (its constructor takes one step). So DeepSpeed's iteration is ``last_epoch - 1`` here.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

WARMUP_TYPES = ("log", "linear")
Number = Union[float, int]


class _Warmup(LRScheduler):
    """Shared warmup state: a log or linear ramp over ``warmup_num_steps`` (at least 2)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, warmup_type: str) -> None:
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
        if warmup_type not in WARMUP_TYPES:
            raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer)

    @property
    def iteration(self) -> int:
        """DeepSpeed's ``last_batch_iteration``."""
        return self.last_epoch - 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's state dict, or DeepSpeed's own ``{"last_batch_iteration": n}`` (its checkpoints keep
        that; an imported one returns it as ``client_state["lr_scheduler"]``): the schedule goes on
        from iteration ``n`` and the groups take its learning rates now. Build the scheduler before
        ``eng.load_checkpoint``, as DeepSpeed does: WarmupCosineLR scales the lr the groups have then."""
        if "last_epoch" in state_dict or "last_batch_iteration" not in state_dict:
            super().load_state_dict(state_dict)
            return
        iteration = state_dict["last_batch_iteration"]
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < -1:
            raise ValueError(f"last_batch_iteration must be an int >= -1, got {iteration!r}")
        self.last_epoch = iteration + 1
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = list(lrs)

    def _warmup_gamma(self, it: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(it + 1)
        return it / self.warmup_num_steps


def _per_group(optimizer: torch.optim.Optimizer, value: Union[Number, Sequence[Number]], name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name} has {len(value)} values for {groups} parameter groups")
        return [float(v) for v in value]
    return [float(value)] * groups


class WarmupLR(_Warmup):
    """DeepSpeed's WarmupLR: from ``warmup_min_lr`` up to ``warmup_max_lr`` (default: the group's
    lr) over ``warmup_num_steps`` steps, log or linear, then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Union[Number, Sequence[Number]] = 0.0,
                 warmup_max_lr: Optional[Union[Number, Sequence[Number]]] = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log") -> None:
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """The learning rate of each group at the current iteration."""
        if self.iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs)]

    def _gamma(self) -> float:
        it = self.iteration
        return self._warmup_gamma(it) if it < self.warmup_num_steps else 1.0


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR, then a linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: Union[Number, Sequence[Number]] = 0.0,
                 warmup_max_lr: Union[Number, Sequence[Number]] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log") -> None:
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps < 0:
            raise ValueError(f"total_num_steps must be an integer >= 0, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _gamma(self) -> float:
        it = self.iteration
        if it < self.warmup_num_steps:
            return self._warmup_gamma(it)
        decay_steps = float(max(1.0, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - it) / decay_steps)


class WarmupCosineLR(_Warmup):
    """DeepSpeed's WarmupCosineLR: the group's lr times a ratio that warms up from
    ``warmup_min_ratio`` to 1, then follows a cosine down to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log") -> None:
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps < 0:
            raise ValueError(f"total_num_steps must be an integer >= 0, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, warmup_num_steps, warmup_type)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """The learning rate of each group at the current iteration."""
        if self.iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self._ratio()
        return [org_lr * ratio for org_lr in self.org_lrs]

    def _ratio(self) -> float:
        it = self.iteration
        if it < self.warmup_num_steps:
            ratio = self._warmup_gamma(it)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = it - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)
