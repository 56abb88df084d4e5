"""StepRecord: the durable record of the last completed optimizer step, kept in the store itself.

The record is a small JSON entry put to the nvme tier (durable and atomic when the put returns).
It names the completed step, each trainable shard's step count and the key set (slot) of its
moments, and, while a step is being applied, everything needed to finish it after a crash: the
step's :class:`Applying` section ([Note: Rolling a step forward], engine/optim/training.py). With
updates inside backward its :class:`InBackward` section says a step's updates may have run, to be
rolled back after a crash ([Note: Speculative updates], engine/optim/speculation.py).
"""

from __future__ import annotations

import dataclasses
import json
import types
from typing import Any, Mapping, Optional

import torch

from engine.errors import StepRecordError
from engine.optim.types import AdamHyper
from tiered import TieredStore

#: The store key of the record.
STEP_RECORD_KEY = "engine/step"
#: Version of the record's JSON layout (1: a second key set per step, no sections; 2: updates inside
#: backward overwrote the moments, and a crash inside backward was replayed from the recorded batch).
RECORD_FORMAT = 3
#: The formats this version reads.
READABLE_FORMATS = (1, 2, 3)
#: Slot of a shard that has no optimizer state yet (it never took a step).
NO_STATE = -1


@dataclasses.dataclass(frozen=True)
class ShardState:
    """One shard in the record: updates it has taken and the slot (0 or 1) holding its live state,
    or ``NO_STATE``. ``staged``: its fp32 master waits under a staging key for a checkpoint load to
    install it as the parameter (the one-copy layout only)."""

    steps: int
    slot: int
    staged: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise StepRecordError(f"a shard's step count must be an int >= 0, got {self.steps!r}")
        if self.slot not in (NO_STATE, 0, 1):
            raise StepRecordError(f"a shard's slot must be -1, 0 or 1, got {self.slot!r}")
        if self.slot == NO_STATE and self.steps != 0:
            raise StepRecordError(f"a shard without state cannot have taken {self.steps} steps")
        if not isinstance(self.staged, bool):
            raise StepRecordError(f"a shard's staged flag must be a bool, got {self.staged!r}")


@dataclasses.dataclass(frozen=True)
class Applying:
    """A step being applied: it completes step ``step`` for ``shards`` (those with a gradient) with
    these values, recorded before the first shard changed so a redo computes the same bits."""

    step: int
    shards: tuple[str, ...]
    hypers: tuple[AdamHyper, ...]
    grad_scale: float
    clip_coef: Optional[float]
    #: The loss scaler's state once the step is done (None without loss scaling).
    loss_scale: Optional[Mapping[str, Any]] = None
    #: Shards whose update ran inside backward and stands: counted by the step, not updated again.
    inside: tuple[str, ...] = ()

    def clip_tensor(self) -> Optional[torch.Tensor]:
        """The clip coefficient as the step multiplies by it (a 0-dim fp32 tensor), or None."""
        return None if self.clip_coef is None else torch.tensor(self.clip_coef, dtype=torch.float32)

    def encode(self) -> dict[str, Any]:
        """The section as JSON-ready values (floats round-trip exactly)."""
        return {
            "step": self.step, "shards": list(self.shards), "hypers": [_hyper_doc(h) for h in self.hypers],
            "grad_scale": self.grad_scale, "clip_coef": self.clip_coef,
            "loss_scale": None if self.loss_scale is None else dict(self.loss_scale),
            **({"inside": list(self.inside)} if self.inside else {}),
        }

    @classmethod
    def decode(cls, doc: Mapping[str, Any]) -> "Applying":
        """Parse :meth:`encode`'s output (errors are the caller's to wrap)."""
        coef = doc["clip_coef"]
        return cls(int(doc["step"]), tuple(str(n) for n in doc["shards"]),
                   tuple(_hyper_of(h) for h in doc["hypers"]), float(doc["grad_scale"]),
                   None if coef is None else float(coef), doc.get("loss_scale"),
                   tuple(str(n) for n in doc.get("inside", ())))


