"""GradOffload: a parameter's gradient goes to the store as an fp32 shard the moment it is final.

Called from the post-accumulate-grad hook (``Engine._on_grad_final``): the shard this rank keeps
(``ShardIO.grad_shard``: the whole gradient at world size 1, the reduce-scattered slice above) is
put to ``grad/<name>`` in the gradient tier without waiting, and ``param.grad`` is set to None at
once, so the full gradient's memory goes as soon as the put has copied it.

A shard larger than the whole host tier goes to nvme instead (it could not be admitted there), so the
host tier need not be sized for the largest gradient. A shard is stored in the narrowest dtype that
holds it exactly: the training dtype (bf16, fp16) when
autograd made the gradient in that dtype at world size 1 and nothing was added to it, else fp32; it
reads back as the same fp32 values. Gradient accumulation (several backward passes before a step)
adds into the stored shard: get + add + put, in fp32, ``old + new`` as torch's ``param.grad += new``
does. Puts in flight are
bounded by ``inflight_bytes`` (at least one shard): past that the oldest is waited for, so the
gradients held in memory by unfinished puts never exceed the bound plus one shard.

``on_offload`` is called at every offload, before the gradient is handed on (the training
engine starts reading the step's first optimizer state groups there, ``engine/optim/prefetch.py``).

Each shard's 2-norm is taken here while the shard is in memory, so the step needs no extra pass
over the gradients to find the global norm (for clipping, and for ``eng.get_global_grad_norm()``).

A step marks the stored gradients consumed (:meth:`GradOffload.mark_consumed`): the next
backward starts from none, unless a ``zero_grad`` came first (which drops them, or with
``set_to_none=False`` makes them zeros that the next backward adds to, as torch does). So a loop
that clears gradients with ``model.zero_grad()``, which never reaches the store (Hugging Face's
Trainer does), trains as torch would; DeepSpeed's step drops the gradients the same way.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Callable, Optional

import torch

from engine.optim.clip import shard_norms
from engine.paging.handle import ParamHandle
from engine.paging.layout import GRAD_KEY_PREFIX, grad_key
from engine.paging.shard_io import ShardIO, delete_keys
from tiered import TieredStore
from tiered.util import round_up


class GradOffload:
    """Gradient shards of one rank between backward and the optimizer step."""

    def __init__(self, shard_io: ShardIO, tier: str, *, inflight_bytes: int,
                 on_offload: Optional[Callable[[], None]] = None) -> None:
        self._io = shard_io
        self._on_offload = on_offload
        self._store: TieredStore = shard_io.store
        self._tier = tier
        self._host_bytes = self._store.config.host_bytes  # the host tier's whole budget
        self._inflight_limit = inflight_bytes
        self._lock = threading.Lock()
        self._pending: "collections.OrderedDict[str, tuple[concurrent.futures.Future[None], int]]" = (
            collections.OrderedDict()
        )
        self._inflight = 0
        self._error: Optional[BaseException] = None
        #: Names of the shards offloaded since the last zero_grad (their keys are in the store).
        self.names: dict[str, None] = {}
        #: 2-norm of each stored shard, by name.
        self.norms: dict[str, torch.Tensor] = {}
        #: fp32 bytes of gradient shards put to the store since the engine started.
        self.bytes_offloaded = 0
        self._consumed = False

    def offload(self, handle: ParamHandle) -> None:
        """Move ``handle``'s final gradient to the store and free it (a no-op without a gradient)."""
        grad = handle.param.grad
        if grad is None:
            return
        if self._on_offload is not None:
            self._on_offload()
        shard = self._io.grad_shard(handle, grad)
        handle.param.grad = None
        del grad
        key = grad_key(handle.name)
        with self._lock:
            if self._consumed:  # the first gradient after a step: the step's gradients are done with
                self._drop_locked()
            self._wait(key)
            accumulated = key in self._store
            if accumulated:  # accumulation: the earlier micro-batches' sum is in the store
                shard = self._store.sync.get(key, shard.device).float().add_(shard)
            norm = shard_norms([shard])[0]
            self._put_locked(handle.name, shard, exact_dtype(handle, accumulated, self._io.world), norm, self._tier)

    def keep(self, name: str, shard: torch.Tensor, dtype: torch.dtype, norm: torch.Tensor) -> None:
        """Store ``shard``, the final fp32 gradient shard of ``name`` an update inside backward takes, on
        nvme as ``dtype`` (it must hold it exactly: :func:`exact_dtype`), so the step can redo the
        update from it ([Note: Speculative updates]); ``norm`` is its 2-norm. Does not wait; ``shard``
        must not change until the put is done."""
        with self._lock:
            if self._consumed:
                self._drop_locked()
            self._wait(grad_key(name))
            self._put_locked(name, shard, dtype, norm, "nvme")

    def _put_locked(self, name: str, shard: torch.Tensor, dtype: torch.dtype, norm: torch.Tensor, tier: str) -> None:
        """Start the put of ``name``'s shard as ``dtype`` (lock held), within the bytes allowed in flight."""
        key = grad_key(name)
        self.norms[name] = norm
        stored = shard if shard.dtype == dtype else shard.to(dtype)
        nbytes = stored.numel() * stored.element_size()
        if tier == "host" and round_up(nbytes) > self._host_bytes:
            tier = "nvme"  # larger than the whole host tier: it could never be admitted there
        while self._pending and self._inflight + nbytes > self._inflight_limit:
            self._wait(next(iter(self._pending)))
        self._pending[key] = (self._store.sync.put_future(key, stored, tier), nbytes)
        self._inflight += nbytes
        self.names[name] = None
        self.bytes_offloaded += nbytes

    def flush(self) -> None:
        """Wait for every put in flight; raise the first error any of them (or an earlier one) had."""
        with self._lock:
            while self._pending:
                self._wait(next(iter(self._pending)))
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError("a gradient shard could not be written to the store; its gradient is lost") from error

    def drop_consumed(self) -> None:
        """Delete the gradients a step used, now (rather than at the next backward's first gradient)."""
        with self._lock:
            if self._consumed:
                self._drop_locked()

    def mark_consumed(self) -> None:
        """A step used the stored gradients: the next backward starts from none (see the module docstring)."""
        with self._lock:
            self._consumed = True

    def _drop_locked(self) -> None:
        """Wait for the puts in flight, then delete every shard offloaded since the last drop (lock held)."""
        while self._pending:
            self._wait(next(iter(self._pending)))
        self._consumed = False
        names = list(self.names)
        self.names.clear()
        self.norms.clear()
        delete_keys(self._store, [grad_key(n) for n in names])

    def current(self, name: str) -> bool:
        """True when ``name`` has a gradient for the next step: stored since the last step or
        ``zero_grad`` (waits for its put)."""
        with self._lock:
            self._wait(grad_key(name))
            return not self._consumed and name in self.names

    def replace(self, handle: ParamHandle, shard: torch.Tensor) -> None:
        """Make ``shard`` (this rank's fp32 gradient shard, already scaled as backward's are) the
        stored gradient of ``handle``, as ``param.grad.copy_(value)`` would; a later backward adds to
        it. After a step, that step's gradients go first, as the next backward would drop them."""
        key = grad_key(handle.name)
        with self._lock:
            if self._consumed:
                self._drop_locked()
            self._wait(key)
            self._store.sync.put(key, shard, self._tier)
            self.norms[handle.name] = shard_norms([shard])[0]
            self.names[handle.name] = None

    def has_grad(self, name: str) -> bool:
        """True when a gradient shard of ``name`` is stored (call after :meth:`flush`)."""
        return grad_key(name) in self._store

    def zero(self, set_to_none: bool = True) -> None:
        """Drop every stored gradient shard (``set_to_none``), or overwrite each with zeros, as
        ``Optimizer.zero_grad`` does with ``param.grad``."""
        try:
            self.flush()
        finally:
            with self._lock:
                self._consumed = False
                if set_to_none:
                    self._drop_locked()
            if not set_to_none:
                for name in list(self.names):
                    key = grad_key(name)
                    if key in self._store:
                        info = self._store.info(key)
                        self._store.sync.put(key, torch.zeros(info.shape, dtype=info.dtype), self._tier)
                        self.norms[name] = torch.zeros((), dtype=torch.float32)

    def discard_stored(self) -> None:
        """Delete every gradient shard in the store, including ones an earlier process left."""
        self.flush()
        self._consumed = False
        self.names.clear()
        self.norms.clear()
        delete_keys(self._store, [k for k in self._store.keys() if k.startswith(GRAD_KEY_PREFIX)])

    def _wait(self, key: str) -> None:
        entry = self._pending.pop(key, None)
        if entry is None:
            return
        future, nbytes = entry
        self._inflight -= nbytes
        try:
            future.result()
        except BaseException as exc:  # noqa: BLE001 - kept and raised by flush(), outside the autograd hook
            self._error = self._error or exc


def exact_dtype(handle: ParamHandle, accumulated: bool, world: int) -> torch.dtype:
    """The narrowest dtype that holds ``handle``'s fp32 gradient shard exactly: its training dtype when
    autograd made the gradient in that dtype at world size 1 and nothing was added to it, else fp32."""
    dtype = handle.layout.dtype
    if world == 1 and not accumulated and dtype in (torch.bfloat16, torch.float16):
        return dtype
    return torch.float32
