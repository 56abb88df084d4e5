"""Hugging Face weight directories as an ``engine.wrap(state_dict=...)`` source.

``save_pretrained`` writes either one ``model.safetensors`` or, past ``max_shard_size``, several
``model-0000i-of-0000n.safetensors`` files and ``model.safetensors.index.json`` whose ``weight_map``
names the file of every tensor. Every file is opened with ``safe_open`` (headers only); a tensor is
read from its file when placement asks for it, one at a time, so a model larger than memory loads
into a meta-device model without ever being whole in memory (accelerate's
``load_checkpoint_and_dispatch`` does the same from the same files). Older models on the Hub ship
``pytorch_model.bin`` (or shards named by ``pytorch_model.bin.index.json``): those are torch's zip
files, opened with ``torch.load(mmap=True, weights_only=True)``, so a tensor's bytes are read only
when it is placed, and nothing but tensors is unpickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Callable

import torch

from engine.io.weight_source import WeightSource

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: What a directory is searched for, in this order: safetensors first, as ``from_pretrained`` does.
WEIGHT_FILES = (INDEX_NAME, SINGLE_NAME, "pytorch_model.bin.index.json", "pytorch_model.bin")


def open_hf_weights(path: str) -> WeightSource:
    """A source over a Hugging Face model directory (the first of :data:`WEIGHT_FILES` in it) or
    over an ``*.index.json`` file itself."""
    if os.path.isdir(path):
        found = [os.path.join(path, name) for name in WEIGHT_FILES if os.path.isfile(os.path.join(path, name))]
        if not found:
            raise ValueError(
                f"state_dict directory {path!r} has neither of {', '.join(WEIGHT_FILES)} (a Hugging Face "
                "save_pretrained directory is expected)"
            )
        path = found[0]
        if not path.endswith(".index.json"):
            return WeightSource.from_file(path)
    return _open_index(path)


class _TorchFile:
    """A ``torch.save`` zip file (``pytorch_model*.bin``) with ``safe_open``'s methods: memory-mapped,
    so a tensor's bytes are read when it is used; tensors only (``weights_only``)."""

    def __init__(self, path: str) -> None:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise ValueError(f"{path!r} is not a state dict of tensors (got {type(loaded).__name__})")
        self._tensors: Mapping[str, torch.Tensor] = loaded

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)


def _open_file(path: str) -> Any:
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        return safe_open(path, framework="pt", device="cpu")
    return _TorchFile(path)


def _shape_reader(handle: Any) -> Callable[[str], tuple[int, ...]]:
    if isinstance(handle, _TorchFile):
        return handle.shape_of
    return lambda name: tuple(handle.get_slice(name).get_shape())  # reads the header only


def _open_index(index_path: str) -> WeightSource:
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{index_path!r} is not a safetensors index (a JSON object with a 'weight_map'): {exc}"
        ) from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path!r}: 'weight_map' must map tensor names to file names")
    folder = os.path.dirname(os.path.abspath(index_path))
    handles: dict[str, Any] = {}
    try:
        for file in sorted(set(weight_map.values())):
            full = os.path.join(folder, file)
            if os.path.dirname(os.path.abspath(full)) != folder or not os.path.isfile(full):
                raise ValueError(f"{index_path!r} names {file!r}, which is not a file next to it")
            handles[file] = _open_file(full)
            missing = [n for n, f in weight_map.items() if f == file and n not in set(handles[file].keys())]
            if missing:
                raise ValueError(f"{full!r} lacks tensors its index assigns to it: {missing[:5]}")
    except BaseException:
        _close_all(handles)
        raise

    def get(name: str) -> Any:
        return handles[weight_map[name]].get_tensor(name)

    shapes = {file: _shape_reader(handle) for file, handle in handles.items()}

    def shape(name: str) -> tuple[int, ...]:
        return shapes[weight_map[name]](name)

    def close(*_exc: object) -> None:
        _close_all(handles)

    return WeightSource(dict.fromkeys(weight_map), get, shape, close, origin=index_path)


def _close_all(handles: dict[str, Any]) -> None:
    for handle in handles.values():
        exit_ = getattr(handle, "__exit__", None)
        if exit_ is not None:
            exit_(None, None, None)
    handles.clear()
