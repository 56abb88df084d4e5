"""Released parameters: safe to touch between uses, with a clear error instead of a crash.

A released parameter keeps its identity, shape, dtype and device, but its storage is 0 bytes (the
values are in the store). Torch's kernels do not check storage bounds, so reading it (``p + 1``,
``print(p)``, ``p.to(...)``) would read a null pointer. While released, the parameter's class is
therefore a subclass of its own class (made by :func:`released_class`) whose ``__torch_function__``
lets metadata through (``shape``, ``dtype``, ``device``, ``grad``, ``requires_grad``, ``numel``,
hooks, ...) and raises :class:`ReleasedParameterError` for every op that would read or write the
values. ``repr`` says what the parameter is and how to read it. The object, its ``__dict__``, its
autograd state (``grad``, hooks) and its C++ tensor are untouched: only ``__class__`` changes, so
nothing autograd or the optimizer holds is affected. Fetching the parameter restores its class.

Inside the wrapped forward the engine's access mode sees a read first and fetches the parameter
(see [Note: Parameters read outside their module] in engine.paging.access_mode), so this class only
ever answers reads from outside the engine's hooks. There it asks the engine's reader (set by
:func:`set_reader`) first: inside a backward, where activation checkpointing re-runs a function
that reads the parameter outside any hooked module, the engine fetches it and holds it for that
backward (see [Note: Activation checkpointing] in engine.paging.module_hooks); anywhere else the
read raises. See [Note: Released parameters] in engine.paging.handle for the storage side.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.parallel.distributed
import torch.nn.utils.clip_grad
from torch import nn

from engine.errors import ReleasedParameterError
from engine.paging.tensor_reads import reads_data

#: Conversions that return the tensor itself when nothing changes (``model.float()`` on a float model).
_DTYPE_CONVERSIONS = {
    "float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
}
#: Functions torch's own module code calls on every parameter that only read metadata.
_ALSO_METADATA = frozenset({"_has_compatible_shallow_copy_type", "is_leaf", "__set_grad__"})
#: Attributes of the released class (set per parameter by :func:`released_class`).
_NAME_ATTR = "_tiered_name"
_CLOSED_ATTR = "_tiered_closed"
_GRADS_ATTR = "_tiered_grads_in_store"
_CLIP_NORM_ATTR = "_tiered_step_clip_norm"
_READER_ATTR = "_tiered_reader"
#: DistributedDataParallel's source file: its constructor broadcasts every parameter's values.
_DDP_FILE = torch.nn.parallel.distributed.__file__
#: torch's gradient clipping (``clip_grad_norm_``, ``clip_grad_value_``), which reads ``param.grad``.
_CLIP_FILE = torch.nn.utils.clip_grad.__file__
#: Its functions that read ``param.grad`` to change it by a 2-norm bound, and the one by a value.
_NORM_CLIPPING = ("clip_grad_norm_", "clip_grad_norm", "_clip_grads_with_norm_")
_VALUE_CLIPPING = "clip_grad_value_"


def released_class(base: type, name: str) -> type:
    """The class a parameter of class ``base`` (``nn.Parameter`` or a subclass) called ``name`` has
    while it is released."""
    assert issubclass(base, nn.Parameter) and not is_released_class(base), base
    return type(
        f"Released{base.__name__}",
        (base,),
        {
            "__torch_function__": classmethod(_torch_function),
            "__repr__": _repr,
            "__module__": __name__,
            _NAME_ATTR: name,
            _CLOSED_ATTR: False,
            _GRADS_ATTR: False,
            _CLIP_NORM_ATTR: None,
            _READER_ATTR: None,
        },
    )


def is_released_class(cls: type) -> bool:
    """True for a class made by :func:`released_class`."""
    return _NAME_ATTR in cls.__dict__


def mark_closed(cls: type) -> None:
    """The engine that released parameters of class ``cls`` was closed: errors say so."""
    assert is_released_class(cls), cls
    setattr(cls, _CLOSED_ATTR, True)


def set_reader(cls: type, reader: Optional[Callable[[], bool]]) -> None:
    """A value read of a parameter of class ``cls`` first calls ``reader()``, which materializes
    the parameter and returns True where the engine allows it (inside a backward), or returns
    False (the read then raises). None: every value read raises (the engine is closing)."""
    assert is_released_class(cls), cls
    setattr(cls, _READER_ATTR, reader)


def mark_grads_in_store(cls: type, step_clip_norm: Optional[float]) -> None:
    """Parameters of class ``cls`` have their gradients in the store (``engine.AdamW``), so their
    ``.grad`` stays None, and each step clips them at the 2-norm ``step_clip_norm`` (None: no
    clipping). torch's gradient clipping, which would find nothing there and clip nothing, is
    refused on them unless the step clips as it asks anyway."""
    assert is_released_class(cls), cls
    setattr(cls, _GRADS_ATTR, True)
    setattr(cls, _CLIP_NORM_ATTR, step_clip_norm)


def _torch_function(cls: type, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
    kwargs = kwargs or {}
    name = getattr(func, "__name__", None)
    if name in ("__repr__", "__format__", "__str__"):
        return _repr(args[0]) if name != "__format__" else format(_repr(args[0]), *args[1:])
    descriptor = getattr(getattr(func, "__self__", None), "__name__", None)
    if name == "__set__" and descriptor == "data" and len(args) >= 2 and args[1] is args[0]:
        return None  # `param.data = param`: what nn.Module._apply does after a conversion that changed nothing
    if _is_unchanged_conversion(name, args, kwargs):
        return args[0]
    if name in ("__set__", "__delete__") and descriptor != "data":
        return _run(func, args, kwargs)  # p.grad = None, p.requires_grad = False, ...
    if name == "__get__" and descriptor == "grad" and getattr(cls, _GRADS_ATTR, False) and _clip_lost(cls):
        raise ReleasedParameterError(_clip_message(cls))
    if name in _ALSO_METADATA or not reads_data(func):
        return _run(func, args, kwargs)
    if _materialized_by_readers((*args, *kwargs.values())):
        return func(*args, **kwargs)  # their own classes again: dispatched as plain parameters
    raise ReleasedParameterError(_message(cls, f"{name if descriptor is None else descriptor}"))


def _materialized_by_readers(values: tuple) -> bool:
    """Ask the reader of every released parameter among ``values`` (and lists of them) to
    materialize it; True when each one did."""
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            cls = type(item)
            if is_released_class(cls):
                reader = getattr(cls, _READER_ATTR)
                if reader is None or not reader():
                    return False
    return True


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _is_unchanged_conversion(name: Optional[str], args: tuple, kwargs: dict) -> bool:
    """``p.to(p.device)``, ``p.float()`` on a float parameter, ``p.cpu()`` on a CPU one: torch returns
    the tensor itself, so ``model.to(same device)`` and ``model.float()`` keep working."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    param = args[0]
    if name in _DTYPE_CONVERSIONS:
        return not kwargs and len(args) == 1 and param.dtype == _DTYPE_CONVERSIONS[name]
    if name == "cpu":
        return not kwargs and len(args) == 1 and param.device.type == "cpu"
    if name != "to" or kwargs.get("copy"):
        return False
    try:
        device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(
            *args[1:], **{k: v for k, v in kwargs.items() if k != "copy"}
        )
    except (TypeError, RuntimeError):
        return False
    same_device = device is None or _same_device(torch.device(device), param.device)
    return same_device and dtype in (None, param.dtype) and memory_format in (None, torch.preserve_format)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def _repr(param: Any) -> str:
    cls = type(param)
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype, device = tuple(param.shape), param.dtype, param.device
    state = "closed engine" if getattr(cls, _CLOSED_ATTR, False) else "engine"
    return (
        f"Parameter {getattr(cls, _NAME_ATTR, '?')!r} (released by the tiered {state}: shape={shape}, dtype={dtype}, "
        f"device={device}; read it inside `with eng.gathered():`)"
    )


