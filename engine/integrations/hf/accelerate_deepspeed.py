"""accelerate's DeepSpeed settings as the DeepSpeed config accelerate would hand DeepSpeed:
:func:`deepspeed_config_from_accelerate`.

An accelerate script trained with ZeRO-3 offload names DeepSpeed nowhere: ``accelerate config``
writes the DeepSpeed answers (ZeRO stage, offload devices and NVMe paths, accumulation, clipping;
or a ``deepspeed_config_file``) into a YAML file, ``accelerate launch`` reads it, and
``accelerator.prepare(model, ...)`` builds a DeepSpeed config from them with accelerate's
``DeepSpeedPlugin`` and calls ``deepspeed.initialize``. Here the same file gives that same config,
built by accelerate's own ``DeepSpeedPlugin`` with the ``"auto"`` values ``prepare`` fills from the
``Accelerator`` filled, for ``engine.initialize(model=..., config=ds_config)``::

    accelerator = Accelerator()                          # launched by `tiered launch` or torchrun
    ds_config = deepspeed_config_from_accelerate(accelerator, "zero3_nvme.yaml")
    eng, optimizer, _, _ = engine.initialize(model=model, optimizer=engine.AdamW(lr=1e-4), config=ds_config)
    optimizer, loader = accelerator.prepare(optimizer, loader)   # not the model (docs/migrating.md)

Needs ``accelerate``; not ``deepspeed``.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from typing import Any, Optional, Union

from accelerate import Accelerator
from accelerate.commands.config.config_args import default_config_file, load_config_from_file
from accelerate.utils import DeepSpeedPlugin, DistributedType
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # accelerate.utils has them only beside deepspeed

from engine.config.deepspeed import fill_auto

#: The ``deepspeed_config`` answers ``DeepSpeedPlugin`` takes as its own fields.
_PLUGIN_FIELDS = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                  "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path",
                  "zero3_init_flag", "zero3_save_16bit_model")
#: Answers about launching (``tiered launch`` takes them as options) or DeepSpeed's leaf modules
#: (an MoE block gathered whole; the engine pages each module's own parameters): no effect here.
_IGNORED = ("deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_inclusion_filter",
            "deepspeed_exclusion_filter", "deepspeed_moe_layer_cls_names")
#: What accelerate's ``prepare`` fills ``"auto"`` clipping with.
_CLIPPING = 1.0
#: Why an Accelerator under a launcher can see one process, and the fix.
ALONE_WITHOUT_GPU = ("without a GPU, accelerate joins the launcher's processes only when told to run on the CPU: "
                     "make it Accelerator(cpu=True), or set ACCELERATE_USE_CPU=1 (what `accelerate launch --cpu` "
                     "does); otherwise each process trains alone, on every batch")


def deepspeed_config_from_accelerate(
    accelerator: Accelerator,
    config: Union[str, "os.PathLike[str]", DeepSpeedPlugin, None] = None,
    *,
    optimizer: Optional[DummyOptim] = None,
    scheduler: Optional[DummyScheduler] = None,
) -> dict[str, Any]:
    """The DeepSpeed config ``accelerator.prepare`` would build for ``config``: an ``accelerate
    config`` file that trains with DeepSpeed (YAML or JSON; None: accelerate's default file, the
    one ``accelerate launch`` reads), or a ``DeepSpeedPlugin``.

    As ``prepare`` does: the gradient accumulation is the config's when it sets one, else the
    accelerator's, and it is the accelerator's to do (its ``accumulate`` and ``backward``, as for
    a model it does not prepare; the config returned says 1); ``"auto"`` clipping is 1.0; the
    precision is the accelerator's when it has one, else the file's ``mixed_precision``
    (``fp16``/``bf16`` sections, fp16 with ``auto_cast``). Batch sizes stay ``"auto"`` (the data
    loader accelerate prepares sets them). ``optimizer``/``scheduler``: the script's
    ``DummyOptim``/``DummyScheduler`` for a config file with ``optimizer``/``scheduler`` sections,
    whose ``"auto"`` values they fill as ``prepare`` fills them (lr and weight decay; the warmup
    from 0 to that lr, its steps, the total steps per process); pass ``optimizer.params`` to
    ``engine.initialize(model_parameters=...)``. A file for another distributed type, or with
    answers accelerate does not write, is a ``ValueError``; so is ``fp8``.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"deepspeed_config_from_accelerate takes an accelerate.Accelerator first, "
                        f"got {type(accelerator).__name__}")
    check_engine_accelerator(accelerator)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise ValueError(f"the launcher started {launched} processes but the Accelerator runs as one of "
                         f"{accelerator.num_processes}: {ALONE_WITHOUT_GPU}")
    if isinstance(config, DeepSpeedPlugin):
        plugin, precision = copy.deepcopy(config), None
    elif config is None or isinstance(config, (str, os.PathLike)):
        plugin, precision = _plugin_of_file(config)
    else:
        raise TypeError(f"config must be an accelerate config file or a DeepSpeedPlugin, got {type(config).__name__}")
    if accelerator.mixed_precision != "no" or precision is None:
        precision = accelerator.mixed_precision
    if precision == "fp8":
        raise ValueError("mixed_precision 'fp8' is not supported by the engine: use 'bf16' (DeepSpeed trains fp8 "
                         "runs in bf16 with MS-AMP or Transformer Engine, neither of which runs here)")
    plugin.set_mixed_precision(precision)
    ds = copy.deepcopy(plugin.deepspeed_config)
    for section in ("offload_param", "offload_optimizer"):
        offload = ds.get("zero_optimization", {}).get(section)
        if isinstance(offload, dict) and offload.get("nvme_path") == "none":
            offload["nvme_path"] = None  # accelerate's word for a path not given, DeepSpeed's null
    _settle_accumulation(ds, accelerator)
    _fill_from_dummies(ds, accelerator, optimizer, scheduler)
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = _CLIPPING
    if ds.get("steps_per_print") == float("inf"):
        del ds["steps_per_print"]  # accelerate's way to keep DeepSpeed's progress line off; off here too
    return ds


