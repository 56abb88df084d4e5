"""LossScaler: the running loss scale of one fp16 training run, after the policy in
:class:`engine.config.LossScaling`.

fp16 gradients underflow to zero below 6e-8, so the loss is multiplied by a scale before backward
(``eng.backward(loss)``) and the fp32 gradient shards are multiplied by its inverse in the step.
A step whose gradients hold an inf or a NaN (the global gradient norm is not finite) is skipped:
nothing is updated, the gradients are dropped, and a dynamic scale is halved. After
``growth_interval`` steps in a row without overflow a dynamic scale doubles. ``hysteresis`` lets
that many overflows pass before the first halving, as DeepSpeed's ``fp16.hysteresis`` does.

Scales stay powers of two (the initial scale must be one when dynamic), so unscaling is exact and
the step equals ``torch.amp.GradScaler`` + ``torch.optim.AdamW`` bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from engine.config.loss_scaling import LossScaling


class LossScaler:
    """The running scale of one training run: what :meth:`update` does after each step."""

    def __init__(self, policy: LossScaling) -> None:
        if not isinstance(policy, LossScaling):
            raise TypeError(f"policy must be an engine.LossScaling, got {type(policy).__name__}")
        self.policy = policy
        #: The current scale.
        self.scale = float(policy.initial_scale)
        #: Steps without overflow since the last overflow or growth.
        self.good_steps = 0
        #: Overflows still tolerated before the next halving.
        self.hysteresis_left = policy.hysteresis
        #: Steps skipped for overflow over the whole run.
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        """Account for one step: skipped for an inf/NaN gradient (``overflow``) or taken."""
        p = self.policy
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            if not p.dynamic:
                return
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, float(p.min_scale))
            else:
                self.hysteresis_left -= 1
            return
        if not p.dynamic:
            return
        self.good_steps += 1
        if p.consecutive_hysteresis:
            self.hysteresis_left = p.hysteresis
        if self.good_steps >= p.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0
            self.hysteresis_left = p.hysteresis

    def state_dict(self) -> dict[str, Any]:
        """The running state, JSON-serializable (checkpoints and the step record carry it)."""
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis_left": self.hysteresis_left,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ValueError naming the field when it does not fit."""
        try:
            scale = float(state["scale"])
            counts = {k: state[k] for k in ("good_steps", "hysteresis_left", "skipped_steps")}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a loss scaler state: {state!r} ({exc})") from exc
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scaler state: scale must be a finite number > 0, got {state['scale']!r}")
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"loss scaler state: {name} must be an int >= 0, got {value!r}")
        self.scale = scale
        self.good_steps = counts["good_steps"]
        self.hysteresis_left = counts["hysteresis_left"]
        self.skipped_steps = counts["skipped_steps"]

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.scale!r}, good_steps={self.good_steps}, skipped_steps={self.skipped_steps})"