def _message(cls: type, what: str) -> str:
    name = getattr(cls, _NAME_ATTR, "?")
    if getattr(cls, _CLOSED_ATTR, False):
        return (
            f"parameter {name!r} has no values in memory: the engine that managed it was closed ({what} needs them). "
            "Its values stay in the store directory: use eng.unwrap() instead of eng.close() to keep them in the "
            "model, or wrap the model again (engine.wrap(..., config=EngineConfig(resume=True)) or state_dict=...)"
        )
    if _called_by_ddp():
        return (
            f"parameter {name!r} is released by the tiered engine, and DistributedDataParallel cannot wrap a model "
            "the engine wraps (it reads every parameter's values; accelerate's prepare(model) and the Hugging Face "
            "Trainer apply it under a launcher, even to one process). The engine already shards the parameters and "
            "averages the gradients across ranks: leave the model out of DDP (with accelerate, prepare only the "
            "optimizer and the data loaders, and run the forward in `with accelerator.autocast():` for its "
            "mixed_precision; with the Trainer, use engine.integrations.hf.EngineTrainer; docs/migrating.md)."
        )
    return (
        f"parameter {name!r} is released by the tiered engine: its values are in the store, not in memory, so "
        f"{what} cannot run on it here. Read or change it inside `with eng.gathered([param]):` (add writeback=True "
        "to keep changes), use model.state_dict() / eng.state_dict(), or eng.unwrap() for a plain model again. "
        "Conversions (model.to(...), model.half()) go before engine.wrap (or EngineConfig(train_dtype=...))."
    )


def _clip_message(cls: type) -> str:
    return (
        f"torch.nn.utils' gradient clipping finds no gradient on {getattr(cls, _NAME_ATTR, '?')!r}: with "
        "engine.AdamW the gradients are in the store (param.grad stays None), so it would clip nothing and return "
        "0. Call eng.clip_grad_norm_(max_norm) instead (with accelerate, in place of "
        "accelerator.clip_grad_norm_(model.parameters(), max_norm); with the Hugging Face Trainer, use "
        "engine.integrations.hf.EngineTrainer, which does); eng.full_grad(param) reads a gradient."
    )


def _called_by_ddp() -> bool:
    """True when DistributedDataParallel's own code is on the stack (only asked when raising)."""
    return _called_from(_DDP_FILE)


def _clip_lost(cls: type) -> bool:
    """True when torch's gradient clipping is on the stack and its clipping would be lost: it finds
    no gradients, so it clips nothing. Not for ``clip_grad_norm_`` at ``math.inf``, which only
    measures (the Hugging Face Trainer does so to log the norm), nor at the 2-norm the engine's step
    clips to anyway (what the Trainer of transformers 4 asks when its norm is the engine's)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _CLIP_FILE and code.co_name == _VALUE_CLIPPING:
            return True
        if code.co_filename == _CLIP_FILE and code.co_name in _NORM_CLIPPING:
            local = frame.f_locals
            try:
                bound, norm_type = float(local.get("max_norm")), float(local.get("norm_type", 2.0))
            except (TypeError, ValueError):
                return True
            return not (math.isinf(bound) or (bound == getattr(cls, _CLIP_NORM_ATTR) and norm_type == 2.0))
        frame = frame.f_back
    return False


def _called_from(filename: str) -> bool:
    """True when code of the source file ``filename`` is on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == filename:
            return True
        frame = frame.f_back
    return False
