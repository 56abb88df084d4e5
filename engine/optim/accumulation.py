"""Gradient accumulation counted by the engine, as DeepSpeed's engine counts it.

With ``EngineConfig.gradient_accumulation_steps = N`` a training loop calls ``eng.backward(loss)``
and ``eng.step()`` once per micro-batch, as a DeepSpeed loop calls ``model_engine.backward`` and
``model_engine.step``: backward divides the loss by N, and only every N-th ``eng.step()`` steps the
optimizer, then zeroes the gradients for the next window. Between those, gradients accumulate
into their stored fp32 shards.

Two mistakes would change training silently, so they are refused: a ``loss.backward()`` of its
own (the loss not divided by N) and an ``eng.zero_grad()`` inside a window (the micro-batches
accumulated so far dropped).
"""

from __future__ import annotations

import torch


class GradientAccumulation:
    """The micro-batch count of one engine and the checks that keep a window whole."""

    def __init__(self, steps: int) -> None:
        assert steps >= 1, steps
        self.steps = steps
        #: ``eng.step()`` calls so far; the optimizer stepped on every ``steps``-th.
        self.micro_steps = 0
        #: True while ``eng.backward`` runs (gradients of any other backward are refused).
        self.in_engine_backward = False

    @property
    def managed(self) -> bool:
        """True when the engine counts micro-batches (``steps`` > 1)."""
        return self.steps > 1

    def divide(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss ``eng.backward`` differentiates: ``loss / steps``, as DeepSpeed divides it."""
        return loss / self.steps if self.managed else loss

    def is_boundary(self) -> bool:
        """True when the next ``eng.step()`` steps the optimizer."""
        return (self.micro_steps + 1) % self.steps == 0

    def count_step(self) -> None:
        """One ``eng.step()`` call has completed (a boundary's optimizer step included)."""
        self.micro_steps += 1

    def restart_window(self) -> None:
        """The window's gradients were dropped (a step that failed and must run its batch again): the
        next ``eng.backward`` is the window's first micro-batch again."""
        self.micro_steps -= self.micro_steps % self.steps

    def check_zero_grad(self) -> None:
        """Refuse ``eng.zero_grad()`` while a window holds the gradients of some of its micro-batches."""
        done = self.micro_steps % self.steps
        if self.managed and done:
            raise RuntimeError(
                f"eng.zero_grad() after {done} of {self.steps} micro-batches would drop their accumulated "
                f"gradients: with EngineConfig.gradient_accumulation_steps={self.steps} the engine steps the "
                f"optimizer once every {self.steps} eng.step() calls and zeroes the gradients itself; call "
                "eng.step() after each micro-batch and leave zero_grad() out of the loop"
            )

    def check_final_grad(self) -> None:
        """Refuse a gradient produced outside ``eng.backward`` (its loss was not divided by ``steps``)."""
        if self.managed and not self.in_engine_backward:
            raise RuntimeError(
                f"EngineConfig.gradient_accumulation_steps={self.steps}, so call eng.backward(loss) instead of "
                f"loss.backward(): it divides the loss by {self.steps}, as DeepSpeed's model_engine.backward "
                "does, so the accumulated gradient is the mean over the micro-batches"
            )
