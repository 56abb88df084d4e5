"""An LR scheduler that holds still for optimizer steps fp16 loss scaling skipped.

DeepSpeed steps its LR scheduler inside ``model_engine.step()`` and not for a step it skipped for
an overflow. A loop that steps the optimizer and the scheduler itself (the Hugging Face Trainer,
accelerate) asks its own loss scaler whether the step was skipped; with the engine's loss scaling
that scaler sees nothing, so :class:`OverflowAwareScheduler` asks the engine instead.
"""

from __future__ import annotations

from typing import Any


class OverflowAwareScheduler:
    """``scheduler``, whose ``step()`` does nothing after an optimizer step ``eng``'s loss scaling
    skipped (every call until the next optimizer step: accelerate's prepared scheduler steps once
    per process). Everything else (``get_last_lr``, ``state_dict``, ...) is ``scheduler``'s. Make it
    after any ``eng.load_checkpoint``, whose step counts it starts from."""

    def __init__(self, scheduler: Any, eng: Any) -> None:
        self.scheduler = scheduler
        self._engine = eng
        self._steps_seen = self._optimizer_steps()
        self._skipped_seen = eng.skipped_steps
        self._hold = False

    def _optimizer_steps(self) -> int:
        return self._engine.completed_steps + self._engine.skipped_steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance ``scheduler``, unless the last optimizer step was skipped."""
        steps = self._optimizer_steps()
        if steps != self._steps_seen:  # the optimizer stepped since the last look: was it skipped?
            skipped = self._engine.skipped_steps
            self._hold = skipped != self._skipped_seen
            self._steps_seen, self._skipped_seen = steps, skipped
        if not self._hold:
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        """``scheduler.get_last_lr()``."""
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """``scheduler.state_dict()`` (what a Trainer or accelerate saves)."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``scheduler.load_state_dict(state)``."""
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (an object made without __init__, as copy and pickle do)
            raise AttributeError(name)
        return getattr(self.scheduler, name)
