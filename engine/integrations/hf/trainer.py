"""Hugging Face ``Trainer`` over a wrapped model: :class:`EngineTrainer`, at any world size.

The Trainer runs a wrapped model as it is (its accumulation, LR schedule, logging, evaluation);
what it cannot see is the engine's: the gradients (in the store, so its ``clip_grad_norm_`` would find
none: the engine clips them at ``TrainingArguments.max_grad_norm``), the fp32 master weights and moments
(also in the store: :class:`EngineCheckpointCallback` saves the engine's checkpoint into each of
the Trainer's), and, with several processes, the parameters (the Trainer would put the model in
``DistributedDataParallel``, which cannot read released ones, and save the weights from rank 0
alone), and, with the engine's fp16 loss scaling, the scale (the Trainer's ``loss.backward()``
would not apply it, and a step skipped for an overflow would still advance the LR schedule).
:class:`EngineTrainer` handles all of it::

    trainer = EngineTrainer(eng, model=model, args=args, train_dataset=data)
    ...
    trainer.train(resume_from_checkpoint=ckpt)          # loads engine_checkpoint(ckpt) first, then the Trainer's

In one process a plain ``Trainer(..., optimizers=(eng.optimizer, None),
callbacks=[EngineCheckpointCallback(eng)])`` with ``max_grad_norm=0.0`` trains the same (logging a
``grad_norm`` of 0); its resume needs ``eng.load_checkpoint(engine_checkpoint(ckpt))`` first, and
without it is refused by ``engine.AdamW.load_state_dict`` (step counts without their moments) rather
than training on from fresh moments. Needs ``transformers``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.optimization import GreedyLR
from transformers.trainer_pt_utils import remove_dummy_checkpoint
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from engine.config.deepspeed import DeepSpeedConfig
from engine.engine import wrap
from engine.integrations.deepspeed.optimizer import scheduler_from_deepspeed
from engine.integrations.deepspeed.store import ScratchStoreEngine, removed_on_failure, wrap_in_own_directory
from engine.integrations.hf.trainer_deepspeed import plan_for_trainer, scheduled_config, training_arguments_source
from engine.io.checkpoint_paths import ENGINE_SUBDIR, engine_checkpoint
from engine.io.weights import StateDictLike
from engine.optim.overflow_scheduler import OverflowAwareScheduler
from engine.paging.placement import InitFn
from tiered import StoreConfig

#: Schedulers the Trainer steps on evaluation metrics rather than after each optimizer step.
_METRIC_STEPPED = (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)


class EngineCheckpointCallback(TrainerCallback):  # type: ignore[misc]
    """Saves ``eng``'s checkpoint (``eng.save_checkpoint``: shards, fp32 masters, moments, step
    counts) into ``checkpoint-<step>/engine`` each time the Trainer saves a checkpoint. Every
    rank runs it (the save is collective). ``exclude_frozen_parameters``: leave the frozen
    parameters out (a PEFT model's base weights, as the Trainer has DeepSpeed do for one). The
    Trainer's ``optimizer.pt`` beside it then holds ``engine.AdamW``'s hyperparameters and step
    counts alone (``AdamW.leave_state_to_checkpoints``), as it does for DeepSpeed: the state is in
    the engine's checkpoint, not twice, nor whole in the memory of rank 0."""

    def __init__(self, eng: Any, *, exclude_frozen_parameters: bool = False) -> None:
        self._eng = eng
        self._exclude_frozen = exclude_frozen_parameters
        _leave_state_to_checkpoints(eng)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Called by the Trainer right after it wrote ``checkpoint-<global_step>``."""
        trainer_dir = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self._eng.save_checkpoint(engine_checkpoint(trainer_dir), overwrite=True,
                                  exclude_frozen_parameters=self._exclude_frozen)


@dataclasses.dataclass
class EngineTrainingArguments(TrainingArguments):  # type: ignore[misc]
    """``TrainingArguments`` whose DeepSpeed config is the engine's: ``deepspeed=`` (``--deepspeed
    ds_config.json`` on the command line of a script that parses its arguments with ``HfArgumentParser``)
    is moved to :attr:`engine_deepspeed_config` before transformers sees it, so no ``deepspeed``
    package is needed, a ZeRO-3 config builds no model under ``deepspeed.zero.Init`` and accelerate
    starts no DeepSpeed process group; ``EngineTrainer(model=model, args=args)`` then builds the
    engine from it. Every other field is ``TrainingArguments``' own; ``deepspeed`` reads None."""

    #: The DeepSpeed config (a dict or a JSON path) given as ``deepspeed=``; None without one.
    engine_deepspeed_config: Optional[Union[dict, str]] = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.deepspeed:
            self.engine_deepspeed_config, self.deepspeed = self.deepspeed, None
        super().__post_init__()


