"""engine: a ZeRO-3 engine that pages an unmodified ``torch.nn.Module``'s parameters through a
:class:`tiered.TieredStore`.

``eng = engine.wrap(model, config=engine.EngineConfig(store=tiered.StoreConfig(...)))`` keeps the
parameters in the store; the model is then called as usual and hooks fetch each module's
parameters just before it runs and release them after (docs/engine.md).

This module is the public surface. Each name is imported from its module on first use (so
``import engine.cli``, the ``tiered`` command's ``--help``, loads no torch, and the integrations'
entry points, ``engine.initialize``, ``engine.from_pretrained`` and the like, load DeepSpeed's or
Hugging Face's code only when asked for).
"""

import importlib
from typing import Any

#: Where each public name lives. The core's modules load no optional dependency; the integrations'
#: (DeepSpeed, Hugging Face) load only when one of their names is asked for.
_HOMES = {
    "AdamW": "engine.optim.adamw",
    "CheckpointError": "engine.errors",
    "DeepSpeedEngine": "engine.integrations.deepspeed.engine",
    "Engine": "engine.engine",
    "EngineClosedError": "engine.errors",
    "EngineConfig": "engine.config",
    "EngineError": "engine.errors",
    "EngineStats": "engine.stats",
    "LossScaling": "engine.config",
    "MemoryBudgetError": "engine.errors",
    "MemoryEstimate": "engine.paging.memory_estimate",
    "OptimizerStateError": "engine.errors",
    "OverflowAwareScheduler": "engine.optim.overflow_scheduler",
    "ReleasedParameterError": "engine.errors",
    "SafetensorsFormatError": "engine.errors",
    "ShardLayout": "engine.paging.layout",
    "StepRecordError": "engine.errors",
    "add_config_arguments": "engine.integrations.deepspeed.initialize",
    "checkpoint_state_dict": "engine.checkpoint.offline_export",
    "estimate_memory": "engine.paging.memory_estimate",
    "export_checkpoint": "engine.checkpoint.offline_export",
    "from_pretrained": "engine.integrations.hf.pretrained",  # needs transformers
    "import_deepspeed_checkpoint": "engine.integrations.deepspeed.checkpoint_import",
    "init_distributed": "engine.paging.distributed_init",
    "initialize": "engine.integrations.deepspeed.initialize",
    "load_checkpoint_and_dispatch": "engine.integrations.hf.device_map",
    "param_key": "engine.paging.layout",
    "wrap": "engine.engine",
}

__all__ = [
    "AdamW",
    "CheckpointError",
    "DeepSpeedEngine",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "LossScaling",
    "MemoryBudgetError",
    "MemoryEstimate",
    "OptimizerStateError",
    "OverflowAwareScheduler",
    "ReleasedParameterError",
    "SafetensorsFormatError",
    "ShardLayout",
    "StepRecordError",
    "add_config_arguments",
    "checkpoint_state_dict",
    "estimate_memory",
    "export_checkpoint",
    "from_pretrained",
    "import_deepspeed_checkpoint",
    "init_distributed",
    "initialize",
    "load_checkpoint_and_dispatch",
    "param_key",
    "wrap",
]

def __getattr__(name: str) -> Any:
    """A public name, imported from its module when first asked for."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
