"""Hugging Face weight directories as an ``engine.wrap(state_dict=...)`` source.

``save_pretrained`` writes either one ``model.safetensors`` or, past ``max_shard_size``, several
``model-0000i-of-0000n.safetensors`` files and ``model.safetensors.index.json`` whose ``weight_map``
names the file of every tensor. Every file is opened with ``safe_open`` (headers only); a tensor is
read from its file when placement asks for it, one at a time, so a model larger than memory loads
into a meta-device model without ever being whole in memory (accelerate's
``load_checkpoint_and_dispatch`` does the same from the same files).
"""

from __future__ import annotations

import json
import os
from typing import Any

from engine.weights import WeightSource

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def open_hf_weights(path: str) -> WeightSource:
    """A source over a Hugging Face model directory (``model.safetensors.index.json`` or
    ``model.safetensors`` in it) or over an ``*.index.json`` file itself."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        single = os.path.join(path, SINGLE_NAME)
        if os.path.isfile(index):
            path = index
        elif os.path.isfile(single):
            return WeightSource.open(single)  # type: ignore[return-value]
        else:
            raise ValueError(
                f"state_dict directory {path!r} has neither {INDEX_NAME} nor {SINGLE_NAME} (a Hugging Face "
                "save_pretrained directory with safetensors weights is expected)"
            )
    return _open_index(path)


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
    from safetensors import safe_open

    folder = os.path.dirname(os.path.abspath(index_path))
    handles: dict[str, Any] = {}
    try:
        for file in sorted(set(weight_map.values())):
            full = os.path.join(folder, file)
            if os.path.dirname(os.path.abspath(full)) != folder or not os.path.isfile(full):
                raise ValueError(f"{index_path!r} names {file!r}, which is not a file next to it")
            handles[file] = safe_open(full, framework="pt", device="cpu")
            missing = [n for n, f in weight_map.items() if f == file and n not in set(handles[file].keys())]
            if missing:
                raise ValueError(f"{full!r} lacks tensors its index assigns to it: {missing[:5]}")
    except BaseException:
        _close_all(handles)
        raise

    def get(name: str) -> Any:
        return handles[weight_map[name]].get_tensor(name)

    def shape(name: str) -> tuple[int, ...]:
        return tuple(handles[weight_map[name]].get_slice(name).get_shape())

    def close(*_exc: object) -> None:
        _close_all(handles)

    return WeightSource(dict.fromkeys(weight_map), get, shape, close, origin=index_path)


def _close_all(handles: dict[str, Any]) -> None:
    for handle in handles.values():
        exit_ = getattr(handle, "__exit__", None)
        if exit_ is not None:
            exit_(None, None, None)
    handles.clear()
