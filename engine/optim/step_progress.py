"""Progress entries of a step being applied: which shards' new state has committed.

Each group of a step with its state on nvme writes one small entry with its state, in the same
atomic store call ([Note: Rolling a step forward], engine/optim/training.py): the step it belongs
to and the names of the group's shards, as UTF-8 JSON. An entry is keyed by the group's first
shard, which no other group of the step (a redo's included) starts with.
"""

from __future__ import annotations

import json

import torch

from engine.errors import StepRecordError
from tiered import TieredStore

#: Store keys of progress entries start with this.
PROGRESS_KEY_PREFIX = "engine/step/done/"


def progress_entry(step: int, names: list[str]) -> tuple[str, torch.Tensor]:
    """The (key, tensor) saying that the shards ``names`` (a group, in order) finished step ``step``."""
    if not names:
        raise ValueError("a progress entry names at least one shard")
    data = json.dumps({"step": step, "shards": list(names)}).encode()
    return PROGRESS_KEY_PREFIX + names[0], torch.frombuffer(bytearray(data), dtype=torch.uint8)


def progress_keys(store: TieredStore) -> list[str]:
    """Every progress entry in ``store``."""
    return [k for k in store.keys() if k.startswith(PROGRESS_KEY_PREFIX)]


def done_shards(store: TieredStore, step: int) -> set[str]:
    """Names of the shards whose new state for step ``step`` has committed (entries of other steps
    are leftovers and ignored). StepRecordError for an entry that cannot be read."""
    keys = progress_keys(store)
    done: set[str] = set()
    for key, tensor in zip(keys, store.sync.get_many(keys) if keys else []):
        try:
            doc = json.loads(bytes(tensor.numpy()).decode())
            if int(doc["step"]) == step:
                done.update(str(n) for n in doc["shards"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StepRecordError(f"the progress entry {key!r} of an interrupted step is not readable: {exc}") from exc
    return done
