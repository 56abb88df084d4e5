"""Checkpoints of a wrapped model: sharded save and load, and a consolidated state dict.

A checkpoint is a directory::

    <dir>/metadata.json          world size, parameters and their layouts, buffers, optimizer
                                 hyperparameters and step counts, per-file sizes and CRC-32s
    <dir>/rank0.safetensors      rank 0's parameter shards, optimizer state and buffers
    <dir>/rank1.safetensors      ... one file per rank

Each rank writes its own file, streaming one store entry at a time (never the whole state in
memory), in the safetensors format (no pickle anywhere). Tensor names in a rank file:
``param/<name>`` (the shard in the training dtype, padding included), ``optim/<name>/master``,
``optim/<name>/exp_avg``, ``optim/<name>/exp_avg_sq`` (fp32, shards that have taken a step) and
``buffer/<name>`` (this rank's buffers, whole); with a plain torch optimizer, rank 0's file also
holds its state tensors (``engine.checkpoint.torch_optimizer``), and the tensors of the caller's
``client_state`` (``engine.io.client_state``). A save with
``exclude_frozen_parameters`` (the name DeepSpeed gives it) leaves out the parameters that take no
gradient, which a fine-tune (LoRA) has most of, and marks the metadata ``frozen_excluded``; a load
then keeps the model's own values for them (loaded from the base model, as the run that saved it did).

Save is atomic: the files go to ``<dir>.partial``, each is fsynced, rank 0 writes the metadata
last, fsyncs, renames the directory to ``<dir>`` and fsyncs its parent; so ``<dir>`` either does
not exist or is complete. Every rank must call save and load (they are collective at world size
> 1), between steps. Errors found on any rank (a mismatch, a missing file, an I/O error) are
raised on every rank, so no rank is left waiting in a collective.

A checkpoint loads at any world size: each rank reads the saved shards that overlap its own
(``engine.io.checkpoint_files``, which also reads checkpoints without an engine for
``engine.checkpoint.offline_export``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from engine.checkpoint import torch_optimizer
from engine.config import EngineConfig
from engine.errors import CheckpointError
from engine.io.checkpoint_files import (
    CRC_CHUNK_BYTES,
    FORMAT,
    METADATA_FILE,
    PARTIAL_SUFFIX,
    STATE_NAMES,
    VERSION,
    CheckpointFiles,
    dtype_str,
    jsonable,
    rank_file,
    tensor_name,
)
from engine.io.checkpoint_paths import fsync_dir, resolve_checkpoint, tagged_path, write_latest
from engine.io.client_state import join_client_state, split_client_state, tensor_sources
from engine.io.progress import byte_progress
from engine.io.read_ahead import read_ahead
from engine.io.safetensors_stream import SafetensorsWriter, TensorSpec
from engine.paging.handle import ParamHandle
from engine.paging.layout import ShardLayout
from engine.paging.pager import Pager
from engine.paging.shard_io import ShardIO
from tiered.util import wait_all

OLD_SUFFIX = ".old"
#: Bytes of puts in flight while a checkpoint is loaded into the store.
LOAD_INFLIGHT_BYTES = 256 << 20


@dataclasses.dataclass
class EngineParts:
    """What checkpoints need of an engine (``Engine._checkpoint_parts()`` builds it).

    ``training`` is the engine's ``engine.optim.training.Training`` when it trains with ``engine.AdamW``
    (``optimizer`` is then that AdamW), else None.
    """

    model: nn.Module
    handles: Sequence[ParamHandle]
    io: ShardIO
    pager: Pager
    config: EngineConfig
    training: Optional[Any] = None
    optimizer: Optional[torch.optim.Optimizer] = None


# ---------------------------------------------------------------------------- consolidated state dict


def consolidated_state_dict(model: nn.Module, handles: Sequence[ParamHandle], io: ShardIO, *,
                            exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    """``model.state_dict()`` with every parameter whole (gathered across ranks) and every tensor a
    CPU copy: what a plain model's ``load_state_dict`` accepts. Tied parameters appear under each of
    their names as one tensor, as in ``state_dict()``. ``exclude_frozen_parameters``: without the
    parameters that take no gradient. Collective at world size > 1: every rank calls it and gets
    the whole dict."""
    by_id = {id(h.param): h for h in handles}
    whole: dict[int, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for name, value in model.state_dict(keep_vars=True).items():  # keep_vars: the Parameter objects, untouched
        handle = by_id.get(id(value))
        if handle is not None and exclude_frozen_parameters and not handle.trainable:
            continue
        if handle is not None:
            if id(value) not in whole:
                whole[id(value)] = io.read_copy(handle).detach().to("cpu")  # a new tensor already
            out[name] = whole[id(value)]
        elif isinstance(value, torch.Tensor):
            out[name] = value.detach().to("cpu", copy=True)
        else:
            out[name] = value  # a module's extra state
    return out


# ---------------------------------------------------------------------------- save


def save_checkpoint(parts: EngineParts, path: "str | os.PathLike[str]", *, overwrite: bool = False,
                    tag: Optional[str] = None, client_state: Optional[Mapping[str, Any]] = None,
                    exclude_frozen_parameters: bool = False, save_latest: bool = True) -> None:
    """Write a sharded checkpoint of ``parts`` to the directory ``path``, or to ``path/tag`` and
    then, with ``save_latest``, point ``path/latest`` at it (``engine.io.checkpoint_paths``).
    ``client_state`` (JSON values and tensors; rank 0's is kept) goes into the metadata and rank 0's
    file (``engine.io.client_state``); ``exclude_frozen_parameters``
    leaves out the parameters that take no gradient. See the module docstring."""
    io = parts.io
    rank = io.rank
    checked: dict[str, Any] = {}

    tags = gather_objects(io, tag)

    def prepare() -> None:
        if len(set(tags)) > 1:  # each rank would write its file under its own tag
            raise ValueError(f"every rank must save under the same tag; the ranks passed {tags}")
        checked["path"] = tagged_path(path, tag)
        checked["client"], checked["client_tensors"] = split_client_state(client_state)
        check_between_steps(parts, "save a checkpoint")
        if rank == 0:
            prepare_partial(checked["path"], checked["path"] + PARTIAL_SUFFIX, overwrite, tag is not None)

    agree(io, attempt(prepare), "preparing the checkpoint directory")
    directory, client = checked["path"], checked["client"]
    partial = directory + PARTIAL_SUFFIX

    written: Any = None
    try:
        written = _write_rank_file(parts, os.path.join(partial, rank_file(rank)), exclude_frozen_parameters,
                                   checked["client_tensors"])
        error = None
    except Exception as exc:  # noqa: BLE001 - every rank hears of it below
        error = exc
    files = gather_objects(io, written if error is None else None)
    complete = all(f is not None for f in files)
    if rank == 0 and error is None and complete:
        error = attempt(lambda: _finish_save(parts, directory, partial, files, overwrite, client,
                                             exclude_frozen_parameters))
        if error is None and tag is not None and save_latest:
            error = attempt(lambda: write_latest(os.path.dirname(directory), tag))
    if rank == 0 and (error is not None or not complete):
        shutil.rmtree(partial, ignore_errors=True)  # what a failed save wrote (the published checkpoint stays)
    agree(io, error, "writing the checkpoint", failed=[r for r, f in enumerate(files) if f is None])


def prepare_partial(path: str, partial: str, overwrite: bool, tagged: bool = False) -> None:
    """Create the empty ``partial`` directory a checkpoint for ``path`` is written into (removing one a
    crashed save left); FileExistsError when ``path`` exists and not ``overwrite``."""
    parent = os.path.dirname(path)
    if tagged and not os.path.isdir(parent) and os.path.isdir(os.path.dirname(parent)):
        os.mkdir(parent)  # the directory of tagged checkpoints, on the first save into it
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the checkpoint's parent directory {parent!r} does not exist; create it first")
    _recover_interrupted_overwrite(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(
            f"checkpoint directory {path!r} already exists; choose another path or pass overwrite=True"
        )
    shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
    os.mkdir(partial)


def _write_rank_file(parts: EngineParts, file: str, exclude_frozen: bool,
                     client_tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Stream this rank's shards, optimizer state and buffers from the store into ``file`` (and on
    rank 0 the client state's tensors)."""
    store = parts.io.store
    sources: list[tuple[TensorSpec, Callable[[], torch.Tensor]]] = []
    for handle in _saved_handles(parts, exclude_frozen):
        info = store.info(handle.key)
        sources.append((TensorSpec(tensor_name(handle.name), info.dtype, tuple(info.shape)),
                        _store_reader(store, handle.key)))
    for name, keys in _live_state_keys(parts, exclude_frozen).items():
        for state, key in zip(STATE_NAMES, keys):
            info = store.info(key)
            sources.append((TensorSpec(tensor_name(name, state), info.dtype, tuple(info.shape)),
                            _store_reader(store, key)))
    for name, buf in parts.model.named_buffers():
        sources.append((TensorSpec("buffer/" + name, buf.dtype, tuple(buf.shape)), _value(buf)))
    if _torch_optimizer(parts) is not None and parts.io.rank == 0:  # every rank holds the same whole state
        sources.extend(torch_optimizer.state_tensors(parts.optimizer))  # type: ignore[arg-type]
    if parts.io.rank == 0:  # rank 0's client_state is the one kept
        sources.extend(tensor_sources(list(client_tensors)))
    return write_tensors(file, sources, parts.io.rank, "saving checkpoint",
                         parts.config.progress and parts.io.rank == 0)


def write_tensors(file: str, sources: Sequence[tuple[TensorSpec, Callable[[], torch.Tensor]]], rank: int,
                  label: str, progress: bool) -> dict[str, Any]:
    """Write rank ``rank``'s file of a checkpoint, each tensor from its getter (read one ahead of
    the write), under a progress bar when ``progress``; return the metadata's record of the file
    (size, CRC-32s whole and per chunk)."""
    getters = {spec.name: get for spec, get in sources}
    writer = SafetensorsWriter(file, [spec for spec, _ in sources], {"format": FORMAT, "rank": str(rank)},
                               chunk_crc_bytes=CRC_CHUNK_BYTES)
    bar = byte_progress(label, sum(spec.nbytes for spec in writer.order), enabled=progress)
    try:
        with bar:
            for spec, value in zip(writer.order, read_ahead([getters[s.name] for s in writer.order])):
                writer.write(spec.name, value)
                bar.advance(spec.nbytes)
            writer.close()
    except BaseException:
        writer.abort()
        raise
    return {"bytes": writer.nbytes, "crc32": writer.crc32, "chunk_bytes": CRC_CHUNK_BYTES,
            "chunk_crc32": writer.chunk_crc32}


def _finish_save(parts: EngineParts, path: str, partial: str, files: list[Any], overwrite: bool,
                 client_state: dict[str, Any], exclude_frozen: bool) -> None:
    """Rank 0: check every rank's file is there (a shared filesystem), write the metadata, publish."""
    for rank, info in enumerate(files):
        file = os.path.join(partial, rank_file(rank))
        if not os.path.isfile(file) or os.path.getsize(file) != info["bytes"]:
            raise CheckpointError(
                f"rank {rank} wrote {rank_file(rank)} but rank 0 does not see it in {partial!r}: every rank must "
                "save to a directory on a filesystem they all share"
            )
    publish(partial, path, _metadata(parts, files, client_state, exclude_frozen), overwrite)


def publish(partial: str, path: str, metadata: dict[str, Any], overwrite: bool) -> None:
    """Write ``metadata.json`` into the complete ``partial`` directory, fsync, and rename it to
    ``path`` (replacing a previous checkpoint there only with ``overwrite``, through ``path.old``)."""
    meta_file = os.path.join(partial, METADATA_FILE)
    with open(meta_file, "w", encoding="utf-8") as f:
        json.dump(metadata, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(partial)
    old = path + OLD_SUFFIX
    replacing = os.path.exists(path)
    if replacing:
        if not overwrite:
            raise FileExistsError(f"checkpoint directory {path!r} appeared while saving; pass overwrite=True")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    try:
        os.rename(partial, path)
    except BaseException:
        if replacing:
            os.rename(old, path)  # put the previous checkpoint back
        raise
    fsync_dir(os.path.dirname(path))
    if replacing:
        shutil.rmtree(old, ignore_errors=True)


def holds_saved_checkpoint(path: "str | os.PathLike[str]") -> bool:
    """Whether a checkpoint was published at ``path``: it is there, or an overwrite killed between
    its two renames left it at ``path.old`` (the next save or load puts it back)."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, METADATA_FILE)) or (
        not os.path.exists(path) and os.path.isfile(os.path.join(path + OLD_SUFFIX, METADATA_FILE)))


def _recover_interrupted_overwrite(path: str) -> None:
    """An overwrite killed between its two renames left no ``<dir>`` and the previous checkpoint,
    complete, in ``<dir>.old`` (it only ever gets there by a rename of a published ``<dir>``): put it back."""
    old = path + OLD_SUFFIX
    if os.path.exists(path) or not holds_saved_checkpoint(path):
        return
    try:
        os.rename(old, path)
    except OSError:
        if not os.path.isdir(path):  # else another rank put it back first
            raise
    fsync_dir(os.path.dirname(path))


def param_record(name: str, names: Sequence[str], layout: ShardLayout, trainable: bool) -> dict[str, Any]:
    """A parameter's entry in a checkpoint's metadata; ``layout`` at the saving world size."""
    return {
        "name": name, "names": list(names), "shape": list(layout.shape), "dtype": dtype_str(layout.dtype),
        "stride": list(layout.stride), "numel": layout.numel, "shard_numel": layout.shard_numel,
        "padded_numel": layout.padded_numel, "trainable": trainable,
    }


def buffer_record(name: str, buffer: torch.Tensor, persistent: bool) -> dict[str, Any]:
    """A buffer's entry in a checkpoint's metadata (``persistent``: in ``state_dict()``; an export skips the others)."""
    return {"name": name, "shape": list(buffer.shape), "dtype": dtype_str(buffer.dtype), "persistent": persistent}


def _metadata(parts: EngineParts, files: list[Any], client_state: dict[str, Any], exclude_frozen: bool
              ) -> dict[str, Any]:
    handles = _saved_handles(parts, exclude_frozen)
    params = [param_record(h.name, h.names, h.layout, h.trainable) for h in handles]
    saved = {h.name for h in handles}
    in_state_dict = set(parts.model.state_dict(keep_vars=True))
    buffers = [buffer_record(n, b, n in in_state_dict) for n, b in parts.model.named_buffers()]
    optimizer = None
    if parts.training is not None:
        sd = parts.optimizer.hyperparameter_state_dict()  # type: ignore[union-attr]
        optimizer = {
            "type": "engine.AdamW",
            "step": parts.training.completed_steps,
            "shard_steps": {n: s for n, s in sd.get("shard_steps", {}).items() if n in saved},
            "param_groups": jsonable(sd["param_groups"], "optimizer param_groups"),
            "with_state": sorted(_live_state_keys(parts, exclude_frozen)),
            "loss_scale": parts.training.scaler.state_dict() if parts.training.scaler is not None else None,
        }
    torch_state = _torch_optimizer(parts)
    return {
        "format": FORMAT, "version": VERSION, "world_size": parts.io.world,
        "params": params, "frozen_excluded": exclude_frozen, "buffers": buffers, "optimizer": optimizer,
        "torch_optimizer": torch_optimizer.state_record(torch_state) if torch_state is not None else None,
        "files": {rank_file(r): f for r, f in enumerate(files)}, "client_state": client_state,
    }


# ---------------------------------------------------------------------------- load


def load_checkpoint(parts: EngineParts, path: "str | os.PathLike[str]", *, load_optimizer: bool = True,
                    tag: Optional[str] = None, load_step_count: bool = False) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``parts``' store (parameters, buffers and, with
    ``load_optimizer``, the optimizer state, step counts and hyperparameters; without it but with
    ``load_step_count``, the completed step count alone, as DeepSpeed's weights-only load keeps
    ``global_steps``). Checks the
    checkpoint against the engine first and changes nothing when they disagree. ``path`` is the
    checkpoint, or ``path/tag``, or the tag ``path/latest`` names (``engine.io.checkpoint_paths``).
    Returns the ``client_state`` saved with it.

    The checkpoint may have been saved at another world size: each rank then reads the saved
    shards that overlap its own (``engine.io.checkpoint_files``), which needs every saved rank's file
    where the ranks can read it. Buffers come from the same rank's file, or rank 0's where the
    checkpoint has fewer ranks."""
    root = os.path.abspath(os.fspath(path))
    io = parts.io
    files: Optional[CheckpointFiles] = None

    def check() -> None:
        nonlocal files
        check_between_steps(parts, "load a checkpoint")  # a pending step waits aside until the checks pass
        if tag is None:
            _recover_interrupted_overwrite(root)
        directory = resolve_checkpoint(root, tag)
        _recover_interrupted_overwrite(directory)
        files = CheckpointFiles(directory)
        _check_metadata(parts, files.metadata, load_optimizer, files.path)
        _check_files(parts, files, load_optimizer)

    try:
        agree(io, attempt(check), f"checking checkpoint {root!r}")
        assert files is not None
        if parts.training is not None:
            parts.training.complete_pending("discard")  # the load replaces the state a step under way started from
        with parts.pager.lock:
            parts.pager.drop_prefetched()  # their values are about to change
        client_state: dict[str, Any] = {}

        def load() -> None:
            assert files is not None
            client_state.update(join_client_state(files.metadata.get("client_state") or {},
                                                  lambda name: files.read(0, name)))
            _load_files(parts, files, load_optimizer, load_step_count)

        agree(io, attempt(load), f"loading checkpoint {files.path!r}")
    finally:
        if files is not None:
            files.close()
    return client_state


def _check_metadata(parts: EngineParts, metadata: dict[str, Any], load_optimizer: bool, path: str) -> None:
    saved = {p["name"]: p for p in metadata["params"]}
    mine = {h.name: h for h in _loaded_handles(parts, metadata)}
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        frozen = (" (the checkpoint left out the parameters that were frozen when it was saved; the model's "
                  "missing ones take a gradient: freeze them as that run did)" if metadata.get("frozen_excluded")
                  else "")
        raise CheckpointError(
            f"the checkpoint's parameters do not match the model's: the model has {len(missing)} the checkpoint "
            f"lacks {missing[:5]} and the checkpoint has {len(extra)} the model lacks {extra[:5]}{frozen}"
        )
    for name, handle in mine.items():
        p, layout = saved[name], handle.layout
        if tuple(p["shape"]) != layout.shape or p["dtype"] != dtype_str(layout.dtype):
            raise CheckpointError(
                f"parameter {name!r} is {p['dtype']} {tuple(p['shape'])} in the checkpoint but {layout.dtype} "
                f"{layout.shape} in the model (a different model, or another EngineConfig.train_dtype)"
            )
        if tuple(p["stride"]) != layout.stride:
            raise CheckpointError(
                f"parameter {name!r} was saved with strides {tuple(p['stride'])} (memory order of its shards) but the "
                f"model's has {layout.stride}: give the parameter the same memory format as when it was saved"
            )
    saved_buffers = {b["name"]: b for b in metadata["buffers"]}
    my_buffers = _buffers_to_load(parts, saved_buffers)
    if set(saved_buffers) != set(my_buffers):
        raise CheckpointError(
            f"the checkpoint's buffers {sorted(set(saved_buffers) - set(my_buffers))[:5]} are not the model's, or the "
            f"model's {sorted(set(my_buffers) - set(saved_buffers))[:5]} are not in the checkpoint"
        )
    for name, buf in my_buffers.items():
        if tuple(saved_buffers[name]["shape"]) != tuple(buf.shape):
            raise CheckpointError(
                f"buffer {name!r} has shape {tuple(saved_buffers[name]['shape'])} in the checkpoint, "
                f"{tuple(buf.shape)} in the model"
            )
    optimizer = metadata["optimizer"]
    if not load_optimizer:
        return
    torch_state = _torch_optimizer(parts)
    if torch_state is not None:
        torch_optimizer.check(torch_state, metadata.get("torch_optimizer"), path)
    if optimizer is not None and parts.training is None:
        raise CheckpointError(
            "the checkpoint has engine.AdamW state but this engine has no engine.AdamW: wrap with "
            "optimizer=engine.AdamW(...) to resume training, or pass load_optimizer=False to load only the weights"
        )
    if optimizer is None and parts.training is not None:
        raise CheckpointError(
            "the checkpoint has no optimizer state (it was saved without engine.AdamW): pass load_optimizer=False to "
            "start the optimizer afresh from the checkpoint's weights"
        )
    if optimizer is not None:
        groups = len(parts.optimizer.param_groups)  # type: ignore[union-attr]
        if len(optimizer["param_groups"]) != groups:
            raise CheckpointError(
                f"the checkpoint's optimizer has {len(optimizer['param_groups'])} parameter groups, this one {groups}"
            )
        _check_group_members(parts, optimizer["param_groups"])


def _check_group_members(parts: EngineParts, saved: list[dict[str, Any]]) -> None:
    """An imported checkpoint names each group's parameters (``param_names``): they must be in the
    same group of this engine's optimizer, or their hyperparameters (weight decay) would change."""
    if not any("param_names" in group for group in saved):
        return
    mine = parts.optimizer.group_of(parts.model.named_parameters())  # type: ignore[union-attr]
    for index, group in enumerate(saved):
        for name in group.get("param_names", []):
            if mine.get(name, index) != index:
                raise CheckpointError(
                    f"parameter {name!r} is in the checkpoint's parameter group {index} (weight_decay "
                    f"{group.get('weight_decay')!r}) but in group {mine[name]} of engine.AdamW: build the groups "
                    "as the run that saved it did"
                )


def _buffers_to_load(parts: EngineParts, saved: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The model's buffers a load restores: all of them, but a non-persistent one (outside
    ``state_dict()``, such as rotary ``inv_freq``) only if the checkpoint has it (an imported one may not)."""
    persistent = set(parts.model.state_dict(keep_vars=True))
    return {name: buf for name, buf in parts.model.named_buffers() if name in saved or name in persistent}


def _loads(parts: EngineParts, files: CheckpointFiles, load_optimizer: bool
           ) -> list[tuple[ParamHandle, Optional[str], str, str, Optional[bool]]]:
    """What this rank loads: (handle, optimizer state or None for the parameter, store key, tier,
    compress), parameter shards first."""
    config = parts.config
    training = parts.training
    unique = _loaded_handles(parts, files.metadata)
    optimizer = files.optimizer if load_optimizer else None
    with_state = set(optimizer["with_state"]) if training is not None and optimizer is not None else set()
    loads: list[tuple[ParamHandle, Optional[str], str, str, Optional[bool]]] = []
    for h in unique:
        # A parameter that is its own fp32 master is staged, never written in place (the commit renames
        # it there); when the checkpoint has its master, that is what is staged.
        staged = training.param_staging_key(h.name) if training is not None and h.trainable else None
        if staged is None:
            loads.append((h, None, h.key, config.param_tier, None))
        elif h.name not in with_state:
            loads.append((h, None, staged, config.param_tier, None))
    if with_state:
        assert training is not None and optimizer is not None
        by_name = {h.name: h for h in unique}
        for name in optimizer["with_state"]:
            if name not in by_name:
                raise CheckpointError(f"{files.path!r}: the optimizer has state for {name!r}, not a parameter")
            one_copy = training.master_is_param(name)
            for state, key in zip(STATE_NAMES, training.staging_keys(name)):
                as_param = one_copy and state == "master"
                loads.append((by_name[name], state, key, config.param_tier if as_param else config.optimizer_tier,
                              None if as_param else config.compress_optimizer))
    return loads


def _loaded_handles(parts: EngineParts, metadata: Mapping[str, Any]) -> list[ParamHandle]:
    """The parameters a load restores: every one, but a frozen one (``requires_grad=False``) only
    if the checkpoint has it when the save left the frozen ones out; the others keep their values."""
    unique = _unique(parts.handles)
    if not metadata.get("frozen_excluded"):
        return unique
    saved = {p["name"] for p in metadata["params"]}
    return [h for h in unique if h.trainable or h.name in saved]


def _buffer_rank(parts: EngineParts, files: CheckpointFiles) -> int:
    return parts.io.rank if parts.io.rank < files.world_size else 0


def _check_files(parts: EngineParts, files: CheckpointFiles, load_optimizer: bool) -> None:
    """Every tensor this rank will read is in the saved files it will read, with the expected dtype and size."""
    for handle, state, *_ in _loads(parts, files, load_optimizer):
        layout = handle.layout
        ranks = files.ranks_holding(handle.name, layout.shard_offset, layout.shard_offset + layout.shard_numel)
        files.check_shards(handle.name, state, layout.dtype if state is None else torch.float32, ranks)
    reader = files.reader(_buffer_rank(parts, files))
    saved = {b["name"] for b in files.metadata["buffers"]}
    for name, buf in _buffers_to_load(parts, saved).items():
        spec = reader.specs.get("buffer/" + name)
        if spec is None:
            raise CheckpointError(f"{reader.path!r} has no tensor {'buffer/' + name!r}")
        # A floating buffer loads cast into the model's floating dtype: DeepSpeed keeps buffers fp32
        # under bf16/fp16, where the engine casts them to EngineConfig.train_dtype.
        cast = spec.dtype.is_floating_point and buf.dtype.is_floating_point
        if (spec.dtype != buf.dtype and not cast) or spec.shape != tuple(buf.shape):
            raise CheckpointError(
                f"{reader.path!r}: buffer {name!r} is {spec.dtype} {spec.shape}, the model's {buf.dtype} "
                f"{tuple(buf.shape)}"
            )


def _load_files(parts: EngineParts, files: CheckpointFiles, load_optimizer: bool, load_step_count: bool) -> None:
    store, config = parts.io.store, parts.config
    loads = _loads(parts, files, load_optimizer)
    total = sum(h.layout.shard_numel * torch.float32.itemsize if state else h.layout.shard_nbytes
                for h, state, *_ in loads)
    bar = byte_progress("loading checkpoint", total, enabled=config.progress, rank=parts.io.rank)
    puts = _BoundedPuts(store, LOAD_INFLIGHT_BYTES)
    try:
        with bar:
            for handle, state, key, tier, compress in loads:
                layout = handle.layout
                shard = files.read_elements(handle.name, layout.shard_offset,
                                            layout.shard_offset + layout.shard_numel, state)
                puts.put(key, shard, tier, compress)
                bar.advance(shard.numel() * shard.element_size())
            puts.wait()
    finally:
        puts.wait(raise_errors=False)
    rank = _buffer_rank(parts, files)
    saved = {b["name"] for b in files.metadata["buffers"]}
    with torch.no_grad():
        for name, buf in _buffers_to_load(parts, saved).items():
            buf.copy_(files.buffer(name, rank))
    torch_state = _torch_optimizer(parts)
    if load_optimizer and torch_state is not None:
        torch_optimizer.restore(torch_state, files.metadata.get("torch_optimizer"), lambda name: files.read(0, name),
                                files.path)
    optimizer = files.optimizer if load_optimizer else None
    if parts.training is not None:
        if optimizer is not None:
            _restore_hyperparameters(parts.optimizer, optimizer)
            _restore_loss_scale(parts.training, optimizer.get("loss_scale"), files.path)
            parts.training.commit_staged(optimizer["step"], optimizer["shard_steps"])
        else:  # weights only: the optimizer starts afresh from them (its step count too, unless asked)
            saved = files.optimizer
            step = saved["step"] if load_step_count and saved is not None else parts.training.completed_steps
            parts.training.commit_staged(step, {})


def _restore_loss_scale(training: Any, saved: Any, path: Any) -> None:
    """The saved loss scaler state, when both the checkpoint and this engine scale the loss (either
    side without scaling: the engine keeps its own, initial, state)."""
    if training.scaler is None or saved is None:
        return
    try:
        training.scaler.load_state_dict(saved)
    except ValueError as exc:
        raise CheckpointError(f"{path!r}: loss scale: {exc}") from exc


def _restore_hyperparameters(optimizer: Any, saved: dict[str, Any]) -> None:
    current = optimizer.param_groups
    indices = optimizer.hyperparameter_state_dict()["param_groups"]
    groups = []
    for group, now, mine in zip(saved["param_groups"], current, indices):
        group = {k: tuple(v) if isinstance(now.get(k), tuple) and isinstance(v, list) else v
                 for k, v in group.items() if k != "param_names"}
        group.setdefault("params", mine["params"])  # an imported group names its parameters instead (checked)
        groups.append(group)
    # The step counts come with the moments, from the checkpoint's step record (commit_staged).
    optimizer.load_state_dict({"state": {}, "param_groups": groups, "shard_steps": optimizer.shard_steps})


# ---------------------------------------------------------------------------- helpers


def check_between_steps(parts: EngineParts, what: str, *, intent: str = "read") -> None:
    """RuntimeError naming ``what`` if a parameter is in use (the model's forward or backward runs);
    then finish an optimizer step that stopped part way, so what follows sees one step's state
    (``intent``: what ``what`` does with it, for ``Training.complete_pending``)."""
    with parts.pager.lock:
        busy = [h.name for h in parts.handles if h.held]
        if busy:
            raise RuntimeError(
                f"cannot {what} while the model is running (parameters in use: {busy[:3]}); call it between steps"
            )
    if parts.training is not None:
        parts.training.complete_pending(intent)


def _live_state_keys(parts: EngineParts, exclude_frozen: bool = False) -> dict[str, tuple[str, str, str]]:
    """Shard name -> store keys of its master, exp_avg, exp_avg_sq, for shards that have state (of
    the parameters a save writes)."""
    if parts.training is None:
        return {}
    store = parts.io.store
    saved = {h.name for h in _saved_handles(parts, exclude_frozen)}
    out = {}
    for shard in parts.training.live_shards():
        keys = (shard.master_key, shard.exp_avg_key, shard.exp_avg_sq_key)
        if shard.name in saved and all(k in store for k in keys):
            out[shard.name] = keys
    return out


def _unique(handles: Sequence[ParamHandle]) -> list[ParamHandle]:
    return list({id(h): h for h in handles}.values())


def _saved_handles(parts: EngineParts, exclude_frozen: bool) -> list[ParamHandle]:
    """The parameters a save writes: every one, or those that take a gradient."""
    return [h for h in _unique(parts.handles) if h.trainable or not exclude_frozen]


def _store_reader(store: Any, key: str) -> Callable[[], torch.Tensor]:
    return lambda: store.sync.get(key)


def _torch_optimizer(parts: EngineParts) -> Optional[torch.optim.Optimizer]:
    """The engine's optimizer when it is a plain torch one (its state then goes in rank 0's file)."""
    return parts.optimizer if parts.training is None and parts.optimizer is not None else None


def _value(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: tensor.detach()


class _BoundedPuts:
    """Store puts in flight with at most ``limit`` bytes outstanding (at least one put)."""

    def __init__(self, store: Any, limit: int) -> None:
        self._store = store
        self._limit = limit
        self._pending: list[tuple[Any, int]] = []
        self._bytes = 0

    def put(self, key: str, tensor: torch.Tensor, tier: str, compress: Optional[bool]) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        while self._pending and self._bytes + nbytes > self._limit:
            future, n = self._pending.pop(0)
            self._bytes -= n
            future.result()
        self._pending.append((self._store.sync.put_future(key, tensor, tier, compress), nbytes))
        self._bytes += nbytes

    def wait(self, raise_errors: bool = True) -> None:
        pending, self._pending, self._bytes = self._pending, [], 0
        wait_all((future for future, _ in pending), raise_errors=raise_errors)


def attempt(fn: Callable[[], Any]) -> Optional[BaseException]:
    """Run ``fn``; return its exception (to share with the other ranks) or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - handed to agree, which raises it
        return exc
    return None


def gather_objects(io: ShardIO, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` in one process)."""
    if io.collectives is None:
        return [obj]
    comm = io.collectives
    return comm.run(comm.all_gather_object, obj)


def agree(io: ShardIO, error: Optional[BaseException], doing: str, failed: Sequence[int] = ()) -> None:
    """Raise on every rank if any rank failed: this rank's own error as it is, else a CheckpointError
    naming the ranks that failed and why."""
    messages = gather_objects(io, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    bad = {r: m for r, m in enumerate(messages) if m is not None}
    bad.update({r: bad.get(r, "its file could not be written") for r in failed})
    if bad:
        detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(bad.items()))
        raise CheckpointError(f"{doing} failed on another rank: {detail}")


__all__ = [
    "CheckpointError", "EngineParts", "agree", "attempt", "check_between_steps", "consolidated_state_dict",
    "buffer_record", "fsync_dir", "gather_objects", "holds_saved_checkpoint", "load_checkpoint", "param_record",
    "prepare_partial", "publish", "rank_file", "save_checkpoint", "write_tensors",
]
