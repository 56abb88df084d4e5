"""EngineConfig.from_deepspeed: every DeepSpeed key is mapped, accepted for a stated reason, or
refused by name; plus engine.AdamW and LR schedulers from the optimizer and scheduler sections."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings

import pytest
import torch

import tiered
from engine.optim.adamw import AdamW
from engine.config import EngineConfig
from engine.config.deepspeed import ACCEPT, DEFAULT_ONLY, MAP, TOP, Key, config_from_deepspeed
from engine.integrations.deepspeed.optimizer import SCHEDULES, optimizer_from_deepspeed, scheduler_from_deepspeed
from engine.integrations.deepspeed.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

MiB = 1024 * 1024
ZERO3 = {"zero_optimization": {"stage": 3}}


@pytest.fixture
def store(tmp_path) -> tiered.StoreConfig:
    return tiered.StoreConfig(path=str(tmp_path / "store"), block_size=4 * MiB, queue_depth=16, io_threads=6)


def ds(**sections) -> dict:
    """A stage-3 config with ``zero_optimization`` keys from ``zero=`` and other top-level sections."""
    config = copy.deepcopy(ZERO3)
    config["zero_optimization"].update(sections.pop("zero", {}))
    config.update(sections)
    return config


def deepspeed_defaults(store: tiered.StoreConfig, **fields) -> EngineConfig:
    """The EngineConfig a config leaving everything else out maps to: the engine's defaults, but
    clipping at DeepSpeed's default ``gradient_clipping`` (1.0 since deepspeedai/DeepSpeed#8068)."""
    return EngineConfig(store=store, **{"max_grad_norm": 1.0, **fields})


def problems_of(config, store) -> str:
    with pytest.raises(ValueError) as info:
        EngineConfig.from_deepspeed(config, store=store)
    return str(info.value)


def test_minimal_stage3_config_keeps_every_default(store):
    config = EngineConfig.from_deepspeed(ZERO3, store=store)
    assert config == deepspeed_defaults(store)
    assert config.max_grad_norm == 1.0  # DeepSpeed clips at 1.0 when the config says nothing


@pytest.mark.parametrize("fragment,engine_fields,store_fields", [
    ({"zero": {"offload_param": {"device": "nvme"}}}, {"param_tier": "nvme"}, {}),
    ({"zero": {"offload_param": {"device": "cpu"}}}, {"param_tier": "host"}, {}),
    ({"zero": {"offload_param": {"device": "none"}}}, {"param_tier": "device"}, {}),
    ({"zero": {"offload_optimizer": {"device": "nvme"}}}, {"optimizer_tier": "nvme"}, {}),
    ({"zero": {"offload_optimizer": {"device": "cpu"}}}, {"optimizer_tier": "host"}, {}),
    ({"zero": {"offload_optimizer": {"device": "none"}}}, {"optimizer_tier": "host"}, {}),
    ({"zero": {"cpu_offload": True}}, {"optimizer_tier": "host"}, {}),
    ({"zero": {"cpu_offload_param": True}}, {"param_tier": "host"}, {}),
    ({"zero": {"cpu_offload": False, "cpu_offload_param": False}}, {}, {}),
    ({"zero": {"stage3_prefetch_bucket_size": 5e7}}, {"prefetch_bytes": 200_000_000}, {}),
    ({"zero": {"prefetch_bucket_size": 5e7}}, {"prefetch_bytes": 200_000_000}, {}),  # DeepSpeed's other name
    ({"zero": {"stage3_prefetch_bucket_size": 1000}, "bf16": {"enabled": True}},
     {"prefetch_bytes": 2000, "train_dtype": "bfloat16"}, {}),
    ({"zero": {"sub_group_size": 1e6}}, {"optimizer_group_bytes": 4_000_000}, {}),
    ({"bf16": {"enabled": False}}, {}, {}),
    ({"bfloat16": {"enabled": True}}, {"train_dtype": "bfloat16"}, {}),
    ({"gradient_clipping": 1.5}, {"max_grad_norm": 1.5}, {}),
    ({"activation_checkpointing": {"cpu_checkpointing": True}}, {"activation_tier": "host"}, {}),
    ({"activation_checkpointing": {"cpu_checkpointing": False}}, {}, {}),
    ({"gradient_clipping": 0}, {"max_grad_norm": None}, {}),
    ({"aio": {"block_size": 1048576}}, {}, {"block_size": 1048576}),
    # DeepSpeed's queue depth is per thread; each store thread holds one request at the disk.
    ({"aio": {"queue_depth": 4}}, {}, {"queue_depth": 4, "io_threads": 4}),
    ({"aio": {"intra_op_parallelism": 3}}, {}, {"queue_depth": 24, "io_threads": 24}),
    ({"aio": {"thread_count": 2}}, {}, {"queue_depth": 16, "io_threads": 16}),
    ({"aio": {"thread_count": 2, "intra_op_parallelism": 2}}, {}, {"queue_depth": 16, "io_threads": 16}),
    ({"aio": {"queue_depth": 32, "intra_op_parallelism": 4}}, {}, {"queue_depth": 128, "io_threads": 128}),
    ({"aio": {"queue_depth": 128, "intra_op_parallelism": 8}}, {}, {"queue_depth": 1024, "io_threads": 256}),
])
def test_each_mapping(store, fragment, engine_fields, store_fields):
    config = EngineConfig.from_deepspeed(ds(**fragment), store=store)
    assert config == deepspeed_defaults(store.replace(**store_fields), **engine_fields)


