"""Import a DeepSpeed ZeRO-1, 2 or 3 checkpoint as an engine checkpoint (``tiered import-deepspeed``).

DeepSpeed's ``model_engine.save_checkpoint(dir)`` at ZeRO-3 writes, for each data-parallel rank
``r`` of ``W``, ``<dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (parameter shapes,
the frozen parameters' pieces, buffers, step counts, the caller's ``client_state``) and
``..._optim_states.pt`` (``bf16_`` in front under bf16): the rank's fp32 master weights and Adam
moments, as flat tensors of "sub-groups". In a sub-group each parameter takes ``S = ceil(numel /
W)`` elements of every rank, rank ``r`` holding elements ``[r*S, (r+1)*S)`` of it flattened: the
layout of an engine checkpoint saved by ``W`` ranks (``engine.io.checkpoint_files``). So an import
rewrites each DeepSpeed rank's pieces into one rank file of an engine checkpoint, one tensor at a
time.

At ZeRO-1 and 2, rank 0 writes the model states alone (``mp_rank_00_model_states.pt``: the whole
module, frozen parameters included) and each rank its optimizer states: each parameter group's
parameters, flattened and concatenated, split into ``W`` equal partitions, with a map of where
each parameter's piece lies in the rank's partition. The import joins each parameter's pieces
into a one-rank engine checkpoint, one parameter at a time.

Then ``eng.load_checkpoint(out)`` resumes either at any world size (master weights, moments, step
counts, hyperparameters, the fp16 loss scale; DeepSpeed's LR scheduler state comes back as
``client_state["lr_scheduler"]``), ``tiered export`` writes its weights in Hugging Face's layout,
and ``engine.wrap(model, state_dict=out)`` serves it.

The files are pickles. They are read with ``torch.load(weights_only=True)``, which builds tensors
and plain containers only; DeepSpeed's own classes in them (the ZeRO stage, the loss scaler, a
piece's address) are read as inert records, so DeepSpeed need not be installed. A file holding any
other object (a ``client_state`` with arbitrary objects) is refused unless ``trust_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import warnings
from typing import Any, Callable, Optional

import torch

from engine.checkpoint.sharded import buffer_record, param_record, prepare_partial, publish, write_tensors
from engine.errors import CheckpointError
from engine.io.checkpoint_files import (
    FORMAT,
    PARTIAL_SUFFIX,
    STATE_NAMES,
    VERSION,
    deepspeed_model_file,
    deepspeed_zero12_model_file,
    rank_file,
    tensor_name,
)
from engine.io.checkpoint_paths import resolve_checkpoint
from engine.io.client_state import split_client_state, tensor_sources
from engine.io.safetensors_stream import TensorSpec
from engine.paging.layout import ShardLayout

_OPTIM_FILES = ("zero_pp_rank_{}_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt")
#: What DeepSpeed itself writes in a model states file; every other key is the caller's client_state.
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info",
})
#: DeepSpeed's ``optimizer.type`` values (lowercased) whose state is Adam's: torch's, DeepSpeed's
#: fused or CPU Adam, in AdamW mode unless ``adam_w_mode`` is false.
_ADAM_TYPES = frozenset({"adam", "adamw"})
#: The torch.optim.AdamW settings of an imported group besides lr, betas, eps and weight_decay.
_ADAMW_FIXED = {"amsgrad": False, "maximize": False, "foreach": None, "fused": None, "capturable": False,
                "differentiable": False, "decoupled_weight_decay": True}


class _DeepSpeedRecord:
    """An object of one of DeepSpeed's classes (a loss scaler) read back as its attributes only."""


def _zero_stage(value: int) -> int:
    return int(value)


#: DeepSpeed's own classes in its checkpoint files, by the name its pickles give them, and what
#: they are read as here (so DeepSpeed need not be installed).
_DEEPSPEED_CLASSES: dict[str, Callable[..., Any]] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _DeepSpeedRecord,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _DeepSpeedRecord,
    # where a ZeRO-1/2 rank's piece of a parameter lies in its partition (numel, start)
    "deepspeed.utils.tensor_fragment.fragment_address": _DeepSpeedRecord,
}


