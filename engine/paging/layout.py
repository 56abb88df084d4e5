"""ShardLayout: how one parameter is flattened, padded and split across ranks, and its store key."""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from tiered import StoreConfig

#: Store keys of parameter shards are this prefix plus the parameter's fully qualified name.
PARAM_KEY_PREFIX = "param/"


def param_key(name: str) -> str:
    """The store key of the parameter called ``name`` (its first fully qualified name):
    ``param/<name>``, where ``eng.store`` keeps that parameter's shard."""
    return PARAM_KEY_PREFIX + name


#: Store keys of fp32 gradient shards (between backward and the optimizer step).
GRAD_KEY_PREFIX = "grad/"
#: Store keys of the optimizer's fp32 state: ``optim/<name>/master``, ``.../exp_avg``, ``.../exp_avg_sq``.
OPTIM_KEY_PREFIX = "optim/"


def grad_key(name: str) -> str:
    """The store key of the fp32 gradient shard of the parameter called ``name``."""
    return GRAD_KEY_PREFIX + name


def optim_keys(name: str, slot: int = 0) -> tuple[str, str, str]:
    """The store keys ``(master, exp_avg, exp_avg_sq)`` of the parameter called ``name``.

    The engine keeps the optimizer state in two key sets and writes each step into the one the
    last completed step did not use (a crash mid-step leaves the other whole): ``slot`` 0 is
    ``optim/<name>/master`` etc., slot 1 the same with ``~1`` appended. Which slot is live is in
    the engine's step record (``engine.optim.training``: ``Training.live_shards()`` gives the live keys).
    """
    assert slot in (0, 1), slot
    base = OPTIM_KEY_PREFIX + name
    suffix = "~1" if slot else ""
    return base + "/master" + suffix, base + "/exp_avg" + suffix, base + "/exp_avg_sq" + suffix


def staged_key(name: str) -> str:
    """Where a checkpoint load stages the fp32 master of the parameter called ``name`` when that
    parameter is its own master (``engine.optim.training``, [Note: One copy of fp32 weights]):
    ``optim/<name>/staged``, renamed to ``param/<name>`` once the load commits."""
    return OPTIM_KEY_PREFIX + name + "/staged"


def before_key(name: str, role: str) -> str:
    """Where an update inside backward keeps the value ``role`` ("param", "master", "exp_avg" or
    "exp_avg_sq") of the parameter called ``name`` had before the step, until the step commits or is
    rolled back: ``optim/<name>/before/<role>`` ([Note: Speculative updates], engine/optim/speculation.py)."""
    return f"{OPTIM_KEY_PREFIX}{name}/before/{role}"


def after_key(name: str, role: str) -> str:
    """Where the value ``role`` an update inside backward computed for the parameter called ``name``
    waits while a call between backward and step reads the values from before the step:
    ``optim/<name>/after/<role>``."""
    return f"{OPTIM_KEY_PREFIX}{name}/after/{role}"


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """One parameter as a flat, padded tensor split evenly across ``world`` ranks.

    Rank ``r`` owns elements ``[shard_offset, shard_offset + shard_numel)`` of the flattened
    parameter padded to ``padded_numel``; world size 1 is the case where the one shard is the
    whole parameter. The store holds each rank's shard in the parameter's own (training) dtype.

    Flattening is in memory order: the parameter is dense with strides ``stride`` (row-major for a
    contiguous parameter, but a channels-last or transposed one keeps its layout, so its kernels
    and their results do not change), and the flat tensor is its storage read front to back.
    A gradient with the same strides (autograd's layout contract) flattens the same way.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        assert self.world >= 1 and 0 <= self.rank < self.world, (self.rank, self.world)
        assert len(self.stride) == len(self.shape), (self.shape, self.stride)

    @classmethod
    def of(cls, param: torch.Tensor, *, rank: int = 0, world: int = 1) -> "ShardLayout":
        """The layout of ``param`` (dense, non-overlapping) for ``rank`` of ``world``."""
        assert is_dense(param), "parameters get dense storage before their layout is taken"
        return cls(tuple(param.shape), param.dtype, tuple(param.stride()), rank, world)

    def flat_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (laid out like the parameter, storage offset 0) as a 1-D view in memory order."""
        return tensor.as_strided((self.numel,), (1,), 0)

    def unflatten(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat tensor in memory order viewed with the parameter's shape and strides."""
        return flat.as_strided(self.shape, self.stride, 0)

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (materialized) parameter."""
        return self.numel * self.dtype.itemsize

    @property
    def shard_numel(self) -> int:
        """Elements of every rank's shard (padding included)."""
        return -(-self.numel // self.world)

    @property
    def padded_numel(self) -> int:
        """Elements of the flattened parameter padded to a multiple of ``world``."""
        return self.shard_numel * self.world

    @property
    def shard_offset(self) -> int:
        """Offset of this rank's shard in the padded flat parameter."""
        return self.rank * self.shard_numel

    @property
    def shard_nbytes(self) -> int:
        """Bytes of this rank's shard in the store."""
        return self.shard_numel * self.dtype.itemsize

    @property
    def is_whole(self) -> bool:
        """True when this rank's shard is the whole parameter (world size 1): no collective needed."""
        return self.world == 1


def rank_store_config(store: StoreConfig, rank: int, world: int) -> StoreConfig:
    """The store configuration of ``rank``: ``store`` itself at world size 1, else every directory
    (``path`` and each of ``nvme_paths``) with a ``rank{N}`` subdirectory, so ranks sharing a
    filesystem never share a store."""
    if world == 1:
        return store
    sub = f"rank{rank}"
    return store.replace(
        path=os.path.join(store.path, sub), nvme_paths=[os.path.join(p, sub) for p in store.nvme_paths or ()]
    )


def is_dense(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s elements fill ``numel`` consecutive storage slots with no overlap and no
    gaps (contiguous in some dimension order: row-major, channels-last, transposed, ...)."""
    if tensor.numel() <= 1:
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(tensor.shape, tensor.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True
