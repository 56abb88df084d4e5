"""SavedActivations: tensors autograd saves for backward go to the store during forward and come
back for backward, read ahead in the reverse of the order they were saved
(``EngineConfig.activation_tier``; docs/training.md, "Activations in the store").

What moves is a *storage*: a saved tensor is offloaded as the whole storage it views, once. Other
saved views of the same storage (q, k and v sliced from one projection, a reshape, a transpose)
share that entry as long as the storage is unchanged, so the bytes move once; a view keeps its whole
storage, as it does in plain PyTorch. Storages below ``activation_min_bytes``, module buffers and
leaves that require a gradient stay in memory.

Forward: pack starts a put and returns a token (what autograd keeps); the tensor is held until the
put is done, and at most ``activation_window_bytes`` of such tensors at once (pack waits for the
oldest beyond that). Backward: unpack returns the tensor still held if the put has not finished,
else the bytes read ahead or read now, and tops up the reads ahead (the window again) along the
saved order, backwards. When autograd lets go of a storage's last token, its entry is deleted.

The saved value is the one at save time, as with ``torch.autograd.graph.save_on_cpu``. An in-place
change made while the tensor is still held (its put unfinished or not yet collected) is caught and
raised at backward, as autograd's own check would.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
import time
import warnings
import weakref
from typing import Any, Optional

import torch

from engine.paging.shard_io import delete_keys
from tiered import Tier, TieredStore

#: Store keys of offloaded activations: this prefix and a sequence number (scratch: deleted once
#: backward is done with them, and left-overs of a crashed run are deleted by the next wrap).
ACTIVATION_KEY_PREFIX = "activation/"


class _Stored:
    """One offloaded storage: its put, what holds its bytes in memory now, and its tokens."""

    __slots__ = ("key", "seq", "nbytes", "device", "source", "flat", "version", "put", "load", "loaded",
                 "tokens", "dead", "ahead", "modified", "failed", "collected")

    def __init__(self, key: str, seq: int, source: torch.Tensor, flat: torch.Tensor) -> None:
        self.key = key
        self.seq = seq
        self.nbytes = flat.numel()
        self.device = flat.device
        # The saved tensor detached (no grad_fn, so no cycle with the node saving it): it keeps the
        # storage alive until the put is done and shares the version counter of the views of it.
        self.source: Optional[torch.Tensor] = source
        self.flat: Optional[torch.Tensor] = flat  # the whole storage as bytes, until the put is collected
        self.version = source._version
        self.put: Optional[concurrent.futures.Future[None]] = None
        self.load: Optional[concurrent.futures.Future[torch.Tensor]] = None
        self.loaded: Optional[torch.Tensor] = None
        self.tokens = 0
        self.dead = False
        self.ahead = False  # read ahead and not yet unpacked: counted in the read window
        self.modified = False
        self.failed = False  # the put failed: the bytes stay in memory
        self.collected = False  # the put is done and _finish_put has run


class SavedActivation:
    """What autograd keeps for an offloaded saved tensor: its storage's entry and how it viewed it."""

    __slots__ = ("stored", "dtype", "shape", "stride", "offset", "__weakref__")

    def __init__(self, stored: _Stored, tensor: torch.Tensor) -> None:
        self.stored = stored
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        """The saved tensor, as a view of its storage's bytes ``flat``."""
        return torch.as_strided(flat.view(self.dtype), self.shape, self.stride, self.offset)


