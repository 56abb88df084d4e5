"""Gathered: a wrapped model's full parameters in memory for a ``with`` block (``eng.gathered()``).

What DeepSpeed's ``zero.GatheredParameters`` and FSDP's ``summon_full_params`` do: every selected
parameter is fetched (all-gathered across ranks at world size > 1) and held, so it can be read,
printed, saved or changed like a plain tensor; on exit it is released again. Changes are kept only
when asked for: ``writeback=True`` writes every selected parameter back to the store (each rank its
own shard of its own copy, so every rank must make the same change), and ``modifier_rank=r`` first
broadcasts rank ``r``'s values to every rank and then writes them back (only rank ``r`` needs to
change anything). With ``engine.AdamW`` the fp32 master weights of written parameters are set from
the new values too, so the next step starts from them. Without either, changes are discarded.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from engine.paging.handle import HandleState, ParamHandle
from engine.paging.pager import Pager
from engine.paging.shard_io import ShardIO

ParamsArg = Union[None, nn.Parameter, nn.Module, Iterable[nn.Parameter]]


def select_handles(
    params: ParamsArg, by_id: dict[int, ParamHandle], all_handles: Sequence[ParamHandle]
) -> list[ParamHandle]:
    """The handles of ``params``: None (every managed parameter), one parameter, a module (its
    parameters) or an iterable of parameters; each handle once, in the order given."""
    if params is None:
        chosen: Iterable[Any] = all_handles
        return list(dict.fromkeys(chosen))
    if isinstance(params, nn.Module):
        params = list(params.parameters())
    elif isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise TypeError(
            f"params must be None, an nn.Parameter, an nn.Module or an iterable of parameters, got "
            f"{type(params).__name__}"
        )
    handles: dict[ParamHandle, None] = {}
    for param in params:
        handle = by_id.get(id(param))
        if handle is None:
            what = f"a {type(param).__name__}" if not isinstance(param, torch.Tensor) else f"shape {tuple(param.shape)}"
            raise ValueError(
                f"eng.gathered() got a parameter this engine does not manage ({what}); pass parameters of the "
                "wrapped model (or None for all of them)"
            )
        handles[handle] = None
    return list(handles)


def check_modifier_rank(modifier_rank: Optional[int], world: int) -> None:
    """``modifier_rank`` must be None or a rank of the engine's group."""
    if modifier_rank is None:
        return
    if isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int) or not 0 <= modifier_rank < world:
        raise ValueError(f"modifier_rank must be None or a rank in [0, {world}), got {modifier_rank!r}")


@contextlib.contextmanager
def gathered(
    handles: list[ParamHandle],
    pager: Pager,
    io: ShardIO,
    *,
    writeback: bool,
    modifier_rank: Optional[int],
    after_write: Any = None,
) -> Iterator[list[nn.Parameter]]:
    """Hold ``handles`` materialized for the block; see the module docstring. ``after_write(handles)``
    runs after a write-back (the engine refreshes ``engine.AdamW``'s master weights there)."""
    pager.materialize(handles)  # a collective at world size > 1: every rank gathers the same parameters
    try:
        yield [h.param for h in handles]
        _restore_storage(handles)
        if modifier_rank is not None and io.world > 1:
            _broadcast(io, handles, modifier_rank)
        if writeback or modifier_rank is not None:
            pager.write_back(handles)
            if after_write is not None:
                after_write(handles)
        else:
            _discard_changes(handles)
    except BaseException:
        _discard_changes(handles)
        raise
    finally:
        with pager.lock:
            for handle in handles:
                pager.release(handle)


def _restore_storage(handles: list[ParamHandle]) -> None:
    """``param.data = new`` inside the block (what some loading code does): copy the new values into
    the parameter's own storage, which the engine pages, and point the parameter back at it."""
    for handle in handles:
        param = handle.param
        if param.untyped_storage()._cdata == handle.storage_id and param.stride() == handle.layout.stride:
            continue
        if tuple(param.shape) != handle.layout.shape or param.dtype != handle.layout.dtype:
            replaced_by = (tuple(param.shape), param.dtype)
            param.data = handle.layout.unflatten(handle.flat)  # the engine's storage again, values unchanged
            raise ValueError(
                f"parameter {handle.name!r} was replaced inside eng.gathered() by a tensor of shape "
                f"{replaced_by[0]} and dtype {replaced_by[1]}; the engine keeps shape {handle.layout.shape} and "
                f"dtype {handle.layout.dtype}: change values in place (param.copy_(new)) instead"
            )
        own = handle.layout.unflatten(handle.flat)
        with torch.no_grad():
            own.copy_(param.detach())
        param.data = own


def _discard_changes(handles: list[ParamHandle]) -> None:
    """Read-only block: the store keeps its values (release frees the storage without writing back)."""
    for handle in handles:
        if handle.state is HandleState.READY:
            handle.synced = handle.version


def _broadcast(io: ShardIO, handles: list[ParamHandle], src: int) -> None:
    """Every rank's copies of ``handles`` become rank ``src``'s (in the engine's collective order)."""
    comm = io.collectives
    assert comm is not None
    group = comm.group
    global_src = dist.get_global_rank(group, src)

    def run() -> None:
        for handle in handles:
            dist.broadcast(handle.flat, global_src, group=group)

    comm.run(run)
