"""The offloaded AdamW step: shard groups streamed through torch's CPU AdamW math, pipelined.

```
group:    0        1        2        3
read     [r0][r1    ][r2    ][r3    ]              one group read ahead
update       [u0    ][u1    ][u2    ][u3    ]      AdamW on a worker thread
write             [w0    ][w1    ][w2    ][w3    ] master, exp_avg, exp_avg_sq, new param shard
```

While group i is updated, group i+1 is being read and group i-1 written, so at most three groups
of (gradient + master + two moments + new training-dtype shard) are in memory. The math is torch's
own functional AdamW (``torch.optim.adamw.adamw``) with the caller's ``foreach``/``fused`` choice,
or, on the single-tensor path, the caller's one-pass kernel of the same arithmetic
([Note: One-pass AdamW], engine/optim/adamw_kernel.py), so results equal ``torch.optim.AdamW`` on
the same tensors bit for bit.

State is created lazily: a shard's first step (its step count is 0) takes its fp32 master from its
training-dtype ``param_key`` shard and starts from zero moments (as torch creates
``exp_avg``/``exp_avg_sq`` at the first step); :func:`init_state` creates them ahead instead. A
shard whose master is its parameter (``OptimShard.master_is_param``) writes the new master once, as
the parameter, together with its moments.

``atomic=True`` (state on nvme) writes each group's new state (master, moments) with one
``put_many(atomic=True)``, together with the entry ``progress`` names for the group: after a crash a
group is wholly updated and marked done, or untouched. The engine builds its single-copy commit on
that ([Note: Rolling a step forward], engine/optim/training.py).

``in_place=True`` (state in host memory) replaces the read and the write of master and moments by
``store.modify`` blocks: the math runs on the store's own memory, held from the group's read to its
write, and with ``param_tier="host"`` the new training-dtype shard is cast straight into its entry
too. A gradient held in host memory is lent the same way and only read: unscaling and clipping
write new tensors, so the stored gradients stay as they were, as with a copy. Nothing is copied
(state the store wrote down to nvme, after a resume say, is read and put back to host memory; a
gradient on nvme is read); the price is that a step failing part way leaves the groups before the
failure updated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
from torch.optim.adamw import adamw as _torch_adamw

from engine.errors import OptimizerStateError
from engine.optim.adamw_kernel import AdamWKernel
from engine.optim.clip import AllReduceSum, clip_coefficient, global_grad_norm, grad_norms_async
from engine.optim.step_io import (
    AsyncTensorStore,
    IOCounter,
    ModifyBlocks,
    blocking,
    check_shards,
    drain,
    gather_all,
    plan_groups,
)
from engine.optim.types import AdamHyper, OptimShard, OptimStepStats
from engine.paging.memory_plan import MATH_CHUNK_BYTES
from tiered import Tier

MiB = 1024 * 1024
#: Chunks of the AdamW math start at multiples of this many elements ([Note: Chunked AdamW math]).
MATH_CHUNK_ALIGN = 4096
STATE_TIERS = ("host", "nvme")
PARAM_TIERS = ("device", "host", "nvme")

#: Called as ``on_event(event, group_index)`` with event "read" and "write" (on the step's event
#: loop, when the group's transfers start) and "update" (on the worker thread, before the math).
EventHook = Callable[[str, int], None]
#: Called with the names of a group's updated shards; returns a (key, tensor) entry the group's
#: state write commits with them (a mark that the group is done).
ProgressHook = Callable[[list[str]], tuple[str, torch.Tensor]]


@dataclasses.dataclass
class _Loaded:
    """One shard of a group while it goes through the pipeline."""

    shard: OptimShard
    grad: torch.Tensor
    step: torch.Tensor
    master: Optional[torch.Tensor] = None  # None until created from `param` (first step)
    exp_avg: Optional[torch.Tensor] = None
    exp_avg_sq: Optional[torch.Tensor] = None
    param: Optional[torch.Tensor] = None  # training-dtype shard read at the first step, then the new one
    in_place: bool = False  # master and moments are the store's memory (modify blocks): nothing to write
    grad_lent: bool = False  # grad is the store's memory (a modify block): read it, never change it
    param_entry: Optional[torch.Tensor] = None  # the param entry's memory, to cast the new shard into


async def step_async(
    store: AsyncTensorStore,
    shards: Sequence[OptimShard],
    hypers: Union[AdamHyper, Sequence[AdamHyper]],
    steps: Mapping[str, int],
    *,
    state_tier: str = "nvme",
    param_tier: str = "nvme",
    compress: bool = False,
    group_bytes: int = 64 * MiB,
    max_grad_norm: Optional[float] = None,
    grad_norms: Optional[Mapping[str, torch.Tensor]] = None,
    all_reduce: Optional[AllReduceSum] = None,
    on_event: Optional[EventHook] = None,
    grad_scale: float = 1.0,
    grad_norm: Optional[torch.Tensor] = None,
    in_place: bool = False,
    math_chunk_bytes: int = MATH_CHUNK_BYTES,
    clip_coef: Optional[torch.Tensor] = None,
    atomic: bool = False,
    progress: Optional[ProgressHook] = None,
    keep: Optional[str] = None,
    kernel: Optional[AdamWKernel] = None,
) -> OptimStepStats:
    """One AdamW step over ``shards`` in the store; returns what it did and cost.

    ``hypers[shard.group]`` are the shard's hyperparameters; ``steps`` maps shard names to the
    updates each has taken so far (missing: 0). State goes to ``state_tier`` (compressed on nvme
    when ``compress``), the new training-dtype shard to ``param_tier``. With ``max_grad_norm`` the
    gradients are first clipped to that global 2-norm exactly as ``clip_grad_norm_`` does; the
    norm comes from ``grad_norms`` (per-shard 2-norms, if the caller already has them) or from an
    extra pipelined pass over the gradient shards, summed across ranks by ``all_reduce``. Pass
    shards in the model's parameter order for bit-exact parity of the norm. Gradient shards are
    left in the store (zeroing them is the caller's business).

    ``grad_scale`` multiplies every gradient before clipping and the update: the inverse of a loss
    scale (``engine/optim/loss_scaler.py``), as ``GradScaler.unscale_`` does. ``grad_norm`` is the global
    norm of the gradients as stored (before ``grad_scale``), when the caller has it already.

    ``in_place`` updates master and moments where they lie (see the module docstring): needs
    ``state_tier="host"`` and shards without ``state_out_keys``.

    ``math_chunk_bytes``: torch's AdamW runs over at most this many fp32 bytes of each tensor per
    call, so its temporaries stay that small ([Note: Chunked AdamW math]).

    ``clip_coef`` (a 0-dim fp32 tensor) multiplies every gradient after ``grad_scale``, in place of
    a coefficient computed from ``max_grad_norm`` (a step redone with the coefficient it recorded).
    ``atomic`` writes each group's new state in one all-or-nothing store call, with the entry
    ``progress`` returns for the group (see the module docstring): needs ``state_tier="nvme"``. A
    shard whose master is its parameter needs ``param_tier == state_tier``. ``keep`` (a tier faster
    than the one written) offers the store clean copies of what the step writes, to keep where its
    eviction policy finds them worth it (a parameter read again in the next forward). ``kernel``:
    the one-pass AdamW for the groups it applies to ([Note: One-pass AdamW]); torch's function for
    the others and without one (the same bits).
    """
    started = time.perf_counter()
    hyper_list = _check_step_arguments(shards, hypers, state_tier, param_tier, math_chunk_bytes, in_place, atomic,
                                       grad_scale)
    counts = {s.name: _step_count(steps, s.name) for s in shards}
    groups = plan_groups(shards, group_bytes)
    io = IOCounter()
    norm, coef = await _clip_coefficient(store, shards, group_bytes, io, max_grad_norm, grad_norms, all_reduce,
                                         grad_scale, grad_norm, clip_coef)
    pipeline = _Pipeline(store, groups, counts, io, state_tier=state_tier, param_tier=param_tier,
                         compress=True if compress else None, in_place=in_place, atomic=atomic, progress=progress,
                         keep=keep, on_event=on_event)
    updated, update_seconds = await pipeline.run(hyper_list, grad_scale, coef, math_chunk_bytes // 4, kernel)
    return OptimStepStats(
        seconds=time.perf_counter() - started,
        bytes_read=io.bytes_read,
        bytes_written=io.bytes_written,
        io_stall_seconds=io.stall_seconds,
        update_seconds=update_seconds,
        groups=len(groups),
        shards_updated=updated,
        shards_skipped=len(shards) - updated,
        grad_norm=None if norm is None else float(norm),
        clip_coef=None if coef is None else float(coef),
        step_counts=types.MappingProxyType(counts),
    )


def _check_step_arguments(shards: Sequence[OptimShard], hypers: Union[AdamHyper, Sequence[AdamHyper]],
                          state_tier: str, param_tier: str, math_chunk_bytes: int, in_place: bool, atomic: bool,
                          grad_scale: float) -> list[AdamHyper]:
    """Check :func:`step_async`'s arguments (TypeError / ValueError naming the value); the
    hyperparameters as a list."""
    hyper_list = [hypers] if isinstance(hypers, AdamHyper) else list(hypers)
    if not hyper_list or not all(isinstance(h, AdamHyper) for h in hyper_list):
        raise TypeError(f"hypers must be an AdamHyper or a non-empty sequence of them, got {hypers!r}")
    _check_tier("state_tier", state_tier, STATE_TIERS)
    _check_tier("param_tier", param_tier, PARAM_TIERS)
    check_shards(shards, len(hyper_list))
    if (isinstance(math_chunk_bytes, bool) or not isinstance(math_chunk_bytes, int) or math_chunk_bytes < 1
            or math_chunk_bytes % (4 * MATH_CHUNK_ALIGN)):
        raise ValueError(f"math_chunk_bytes must be a positive multiple of {4 * MATH_CHUNK_ALIGN}, got "
                         f"{math_chunk_bytes!r}")
    if in_place:
        _check_in_place(shards, state_tier)
    if atomic and state_tier != "nvme":
        raise ValueError(f"atomic=True commits each group on nvme; state_tier must be 'nvme', got {state_tier!r}")
    if param_tier != state_tier and any(s.master_is_param for s in shards):
        raise ValueError(f"a shard whose master is its parameter keeps both in one tier, but param_tier is "
                         f"{param_tier!r} and state_tier {state_tier!r}")
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) or not grad_scale > 0:
        raise ValueError(f"grad_scale must be a number > 0, got {grad_scale!r}")
    return hyper_list


async def _clip_coefficient(
    store: AsyncTensorStore, shards: Sequence[OptimShard], group_bytes: int, io: IOCounter,
    max_grad_norm: Optional[float], grad_norms: Optional[Mapping[str, torch.Tensor]],
    all_reduce: Optional[AllReduceSum], grad_scale: float, grad_norm: Optional[torch.Tensor],
    clip_coef: Optional[torch.Tensor],
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The global norm (unscaled) and the clip coefficient the step multiplies the gradients by: the one
    given, or from ``max_grad_norm`` (reading the gradients for their norms when nobody has them); (None,
    None) without clipping."""
    if clip_coef is not None:
        return None, clip_coef
    if max_grad_norm is None:
        return None, None
    if grad_norm is None:
        norms = grad_norms if grad_norms is not None else await grad_norms_async(
            store, shards, group_bytes=group_bytes, io=io
        )
        grad_norm = global_grad_norm(norms, shards, all_reduce)
    # A power-of-two scale scales the norm exactly: this is the norm of the unscaled gradients.
    norm = grad_norm * grad_scale if grad_scale != 1.0 else grad_norm
    return norm, clip_coefficient(norm, max_grad_norm)


class _Pipeline:
    """One step's groups through read, update and write, each stage a group ahead of the next (see the
    module docstring)."""

    def __init__(self, store: AsyncTensorStore, groups: list[list[OptimShard]], counts: dict[str, int],
                 io: IOCounter, *, state_tier: str, param_tier: str, compress: Optional[bool], in_place: bool,
                 atomic: bool, progress: Optional[ProgressHook], keep: Optional[str],
                 on_event: Optional[EventHook]) -> None:
        self._store, self._groups, self._counts, self._io = store, groups, counts, io
        self._state_tier, self._param_tier, self._compress = state_tier, param_tier, compress
        self._in_place, self._atomic, self._progress, self._keep = in_place, atomic, progress, keep
        self._on_event = on_event
        # In place: each group's modify blocks, open from its read until its write has ended them.
        self._open_blocks: dict[int, ModifyBlocks] = {}

    async def run(self, hypers: list[AdamHyper], grad_scale: float, coef: Optional[torch.Tensor],
                  chunk_elems: int, kernel: Optional[AdamWKernel]) -> tuple[int, float]:
        """Read, update and write every group; returns the shards updated and the seconds of AdamW's math."""
        loop = asyncio.get_running_loop()
        updated = 0
        update_seconds = 0.0
        reading: Optional[asyncio.Future[list[_Loaded]]] = None
        writing: Optional[asyncio.Future[None]] = None
        try:
            reading = self._start_read(0) if self._groups else None
            for i in range(len(self._groups)):
                current = reading
                assert current is not None
                reading = self._start_read(i + 1) if i + 1 < len(self._groups) else None
                loaded = await self._io.wait(current)
                t0 = time.perf_counter()
                await loop.run_in_executor(None, _update, loaded, hypers, grad_scale, coef, self._on_event, i,
                                           chunk_elems, kernel)
                update_seconds += time.perf_counter() - t0
                if writing is not None:
                    await self._io.wait(writing)
                writing = self._start_write(i, loaded)
                for item in loaded:
                    self._counts[item.shard.name] = int(item.step.item())
                updated += len(loaded)
                del loaded, current
            if writing is not None:
                await self._io.wait(writing)
        except BaseException:
            await self._drain(reading, writing)
            raise
        return updated, update_seconds

    def _start_read(self, i: int) -> "asyncio.Future[list[_Loaded]]":
        if self._on_event is not None:
            self._on_event("read", i)
        blocks = None
        if self._in_place:
            blocks = self._open_blocks[i] = ModifyBlocks()
        return asyncio.ensure_future(_read_group(self._store, self._groups[i], self._counts, self._io, blocks,
                                                 self._param_tier))

    def _start_write(self, i: int, loaded: list[_Loaded]) -> "asyncio.Future[None]":
        if self._on_event is not None:
            self._on_event("write", i)
        return asyncio.ensure_future(_write_group(
            self._store, loaded, self._io, self._state_tier, self._param_tier, self._compress,
            self._open_blocks.pop(i, None), atomic=self._atomic, progress=self._progress, keep=self._keep,
        ))

    async def _drain(self, reading: "Optional[asyncio.Future[list[_Loaded]]]",
                     writing: "Optional[asyncio.Future[None]]") -> None:
        """After an error: reads in flight are dropped; a write already started runs to its end
        (cancelling it could leave a shard with only some of its four tensors written). A read that
        opens modify blocks runs to its end too, so that every block it opened is known and ended here."""
        await drain([reading], cancel=not self._in_place)
        await drain([writing], cancel=False)
        await drain([asyncio.ensure_future(blocks.close()) for blocks in self._open_blocks.values()], cancel=False)


#: Blocking :func:`step_async`, for ``eng.step()``: the same arguments, run on a private event loop.
step = blocking(step_async)


async def init_state_async(
    store: AsyncTensorStore,
    shards: Sequence[OptimShard],
    *,
    state_tier: str = "nvme",
    compress: bool = False,
    group_bytes: int = 64 * MiB,
) -> int:
    """Create the fp32 master (from ``param_key``; none for a shard that is its own master) and zero
    moments of every shard that has no ``exp_avg`` in the store yet, one group at a time; returns how
    many shards it initialized.

    Optional: :func:`step_async` does the same lazily at a shard's first step.
    """
    _check_tier("state_tier", state_tier, STATE_TIERS)
    check_shards(shards, max((s.group for s in shards), default=0) + 1)
    io = IOCounter()
    loop = asyncio.get_running_loop()
    state_compress = True if compress else None
    created = 0
    for group in plan_groups([s for s in shards if s.exp_avg_key not in store], group_bytes):
        params = await gather_all(io.get(store, s.param_key) for s in group)
        states = await loop.run_in_executor(None, _initial_state, group, params)
        await gather_all(
            io.put(store, key, tensor, state_tier, state_compress)
            for s, (master, zeros) in zip(group, states)
            for key, tensor in ((s.master_key, master), (s.exp_avg_key, zeros), (s.exp_avg_sq_key, zeros))
            if key != s.param_key
        )
        created += len(group)
    return created


#: Blocking :func:`init_state_async`: the same arguments, run on a private event loop.
init_state = blocking(init_state_async)


def update_in_memory(
    shards: Sequence[OptimShard], grads: Sequence[torch.Tensor], masters: Sequence[torch.Tensor],
    moments: Sequence[Optional[tuple[torch.Tensor, torch.Tensor]]], steps: Sequence[int],
    hypers: Sequence[AdamHyper], *, grad_scale: float = 1.0, grads_shared: Optional[Sequence[bool]] = None,
    kernel: Optional[AdamWKernel] = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """torch's AdamW math on shards held in memory (the updates inside backward,
    ``engine/optim/backward_step.py``), as the pipelined step computes it: ``masters`` (flat fp32)
    are updated in place; returns each shard's new (exp_avg, exp_avg_sq), its ``moments`` pair
    updated in place, or new ones made from zeros at a shard's first step (None), as torch makes
    them. ``steps[i]`` is the updates shard i has taken so far; ``hypers`` holds the
    hyperparameters of every parameter group. The gradients are multiplied by ``grad_scale`` first
    (1 / loss scale, as ``GradScaler.unscale_``), in place unless ``grads_shared[i]`` says another
    user still reads gradient i. ``kernel`` as for :func:`step_async`. ValueError for mismatched
    lengths or sizes."""
    if not len(shards) == len(grads) == len(masters) == len(moments) == len(steps):
        raise ValueError("update_in_memory takes one gradient, master, moments pair and step count per shard")
    loaded = []
    for shard, grad, master, pair, count in zip(shards, grads, masters, moments, steps):
        exp_avg, exp_avg_sq = pair if pair is not None else (torch.zeros_like(master), torch.zeros_like(master))
        for what, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if t.dtype != torch.float32 or t.numel() != shard.numel:
                raise ValueError(f"shard {shard.name!r}: {what} is {t.dtype} with {t.numel()} elements, expected "
                                 f"torch.float32 with {shard.numel}")
        loaded.append(_Loaded(shard, _flat_grad(shard, grad), torch.tensor(float(count), dtype=torch.float32),
                              master.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)))
    for item, shared in zip(loaded, grads_shared or ()):
        item.grad_lent = shared
    _update(loaded, list(hypers), grad_scale, None, None, -1, MATH_CHUNK_BYTES // 4, kernel)
    return [(item.exp_avg, item.exp_avg_sq) for item in loaded]  # type: ignore[misc]


# ---------------------------------------------------------------------------------------- pipeline


async def _read_group(
    store: AsyncTensorStore, group: list[OptimShard], counts: Mapping[str, int], io: IOCounter,
    blocks: Optional[ModifyBlocks], param_tier: str,
) -> list[_Loaded]:
    """Start every read of the group's shards that have a gradient, and wait for them all (with
    ``blocks``, open modify blocks on master and moments instead of reading them)."""

    async def load(shard: OptimShard) -> _Loaded:
        count = counts[shard.name]
        step_t = torch.tensor(float(count), dtype=torch.float32)
        if blocks is not None and shard.exp_avg_key in store and shard.master_key in store:
            return await _load_in_place(store, shard, step_t, io, blocks, param_tier)
        if not count:  # the first step: the master is the parameter upcast, the moments zeros (as torch)
            grad, param = await gather_all(io.get(store, k) for k in (shard.grad_key, shard.param_key))
            if param.numel() != shard.numel:
                raise OptimizerStateError(
                    f"shard {shard.name!r}: {shard.param_key!r} holds {param.numel()} elements, expected {shard.numel}"
                )
            return _Loaded(shard, _flat_grad(shard, grad), step_t, param=param.view(-1))
        missing = [k for k in (shard.master_key, shard.exp_avg_key, shard.exp_avg_sq_key) if k not in store]
        if missing:
            raise OptimizerStateError(
                f"shard {shard.name!r} has taken {count} steps, but its optimizer state {missing[0]!r} is not in "
                "the store; restore the optimizer state before stepping"
            )
        grad, master, exp_avg, exp_avg_sq = await gather_all(
            io.get(store, k) for k in (shard.grad_key, shard.master_key, shard.exp_avg_key, shard.exp_avg_sq_key)
        )
        for what, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            _check_state(shard, what, t)
        return _Loaded(shard, _flat_grad(shard, grad), step_t, master.view(-1), exp_avg.view(-1),
                       exp_avg_sq.view(-1))

    return await gather_all(load(s) for s in group if s.grad_key in store)


async def _load_in_place(store: AsyncTensorStore, shard: OptimShard, step_t: torch.Tensor, io: IOCounter,
                          blocks: ModifyBlocks, param_tier: str) -> _Loaded:
    """A shard whose master and moments the update changes where they lie (in-place steps)."""
    keys = (shard.master_key, shard.exp_avg_key, shard.exp_avg_sq_key)
    # A block on a gradient held only on nvme would write it back on exit: that one is read instead.
    lend_grad = store.info(shard.grad_key).tiers[0] is Tier.HOST
    read_grad = io.modify(blocks, store, shard.grad_key, None) if lend_grad else io.get(store, shard.grad_key)
    grad, *state = await gather_all([read_grad, *(io.modify(blocks, store, k, "host") for k in keys)])
    for what, t in zip(("master", "exp_avg", "exp_avg_sq"), state):
        _check_state(shard, what, t)
    item = _Loaded(shard, _flat_grad(shard, grad), step_t, *(t.view(-1) for t in state), in_place=True,
                   grad_lent=lend_grad)
    if param_tier == "host" and shard.param_key in store and not shard.master_is_param:
        param = await io.modify(blocks, store, shard.param_key, "host")
        if param.numel() != shard.numel or param.dtype != shard.train_dtype:
            raise OptimizerStateError(
                f"shard {shard.name!r}: {shard.param_key!r} in the store is {param.dtype} with {param.numel()} "
                f"elements, expected {shard.train_dtype} with {shard.numel}"
            )
        item.param_entry = param.view(-1)
    return item


def _update(loaded: list[_Loaded], hypers: list[AdamHyper], grad_scale: float, coef: Optional[torch.Tensor],
            on_event: Optional[EventHook], index: int, chunk_elems: int, kernel: Optional[AdamWKernel]) -> None:
    """The AdamW math of one group, in place (runs on a worker thread)."""
    if on_event is not None:
        on_event("update", index)
    with torch.no_grad():
        for item in loaded:
            if item.master is None:  # first step: state as torch creates it
                assert item.param is not None
                item.master = item.param.to(torch.float32)
                item.exp_avg = torch.zeros_like(item.master)
                item.exp_avg_sq = torch.zeros_like(item.master)
        _unscale_and_clip(loaded, grad_scale, coef)
        for g, hyper in enumerate(hypers):
            members = [item for item in loaded if item.shard.group == g]
            if not members:
                continue
            if kernel is not None and all(kernel.applies(hyper, _tensors(m)) for m in members):
                for m in members:
                    kernel.step(*_tensors(m), m.step, hyper)
            else:
                _adamw_in_chunks(members, hyper, chunk_elems)
        for item in loaded:
            assert item.master is not None
            dtype = item.shard.train_dtype
            if item.shard.master_is_param:
                item.param = None  # written once, as the master
            elif item.param_entry is not None:
                item.param_entry.copy_(item.master)  # the same rounding as .to(dtype)
            else:
                item.param = item.master if dtype == torch.float32 else item.master.to(dtype)


# [Note: Chunked AdamW math]
# torch's AdamW makes temporaries the size of what it is given: the single-tensor path two tensors of
# a parameter at once (``exp_avg_sq.sqrt() / bias_correction``), the foreach path one per tensor of
# the call. A shard of a 32000 x 2560 embedding would take 625 MiB of them on top of the group. So
# each tensor is cut into consecutive pieces of at most ``chunk_elems`` elements and torch's
# function is called once per run of pieces totalling at most that many: the temporaries are then
# at most two chunks. The math is elementwise, so every element gets the bits one call over the
# whole tensors gives, provided every piece starts at a multiple of the vector width (the fused and
# vectorized kernels treat a tensor's last few elements apart): pieces are multiples of
# MATH_CHUNK_ALIGN elements. Each piece gets its own copy of the shard's step count (the function
# adds one to the count of every tensor it is given), and the shard keeps the first one's. Chunks are
# smaller than glibc's mmap threshold as wrap sets it: larger temporaries would each be a new mapping,
# every page faulted in and zeroed by the kernel, a fault per 4 KiB of the state each step (measured on
# a 256 MiB shard on 2 cores: 512 KiB chunks run 1.7x faster than 16 MiB ones, and fault no page).


def _tensors(item: _Loaded) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``item``'s master, gradient and moments, the tensors AdamW reads and updates."""
    assert item.master is not None and item.exp_avg is not None and item.exp_avg_sq is not None
    return item.master, item.grad, item.exp_avg, item.exp_avg_sq


def _adamw_in_chunks(members: list[_Loaded], hyper: AdamHyper, chunk_elems: int) -> None:
    """torch's AdamW over ``members`` (one hyperparameter group), ``chunk_elems`` elements at a time."""
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for m in members:
        assert m.master is not None and m.exp_avg is not None and m.exp_avg_sq is not None
        n = m.master.numel()
        for lo in range(0, n, chunk_elems):
            hi = min(n, lo + chunk_elems)
            step = m.step if lo == 0 else m.step.clone()  # the shard keeps the first piece's count
            pieces.append((m.master[lo:hi], m.grad[lo:hi], m.exp_avg[lo:hi], m.exp_avg_sq[lo:hi], step))
    start = 0
    while start < len(pieces):
        end, size = start, 0
        while end < len(pieces) and (end == start or size + pieces[end][0].numel() <= chunk_elems):
            size += pieces[end][0].numel()
            end += 1
        run = pieces[start:end]
        _torch_adamw(
            [p[0] for p in run], [p[1] for p in run], [p[2] for p in run], [p[3] for p in run], [],
            [p[4] for p in run],
            foreach=hyper.foreach,
            fused=hyper.fused,
            amsgrad=False,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            lr=hyper.lr,
            weight_decay=hyper.weight_decay,
            eps=hyper.eps,
            maximize=False,
        )
        start = end


def _unscale_and_clip(loaded: list[_Loaded], grad_scale: float, coef: Optional[torch.Tensor]) -> None:
    """Multiply the group's gradients by ``grad_scale``, then by the clip coefficient, as
    ``GradScaler.unscale_`` and ``clip_grad_norm_`` do. A lent gradient is the store's memory, so
    the first multiply then writes new tensors (the same foreach kernel: the same bits)."""
    factors: list[Union[float, torch.Tensor]] = ([grad_scale] if grad_scale != 1.0 else []) + (
        [coef] if coef is not None else [])
    grads = [item.grad for item in loaded]
    if not factors or not grads:
        return
    if any(item.grad_lent for item in loaded):
        grads = list(torch._foreach_mul(grads, factors.pop(0)))
    for factor in factors:
        torch._foreach_mul_(grads, factor)
    for item, grad in zip(loaded, grads):
        item.grad = grad


def _faster(keep: Optional[str], tier: str) -> Optional[str]:
    """``keep`` when it is a tier faster than ``tier`` (a copy worth offering the store), else None."""
    return keep if keep is not None and Tier.parse(keep).rank < Tier.parse(tier).rank else None


async def _write_group(store: AsyncTensorStore, loaded: list[_Loaded], io: IOCounter, state_tier: str,
                       param_tier: str, compress: Optional[bool], blocks: Optional[ModifyBlocks], *,
                       atomic: bool = False, progress: Optional[ProgressHook] = None,
                       keep: Optional[str] = None) -> None:
    """Write every updated tensor of a group back, then end the group's modify blocks (in-place
    state: that is its write). The state goes first, in one ``put_many`` (all or nothing with
    ``atomic``, with the group's ``progress`` entry), then the new training-dtype shards that are not
    their own master: so a shard whose parameter was rewritten always has its new state committed.
    Modify blocks end last: a new fp32 parameter shard bound for another tier is the master's own
    memory, which ending its block gives back."""
    state: dict[str, torch.Tensor] = {}
    codecs: dict[str, Optional[bool]] = {}
    params: list[tuple[str, torch.Tensor]] = []
    for item in loaded:
        s = item.shard
        assert item.master is not None and item.exp_avg is not None and item.exp_avg_sq is not None
        if not item.in_place:
            master_key, exp_avg_key, exp_avg_sq_key = s.out_keys
            state.update({master_key: item.master, exp_avg_key: item.exp_avg, exp_avg_sq_key: item.exp_avg_sq})
            codecs.update({master_key: None if s.master_is_param else compress, exp_avg_key: compress,
                           exp_avg_sq_key: compress})
        if item.param is not None and item.param_entry is None:
            params.append((s.param_key, item.param))
    if progress is not None and loaded:
        key, mark = progress([item.shard.name for item in loaded])
        state[key] = mark
        codecs[key] = None
    try:
        if state:
            await io.put_many(store, state, state_tier, codecs, atomic, _faster(keep, state_tier))
        param_keep = _faster(keep, param_tier)
        await gather_all(io.put(store, key, param, param_tier, None, param_keep) for key, param in params)
    finally:
        if blocks is not None:
            await blocks.close()


def _initial_state(group: list[OptimShard], params: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for shard, param in zip(group, params):
        if param.numel() != shard.numel:
            raise OptimizerStateError(
                f"shard {shard.name!r}: {shard.param_key!r} holds {param.numel()} elements, expected {shard.numel}"
            )
        master = param.reshape(-1).to(torch.float32)
        out.append((master, torch.zeros_like(master)))
    return out


def _flat_grad(shard: OptimShard, grad: torch.Tensor) -> torch.Tensor:
    if grad.numel() != shard.numel:
        raise OptimizerStateError(
            f"shard {shard.name!r}: gradient {shard.grad_key!r} holds {grad.numel()} elements, expected {shard.numel}"
        )
    if not grad.dtype.is_floating_point:
        raise OptimizerStateError(f"shard {shard.name!r}: gradient {shard.grad_key!r} has dtype {grad.dtype}")
    grad = grad.view(-1)
    return grad if grad.dtype == torch.float32 else grad.float()


def _check_state(shard: OptimShard, what: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.float32 or tensor.numel() != shard.numel:
        raise OptimizerStateError(
            f"shard {shard.name!r}: {what} in the store is {tensor.dtype} with {tensor.numel()} elements, "
            f"expected torch.float32 with {shard.numel}"
        )


def _step_count(steps: Mapping[str, int], name: str) -> int:
    count = steps.get(name, 0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"steps[{name!r}] must be an int >= 0, got {count!r}")
    return count


def _check_in_place(shards: Sequence[OptimShard], state_tier: str) -> None:
    if state_tier != "host":
        raise ValueError(f"in_place=True updates state in host memory; state_tier must be 'host', got {state_tier!r}")
    moved = [s.name for s in shards if s.state_out_keys is not None]
    if moved:
        raise ValueError(f"in_place=True updates state where it lies, but shards {moved[:3]} set state_out_keys")


def _check_tier(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