class EngineTrainer(Trainer):  # type: ignore[misc]
    """The Trainer over a model ``engine.wrap`` returned ``eng`` for, at any world size.

    Same arguments as ``Trainer`` (``model`` must be ``eng.model``); ``optimizers`` defaults to
    ``(eng.optimizer, None)`` and an :class:`EngineCheckpointCallback` is added unless one is
    given. With several processes, or one under a launcher (a process group, or accelerate's
    distributed state), the model is kept out of ``DistributedDataParallel`` (the engine shards
    the parameters and averages the gradients across ranks itself). ``save_model``
    streams the weights (``eng.save_weights``) rather than holding the whole model in memory, the
    logged ``grad_norm`` is the engine's, the engine's fp16 loss scaling (DeepSpeed's ``fp16``
    section) scales the Trainer's backward and holds its LR schedule on skipped steps, and a PEFT
    model saves its adapter and leaves its frozen base out of the engine's checkpoints.

    Without ``eng``, the Trainer's DeepSpeed integration: ``EngineTrainer(model=model, args=args,
    deepspeed_config=ds_config)``, or ``args`` an :class:`EngineTrainingArguments` made with
    ``deepspeed=ds_config`` (``--deepspeed ds_config.json`` on a script's command line), wraps the
    model under that config (no ``deepspeed`` package needed), its ``"auto"`` values filled from
    the arguments as the Trainer fills them (:mod:`engine.integrations.hf.trainer_deepspeed`); the engine is
    ``trainer.engine``. ``store``: where its store goes (default: under the config's ``nvme_path``,
    else a temporary directory, removed when the engine closes); ``state_dict``/``init_fn``: as for
    ``engine.wrap``, so a model built on the meta device (larger than memory) is filled from its
    ``save_pretrained`` directory one tensor at a time, where the Trainer's DeepSpeed runs load it
    under ``zero.Init``. Plain ``TrainingArguments(deepspeed=...)`` is refused with a ``ValueError``
    naming those two forms: transformers needs the ``deepspeed`` package to make them, and with a
    ZeRO-3 config builds models under ``deepspeed.zero.Init`` and sets up DeepSpeed's process group."""

    def __init__(self, eng: Any = None, *args: Any, deepspeed_config: Optional[DeepSpeedConfig] = None,
                 store: Optional[StoreConfig] = None, state_dict: Optional[StateDictLike] = None,
                 init_fn: Optional[InitFn] = None, **kwargs: Any) -> None:
        if isinstance(eng, nn.Module):  # EngineTrainer(model, args, ...), as Trainer(model, args, ...)
            args, eng = (eng, *args), None
        model = _trainer_argument(args, kwargs, "model", 0)
        self._deepspeed_schedule: Optional[dict[str, Any]] = None
        if eng is not None:
            engine_deepspeed = getattr(_trainer_argument(args, kwargs, "args", 1), "engine_deepspeed_config", None)
            if any(x is not None for x in (deepspeed_config, engine_deepspeed, store, state_dict, init_fn)):
                raise ValueError("EngineTrainer(eng, deepspeed_config=/store=/state_dict=/init_fn=, or "
                                 "EngineTrainingArguments(deepspeed=...)): those build an engine; eng is one already")
            self._set_up(eng, model, args, kwargs)
            return
        eng, args, kwargs = self._engine_from_deepspeed(model, args, kwargs, deepspeed_config, store,
                                                        dict(state_dict=state_dict, init_fn=init_fn))
        try:
            self._set_up(eng, model, args, kwargs)
        except BaseException:
            eng.close()  # the engine this trainer made, refused: its store goes with it
            raise

    def _set_up(self, eng: Any, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The checks, then the Trainer's own ``__init__`` over ``eng``'s model and optimizer."""
        if model is not eng.model:
            raise ValueError("EngineTrainer(eng, model=...): model must be the model eng wraps (eng.model)")
        kwargs.setdefault("optimizers", (eng.optimizer, None))
        callbacks = list(kwargs.pop("callbacks", None) or [])
        if not any(isinstance(c, EngineCheckpointCallback) for c in callbacks):
            # A PEFT model's frozen base stays out, as the Trainer has DeepSpeed leave it out.
            callbacks.append(EngineCheckpointCallback(eng, exclude_frozen_parameters=is_peft_model(model)))
        training_args = _trainer_argument(args, kwargs, "args", 1)  # None: the Trainer's defaults
        _check_sharding(getattr(training_args, "deepspeed", None), getattr(training_args, "fsdp", None))
        _check_mixed_precision(getattr(training_args, "fp16", False))
        distributed = eng.world_size > 1 or _launched_distributed(getattr(training_args, "distributed_state", None))
        if distributed:
            _check_compile(getattr(training_args, "torch_compile", False))
        if training_args is not None:
            _check_device(eng.device, training_args.device)
        self.engine = eng
        super().__init__(*args, callbacks=callbacks, **kwargs)
        _check_clipping(self.args.max_grad_norm, eng)
        if distributed or _launched_distributed(self.accelerator.state):
            # What the Trainer does for a model that reduces its own gradients: accelerate's
            # evaluation-mode preparation (autocast under bf16/fp16 arguments, no DDP), which also
            # marks the model prepared, so the prepare() in train() leaves it as it is. Under a
            # launcher accelerate puts even one process's model in DDP, so this is not only for world > 1.
            self.accelerator.prepare_model(eng.model, device_placement=False, evaluation_mode=True)
            assert getattr(eng.model, "_is_accelerate_prepared", False), "accelerate no longer marks prepared models"

    def _engine_from_deepspeed(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                               deepspeed_config: Optional[DeepSpeedConfig], store: Optional[StoreConfig],
                               wrap_kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """The engine for ``model`` under the Trainer's DeepSpeed config, and the Trainer's arguments
        with the ``TrainingArguments`` it then runs with."""
        training_args = _trainer_argument(args, kwargs, "args", 1)
        source = training_arguments_source(training_args, deepspeed_config)
        if not isinstance(model, nn.Module) or training_args is None or source is None:
            raise ValueError("EngineTrainer needs an engine (EngineTrainer(eng, model=eng.model, ...)), or model= and "
                             "args= with a DeepSpeed config (deepspeed_config=, or "
                             "EngineTrainingArguments(deepspeed=...)) to build one from")
        plan = plan_for_trainer(model, training_args, source, store=store,
                                decay_parameter_names=self.get_decay_parameter_names(model),
                                trainer_optimizer=Trainer.get_optimizer_cls_and_kwargs)
        default = plan.default_store
        with removed_on_failure(default):
            scratch = default.scratch if default else None
            engine_class = functools.partial(ScratchStoreEngine, scratch_dir=scratch)
            eng = wrap_in_own_directory(default, plan.config, lambda config: wrap(
                model, optimizer=plan.optimizer, config=config, **wrap_kwargs, engine_class=engine_class))
        if "scheduler" in plan.deepspeed_config:
            self._deepspeed_schedule = plan.deepspeed_config
        if "args" in kwargs:
            kwargs = {**kwargs, "args": plan.args}
        else:
            args = (args[0], plan.args, *args[2:])
        return eng, args, kwargs

    def train(self, resume_from_checkpoint: "str | bool | None" = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; resuming from one of its checkpoints (a path, or True for the last
        under ``output_dir``) first loads the engine's checkpoint saved in it (fp32 masters, moments,
        step counts), as the Trainer has DeepSpeed load its own, then the Trainer's state."""
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)  # None: the Trainer raises, naming the directory
        if isinstance(path, (str, os.PathLike)) and os.path.isdir(engine_checkpoint(path)):
            self.engine.load_checkpoint(engine_checkpoint(path))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loss; under the engine's fp16 loss scaling, passed through
        ``eng.with_loss_scale`` so the Trainer's ``backward`` scales it (as DeepSpeed's does)."""
        result = super().compute_loss(model, inputs, *args, **kwargs)
        if isinstance(result, tuple):  # return_outputs=True
            return (self.engine.with_loss_scale(result[0]), *result[1:])
        return self.engine.with_loss_scale(result)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's LR scheduler (the DeepSpeed config's ``scheduler`` section, when the engine was
        built from one that has it); under the engine's loss scaling wrapped in
        :class:`OverflowAwareScheduler`, so a step skipped for an overflow leaves it where it is (as
        DeepSpeed leaves its scheduler): the Trainer asks accelerate, which sees no overflow."""
        if self._deepspeed_schedule is not None and self.lr_scheduler is None:
            # The config's scheduler, as the Trainer has DeepSpeed build it once the step count is known.
            ds = scheduled_config(self._deepspeed_schedule, self.args, num_training_steps)
            self.lr_scheduler = scheduler_from_deepspeed(ds, optimizer if optimizer is not None else self.optimizer)
            self._created_lr_scheduler = True  # rebuilt by the next train(), as the Trainer rebuilds its own
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.engine.loss_scale is not None and not isinstance(scheduler, (OverflowAwareScheduler, *_METRIC_STEPPED)):
            scheduler = self.lr_scheduler = OverflowAwareScheduler(scheduler, self.engine)
        return scheduler

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        """The Trainer's clipping at ``TrainingArguments.max_grad_norm``, done by the engine on the
        gradients in its store (``eng.clip_grad_norm_``), where the Trainer's own
        ``clip_grad_norm_`` would find none on the model and clip nothing."""
        return self.engine.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Optional[float]:
        """The ``grad_norm`` the Trainer logs: the engine's, where the Trainer's own
        ``clip_grad_norm_`` would find no gradients (they are in the store) and log 0. (Both are
        Trainer methods since transformers 5; before, the engine clips only at
        ``EngineConfig.max_grad_norm`` and the log shows that 0.)"""
        if grad_norm is not None:
            return float(grad_norm)
        return self.engine.pending_grad_norm()

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Write what the Trainer writes (``save_pretrained``'s files: config, weights, the processing
        class, the training arguments), the weights streamed one tensor at a time by
        ``eng.save_weights`` (gathered across ranks, rank 0 writes), so a model larger than host
        memory saves too; for a PEFT model, its adapter (``adapter_model.safetensors``), as the
        Trainer writes it. Every rank must call it (the Trainer does, at each checkpoint)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if is_peft_model(self.model):
            # PEFT's save_pretrained keeps the adapter's entries of the state dict it is given: the
            # model without its frozen base (gathered one tensor at a time on every rank).
            self._save(output_dir, state_dict=self.engine.state_dict(exclude_frozen_parameters=True))
        else:
            # The Trainer's own files around an empty state dict, whose weights file then goes, as
            # the Trainer itself does when DeepSpeed keeps the weights.
            self._save(output_dir, state_dict={})  # returns at once on the ranks that do not write
            remove_dummy_checkpoint(self.args.should_save, output_dir, [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])
            self.engine.save_weights(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def _leave_state_to_checkpoints(eng: Any) -> None:
    """Have ``eng``'s ``engine.AdamW`` (if it has one) leave its moments and masters out of its
    ``state_dict()``: the caller saves the engine's checkpoint, which holds them, beside it."""
    leave = getattr(getattr(eng, "optimizer", None), "leave_state_to_checkpoints", None)
    if leave is not None:
        leave()


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT model (``peft.PeftModel``: LoRA and the other adapters)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _trainer_argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, position: int) -> Any:
    """``Trainer.__init__``'s argument ``name`` (its ``position``-th), given by keyword or position."""
    return kwargs.get(name, args[position] if len(args) > position else None)


