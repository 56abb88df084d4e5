"""Every rank starts from rank 0's values: :func:`take_rank0_values`.

Each rank keeps 1/world of every parameter, cut from its own copy of the model, so ranks whose
copies differ (seeded differently, or weights loaded on rank 0 only, a pattern DDP allows because
it broadcasts rank 0's state at construction) would assemble parameters from different models
without a word. Before placing, the ranks compare a CRC-32 of each materialized parameter and
buffer; where any differs, rank 0's value is broadcast to all, as DDP and DeepSpeed's
``zero.Init`` do, and a warning names what differed. Parameters still on the meta device are
initialized later, each rank cutting its shard from a whole tensor it draws itself: under
:func:`rank0_random_state` every rank draws from rank 0's random state, so ranks seeded apart
(accelerate's ``set_seed(device_specific=True)``) still assemble one model, the one a single
process seeded as rank 0 would have made.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from engine.io.safetensors_stream import tensor_bytes
from engine.paging.collectives import Collectives
from tiered.util import crc32


def take_rank0_values(model: nn.Module, collectives: Collectives) -> list[str]:
    """Make every materialized parameter and buffer of ``model`` equal to rank 0's on every rank;
    return the names of those that differed (the same list on every rank), after warning of them."""
    tensors: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers()):
        if tensor.device.type != "meta" and id(tensor) not in tensors:
            tensors[id(tensor)] = (name, tensor)
    entries = list(tensors.values())
    mine = [_fingerprint(t) for _, t in entries]
    everyone = collectives.run(collectives.all_gather_object, mine)
    if any(len(theirs) != len(mine) for theirs in everyone):
        raise ValueError(f"the ranks' models have different numbers of materialized parameters and buffers "
                         f"({[len(theirs) for theirs in everyone]}): build the same model on every rank")
    differing = [i for i in range(len(entries)) if any(theirs[i] != everyone[0][i] for theirs in everyone[1:])]
    if not differing:
        return []
    with torch.no_grad():
        for i in differing:
            collectives.run(_broadcast_from_rank0, entries[i][1], collectives)
    names = [entries[i][0] for i in differing]
    warnings.warn(
        f"{len(names)} parameters and buffers differed between the ranks' models at wrap: {names[:10]}"
        f"{' ...' if len(names) > 10 else ''}; every rank now has rank 0's values, as DDP and DeepSpeed's "
        "zero.Init broadcast them (seed every rank alike, or load the weights on every rank, to silence this)",
        UserWarning, stacklevel=4)
    return names


@contextlib.contextmanager
def rank0_random_state(collectives: Collectives, device: torch.device) -> Iterator[None]:
    """Inside, every rank's CPU generator (and ``device``'s, on CUDA) continues from rank 0's state;
    after, each rank has its own back. Where the states already agree (every rank seeded alike),
    nothing changes: the draws advance each rank's own generator, as in one process."""
    devices = [device] if device.type == "cuda" else []
    mine = [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]
    everyone = collectives.run(collectives.all_gather_object, [bytes(s.numpy()) for s in mine])
    if all(theirs == everyone[0] for theirs in everyone[1:]):
        yield
        return
    with torch.random.fork_rng(devices=devices):
        rank0 = [torch.frombuffer(bytearray(state), dtype=torch.uint8) for state in everyone[0]]
        torch.set_rng_state(rank0[0])
        for d, state in zip(devices, rank0[1:]):
            torch.cuda.set_rng_state(state, d)
        yield


def _fingerprint(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], int]:
    data = tensor_bytes(tensor)
    return str(tensor.dtype), tuple(tensor.shape), crc32([data], len(data))


def _broadcast_from_rank0(tensor: torch.Tensor, collectives: Collectives) -> None:
    data = tensor.detach()
    staged = data.contiguous()  # the tensor itself when it already is
    dist.broadcast(staged, src=dist.get_global_rank(collectives.group, 0), group=collectives.group)
    if staged is not data:
        data.copy_(staged)


__all__ = ["rank0_random_state", "take_rank0_values"]
