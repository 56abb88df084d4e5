"""The root module's forward inputs, moved to the compute device and cast to the training dtype.

The engine computes on ``EngineConfig.compute_device`` (``engine.initialize`` picks
``cuda:<local rank>`` for a model built on the CPU, as DeepSpeed moves it), so a script that feeds
the batch it loaded on the CPU would meet the first kernel with tensors on two devices. FSDP2's
root pre-forward and accelerate's ``AlignDevicesHook`` move the inputs instead, and so does a
forward pre-hook on the root module here: every tensor among the positional and keyword arguments
(inside tuples, lists and dicts too) goes to the compute device when that is an accelerator.

With ``train_dtype="float16"`` (or bfloat16) wrap casts the parameters; a caller's fp32 inputs
then meet fp16 weights and the first matmul raises. DeepSpeed's ``fp16.auto_cast`` and FSDP2's
``MixedPrecisionPolicy(cast_forward_inputs=True)`` cast the inputs instead: with
``cast_forward_inputs`` the same hook casts every floating tensor to the training dtype; integer
tensors (token ids), other objects and tensors already in the dtype pass unchanged.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn


class InputCast:
    """The root module's forward pre-hook moving tensor inputs to ``device`` (None: where they are)
    and casting floating ones to ``dtype`` (None: as they are); :meth:`remove` takes it off."""

    def __init__(self, model: nn.Module, dtype: Optional[torch.dtype], device: Optional[torch.device]) -> None:
        assert dtype is None or dtype.is_floating_point, dtype
        assert dtype is not None or device is not None, "a hook that changes nothing"
        self.dtype = dtype
        self.device = device
        self._handle = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._cast(args), self._cast(kwargs)

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            dtype = self.dtype if self.dtype is not None and value.is_floating_point() else None
            return value.to(device=self.device, dtype=dtype)  # the same tensor when nothing changes
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple keeps its type
            return type(value)(*(self._cast(v) for v in value))
        if isinstance(value, (tuple, list)):
            return type(value)(self._cast(v) for v in value)
        if type(value) is dict:
            return {k: self._cast(v) for k, v in value.items()}
        if isinstance(value, dict):  # OrderedDict, a transformers ModelOutput: a copy of the same type
            moved = copy.copy(value)
            for k, v in value.items():
                moved[k] = self._cast(v)
            return moved
        return value

    def remove(self) -> None:
        """Take the hook off the module."""
        self._handle.remove()
