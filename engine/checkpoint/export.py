"""Export a wrapped model's weights in Hugging Face's safetensors layout, one tensor at a time.

``eng.state_dict()`` consolidates the whole model in memory, which a model larger than memory
cannot afford. :func:`save_weights` gathers one parameter at a time (across ranks at world size
> 1) and streams it into the file it belongs to, so memory holds one parameter at a time, never
the model. The layout is the one ``save_pretrained`` writes and ``from_pretrained`` reads:

    <dir>/model.safetensors                       everything, when it fits in one shard
    <dir>/model-00001-of-00003.safetensors        otherwise shards of at most max_shard_bytes
    <dir>/model.safetensors.index.json            {"metadata": {"total_size"}, "weight_map"}

Tensors are named as in ``model.state_dict()``; a tied parameter is written once, under its first
name (``save_pretrained`` drops the tied names too, and ``from_pretrained`` ties them again). A
transformers 5 model whose weights it fuses or renames in memory (MoE experts) is written in the
layout its ``save_pretrained`` writes, converted back (the engine's :mod:`engine.extensions`).

Publishing order, so that a crash never leaves a loadable mix of two saves: every file is
written to ``<name>.partial`` and fsynced; then the previous save's ``model.safetensors`` and
index are removed, the new files renamed into place, the index (or the single file) last, and
shards of the previous save that this one does not overwrite are removed.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from engine.checkpoint.sharded import EngineParts, agree, attempt, check_between_steps, fsync_dir, gather_objects
from engine.extensions import DEFAULT_EXTENSIONS, Extensions
from engine.io.progress import byte_progress
from engine.io.read_ahead import read_ahead
from engine.io.safetensors_stream import Reader, SafetensorsWriter, TensorSpec, export_dtype

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: ``save_pretrained``'s default ``max_shard_size`` ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: What ``from_pretrained`` requires in a safetensors file's metadata.
_HF_METADATA = {"format": "pt"}
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_PARTIAL = ".partial"


def save_weights(
    parts: EngineParts, path: "str | os.PathLike[str]", *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Optional[torch.dtype] = None, master_weights: bool = False, exclude_frozen_parameters: bool = False,
    extensions: Extensions = DEFAULT_EXTENSIONS,
) -> list[str]:
    """Write the model's weights to the directory ``path`` (created if missing); return the files
    written, index last. With ``master_weights``, a parameter ``engine.AdamW`` has stepped is its
    fp32 master weight; ``exclude_frozen_parameters`` leaves out the parameters that take no
    gradient. Collective: every rank calls it, rank 0 writes."""
    check_export_arguments(max_shard_bytes, dtype)
    directory = os.path.abspath(os.fspath(path))
    io = parts.io
    masters = _master_keys(parts) if master_weights else {}
    tensors = _tensors(parts, dtype, masters, exclude_frozen_parameters)  # the same on every rank
    tensors = extensions.saving(parts.model, tensors)  # e.g. what transformers 5 fuses in memory, split as it saves it
    writing = io.rank == 0
    error = attempt(lambda: check_between_steps(parts, "save weights"))
    if writing and error is None:
        error = attempt(lambda: os.makedirs(directory, exist_ok=True))
    agree(io, error, "preparing the weights directory")
    bar = byte_progress("saving weights", sum(spec.nbytes for spec, _ in tensors), enabled=parts.config.progress,
                        rank=io.rank)
    with bar:
        files, error = write_weights(directory, tensors, max_shard_bytes, writing=writing,
                                     alone=io.collectives is None, advance=bar.advance)
    agree(io, error, "saving weights")
    return files


def check_export_arguments(max_shard_bytes: int, dtype: Optional[torch.dtype]) -> None:
    """ValueError / TypeError for a ``max_shard_bytes`` or ``dtype`` an export cannot use."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be an int >= 1, got {max_shard_bytes!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")


def write_weights(
    directory: str, tensors: list[tuple[TensorSpec, Reader]], max_shard_bytes: int, *, writing: bool = True,
    alone: bool = True, advance: Callable[[int], None] = lambda n: None,
) -> tuple[list[str], Optional[BaseException]]:
    """Read every tensor of ``tensors`` in order and, when ``writing``, write them into ``directory``
    (which exists) in the layout of the module docstring and publish the files. Returns the files
    (index last) and the first error, after removing what a failed write left. Unless ``alone``,
    the readers are collective, so every tensor is read even after a write error; a failed read
    raises on every rank at the same tensor (``ShardIO.read_copy``), so all stop there alike."""
    shards = _split(tensors, max_shard_bytes)
    names = _file_names(len(shards))
    files = [os.path.join(directory, n) for n in [*names, *([INDEX_FILE] if len(names) > 1 else [])]]
    writers: list[SafetensorsWriter] = []
    error: Optional[BaseException] = None
    for name, shard in zip(names, shards):
        if error is not None and alone:
            break  # nothing else waits for this process's reads: stop at the first error
        writer: Optional[SafetensorsWriter] = None
        if writing and error is None:
            try:
                writer = SafetensorsWriter(os.path.join(directory, name + _PARTIAL), [s for s, _ in shard],
                                           _HF_METADATA)
                writers.append(writer)
            except Exception as exc:  # noqa: BLE001 - the reads go on (collective); the caller raises it
                error = exc
        try:
            error = _write_shard(shard, writer, error, advance)
        except Exception as exc:  # noqa: BLE001 - a tensor could not be read: clean up below, the caller raises
            error = exc
            break
    if writing and error is None:
        error = attempt(lambda: _publish(directory, names, shards))
    if writing and error is not None:
        for writer in writers:
            writer.abort()
        for name in [*names, INDEX_FILE]:  # a writer that failed to start may have left its file too
            _remove(os.path.join(directory, name + _PARTIAL))
    return files, error


