"""The engine's typed exceptions.

Every error the engine raises on purpose with a class of its own derives from :class:`EngineError`,
so callers can catch the whole family; each also derives from the builtin a Python programmer would
catch (``except ValueError`` still catches a :class:`CheckpointError`). Invalid arguments raise the
builtin ``ValueError`` or ``TypeError`` naming the value, as the store does; the store's own errors
(:class:`tiered.TieredError` and its children) pass through unchanged.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every engine-specific error."""


class EngineClosedError(EngineError, RuntimeError):
    """The engine was unwrapped or closed; wrap the model again to page it."""


class ReleasedParameterError(EngineError, RuntimeError):
    """A parameter the engine released (its values are in the store) was read or written outside the
    wrapped model's forward. Read it inside ``with eng.gathered():``, or before wrap / after
    ``eng.unwrap()``."""


class CheckpointError(EngineError, ValueError):
    """A checkpoint does not match the engine loading it, is incomplete or is damaged; or saving
    failed on some rank. The message says which and what to do."""


class SafetensorsFormatError(EngineError, ValueError):
    """A file is not a well-formed safetensors file (or not the one expected)."""


class OptimizerStateError(EngineError, RuntimeError):
    """The optimizer state in the store does not match what the caller says it should be (for
    example a shard that has taken steps but whose fp32 master copy is gone)."""


class MemoryBudgetError(EngineError, ValueError):
    """``StoreConfig.host_bytes`` is below the least host memory the model needs under the config;
    the message names that minimum and what takes it (engine/paging/memory_plan.py)."""


class StepRecordError(EngineError, RuntimeError):
    """The store's step record is unreadable or does not match the model being resumed."""


__all__ = [
    "CheckpointError",
    "EngineClosedError",
    "EngineError",
    "MemoryBudgetError",
    "OptimizerStateError",
    "ReleasedParameterError",
    "SafetensorsFormatError",
    "StepRecordError",
]