def _launched_distributed(state: Any) -> bool:
    """Whether the Trainer's ``accelerator.prepare(model)`` would put the model in
    ``DistributedDataParallel``: a ``torch.distributed`` process group exists, or accelerate's
    state (``TrainingArguments.distributed_state``, the accelerator's ``state``; None: not made yet)
    is a distributed one, as under ``torchrun`` or ``tiered launch`` with a single process."""
    if dist.is_available() and dist.is_initialized():
        return True
    return state is not None and getattr(state, "distributed_type", DistributedType.NO) != DistributedType.NO


def _check_sharding(deepspeed: Any, fsdp: Any) -> None:
    """ValueError for ``TrainingArguments(deepspeed=...)`` or ``(fsdp=...)``: the Trainer would hand
    the model to DeepSpeed or FSDP, which would shard parameters the engine already holds."""
    if deepspeed:
        raise ValueError(
            f"TrainingArguments(deepspeed={deepspeed!r}) would hand the model to DeepSpeed, but the engine already "
            "shards and offloads it: give EngineTrainer no engine and the config as deepspeed_config= "
            "(EngineTrainer(model=model, args=args, deepspeed_config=...) builds it from that config), or build "
            "the engine's config from it (engine.EngineConfig.from_deepspeed(path, store=...)) and leave deepspeed "
            "unset"
        )
    if fsdp:
        raise ValueError(
            f"TrainingArguments(fsdp={fsdp!r}) would wrap the model in FSDP, but the engine already shards and "
            "offloads it: leave fsdp unset (EngineConfig's tiers set where the parameters live)"
        )


