"""Map a DeepSpeed JSON config onto EngineConfig and the store's StoreConfig.

Every key is accounted for: it is *mapped* (its value sets an EngineConfig or StoreConfig field),
*accepted* (validated, then deliberately without effect, for a documented reason: DeepSpeed's
own logging, buffer pools the store does not need, ...), *default-only* (a DeepSpeed feature the
engine does not have: accepted only at the value that turns it off), or an error. Unknown keys are
errors too (DeepSpeed silently ignores them). All problems are collected and raised as one
ValueError naming each key by its path, e.g. ``zero_optimization.offload_param.foo``.

Keys the JSON leaves out, or sets to "auto" (the Hugging Face integration's placeholder), keep the
EngineConfig defaults and the given StoreConfig's values, not DeepSpeed's defaults. docs/training.md
has the full table.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Callable, Collection, Mapping, Optional, Union

from engine.config.deepspeed_optimizer import optimizer_problems, scheduler_problems
from engine.config.deepspeed_schema import (
    ACCEPT,
    DEFAULT_ONLY,
    MAP,
    InvalidValue,
    Key,
    Schema,
    check_bool,
    check_choice,
    check_int,
    check_number,
    raise_problems,
    walk_schema,
)
from engine.config.loss_scaling import LossScaling
from tiered import StoreConfig

DeepSpeedConfig = Union[Mapping[str, Any], str, "os.PathLike[str]"]

ALIGNMENT = 4096
#: DeepSpeed's own aio defaults, for an ``aio`` section that sets one of the two but not the other.
DEEPSPEED_AIO_QUEUE_DEPTH = 8
DEEPSPEED_AIO_THREADS = 1
#: DeepSpeed clips gradients at this global norm when a config leaves ``gradient_clipping`` out
#: (since deepspeedai/DeepSpeed#8068, mid-2026; 0, no clipping, before it): 1.0 in 0.19.8.
DEEPSPEED_GRADIENT_CLIPPING = 1.0
#: The ZeRO stages a config may name. The engine is ZeRO-3: a stage-1 or stage-2 run (optimizer state,
#: and gradients, sharded) takes the same steps here with its parameters sharded as well, so their
#: configs (ZeRO-Offload's among them) are taken as they are written.
ZERO_STAGES_RUN_AS_3 = (1, 2, 3)
#: A mapped aio section never starts more store I/O threads than this.
MAX_MAPPED_IO_THREADS = 256
FP32_BYTES = 4


# ---------------------------------------------------------------------------------------- checkers


def _path(v: Any) -> str:
    if not isinstance(v, (str, os.PathLike)) or not os.fspath(v):
        raise InvalidValue("must be a directory path")
    return os.fspath(v)


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise InvalidValue("must be a string")
    return v


def _any(v: Any) -> Any:
    return v


def _fp32_or_null(v: Any) -> Optional[str]:
    if v is None or (isinstance(v, str) and v.lower() in ("fp32", "float32")):
        return v
    raise InvalidValue('only "fp32" or null: the engine reduces and accumulates gradients in fp32')


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else check(v)


def _mapping_or_none(v: Any) -> Any:
    if v is not None and not isinstance(v, Mapping):
        raise InvalidValue("must be an object or null")
    return v


def _block_size(v: Any) -> int:
    n = check_int(ALIGNMENT)(v)
    if n % ALIGNMENT:
        raise InvalidValue(f"must be a multiple of {ALIGNMENT} (the store's O_DIRECT alignment)")
    return n


# ---------------------------------------------------------------------------------------- schema

_ASYNC = "the engine always overlaps it (prefetch along the recorded order, pipelined optimizer step)"
_BUFFERS = "the store streams any tensor through its own staging slots: no fixed DeepSpeed buffer pool to size"
_PINNED = "the store pins its host pool and staging buffers whenever CUDA is present"
_COMM = "the engine issues one collective per parameter shard; DeepSpeed's bucketing knob has no counterpart"
_ZERO12 = "applies to ZeRO stages 1 and 2 only"
_LOGGING = "DeepSpeed's own logging/monitoring; the engine reports through eng.stats()"
_TIMERS = ("engine.initialize's engine prints each forward, backward and step call's wall time in ms, and each "
           "optimizer step's sums with the time spent waiting on the store (io_wait), on rank 0")
_PROGRESS_LINE = ("engine.initialize's engine prints DeepSpeed's progress line (step, skipped steps, lr, momentum) "
                  "every N steps on rank 0")
_ACCUMULATION = ("gradient_accumulation_steps (given, or train_batch_size / (train_micro_batch_size_per_gpu x "
                 "world size), as DeepSpeed derives it)")
_MODEL_SIDE = "changes how DeepSpeed patches or traces modules; the engine uses plain module hooks"
_CONSOLIDATED = "eng.state_dict() and eng.save_weights(dir) always consolidate"
_RESIDENT = ("the engine pages every parameter through the store; hot ones stay resident in its "
             "device/host tiers by the recorded access order (Belady eviction)")

OFFLOAD_PARAM: Schema = {
    "device": Key(check_choice("none", "cpu", "nvme"), MAP, "param_tier: none -> device, cpu -> host, nvme -> nvme "
                  "(engine.initialize's own store gives the device or host tier room for what goes there)"),
    "nvme_path": Key(_optional(_path), MAP, "StoreConfig.nvme_paths (with offload_optimizer.nvme_path)"),
    "pin_memory": Key(check_bool, ACCEPT, _PINNED),
    "buffer_count": Key(check_int(), ACCEPT, _BUFFERS),
    "buffer_size": Key(check_int(), ACCEPT, _BUFFERS),
    "max_in_cpu": Key(check_int(), ACCEPT, "host memory is StoreConfig.host_bytes, one budget for all data"),
}

OFFLOAD_OPTIMIZER: Schema = {
    "device": Key(check_choice("none", "cpu", "nvme"), MAP,
                  "optimizer_tier: cpu -> host, nvme -> nvme, none -> host (the optimizer always runs on the "
                  "CPU; the host tier is the closest place for its state, and engine.initialize's own store "
                  "gives that tier room for it)"),
    "nvme_path": Key(_optional(_path), MAP, "StoreConfig.nvme_paths (with offload_param.nvme_path)"),
    "pin_memory": Key(check_bool, ACCEPT, _PINNED),
    "buffer_count": Key(check_int(), ACCEPT, "the step streams groups of optimizer_group_bytes (sub_group_size)"),
    "fast_init": Key(check_bool, ACCEPT, "state is created lazily at each shard's first step; nothing to speed up"),
    "pipeline_read": Key(check_bool, ACCEPT, "the step always reads group i+1 while updating group i"),
    "pipeline_write": Key(check_bool, ACCEPT, "the step always writes group i-1 while updating group i"),
    "ratio": Key(check_number(0.0, 1.0), DEFAULT_ONLY, "partial optimizer offload is not supported", 1.0),
    "super_offload": Key(check_bool, DEFAULT_ONLY, "SuperOffload (Grace Hopper) is not supported", False),
    "cpuadam_cores_perc": Key(check_number(0.0, 1.0), ACCEPT, "used only with super_offload, which is off"),
}

#: ``stage3_`` keys DeepSpeed's ZeRO config also takes by their field names, without the prefix.
_STAGE3_UNPREFIXED = ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
                      "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                      "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")

ZERO: Schema = {
    "stage": Key(check_int(), MAP, "1, 2 or 3, each run as ZeRO-3: the engine shards parameters, gradients and "
                 "optimizer state (at 1 and 2 too: the same steps, less memory per rank); 0 (no sharding) is refused"),
    "offload_param": OFFLOAD_PARAM,
    "offload_optimizer": OFFLOAD_OPTIMIZER,
    "stage3_prefetch_bucket_size": Key(check_int(), MAP, "prefetch_bytes = elements x training-dtype bytes"),
    "sub_group_size": Key(check_int(1), MAP, "optimizer_group_bytes = elements x 4 (fp32)"),
    "cpu_offload": Key(check_bool, MAP, "deprecated DeepSpeed name: true = offload_optimizer.device cpu"),
    "cpu_offload_param": Key(check_bool, MAP, "deprecated DeepSpeed name: true = offload_param.device cpu"),
    "cpu_offload_use_pin_memory": Key(check_bool, ACCEPT, _PINNED),
    "stage3_max_live_parameters": Key(check_int(), ACCEPT, "the engine releases each module's parameters right after "
                                      "use; materialized memory is bounded by the largest module plus prefetch_bytes"),
    "stage3_max_reuse_distance": Key(check_int(), ACCEPT, _RESIDENT),
    "stage3_param_persistence_threshold": Key(check_int(), ACCEPT, _RESIDENT),
    "stage3_model_persistence_threshold": Key(check_int(), ACCEPT, _RESIDENT),
    "stage3_gather_16bit_weights_on_model_save": Key(check_bool, ACCEPT, _CONSOLIDATED),
    "stage3_gather_fp16_weights_on_model_save": Key(check_bool, ACCEPT, _CONSOLIDATED),
    "stage3_module_granularity_threshold": Key(check_int(None), ACCEPT, _MODEL_SIDE),
    "stage3_use_all_reduce_for_fetch_params": Key(check_bool, ACCEPT, _COMM),
    "stage3_allgather_sequential": Key(check_bool, ACCEPT, _COMM),
    "overlap_comm": Key(check_bool, ACCEPT, _ASYNC),
    "contiguous_gradients": Key(check_bool, ACCEPT, "each gradient shard goes to the store as soon as it is final"),
    "reduce_scatter": Key(check_bool, ACCEPT, "gradients are always reduce-scattered when world size > 1"),
    "reduce_bucket_size": Key(check_int(), ACCEPT, _COMM),
    "allgather_partitions": Key(check_bool, ACCEPT, _COMM),
    "allgather_bucket_size": Key(check_int(), ACCEPT, _COMM),
    "use_multi_rank_bucket_allreduce": Key(check_bool, ACCEPT, _COMM),
    "ignore_unused_parameters": Key(check_bool, ACCEPT, "a parameter without a gradient is skipped, as torch does"),
    "round_robin_gradients": Key(check_bool, ACCEPT, _ZERO12),
    "compute_grad_norm": Key(check_bool, ACCEPT, _ZERO12),
    "parameter_alignment": Key(check_bool, ACCEPT, _ZERO12),
    "memory_efficient_linear": Key(check_bool, ACCEPT, _MODEL_SIDE),
    "override_module_apply": Key(check_bool, ACCEPT, _MODEL_SIDE),
    "log_trace_cache_warnings": Key(check_bool, ACCEPT, _LOGGING),
    "enable_sanity_checks": Key(check_bool, ACCEPT,
                                "DeepSpeed's internal checks; the engine's invariants are always on"),
    "load_from_fp32_weights": Key(check_bool, DEFAULT_ONLY, "checkpoints always restore the fp32 master weights", True),
    "elastic_checkpoint": Key(check_bool, DEFAULT_ONLY, "elastic checkpoints are not supported", False),
    "legacy_stage1": Key(check_bool, DEFAULT_ONLY, "DeepSpeed's legacy stage-1 implementation is not supported", False),
    "pipeline_loading_checkpoint": Key(check_bool, DEFAULT_ONLY, "pipeline-parallel loading is not supported", False),
    "zero_hpz_partition_size": Key(check_int(), DEFAULT_ONLY, "ZeRO++ hierarchical partitioning is not supported", 1),
    "zero_quantized_weights": Key(check_bool, DEFAULT_ONLY, "ZeRO++ quantized weights are not supported", False),
    "zero_quantized_nontrainable_weights": Key(check_bool, DEFAULT_ONLY, "quantized weights are not supported", False),
    "zero_quantized_gradients": Key(check_bool, DEFAULT_ONLY, "ZeRO++ quantized gradients are not supported", False),
    "zeropp_loco_param": Key(_mapping_or_none, DEFAULT_ONLY, "LoCo-Zero++ is not supported", None),
    "mics_shard_size": Key(check_int(None), DEFAULT_ONLY, "MiCS sharding is not supported", -1),
    "mics_hierarchical_params_gather": Key(check_bool, DEFAULT_ONLY, "MiCS sharding is not supported", False),
    "save_muon_momentum_buffer_in_memory": Key(check_bool, DEFAULT_ONLY, "the Muon optimizer is not supported", False),
    "zenflow": Key(_mapping_or_none, DEFAULT_ONLY, "ZenFlow is not supported", None),
    "leaf_module": Key(_mapping_or_none, DEFAULT_ONLY, "ZeRO-3 leaf modules are not supported: every module "
                       "with parameters is hooked on its own", None),
}

AIO: Schema = {
    "block_size": Key(_block_size, MAP, "StoreConfig.block_size"),
    "queue_depth": Key(check_int(1), MAP, "StoreConfig.queue_depth and io_threads: queue_depth x intra_op_parallelism "
                       "(the requests DeepSpeed keeps in flight, one libaio queue per thread)"),
    "intra_op_parallelism": Key(check_int(1), MAP, "StoreConfig.queue_depth and io_threads, with aio.queue_depth"),
    "thread_count": Key(check_int(1), MAP, "as intra_op_parallelism (its older DeepSpeed name)"),
    "single_submit": Key(check_bool, ACCEPT,
                         "libaio submission detail; each store I/O thread issues one syscall per block"),
    "overlap_events": Key(check_bool, ACCEPT, "libaio completion detail; store blocks complete independently"),
    "use_gds": Key(check_bool, DEFAULT_ONLY, "GPUDirect Storage is not supported yet (docs/architecture.md)", False),
}

FP16: Schema = {
    "enabled": Key(check_bool, MAP, "train_dtype: true -> float16, with loss_scaling (fp32 master weights kept)"),
    "loss_scale": Key(check_number(), MAP, "loss_scaling: 0 -> dynamic, > 0 -> LossScaling.static(value)"),
    "initial_scale_power": Key(check_int(0), MAP, "LossScaling.initial_scale = 2 ** value"),
    "loss_scale_window": Key(check_int(1), MAP, "LossScaling.growth_interval"),
    "hysteresis": Key(check_int(1), MAP, "LossScaling.hysteresis"),
    "consecutive_hysteresis": Key(check_bool, MAP, "LossScaling.consecutive_hysteresis"),
    "min_loss_scale": Key(check_number(), MAP, "LossScaling.min_scale"),
    "auto_cast": Key(check_bool, MAP, "cast_forward_inputs: floating forward inputs cast to float16"),
    "fp16_master_weights_and_grads": Key(check_bool, DEFAULT_ONLY, "master weights and gradients are fp32", False),
}

BF16: Schema = {
    "enabled": Key(check_bool, MAP, "train_dtype: true -> bfloat16 (fp32 master weights kept, as in DeepSpeed)"),
    "immediate_grad_update": Key(check_bool, ACCEPT, "gradient shards always go to the store when final"),
    "check_grad_overflow": Key(check_bool, ACCEPT, "no loss scaling in bf16, so no overflow skipping"),
    "check_overflow": Key(check_bool, ACCEPT, "no loss scaling in bf16, so no overflow skipping"),
    "bf16_master_weights_and_grads": Key(check_bool, DEFAULT_ONLY, "master weights and gradients are fp32", False),
    "bf16_optimizer_states": Key(check_bool, DEFAULT_ONLY, "Adam moments are fp32", False),
}

_CHECKPOINT_API = ("applies to deepspeed.checkpointing.checkpoint; use torch.utils.checkpoint, which the engine "
                   "supports (docs/engine.md)")

ACTIVATION_CHECKPOINTING: Schema = {
    "cpu_checkpointing": Key(check_bool, MAP, "activation_tier: true -> \"host\" (every saved tensor of at least "
                             "activation_min_bytes goes to the store during forward, not only checkpoint inputs)"),
    "partition_activations": Key(check_bool, ACCEPT, "splits checkpoints across model-parallel ranks; the engine has "
                                 "no model parallelism, so each rank's activations are its own"),
    "contiguous_memory_optimization": Key(check_bool, ACCEPT, _CHECKPOINT_API),
    "number_checkpoints": Key(_optional(check_int(1)), ACCEPT, _CHECKPOINT_API),
    "synchronize_checkpoint_boundary": Key(check_bool, ACCEPT, _CHECKPOINT_API),
    "profile": Key(check_bool, ACCEPT, _LOGGING),
}

_MONITOR = ("engine.initialize's engine writes DeepSpeed's events (lr, fp16 loss_scale, wall_clock_breakdown's "
            "timings) and the script's (model_engine.monitor.write_events) on rank 0")
_MONITOR_DIR = "the files go to output_path/job_name (DeepSpeed's defaults: \"\" and \"DeepSpeedJobName\")"

TENSORBOARD: Schema = {
    "enabled": Key(check_bool, ACCEPT, _MONITOR + ", as TensorBoard scalars (needs the tensorboard package)"),
    "output_path": Key(_text, ACCEPT, _MONITOR_DIR),
    "job_name": Key(_text, ACCEPT, _MONITOR_DIR),
}

CSV_MONITOR: Schema = {
    "enabled": Key(check_bool, ACCEPT, _MONITOR + ", one CSV file per event name"),
    "output_path": Key(_text, ACCEPT, _MONITOR_DIR),
    "job_name": Key(_text, ACCEPT, _MONITOR_DIR),
}

WANDB: Schema = {
    "enabled": Key(check_bool, ACCEPT,
                   _MONITOR + ", to the script's W&B run, or one it starts (needs the wandb package)"),
    "group": Key(_optional(_text), ACCEPT, "wandb.init's group, for a run the engine starts"),
    "team": Key(_optional(_text), ACCEPT, "wandb.init's entity, for a run the engine starts"),
    "project": Key(_text, ACCEPT, "wandb.init's project, for a run the engine starts (DeepSpeed's default: deepspeed)"),
}

_PROFILE = "engine.initialize's engine prints DeepSpeed's flops profile of that optimizer step on rank 0"

FLOPS_PROFILER: Schema = {
    "enabled": Key(check_bool, ACCEPT, _PROFILE + " (forward flops counted by torch.utils.flop_counter)"),
    "profile_step": Key(check_int(0), ACCEPT, "the optimizer step profiled: the one taken at this global_steps "
                        "(DeepSpeed's default: 1, the second)"),
    "module_depth": Key(check_int(-1), ACCEPT, "deepest module level listed (-1, the default: all)"),
    "top_modules": Key(check_int(1), ACCEPT, "modules listed at each depth, most flops first (default 1)"),
    "detailed": Key(check_bool, ACCEPT, "adds the per-module, per-operator flop table (default true)"),
    "recompute_fwd_factor": Key(check_number(0.0), ACCEPT, "forward recomputed in backward (activation checkpointing): "
                                "bwd flops = (2 + factor) x fwd flops (default 0)"),
    "output_file": Key(_optional(_text), ACCEPT, "write the profile to this file instead of stdout"),
}

TIMERS: Schema = {
    "throughput": {
        "enabled": Key(check_bool, ACCEPT, "engine.initialize's engine prints DeepSpeed's samples/second line with "
                       "each steps_per_print progress line (default true)"),
        "synchronized": Key(check_bool, ACCEPT, "with CUDA, synchronize the device when the throughput timer reads the "
                            "clock (default true)"),
    },
}

_COMET_START = "passed to comet_ml.start"

COMET: Schema = {
    "enabled": Key(check_bool, ACCEPT, _MONITOR + ", to a Comet experiment (needs the comet_ml package)"),
    "samples_log_interval": Key(check_int(1), ACCEPT, "an event name is logged at most once per this many samples "
                                "(DeepSpeed's default: 100)"),
    "project": Key(_optional(_text), ACCEPT, _COMET_START),
    "workspace": Key(_optional(_text), ACCEPT, _COMET_START),
    "api_key": Key(_optional(_text), ACCEPT, _COMET_START),
    "experiment_name": Key(_optional(_text), ACCEPT, "the experiment's name (set_name)"),
    "experiment_key": Key(_optional(_text), ACCEPT, _COMET_START),
    "online": Key(_optional(check_bool), ACCEPT, _COMET_START),
    "mode": Key(_optional(check_choice("get", "create", "get_or_create")), ACCEPT, _COMET_START),
}

CHECKPOINT: Schema = {
    "tag_validation": Key(check_choice("ignore", "warn", "fail"), ACCEPT,
                          "every rank's tag is always checked: different tags are an error"),
    "load_universal": Key(check_bool, ACCEPT, "a checkpoint loads at any world size without conversion"),
    "use_node_local_storage": Key(check_bool, DEFAULT_ONLY, "every rank must reach every rank's checkpoint file",
                                  False),
    "parallel_write": Key(_mapping_or_none, ACCEPT, "every rank writes its own shard files; the setting is for "
                          "pipeline stages, which are not here"),
}

DATA_TYPES: Schema = {
    "grad_accum_dtype": Key(_fp32_or_null, ACCEPT, "gradients accumulate into their fp32 shards; fp32 (or null) only"),
}

TORCH_AUTOCAST: Schema = {
    "enabled": Key(check_bool, DEFAULT_ONLY, "the forward is not autocast for you: run it under torch.autocast(...) in "
                   "the script, or train in bf16 (the bf16 section)", False),
    "dtype": Key(_any, ACCEPT, "used only with enabled, which is off"),
    "lower_precision_safe_modules": Key(_any, ACCEPT, "used only with enabled, which is off"),
}

TOP: Schema = {
    "zero_optimization": ZERO,
    "activation_checkpointing": ACTIVATION_CHECKPOINTING,
    "aio": AIO,
    "bf16": BF16,
    "bfloat16": BF16,
    "fp16": FP16,
    "gradient_clipping": Key(check_number(), MAP,
                             "max_grad_norm (0 -> None, no clipping; left out -> 1.0, as DeepSpeed)"),
    "optimizer": Key(_mapping_or_none, MAP, "validated here; build it with optimizer_from_deepspeed(ds)"),
    "scheduler": Key(_mapping_or_none, MAP, "validated here; build it with scheduler_from_deepspeed(ds, optimizer)"),
    "train_batch_size": Key(check_int(1), MAP, _ACCUMULATION),
    "train_micro_batch_size_per_gpu": Key(check_int(1), MAP, _ACCUMULATION),
    "gradient_accumulation_steps": Key(check_int(1), MAP, _ACCUMULATION),
    "dataloader_drop_last": Key(check_bool, ACCEPT,
                                "engine.initialize(training_data=)'s loader drops a last short batch"),
    "steps_per_print": Key(_optional(check_int()), ACCEPT, _PROGRESS_LINE),
    "wall_clock_breakdown": Key(check_bool, ACCEPT, _TIMERS),
    "memory_breakdown": Key(check_bool, ACCEPT, "engine.initialize's engine prints DeepSpeed's memory lines after each "
                            "forward, backward and step, with the store's tiers and the materialized parameters, "
                            "on rank 0"),
    "dump_state": Key(check_bool, ACCEPT, "engine.initialize's engine prints the EngineConfig (store settings "
                      "included) the config became, on rank 0"),
    "tensorboard": TENSORBOARD,
    "wandb": WANDB,
    "csv_monitor": CSV_MONITOR,
    "comet": COMET,
    "flops_profiler": FLOPS_PROFILER,
    "comms_logger": Key(_mapping_or_none, ACCEPT, _LOGGING),
    "timers": TIMERS,
    "checkpoint": CHECKPOINT,
    "zero_allow_untested_optimizer": Key(check_bool, ACCEPT, "relaxes DeepSpeed's check of client optimizers"),
    "zero_force_ds_cpu_optimizer": Key(check_bool, ACCEPT, "the engine's optimizer is always its own CPU AdamW"),
    "prescale_gradients": Key(check_bool, DEFAULT_ONLY, "gradient prescaling is not supported", False),
    "gradient_predivide_factor": Key(check_number(), DEFAULT_ONLY, "gradient predivision is not supported", 1.0),
    "sparse_gradients": Key(check_bool, DEFAULT_ONLY, "sparse gradients are not supported", False),
    "communication_data_type": Key(_fp32_or_null, ACCEPT, "gradients are reduce-scattered in fp32 into their fp32 "
                                   "shards; fp32 (or null) only"),
    "seq_parallel_communication_data_type": Key(_any, ACCEPT, "used only with sequence parallelism, which is not here"),
    "data_types": DATA_TYPES,
    "torch_autocast": TORCH_AUTOCAST,
}


# ---------------------------------------------------------------------------------------- public API


def load_deepspeed_config(ds_config: DeepSpeedConfig) -> dict[str, Any]:
    """The DeepSpeed config as a dict: ``ds_config`` itself (a mapping) or the JSON file it names."""
    if isinstance(ds_config, Mapping):
        return dict(ds_config)
    if isinstance(ds_config, (str, os.PathLike)):
        path = os.fspath(ds_config)
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read the DeepSpeed config {path!r}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"the DeepSpeed config {path!r} is not valid JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"the DeepSpeed config {path!r} must hold a JSON object, got {type(loaded).__name__}")
        return loaded
    raise TypeError(f"a DeepSpeed config is a dict or a path to a JSON file, got {type(ds_config).__name__}")


def fill_auto(ds: dict[str, Any], path: str, value: Any) -> Any:
    """Replace the ``"auto"`` at the dotted ``path`` of ``ds`` (the Hugging Face integrations'
    placeholder, which they fill from their own arguments) by ``value``, in place. Returns what was
    there: ``"auto"``, the value the config set, or None where the path is absent."""
    *parents, key = path.split(".")
    node: Any = ds
    for parent in parents:
        node = node.get(parent) if isinstance(node, Mapping) else None
    if not isinstance(node, dict) or key not in node:
        return None
    found = node[key]
    if isinstance(found, str) and found == "auto":
        node[key] = value
    return found


def deepspeed_settings(ds_config: DeepSpeedConfig) -> tuple[dict[str, Any], list[str]]:
    """Walk the config against the schema: (values of the keys present, by dotted path; problems)."""
    found: dict[str, Any] = {}
    problems: list[str] = []
    walk_schema(_stage3_names(load_deepspeed_config(ds_config), problems), TOP, "", found, problems)
    return found, problems


def config_from_deepspeed(cls: type, ds_config: DeepSpeedConfig, *, store: StoreConfig,
                          reports: Collection[str] = (), **overrides: Any) -> Any:
    """An EngineConfig (``cls``) from a DeepSpeed config dict or JSON path, over ``store``.

    Mapped values replace the matching fields of ``store`` and of the EngineConfig defaults;
    ``overrides`` replace EngineConfig fields last. ValueError names every unknown or unsupported
    key and every bad value, by path. A warning names the reports (monitors, profilers, timings)
    the config turns on that are not in ``reports``, those the caller produces.
    """
    if not isinstance(store, StoreConfig):
        raise TypeError(f"store must be a tiered.StoreConfig, got {type(store).__name__}")
    found, problems = deepspeed_settings(ds_config)
    engine_fields, store_fields = _map(found, problems)
    raise_problems(problems)
    _warn_unreported(found, reports)
    return cls(store=store.replace(**store_fields), **{**engine_fields, **overrides})


#: DeepSpeed's reports (monitors, timings, the flops profile), which ``engine.initialize``'s engine
#: produces: a config turning one on where nothing produces it gets a warning.
INITIALIZE_REPORTS = ("tensorboard", "wandb", "csv_monitor", "comet", "wall_clock_breakdown", "flops_profiler",
                      "memory_breakdown", "dump_state")


def _warn_unreported(found: Mapping[str, Any], produced: Collection[str]) -> None:
    """Warn when the config turns on a DeepSpeed report that is not produced: the user would look
    for its files or lines and find none."""
    asked = [k for k in INITIALIZE_REPORTS if k not in produced and (
        found.get(k) is True or isinstance(found.get(k), Mapping) and found[k].get("enabled") is True)]
    if not asked:
        return
    warnings.warn(
        f"{', '.join(asked)}: not produced by this engine (nothing is written or printed for them); "
        f"engine.initialize's engine produces them, as DeepSpeed's does; or log from the loop: eng.get_lr(), "
        f"eng.loss_scale, and eng.stats() for the engine's I/O and stall figures", UserWarning, stacklevel=4)


# ---------------------------------------------------------------------------------------- internals


def _stage3_names(ds: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """``ds`` with the ``zero_optimization`` keys DeepSpeed also takes without their ``stage3_``
    prefix (``prefetch_bucket_size``, ...) under their prefixed names; both given is a problem."""
    zero = ds.get("zero_optimization")
    if not isinstance(zero, Mapping):
        return ds
    renamed: dict[str, Any] = {}
    for key, value in zero.items():
        name = f"stage3_{key}" if key in _STAGE3_UNPREFIXED else key
        if name != key and name in zero:
            problems.append(f"zero_optimization.{key}: given twice, as {key} and as {name}; keep one")
            continue
        renamed[name] = value
    return {**ds, "zero_optimization": renamed}


def _map(found: Mapping[str, Any], problems: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """EngineConfig and StoreConfig fields from the validated values; adds cross-key problems."""
    eng: dict[str, Any] = {}
    sto: dict[str, Any] = {}
    z = "zero_optimization"
    stage = found.get(f"{z}.stage")
    if stage not in ZERO_STAGES_RUN_AS_3:
        got = "missing (DeepSpeed's default is 0, no sharding)" if stage is None else f"got {stage}"
        problems.append(f"{z}.stage: must be 1, 2 or 3 (the engine runs each as ZeRO-3, sharding parameters, "
                        f"gradients and optimizer state; stage 0 is plain data parallelism), {got}")

    param_device = _offload_device(found, problems, f"{z}.offload_param.device", f"{z}.cpu_offload_param")
    if param_device is not None:
        eng["param_tier"] = {"none": "device", "cpu": "host", "nvme": "nvme"}[param_device]

    optim_device = _offload_device(found, problems, f"{z}.offload_optimizer.device", f"{z}.cpu_offload")
    if optim_device is not None:
        eng["optimizer_tier"] = "nvme" if optim_device == "nvme" else "host"

    paths = [found[k] for k in (f"{z}.offload_param.nvme_path", f"{z}.offload_optimizer.nvme_path")
             if found.get(k) is not None]
    if paths:
        sto["nvme_paths"] = tuple(dict.fromkeys(os.path.abspath(p) for p in paths))

    bf16 = [found[k] for k in ("bf16.enabled", "bfloat16.enabled") if k in found]
    if len(set(bf16)) > 1:
        problems.append("bfloat16.enabled: conflicts with bf16.enabled (two names of one DeepSpeed setting)")
    if bf16 and bf16[0]:
        eng["train_dtype"] = "bfloat16"
    if found.get("fp16.enabled"):
        if "train_dtype" in eng:
            problems.append("fp16.enabled: conflicts with bf16.enabled (one training dtype)")
        else:
            eng["train_dtype"] = "float16"
            _map_loss_scaling(found, eng, problems)
            if found.get("fp16.auto_cast"):
                eng["cast_forward_inputs"] = True
    element_bytes = 2 if eng.get("train_dtype") in ("bfloat16", "float16") else 4
    if f"{z}.stage3_prefetch_bucket_size" in found:
        eng["prefetch_bytes"] = found[f"{z}.stage3_prefetch_bucket_size"] * element_bytes
    if f"{z}.sub_group_size" in found:
        eng["optimizer_group_bytes"] = found[f"{z}.sub_group_size"] * FP32_BYTES

    threads = {k: found[k] for k in ("aio.intra_op_parallelism", "aio.thread_count") if k in found}
    if len(set(threads.values())) > 1:
        problems.append("aio.thread_count: older name of aio.intra_op_parallelism, set to a different value")
    if threads or "aio.queue_depth" in found:
        # DeepSpeed's queue_depth is per thread (each has its own libaio context); each store I/O
        # thread keeps one block at the disk, so the same depth takes that many threads.
        in_flight = (found.get("aio.queue_depth", DEEPSPEED_AIO_QUEUE_DEPTH)
                     * next(iter(threads.values()), DEEPSPEED_AIO_THREADS))
        sto["queue_depth"] = in_flight
        sto["io_threads"] = min(in_flight, MAX_MAPPED_IO_THREADS)
    if "aio.block_size" in found:
        sto["block_size"] = found["aio.block_size"]

    _map_accumulation(found, eng, problems)
    if found.get("activation_checkpointing.cpu_checkpointing"):
        eng["activation_tier"] = "host"
    # DeepSpeed clips only when > 0, and at its default when the key is left out
    eng["max_grad_norm"] = found.get("gradient_clipping", DEEPSPEED_GRADIENT_CLIPPING) or None

    if found.get("optimizer") is not None:
        problems.extend(optimizer_problems(found["optimizer"]))
    if found.get("scheduler") is not None:
        problems.extend(scheduler_problems(found["scheduler"]))
    return eng, sto


def _map_accumulation(found: Mapping[str, Any], eng: dict[str, Any], problems: list[str]) -> None:
    """``gradient_accumulation_steps``, or what DeepSpeed derives it from: train_batch_size =
    micro batch x accumulation steps x world size (the default process group's, 1 without one)."""
    batch = found.get("train_batch_size")
    micro = found.get("train_micro_batch_size_per_gpu")
    steps = found.get("gradient_accumulation_steps")
    world = _world_size()
    if steps is None and batch is not None and micro is not None:
        steps, rest = divmod(batch, micro * world)
        if rest or not steps:
            problems.append(
                f"train_batch_size: {batch} is not train_micro_batch_size_per_gpu ({micro}) x world size "
                f"({world}) x a whole number of accumulation steps"
            )
            return
    elif None not in (batch, micro, steps) and batch != micro * steps * world:
        problems.append(
            f"train_batch_size: {batch} must equal train_micro_batch_size_per_gpu ({micro}) x "
            f"gradient_accumulation_steps ({steps}) x world size ({world}) = {micro * steps * world}"
        )
        return
    if steps is not None:
        eng["gradient_accumulation_steps"] = steps


def micro_batch_size(ds: Mapping[str, Any], accumulation_steps: int, world: int) -> Optional[int]:
    """Samples per micro-batch on each rank: ``train_micro_batch_size_per_gpu``, or
    ``train_batch_size / (accumulation_steps x world)`` as DeepSpeed derives it; None when the
    config sets neither."""
    micro = ds.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, int):
        return micro
    batch = ds.get("train_batch_size")
    return batch // (accumulation_steps * world) if isinstance(batch, int) else None


