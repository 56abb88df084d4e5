"""The Hugging Face Trainer's DeepSpeed integration, on the engine: what ``Trainer`` does with
``TrainingArguments(deepspeed=ds_config)`` (``--deepspeed ds_config.json`` in its example scripts),
done for :class:`engine.integrations.hf.EngineTrainer` when it is given no engine (the config as
``deepspeed_config=``, or as ``deepspeed=`` of ``engine.integrations.hf.EngineTrainingArguments``, which
keeps it from transformers' own integration).

The Trainer fills the config's ``"auto"`` values from its arguments and checks the others against
them (transformers' ``HfTrainerDeepSpeedConfig``); the same is done here, then the model is wrapped
under ``EngineConfig.from_deepspeed`` of the filled config. As the Trainer hands them to DeepSpeed:
the config's ``optimizer`` section (one group of every trainable parameter) or else the Trainer's
own AdamW (its weight-decay groups), and the ``scheduler`` section or else the Trainer's schedule;
``fp16``/``bf16`` train in that dtype with fp32 master weights (the engine's loss scaling for
fp16), not under the Trainer's autocast; clipping at the config's ``gradient_clipping``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable, Collection, Mapping, Optional

import torch
from torch import nn

from engine.config import EngineConfig
from engine.config.deepspeed import DeepSpeedConfig, fill_auto, load_deepspeed_config
from engine.integrations.deepspeed.optimizer import optimizer_from_deepspeed
from engine.integrations.deepspeed.store import DefaultStore, default_store, removed_on_failure
from engine.optim.adamw import AdamW
from tiered import StoreConfig


@dataclasses.dataclass(frozen=True)
class TrainerPlan:
    """What the Trainer's DeepSpeed config becomes: the engine's config and optimizer, the filled
    DeepSpeed config (its ``scheduler`` section is built once the step count is known) and the
    arguments the Trainer runs with (``deepspeed`` unset; ``fp16``/``bf16`` and clipping handed
    to the engine)."""

    config: EngineConfig
    optimizer: AdamW
    deepspeed_config: dict[str, Any]
    args: Any
    #: Where the config put the store when no ``store=`` was given (its ``scratch`` directory, if
    #: any, is the engine's to remove when it closes); None with ``store=``.
    default_store: Optional[DefaultStore] = None


def filled_config(ds: Mapping[str, Any], args: Any) -> dict[str, Any]:
    """``ds`` with the ``"auto"`` values the Trainer fills from ``args`` filled, as transformers'
    ``HfTrainerDeepSpeedConfig.trainer_config_process`` fills them. A value that is set and differs
    from the arguments' is a ValueError listing each, as the Trainer raises it."""
    filled = copy.deepcopy(dict(ds))
    mismatches: list[str] = []

    def fill(path: str, value: Any, name: Optional[str] = None) -> None:
        found = fill_auto(filled, path, value)
        if name is not None and found is not None and found != "auto" and found != value:
            mismatches.append(f"- ds {path}={found} vs hf {name}={value}")

    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    fill("train_batch_size", args.world_size * micro * accumulation, "train_batch_size (calculated)")
    fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    fill("scheduler.params.warmup_min_lr", 0)
    fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    if mismatches:
        raise ValueError("Please correct the following DeepSpeed config values that mismatch TrainingArguments "
                         "values:\n" + "\n".join(mismatches)
                         + "\nThe easiest method is to set these DeepSpeed config values to 'auto'.")
    return filled