def test_nvme_paths_of_both_offload_sections(store, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    zero = {"offload_param": {"device": "nvme", "nvme_path": a},
            "offload_optimizer": {"device": "nvme", "nvme_path": b}}
    assert EngineConfig.from_deepspeed(ds(zero=zero), store=store).store.nvme_paths == (a, b)
    zero["offload_optimizer"]["nvme_path"] = a + "/"
    assert EngineConfig.from_deepspeed(ds(zero=zero), store=store).store.nvme_paths == (a,)


def test_accepted_keys_change_nothing(store):
    zero = {
        "offload_param": {"device": "nvme", "pin_memory": True, "buffer_count": 5, "buffer_size": 1e8,
                          "max_in_cpu": 1e9},
        "offload_optimizer": {"device": "nvme", "pin_memory": True, "buffer_count": 4, "fast_init": False,
                              "pipeline_read": True, "pipeline_write": True, "ratio": 1.0},
        "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e8, "reduce_scatter": True,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_param_persistence_threshold": 1e5, "stage3_gather_16bit_weights_on_model_save": True,
        "allgather_partitions": True, "allgather_bucket_size": 5e8, "load_from_fp32_weights": True,
        "round_robin_gradients": False, "ignore_unused_parameters": True, "zero_quantized_weights": False,
        # DeepSpeed's ZeRO config also takes the stage3_ keys by their unprefixed field names
        "model_persistence_threshold": 1e5, "use_all_reduce_for_fetch_params": False, "module_granularity_threshold": 0,
    }
    top = {"steps_per_print": 10, "wall_clock_breakdown": False, "fp16": {"enabled": False, "loss_scale": 0},
           "aio": {"single_submit": False, "overlap_events": True, "use_gds": False},
           "tensorboard": {"enabled": False}, "prescale_gradients": False, "zero_allow_untested_optimizer": True,
           "comms_logger": {"enabled": True, "verbose": False}, "timers": {"throughput": {"enabled": True}},
           "checkpoint": {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False,
                          "parallel_write": {"pipeline_stage": False}},
           "communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"},
           "seq_parallel_communication_data_type": "fp32",
           "torch_autocast": {"enabled": False, "dtype": "bfloat16", "lower_precision_safe_modules": []},
           "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": False,
                                        "number_checkpoints": None, "synchronize_checkpoint_boundary": False,
                                        "profile": False}}
    config = EngineConfig.from_deepspeed(ds(zero=zero, **top), store=store)
    assert config == deepspeed_defaults(store, param_tier="nvme", optimizer_tier="nvme")


def test_fp16_auto_cast_casts_forward_inputs(store):
    config = EngineConfig.from_deepspeed(ds(fp16={"enabled": True, "auto_cast": True}), store=store)
    assert config.cast_forward_inputs and config.train_dtype == "float16"
    assert not EngineConfig.from_deepspeed(ds(fp16={"enabled": True}), store=store).cast_forward_inputs
    off = EngineConfig.from_deepspeed(ds(fp16={"enabled": False, "auto_cast": True}), store=store)
    assert not off.cast_forward_inputs and off.train_dtype is None


