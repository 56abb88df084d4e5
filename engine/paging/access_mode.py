"""ParamAccessMode: materialize a released parameter that the wrapped forward reads outside the
modules that hold it (torch's official ``TorchFunctionMode`` override protocol, active only while
the wrapped model's forward runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:  # engine.paging.handle imports this module (through engine.paging.released)
    from engine.paging.handle import ParamHandle

#: Tensor methods and functions that read only metadata: a released parameter answers them.
_METADATA_FUNCTIONS = frozenset(
    {
        "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
        "element_size", "is_floating_point", "is_complex", "is_signed", "get_device", "data_ptr",
        "untyped_storage", "_typed_storage", "__len__", "__hash__", "requires_grad_", "register_hook",
        "register_post_accumulate_grad_hook", "_is_view", "is_shared", "is_pinned", "has_names", "is_inference",
    }
)
#: Properties that return a view of the data (every other property is metadata).
_VIEW_PROPERTIES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})


class ParamAccessMode(TorchFunctionMode):
    """Calls ``on_read(handle)`` before any op that reads a managed parameter nothing holds;
    ``on_read`` returns a callable to run after the op (releasing it) or None."""

    def __init__(
        self, by_id: dict[int, ParamHandle], on_read: Callable[[ParamHandle], Optional[Callable[[], None]]]
    ) -> None:
        super().__init__()
        self._by_id = by_id
        self._on_read = on_read

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        after: list[Callable[[], None]] = []
        if reads_data(func):
            for value in (*args, *kwargs.values()):
                if isinstance(value, (list, tuple)):
                    for item in value:
                        self._check(item, after)
                else:
                    self._check(value, after)
        try:
            return func(*args, **kwargs)
        finally:
            for undo in after:
                undo()

    def _check(self, value: Any, after: list[Callable[[], None]]) -> None:
        if isinstance(value, torch.nn.Parameter):
            handle = self._by_id.get(id(value))
            if handle is not None and not handle.held:
                undo = self._on_read(handle)
                if undo is not None:
                    after.append(undo)


def reads_data(func: Any) -> bool:
    """True when the torch function or tensor method ``func`` reads a tensor's values (False for
    metadata: sizes, dtype, device, hooks, every property except the view ones like ``.data``)."""
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _VIEW_PROPERTIES
    return name not in _METADATA_FUNCTIONS