def _check_compile(torch_compile: bool) -> None:
    """ValueError for ``TrainingArguments(torch_compile=True)`` with several processes or under a
    launcher: accelerate would return a compiled wrapper and prepare (put in DDP) the model itself."""
    if torch_compile:
        raise ValueError(
            "TrainingArguments(torch_compile=True) is not supported by EngineTrainer with several processes or "
            "under a launcher (a process group): accelerate would compile a wrapper and put the model itself in "
            "DistributedDataParallel, which cannot read the engine's released parameters. Pass torch_compile=False "
            "(the engine's hooks split dynamo's graph at every module, so compiling measured no speed-up; "
            "docs/training.md), or run one process without a launcher"
        )


def _check_device(engine_device: torch.device, trainer_device: torch.device) -> None:
    """ValueError when the engine computes elsewhere than the Trainer puts the batches (and the model):
    the Trainer's ``model.to(args.device)`` cannot move the engine's released parameters."""
    indices = (engine_device.index, trainer_device.index)
    same = engine_device.type == trainer_device.type and (None in indices or indices[0] == indices[1])
    if not same:
        raise ValueError(
            f"the engine computes on {engine_device} but the Trainer runs on {trainer_device} (TrainingArguments."
            f"device): wrap with EngineConfig(compute_device={str(trainer_device)!r}), so the parameters are "
            "materialized where the Trainer sends the batches, or give EngineTrainer no engine and a DeepSpeed "
            "config, which places it there")