@pytest.mark.parametrize("batch,expected", [
    ({"gradient_accumulation_steps": 8}, 8),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 8),  # derived, as DeepSpeed does at world 1
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}, 8),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 4),
    ({"train_batch_size": 32}, 1),  # nothing to derive it from
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, 1),
])
def test_gradient_accumulation_steps_given_or_derived(store, batch, expected):
    assert EngineConfig.from_deepspeed(ds(**batch), store=store).gradient_accumulation_steps == expected


@pytest.mark.parametrize("batch,expected", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "is not train_micro_batch_size_per_gpu (4)"),
    ({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4}, "is not train_micro_batch_size_per_gpu (4)"),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
     "must equal train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps (4) x world size (1) = 16"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps: must be"),
])
def test_inconsistent_batch_sizes_are_named(store, batch, expected):
    assert expected in problems_of(ds(**batch), store)


def test_auto_values_are_treated_as_unset(store):
    config = EngineConfig.from_deepspeed(
        ds(zero={"stage3_prefetch_bucket_size": "auto", "sub_group_size": "auto"}, gradient_clipping="auto",
           bf16={"enabled": "auto"}, train_batch_size="auto", optimizer={"type": "AdamW", "params": {"lr": "auto"}}),
        store=store,
    )
    assert config == deepspeed_defaults(store)


def test_overrides_win_and_absent_keys_keep_the_store(store):
    config = EngineConfig.from_deepspeed(
        ds(zero={"offload_param": {"device": "cpu"}}, aio={"queue_depth": 4}), store=store,
        param_tier="nvme", compress_optimizer=True,
    )
    assert config.param_tier == "nvme" and config.compress_optimizer
    assert (config.store.queue_depth, config.store.block_size, config.store.io_threads) == (4, 4 * MiB, 4)


def test_json_file(store, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds(zero={"offload_optimizer": {"device": "nvme"}}, gradient_clipping=1.0)))
    for given in (str(path), path):
        config = EngineConfig.from_deepspeed(given, store=store)
        assert config.optimizer_tier == "nvme" and config.max_grad_norm == 1.0
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig.from_deepspeed(str(path), store=store)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        EngineConfig.from_deepspeed(str(path), store=store)
    with pytest.raises(ValueError, match="cannot read"):
        EngineConfig.from_deepspeed(str(tmp_path / "missing.json"), store=store)
    with pytest.raises(TypeError, match="dict or a path"):
        EngineConfig.from_deepspeed(42, store=store)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="StoreConfig"):
        config_from_deepspeed(EngineConfig, ZERO3, store="nope")  # type: ignore[arg-type]


def test_every_unknown_key_is_named_with_its_path(store):
    config = ds(
        zero={"stage3_prefetch_bucket_sise": 1, "offload_param": {"device": "nvme", "buffer_cnt": 2},
              "offload_optimizer": {"device": "cpu", "speed": 3}},
        aio={"block_size": 1048576, "threads": 4}, bf16={"enabled": True, "magic": 1},
        unknown_section={"a": 1}, train_batch_size=8,
    )
    message = problems_of(config, store)
    assert "6 unsupported or invalid" in message
    for path in ("zero_optimization.stage3_prefetch_bucket_sise", "zero_optimization.offload_param.buffer_cnt",
                 "zero_optimization.offload_optimizer.speed", "aio.threads", "bf16.magic", "unknown_section"):
        assert f"{path}: unknown key" in message
    assert "did you mean 'stage3_prefetch_bucket_size'?" in message
    assert "unknown_section.a" not in message  # an unknown section is named once