class SavedActivations:
    """Offloads saved tensors of the wrapped forward to ``tier`` of ``store`` (one per engine)."""

    def __init__(self, store: TieredStore, tier: "Tier | str", *, min_bytes: int, window_bytes: int) -> None:
        self._store = store
        self._tier = Tier.parse(tier)
        self._min_bytes = min_bytes
        self._window = window_bytes
        self._lock = threading.RLock()
        self._seq = 0
        self._order: list[_Stored] = []  # in the order saved; dead ones pruned between passes
        self._cursor: Optional[int] = None  # next index to read ahead from, walking backwards
        self._writing: collections.deque[_Stored] = collections.deque()  # puts not yet collected, oldest first
        self._writing_bytes = 0
        self._ahead_bytes = 0
        self._by_storage: dict[int, tuple[weakref.ref[torch.Tensor], _Stored]] = {}
        self._released: collections.deque[_Stored] = collections.deque()  # tokens autograd let go of
        self._deletes: list[concurrent.futures.Future[None]] = []
        self._skip_storages: set[int] = set()
        self._backward_tasks: set[int] = set()
        self._closed = False
        self._warned = False
        self.bytes_offloaded = 0
        self.bytes_read = 0
        self.stall_seconds = 0.0
        self.peak_write_bytes = 0

    # ------------------------------------------------------------------ forward

    def begin_forward(self, model: torch.nn.Module) -> None:
        """A step's forward starts: collect what the last one left, and note the buffers' storages
        (buffers live in the module anyway, so they are never offloaded)."""
        self.collect(wait_deletes=False)
        self._skip_storages = {b.untyped_storage()._cdata for b in model.buffers() if b.device.type != "meta"}

    def pack(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> Any:
        """A token for ``tensor`` (strided, not meta) with its ``storage`` on the way to the store, or
        ``tensor`` detached when it stays (see [Note: Saved tensors are detached])."""
        if type(tensor) is not torch.Tensor or self._closed:  # subclasses keep their own semantics
            return tensor.detach()
        nbytes = storage.nbytes()
        cdata = storage._cdata
        if (nbytes < self._min_bytes or nbytes % tensor.element_size() or cdata in self._skip_storages
                or (tensor.is_leaf and tensor.requires_grad)):
            return tensor.detach()
        with self._lock:
            self._collect_locked()
            self._cursor = None  # a new forward: reads ahead restart from its last saved tensor
            stored = self._shared(cdata, tensor)
            if stored is None:
                stored = self._start_put(tensor, storage, cdata)
            stored.tokens += 1
        token = SavedActivation(stored, tensor)
        weakref.finalize(token, self._released.append, stored)  # no lock: finalizers run anywhere
        self._wait_for_window()
        return token

    def _shared(self, cdata: int, tensor: torch.Tensor) -> Optional[_Stored]:
        hit = self._by_storage.get(cdata)
        if hit is None:
            return None
        ref, stored = hit
        alive = ref()
        # The storage is the same one only while a tensor still on it is alive (an address can be reused
        # once it is freed); unchanged only at the same version.
        if (alive is None or stored.dead or alive.untyped_storage()._cdata != cdata
                or alive._version != stored.version or tensor._version != stored.version):
            del self._by_storage[cdata]
            return None
        return stored

    def _start_put(self, tensor: torch.Tensor, storage: torch.UntypedStorage, cdata: int) -> _Stored:
        with torch.no_grad():
            flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            flat.set_(storage, 0, (storage.nbytes(),), (1,))
        self._seq += 1
        stored = _Stored(f"{ACTIVATION_KEY_PREFIX}{self._seq}", self._seq, tensor.detach(), flat)
        stored.put = self._store.sync.put_future(stored.key, flat, self._tier)
        self._order.append(stored)
        self._writing.append(stored)
        self._writing_bytes += stored.nbytes
        self.peak_write_bytes = max(self.peak_write_bytes, self._writing_bytes)
        self.bytes_offloaded += stored.nbytes
        self._by_storage[cdata] = (weakref.ref(tensor), stored)
        return stored

    def _wait_for_window(self) -> None:
        """Block until the tensors held for unfinished puts fit the window again (the oldest one always may)."""
        while True:
            with self._lock:
                if self._writing_bytes <= self._window or len(self._writing) <= 1:
                    return
                oldest = self._writing[0].put
            assert oldest is not None
            started = time.perf_counter()
            concurrent.futures.wait([oldest])
            self.stall_seconds += time.perf_counter() - started
            with self._lock:
                self._collect_locked()

    # ------------------------------------------------------------------ backward

    def unpack(self, token: SavedActivation) -> torch.Tensor:
        """The saved tensor again: from memory while still held, else from the store (read ahead, or now)."""
        stored = token.stored
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    "backward needs a saved activation, but its engine was closed and its store with it: run "
                    "backward before eng.close()"
                )
            self._note_backward()
            self._collect_locked()
            self._check_unchanged(stored)
            flat = stored.flat if stored.flat is not None else stored.loaded
            if flat is None and stored.load is None:
                self._start_load(stored)
            load = stored.load
            if stored.ahead:
                stored.ahead = False
                self._ahead_bytes -= stored.nbytes
            if self._cursor is None:
                self._cursor = len(self._order) - 1
            self._read_ahead()
        if flat is None:
            assert load is not None
            started = time.perf_counter()
            flat = load.result()
            self.stall_seconds += time.perf_counter() - started
            with self._lock:
                if not stored.dead and stored.load is load:
                    stored.loaded = flat
        return token.view_of(flat)

    def _check_unchanged(self, stored: _Stored) -> None:
        if stored.source is not None and stored.source._version != stored.version:
            stored.modified = True
        if stored.modified:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: a "
                f"saved activation of {stored.nbytes} bytes was at version {stored.version} when saved and was "
                "changed in place before the engine had stored it (EngineConfig.activation_tier); change a copy "
                "instead (x = x.clone() before the in-place operation)"
            )

    def _start_load(self, stored: _Stored) -> None:
        stored.load = self._store.sync.get_future(stored.key, stored.device)
        self.bytes_read += stored.nbytes

    def _read_ahead(self) -> None:
        """Start reads of the saved storages backward will want next, walking the saved order backwards
        while they fit the window."""
        cursor = self._cursor
        assert cursor is not None
        while cursor >= 0:
            stored = self._order[cursor]
            if not (stored.dead or stored.flat is not None or stored.loaded is not None or stored.load is not None):
                if self._ahead_bytes + stored.nbytes > self._window:
                    break
                self._start_load(stored)
                stored.ahead = True
                self._ahead_bytes += stored.nbytes
            cursor -= 1
        self._cursor = cursor

    def _note_backward(self) -> None:
        """Collect once this backward (graph task) ends: what it let go of is deleted before it returns."""
        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self._backward_tasks:
            self._backward_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._backward_done, task))

    def _backward_done(self, task: int) -> None:
        with self._lock:
            self._backward_tasks.discard(task)
            if self._backward_tasks:
                return
            for stored in self._order:  # a graph kept for another backward reads them again then
                if not stored.dead:
                    stored.loaded = stored.load = None
                    if stored.ahead:
                        stored.ahead = False
                        self._ahead_bytes -= stored.nbytes
            self._cursor = None
        self.collect(wait_deletes=True)

    # ------------------------------------------------------------------ bookkeeping

    def collect(self, *, wait_deletes: bool) -> None:
        """Collect finished puts and released tokens; with ``wait_deletes``, wait until the store has
        deleted every entry autograd let go of (its put finished first; a failed delete raises)."""
        while True:
            with self._lock:
                self._collect_locked()
                # Tokens die whenever autograd or the garbage collector lets go of them, on any thread,
                # so entries can die while this waits for others: wait for their puts too, until none is left.
                pending = [s.put for s in self._writing if s.dead and s.put is not None] if wait_deletes else []
                if not pending:
                    self._order = [s for s in self._order if not s.dead]
                    self._cursor = None
                    deletes = self._deletes
                    if wait_deletes:
                        self._deletes = []
                    else:
                        self._deletes = [f for f in deletes if not f.done()]
                        deletes = [f for f in deletes if f.done()]
                    break
            concurrent.futures.wait(pending)
        for future in deletes:
            future.result()

    def _collect_locked(self) -> None:
        # Every finished put, not only the oldest: puts to a full host tier finish out of order, and
        # one slow put must not keep the entries behind it from being deleted.
        if any(s.put.done() for s in self._writing):  # type: ignore[union-attr]
            writing, self._writing = self._writing, collections.deque()
            for stored in writing:
                if stored.put.done():  # type: ignore[union-attr]
                    self._finish_put(stored)
                else:
                    self._writing.append(stored)
        while self._released:
            stored = self._released.popleft()
            stored.tokens -= 1
            if stored.tokens == 0:
                self._drop(stored)

    def _finish_put(self, stored: _Stored) -> None:
        stored.collected = True
        self._writing_bytes -= stored.nbytes
        assert stored.put is not None
        error = stored.put.exception()
        if error is not None:
            stored.failed = True
            if not self._warned:  # once: a full tier would otherwise warn for every saved tensor
                self._warned = True
                warnings.warn(
                    f"a saved activation ({stored.nbytes} bytes) could not be written to the store's "
                    f"{self._tier.value} tier ({type(error).__name__}: {error}); it stays in memory, as will any "
                    "other that fails (not reported again). Raise that tier's budget, or set "
                    "EngineConfig.activation_tier=None", RuntimeWarning, stacklevel=2,
                )
            return  # flat and source stay: backward takes the bytes from memory
        if stored.source is not None and stored.source._version != stored.version:
            stored.modified = True
        stored.source = stored.flat = None
        if stored.dead:
            self._delete(stored)

    def _drop(self, stored: _Stored) -> None:
        """Autograd holds no token of ``stored`` any more: free its bytes and delete its entry."""
        stored.dead = True
        stored.loaded = stored.load = None
        if stored.ahead:
            stored.ahead = False
            self._ahead_bytes -= stored.nbytes
        if stored.collected:
            if stored.failed:
                stored.source = stored.flat = None
            else:
                self._delete(stored)
        # else: _finish_put deletes it once the put is done

    def _delete(self, stored: _Stored) -> None:
        if not self._closed:
            self._deletes.append(self._store.sync.delete_future(stored.key))

    def close(self) -> None:
        """Wait for every put, delete every entry still held, and refuse later unpacks."""
        with self._lock:
            if self._closed:
                return
            pending = [s.put for s in self._writing if s.put is not None]
        concurrent.futures.wait(pending)
        self.collect(wait_deletes=True)
        with self._lock:
            self._closed = True
            keys = [s.key for s in self._order]  # delete_keys skips those never stored
            self._order, self._writing, self._by_storage = [], collections.deque(), {}
        delete_keys(self._store, keys)


def discard_activations(store: TieredStore) -> None:
    """Delete activations a crashed run left in ``store`` (scratch: of no use to a later run)."""
    delete_keys(store, [k for k in store.keys() if k.startswith(ACTIVATION_KEY_PREFIX)])