def _check_mixed_precision(fp16: bool) -> None:
    """ValueError for ``TrainingArguments(fp16=True)``: accelerate's ``GradScaler`` unscales and checks
    the model's ``.grad``, which stays empty, and its step then fails."""
    if fp16:
        raise ValueError(
            "TrainingArguments(fp16=True) has accelerate scale the loss with a GradScaler that checks the model's "
            ".grad, which the engine keeps in its store: train fp16 as DeepSpeed does, with the engine's loss "
            "scaling (EngineConfig.from_deepspeed with an \"fp16\": {\"enabled\": true} section, or "
            "EngineConfig(train_dtype=\"float16\", loss_scaling=engine.LossScaling())) and fp16=False here; "
            "or use bf16=True"
        )


def _check_clipping(max_grad_norm: Optional[float], eng: Any) -> None:
    """ValueError when ``TrainingArguments.max_grad_norm`` asks for clipping that would not happen as
    asked: two different norms (the arguments' and ``EngineConfig.max_grad_norm``), or, on a
    transformers without ``Trainer._clip_grad_norm`` (before 5), any norm the engine's config does
    not have (that Trainer clips the model's ``.grad``, which stays empty)."""
    wanted = max_grad_norm or 0.0
    configured = eng.config.max_grad_norm
    if not wanted > 0 or configured == wanted:
        return
    if not hasattr(Trainer, "_clip_grad_norm"):
        raise ValueError(
            f"TrainingArguments(max_grad_norm={wanted}) clips the model's .grad, which the engine keeps in its store "
            f"(so this transformers' Trainer would clip nothing), and the engine clips at {configured}: wrap with "
            f"EngineConfig(max_grad_norm={wanted}) to clip, or pass max_grad_norm=0.0 for no clipping"
        )
    if configured is not None:
        raise ValueError(
            f"TrainingArguments(max_grad_norm={wanted}) and the engine's EngineConfig(max_grad_norm={configured}) ask "
            f"for two different clippings: keep one (max_grad_norm=0.0 in the arguments leaves it to the engine's "
            f"config; EngineConfig(max_grad_norm=None) to the arguments)"
        )


__all__ = ["ENGINE_SUBDIR", "EngineCheckpointCallback", "EngineTrainer", "EngineTrainingArguments",
           "engine_checkpoint", "is_peft_model"]