def scheduled_config(ds: Mapping[str, Any], args: Any, num_training_steps: int) -> dict[str, Any]:
    """``ds`` with the scheduler's ``"auto"`` step counts filled once the Trainer knows how many steps
    it takes (transformers' ``trainer_config_finalize``)."""
    filled = copy.deepcopy(dict(ds))
    fill_auto(filled, "scheduler.params.total_num_steps", num_training_steps)
    fill_auto(filled, "scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)))
    return filled


def plan_for_trainer(model: nn.Module, args: Any, ds_source: DeepSpeedConfig, *,
                     decay_parameter_names: Collection[str], trainer_optimizer: Callable[[Any, nn.Module], Any],
                     store: Optional[StoreConfig] = None) -> TrainerPlan:
    """The engine the Trainer's DeepSpeed config asks for. ``decay_parameter_names``: the Trainer's
    weight-decay parameters; ``trainer_optimizer``: its ``get_optimizer_cls_and_kwargs``; ``store``:
    where the store goes (default: under the config's ``nvme_path``, as ``engine.initialize``)."""
    ds = filled_config(load_deepspeed_config(ds_source), args)
    if ds.get("steps_per_print") == math.inf:
        del ds["steps_per_print"]  # how the Trainer's DeepSpeed setup silences DeepSpeed's own log lines
    default = default_store(ds) if store is None else None
    with removed_on_failure(default):
        # The scheduler's step counts are known in train(); a stand-in count lets the rest be checked now.
        checked = scheduled_config(ds, args, max(args.max_steps, 1))
        config = EngineConfig.from_deepspeed(checked, store=default.config if default is not None else store)
        if default is not None:
            config = default.apply(config, model, args.world_size)
        # The Trainer runs the accumulation window and calls the clipping (eng.clip_grad_norm_).
        config = config.replace(gradient_accumulation_steps=1)
        if config.compute_device is None and args.device.type != "cpu":
            config = config.replace(compute_device=str(args.device))  # where the Trainer puts its batches
        trainable = [p for p in model.parameters() if p.requires_grad]
        if "optimizer" in ds:
            optimizer = optimizer_from_deepspeed(ds, trainable)
        else:
            optimizer = _trainer_adamw(model, args, decay_parameter_names, trainer_optimizer)
        run_args = dataclasses.replace(args, deepspeed=None, fp16=False, bf16=False,
                                       max_grad_norm=config.max_grad_norm or 0.0)
    return TrainerPlan(config=config, optimizer=optimizer, deepspeed_config=ds, args=run_args,
                       default_store=default)


def _trainer_adamw(model: nn.Module, args: Any, decay: Collection[str],
                   trainer_optimizer: Callable[[Any, nn.Module], Any]) -> AdamW:
    """The Trainer's ``create_optimizer`` for a config without an ``optimizer`` section, as
    ``engine.AdamW``: its two groups (weight decay on all but biases and norms), its lr, betas, eps,
    and its kernel (``fused=True`` for the default ``adamw_torch_fused``: torch's fused and for-loop
    AdamW round differently in the last bit on some CPUs)."""
    optimizer_cls, kwargs = trainer_optimizer(args, model)
    if optimizer_cls is not torch.optim.AdamW:
        raise ValueError(
            f"TrainingArguments(optim={getattr(args.optim, 'value', args.optim)!r}) asks the Trainer for "
            f"{optimizer_cls.__name__}, but the engine steps AdamW on the shards in its store: pass "
            "optim='adamw_torch', or give the DeepSpeed config an \"optimizer\" section (AdamW or Adam)")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    return AdamW([g for g in groups if g["params"]], lr=kwargs["lr"], betas=kwargs.get("betas", (0.9, 0.999)),
                 eps=kwargs.get("eps", 1e-8), weight_decay=args.weight_decay, foreach=kwargs.get("foreach"),
                 fused=kwargs.get("fused"))


def training_arguments_source(args: Any, explicit: Optional[DeepSpeedConfig]) -> Optional[DeepSpeedConfig]:
    """The DeepSpeed config EngineTrainer builds from: ``deepspeed_config=`` (``explicit``) or the
    ``engine_deepspeed_config`` of ``engine.integrations.hf.EngineTrainingArguments`` (what its
    ``deepspeed=`` was given). ValueError when both are given, and for plain
    ``TrainingArguments(deepspeed=...)``, which hands the run to DeepSpeed before EngineTrainer sees it."""
    plain = getattr(args, "deepspeed", None)
    if plain:
        raise ValueError(
            f"TrainingArguments(deepspeed={plain!r}) is transformers' DeepSpeed integration: it needs the deepspeed "
            "package to make such arguments and, with a ZeRO-3 config, builds models (from_pretrained, from_config) "
            "under deepspeed.zero.Init and has accelerate start DeepSpeed's process group, before EngineTrainer "
            "sees them. Give the config to the engine instead: EngineTrainer(model=model, args=args, "
            "deepspeed_config=...), or make the arguments as engine.integrations.hf.EngineTrainingArguments (the same "
            "fields; its deepspeed=, `--deepspeed ds_config.json` through HfArgumentParser, goes to the engine)")
    given = getattr(args, "engine_deepspeed_config", None)
    if explicit is not None and given is not None:
        raise ValueError("EngineTrainer: a DeepSpeed config both as deepspeed_config= and in "
                         "EngineTrainingArguments(deepspeed=...); give one")
    return explicit if explicit is not None else given


__all__ = ["TrainerPlan", "filled_config", "plan_for_trainer", "scheduled_config", "training_arguments_source"]
