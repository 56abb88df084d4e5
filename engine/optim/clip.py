"""Global-norm gradient clipping over gradient shards in the store, computed exactly as
``torch.nn.utils.clip_grad_norm_`` computes it (2-norm, fp32, eps 1e-6).

Across ranks, each rank holds 1/world of every gradient; the global norm is the square root of the
sum over ranks of each rank's local sum of squares, which ``all_reduce`` supplies.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Mapping, Optional, Sequence

import torch

from engine.optim.step_io import AsyncTensorStore, IOCounter, drain, gather_all, plan_groups, run_sync
from engine.optim.types import OptimShard

#: Sums a 0-dim fp32 tensor (this rank's sum of squared gradient elements) over all ranks and
#: returns the global sum, e.g. ``lambda t: (dist.all_reduce(t), t)[1]``.
AllReduceSum = Callable[[torch.Tensor], torch.Tensor]

#: torch.nn.utils.clip_grad_norm_'s guard against division by zero.
CLIP_EPS = 1e-6


def shard_norms(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each gradient, as 0-dim fp32 tensors (torch's foreach norm, as clip_grad_norm_)."""
    if not grads:
        return []
    return list(torch._foreach_norm(list(grads), 2.0))


def total_norm(norms: Sequence[torch.Tensor], all_reduce: Optional[AllReduceSum] = None) -> torch.Tensor:
    """The global 2-norm from per-shard norms (in parameter order, for bit-exact parity).

    Without ``all_reduce`` this is clip_grad_norm_'s norm of the stacked norms; with it, the square
    root of the all-reduced local sum of squares. No norms at all (no gradients) give 0.
    """
    local = torch.linalg.vector_norm(torch.stack(list(norms)), 2.0) if norms else torch.tensor(0.0)
    if all_reduce is None:
        return local
    summed = all_reduce(local * local)
    if not isinstance(summed, torch.Tensor):
        raise TypeError(f"all_reduce must return a tensor, got {type(summed).__name__}")
    return summed.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(max_norm / (norm + 1e-6), 1) as a 0-dim tensor, the same expression clip_grad_norm_ uses."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_grad_norm must be a number > 0, got {max_norm!r}")
    coef = float(max_norm) / (norm + CLIP_EPS)
    return torch.clamp(coef, max=1.0)


async def grad_norms_async(
    store: AsyncTensorStore, shards: Sequence[OptimShard], *, group_bytes: int, io: Optional[IOCounter] = None
) -> dict[str, torch.Tensor]:
    """Read every gradient shard (one group ahead of the one being reduced) and return each present
    shard's 2-norm by name; shards without a gradient key are left out."""
    io = io if io is not None else IOCounter()
    groups = plan_groups(shards, group_bytes)

    async def read(group: list[OptimShard]) -> list[tuple[str, torch.Tensor]]:
        present = [s for s in group if s.grad_key in store]
        grads = await gather_all(io.get(store, s.grad_key) for s in present)
        return [(s.name, g) for s, g in zip(present, grads)]

    norms: dict[str, torch.Tensor] = {}
    ahead: Optional[asyncio.Task[list[tuple[str, torch.Tensor]]]] = None
    loop = asyncio.get_running_loop()
    try:
        ahead = asyncio.ensure_future(read(groups[0])) if groups else None
        for i in range(len(groups)):
            current = ahead
            assert current is not None
            ahead = asyncio.ensure_future(read(groups[i + 1])) if i + 1 < len(groups) else None
            loaded = await io.wait(current)
            values = await loop.run_in_executor(None, shard_norms, [g.float() for _, g in loaded])
            norms.update((name, n) for (name, _), n in zip(loaded, values))
    except BaseException:
        await drain([ahead], cancel=True)
        raise
    return norms


def grad_norms(store: AsyncTensorStore, shards: Sequence[OptimShard], *, group_bytes: int) -> dict[str, torch.Tensor]:
    """Blocking :func:`grad_norms_async`."""
    return run_sync(grad_norms_async(store, shards, group_bytes=group_bytes))


def global_grad_norm(
    norms: Mapping[str, torch.Tensor], shards: Sequence[OptimShard], all_reduce: Optional[AllReduceSum] = None
) -> torch.Tensor:
    """:func:`total_norm` of ``norms`` taken in the order of ``shards`` (names missing from
    ``norms`` had no gradient)."""
    return total_norm([norms[s.name] for s in shards if s.name in norms], all_reduce)
