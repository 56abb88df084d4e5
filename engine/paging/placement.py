"""Placement: at wrap, every parameter's shard goes into the store, one module at a time.

For each module in pre-order: its direct parameters are given exclusive, contiguous storage on the
compute device (a parameter on the meta device gets empty storage, keeping its identity through
``torch.utils.swap_tensors``); a module with tensors on the meta device is initialized
(``init_fn(module)``, else ``module.reset_parameters()`` and then a Hugging Face model's
``_init_weights`` for it and its enclosing modules, as transformers runs it: ``engine.paging.init_scope``;
a tensor left unset is an error) unless the weight source sets them all;
values from the weight source are copied in; then the shards are written and the storage freed.
So at most one module's parameters (plus tied ones it shares) are materialized at a time.
Buffers are moved to the compute device and stay there.

With ``dtype`` (``EngineConfig.train_dtype``) floating parameters and buffers are cast to it as
their module is placed, as ``model.to(dtype)`` would. With ``from_store`` (resuming) the values
are the store's: parameters are adopted without being written, after checking that the store
holds a shard of the right size and dtype for each.
"""

from __future__ import annotations

import collections
import math
import warnings
from typing import Callable, Optional

import torch
from torch import nn

from engine.io.weights import WeightSource
from engine.paging.handle import HandleState, ParamHandle
from engine.paging.init_scope import InitScope, hf_initializers
from engine.paging.layout import ShardLayout, is_dense, param_key
from engine.paging.shard_io import ShardIO
from engine.stats import MemoryMeter
from tiered.util import wait_all

InitFn = Callable[[nn.Module], None]


