"""Which torch functions and tensor methods read a tensor's values, and which read only its
metadata: what a released parameter answers (:mod:`engine.paging.released`) and what makes the
access mode fetch one (:mod:`engine.paging.access_mode`)."""

from __future__ import annotations

from typing import Any

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


def reads_data(func: Any) -> bool:
    """True when the torch function or tensor method ``func`` reads a tensor's values (False for
    metadata: sizes, dtype, device, hooks, every property except the view ones like ``.data``)."""
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _VIEW_PROPERTIES
    return name not in _METADATA_FUNCTIONS
