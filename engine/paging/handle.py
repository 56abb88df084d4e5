"""ParamHandle: the engine's record of one managed ``nn.Parameter`` and its storage state."""

from __future__ import annotations

import concurrent.futures
import enum
import functools
from typing import Callable, Optional

import torch

from engine.paging.layout import ShardLayout
from engine.paging.released import mark_closed, mark_grads_in_store, released_class, set_reader
from engine.stats import MemoryMeter


# [Note: Released parameters]
# Release is ``param.untyped_storage().resize_(0)``: the ``nn.Parameter`` and every view of it keep
# their identity and metadata; only the bytes go. Fetch resizes the storage back and has the store
# fill it (``SyncStore.get_future(key, out=<flat view of the parameter>)``, a non-blocking get
# straight into the parameter's own storage). A view taken earlier (autograd saves ``W.t()`` for a
# linear layer) sees the refilled bytes, because a view reads through its storage. No parameter is
# ever replaced, so an optimizer built on ``model.parameters()`` before wrap holds the same objects,
# and tied weights (one ``Parameter`` under two names) are one handle and one store entry.
#
# A kernel would read a null pointer from the 0-byte storage, so while released the parameter's
# class is a subclass of its own (engine.paging.released) that answers metadata reads and raises
# ReleasedParameterError for value reads. Only ``__class__`` changes: the object, its ``__dict__``,
# its autograd state and its C++ tensor stay, so autograd and the optimizer are unaffected, and
# allocation gives the class back. A meta tensor swapped in through ``param.data`` would not do:
# torch refuses ``set_data`` across device types, and ``swap_tensors`` moves ``grad`` and hooks
# with the data.
#
# [Note: Parameter versions]
# The parameter's autograd version counter says when the model changed a materialized parameter in
# place (``nn.Embedding(max_norm=...)`` renormalizes its weight in forward; weight clipping does the
# same): such a parameter is written back to the store before its storage is freed. The store's own
# writes into the storage bump the counter too (a copy in is an in-place op), so the handle
# subtracts them: ``version`` counts only the user's changes and ``synced`` is its value when the
# storage last matched the store. The same counter restores autograd's "modified by an inplace
# operation" error, which saved-tensor hooks otherwise switch off: unpack compares the version at
# save time with the current one.


class HandleState(enum.Enum):
    """Where a parameter's bytes are.

    RELEASED: storage resized to 0 bytes; the shard is only in the store.
    FETCHING: storage allocated, bytes on their way from the store (``future`` pending).
    READY: storage holds the parameter.
    """

    RELEASED = "released"
    FETCHING = "fetching"
    READY = "ready"