class _TrustingUnpickler(pickle.Unpickler):
    """Builds any object (``trust_pickle=True``), DeepSpeed's own classes as above."""

    def find_class(self, module: str, name: str) -> Any:
        known = _DEEPSPEED_CLASSES.get(f"{module}.{name}")
        return known if known is not None else super().find_class(module, name)


class _TrustingPickle:
    """The ``pickle_module`` torch.load unpickles a trusted file with."""

    Unpickler = _TrustingUnpickler
    load = staticmethod(pickle.load)


@dataclasses.dataclass(frozen=True)
class _Param:
    """One parameter of the checkpoint: its layout over DeepSpeed's ranks (contiguous, in the
    training dtype) and where each rank keeps its piece."""

    name: str
    layout: ShardLayout
    #: Index of its optimizer sub-group and its offset in each rank's flat tensors; -1 when frozen.
    sub_group: int = -1
    offset: int = 0

    @classmethod
    def of(cls, name: Any, shape: Any, dtype: torch.dtype, world: int, sub_group: int = -1,
           offset: int = 0) -> "_Param":
        shape = tuple(int(d) for d in shape)
        stride = tuple(torch.empty(shape, device="meta").stride())  # DeepSpeed flattens the contiguous tensor
        return cls(str(name), ShardLayout(shape, dtype, stride, 0, world), sub_group, offset)

    @property
    def trainable(self) -> bool:
        return self.sub_group >= 0


