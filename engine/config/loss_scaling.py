"""LossScaling: how the engine scales the loss in fp16 training (``EngineConfig.loss_scaling``).

The policy is a frozen value here, beside the configuration that holds it; the running scale of a
training run is :class:`engine.optim.loss_scaler.LossScaler`.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """How the engine scales the loss (``EngineConfig.loss_scaling``); DeepSpeed's ``fp16`` section.

    ``dynamic=False`` keeps ``initial_scale`` for the whole run (DeepSpeed's ``loss_scale`` > 0);
    overflowing steps are still skipped.
    """

    #: The scale of the first step (DeepSpeed: 2 ** ``initial_scale_power``, default 2 ** 16).
    initial_scale: float = 2.0**16
    #: Adjust the scale from overflows (True) or keep ``initial_scale`` (False).
    dynamic: bool = True
    #: Steps in a row without overflow after which the scale doubles (DeepSpeed ``loss_scale_window``).
    growth_interval: int = 1000
    #: Overflows tolerated before the scale is first halved (DeepSpeed ``hysteresis``; 1 halves at once).
    hysteresis: int = 2
    #: Restore the hysteresis after every good step rather than only when the scale grows
    #: (DeepSpeed ``consecutive_hysteresis``).
    consecutive_hysteresis: bool = False
    #: The scale never goes below this (DeepSpeed ``min_loss_scale``).
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("initial_scale", "min_scale"):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, (int, float))
            if not (number and math.isfinite(value) and value > 0):
                raise ValueError(f"LossScaling.{name} must be a finite number > 0, got {value!r}")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LossScaling.{name} must be an int >= 1, got {value!r}")
        for name in ("dynamic", "consecutive_hysteresis"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LossScaling.{name} must be True or False, got {getattr(self, name)!r}")
        if self.dynamic:
            for name in ("initial_scale", "min_scale"):
                value = float(getattr(self, name))
                if math.frexp(value)[0] != 0.5:
                    raise ValueError(
                        f"LossScaling.{name} must be a power of two when dynamic (so unscaling is exact), got {value!r}"
                    )
            if self.min_scale > self.initial_scale:
                raise ValueError(
                    f"LossScaling.min_scale ({self.min_scale!r}) is above initial_scale ({self.initial_scale!r})"
                )

    @classmethod
    def static(cls, scale: float) -> "LossScaling":
        """A fixed scale (DeepSpeed ``"loss_scale": scale``)."""
        return cls(initial_scale=scale, dynamic=False)
