"""A plain torch optimizer's state in an engine checkpoint (``engine.AdamW`` keeps its own in the store).

A torch optimizer steps whole parameters with gradients every rank averaged alike, so every rank
holds the same whole state, and rank 0's file carries it: each state tensor as
``torch_optimizer/<parameter index>/<name>``, and in the metadata's ``torch_optimizer`` record the
optimizer's class, its ``param_groups`` and the state's other values (JSON). A load gives them to
the optimizer's own ``load_state_dict``, which refuses groups that do not match.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from engine.errors import CheckpointError
from engine.io.checkpoint_files import jsonable
from engine.io.safetensors_stream import TensorSpec

PREFIX = "torch_optimizer/"

Getter = Callable[[], torch.Tensor]


def class_name(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class as the record names it (``torch.optim.adamw.AdamW``)."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[TensorSpec, Getter]]:
    """The state's tensors, each with a getter of its CPU value, for rank 0's file."""
    sources: list[tuple[TensorSpec, Getter]] = []
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                sources.append((TensorSpec(f"{PREFIX}{index}/{name}", value.dtype, tuple(value.shape)),
                                lambda value=value: value.detach().cpu()))
    return sources


def state_record(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The metadata's record: class, ``param_groups`` and the state's values that are not tensors
    (tensors are marked ``null`` here and stored in rank 0's file)."""
    sd = optimizer.state_dict()
    what = f"{class_name(optimizer)} state"
    state = {str(index): {name: None if isinstance(value, torch.Tensor) else {"value": jsonable(value, what)}
                          for name, value in entries.items()}
             for index, entries in sd["state"].items()}
    return {"class": class_name(optimizer), "param_groups": jsonable(sd["param_groups"], what), "state": state}


def check(optimizer: torch.optim.Optimizer, record: Optional[dict[str, Any]], path: str) -> None:
    """CheckpointError when ``record`` cannot load into ``optimizer`` (another class, other groups),
    before a load changes anything."""
    if record is None:
        return
    if record["class"] != class_name(optimizer):
        raise CheckpointError(f"{path!r} holds the state of a {record['class']}, this engine's optimizer is a "
                              f"{class_name(optimizer)}: use the same optimizer, or load_optimizer=False")
    saved = [len(group["params"]) for group in record["param_groups"]]
    mine = [len(group["params"]) for group in optimizer.param_groups]
    if saved != mine:
        raise CheckpointError(f"{path!r}: the saved {record['class']} has parameter groups of {saved} parameters, "
                              f"this one {mine}")


def restore(optimizer: torch.optim.Optimizer, record: Optional[dict[str, Any]], read: Callable[[str], torch.Tensor],
            path: str) -> None:
    """Load ``record`` (and the tensors ``read(name)`` returns) into ``optimizer``, checked by
    :func:`check` first. A checkpoint saved without a torch optimizer's state (or before
    checkpoints held it) leaves the optimizer as it is."""
    if record is None:
        return
    check(optimizer, record, path)
    state = {int(index): {name: read(f"{PREFIX}{index}/{name}") if entry is None else entry["value"]
                          for name, entry in entries.items()}
             for index, entries in record["state"].items()}
    live = optimizer.param_groups
    groups = [{k: tuple(v) if isinstance(now.get(k), tuple) and isinstance(v, list) else v for k, v in group.items()}
              for group, now in zip(record["param_groups"], live)]
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{path!r}: the saved {record['class']} state does not fit this optimizer: {exc}") from exc


__all__ = ["PREFIX", "check", "class_name", "restore", "state_record", "state_tensors"]
