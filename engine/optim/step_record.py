"""StepRecord: the durable record of the last completed optimizer step, kept in the store itself.

A step writes its new optimizer state into the key set (slot) that the last completed step did
not use, and commits by putting this small record to the nvme tier last. A put to nvme is durable
and atomic when it returns (the store commits an entry's manifest record only after its bytes),
so after a crash the store holds either the old record with the old state intact, or the new one.
"""

from __future__ import annotations

import dataclasses
import json
import types
from typing import Any, Mapping, Optional

import torch

from engine.errors import StepRecordError
from tiered import TieredStore

#: The store key of the record.
STEP_RECORD_KEY = "engine/step"
#: Version of the record's JSON layout.
RECORD_FORMAT = 1
#: Slot of a shard that has no optimizer state yet (it never took a step).
NO_STATE = -1


@dataclasses.dataclass(frozen=True)
class ShardState:
    """One shard in the record: updates it has taken and the slot (0 or 1) holding its live state,
    or ``NO_STATE``."""

    steps: int
    slot: int

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise StepRecordError(f"a shard's step count must be an int >= 0, got {self.steps!r}")
        if self.slot not in (NO_STATE, 0, 1):
            raise StepRecordError(f"a shard's slot must be -1, 0 or 1, got {self.slot!r}")
        if self.slot == NO_STATE and self.steps != 0:
            raise StepRecordError(f"a shard without state cannot have taken {self.steps} steps")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """Completed optimizer steps (``step``) and every trainable shard's :class:`ShardState`, by name;
    with loss scaling, the scaler's state after that step (``LossScaler.state_dict()``)."""

    step: int
    shards: Mapping[str, ShardState]
    loss_scale: Optional[Mapping[str, Any]] = None

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise StepRecordError(f"the record's step must be an int >= 0, got {self.step!r}")
        object.__setattr__(self, "shards", types.MappingProxyType(dict(self.shards)))

    @classmethod
    def empty(cls, names: list[str]) -> "StepRecord":
        """No step taken, no state for any of ``names``."""
        return cls(0, {name: ShardState(0, NO_STATE) for name in names})

    def replace(self, **changes: Any) -> "StepRecord":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def encode(self) -> torch.Tensor:
        """The record as a uint8 tensor of UTF-8 JSON."""
        doc = {
            "format": RECORD_FORMAT,
            "step": self.step,
            "shards": {name: [s.steps, s.slot] for name, s in self.shards.items()},
        }
        if self.loss_scale is not None:
            doc["loss_scale"] = dict(self.loss_scale)
        return torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8)

    @classmethod
    def decode(cls, tensor: torch.Tensor) -> "StepRecord":
        """Parse :meth:`encode`'s output; StepRecordError if it is not a record of this format."""
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise StepRecordError(f"{STEP_RECORD_KEY!r} holds a {tensor.dtype} tensor of shape {tuple(tensor.shape)}")
        try:
            doc = json.loads(bytes(tensor.numpy()).decode())
            if doc.get("format") != RECORD_FORMAT:
                raise StepRecordError(f"{STEP_RECORD_KEY!r} has format {doc.get('format')!r}, expected {RECORD_FORMAT}")
            shards = {str(name): ShardState(int(v[0]), int(v[1])) for name, v in doc["shards"].items()}
            loss_scale = doc.get("loss_scale")
            if loss_scale is not None and not isinstance(loss_scale, dict):
                raise StepRecordError(f"{STEP_RECORD_KEY!r} has a loss_scale that is not an object: {loss_scale!r}")
            return cls(int(doc["step"]), shards, loss_scale)
        except StepRecordError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise StepRecordError(f"{STEP_RECORD_KEY!r} is not a readable step record: {exc}") from exc

    def write(self, store: TieredStore) -> None:
        """Commit the record: a durable put to nvme (blocks)."""
        store.sync.put(STEP_RECORD_KEY, self.encode(), "nvme")

    @classmethod
    def read(cls, store: TieredStore) -> Optional["StepRecord"]:
        """The store's record, or None when it has none."""
        if STEP_RECORD_KEY not in store:
            return None
        return cls.decode(store.sync.get(STEP_RECORD_KEY))
