"""Hugging Face's weight initialization, one module at a time: :func:`hf_initializers` and :class:`InitScope`.

A Hugging Face model built for real initializes in two passes: each module's constructor runs its
``reset_parameters()``, then ``post_init`` applies the model's ``_init_weights`` to every module,
children before parents. A parent's call often reaches into its children (GPT-2 scales its
attention's and MLP's ``c_proj.weight``, CLIP its ``q_proj``/``k_proj``/``v_proj``, T5 its ``wo``),
and the parent's word is the last. Wrap places a meta-device model one module at a time, so when a
module is placed it runs, for that module, the module's own initializer and then each enclosing
module's, innermost first: the same last word. While they run an :class:`InitScope` shows every
other tensor of the model as a meta tensor of its shape and dtype, so what the initializers do to
modules placed earlier (already in the store) or later (still on the meta device) does nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

Initializer = Callable[[nn.Module], None]


def hf_initializers(model: nn.Module, prefix: str) -> list[tuple[Initializer, nn.Module]]:
    """``(initializer, module)`` pairs to run for the module at ``prefix`` after its
    ``reset_parameters()``: that module and each enclosing one, innermost first, each with the
    ``_init_weights`` of the nearest Hugging Face model holding it (a composite model's sub-models
    keep their own, as transformers' ``smart_apply`` does). Empty for a model without one."""
    parts = prefix.split(".") if prefix else []
    chain = [model.get_submodule(".".join(parts[:depth])) for depth in range(len(parts), -1, -1)]
    pairs: list[tuple[Initializer, nn.Module]] = []
    for at, module in enumerate(chain):
        init = next((i for i in map(_own_initializer, chain[at:]) if i is not None), None)
        if init is not None:
            pairs.append((init, module))
    return pairs


def _own_initializer(module: nn.Module) -> Optional[Initializer]:
    init = getattr(module, "_init_weights", None)
    return init if callable(init) else None


class InitScope(TorchFunctionMode):
    """Inside it, the tensors whose ids are in ``tensors`` but not in ``own`` take part in torch
    calls as meta tensors of their shape and dtype: writes to them and reads of them do nothing,
    their metadata answers."""

    def __init__(self, tensors: "set[int] | frozenset[int]", own: "set[int] | frozenset[int]") -> None:
        super().__init__()
        self._tensors = tensors
        self._own = own
        self._stand_ins: dict[int, torch.Tensor] = {}

    def _is_other(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._tensors and id(tensor) not in self._own

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if _any_tensor(args, self._is_other) or _any_tensor(kwargs, self._is_other):
            args, kwargs = self._replace(args), self._replace(kwargs)
        return func(*args, **kwargs)

    def _replace(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if not self._is_other(value):
                return value
            stand_in = self._stand_ins.get(id(value))
            if stand_in is None:
                stand_in = self._stand_ins[id(value)] = torch.empty(value.shape, dtype=value.dtype, device="meta")
            return stand_in
        if isinstance(value, list):
            return [self._replace(v) for v in value]
        if isinstance(value, tuple):
            items = [self._replace(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if isinstance(value, dict):
            return {k: self._replace(v) for k, v in value.items()}
        return value


def _any_tensor(value: Any, test: Callable[[torch.Tensor], bool]) -> bool:
    if isinstance(value, torch.Tensor):
        return test(value)
    if isinstance(value, (list, tuple)):
        return any(_any_tensor(v, test) for v in value)
    if isinstance(value, dict):
        return any(_any_tensor(v, test) for v in value.values())
    return False


__all__ = ["InitScope", "hf_initializers"]
