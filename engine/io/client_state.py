"""The ``client_state`` a checkpoint carries: JSON values, and tensors, never pickle.

DeepSpeed pickles ``client_state``, and scripts put tensors in it (``torch.get_rng_state()``, a
running loss). Here the JSON part goes into ``metadata.json`` with each tensor replaced by a marker
``{"__tensor__": i}``, and the tensors go into rank 0's file as ``client_state/<i>`` (safetensors,
checked against their CRC-32 when loaded). A load puts them back where they were, on the CPU.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Optional

import torch

from engine.io.safetensors_stream import TensorSpec

#: The key of the marker that stands for a tensor in the saved JSON.
MARKER = "__tensor__"
#: Rank 0's file holds tensor ``i`` as ``PREFIX + str(i)``.
PREFIX = "client_state/"

Getter = Callable[[], torch.Tensor]


def split_client_state(client_state: Optional[Mapping[str, Any]]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``client_state`` as the JSON dict a checkpoint's metadata stores (tensors replaced by
    markers; a load gives tuples back as lists) and the tensors, in marker order. TypeError naming
    what is neither JSON nor a tensor; ValueError for a dict using the marker's key itself."""
    if client_state is None:
        return {}, []
    if not isinstance(client_state, Mapping):
        raise TypeError(f"client_state must be a dict, got {type(client_state).__name__}")
    tensors: list[torch.Tensor] = []
    containing: set[int] = set()  # the containers around the value being replaced

    def replace(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach())
            return {MARKER: len(tensors) - 1}
        if not isinstance(value, (Mapping, list, tuple)):
            return value
        if id(value) in containing:
            raise TypeError(f"client_state contains itself (a {type(value).__name__} holding itself, directly or "
                            f"through others): JSON cannot hold a circular reference")
        containing.add(id(value))
        try:
            if isinstance(value, Mapping):
                if MARKER in value:
                    raise ValueError(f"client_state may not use the key {MARKER!r} (it marks a saved tensor); "
                                     f"rename it")
                return {key: replace(item) for key, item in value.items()}
            return [replace(item) for item in value]
        finally:
            containing.discard(id(value))

    marked = replace(client_state)
    try:
        return json.loads(json.dumps(marked, allow_nan=True)), tensors
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"client_state must hold JSON values (numbers, strings, lists, dicts with str keys) and tensors: {exc}; "
            "convert other objects (a numpy array: torch.from_numpy) or save them yourself"
        ) from exc


def tensor_sources(tensors: list[torch.Tensor]) -> list[tuple[TensorSpec, Getter]]:
    """Rank 0's file entries for the tensors :func:`split_client_state` took out."""
    return [(TensorSpec(f"{PREFIX}{i}", t.dtype, tuple(t.shape)), lambda t=t: t.to("cpu"))
            for i, t in enumerate(tensors)]


def join_client_state(saved: Mapping[str, Any], read: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    """The saved JSON ``client_state`` with each marker replaced by its tensor, ``read(name)``
    giving rank 0's tensor of that name."""

    def restore(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {MARKER} and isinstance(value[MARKER], int):
                # A tensor of its own, as torch.load gives: torch.set_rng_state reads a view's storage
                # from its start (torch 2.13), so a view into the read buffer would restore garbage.
                return read(f"{PREFIX}{value[MARKER]}").clone()
            return {key: restore(item) for key, item in value.items()}
        if isinstance(value, list):
            return [restore(item) for item in value]
        return value

    return restore(dict(saved))


__all__ = ["MARKER", "PREFIX", "join_client_state", "split_client_state", "tensor_sources"]
