"""The engine's configuration: :class:`EngineConfig` and the value types its fields take."""

from engine.config.engine_config import EngineConfig
from engine.config.loss_scaling import LossScaling

__all__ = ["EngineConfig", "LossScaling"]