def parameter_names(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """id(parameter) -> every fully qualified name it has (tied weights have several), first first."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {k: tuple(v) for k, v in names.items()}


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer not on the meta device; CPU if none."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


class Placement:
    """Writes a model's parameters into the store module by module; ``handles`` grows as it goes,
    so a caller can undo a placement that failed half way.

    With a weight source, ``initialize_missing=False`` makes a tensor on the meta device that the
    source does not set a ValueError before anything is written (accelerate's loading refuses it),
    where by default it is initialized as the model initializes it; ``cast_unloaded_buffers=False``
    leaves the buffers the source does not set in their own dtype under ``dtype`` (accelerate's
    ``dtype=`` casts only what the checkpoint holds, so a rotary embedding's fp32 ``inv_freq``
    stays fp32), where by default ``dtype`` casts every floating tensor, as DeepSpeed's
    ``module.half()`` does."""

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        shard_io: ShardIO,
        meter: MemoryMeter,
        rank: int = 0,
        world: int = 1,
        source: Optional[WeightSource] = None,
        init_fn: Optional[InitFn] = None,
        dtype: Optional[torch.dtype] = None,
        from_store: bool = False,
        initialize_missing: bool = True,
        cast_unloaded_buffers: bool = True,
    ) -> None:
        assert not (from_store and source is not None), "resuming takes every value from the store"
        self._initialize_missing = initialize_missing
        self._cast_unloaded_buffers = cast_unloaded_buffers
        self._model = model
        self._device = device
        self._io = shard_io
        self._meter = meter
        self._rank = rank
        self._world = world
        self._source = source
        self._init_fn = init_fn
        self._dtype = dtype
        self._from_store = from_store
        self._names = parameter_names(model)
        self._model_tensors: Optional[frozenset[int]] = None  # ids of every parameter and buffer, for InitScope
        self._storage_users: collections.Counter[int] = collections.Counter()
        self._moved_buffers: dict[int, torch.Tensor] = {}
        self.handles: dict[int, ParamHandle] = {}  # id(param) -> handle, in placement order
        self.by_module: dict[nn.Module, list[ParamHandle]] = {}
        self.was_materialized: set[int] = set()  # ids of parameters that had data before wrap
        #: Parameters and persistent buffers the weight source does not set (HF's "newly initialized").
        self.not_loaded: list[str] = []

    @property
    def device(self) -> torch.device:
        """Where parameters are materialized for compute."""
        return self._device

    def total_bytes(self) -> int:
        """Bytes of the parameters to place, each tied parameter once, in the dtype they are stored in."""
        return sum(p.numel() * self._stored_dtype(p).itemsize for p in self._model.parameters())  # tied once

    def _stored_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        """The dtype ``tensor`` is placed in: the training dtype for floating tensors, when there is one."""
        return self._dtype if self._dtype is not None and tensor.is_floating_point() else tensor.dtype

    def run(self, on_placed: Optional[Callable[[int], None]] = None) -> None:
        """Place every parameter; raise ValueError for unusable weights (nothing is left half-written).
        ``on_placed(nbytes)`` is called as each module's new parameters are in the store."""
        if self._source is not None:
            known = {n for names in self._names.values() for n in names}
            known.update(name for name, _ in self._model.named_buffers(remove_duplicate=False))
            unknown = sorted(n for n in self._source.unused() if n not in known)
            if unknown:
                raise ValueError(
                    f"{self._source.origin} has {len(unknown)} entries that match no parameter or buffer of the "
                    f"model: {unknown[:10]}; remove them or load into the model they came from"
                )
            tensors = [*self._model.named_parameters(remove_duplicate=False), *self._model.named_buffers()]
            for name, tensor in tensors:  # before anything is written, so a mismatch leaves the model as it was
                if name in self._source and self._source.shape(name) != tuple(tensor.shape):
                    raise ValueError(
                        f"{name!r}: {self._source.origin} has shape {self._source.shape(name)}, the model "
                        f"{tuple(tensor.shape)}"
                    )
            if not self._initialize_missing:
                self._check_nothing_missing()
        for name, param in self._model.named_parameters():
            if param.device.type != "meta" and param.untyped_storage().nbytes() < _extent_bytes(param):
                raise ValueError(
                    f"parameter {name!r} has no data (its storage is {param.untyped_storage().nbytes()} bytes): "
                    "is the model already wrapped by an engine? Unwrap it first. (After eng.close() the parameters "
                    "stay released: wrap a new model, e.g. built on the meta device, with EngineConfig(resume=True) "
                    "or state_dict=...)"
                )
            if param.device.type != "meta":
                self.was_materialized.add(id(param))
                self._storage_users[param.untyped_storage()._cdata] += 1
        for name, module in self._model.named_modules():
            placed = self._place_module(name, module)
            if on_placed is not None and placed:
                on_placed(placed)
        if self._source is not None and self.not_loaded and self._init_fn is None:
            names = self.not_loaded
            warnings.warn(
                f"{len(names)} parameters and buffers of the model are not in {self._source.origin} and were not "
                f"loaded, but initialized (newly, as the model initializes them, or kept as they were): "
                f"{names[:10]}{' ...' if len(names) > 10 else ''}; train them before using the model for predictions, "
                "or load weights that have them", UserWarning, stacklevel=4)

    def _check_nothing_missing(self) -> None:
        """ValueError naming the tensors on the meta device that the weight source does not set."""
        assert self._source is not None
        missing = [self._names[id(p)][0] for p in self._model.parameters()
                   if p.device.type == "meta" and self._source.find(self._names[id(p)]) is None]
        missing += [name for name, buf in self._model.named_buffers()
                    if buf.device.type == "meta" and name not in self._source]
        if missing:
            raise ValueError(
                f"{len(missing)} parameters and buffers of the model are on the meta device and not in "
                f"{self._source.origin}: {missing[:10]}{' ...' if len(missing) > 10 else ''}; nothing was loaded. "
                "Load weights that have them (a weight the model shares with another, as an output layer tied to "
                "the input embedding, needs model.tie_weights() first), or ask for them to be initialized as the "
                "model initializes them (load_checkpoint_and_dispatch(..., initialize_missing_weights=True))"
            )

    def _buffer_dtype(self, name: str, buf: torch.Tensor) -> torch.dtype:
        """The dtype buffer ``name`` is placed in (see the class docstring, ``cast_unloaded_buffers``)."""
        if not self._cast_unloaded_buffers and (self._source is None or name not in self._source):
            return buf.dtype
        return self._stored_dtype(buf)

    # ------------------------------------------------------------------ one module

    def _place_module(self, prefix: str, module: nn.Module) -> int:
        """Place ``module``'s own parameters and buffers; return the bytes of parameters new to the store."""
        mine: list[ParamHandle] = []
        new: list[ParamHandle] = []
        missing: list[str] = []  # tensors on meta that the weight source does not set
        for param in {id(p): p for p in module._parameters.values() if p is not None}.values():
            handle = self.handles.get(id(param))
            if handle is None:
                names = self._names[id(param)]
                unsourced = self._source is not None and self._source.find(names) is None
                if param.device.type == "meta" and not self._from_store and (self._source is None or unsourced):
                    missing.append(names[0])
                if unsourced:
                    self.not_loaded.append(names[0])
                handle = self._adopt(param)
                new.append(handle)
            mine.append(handle)
        self.by_module[module] = mine
        missing += [n for n in self._place_buffers(prefix, module) if self._source is None or n not in self._source]
        if self._source is not None:
            persistent = [_join(prefix, n) for n, b in module._buffers.items()
                          if b is not None and n not in module._non_persistent_buffers_set]
            self.not_loaded += [n for n in persistent if n not in self._source]

        rewrite = list(new)
        if missing:
            for handle in mine:
                if handle.state is HandleState.RELEASED:  # tied, placed by an earlier module: init may change it
                    self._refetch(handle)
                    rewrite.append(handle)
            self._init(prefix, module, missing)
        if self._source is not None:
            self._load(prefix, module, rewrite)
        placed = sum(h.layout.nbytes for h in new)
        if self._from_store:
            for handle in rewrite:
                self._check_stored(handle)
                handle.free(self._meter)
            return placed
        wait_all([self._io.write(h) for h in rewrite])
        for handle in rewrite:  # only once written: a failed placement keeps the values in the parameters
            handle.free(self._meter)
        return placed

    def _adopt(self, param: nn.Parameter) -> ParamHandle:
        """Give ``param`` exclusive contiguous storage on the compute device and a handle."""
        dtype = self._stored_dtype(param)
        nbytes = param.numel() * dtype.itemsize
        if param.device.type == "meta":
            fresh = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=self._device), param.requires_grad)
            fresh.__dict__.update(param.__dict__)  # swap_tensors swaps __dict__ too: keep the user's attributes
            torch.utils.swap_tensors(param, fresh)
            self._meter.add(nbytes)
        else:
            storage = param.untyped_storage()
            storage_dtype = param.dtype
            exclusive = (
                param.device == self._device
                and param.dtype == dtype
                and is_dense(param)
                and param.storage_offset() == 0
                and storage.nbytes() == nbytes
                and storage.resizable()
                and self._storage_users[storage._cdata] == 1
            )
            if not exclusive:  # keeps a dense layout (channels-last, transposed), else row-major
                fresh = torch.empty_like(param, dtype=dtype, device=self._device, memory_format=torch.preserve_format)
                fresh.copy_(param.detach())
                param.data = fresh
                if dtype != storage_dtype:  # cast to the training dtype: the meter counts the new size
                    self._meter.add(nbytes)
                    self._meter.sub(param.numel() * storage_dtype.itemsize)
        names = self._names[id(param)]
        layout = ShardLayout.of(param, rank=self._rank, world=self._world)
        handle = ParamHandle(param, names, layout, param_key(names[0]))
        self.handles[id(param)] = handle
        return handle

    def _place_buffers(self, prefix: str, module: nn.Module) -> list[str]:
        """Move the module's buffers to the compute device; return the names of those on meta."""
        meta = []
        for name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            moved = self._moved_buffers.get(id(buf))
            if moved is None:
                dtype = self._buffer_dtype(_join(prefix, name), buf)
                if buf.device.type == "meta":
                    meta.append(_join(prefix, name))
                    moved = torch.empty_like(buf, dtype=dtype, device=self._device)
                elif buf.device != self._device or buf.dtype != dtype:
                    moved = buf.to(self._device, dtype)
                else:
                    continue
                try:
                    torch.utils.swap_tensors(buf, moved)  # keeps aliases of the buffer object valid
                    moved = buf
                except RuntimeError:
                    module._buffers[name] = moved
                self._moved_buffers[id(buf)] = moved
            elif moved is not buf:
                module._buffers[name] = moved
        return meta

    def _check_stored(self, handle: ParamHandle) -> None:
        """Resuming: the store must hold ``handle``'s shard with its size and dtype."""
        store = self._io.store
        if handle.key not in store:
            raise ValueError(
                f"resuming: the store has no shard of parameter {handle.name!r} ({handle.key!r}); it holds another "
                "model, or the shard lived in a memory tier that a crash lost (param_tier='nvme' survives crashes)"
            )
        info = store.info(handle.key)
        if info.dtype != handle.layout.dtype or math.prod(info.shape) != handle.layout.shard_numel:
            raise ValueError(
                f"resuming: the store's shard of {handle.name!r} is {info.dtype} with {math.prod(info.shape)} "
                f"elements, the model's is {handle.layout.dtype} with {handle.layout.shard_numel} (a different "
                "model, or a different EngineConfig.train_dtype)"
            )

    def _refetch(self, handle: ParamHandle) -> None:
        handle.allocate(self._meter)
        handle.state = HandleState.FETCHING
        try:
            self._io.fetch(handle).result()
        finally:
            handle.state = HandleState.READY

    def _init(self, prefix: str, module: nn.Module, missing: list[str]) -> None:
        """Initialize ``module``'s ``missing`` tensors: ``init_fn``; else its ``reset_parameters()``,
        then a Hugging Face model's ``_init_weights`` for it and each enclosing module (which also
        sets what ``reset_parameters`` does not know, as Gemma's ``embed_scale``, and a rotary
        embedding's ``inv_freq``). The missing tensors are first filled with a
        value no initializer leaves, so any still holding it is an error rather than garbage."""
        own = {_join(prefix, n): t for n, t in (*module.named_parameters(recurse=False),
                                                 *module.named_buffers(recurse=False))}
        tensors = {name: own[name] for name in missing if name in own}
        ran: list[str] = []
        with torch.no_grad():
            for tensor in tensors.values():
                _fill_unset(tensor)
            if self._init_fn is not None:
                self._init_fn(module)
                ran.append("init_fn")
            else:
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
                    ran.append("its reset_parameters()")
                initializers = hf_initializers(self._model, prefix)
                if initializers:
                    self._run_enclosing(prefix, module, initializers)
                    ran.append("the model's _init_weights")
        if not ran:
            raise ValueError(
                f"module {prefix or '<root>'!r} ({type(module).__name__}) has tensors on the meta device that no "
                f"state dict sets and that it has no reset_parameters() for: {missing}; pass init_fn=... or a "
                "state_dict that has them"
            )
        left = [name for name, tensor in tensors.items() if _is_unset(tensor)]
        if left:
            raise ValueError(
                f"module {prefix or '<root>'!r} ({type(module).__name__}) has tensors on the meta device that no "
                f"state dict sets and that {' and '.join(ran)} left unset: {left}; pass an init_fn=... that sets "
                "them, or a state_dict that has them"
            )

    def _run_enclosing(self, prefix: str, module: nn.Module, initializers: list[tuple[InitFn, nn.Module]]) -> None:
        """Run a Hugging Face model's ``_init_weights`` for ``module`` and each module enclosing it
        (``engine.paging.init_scope``), with only ``module``'s own tensors taking their writes."""
        if self._model_tensors is None:
            self._model_tensors = frozenset(id(t) for t in (*self._model.parameters(), *self._model.buffers()))
        own = {id(t) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))}
        with InitScope(self._model_tensors, own):
            for init, enclosing in initializers:
                try:
                    init(enclosing)
                except Exception as exc:
                    raise ValueError(
                        f"module {prefix or '<root>'!r} ({type(module).__name__}): the model's _init_weights failed "
                        f"for {type(enclosing).__name__} while initializing it on the meta device ({exc}); pass "
                        "init_fn=... or a state_dict that sets its tensors"
                    ) from exc

    def _load(self, prefix: str, module: nn.Module, handles: list[ParamHandle]) -> None:
        assert self._source is not None
        with torch.no_grad():
            for handle in handles:
                found = self._source.find(handle.names)
                if found is not None:
                    _copy_checked(handle.param, self._source.read(found), found)
                    self._source.used.update(n for n in handle.names if n in self._source)  # tied: every alias
            for name, buf in module._buffers.items():
                full = _join(prefix, name)
                if buf is not None and full in self._source:
                    _copy_checked(buf, self._source.read(full), full)


def _fill_unset(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` with a value initializers do not produce (NaN; an integer type's maximum)."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).max)


def _is_unset(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds (some of) what :func:`_fill_unset` wrote; a bool tensor cannot tell."""
    if tensor.numel() == 0 or tensor.dtype == torch.bool:
        return False
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.is_floating_point():
        return bool(torch.isnan(tensor.amax()))  # amax propagates NaN: one pass, no mask (isnan().any() is 8x slower)
    return bool((tensor == torch.iinfo(tensor.dtype).max).all())


def _extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes of storage ``tensor`` reaches into (offset plus its furthest element)."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (tensor.storage_offset() + last + 1) * tensor.element_size()


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"{name!r}: the state dict's tensor has shape {tuple(src.shape)}, the model's {tuple(dst.shape)}"
        )
    dst.detach().copy_(src)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
