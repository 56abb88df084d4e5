"""Collectives: one process group's collectives, issued in submission order on one worker thread.

Every rank must issue the same collectives in the same order (gloo and NCCL match them by their
position in the sequence). The engine's collectives come from several places: fetches started by
the prefetcher (non-blocking: the all-gather waits for the local shard to arrive from the store),
gradient reductions in backward, ``state_dict()`` and checkpoints. Issuing all of them from one
FIFO worker keeps the order in which the hooks submit them, which is the same on every rank as long
as every rank runs the same modules in the same order (docs/training.md, "Multiple processes"),
while the submitting thread goes on computing.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from engine.paging.distributed_init import launched_world_size

T = TypeVar("T")

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Collectives:
    """The engine's collectives over ``group`` (world size > 1), run one at a time in submission order.

    ``submit(fn, ...)`` queues ``fn`` to run on the worker and returns a future; the methods below
    are the collectives ``fn`` calls there (they block the worker, never the submitter). ``run`` is
    ``submit(...).result()``. Never call ``run`` from inside a submitted function (it would wait
    for itself).
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        assert self.world > 1, "world size 1 needs no collectives"
        # NCCL works on the current CUDA device: the worker takes the one current when the engine is made
        # (torchrun scripts call torch.cuda.set_device(local_rank) first).
        nccl = dist.get_backend(group) == "nccl"
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="engine-collectives",
            initializer=torch.cuda.set_device if nccl else None,
            initargs=(torch.cuda.current_device(),) if nccl else (),
        )
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> "concurrent.futures.Future[T]":
        """Queue ``fn(*args)`` behind every collective submitted before it; return its future."""
        if self._closed:
            raise RuntimeError("the engine's collectives were closed with the engine")
        return self._worker.submit(fn, *args)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in submission order; blocks until it has run and returns its result."""
        return self.submit(fn, *args).result()

    # ------------------------------------------------------------------ on the worker

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """Every rank's ``shard`` concatenated in rank order into ``out`` (``world`` x its numel);
        ``shard`` may be this rank's slice of ``out`` (in place, as FSDP does)."""
        _all_gather_single(out, shard, group=self.group)

    def ranks_where(self, flag: bool, device: torch.device) -> list[int]:
        """The ranks that passed ``flag=True``, in rank order (every rank learns the same list).
        ``device`` is where the collective runs: a CUDA device under NCCL."""
        flags = torch.zeros(self.world, dtype=torch.int32, device=device)
        _all_gather_single(flags, torch.tensor([int(flag)], dtype=torch.int32, device=device), group=self.group)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def reduce_scatter_mean(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        """The mean over ranks of ``flat`` (``world`` x ``out``'s numel), this rank's part into ``out``."""
        _reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.group)
        out.div_(self.world)

    def all_reduce_mean(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` by its mean over ranks (what DDP leaves in ``param.grad``): summed, then
        divided by the world size."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        tensor.div_(self.world)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` by its sum over ranks."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable, small: metadata only), in rank order."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Let queued collectives finish and stop the worker. Idempotent."""
        if not self._closed:
            self._closed = True
            self._worker.shutdown(wait=True)


def _check_not_launched() -> None:
    """Refuse to run unsharded in a process a launcher started as one of several: each rank would
    train its own copy of the model (or all would open one store and collide)."""
    world = launched_world_size()
    if world is not None and world > 1:
        raise ValueError(
            f"this process was launched as one of WORLD_SIZE={world} ranks, but torch.distributed is not "
            f"initialized: call torch.distributed.init_process_group(...) or engine.init_distributed() before "
            f"engine.wrap (engine.initialize does it itself; accelerate's Accelerator and the Trainer's "
            f"TrainingArguments join it when they are made, so make them first)"
        )


def group_rank_and_world(process_group: Optional[Any]) -> tuple[Any, int, int]:
    """The group the engine shards over, this process's rank in it and its size.

    ``process_group=None`` means the default group when ``torch.distributed`` is initialized, else
    no group (rank 0 of 1). A group of size 1 is returned as None: nothing to communicate.
    """
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            _check_not_launched()
            return None, 0, 1
        process_group = dist.group.WORLD
    try:
        world = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(
            f"process_group must be a torch.distributed ProcessGroup this process belongs to, got {process_group!r}: "
            f"{exc}"
        ) from exc
    if rank < 0:
        raise ValueError(f"this process is not a member of process_group {process_group!r}; pass a group it is in")
    return (process_group if world > 1 else None), rank, world