class ParamHandle:
    """One managed parameter (tied weights share one handle, named by their first name).

    Args:
        param: the model's own parameter; never replaced (see [Note: Released parameters]).
        names: every fully qualified name it has in the model, first one first.
        layout: how it is flattened and sharded (:class:`~engine.paging.layout.ShardLayout`).
        key: its shard's store key.

    A handle is *held* while a running module uses it (``users``) or backward still needs it
    (``bwd_hold``); an unheld handle is either RELEASED or ``prefetched`` (materialized ahead of
    its next need). ``version`` and ``synced`` track the user's in-place changes (see
    [Note: Parameter versions]).
    """

    def __init__(self, param: torch.nn.Parameter, names: tuple[str, ...], layout: ShardLayout, key: str) -> None:
        assert param.storage_offset() == 0 and param.untyped_storage().nbytes() == layout.nbytes
        self.param = param
        self.names = names
        self.layout = layout
        self.key = key
        self.nbytes = layout.nbytes
        self.state = HandleState.READY
        self.users = 0
        self.bwd_hold = False
        self.prefetched = False
        self.future: Optional["concurrent.futures.Future[torch.Tensor]"] = None
        #: This rank's fp32 master shard as the last fetch read it, for an update inside backward to
        #: take ([Note: Masters read in backward] in engine.paging.pager); None: that fetch read the parameter.
        self.master_copy: Optional[torch.Tensor] = None
        #: The fetch read the master: its cast into the storage is still to be made (world size 1).
        self.cast_pending = False
        self.storage_id = param.untyped_storage()._cdata
        self._store_bumps = 0  # version increments caused by the store filling the storage
        self._before_fetch = param._version
        self.synced = self.version
        # A flat alias of the parameter's storage in memory order: valid across resizes (same StorageImpl).
        self.flat = layout.flat_view(param.detach())
        self._own_class = type(param)
        self._released_class = released_class(self._own_class, names[0])

    def mark_grads_in_store(self, step_clip_norm: Optional[float]) -> None:
        """The parameter's gradients go to the store (``engine.AdamW``), whose steps clip them at
        ``step_clip_norm``: while it is released, torch's gradient clipping, which would find no
        ``.grad`` and clip nothing, is refused with what to call."""
        mark_grads_in_store(self._released_class, step_clip_norm)

    def set_reader(self, reader: "Optional[Callable[[ParamHandle], bool]]") -> None:
        """While released, a value read of the parameter from outside the engine's hooks first calls
        ``reader(handle)``, which materializes it and returns True where that is allowed, else False
        (the read raises ReleasedParameterError). None: every such read raises."""
        set_reader(self._released_class, None if reader is None else functools.partial(reader, self))

    @property
    def name(self) -> str:
        """The parameter's first fully qualified name."""
        return self.names[0]

    @property
    def held(self) -> bool:
        """True while a running module or backward needs the parameter materialized."""
        return self.users > 0 or self.bwd_hold

    @property
    def version(self) -> int:
        """The parameter's version counter without the store's writes into it."""
        return self.param._version - self._store_bumps

    def fetch_started(self) -> None:
        """The store starts writing into the storage (its version bumps are not the user's)."""
        self._before_fetch = self.param._version

    def fetch_finished(self) -> None:
        """The store finished writing: the storage matches the store."""
        self._store_bumps += self.param._version - self._before_fetch
        self.synced = self.version

    @property
    def trainable(self) -> bool:
        """True when the parameter requires a gradient."""
        return self.param.requires_grad

    def allocate(self, meter: MemoryMeter) -> None:
        """Give the parameter its storage back (contents undefined until filled)."""
        assert self.state is HandleState.RELEASED, (self.name, self.state)
        self.flat.untyped_storage().resize_(self.nbytes)
        self.unmark_released()
        meter.add(self.nbytes)

    def free(self, meter: MemoryMeter, *, force: bool = False) -> None:
        """Free the parameter's storage (its shard stays in the store). ``force`` frees it even
        while held (after a failed fetch, so nothing computes on bytes that never arrived)."""
        assert force or not self.held, self.name
        assert self.future is None or self.future.done(), self.name
        self.prefetched = False
        self.future = None
        self.master_copy = None
        self.cast_pending = False
        if self.state is HandleState.RELEASED:
            return
        self.flat.untyped_storage().resize_(0)
        self.state = HandleState.RELEASED
        self.mark_released()
        meter.sub(self.nbytes)

    def take_master_copy(self) -> Optional[torch.Tensor]:
        """The fp32 master shard the last fetch read (see :attr:`master_copy`), handed over once."""
        copy, self.master_copy = self.master_copy, None
        return copy

    def mark_released(self) -> None:
        """Give the (released) parameter its released class: value reads raise instead of crashing."""
        assert self.state is HandleState.RELEASED, self
        self.param.__class__ = self._released_class

    def unmark_released(self) -> None:
        """Give the parameter its own class back (before its storage is refilled, or while torch's own
        ``state_dict`` code takes its 0-byte ``detach()`` that the engine's hook then replaces)."""
        if type(self.param) is self._released_class:
            self.param.__class__ = self._own_class

    def detach_released(self) -> None:
        """The engine closes with this parameter released: make it a meta tensor of the same shape and
        dtype (as a model built under ``torch.device("meta")``, which ``engine.wrap`` takes again), keeping
        the object, its class and attributes (``param.grad`` goes: it cannot live on a meta parameter).
        Where torch refuses the swap (an autograd graph still holds the parameter), it stays released
        and its errors say the engine was closed."""
        assert self.state is HandleState.RELEASED, self
        param = self.param
        self.unmark_released()
        placeholder = torch.nn.Parameter(
            torch.empty_strided(self.layout.shape, self.layout.stride, dtype=self.layout.dtype, device="meta"),
            requires_grad=param.requires_grad,
        )
        placeholder.__dict__.update(param.__dict__)  # swap_tensors swaps __dict__ too
        try:
            torch.utils.swap_tensors(param, placeholder)
        except RuntimeError:
            self.mark_released()
            mark_closed(type(param))
            return
        param.__class__ = self._own_class  # swap_tensors swapped the classes as well

    def __repr__(self) -> str:
        return (
            f"ParamHandle({self.name!r}, {self.state.value}, users={self.users}, bwd_hold={self.bwd_hold}, "
            f"prefetched={self.prefetched})"
        )