@dataclasses.dataclass(frozen=True)
class InBackward:
    """Updates of step ``step`` may have run inside backward: the shards that took theirs keep the
    values from before the step aside until it commits, and a resume rolls them back."""

    step: int

    def encode(self) -> dict[str, Any]:
        """The section as JSON-ready values."""
        return {"step": self.step}

    @classmethod
    def decode(cls, doc: Mapping[str, Any]) -> "InBackward":
        """Parse :meth:`encode`'s output."""
        return cls(int(doc["step"]))


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """Completed optimizer steps (``step``) and every trainable shard's :class:`ShardState`, by name;
    with loss scaling, the scaler's state after that step (``LossScaler.state_dict()``).
    ``master_in_param``: fp32 shards are their own masters ([Note: One copy of fp32 weights]).
    ``applying`` / ``in_backward``: a step under way (see the module docstring)."""

    step: int
    shards: Mapping[str, ShardState]
    loss_scale: Optional[Mapping[str, Any]] = None
    master_in_param: bool = False
    applying: Optional[Applying] = None
    in_backward: Optional[InBackward] = None

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise StepRecordError(f"the record's step must be an int >= 0, got {self.step!r}")
        object.__setattr__(self, "shards", types.MappingProxyType(dict(self.shards)))

    @classmethod
    def empty(cls, names: list[str], *, master_in_param: bool = False) -> "StepRecord":
        """No step taken, no state for any of ``names``."""
        return cls(0, {name: ShardState(0, NO_STATE) for name in names}, master_in_param=master_in_param)

    def replace(self, **changes: Any) -> "StepRecord":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def encode(self) -> torch.Tensor:
        """The record as a uint8 tensor of UTF-8 JSON."""
        doc: dict[str, Any] = {
            "format": RECORD_FORMAT,
            "step": self.step,
            "shards": {name: [s.steps, s.slot, *([1] if s.staged else [])] for name, s in self.shards.items()},
            "master_in_param": self.master_in_param,
        }
        if self.loss_scale is not None:
            doc["loss_scale"] = dict(self.loss_scale)
        if self.applying is not None:
            doc["applying"] = self.applying.encode()
        if self.in_backward is not None:
            doc["in_backward"] = self.in_backward.encode()
        return torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8)

    @classmethod
    def decode(cls, tensor: torch.Tensor) -> "StepRecord":
        """Parse :meth:`encode`'s output (or a format-1 record); StepRecordError if it is not one."""
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise StepRecordError(f"{STEP_RECORD_KEY!r} holds a {tensor.dtype} tensor of shape {tuple(tensor.shape)}")
        try:
            doc = json.loads(bytes(tensor.numpy()).decode())
            if doc.get("format") not in READABLE_FORMATS:
                raise StepRecordError(
                    f"{STEP_RECORD_KEY!r} has format {doc.get('format')!r}, expected one of {READABLE_FORMATS}"
                )
            shards = {str(name): ShardState(int(v[0]), int(v[1]), bool(v[2]) if len(v) > 2 else False)
                      for name, v in doc["shards"].items()}
            loss_scale = doc.get("loss_scale")
            if loss_scale is not None and not isinstance(loss_scale, dict):
                raise StepRecordError(f"{STEP_RECORD_KEY!r} has a loss_scale that is not an object: {loss_scale!r}")
            applying = doc.get("applying")
            in_backward = doc.get("in_backward")
            if in_backward is not None and doc["format"] < 3:
                raise StepRecordError(
                    f"step {in_backward.get('step')} stopped inside backward under an earlier layout of the updates "
                    "inside backward, which this version cannot roll back: resume with the version that wrote it "
                    "(it replays that step's batch), or load a checkpoint"
                )
            return cls(int(doc["step"]), shards, loss_scale, bool(doc.get("master_in_param", False)),
                       Applying.decode(applying) if applying is not None else None,
                       InBackward.decode(in_backward) if in_backward is not None else None)
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


def _hyper_doc(hyper: AdamHyper) -> dict[str, Any]:
    lr = hyper.lr
    return {"lr": float(lr), "lr_dtype": str(lr.dtype).removeprefix("torch.") if isinstance(lr, torch.Tensor) else None,
            "betas": [hyper.beta1, hyper.beta2], "eps": hyper.eps, "weight_decay": hyper.weight_decay,
            "foreach": hyper.foreach, "fused": hyper.fused}


def _hyper_of(doc: Mapping[str, Any]) -> AdamHyper:
    lr_dtype = doc.get("lr_dtype")
    lr: Any = float(doc["lr"])
    if lr_dtype is not None:
        dtype = getattr(torch, str(lr_dtype), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"the learning rate's dtype {lr_dtype!r} is not a torch dtype")
        lr = torch.tensor(lr, dtype=dtype)
    beta1, beta2 = doc["betas"]
    return AdamHyper(lr, float(beta1), float(beta2), float(doc["eps"]), float(doc["weight_decay"]), doc["foreach"],
                     doc["fused"])
