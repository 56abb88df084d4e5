"""A checkpoint's weights without an engine, a model or a process group: DeepSpeed's ``zero_to_fp32``.

:func:`checkpoint_state_dict` returns the consolidated ``{name: tensor}`` dict of a directory
written by ``eng.save_checkpoint`` at any world size; :func:`export_checkpoint` streams the same
tensors into Hugging Face's safetensors layout (``engine.checkpoint.export``), one tensor in memory at a
time, so a checkpoint of a model larger than memory exports too. ``tiered export CKPT OUT`` is
the command line, and ``engine.wrap(model, state_dict=CKPT)`` reads the same weights
(:func:`open_checkpoint_weights`).

With ``master_weights`` (the default) a parameter the optimizer has stepped comes out as its fp32
master weight, the value training continues from, not the training-dtype copy the model computes
with (the two differ under bf16 or fp16 training); parameters without optimizer state (frozen, or
a checkpoint saved without ``engine.AdamW``) come out in the dtype they were trained in.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from engine.checkpoint.export import DEFAULT_MAX_SHARD_BYTES, check_export_arguments, write_weights
from engine.extensions.transformers_layout import TransformersLayout, meta_model
from engine.io.checkpoint_files import CheckpointFiles
from engine.io.checkpoint_paths import resolve_checkpoint
from engine.io.checkpoint_weights import checkpoint_tensors
from engine.io.progress import byte_progress
from engine.io.safetensors_stream import Reader, TensorSpec


def checkpoint_state_dict(
    path: "str | os.PathLike[str]", *, master_weights: bool = True, dtype: Optional[torch.dtype] = None,
    tag: Optional[str] = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint at ``path`` (or ``path/tag``, or the tag ``path/latest`` names) as a
    consolidated ``{name: tensor}`` dict on the CPU (every parameter whole, under each of its tied
    names; every persistent buffer as rank 0 saved it), which a plain model's ``load_state_dict``
    accepts. Floating tensors are cast to ``dtype`` when given. DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``; holds the whole model in memory.

    Raises:
        engine.CheckpointError: ``path`` holds no complete, undamaged checkpoint (the message says
            what is missing or wrong).
        TypeError: ``dtype`` is not a floating torch dtype.
        ValueError: ``tag`` is not a directory name.
    """
    check_export_arguments(DEFAULT_MAX_SHARD_BYTES, dtype)
    out: dict[str, torch.Tensor] = {}
    with CheckpointFiles(resolve_checkpoint(path, tag)) as files:
        for _, read, names in checkpoint_tensors(files, master_weights, dtype):
            value = read()
            for name in names:
                out[name] = value
    return out


def export_checkpoint(
    path: "str | os.PathLike[str]", out: "str | os.PathLike[str]", *, master_weights: bool = True,
    dtype: Optional[torch.dtype] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True,
    tag: Optional[str] = None, hf_config: "str | os.PathLike[str] | None" = None,
) -> list[str]:
    """Write the weights of the checkpoint at ``path`` (found as :func:`checkpoint_state_dict`
    finds it) to the directory ``out`` (created if missing) as ``save_pretrained`` lays them out:
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` and
    ``model.safetensors.index.json``; a tied parameter once, under its first name. One tensor in
    memory at a time. Returns the files written, index last. Add the model's ``config.json``
    (``model.config.save_pretrained(out)``) and ``from_pretrained(out)`` loads it. ``progress``
    draws a byte bar on a terminal for exports of 256 MiB or more. ``hf_config``: the model's
    Hugging Face config (a directory holding ``config.json``): it is written to ``out`` too, and
    what transformers 5 fuses in memory (an MoE's experts) is written in the layout its
    ``save_pretrained`` writes, from a model built on the meta device (``AutoModelForCausalLM``).

    Raises:
        engine.CheckpointError: ``path`` holds no complete, undamaged checkpoint.
        ValueError: ``max_shard_bytes`` below 1, a ``tag`` that is not a directory name, or a dtype
            safetensors cannot hold.
        TypeError: ``dtype`` is not a floating torch dtype.
        OSError: ``out`` cannot be written; nothing of this export is left published there.
    """
    check_export_arguments(max_shard_bytes, dtype)
    directory = os.path.abspath(os.fspath(out))
    hf = None
    if hf_config is not None:
        hf = meta_model(hf_config)
    with CheckpointFiles(resolve_checkpoint(path, tag)) as files:
        tensors: list[tuple[TensorSpec, Reader]] = [(spec, read) for spec, read, _ in
                                                    checkpoint_tensors(files, master_weights, dtype)]
        if hf is not None:
            tensors = TransformersLayout().saving(hf, tensors)
        os.makedirs(directory, exist_ok=True)
        bar = byte_progress("exporting checkpoint", sum(spec.nbytes for spec, _ in tensors), enabled=progress)
        with bar:
            written, error = write_weights(directory, tensors, max_shard_bytes, advance=bar.advance)
    if error is not None:
        raise error
    if hf is not None:
        hf.config.save_pretrained(directory)
        written.insert(0, os.path.join(directory, "config.json"))
    return written


__all__ = ["checkpoint_state_dict", "export_checkpoint"]
