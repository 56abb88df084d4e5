"""engine: a ZeRO-3 engine that pages an unmodified ``torch.nn.Module``'s parameters through a
:class:`tiered.TieredStore`.

``eng = engine.wrap(model, config=engine.EngineConfig(store=tiered.StoreConfig(...)))`` keeps the
parameters in the store; the model is then called as usual and hooks fetch each module's
parameters just before it runs and release them after (docs/engine.md).
"""

from typing import Any

from engine.checkpoint.offline_export import checkpoint_state_dict, export_checkpoint
from engine.config import EngineConfig
from engine.engine import Engine, EngineClosedError, wrap
from engine.integrations.deepspeed.checkpoint_import import import_deepspeed_checkpoint
from engine.integrations.deepspeed.engine import DeepSpeedEngine
from engine.integrations.hf.device_map import load_checkpoint_and_dispatch
from engine.optim.loss_scaler import LossScaling
from engine.optim.overflow_scheduler import OverflowAwareScheduler
from engine.paging.distributed_init import init_distributed
from engine.paging.layout import ShardLayout, param_key
from engine.paging.memory_estimate import MemoryEstimate, estimate_memory
from engine.paging.released import ReleasedParameterError
from engine.stats import EngineStats

__all__ = [
    "AdamW", "DeepSpeedEngine", "Engine", "EngineClosedError", "EngineConfig", "EngineStats", "LossScaling",
    "MemoryEstimate", "OverflowAwareScheduler", "ReleasedParameterError", "ShardLayout", "add_config_arguments",
    "checkpoint_state_dict", "estimate_memory", "export_checkpoint", "from_pretrained", "import_deepspeed_checkpoint",
    "init_distributed", "initialize", "load_checkpoint_and_dispatch", "param_key", "wrap",
]


def __getattr__(name: str) -> Any:
    # engine.AdamW (and engine.initialize, which builds one) are imported on first use, so the paging
    # engine does not depend on the optimizer modules.
    if name == "AdamW":
        from engine.optim.adamw import AdamW

        return AdamW
    if name in ("initialize", "add_config_arguments"):
        from engine.integrations.deepspeed import initialize as deepspeed_initialize

        return getattr(deepspeed_initialize, name)
    if name == "from_pretrained":  # needs transformers
        from engine.integrations.hf.pretrained import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
