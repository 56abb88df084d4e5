"""DeepSpeed's API over the engine, without DeepSpeed installed: ``engine.initialize`` (its engine,
config, store defaults, reports and monitors), the optimizer and LR schedules a DeepSpeed config
describes, its launcher's plan, and the import of DeepSpeed ZeRO checkpoints.

``engine.initialize`` and ``engine.add_config_arguments`` are in :mod:`.initialize` (not re-exported
here, where the name would hide that module). The DeepSpeed config's key table itself is
configuration: :mod:`engine.config.deepspeed`.
"""

from engine.integrations.deepspeed.checkpoint_import import import_deepspeed_checkpoint
from engine.integrations.deepspeed.engine import DeepSpeedEngine
from engine.integrations.deepspeed.optimizer import optimizer_from_deepspeed, scheduler_from_deepspeed
from engine.integrations.deepspeed.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "DeepSpeedEngine", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "import_deepspeed_checkpoint",
    "optimizer_from_deepspeed", "scheduler_from_deepspeed",
]