def _write_shard(
    shard: list[tuple[TensorSpec, Reader]], writer: Optional[SafetensorsWriter], error: Optional[BaseException],
    advance: Callable[[int], None],
) -> Optional[BaseException]:
    """Read every tensor of ``shard`` (collective at world size > 1, so on every rank, in the order
    the writer lays them out) and write it when this rank writes; return the first error."""
    read = dict(shard)
    order = SafetensorsWriter.order_of(read)
    for spec, value in zip(order, read_ahead([read[s] for s in order])):
        if writer is not None and error is None:
            try:
                writer.write(spec.name, value)
            except Exception as exc:  # noqa: BLE001 - the caller's agree() raises it on every rank
                error = exc
        advance(spec.nbytes)
        del value
    if writer is not None and error is None:
        error = attempt(writer.close)
    return error


def _master_keys(parts: EngineParts) -> dict[str, str]:
    """Parameter name -> store key of its live fp32 master weight, for the parameters that have one
    on every rank (the set decides which collectives run, so the ranks agree on it)."""
    if parts.training is None:
        return {}
    store = parts.io.store
    mine = {s.name: s.master_key for s in parts.training.live_shards() if s.master_key in store}
    everyone = gather_objects(parts.io, sorted(mine))
    common = set(everyone[0]).intersection(*everyone[1:])
    return {name: key for name, key in mine.items() if name in common}


def _tensors(parts: EngineParts, dtype: Optional[torch.dtype], masters: Mapping[str, str],
             exclude_frozen: bool = False) -> list[tuple[TensorSpec, Reader]]:
    """``model.state_dict()``'s tensors in order, each tied parameter once, with a reader each
    (from the fp32 master weight for the parameters in ``masters``); without the frozen
    parameters when ``exclude_frozen``."""
    by_id = {id(h.param): h for h in parts.handles}
    seen: set[int] = set()
    out: list[tuple[TensorSpec, Reader]] = []
    extra = []
    for name, value in parts.model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            extra.append(name)
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        handle = by_id.get(id(value))
        if handle is not None and exclude_frozen and not handle.trainable:
            continue
        master = masters.get(handle.name) if handle is not None else None
        saved = torch.float32 if master is not None else value.dtype
        target = export_dtype(saved, dtype)
        spec = TensorSpec(name, target, tuple(value.shape))
        if handle is not None:
            out.append((spec, _param_reader(parts, handle, target, master)))
        else:
            out.append((spec, _buffer_reader(value, target)))
    if extra:
        raise ValueError(f"safetensors holds tensors only; these state_dict entries are not tensors: {extra}")
    return out


def _param_reader(parts: EngineParts, handle: Any, dtype: torch.dtype, master_key: Optional[str]) -> Reader:
    if master_key is not None:
        return lambda: parts.io.read_copy(handle, master_key, torch.float32).detach().to("cpu", dtype)
    return lambda: parts.io.read_copy(handle).detach().to("cpu", dtype)


def _buffer_reader(value: torch.Tensor, dtype: torch.dtype) -> Reader:
    return lambda: value.detach().to("cpu", dtype)


def _split(tensors: list[tuple[TensorSpec, Reader]], max_bytes: int) -> list[list[tuple[TensorSpec, Reader]]]:
    """Consecutive shards of at most ``max_bytes`` each (a larger tensor gets a shard of its own),
    as ``save_pretrained`` splits them."""
    shards: list[list[tuple[TensorSpec, Reader]]] = [[]]
    size = 0
    for item in tensors:
        nbytes = item[0].nbytes
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _publish(directory: str, names: Sequence[str], shards: Sequence[Sequence[tuple[TensorSpec, Reader]]]) -> None:
    """Rename the fsynced ``.partial`` files into place (see the module docstring for the order)."""
    for old in (INDEX_FILE, SINGLE_FILE):
        _remove(os.path.join(directory, old))
    fsync_dir(directory)
    for name in names:
        os.replace(os.path.join(directory, name + _PARTIAL), os.path.join(directory, name))
    if len(names) > 1:
        weight_map = {spec.name: name for name, shard in zip(names, shards) for spec, _ in shard}
        total = sum(spec.nbytes for shard in shards for spec, _ in shard)
        index = os.path.join(directory, INDEX_FILE)
        with open(index + _PARTIAL, "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(index + _PARTIAL, index)
    stale = [f for f in os.listdir(directory) if _SHARD_NAME.fullmatch(f) and f not in names]
    for name in stale:
        _remove(os.path.join(directory, name))
    fsync_dir(directory)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
