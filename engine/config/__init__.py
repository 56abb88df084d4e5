"""The engine's configuration: :class:`EngineConfig` and the value types its fields take."""

from engine.config.engine_config import EngineConfig

__all__ = ["EngineConfig"]
