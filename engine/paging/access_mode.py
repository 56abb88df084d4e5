"""ParamAccessMode: materialize a released parameter that the wrapped forward reads outside the
modules that hold it (torch's official ``TorchFunctionMode`` override protocol, active only while
the wrapped model's forward runs).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from engine.paging.handle import ParamHandle
from engine.paging.tensor_reads import reads_data


# [Note: Parameters read outside their module]
# While the wrapped forward runs, the access mode (torch's TorchFunctionMode protocol) looks at the
# arguments of every torch function: a managed parameter that nothing holds is acquired for the
# innermost running module until the function returns, counted in ``on_demand_fetches``, and added
# to that module's extras, so the next step's pre-hook fetches it up front (which changes the order
# once: that step re-records). Functions that read only metadata (engine.paging.tensor_reads) do
# not fetch. Outside the forward nothing fetches: a released parameter answers through its released
# class instead (see [Note: Released parameters]).


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
