"""A checkpoint's tensors, each read when asked for: what ``engine.wrap(state_dict=CKPT)``,
``engine.checkpoint_state_dict`` and ``tiered export`` read from a directory ``eng.save_checkpoint``
wrote, at any world size, without an engine or a process group.

With ``master_weights`` a parameter the optimizer has stepped comes out as its fp32 master weight,
the value training continues from; parameters without optimizer state (frozen, or a checkpoint
saved without ``engine.AdamW``) come out in the dtype they were trained in.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from engine.io.checkpoint_files import CheckpointFiles, dtype_of
from engine.io.checkpoint_paths import resolve_checkpoint
from engine.io.safetensors_stream import Reader, TensorSpec, export_dtype
from engine.io.weight_source import WeightSource


def open_checkpoint_weights(path: "str | os.PathLike[str]") -> WeightSource:
    """A checkpoint directory (or a directory of tagged ones, through its ``latest``) as an
    ``engine.wrap(state_dict=...)`` source: the weights :func:`checkpoint_state_dict` would give,
    each read when placement asks for it, so a model larger than memory loads one tensor at a time."""
    files = CheckpointFiles(resolve_checkpoint(path))
    try:
        readers: dict[str, Reader] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for spec, read, names in checkpoint_tensors(files, True, None):
            for name in names:
                readers[name], shapes[name] = read, spec.shape
    except BaseException:
        files.close()
        raise
    return WeightSource(readers, lambda name: readers[name](), shapes.__getitem__, files.__exit__, origin=files.path)


def checkpoint_tensors(files: CheckpointFiles, master_weights: bool, dtype: Optional[torch.dtype]
             ) -> list[tuple[TensorSpec, Reader, list[str]]]:
    """Each parameter (master or training copy) and buffer of the checkpoint: its spec as
    exported, a reader, and every name it goes by."""
    out: list[tuple[TensorSpec, Reader, list[str]]] = []
    for name, record in files.params.items():
        state = "master" if master_weights and files.has_state(name) else None
        saved = torch.float32 if state else dtype_of(record["dtype"])
        target = export_dtype(saved, dtype)
        names = [str(n) for n in record.get("names") or [name]]
        out.append((TensorSpec(name, target, tuple(record["shape"])), _param_reader(files, name, state, target), names))
    for record in files.metadata["buffers"]:
        if not record.get("persistent", True):
            continue  # not in the model's state_dict (Llama's rotary inv_freq): rebuilt by the model itself
        name = record["name"]
        saved = dtype_of(record["dtype"])
        target = export_dtype(saved, dtype)
        out.append((TensorSpec(name, target, tuple(record["shape"])), _buffer_reader(files, name, target), [name]))
    return out


def _param_reader(files: CheckpointFiles, name: str, state: Optional[str], dtype: torch.dtype) -> Reader:
    return lambda: files.whole(name, state).to(dtype)


def _buffer_reader(files: CheckpointFiles, name: str, dtype: torch.dtype) -> Reader:
    return lambda: files.buffer(name).to(dtype)