@pytest.mark.parametrize("fragment,path,expected", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled", "conflicts with bf16"),
    ({"fp16": {"enabled": True, "min_loss_scale": 3}}, "fp16", "power of two"),
    ({"zero": {"offload_optimizer": {"ratio": 0.5}}}, "zero_optimization.offload_optimizer.ratio", "partial"),
    ({"zero": {"zero_quantized_gradients": True}}, "zero_optimization.zero_quantized_gradients", "not supported"),
    ({"zero": {"zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size", "only 1"),
    ({"aio": {"use_gds": True}}, "aio.use_gds", "GPUDirect"),
    ({"prescale_gradients": True}, "prescale_gradients", "not supported"),
    ({"communication_data_type": "fp16"}, "communication_data_type", 'only "fp32" or null'),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype", 'only "fp32" or null'),
    ({"torch_autocast": {"enabled": True}}, "torch_autocast.enabled", "run it under torch.autocast"),
    ({"zero": {"max_live_parameters": 1, "stage3_max_live_parameters": 2}}, "zero_optimization.max_live_parameters",
     "given twice, as max_live_parameters and as stage3_max_live_parameters"),
    ({"zero": {"offload_param": {"device": "gpu"}}}, "zero_optimization.offload_param.device", "one of"),
    ({"zero": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size", ">= 0"),
    ({"zero": {"sub_group_size": 1.5}}, "zero_optimization.sub_group_size", "integer"),
    ({"zero": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm", "true or false"),
    ({"zero": {"offload_param": 5}}, "zero_optimization.offload_param", "must be an object"),
    ({"aio": {"block_size": 1000000}}, "aio.block_size", "multiple of 4096"),
    ({"gradient_clipping": -1}, "gradient_clipping", ">= 0"),
    ({"aio": {"thread_count": 2, "intra_op_parallelism": 4}}, "aio.thread_count", "different value"),
    ({"zero": {"cpu_offload": True, "offload_optimizer": {"device": "nvme"}}}, "zero_optimization.cpu_offload",
     "conflicts"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}}, "bfloat16.enabled", "conflicts"),
    ({"checkpoint": {"use_node_local_storage": True}}, "checkpoint.use_node_local_storage", "every rank must reach"),
    ({"checkpoint": {"tag_validation": "maybe"}}, "checkpoint.tag_validation", "one of"),
])
def test_unsupported_or_invalid_values_are_named(store, fragment, path, expected):
    message = problems_of(ds(**fragment), store)
    line = next((line for line in message.splitlines() if line.strip().startswith(f"{path}:")), None)
    assert line is not None and expected in line, message


@pytest.mark.parametrize("config,expected", [
    ({}, "must be 1, 2 or 3 (the engine runs each as ZeRO-3"),
    ({}, "missing (DeepSpeed's default is 0, no sharding)"),
    ({"zero_optimization": {"stage": 0}}, "stage 0 is plain data parallelism), got 0"),
    ({"zero_optimization": {"stage": 4}}, "got 4"),
    ({"zero_optimization": True}, "zero_optimization: must be an object"),
])
def test_stage_must_be_1_2_or_3(store, config, expected):
    assert expected in problems_of(config, store)


def test_zero_offload_stage_2_config_runs_as_stage_3(store):
    """DeepSpeed's ZeRO-Offload config (stage 2, optimizer state on the CPU), as its tutorial writes
    it, configures the engine as the same config at stage 3 does."""
    zero = {"offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
            "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True,
            "reduce_bucket_size": 2e8, "contiguous_gradients": True}
    by_stage = {s: EngineConfig.from_deepspeed(ds(zero={**zero, "stage": s}), store=store) for s in (1, 2, 3)}
    assert by_stage[1] == by_stage[2] == by_stage[3]
    assert by_stage[2].optimizer_tier == "host"


def test_problems_in_several_sections_are_reported_together(store):
    config = ds(zero={"stage": 0, "foo": 1}, optimizer={"type": "Lamb"}, scheduler={"type": "OneCycle"},
                fp16={"enabled": True, "fp16_master_weights_and_grads": True})
    message = problems_of(config, store)
    for path in ("zero_optimization.stage", "zero_optimization.foo", "optimizer.type", "scheduler.type",
                 "fp16.fp16_master_weights_and_grads"):
        assert f"\n  {path}:" in message, message


def test_schema_covers_every_key_of_the_installed_deepspeed():
    """Each key DeepSpeed's own config classes know is classified here: none would be 'unknown'."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.swap_tensor import constants as aio
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    def names(model) -> set[str]:
        return {field.alias or name for name, field in model.model_fields.items()}

    zero = TOP["zero_optimization"]
    assert names(DeepSpeedZeroConfig) <= set(zero)
    assert names(DeepSpeedZeroOffloadParamConfig) <= set(zero["offload_param"])
    assert names(DeepSpeedZeroOffloadOptimizerConfig) <= set(zero["offload_optimizer"])
    from deepspeed.runtime.activation_checkpointing import config as act
    assert {getattr(act, n) for n in dir(act) if n.startswith("ACT_CHKPT_") and n != "ACT_CHKPT_DEFAULT"
            and not n.endswith(("_DEFAULT", "_FORMAT"))} - {act.ACT_CHKPT} <= set(TOP["activation_checkpointing"])
    assert {getattr(aio, n) for n in dir(aio) if n.startswith("AIO_") and n.count("_") >= 2
            and not n.endswith(("_DEFAULT", "_FORMAT"))} <= set(TOP["aio"])
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    for section, model in (("tensorboard", TensorBoardConfig), ("csv_monitor", CSVConfig), ("wandb", WandbConfig),
                           ("comet", CometConfig)):
        assert names(model) == set(TOP[section]), section
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig
    assert names(DeepSpeedThroughputTimerConfig) == set(TOP["timers"]["throughput"])
    from deepspeed.profiling import constants as flops
    assert {getattr(flops, n) for n in dir(flops) if n.startswith("FLOPS_PROFILER_")
            and not n.endswith(("_DEFAULT", "_FORMAT"))} == set(TOP["flops_profiler"])
    from engine.integrations.deepspeed.flops import FlopsProfilerSettings
    defaults = FlopsProfilerSettings()
    for field in dataclasses.fields(defaults):  # the profile a section leaving keys out gets is DeepSpeed's
        assert getattr(flops, f"FLOPS_PROFILER_{field.name.upper()}_DEFAULT") == getattr(defaults, field.name)
    # The defaults the mapping assumes for a half-given aio section are DeepSpeed's own.
    from engine.config.deepspeed import DEEPSPEED_AIO_QUEUE_DEPTH, DEEPSPEED_AIO_THREADS
    assert (aio.AIO_QUEUE_DEPTH_DEFAULT, aio.AIO_INTRA_OP_PARALLELISM_DEFAULT) == (
        DEEPSPEED_AIO_QUEUE_DEPTH, DEEPSPEED_AIO_THREADS)


def test_every_key_has_an_action_and_a_reason():
    def walk(schema):
        for key, spec in schema.items():
            if isinstance(spec, Key):
                assert spec.action in (MAP, ACCEPT, DEFAULT_ONLY) and spec.why, key
            else:
                walk(spec)

    walk(TOP)


# ------------------------------------------------------------------------------ optimizer section


def test_optimizer_from_deepspeed():
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                                        "weight_decay": 0.1}}}
    opt = optimizer_from_deepspeed(config)
    assert isinstance(opt, AdamW)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.9, 0.95), 1e-6, 0.1)
    # deepspeed.initialize(model_parameters=groups): the section's settings are the groups' defaults
    lin = torch.nn.Linear(2, 2)
    grouped = optimizer_from_deepspeed(config, [{"params": [lin.weight]}, {"params": [lin.bias], "weight_decay": 0.0}])
    assert [g["weight_decay"] for g in grouped.param_groups] == [0.1, 0.0] and grouped.param_groups[1]["lr"] == 3e-4


@pytest.mark.parametrize("section,weight_decay,fused", [
    # DeepSpeed's Adam is AdamW mode, weight decay 0, stepped by its own fused kernel: torch's fused one here
    ({"type": "Adam", "params": {"lr": 1e-4}}, 0.0, True),
    ({"type": "adamw", "params": {"torch_adam": True}}, 0.01, None),  # torch.optim.AdamW's defaults
    ({"type": "adamw", "params": {"torch_adam": False}}, 0.0, True),
    ({"type": "Adam", "params": {"adam_w_mode": True, "bias_correction": True, "amsgrad": False}}, 0.0, True),
])
def test_optimizer_defaults_follow_deepspeed(section, weight_decay, fused):
    group = optimizer_from_deepspeed({"optimizer": section}).param_groups[0]
    assert (group["weight_decay"], group["fused"]) == (weight_decay, fused)


def test_no_optimizer_section_gives_torch_defaults():
    group = optimizer_from_deepspeed(ZERO3).param_groups[0]
    assert (group["weight_decay"], group["fused"]) == (0.01, None)


@pytest.mark.parametrize("section,expected", [
    ({"type": "Lamb"}, "optimizer.type"),
    ({"params": {"lr": 1e-3}}, "optimizer.type: missing"),
    ({"type": "Adam", "params": {"adam_w_mode": False}}, "L2-regularized"),
    ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, "gradient_clipping"),
    ({"type": "AdamW", "params": {"amsgrad": True}}, "AMSGrad"),
    ({"type": "AdamW", "params": {"betas": [0.9]}}, "optimizer.params.betas"),
    ({"type": "AdamW", "params": {"momentum": 0.9}}, "optimizer.params.momentum: unknown"),
])
def test_optimizer_problems(store, section, expected):
    with pytest.raises(ValueError, match=expected):
        optimizer_from_deepspeed({"optimizer": section})
    assert expected.split(":")[0] in problems_of(ds(optimizer=section), store)


# ------------------------------------------------------------------------------ scheduler section


def _lrs(scheduler, optimizer, steps: int) -> list[float]:
    lrs = [optimizer.param_groups[0]["lr"]]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected call of")  # no optimizer steps here
        for _ in range(steps):
            scheduler.step()
            lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


SCHEDULE_CASES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 7, "warmup_type": "log"}),
    ("WarmupLR", {"warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_max_lr": 2e-3, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 1}),
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 3, "warmup_type": "linear"}),
]


@pytest.mark.parametrize("kind,params", SCHEDULE_CASES)
def test_schedules_equal_deepspeed_lr_sequence(kind, params):
    ds_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    ours_opt = AdamW(lr=5e-4)
    ours = scheduler_from_deepspeed({"scheduler": {"type": kind, "params": params}}, ours_opt)
    assert isinstance(ours, SCHEDULES[kind][0])
    theirs_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=5e-4)
    theirs = getattr(ds_schedules, kind)(theirs_opt, **params)
    assert _lrs(ours, ours_opt, 30) == _lrs(theirs, theirs_opt, 30)


@pytest.mark.parametrize("kind,params", SCHEDULE_CASES)
def test_schedules_resume_from_deepspeeds_state(kind, params):
    """DeepSpeed's checkpoints keep {"last_batch_iteration": n}: a new scheduler loaded with it is
    where one stepped n + 1 times is, and both go on alike."""
    section = {"scheduler": {"type": kind, "params": params}}
    stepped_opt, resumed_opt = AdamW(lr=5e-4), AdamW(lr=5e-4)
    stepped = scheduler_from_deepspeed(section, stepped_opt)
    resumed = scheduler_from_deepspeed(section, resumed_opt)
    before = _lrs(stepped, stepped_opt, 6)
    resumed.load_state_dict({"last_batch_iteration": 5})
    assert resumed_opt.param_groups[0]["lr"] == before[-1]
    assert _lrs(resumed, resumed_opt, 10) == _lrs(stepped, stepped_opt, 10)
    with pytest.raises(ValueError, match="last_batch_iteration"):
        resumed.load_state_dict({"last_batch_iteration": -2})
    resumed.load_state_dict(stepped.state_dict())  # torch's own state dict still loads
    assert resumed.last_epoch == stepped.last_epoch


def test_schedules_without_deepspeed_installed():
    """The formulas at a few points, so the module is checked where DeepSpeed is absent too."""
    opt = AdamW(lr=1.0)
    lrs = _lrs(WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear"), opt, 6)
    assert lrs == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    opt = AdamW(lr=1.0)
    lrs = _lrs(WarmupDecayLR(opt, total_num_steps=6, warmup_max_lr=1.0, warmup_num_steps=2,
                             warmup_type="linear"), opt, 8)
    assert lrs == [0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    opt = AdamW(lr=2.0)
    lrs = _lrs(WarmupCosineLR(opt, total_num_steps=4, warmup_num_steps=2, cos_min_ratio=0.0,
                              warmup_type="linear"), opt, 5)
    assert lrs[:3] == [0.0, 0.0, 1.0] and lrs[3] == pytest.approx(1.0) and lrs[-1] == 0.0


def test_torch_scheduler_by_name():
    opt = AdamW(lr=1.0)
    scheduler = scheduler_from_deepspeed({"scheduler": {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}},
                                         opt)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert _lrs(scheduler, opt, 4) == [1.0, 1.0, 0.5, 0.5, 0.25]
    assert scheduler_from_deepspeed(ZERO3, opt) is None


@pytest.mark.parametrize("section,expected", [
    ({"type": "OneCycle", "params": {}}, "scheduler.type: not supported"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}}, "total_num_steps: missing"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cubic"}}, "warmup_type"),
    ({"type": "WarmupLR", "params": {"warmup_steps": 3}}, "scheduler.params.warmup_steps: unknown"),
    ({"type": "WarmupLR", "params": {"last_batch_iteration": 5}}, "state_dict"),
    ({"type": "StepLR", "params": {"step": 2}}, "torch.optim.lr_scheduler.StepLR"),
    ({"type": "WarmupLR", "extra": 1}, "scheduler.extra: unknown"),
])
def test_scheduler_problems(store, section, expected):
    with pytest.raises(ValueError, match=expected):
        scheduler_from_deepspeed({"scheduler": section}, AdamW())
    assert expected.split(":")[0] in problems_of(ds(scheduler=section), store)


def test_a_full_hugging_face_style_config(store, tmp_path):
    """The shape of config users copy from the DeepSpeed and Hugging Face docs (ZeRO-Infinity)."""
    nvme = str(tmp_path / "nvme")
    config = {
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 4,
                                  "fast_init": False},
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 5,
                              "buffer_size": 1e8, "max_in_cpu": 1e9},
            "aio": None,
            "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }
    message = problems_of(config, store)  # "aio" is not a zero_optimization key: named, nothing else
    assert message.count("\n  ") == 1 and "zero_optimization.aio: unknown key" in message
    del config["zero_optimization"]["aio"]
    engine_config = EngineConfig.from_deepspeed(config, store=store)
    assert engine_config == deepspeed_defaults(
        store.replace(nvme_paths=(nvme,), block_size=262144, queue_depth=32, io_threads=32),
        param_tier="nvme", optimizer_tier="nvme", optimizer_group_bytes=4_000_000_000,
    )
    # "auto" is the Hugging Face Trainer's to fill: without it DeepSpeed's defaults are used, and said
    with pytest.warns(UserWarning, match=r"lr, betas, eps, weight_decay: \"auto\".* lr=0\.001, betas=\(0\.9, 0\.999\)"):
        opt = optimizer_from_deepspeed(config)
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["weight_decay"] == 0.0
    with pytest.warns(UserWarning, match="warmup_min_lr, warmup_max_lr, warmup_num_steps: .* defaults of WarmupLR"):
        assert isinstance(scheduler_from_deepspeed(config, opt), WarmupLR)
    assert os.fspath(nvme) in engine_config.store.nvme_paths


def test_the_configuration_reference_lists_every_key():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "configuration.md"), encoding="utf-8") as f:
        doc = f.read()

    def paths(schema, prefix):
        for key, spec in schema.items():
            path = f"{prefix}.{key}" if prefix else key
            if isinstance(spec, Key):
                yield path
            else:
                yield from paths(spec, path)

    missing = [p for p in paths({k: v for k, v in TOP.items() if k != "bfloat16"}, "") if f"`{p}`" not in doc]
    assert not missing, f"docs/configuration.md does not list {missing}"


def test_monitors_turned_on_are_named_in_a_warning(store):
    """DeepSpeed's tensorboard/wandb/csv monitors, flops profiler and wall-clock breakdown are accepted,
    but an EngineConfig's engine produces none of them (engine.initialize's produces all but the
    profiler): turned on, a warning says so; off, nothing is said."""
    with pytest.warns(UserWarning, match=r"^tensorboard, csv_monitor, wall_clock_breakdown: not produced"):
        EngineConfig.from_deepspeed(ds(tensorboard={"enabled": True, "output_path": "tb"}, wall_clock_breakdown=True,
                                       csv_monitor={"enabled": True}, wandb={"enabled": False}), store=store)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EngineConfig.from_deepspeed(ds(tensorboard={"enabled": False}, wall_clock_breakdown=False), store=store)
