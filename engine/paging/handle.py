"""ParamHandle: the engine's record of one managed ``nn.Parameter`` and its storage state."""

from __future__ import annotations

import concurrent.futures
import enum
from typing import Optional

import torch

from engine.paging.layout import ShardLayout
from engine.paging.released import mark_closed, mark_grads_in_store, released_class
from engine.stats import MemoryMeter


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

    The ``nn.Parameter`` object is never replaced: release resizes its storage to 0 bytes, which
    keeps every view of it (views autograd saved included) valid for the next refill, and gives the
    parameter its released class (``engine.paging.released``: metadata reads work, value reads raise
    ``ReleasedParameterError`` instead of reading 0 bytes); allocation gives its own class back. A handle is
    *held* while a running module uses it (``users``) or backward still needs it (``bwd_hold``);
    an unheld handle is either RELEASED or ``prefetched`` (materialized ahead of its next need).

    Versions: the parameter's autograd version counter also counts the store's own writes into
    its storage (a copy from the host tier is an in-place op), so those are subtracted:
    ``version`` counts only the user's in-place changes, and ``synced`` is its value when the
    storage last matched the store. A released parameter whose ``version != synced`` is written
    back first (an ``nn.Embedding(max_norm=...)`` renormalizes its weight in forward).
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
        if self.state is HandleState.RELEASED:
            return
        self.flat.untyped_storage().resize_(0)
        self.state = HandleState.RELEASED
        self.mark_released()
        meter.sub(self.nbytes)

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