def check_engine_accelerator(accelerator: Accelerator) -> None:
    """``ValueError`` when ``accelerator`` runs DeepSpeed itself: its ``prepare`` and ``backward``
    would hand the model to DeepSpeed's engine, which does not exist here."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError("this Accelerator runs DeepSpeed itself (launched with an accelerate config that trains with "
                         "DeepSpeed, or given a deepspeed_plugin): its prepare and backward would look for DeepSpeed's "
                         "engine. Launch with `tiered launch` or torchrun (or an accelerate config without DeepSpeed) "
                         "and read that config with deepspeed_config_from_accelerate(accelerator, file or plugin)")


def _plugin_of_file(path: Union[str, "os.PathLike[str]", None]) -> tuple[DeepSpeedPlugin, Optional[str]]:
    """The ``DeepSpeedPlugin`` of an accelerate config file's DeepSpeed answers, and its precision."""
    if path is None and not os.path.isfile(default_config_file):
        raise FileNotFoundError(f"accelerate's default config file {default_config_file} does not exist: run "
                                "`accelerate config`, or name the config file")
    where = f"accelerate's default config file {default_config_file}" if path is None else os.fspath(path)
    cluster = load_config_from_file(default_config_file if path is None else os.fspath(path))
    if cluster.distributed_type != DistributedType.DEEPSPEED:
        raise ValueError(f"{where} does not train with DeepSpeed (distributed_type: "
                         f"{getattr(cluster.distributed_type, 'value', cluster.distributed_type)}): it has no "
                         f"DeepSpeed config; give engine.wrap an engine.EngineConfig instead")
    answers = dict(cluster.deepspeed_config or {})
    unknown = sorted(set(answers) - set(_PLUGIN_FIELDS) - set(_IGNORED) - {"deepspeed_config_file"})
    if unknown:
        raise ValueError(f"{where}: deepspeed_config has answers accelerate's DeepSpeedPlugin does not take: "
                         f"{', '.join(unknown)}")
    plugin = DeepSpeedPlugin(hf_ds_config=answers.get("deepspeed_config_file"),
                             **{k: answers[k] for k in _PLUGIN_FIELDS if k in answers})
    precision = getattr(cluster.mixed_precision, "value", cluster.mixed_precision)
    return plugin, precision


def _fill_from_dummies(ds: dict[str, Any], accelerator: Accelerator, optimizer: Optional[DummyOptim],
                       scheduler: Optional[DummyScheduler]) -> None:
    """The ``"auto"`` values of the optimizer and scheduler sections, from accelerate's stand-ins for
    them, as ``prepare`` fills them; a stand-in without its section is refused, as by ``prepare``."""
    for given, section, kind in ((optimizer, "optimizer", DummyOptim), (scheduler, "scheduler", DummyScheduler)):
        if given is None:
            continue
        if not isinstance(given, kind):
            raise TypeError(f"{section}= takes accelerate's {kind.__name__}, got {type(given).__name__}")
        if section not in ds:
            raise ValueError(f"a {kind.__name__} stands for the config's {section} section, but the config has none")
    fills: dict[str, Any] = {}
    if optimizer is not None:
        fills.update({"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay})
    if scheduler is not None and scheduler.lr_scheduler_callable is None:
        stood_for = scheduler.optimizer  # a DummyOptim (its lr) or a torch optimizer (its defaults' lr)
        defaults = getattr(stood_for, "defaults", None)
        peak = defaults["lr"] if defaults is not None else getattr(stood_for, "lr", None)
        fills.update({"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": peak,
                      "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps)})
        if scheduler.total_num_steps is not None:
            total = scheduler.total_num_steps
            fills["scheduler.params.total_num_steps"] = (total if accelerator.split_batches
                                                         else math.ceil(total / accelerator.num_processes))
    for path, value in fills.items():
        fill_auto(ds, path, value)


def _settle_accumulation(ds: dict[str, Any], accelerator: Accelerator) -> None:
    """The accumulation as ``prepare`` settles it (the config's, else the accelerator's), given to
    the accelerator: its ``accumulate`` and ``backward`` accumulate for a model it does not
    prepare. The config says 1, so that the engine does not divide the loss a second time."""
    steps = ds.get("gradient_accumulation_steps", "auto")
    if steps != "auto" and steps != accelerator.gradient_accumulation_steps:
        # 1 is accelerate's default; under `accelerate launch` the file's value would have been the accelerator's
        if accelerator.gradient_accumulation_steps != 1:
            warnings.warn(f"Gradient accumulation steps mismatch: the Accelerator has "
                          f"{accelerator.gradient_accumulation_steps}, the DeepSpeed config {steps}. Using "
                          f"DeepSpeed's value (as accelerate's prepare does)", stacklevel=3)
        accelerator.gradient_accumulation_steps = steps
    ds["gradient_accumulation_steps"] = 1


__all__ = ["ALONE_WITHOUT_GPU", "check_engine_accelerator", "deepspeed_config_from_accelerate"]