def _world_size() -> int:
    """The default process group's size, as DeepSpeed reads it when it checks the batch sizes."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _map_loss_scaling(found: Mapping[str, Any], eng: dict[str, Any], problems: list[str]) -> None:
    """``fp16``'s scaling keys as an engine.LossScaling (DeepSpeed's defaults for keys left out)."""
    static = found.get("fp16.loss_scale", 0.0)
    fields: dict[str, Any] = {}
    for key, field in (("loss_scale_window", "growth_interval"), ("hysteresis", "hysteresis"),
                       ("consecutive_hysteresis", "consecutive_hysteresis"), ("min_loss_scale", "min_scale")):
        if f"fp16.{key}" in found:
            fields[field] = found[f"fp16.{key}"]
    if "fp16.initial_scale_power" in found:
        fields["initial_scale"] = 2.0 ** found["fp16.initial_scale_power"]
    try:
        eng["loss_scaling"] = LossScaling.static(static) if static else LossScaling(**fields)
    except ValueError as exc:
        problems.append(f"fp16: {exc}")


def _offload_device(found: Mapping[str, Any], problems: list[str], key: str, deprecated: str) -> Optional[str]:
    """The offload device ``key`` names, or "cpu" when only the deprecated boolean ``deprecated`` is set
    (both set is a conflict, added to ``problems``)."""
    device = found.get(key)
    if found.get(deprecated) is not None:
        if device is not None:
            problems.append(f"{deprecated}: deprecated and conflicts with {key}")
        elif found[deprecated]:
            device = "cpu"
    return device
