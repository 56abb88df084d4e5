"""Casting a model's floating-point forward inputs to the training dtype (``cast_forward_inputs``).

With ``train_dtype="float16"`` (or bfloat16) wrap casts the parameters; a caller's fp32 inputs
then meet fp16 weights and the first matmul raises. DeepSpeed's ``fp16.auto_cast`` and FSDP2's
``MixedPrecisionPolicy(cast_forward_inputs=True)`` cast the inputs instead: a forward pre-hook on
the root module casts every floating tensor among the positional and keyword arguments (inside
tuples, lists and dicts too); integer tensors (token ids), other objects and tensors already in
the dtype pass unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class InputCast:
    """The root module's forward pre-hook; :meth:`remove` takes it off."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        assert dtype.is_floating_point, dtype
        self.dtype = dtype
        self._handle = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._cast(args), self._cast(kwargs)

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.dtype) if value.is_floating_point() and value.dtype != self.dtype else value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple keeps its type
            return type(value)(*(self._cast(v) for v in value))
        if isinstance(value, (tuple, list)):
            return type(value)(self._cast(v) for v in value)
        if isinstance(value, dict):
            return {k: self._cast(v) for k, v in value.items()}
        return value

    def remove(self) -> None:
        """Take the hook off the module."""
        self._handle.remove()