class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint of stage 1, 2 or 3 (its tag directory: ``path/tag``, or the tag
    ``path/latest`` names, or ``path`` itself), checked on open; each rank's files are read when
    written out."""

    def __init__(self, path: "str | os.PathLike[str]", tag: Optional[str] = None, *,
                 trust_pickle: bool = False) -> None:
        self.path = resolve_checkpoint(path, tag)
        self._trust_pickle = trust_pickle
        zero3 = os.path.isfile(deepspeed_model_file(self.path, 0))
        if not zero3 and not os.path.isfile(deepspeed_zero12_model_file(self.path)):
            raise CheckpointError(f"{self.path!r} is not a DeepSpeed checkpoint: it has neither "
                                  f"{os.path.basename(deepspeed_model_file(self.path, 0))} (ZeRO-3) nor "
                                  f"{os.path.basename(deepspeed_zero12_model_file(self.path))}")
        model = self._load(deepspeed_model_file(self.path, 0) if zero3 else deepspeed_zero12_model_file(self.path))
        self.ds_world_size = int(model.get("dp_world_size", 0))
        if model.get("mp_world_size", 1) != 1:
            raise CheckpointError(
                f"{self.path!r} was saved with model (tensor) parallelism of {model['mp_world_size']}; only data "
                "parallel ZeRO checkpoints import"
            )
        if self.ds_world_size < 1:
            raise CheckpointError(f"{self.path!r}: its model states give no data-parallel world size")
        optim = self._load(self._optim_file(0))["optimizer_state_dict"]
        self._rank0 = (model, optim)  # read once, used again when rank 0's file is written
        self.zero_stage = self._check_stage(optim, zero3)
        #: Ranks of the engine checkpoint written: DeepSpeed's at ZeRO-3, whose layout is the engine's;
        #: one at ZeRO-1/2, whose ranks split the concatenated parameters, so each is written whole.
        self.world_size = self.ds_world_size if zero3 else 1
        self.global_steps = int(model.get("global_steps", 0))
        self.skipped_steps = int(model.get("skipped_steps", 0))
        self.ds_version = str(model.get("ds_version", "unknown"))
        self.ds_config: dict[str, Any] = model.get("ds_config") or {}
        inner = optim["optimizer_state_dict" if zero3 else "base_optimizer_state"]
        self._check_adam(inner)
        self._state_steps = {int(i): int(s["step"]) for i, s in inner["state"].items()}
        flats = optim["fp32_flat_groups" if zero3 else "single_partition_of_fp32_groups"]
        self.params = self._layout(model, flats)
        self.groups = self._param_groups(inner, len(flats))
        self.tied = {str(k): str(v) for k, v in (model.get("shared_params") or {}).items()}
        #: Saved with ``exclude_frozen_parameters=True`` (as the Trainer saves a PEFT model): DeepSpeed
        #: then records no frozen parameters at all, so a load keeps the model's own values for them.
        #: (ZeRO-1 never records their shapes, but keeps them in the module states unless left out.)
        self.frozen_excluded = (model.get("frozen_param_shapes") is None
                                and not any(not p.trainable for p in self.params))
        self.buffers = {name: model["module"][name] for name in model.get("buffer_names", [])
                        if name in model["module"]}
        self.loss_scale = self._loss_scale(optim)
        self.lr_scheduler: Optional[dict[str, Any]] = model.get("lr_scheduler")
        self.client_state, self.client_tensors = _client_state(model, self.path)
        if self.lr_scheduler is not None:  # DeepSpeed keeps it beside the client_state keys, and so does the import
            self.client_state["lr_scheduler"] = _json_or_none(self.lr_scheduler)

    # ------------------------------------------------------------------ reading the pickles

    def _load(self, file: str) -> dict[str, Any]:
        safe_globals = getattr(torch.serialization, "safe_globals", None)
        if safe_globals is None and not self._trust_pickle:
            raise CheckpointError(
                f"reading {file!r} without unpickling arbitrary objects needs torch >= 2.6 (torch.serialization."
                f"safe_globals; this is {torch.__version__}): upgrade torch, or pass trust_pickle=True for files "
                "you trust"
            )
        try:
            if self._trust_pickle:
                return torch.load(file, map_location="cpu", weights_only=False, mmap=True,
                                  pickle_module=_TrustingPickle)
            with safe_globals([(known, name) for name, known in _DEEPSPEED_CLASSES.items()]):
                return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as exc:
            reason = next((line.strip() for line in str(exc).splitlines() if "Unsupported global" in line),
                          str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            raise CheckpointError(
                f"{file!r} holds an object torch.load(weights_only=True) does not build ({reason}); if you trust "
                "the file (your own DeepSpeed run wrote it), import with trust_pickle=True (--trust-pickle)"
            ) from exc
        except (RuntimeError, EOFError, OSError) as exc:
            raise CheckpointError(f"{file!r} could not be read as a torch checkpoint file: {exc}") from exc

    def _optim_file(self, rank: int) -> str:
        for pattern in _OPTIM_FILES:
            file = os.path.join(self.path, pattern.format(rank))
            if os.path.isfile(file):
                return file
        raise CheckpointError(
            f"{self.path!r} has no optimizer states file for rank {rank} ({_OPTIM_FILES[0].format(rank)}): ZeRO "
            "keeps the fp32 weights there, so every rank's file is needed. (A checkpoint saved without ZeRO, stage "
            "0, has none: its weights are the 'module' entry of mp_rank_00_model_states.pt, for engine.wrap("
            "state_dict=...).)"
        )

    # ------------------------------------------------------------------ what rank 0's files say

    def _check_adam(self, inner: dict[str, Any]) -> None:
        """CheckpointError unless the optimizer was Adam or AdamW (DeepSpeed's, torch's or apex's)."""
        kind = str((self.ds_config.get("optimizer") or {}).get("type", "adamw")).lower()
        keys = sorted({key for state in inner["state"].values() for key in state})
        if kind not in _ADAM_TYPES or any(key not in ("step", "exp_avg", "exp_avg_sq") for key in keys) or (
                inner["state"] and keys != ["exp_avg", "exp_avg_sq", "step"]):
            raise CheckpointError(
                f"{self.path!r} was trained with the optimizer {kind!r} (state {keys}); only Adam and AdamW import, "
                "into engine.AdamW. For the weights alone, run DeepSpeed's zero_to_fp32.py on it and pass the file "
                "to engine.wrap(state_dict=...)"
            )

    def _check_stage(self, optim: dict[str, Any], zero3: bool) -> int:
        """The ZeRO stage of rank 0's optimizer states, checked against the files' layout and world size."""
        stage = optim.get("zero_stage")
        if stage is None and not zero3 and "base_optimizer_state" in optim:
            stage = 1  # DeepSpeed's bf16 optimizer (bf16 at ZeRO-1) partitions as ZeRO-1 and records no stage
        if stage not in ((3,) if zero3 else (1, 2)):
            raise CheckpointError(f"{self.path!r}: its optimizer states say ZeRO stage {stage!r} where its files "
                                  f"are laid out as stage {'3' if zero3 else '1 or 2'}'s")
        counts = optim.get("partition_count")
        if any(int(c) != self.ds_world_size for c in (counts if isinstance(counts, (list, tuple)) else [counts])):
            raise CheckpointError(f"{self.path!r}: the optimizer is split {counts!r} ways, the model over "
                                  f"{self.ds_world_size} ranks")
        return int(stage)

    def _layout(self, model: dict[str, Any], flats: list[torch.Tensor]) -> list[_Param]:
        module, world = model["module"], self.world_size
        shapes = model.get("param_shapes") or []
        if len(shapes) != len(flats):
            raise CheckpointError(f"{self.path!r}: {len(shapes)} parameter shape groups for {len(flats)} flat "
                                  "optimizer groups (not a ZeRO checkpoint this importer knows)")
        params: list[_Param] = []
        for index, group in enumerate(shapes):
            offset = 0
            for name, shape in group.items():
                param = _Param.of(name, shape, _dtype(module, name, self.path), world, index, offset)
                params.append(param)
                offset += param.layout.shard_numel
            if self.zero_stage == 3 and offset != flats[index].numel():
                raise CheckpointError(f"{self.path!r}: flat optimizer group {index} holds {flats[index].numel()} "
                                      f"elements per rank, its parameters {offset}")
        frozen = model.get("frozen_param_shapes") or {}
        if self.zero_stage < 3:  # the module states hold the whole model: its other tensors are frozen parameters
            known = {*(p.name for p in params), *model.get("buffer_names", []), *(model.get("shared_params") or {})}
            frozen = {n: v.shape for n, v in module.items() if n not in known and isinstance(v, torch.Tensor)}
        for name, shape in frozen.items():
            params.append(_Param.of(name, shape, _dtype(module, name, self.path), world))
        return params

    def _param_groups(self, inner: dict[str, Any], subs: int) -> list[dict[str, Any]]:
        """Each parameter group's AdamW hyperparameters and the names of its parameters."""
        settings = (self.ds_config.get("optimizer") or {}).get("params") or {}
        group_of_sub: dict[int, int] = {}
        groups = []
        for g, group in enumerate(inner["param_groups"]):
            for sub in group["params"]:
                group_of_sub[int(sub)] = g
            decoupled = group.get("decoupled_weight_decay", settings.get("adam_w_mode", True))
            problems = [f"{key}={group[key]!r}" for key in ("amsgrad", "maximize") if group.get(key)]
            if not group.get("bias_correction", True):
                problems.append("bias_correction=False")
            if not decoupled and group.get("weight_decay", 0.0):
                problems.append("weight decay added to the gradient (Adam with adam_w_mode=false)")
            if problems:
                raise CheckpointError(f"{self.path!r}: parameter group {g} was trained with {', '.join(problems)}; "
                                      "the engine's optimizer is torch's AdamW, which has none of these")
            groups.append({"lr": float(group["lr"]), "betas": [float(b) for b in group["betas"]],
                           "eps": float(group["eps"]), "weight_decay": float(group.get("weight_decay", 0.0)),
                           **_ADAMW_FIXED})
        if sorted(group_of_sub) != list(range(subs)):
            raise CheckpointError(f"{self.path!r}: the optimizer's groups list sub-groups {sorted(group_of_sub)}, "
                                  f"the checkpoint has {subs}")
        for state in self._state_steps:
            if state not in group_of_sub:
                raise CheckpointError(f"{self.path!r}: optimizer state for an unknown sub-group {state}")
        for g, group in enumerate(groups):
            group["param_names"] = [p.name for p in self._trainable() if group_of_sub[p.sub_group] == g]
        return groups

    def _trainable(self) -> list[_Param]:
        return [p for p in self.params if p.trainable]

    def _loss_scale(self, optim: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The fp16 loss scaler's state as ``engine.LossScaler.state_dict()`` has it; None without fp16."""
        scaler = optim.get("loss_scaler")
        if not any(p.layout.dtype == torch.float16 for p in self.params) or scaler is None:
            return None
        record = vars(scaler) if not isinstance(scaler, dict) else scaler
        scale = float(record.get("cur_scale", 1.0))
        if not optim.get("dynamic_loss_scale"):
            return {"scale": scale, "good_steps": 0, "hysteresis_left": 1, "skipped_steps": self.skipped_steps}
        # DeepSpeed (0.19) doubles the scale in the step whose count of good steps before it, since
        # the last overflow, is a positive multiple of the window; the engine's scaler in the step
        # that makes its good_steps reach the window. Which step grows next decides good_steps.
        # Right after an overflow DeepSpeed waits one step longer than the engine can be told to.
        window = int(record["scale_window"])
        stable = int(record["cur_iter"]) - int(record["last_overflow_iter"]) - 1
        before_growth = window if stable <= 0 else -stable % window
        return {"scale": scale, "good_steps": max(window - 1 - before_growth, 0),
                "hysteresis_left": int(record.get("cur_hysteresis", 1)), "skipped_steps": self.skipped_steps}

    # ------------------------------------------------------------------ one rank's tensors

    def rank_sources(self, rank: int) -> list[tuple[TensorSpec, Callable[[], torch.Tensor]]]:
        """Rank ``rank``'s tensors as an engine checkpoint's rank file names them, each with a getter."""
        if self.zero_stage == 3:
            return self._zero3_sources(rank)
        assert rank == 0, rank  # a ZeRO-1/2 import writes one rank file
        return self._zero12_sources()

    def _zero3_sources(self, rank: int) -> list[tuple[TensorSpec, Callable[[], torch.Tensor]]]:
        """ZeRO-3: DeepSpeed rank ``rank``'s pieces of every parameter, as the engine's rank ``rank`` holds them."""
        if rank == 0:
            model, optim = self._rank0
        else:
            model = self._load(deepspeed_model_file(self.path, rank))
            optim = self._load(self._optim_file(rank))["optimizer_state_dict"]
        flats, inner = optim["fp32_flat_groups"], optim["optimizer_state_dict"]
        for param in self._trainable():
            end = param.offset + param.layout.shard_numel
            if param.sub_group >= len(flats) or flats[param.sub_group].numel() < end:
                raise CheckpointError(f"rank {rank}'s optimizer states do not hold {param.name!r} where rank 0's do")
        fragments = model.get("frozen_param_fragments") or {}
        sources: list[tuple[TensorSpec, Callable[[], torch.Tensor]]] = []
        for param in self.params:
            layout = param.layout
            spec = TensorSpec(tensor_name(param.name), layout.dtype, (layout.shard_numel,))
            if param.trainable:
                sources.append((spec, _piece(flats[param.sub_group], param, rank, layout.dtype)))
            else:
                fragment = fragments.get(param.name)
                if fragment is None or fragment.numel() != layout.shard_numel:
                    raise CheckpointError(f"rank {rank}'s model states have no {layout.shard_numel}-element piece of "
                                          f"the frozen parameter {param.name!r}")
                sources.append((spec, _piece(fragment, param, rank, layout.dtype)))
        for param in self._trainable():
            if param.sub_group not in self._state_steps:
                continue  # no step taken yet: no moments (rank 0's files say)
            state = inner["state"].get(param.sub_group)
            if state is None:
                raise CheckpointError(f"rank {rank}'s optimizer states have no moments for {param.name!r}; rank 0's do")
            flats_of = {"master": flats[param.sub_group], "exp_avg": state["exp_avg"],
                        "exp_avg_sq": state["exp_avg_sq"]}
            for name in STATE_NAMES:
                sources.append((TensorSpec(tensor_name(param.name, name), torch.float32, (param.layout.shard_numel,)),
                                _piece(flats_of[name], param, rank, torch.float32)))
        return sources + self._buffer_sources(model, rank)

    def _zero12_sources(self) -> list[tuple[TensorSpec, Callable[[], torch.Tensor]]]:
        """ZeRO-1/2: the one rank file's tensors, every parameter whole. DeepSpeed's ranks split each
        group's parameters, concatenated, into equal partitions; each rank's ``param_slice_mappings``
        say where in its partition its piece of a parameter lies, so a parameter is its pieces in
        rank order."""
        model, optim = self._rank0
        optims = [optim, *(self._load(self._optim_file(r))["optimizer_state_dict"]
                           for r in range(1, self.ds_world_size))]
        for rank, each in enumerate(optims):
            if "param_slice_mappings" not in each:
                raise CheckpointError(f"rank {rank}'s optimizer states have no param_slice_mappings (DeepSpeed "
                                      f"{self.ds_version}); a ZeRO-1/2 checkpoint of DeepSpeed >= 0.10 imports")
        sources: list[tuple[TensorSpec, Callable[[], torch.Tensor]]] = []
        for param in self.params:
            layout = param.layout
            spec = TensorSpec(tensor_name(param.name), layout.dtype, (layout.numel,))
            if param.trainable:
                sources.append((spec, self._joined(optims, param, "master", layout.dtype)))
            else:  # a frozen parameter: the module states hold it whole
                value = model["module"][param.name]
                sources.append((spec, lambda v=value, d=layout.dtype: v.reshape(-1).to(d, copy=True)))
        for param in self._trainable():
            if param.sub_group in self._state_steps:
                for name in STATE_NAMES:
                    sources.append((TensorSpec(tensor_name(param.name, name), torch.float32, (param.layout.numel,)),
                                    self._joined(optims, param, name, torch.float32)))
        return sources + self._buffer_sources(model, 0)

    def _joined(self, optims: list[dict[str, Any]], param: _Param, state: str, dtype: torch.dtype
                ) -> Callable[[], torch.Tensor]:
        """A getter of ``param``'s fp32 master (``state`` "master") or Adam moment, whole, from the
        pieces of it every ZeRO-1/2 rank holds, as ``dtype``."""
        def get() -> torch.Tensor:
            pieces = []
            for optim in optims:
                where = optim["param_slice_mappings"][param.sub_group].get(param.name)
                if where is None:
                    continue  # none of it on this rank
                flat = (optim["single_partition_of_fp32_groups"][param.sub_group] if state == "master"
                        else optim["base_optimizer_state"]["state"][param.sub_group][state])
                pieces.append(flat.reshape(-1).narrow(0, int(where.start), int(where.numel)))
            out = torch.cat(pieces).to(dtype) if pieces else torch.empty(0, dtype=dtype)
            if out.numel() != param.layout.numel:
                raise CheckpointError(f"{self.path!r}: DeepSpeed's ranks hold {out.numel()} elements of "
                                      f"{param.name!r} ({state}), which has {param.layout.numel}")
            return out
        return get

    def _buffer_sources(self, model: dict[str, Any], rank: int) -> list[tuple[TensorSpec, Callable[[], torch.Tensor]]]:
        """The buffers, whole, from a model states file."""
        sources: list[tuple[TensorSpec, Callable[[], torch.Tensor]]] = []
        module = model["module"]
        for name in self.buffers:
            value = module.get(name)
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"rank {rank}'s model states have no buffer {name!r}")
            sources.append((TensorSpec("buffer/" + name, value.dtype, tuple(value.shape)),
                            lambda value=value: value.detach().clone()))
        return sources

    # ------------------------------------------------------------------ the engine checkpoint's metadata

    def metadata(self, files: dict[str, Any]) -> dict[str, Any]:
        """The engine checkpoint's ``metadata.json`` for rank files recorded in ``files``."""
        names: dict[str, list[str]] = {p.name: [p.name] for p in self.params}
        for name, source in self.tied.items():
            if source in names and name not in names:
                names[source].append(name)
        params = [param_record(p.name, names[p.name], p.layout, p.trainable) for p in self.params]
        buffers = [buffer_record(n, b, True) for n, b in self.buffers.items()]  # DeepSpeed saves persistent ones
        stepped = [p.name for p in self._trainable() if p.sub_group in self._state_steps]
        optimizer = None
        if self._trainable():
            optimizer = {
                # DeepSpeed counts the steps an fp16 overflow skipped; the engine counts those taken
                "type": "engine.AdamW", "step": self.global_steps - self.skipped_steps,
                "shard_steps": {p.name: int(self._state_steps[p.sub_group]) for p in self._trainable()
                                if p.name in stepped},
                "param_groups": self.groups, "with_state": stepped, "loss_scale": self.loss_scale,
            }
        return {
            "format": FORMAT, "version": VERSION, "world_size": self.world_size, "params": params,
            "frozen_excluded": self.frozen_excluded, "buffers": buffers, "optimizer": optimizer, "files": files,
            "client_state": self.client_state,
            "imported_from": {"format": f"deepspeed-zero{self.zero_stage}", "path": self.path,
                              "ds_version": self.ds_version, "dp_world_size": self.ds_world_size,
                              "global_steps": self.global_steps, "skipped_steps": self.skipped_steps},
        }


def import_deepspeed_checkpoint(path: "str | os.PathLike[str]", out: "str | os.PathLike[str]", *,
                                tag: Optional[str] = None, overwrite: bool = False, trust_pickle: bool = False,
                                progress: bool = True) -> str:
    """Convert the DeepSpeed ZeRO checkpoint (stage 1, 2 or 3) at ``path`` (``path/tag``, or the tag
    its ``latest`` names) into an engine checkpoint at ``out`` (its parent created if missing),
    written atomically; return ``out``'s absolute path.

    ``eng.load_checkpoint(out)`` then resumes training from it at any world size, with an
    ``engine.AdamW`` whose parameter groups hold the same parameters as DeepSpeed's did (checked
    by name on load). One process, no process group; one tensor in memory at a time.

    Raises:
        engine.CheckpointError: ``path`` is not a DeepSpeed ZeRO checkpoint this can read (a
            missing rank's file, an optimizer other than Adam or AdamW, a pickled object without
            ``trust_pickle``, ...; the message says which), or ``out`` exists without ``overwrite``.
        OSError: ``out`` cannot be written; nothing is left at ``out`` then."""
    target = os.path.abspath(os.fspath(out))
    partial = target + PARTIAL_SUFFIX
    os.makedirs(os.path.dirname(target), exist_ok=True)
    prepare_partial(target, partial, overwrite)
    try:
        checkpoint = DeepSpeedCheckpoint(path, tag, trust_pickle=trust_pickle)
        files = {}
        for rank in range(checkpoint.world_size):
            sources = checkpoint.rank_sources(rank) + (tensor_sources(checkpoint.client_tensors) if rank == 0 else [])
            files[rank_file(rank)] = write_tensors(os.path.join(partial, rank_file(rank)), sources, rank,
                                                   f"importing rank {rank} of {checkpoint.world_size}", progress)
        publish(partial, target, checkpoint.metadata(files), overwrite)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


# ---------------------------------------------------------------------------- helpers


def _piece(flat: torch.Tensor, param: _Param, rank: int, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """A getter of ``param``'s rank ``rank`` piece of ``flat`` (a sub-group's flat tensor, or a
    frozen parameter's own piece at offset 0) as ``dtype``, its padding zeroed (DeepSpeed leaves
    whatever was in memory there)."""
    layout = dataclasses.replace(param.layout, rank=rank)
    offset = param.offset if param.trainable else 0

    def get() -> torch.Tensor:
        out = flat.reshape(-1)[offset:offset + layout.shard_numel].to(dtype, copy=True)
        out[max(0, layout.numel - layout.shard_offset):] = 0
        return out
    return get


def _dtype(module: dict[str, Any], name: str, path: str) -> torch.dtype:
    value = module.get(name)
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{path!r}: the model states have no entry for parameter {name!r}")
    return value.dtype


def _client_state(model: dict[str, Any], path: str) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The caller's ``client_state`` keys of a model states file that JSON and tensors hold, split
    as a checkpoint keeps them (``engine.io.client_state``); a warning names the others."""
    kept, dropped = {}, []
    for key, value in model.items():
        if key in _DEEPSPEED_KEYS:
            continue
        try:
            split_client_state({str(key): value})
            kept[str(key)] = value
        except (TypeError, ValueError):
            dropped.append(str(key))
    if dropped:
        warnings.warn(f"{path!r}: client_state keys {dropped} are neither JSON (numbers, strings, lists, dicts) nor "
                      "tensors, and are left out of the imported checkpoint", stacklevel=4)
    return split_client_state(kept)


def _json_or_none(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return None


__all__ = ["DeepSpeedCheckpoint", "import_deepspeed_checkpoint"]
