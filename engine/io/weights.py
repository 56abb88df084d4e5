"""The weights ``engine.wrap(state_dict=...)`` reads: :func:`open_weights` opens what the caller
passed (a mapping, a file, a ``save_pretrained`` directory, an engine checkpoint) as one
:class:`~engine.io.weight_source.WeightSource`, read one tensor at a time.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Union

import torch

from engine.io.checkpoint_paths import holds_checkpoint
from engine.io.checkpoint_weights import open_checkpoint_weights
from engine.io.pretrained_weights import open_hf_weights
from engine.io.weight_source import WeightSource

StateDictLike = Union[Mapping[str, torch.Tensor], str, "os.PathLike[str]", WeightSource]


def open_weights(state_dict: Optional[StateDictLike]) -> Optional[WeightSource]:
    """A source over ``state_dict``; None for None.

    Args:
        state_dict: a mapping of name -> tensor; a path to a ``.safetensors`` or ``torch.save`` file;
            a directory ``eng.save_checkpoint`` wrote (or one of its tagged ones, through ``latest``);
            a Hugging Face ``save_pretrained`` directory or its ``*.index.json``; or a source already
            open (it is returned as it is).

    Returns:
        The source, which the caller closes; None when ``state_dict`` is None.

    Raises:
        TypeError: ``state_dict`` is none of these, or a mapping holds something else than tensors.
        ValueError: the path does not exist or does not hold weights (the message says why).
    """
    if state_dict is None:
        return None
    if isinstance(state_dict, WeightSource):  # already open (e.g. engine.integrations.hf.peft_base_weights)
        return state_dict
    if isinstance(state_dict, Mapping):
        return WeightSource.from_mapping(state_dict)
    if not isinstance(state_dict, (str, os.PathLike)):
        raise TypeError(
            f"state_dict must be a mapping of name -> tensor or a path to a .safetensors or torch file, "
            f"got {type(state_dict).__name__}"
        )
    path = os.fspath(state_dict)
    if os.path.isdir(path) and holds_checkpoint(path):  # an eng.save_checkpoint directory
        return open_checkpoint_weights(path)
    if os.path.isdir(path) or path.endswith(".index.json"):  # a Hugging Face save_pretrained directory
        return open_hf_weights(path)
    return WeightSource.from_file(path)
