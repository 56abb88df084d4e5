"""engine: a ZeRO-3 engine that pages an unmodified ``torch.nn.Module``'s parameters through a
:class:`tiered.TieredStore`.

``eng = engine.wrap(model, config=engine.EngineConfig(store=tiered.StoreConfig(...)))`` keeps the
parameters in the store; the model is then called as usual and hooks fetch each module's
parameters just before it runs and release them after (docs/engine.md).

This module is the public surface. Its names are imported on first use: the core ones all together
the first time one is asked for (so ``import engine.cli``, the ``tiered`` command's ``--help``,
loads no torch), the optimizer and the integrations' entry points (``engine.initialize``,
``engine.from_pretrained``, ...) each on its own, so the core loads neither DeepSpeed's nor Hugging
Face's code, nor any optional dependency.
"""

from typing import Any

__all__ = [
    "AdamW", "CheckpointError", "DeepSpeedEngine", "Engine", "EngineClosedError", "EngineConfig", "EngineError",
    "EngineStats", "LossScaling", "MemoryBudgetError", "MemoryEstimate", "OptimizerStateError",
    "OverflowAwareScheduler", "ReleasedParameterError", "SafetensorsFormatError", "ShardLayout", "StepRecordError",
    "add_config_arguments", "checkpoint_state_dict", "estimate_memory", "export_checkpoint", "from_pretrained",
    "import_deepspeed_checkpoint", "init_distributed", "initialize", "load_checkpoint_and_dispatch", "param_key",
    "wrap",
]


def __getattr__(name: str) -> Any:
    """A public name, imported when first asked for (the core's all at once)."""
    if name == "AdamW":
        from engine.optim.adamw import AdamW

        return AdamW
    if name == "initialize":
        from engine.integrations.deepspeed.initialize import initialize

        return initialize
    if name == "add_config_arguments":
        from engine.integrations.deepspeed.initialize import add_config_arguments

        return add_config_arguments
    if name == "DeepSpeedEngine":
        from engine.integrations.deepspeed.engine import DeepSpeedEngine

        return DeepSpeedEngine
    if name == "import_deepspeed_checkpoint":
        from engine.integrations.deepspeed.checkpoint_import import import_deepspeed_checkpoint

        return import_deepspeed_checkpoint
    if name == "from_pretrained":  # needs transformers
        from engine.integrations.hf.pretrained import from_pretrained

        return from_pretrained
    if name == "load_checkpoint_and_dispatch":
        from engine.integrations.hf.device_map import load_checkpoint_and_dispatch

        return load_checkpoint_and_dispatch
    if name in __all__:
        core = _core_names()
        globals().update(core)
        return core[name]
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _core_names() -> dict[str, Any]:
    from engine.checkpoint.offline_export import checkpoint_state_dict, export_checkpoint
    from engine.config import EngineConfig, LossScaling
    from engine.engine import Engine, wrap
    from engine.errors import (
        CheckpointError,
        EngineClosedError,
        EngineError,
        MemoryBudgetError,
        OptimizerStateError,
        ReleasedParameterError,
        SafetensorsFormatError,
        StepRecordError,
    )
    from engine.optim.overflow_scheduler import OverflowAwareScheduler
    from engine.paging.distributed_init import init_distributed
    from engine.paging.layout import ShardLayout, param_key
    from engine.paging.memory_estimate import MemoryEstimate, estimate_memory
    from engine.stats import EngineStats

    return {name: value for name, value in locals().items() if name in __all__}
