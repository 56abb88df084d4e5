"""Loss scaling for a backward the engine does not call: ``eng.with_loss_scale(loss)``.

``eng.backward(loss)`` scales the loss itself. A training loop that calls ``loss.backward()`` on
its own (the Hugging Face Trainer, through accelerate) gets the same gradients from a loss passed
through :func:`scale_in_backward`: its value is the loss's, so what the loop logs is unchanged,
and its backward multiplies the incoming gradient by the current loss scale, which is
``(loss * scale).backward()`` with the scale applied at the root of the graph.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from engine.optim.training import Training


class _ScaleInBackward(torch.autograd.Function):
    """Identity forward; backward multiplies by the engine's loss scale and marks the backward scaled."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, training: "Training") -> torch.Tensor:
        ctx.training = training
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        training = ctx.training
        if training.scaled_backward:  # inside eng.backward, which scaled the loss already
            return grad, None
        training.scaled_backward = True
        # The gradients this backward makes final are checked against the flag (Training._on_offload),
        # so it holds until the whole backward has run.
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_end_scaled_backward, training))
        assert training.scaler is not None
        return grad * training.scaler.scale, None


def _end_scaled_backward(training: "Training") -> None:
    training.scaled_backward = False


def scale_in_backward(loss: torch.Tensor, training: "Training") -> torch.Tensor:
    """``loss``, whose backward is scaled by ``training``'s current loss scale (read when the
    backward runs, so a step between the forward and the backward is followed)."""
    return _ScaleInBackward.apply(loss, training)
