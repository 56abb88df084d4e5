"""ShardIO: moves a parameter between its materialized storage and its shard in the store.

Fetch path: get this rank's shard -> all-gather across ranks (world > 1) -> fill the parameter.
Write path: take this rank's slice of the parameter -> put it as the shard. Gradient path: the
full gradient -> reduce-scatter (mean over ranks) -> this rank's fp32 gradient shard. At world size
1 the shard is the whole parameter, so fetch and write are one store call on the parameter's own
storage and the gradient shard is the gradient itself.

With several ranks every collective goes through one :class:`~engine.paging.collectives.Collectives`
worker, in the order this object's methods are called: a fetch starts the local get at once and
queues its all-gather, which runs once the bytes have arrived, so prefetches still overlap compute.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Callable, Iterable, Optional, TypeVar

import torch

from engine.paging.collectives import Collectives
from engine.paging.handle import ParamHandle
from engine.paging.layout import ShardLayout
from tiered import Tier, TieredStore, TransferError
from tiered.util import wait_all

T = TypeVar("T")


class ShardIO:
    """Store traffic of parameter shards, for one rank; ``collectives`` is required when any
    handle's layout spans several ranks."""

    def __init__(self, store: TieredStore, tier: "Tier | str", collectives: Optional[Collectives] = None, *,
                 cache: "Tier | str | None" = None) -> None:
        self.store = store
        self.tier = Tier.parse(tier)
        self.collectives = collectives
        #: A faster tier where fetches and writes offer the store a clean copy of the shard to keep
        #: across steps (the store keeps it when its policy, fed the recorded order, finds it worth it).
        self.cache = Tier.parse(cache) if cache is not None else None

    @property
    def rank(self) -> int:
        """This process's rank in the sharding group (0 without one)."""
        return self.collectives.rank if self.collectives is not None else 0

    @property
    def world(self) -> int:
        """Ranks the parameters are sharded over (1 without a group)."""
        return self.collectives.world if self.collectives is not None else 1

    def fetch(self, handle: ParamHandle, master: Optional[str] = None) -> "concurrent.futures.Future[torch.Tensor]":
        """Start filling ``handle``'s (allocated) storage from the store; never blocks. ``master``: read
        that fp32 entry (this rank's master shard) instead of the parameter's and cast it in, keeping
        the fp32 copy on the handle ([Note: Masters read in backward] in engine.paging.pager); call
        :meth:`finish_fetch` once the future is done."""
        layout = handle.layout
        if master is not None:
            copy = self.store.host_buffer(layout.shard_numel * 4).view(torch.float32)
            handle.master_copy = copy
            local = self.store.sync.get_future(master, out=copy)
            if layout.is_whole:
                handle.cast_pending = True
                return local
            gathered, shard = self._gather_buffers(layout, handle.flat)
            return self._comm().submit(self._gather_cast, local, copy, gathered, shard, layout.numel, handle.flat)
        if layout.is_whole:
            return self.store.sync.get_future(handle.key, handle.flat.device, out=handle.flat, keep=self.cache)
        gathered, shard = self._gather_buffers(layout, handle.flat)
        local = self.store.sync.get_future(handle.key, handle.flat.device, out=shard, keep=self.cache)
        return self._comm().submit(self._gather, local, gathered, shard, layout.numel, handle.flat)

    def finish_fetch(self, handle: ParamHandle) -> None:
        """After a :meth:`fetch` that read the master at world size 1: cast it into the storage."""
        if handle.cast_pending:
            assert handle.master_copy is not None
            handle.flat.copy_(handle.master_copy)  # the rounding that wrote the parameter: the same bits
            handle.cast_pending = False

    def read_copy(self, handle: ParamHandle, key: Optional[str] = None, dtype: Optional[torch.dtype] = None
                  ) -> torch.Tensor:
        """A new tensor with the parameter's whole value, on its device (blocks; a collective at
        world size > 1, so every rank must call it for the same parameters in the same order).
        ``key`` and ``dtype`` read another entry laid out like the parameter's shards instead (its
        fp32 master weight)."""
        layout = handle.layout
        key = handle.key if key is None else key
        if layout.is_whole:
            flat = self.store.sync.get(key, handle.flat.device)
            return layout.unflatten(flat)
        gathered = torch.empty(layout.padded_numel, dtype=dtype or layout.dtype, device=handle.flat.device)
        shard = gathered[layout.shard_offset : layout.shard_offset + layout.shard_numel]
        try:
            local = self.store.sync.get_future(key, handle.flat.device, out=shard)
        except Exception as exc:  # noqa: BLE001 - e.g. a closed store: the other ranks must still hear of it
            local = concurrent.futures.Future()
            local.set_exception(exc)
        flat = self._comm().run(self._gather_checked, local, gathered, shard, layout.numel, handle.name)
        return layout.unflatten(flat)

    def write(self, handle: ParamHandle) -> "concurrent.futures.Future[None]":
        """Start writing ``handle``'s materialized value as its shard (this rank's slice of it); the
        storage must stay as it is until the future is done."""
        if handle.layout.is_whole:
            return self.store.sync.put_future(handle.key, handle.flat, self.tier, keep=self.cache)
        return self.store.sync.put_future(handle.key, _shard_of(handle.layout, handle.flat), self.tier,
                                          keep=self.cache)

    def local_shard(self, handle: ParamHandle, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A copy of this rank's shard of ``handle``'s materialized value (flat, padded with zeros
        where the shard runs past the end): what :meth:`write` would put. Local.

        ``out``: a flat tensor of the shard's size and the parameter's dtype, on any device, to copy
        into (returned); None: a new tensor on the parameter's device."""
        flat = handle.flat
        piece = flat if handle.layout.is_whole else _shard_of(handle.layout, flat)
        if out is not None:
            return out.copy_(piece)
        shares = piece.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        return piece.clone() if shares else piece

    def shard_of(self, handle: ParamHandle, value: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``value``, a whole tensor of the parameter's shape (any dtype): the
        elements :meth:`write` would put for it, flat, padded with zeros where the shard runs past
        the end. Local: no collective."""
        layout = handle.layout
        assert tuple(value.shape) == tuple(layout.shape), (handle.name, tuple(value.shape))
        ordered = layout.unflatten(torch.empty(layout.numel, dtype=value.dtype, device=value.device)).copy_(value)
        flat = layout.flat_view(ordered)
        return flat if layout.is_whole else _shard_of(layout, flat)

    def grad_shard(self, handle: ParamHandle, grad: torch.Tensor) -> torch.Tensor:
        """The fp32 gradient shard this rank keeps, given the parameter's full gradient ``grad``
        (laid out like the parameter). World size 1: the whole gradient, flat, in memory order
        (a view when it is already fp32 and dense like the parameter, else a copy). World size > 1:
        the mean of every rank's gradient over this rank's part of the padded flat parameter
        (reduce-scatter, as FSDP and DeepSpeed average data-parallel gradients); a new tensor.
        Blocks until the reduction is done; ``grad`` is not changed."""
        layout = handle.layout
        if grad.stride() != layout.stride or grad.storage_offset() != 0:
            grad = layout.unflatten(torch.empty_like(handle.flat, dtype=grad.dtype)).copy_(grad)
        flat = layout.flat_view(grad)
        if layout.is_whole:
            return flat.to(torch.float32)
        if flat.dtype != torch.float32 or layout.padded_numel != layout.numel:
            padded = torch.zeros(layout.padded_numel, dtype=torch.float32, device=flat.device)
            padded[: layout.numel] = flat
            flat = padded
        out = torch.empty(layout.shard_numel, dtype=torch.float32, device=flat.device)
        comm = self._comm()
        comm.run(_on_device_of(out, comm.reduce_scatter_mean), out, flat)
        return out

    def average_grad(self, grad: torch.Tensor) -> None:
        """Replace ``grad`` (a whole gradient) by its mean over ranks, in place (an all-reduce, as
        DDP does): what ``param.grad`` holds at world size > 1 when no engine optimizer takes the
        gradient shards. A no-op at world size 1. Blocks."""
        if self.collectives is None:
            return
        comm = self.collectives
        comm.run(_on_device_of(grad, comm.all_reduce_mean), grad)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over ranks, in place, and returned (the optimizer step's global
        gradient norm: each rank's sum of squares). Blocks; the identity at world size 1."""
        if self.collectives is not None:
            comm = self.collectives
            comm.run(_on_device_of(tensor, comm.all_reduce_sum), tensor)
        return tensor

    def close(self) -> None:
        """Stop the collectives worker (after what is queued has run). Idempotent."""
        if self.collectives is not None:
            self.collectives.close()

    # ------------------------------------------------------------------ internals

    def _comm(self) -> Collectives:
        if self.collectives is None:
            raise RuntimeError("a parameter is sharded across ranks but the engine has no process group")
        return self.collectives

    @staticmethod
    def _gather_buffers(layout: ShardLayout, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the all-gather writes (the parameter itself unless there is padding) and the slice of
        it this rank's shard is read into."""
        if layout.padded_numel == layout.numel:
            gathered = flat
        else:
            gathered = torch.empty(layout.padded_numel, dtype=layout.dtype, device=flat.device)
        return gathered, gathered[layout.shard_offset : layout.shard_offset + layout.shard_numel]

    def _gather(
        self,
        local: "concurrent.futures.Future[torch.Tensor]",
        gathered: torch.Tensor,
        shard: torch.Tensor,
        numel: int,
        flat: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """On the collectives worker: wait for the local shard, all-gather, copy out of padding.
        Returns the whole flat parameter (``flat`` when given, else ``gathered`` without padding)."""
        # An error here leaves the other ranks waiting in this all-gather: a failed rank must stop
        # the job (torchrun does), since skipping the collective would desynchronize the sequence.
        # Fetches do not agree on failures first (read_copy does), which would double their collectives.
        local.result()
        return self._all_gather(gathered, shard, numel, flat)

    def _gather_cast(
        self, local: "concurrent.futures.Future[torch.Tensor]", master: torch.Tensor, gathered: torch.Tensor,
        shard: torch.Tensor, numel: int, flat: torch.Tensor,
    ) -> torch.Tensor:
        """``_gather`` for a fetch that read this rank's fp32 master: cast it into the shard first."""
        local.result()
        shard.copy_(master)
        return self._all_gather(gathered, shard, numel, flat)

    def _gather_checked(
        self, local: "concurrent.futures.Future[torch.Tensor]", gathered: torch.Tensor, shard: torch.Tensor,
        numel: int, name: str,
    ) -> torch.Tensor:
        """``_gather`` for a value handed to the caller (``read_copy``): the ranks first agree that
        each read its shard, so when one could not, every rank raises (that rank its own error, the
        others a TransferError naming it) instead of waiting in the all-gather or returning a value
        with another rank's part missing. Every rank then issues the same collectives either way."""
        error: Optional[BaseException] = None
        try:
            local.result()
        except Exception as exc:  # noqa: BLE001 - raised below, once the other ranks know of it
            error = exc
        comm = self._comm()
        with _device_of(gathered):
            failed = comm.ranks_where(error is not None, gathered.device)
        if error is not None:
            raise error
        if failed:
            ranks = f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
            raise TransferError(f"reading parameter {name!r} failed on {ranks} (the error raised there says why); "
                                "every rank stops here rather than return it with that rank's part missing")
        return self._all_gather(gathered, shard, numel, None)

    def _all_gather(self, gathered: torch.Tensor, shard: torch.Tensor, numel: int, flat: Optional[torch.Tensor]
                    ) -> torch.Tensor:
        """All-gather the shards into ``gathered``; the whole flat parameter as ``_gather`` returns it."""
        comm = self._comm()
        with _device_of(gathered):
            comm.all_gather(gathered, shard)
            if flat is None:
                return gathered if numel == gathered.numel() else gathered[:numel].clone()
            if gathered is not flat:
                flat.copy_(gathered[:numel])
        return flat


def _shard_of(layout: ShardLayout, flat: torch.Tensor) -> torch.Tensor:
    """This rank's part of the whole flat parameter value ``flat``: a view, or a zero-padded copy for
    the last ranks' shards, which run past its end."""
    start = min(layout.shard_offset, layout.numel)
    end = min(layout.shard_offset + layout.shard_numel, layout.numel)
    piece = flat[start:end]
    if piece.numel() != layout.shard_numel:
        padded = torch.zeros(layout.shard_numel, dtype=flat.dtype, device=flat.device)
        padded[: piece.numel()] = piece
        piece = padded
    return piece


def _device_of(tensor: torch.Tensor) -> "contextlib.AbstractContextManager[object]":
    """Make ``tensor``'s CUDA device current on the collectives worker (NCCL uses the current one)."""
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()


def _on_device_of(tensor: torch.Tensor, fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` run with ``tensor``'s CUDA device current."""

    def call(*args: object) -> T:
        with _device_of(tensor):
            return fn(*args)

    return call


def delete_keys(store: TieredStore, keys: Iterable[str]) -> None:
    """Delete ``keys`` from the store, all in flight together (those already absent are skipped);
    after every delete has finished, raise the first error."""
    wait_all([store.sync.delete_future(k) for k in keys if k in store])
