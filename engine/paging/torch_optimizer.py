"""TorchOptimizerHooks: a plain ``torch.optim.Optimizer`` built on the model's parameters keeps working.

Before its ``step()``, every managed parameter that has a gradient is fetched (in parallel) into
its own storage; after the step, each is written back to the store and released. Parameters
without a gradient are skipped, as torch's optimizers skip them. All of them are materialized
during the step: for models larger than memory use the engine's own offloaded optimizer.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.paging.handle import ParamHandle
from engine.paging.pager import Pager


class TorchOptimizerHooks:
    """Step pre/post hooks on one optimizer."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        by_id: dict[int, ParamHandle],
        pager: Pager,
    ) -> None:
        self._optimizer = optimizer
        self._by_id = by_id
        self._pager = pager
        self._held: list[ParamHandle] = []
        self._removers = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    def remove(self) -> None:
        """Unregister the hooks."""
        for remover in self._removers:
            remover.remove()
        self._removers = []

    def drop(self) -> None:
        """Release what a step that raised left held, without writing it back: the store keeps the
        values from before that step."""
        held, self._held = self._held, []
        for handle in held:
            self._pager.release(handle)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.drop()
        handles = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                handle = self._by_id.get(id(param))
                if handle is not None and param.grad is not None:
                    handles[handle] = None
        self._pager.materialize(handles)
        self._held = list(handles)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        held, self._held = self._held, []
        try:
            self._pager.write_back(held)
        finally:
            for handle in held:
                self._pager.release(handle)
