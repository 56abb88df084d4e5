"""engine.wrap and Engine: page an unmodified model's parameters through a tiered store.

``wrap`` writes every parameter's shard into the store (module by module, so a model built on the
meta device never has more than one module materialized), frees their storage and installs the
hooks; from then on the model is called as usual and the hooks fetch and release parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from engine.checkpoint import export, full_state
from engine.checkpoint.optimizer_state import EngineWholeState
from engine.checkpoint import sharded as checkpoint
from engine.config import EngineConfig
from engine.errors import EngineClosedError
from engine.extensions import DEFAULT_EXTENSIONS, Extensions
from engine.io.progress import byte_progress
from engine.io.weights import StateDictLike, WeightSource, open_weights
from engine.optim.accumulation import GradientAccumulation
from engine.optim.scaled_loss import scale_in_backward
from engine.paging.backward import BackwardTracker, SavedTensorHooks, register_grad_final_hooks
from engine.paging.collectives import Collectives, group_rank_and_world
from engine.paging.distributed_init import local_rank as launcher_local_rank
from engine.paging.gathered import ParamsArg, check_modifier_rank, select_handles
from engine.paging.gathered import gathered as gathered_block
from engine.paging.handle import HandleState, ParamHandle
from engine.paging.input_cast import InputCast
from engine.paging.allocator import limit_heap_retention
from engine.paging.layout import rank_store_config
from engine.paging.memory_plan import MemoryPlan
from engine.paging.module_hooks import ForwardScope, ModuleHooks
from engine.paging.pager import Pager
from engine.paging.placement import InitFn, Placement, model_device
from engine.paging.rank_agreement import rank0_random_state, take_rank0_values
from engine.paging.saved_activations import SavedActivations, discard_activations
from engine.paging.shard_io import ShardIO
from engine.paging.state_dict_hooks import StateDictHooks
from engine.paging.torch_optimizer import TorchOptimizerHooks
from engine.stats import EngineCounters, EngineStats, MemoryMeter, bytes_out_by_tier
from tiered import StoreStats, TieredStore

if TYPE_CHECKING:
    from engine.optim.training import Training


_log = logging.getLogger("engine")


class Engine:
    """A wrapped model: its parameters live in ``store`` and hooks page them in and out.

    Made by :func:`wrap`, which builds every constructor argument (the placement that put the
    parameters in the store, the memory meter, the shard I/O); an integration subclasses it and
    passes its class as ``wrap(..., engine_class=...)``. The model object, its modules and its
    ``nn.Parameter`` objects are the user's own, unchanged except that a released parameter's
    storage is 0 bytes (see [Note: Released parameters]). Every method of a closed engine raises
    :class:`engine.EngineClosedError`; invalid arguments raise ``TypeError`` or ``ValueError``
    naming them.
    """

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig,
        store: TieredStore,
        placement: Placement,
        meter: MemoryMeter,
        shard_io: ShardIO,
        optimizer: Optional[torch.optim.Optimizer],
        extensions: Extensions = DEFAULT_EXTENSIONS,
        memory_plan: Optional[MemoryPlan] = None,
    ) -> None:
        # Built by wrap() once every parameter is in the store.
        self._model = model
        self._memory_plan = memory_plan
        self._extensions = extensions
        self._config = config
        self._device = placement.device
        self._store = store
        self._meter = meter
        self._wrap_peak = meter.reset_peak()
        self._io = shard_io
        self._handles: list[ParamHandle] = list(placement.handles.values())
        self._by_id: dict[int, ParamHandle] = {id(h.param): h for h in self._handles}
        by_storage = {h.storage_id: h for h in self._handles}
        self._counters = EngineCounters()
        self._pager = Pager(shard_io, meter, self._counters, config.prefetch_bytes, store.set_access_order)
        self._tracker = BackwardTracker(self._pager)
        self._activations: Optional[SavedActivations] = None
        if config.activation_tier is not None:
            self._activations = SavedActivations(
                store, config.activation_tier, min_bytes=config.activation_min_bytes,
                window_bytes=config.activation_window_bytes,
            )
        saved = SavedTensorHooks(by_storage, self._tracker, self._activations)
        scope = ForwardScope(model, self._pager, self._tracker, saved, self._by_id, self._counters)
        self._module_hooks = [
            ModuleHooks(module, placement.by_module.get(module, []), scope) for module in model.modules()
        ]
        for handle in self._handles:  # see [Note: Activation checkpointing]
            handle.set_reader(scope.on_backward_read)
        self._grad_hooks = register_grad_final_hooks(self._handles, self._on_grad_final)
        self._state_dict_hooks = StateDictHooks(placement.by_module, self._pager, shard_io, self._refresh_masters,
                                                before=self._before_state_access)
        self._optimizer = optimizer
        self._accumulation = GradientAccumulation(config.gradient_accumulation_steps)
        self._input_cast: Optional[InputCast] = None
        cast_to = getattr(torch, config.train_dtype) if config.cast_forward_inputs else None  # type: ignore[arg-type]
        move_to = self._device if self._device.type != "cpu" else None  # inputs on the CPU stay there
        if cast_to is not None or move_to is not None:
            self._input_cast = InputCast(model, cast_to, move_to)
        self._training: Optional[Training] = None
        self._optimizer_hooks: Optional[TorchOptimizerHooks] = None
        try:  # an optimizer that does not fit the model: the model gets its hooks back off
            if _is_engine_optimizer(optimizer):
                from engine.optim.training import Training

                self._training = Training(
                    model, self._by_id, optimizer, shard_io, self._pager, config,  # type: ignore[arg-type]
                    updates_buffer_bytes=memory_plan.updates_buffer_bytes if memory_plan is not None else 0,
                    pool_bounds=(memory_plan.pool_bytes, memory_plan.after_backward_pool_bytes)
                    if memory_plan is not None and memory_plan.after_backward_pool_bytes is not None else None,
                    on_gradients_dropped=self._accumulation.restart_window,
                )
                if shard_io.collectives is not None:  # global-norm clipping sums squares over ranks
                    self._training.all_reduce = shard_io.all_reduce_sum
                optimizer._bind_whole_state(EngineWholeState(self._full_state_parts))  # type: ignore[union-attr]
                scope.on_root_forward = self._training.on_forward
            elif optimizer is not None:
                self._optimizer_hooks = TorchOptimizerHooks(optimizer, self._by_id, self._pager)
        except BaseException:
            self._remove_hooks()
            raise
        self._pool_hooks: list[Any] = []
        if memory_plan is not None and memory_plan.step_pool_bytes != memory_plan.pool_bytes and self._training:
            # [Note: One memory budget], by phase: the step's buffers, then backward's.
            self._pool_hooks = [
                optimizer.register_step_pre_hook(  # type: ignore[union-attr]
                    lambda *_: store.resize_result_pool(memory_plan.step_pool_bytes)),
                optimizer.register_step_post_hook(  # type: ignore[union-attr]
                    lambda *_: store.resize_result_pool(memory_plan.pool_bytes)),
            ]
        self._step_applied = False
        self._lr_scheduler: Optional[Any] = None
        self._baseline = bytes_out_by_tier(store.stats())
        self._last_store_stats: Optional[StoreStats] = None
        self._closed = False

    # ------------------------------------------------------------------ public

    @property
    def model(self) -> nn.Module:
        """The wrapped model (the same object that was passed to :func:`wrap`)."""
        return self._model

    @property
    def module(self) -> nn.Module:
        """The wrapped model (DeepSpeed's ``model_engine.module``); the same as :attr:`model`."""
        return self._model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)``: DeepSpeed's ``model_engine(batch)``."""
        self._check_open()
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """What the engine does not have, its model does, as with DeepSpeed's engine: so
        ``model = engine.from_pretrained(...)`` (or ``engine.load_checkpoint_and_dispatch``, in
        accelerate's ``model = load_checkpoint_and_dispatch(...)``) answers ``model.generate(...)``,
        ``model.parameters()``, ``model.gradient_checkpointing_enable()``. The engine's own names come
        first (``config`` is the EngineConfig: the model's is ``eng.model.config``); private names
        are not forwarded."""
        model = self.__dict__.get("_model")
        if model is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(model, name)
        except AttributeError:
            raise AttributeError(f"neither the engine nor its model ({type(model).__name__}) has an attribute "
                                 f"{name!r}") from None

    def train(self, mode: bool = True) -> "Engine":
        """``model.train(mode)``; returns the engine, as DeepSpeed's ``model_engine.train()`` does."""
        self._model.train(mode)
        return self

    def eval(self) -> "Engine":
        """``model.eval()``; returns the engine."""
        return self.train(False)

    @property
    def lr_scheduler(self) -> Optional[Any]:
        """An LR scheduler :meth:`step` steps after each optimizer step it applies (not after one loss
        scaling skipped), where DeepSpeed's ``model_engine.step()`` steps its own; its state goes into
        :meth:`save_checkpoint`'s ``client_state["lr_scheduler"]`` and comes back from
        :meth:`load_checkpoint`. None (the default): step your scheduler yourself
        (``if eng.step(): scheduler.step()``). ``engine.initialize`` sets it."""
        return self._lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Optional[Any]) -> None:
        if scheduler is not None and not all(
            callable(getattr(scheduler, m, None)) for m in ("step", "state_dict", "load_state_dict")
        ):
            raise TypeError(f"lr_scheduler must be an LR scheduler (step, state_dict, load_state_dict) or None, "
                            f"got {type(scheduler).__name__}")
        self._lr_scheduler = scheduler

    def get_lr(self) -> list[float]:
        """The learning rate of each of the optimizer's parameter groups (DeepSpeed's ``get_lr()``)."""
        if self._optimizer is None:
            raise RuntimeError("eng.get_lr() needs an optimizer: pass optimizer=engine.AdamW(...) to engine.wrap")
        return [group["lr"] for group in self._optimizer.param_groups]

    @property
    def config(self) -> EngineConfig:
        """The configuration the engine was made with, with the sizes its memory plan chose
        (``prefetch_bytes``, ``optimizer_group_bytes``, ``optimizer_prefetch_groups``)."""
        return self._config

    @property
    def memory_plan(self) -> Optional[MemoryPlan]:
        """How ``store.host_bytes`` was divided among the host tier, staging, the buffer pool, the
        transients and the codec (engine/paging/memory_plan.py); None for an engine not made by wrap."""
        return self._memory_plan

    @property
    def extensions(self) -> Extensions:
        """What the engine consults for the model's library (:mod:`engine.extensions`): the weight
        layout :meth:`save_weights` writes."""
        return self._extensions

    @property
    def store(self) -> TieredStore:
        """The store holding the parameter shards (keys ``param/<name>``)."""
        return self._store

    @property
    def closed(self) -> bool:
        """True after :meth:`unwrap` or :meth:`close`."""
        return self._closed

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer passed to :func:`wrap` (an ``engine.AdamW`` is bound to the model)."""
        return self._optimizer

    @property
    def world_size(self) -> int:
        """Processes the parameters are sharded over (1 in one process). DeepSpeed's name."""
        return self._io.world

    @property
    def device(self) -> torch.device:
        """Where the model computes (parameters are materialized there): ``EngineConfig.compute_device``,
        or the device the model was on. DeepSpeed's ``model_engine.device``: move inputs here."""
        return self._device

    @property
    def local_rank(self) -> int:
        """This process's index on its machine (``LOCAL_RANK``, as torchrun sets it; 0 without a
        launcher). DeepSpeed's ``model_engine.local_rank``."""
        return launcher_local_rank()

    @property
    def global_rank(self) -> int:
        """This process's rank in the default process group (0 without one). DeepSpeed's name."""
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def step_mode(self) -> str:
        """Which way the next ``engine.AdamW`` step runs, and why: its updates inside backward, or the
        step after backward (``EngineConfig.step_in_backward``; docs/training.md). One line; wrap logs
        it (logger "engine") and ``tiered train`` prints it. "no engine.AdamW" without one."""
        return self._training.step_mode if self._training is not None else "no engine.AdamW"

    @property
    def completed_steps(self) -> int:
        """Optimizer steps of ``engine.AdamW`` completed on this store, including those of the run a
        resumed engine continues (0 without an engine optimizer)."""
        return self._training.completed_steps if self._training is not None else 0

    @property
    def loss_scale(self) -> Optional[float]:
        """The current loss scale with ``EngineConfig.loss_scaling`` (None without)."""
        scaler = self._training.scaler if self._training is not None else None
        return scaler.scale if scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps loss scaling skipped for an overflow, over the run (0 without loss
        scaling); DeepSpeed's ``model_engine.skipped_steps``."""
        scaler = self._training.scaler if self._training is not None else None
        return scaler.skipped_steps if scaler is not None else 0

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``, DeepSpeed's ``model_engine.backward``: the loss is divided by
        ``EngineConfig.gradient_accumulation_steps`` and multiplied by :attr:`loss_scale` when
        ``EngineConfig.loss_scaling`` is set (with either, this and not ``loss.backward()`` must be
        called; the step divides the gradients by the same scale)."""
        self._check_open()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"eng.backward takes the loss tensor, got {type(loss).__name__}")
        loss = self._accumulation.divide(loss)
        training = self._training
        self._accumulation.in_engine_backward = True
        try:
            if training is None or training.scaler is None:
                loss.backward(**kwargs)
                return
            scaled = loss * training.scaler.scale
            training.scaled_backward = True
            try:
                scaled.backward(**kwargs)
            finally:
                training.scaled_backward = False
        finally:
            self._accumulation.in_engine_backward = False

    def with_loss_scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` for a training loop that calls ``loss.backward()`` itself (the Hugging Face
        Trainer: :class:`engine.integrations.hf.EngineTrainer` uses it): the same value, and a backward
        through it multiplies the gradient by :attr:`loss_scale`, as :meth:`backward` does. Returns
        ``loss`` as it is without ``EngineConfig.loss_scaling``. Gradient accumulation in the
        engine (``EngineConfig.gradient_accumulation_steps`` > 1) still needs :meth:`backward`."""
        self._check_open()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"eng.with_loss_scale takes the loss tensor, got {type(loss).__name__}")
        training = self._training
        if training is None or training.scaler is None or not loss.requires_grad:
            return loss
        return scale_in_backward(loss, training)

    def step(self) -> bool:
        """One optimizer step: ``optimizer.step()``, so LR schedulers and step hooks see it. With
        ``engine.AdamW`` the gradient shards stream through the offloaded AdamW and the new
        parameters go to the store (docs/training.md); with a torch optimizer its hooks fetch the
        parameters, torch updates them and they are written back.

        With ``EngineConfig.gradient_accumulation_steps = N > 1``, DeepSpeed's ``model_engine.step``:
        call it after every micro-batch; every N-th call steps the optimizer and then zeroes the
        gradients, the others only count. Returns True when the optimizer stepped and the step was
        applied, False as well for a step loss scaling skipped for an overflow: step an LR scheduler
        on True, and it advances where DeepSpeed's ``model_engine.step()`` advances it."""
        self._check_open()
        if self._optimizer is None:
            raise RuntimeError("eng.step() needs an optimizer: pass optimizer=engine.AdamW(...) to engine.wrap")
        accumulation = self._accumulation
        if not accumulation.is_boundary():
            accumulation.count_step()
            if self._training is not None:
                self._training.end_micro_batch()
            return False
        skipped = self.skipped_steps
        self._optimizer.step()
        accumulation.count_step()
        self._step_applied = self.skipped_steps == skipped
        if accumulation.managed:
            self.zero_grad()
        if self._step_applied and self._lr_scheduler is not None:
            self._lr_scheduler.step()
        return self._step_applied

    def was_step_applied(self) -> bool:
        """Whether the last :meth:`step` that reached the optimizer changed the parameters: False
        after one loss scaling skipped for an overflow, and before the first. DeepSpeed's
        ``model_engine.was_step_applied()``."""
        return self._step_applied

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next :meth:`step` steps the optimizer (always, without gradient
        accumulation). DeepSpeed's ``model_engine.is_gradient_accumulation_boundary()``."""
        return self._accumulation.is_boundary()

    def gathered(
        self, params: ParamsArg = None, *, writeback: bool = False, modifier_rank: Optional[int] = None
    ) -> "contextlib.AbstractContextManager[list[nn.Parameter]]":
        """Hold full parameters in memory for a ``with`` block (DeepSpeed's ``zero.GatheredParameters``,
        FSDP's ``summon_full_params``): ``params`` is None (all), a parameter, a module or an iterable
        of parameters; the block gets the list of parameters, readable and writable as plain tensors.
        On exit they are released. ``writeback=True`` writes them back to the store (each rank its shard
        of its own copy: every rank must make the same change); ``modifier_rank=r`` broadcasts rank r's
        values first and writes them back (only rank r needs to change them). Otherwise changes are
        discarded. With ``engine.AdamW`` written parameters also reset their fp32 master weights.
        At world size > 1 every rank must enter it with the same parameters (it all-gathers).
        Use it between steps (not inside the wrapped forward)."""
        self._check_open()
        if not isinstance(writeback, bool):
            raise TypeError(f"writeback must be a bool, got {type(writeback).__name__}")
        check_modifier_rank(modifier_rank, self._io.world)
        handles = select_handles(params, self._by_id, self._handles)
        if self._training is not None:  # the block reads (or writes) the last committed step's parameters
            self._training.complete_pending("write" if writeback or modifier_rank is not None else "read")
        return gathered_block(
            handles, self._pager, self._io, writeback=writeback, modifier_rank=modifier_rank,
            after_write=self._refresh_masters,
        )

    def _before_state_access(self, intent: str) -> None:
        """``model.state_dict()`` ("read") or ``model.load_state_dict()`` ("write") is about to run: bring the
        store to one step's state first (``Training.complete_pending``)."""
        training = getattr(self, "_training", None)
        if training is not None:
            training.complete_pending(intent)

    def _refresh_masters(self, handles: list[ParamHandle]) -> None:
        """Parameters were written from outside a step: their fp32 master weights (``engine.AdamW``)
        follow the values that changed (Adam moments are kept), so the next step does not undo them
        (see [Note: Masters of written parameters])."""
        if self._training is not None:
            self._training.masters_follow_params(h.name for h in handles)

    # ------------------------------------------------------------------ one parameter's whole state

    def full_fp32_param(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """The fp32 weights of ``param`` the next step starts from (``engine.AdamW``'s master; before
        the parameter's first step, or with a torch optimizer, its value in fp32), whole, on the
        compute device; None for a frozen parameter. DeepSpeed's ``safe_get_full_fp32_param``. Like
        every ``full_*`` call: between steps, and at world size > 1 on every rank (it gathers)."""
        return full_state.full_fp32_param(self._full_state_parts(), self._handle_of(param))

    def full_grad(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """The fp32 gradient of ``param`` the next step will use: accumulated over the window's
        micro-batches, averaged over ranks, without the fp16 loss scale; None when it has none (the
        model's ``.grad`` is None under ``engine.AdamW``: the gradients are in the store).
        DeepSpeed's ``safe_get_full_grad``."""
        return full_state.full_grad(self._full_state_parts(), self._handle_of(param))

    def full_optimizer_state(self, param: nn.Parameter, key: str) -> Optional[torch.Tensor]:
        """The optimizer state ``key`` of ``param``, whole: ``"exp_avg"`` or ``"exp_avg_sq"`` under
        ``engine.AdamW`` (zeros before the parameter's first step), any key of a torch optimizer's
        ``state[param]``. DeepSpeed's ``safe_get_full_optimizer_state``."""
        return full_state.full_optimizer_state(self._full_state_parts(), self._handle_of(param), key)

    def set_full_fp32_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Set ``param`` to ``value`` (its shape): the parameter in the training dtype, so the next
        forward uses it, and ``engine.AdamW``'s fp32 master exactly (DeepSpeed's
        ``safe_set_full_fp32_param`` sets the master alone, which its next step copies into the
        parameter). Every rank passes the same value."""
        handle = self._handle_of(param)
        full_state.check_value(handle, value)
        parts = self._full_state_parts()
        checkpoint.check_between_steps(parts, "set a parameter's fp32 weights", intent="write")

        def exact_master(_: list[ParamHandle]) -> None:  # in place of gathered's master from the cast values
            full_state.set_full_fp32_param(parts, handle, value)

        with gathered_block([handle], self._pager, self._io, writeback=True, modifier_rank=None,
                            after_write=exact_master), torch.no_grad():
            param.copy_(value)

    def set_full_grad(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` (``param``'s shape) the gradient the next step uses, as
        ``param.grad.copy_(value)`` before a plain step (a later backward adds to it). Every rank
        passes the same value (the averaged gradient). DeepSpeed's ``safe_set_full_grad``."""
        full_state.set_full_grad(self._full_state_parts(), self._handle_of(param), value)

    def set_full_optimizer_state(self, param: nn.Parameter, value: torch.Tensor, key: str) -> None:
        """Make ``value`` (``param``'s shape) the optimizer state ``key`` of ``param``; under
        ``engine.AdamW`` once the parameter has taken a step. Every rank passes the same value.
        DeepSpeed's ``safe_set_full_optimizer_state``."""
        full_state.set_full_optimizer_state(self._full_state_parts(), self._handle_of(param), value, key)

    def _full_state_parts(self) -> checkpoint.EngineParts:
        self._check_open()
        if self._training is not None:
            self._training.grads.flush()  # backward's last puts, and any error they had
        return self._checkpoint_parts()

    def _handle_of(self, param: object) -> ParamHandle:
        handle = self._by_id.get(id(param)) if isinstance(param, nn.Parameter) else None
        if handle is None:
            what = f"shape {tuple(param.shape)}" if isinstance(param, torch.Tensor) else type(param).__name__
            raise ValueError(f"not a parameter of the wrapped model ({what}); pass one of model.parameters()")
        return handle

    def drop_prefetched(self) -> None:
        """Free every parameter prefetched ahead of its next use, so the next forward starts cold
        (forward-only loops keep the next forward's first parameters prefetched between calls)."""
        self._check_open()
        self._pager.drop_prefetched()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``: with ``engine.AdamW`` the gradient shards in the store go;
        without an optimizer, the model's ``zero_grad``."""
        self._check_open()
        self._accumulation.check_zero_grad()
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=set_to_none)
        else:
            self._model.zero_grad(set_to_none=set_to_none)

    def state_dict(self, *, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The model's whole state as ``{name: tensor}`` on the CPU, every parameter consolidated
        (gathered across ranks): a plain model's ``load_state_dict`` accepts it. Parameters are in
        the training dtype. ``exclude_frozen_parameters`` (DeepSpeed's name): without the
        parameters that take no gradient (a LoRA fine-tune's base weights; what PEFT's
        ``save_pretrained(state_dict=...)`` keeps is among the rest). With several ranks every rank
        must call it and each gets the whole dict. An optimizer step that stopped part way is
        finished first (docs/training.md, "The optimizer step")."""
        self._check_open()
        if self._training is not None:
            self._training.complete_pending("read")
        return checkpoint.consolidated_state_dict(self._model, self._handles, self._io,
                                                  exclude_frozen_parameters=exclude_frozen_parameters)

    def save_weights(
        self, path: "str | os.PathLike[str]", *, max_shard_bytes: int = export.DEFAULT_MAX_SHARD_BYTES,
        dtype: Optional[torch.dtype] = None, master_weights: bool = False, exclude_frozen_parameters: bool = False,
    ) -> list[str]:
        """Write the model's weights to the directory ``path`` in Hugging Face's safetensors layout
        (``model.safetensors``, or shards of at most ``max_shard_bytes`` and
        ``model.safetensors.index.json``), one parameter at a time: memory never holds the whole
        model, unlike :meth:`state_dict`. ``from_pretrained(path)`` loads them once the model's
        ``config.json`` is there, and so does ``engine.wrap(model, state_dict=path)``. Floating
        tensors are cast to ``dtype`` when given (default: the training dtype). With
        ``master_weights``, parameters ``engine.AdamW`` has stepped come from their fp32 master
        weights (the bits a bf16 or fp16 copy rounds away; fp32 unless ``dtype``).
        ``exclude_frozen_parameters``: leave out the parameters that take no gradient. Every rank
        calls it; rank 0 writes. Returns the files written. DeepSpeed's ``save_16bit_model``."""
        self._check_open()
        return export.save_weights(self._checkpoint_parts(), path, max_shard_bytes=max_shard_bytes, dtype=dtype,
                                   master_weights=master_weights, exclude_frozen_parameters=exclude_frozen_parameters,
                                   extensions=self._extensions)

    def save_checkpoint(
        self, path: "str | os.PathLike[str]", tag: Optional[str] = None,
        client_state: Optional[Mapping[str, Any]] = None, *, overwrite: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> None:
        """Save a sharded checkpoint to the directory ``path``, atomically: one safetensors file per
        rank (its parameter shards, ``engine.AdamW`` state and buffers) and ``metadata.json``. With
        ``tag``, to ``path/tag``, and ``path/latest`` then names it (DeepSpeed's layout).
        ``client_state``: a dict of your own, JSON values and tensors (epoch, data position, an LR
        scheduler's ``state_dict()``, ``torch.get_rng_state()``), that :meth:`load_checkpoint`
        returns (tensors on the CPU; never pickled: ``engine.io.client_state``). ``exclude_frozen_parameters``
        (DeepSpeed's name): leave out the parameters that take no gradient (a LoRA fine-tune's base
        weights); :meth:`load_checkpoint` then keeps the model's own values for them. Every rank
        calls it, between steps. With :attr:`lr_scheduler` set, its ``state_dict()`` is saved as
        ``client_state["lr_scheduler"]`` (unless ``client_state`` has that key). A checkpoint
        already at the place is replaced only with ``overwrite`` (``FileExistsError`` otherwise;
        ``engine.initialize``'s engine replaces it, as DeepSpeed does). docs/training.md, "Checkpoints"."""
        self._save_checkpoint(path, tag, client_state, overwrite=overwrite,
                              exclude_frozen_parameters=exclude_frozen_parameters)

    def _save_checkpoint(
        self, path: "str | os.PathLike[str]", tag: Optional[str], client_state: Optional[Mapping[str, Any]], *,
        overwrite: bool, exclude_frozen_parameters: bool, save_latest: bool = True,
    ) -> None:
        self._check_open()
        if self._lr_scheduler is not None and "lr_scheduler" not in (client_state or {}):
            client_state = {**(client_state or {}), "lr_scheduler": self._lr_scheduler.state_dict()}
        checkpoint.save_checkpoint(self._checkpoint_parts(), path, overwrite=overwrite, tag=tag,
                                   client_state=client_state, exclude_frozen_parameters=exclude_frozen_parameters,
                                   save_latest=save_latest)

    def load_checkpoint(
        self, path: "str | os.PathLike[str]", tag: Optional[str] = None, *, load_optimizer: bool = True,
    ) -> dict[str, Any]:
        """Load a checkpoint saved by :meth:`save_checkpoint` (same model, any world size: each rank
        reads the saved shards overlapping its own): weights, buffers and, with ``load_optimizer``,
        the ``engine.AdamW`` state, step counts and hyperparameters (a frozen parameter a save with
        ``exclude_frozen_parameters`` left out keeps its value). ``path`` is the checkpoint, or
        ``path/tag``, or the tag ``path/latest`` names. Returns the saved ``client_state`` (``{}``
        if none); with ``load_optimizer``, :attr:`lr_scheduler` (when set) takes its
        ``"lr_scheduler"`` entry, as DeepSpeed's ``load_checkpoint`` restores its scheduler. Raises
        ``engine.CheckpointError`` naming any mismatch."""
        return self._load_checkpoint(path, tag, load_optimizer=load_optimizer, load_lr_scheduler=load_optimizer)

    def _load_checkpoint(
        self, path: "str | os.PathLike[str]", tag: Optional[str], *, load_optimizer: bool, load_lr_scheduler: bool,
        load_step_count: bool = False,
    ) -> dict[str, Any]:
        self._check_open()
        client_state = checkpoint.load_checkpoint(self._checkpoint_parts(), path, load_optimizer=load_optimizer,
                                                  tag=tag, load_step_count=load_step_count)
        if load_lr_scheduler and self._lr_scheduler is not None and "lr_scheduler" in client_state:
            self._lr_scheduler.load_state_dict(client_state["lr_scheduler"])
        return client_state

    def _checkpoint_parts(self) -> checkpoint.EngineParts:
        return checkpoint.EngineParts(
            self._model, self._handles, self._io, self._pager, self._config, self._training, self._optimizer
        )

    def get_global_grad_norm(self) -> Optional[float]:
        """The 2-norm of the whole gradient the last ``engine.AdamW`` step used (every parameter, every
        rank; after loss-scale unscaling, before clipping): what ``clip_grad_norm_`` returns. Non-finite
        for a step skipped for overflow; None before the first step or without ``engine.AdamW``.
        DeepSpeed's name; also ``eng.stats().grad_norm``."""
        return self._training.last_grad_norm if self._training is not None else None

    def pending_grad_norm(self) -> Optional[float]:
        """The 2-norm of the gradient the next ``engine.AdamW`` step will use (every parameter, every
        rank; unscaled, before clipping): what ``clip_grad_norm_`` returns before a plain model's
        step, and what :meth:`get_global_grad_norm` reports after it. Non-finite when loss scaling
        will skip the step; None without ``engine.AdamW``. At world size > 1 every rank must call it
        (the ranks' sums are added)."""
        self._check_open()
        return self._training.pending_grad_norm() if self._training is not None else None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the wrapped model (FSDP's ``model.clip_grad_norm_``):
        call it where a plain loop clips, after the last backward before a step (under accelerate,
        in place of ``accelerator.clip_grad_norm_(model.parameters(), max_norm)``, which finds no
        gradients on the model). Returns the total norm of the whole gradient (every parameter,
        every rank, unscaled) as a 0-dim fp32 tensor; ``math.inf`` only measures it.

        With ``engine.AdamW`` the gradients are in the store: the next step clips them (to the
        smaller of ``max_norm`` and ``EngineConfig.max_grad_norm``) as it reads them, and a backward
        before that step is refused. Only the 2-norm. Every rank calls it at world size > 1.
        With a torch optimizer the gradients are the parameters' ``.grad``, and this is torch's."""
        self._check_open()
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be a number > 0 (or math.inf), got {max_norm!r}")
        if self._training is None:
            return torch.nn.utils.clip_grad_norm_(self._model.parameters(), max_norm, norm_type=norm_type)
        if norm_type != 2:
            raise ValueError(
                f"clip_grad_norm_: engine.AdamW clips by the 2-norm only (EngineConfig.max_grad_norm's), got "
                f"norm_type={norm_type!r}"
            )
        return torch.tensor(self._training.clip_next_step(float(max_norm)), dtype=torch.float32)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters and the store's (see :class:`EngineStats`)."""
        store_stats = self._last_store_stats if self._closed else self._store.stats()
        assert store_stats is not None
        now = bytes_out_by_tier(store_stats)
        return EngineStats(
            **dataclasses.asdict(self._counters),  # EngineStats repeats every counter under its own name
            bytes_fetched={tier: now[tier] - self._baseline[tier] for tier in now},
            materialized_bytes=self._meter.current,
            peak_materialized_bytes=self._meter.peak,
            wrap_peak_materialized_bytes=self._wrap_peak,
            store=store_stats,
            **self._activation_stats(),
            **self._training_stats(),
        )

    def _activation_stats(self) -> dict[str, Any]:
        a = self._activations
        if a is None:
            return {}
        return dict(
            activation_bytes_offloaded=a.bytes_offloaded,
            activation_bytes_read=a.bytes_read,
            activation_stall_seconds=a.stall_seconds,
            activation_peak_write_bytes=a.peak_write_bytes,
        )

    def _training_stats(self) -> dict[str, Any]:
        if self._training is None:
            return {}
        t = self._training.counters
        return dict(
            optimizer_steps=t.steps,
            optimizer_seconds=t.seconds,
            optimizer_bytes_read=t.bytes_read,
            optimizer_bytes_written=t.bytes_written,
            optimizer_stall_seconds=t.stall_seconds,
            optimizer_update_seconds=t.update_seconds,
            grad_bytes_offloaded=self._training.grads.bytes_offloaded,
            skipped_steps=self.skipped_steps,
            loss_scale=self.loss_scale,
            grad_norm=self._training.last_grad_norm,
        )

    def unwrap(self) -> nn.Module:
        """Materialize every parameter, remove every hook, close the store; return the plain model."""
        self._check_open()
        if self._training is not None:  # the model comes out as the last committed step left it
            self._training.complete_pending("discard")
        with self._pager.lock:
            self._settle()
            self._pager.materialize(self._handles)
            for handle in self._handles:
                handle.users = 0
        self._shutdown()
        return self._model

    def close(self) -> None:
        """Remove every hook and close the store; the parameters become meta tensors (shapes and dtypes,
        no values: like a model built under ``torch.device("meta")``), their values stay in the store
        directory. Wrap the model again to use it (``EngineConfig(resume=True)`` or ``state_dict=``), or
        call :meth:`unwrap` instead to keep the values in the model. Idempotent."""
        if self._closed:
            return
        with self._pager.lock:
            self._settle()
        self._shutdown()
        for handle in self._handles:
            if handle.state is HandleState.RELEASED:
                handle.detach_released()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._handles)} parameters"
        return f"Engine({type(self._model).__name__}, {state}, store={self._store.config.path!r})"

    # ------------------------------------------------------------------ seams

    def _on_grad_final(self, handle: ParamHandle) -> None:
        """A parameter's gradient is final for this backward (post-accumulate-grad).

        Multi-rank training reduce-scatters ``handle.param.grad`` and hands the gradient shard to
        the store here, before the backward hold is released (see [Note: Backward holds]).
        """
        if self._optimizer is not None:
            self._accumulation.check_final_grad()
        if self._training is not None:
            self._training.on_final_grad(handle, self._accumulation.is_boundary())
        elif handle.param.grad is not None:  # no engine optimizer: param.grad is the mean over ranks, as with DDP
            self._io.average_grad(handle.param.grad)
        self._pager.end_backward_hold(handle)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this engine was unwrapped or closed; call engine.wrap again")

    def _settle(self) -> None:
        if self._optimizer_hooks is not None:
            self._optimizer_hooks.drop()
        self._tracker.reset()
        self._pager.drop_prefetched()
        self._pager.schedule.finish()
        if self._activations is not None:
            self._activations.close()

    def _shutdown(self) -> None:
        self._closed = True
        if self._training is not None:
            self._training.close()
        self._remove_hooks()
        self._last_store_stats = self._store.stats()
        self._io.close()
        self._store.sync.close()

    def _remove_hooks(self) -> None:
        for hooks in self._module_hooks:
            hooks.remove()
        for handle in self._handles:
            handle.set_reader(None)
        for remover in self._grad_hooks:
            remover.remove()
        self._state_dict_hooks.remove()
        if self._optimizer_hooks is not None:
            self._optimizer_hooks.remove()
        if self._input_cast is not None:
            self._input_cast.remove()
        for hook in getattr(self, "_pool_hooks", ()):
            hook.remove()

    def _start_training(self, resume: bool) -> None:
        """Fresh: commit an empty step record. Resume: take up the store's (Training.start)."""
        if self._training is not None:
            self._training.start(resume)
        elif resume:
            raise ValueError(
                "EngineConfig(resume=True) resumes training with engine.AdamW: pass optimizer=engine.AdamW(...)"
            )


#: Builds the engine :func:`wrap` returns from :class:`Engine`'s constructor arguments: ``Engine``, a
#: subclass, or a ``functools.partial`` of one that fills the subclass's own arguments.
EngineFactory = Callable[..., Engine]


def wrap(
    model: nn.Module,
    *,
    config: EngineConfig,
    optimizer: Optional[torch.optim.Optimizer] = None,
    process_group: Optional[Any] = None,
    init_fn: Optional[InitFn] = None,
    state_dict: Optional[StateDictLike] = None,
    extensions: Extensions = DEFAULT_EXTENSIONS,
    engine_class: EngineFactory = Engine,
    initialize_missing: bool = True,
    cast_unloaded_buffers: bool = True,
) -> Engine:
    """Keep ``model``'s parameters in a tiered store and page them in around each use.

    Args:
        model: the model, unmodified; its ``nn.Parameter`` objects stay the same objects. It may be
            built on the meta device (then ``init_fn`` or ``state_dict`` gives it its values).
        config: the engine's configuration; the store is opened from ``config.store`` with the sizes
            of the host memory plan (``config.host_budget``: engine/paging/memory_plan.py).
        optimizer: ``engine.AdamW(...)`` (offloaded: its state lives in the store), or a
            ``torch.optim.Optimizer`` built on the model's parameters before wrap (its step fetches
            them and writes them back), or None (inference).
        process_group: the ``torch.distributed`` group to shard over; None uses the default group
            when ``torch.distributed`` is initialized (each rank then keeps 1/world of every
            parameter in the ``rank{N}`` subdirectory of the store's paths), and no sharding
            otherwise; a group of size 1 does not shard (docs/training.md, "Multiple processes").
        init_fn: ``init_fn(module)`` initializes a module whose parameters are on the meta device
            (default: its ``reset_parameters()``, then for a Hugging Face model its ``_init_weights``
            for the module and the modules enclosing it, as transformers initializes a model).
        state_dict: parameter and buffer values, read one tensor at a time: a mapping, or a path to a
            .safetensors or torch file, a ``save_pretrained`` directory or an ``eng.save_checkpoint``
            directory (:func:`engine.io.weights.open_weights`).
        extensions: what depends on the model's library (:mod:`engine.extensions`): by default the
            transformers weight layout, so a transformers 5 model loads checkpoints in the layout
            ``save_pretrained`` writes and :meth:`Engine.save_weights` writes that layout back.
        engine_class: builds the engine from :class:`Engine`'s constructor arguments (an ``Engine``
            subclass or a partial of one); ``engine.initialize`` passes its DeepSpeed-shaped engine.
        initialize_missing: False makes a tensor on the meta device that ``state_dict`` does not set
            a ValueError rather than initialized (accelerate's loading rule).
        cast_unloaded_buffers: False makes ``EngineConfig.train_dtype`` cast only the buffers
            ``state_dict`` sets (accelerate's rule: a rotary ``inv_freq`` stays fp32).

    Returns:
        The engine; the model object is the one passed, called as usual.

    Raises:
        MemoryBudgetError: ``config.store.host_bytes`` is below what the model needs under ``config``
            (a ValueError naming the minimum and what takes it); nothing is written.
        TypeError: an argument of the wrong type (named in the message).
        ValueError: a configuration the engine cannot honour (a shard larger than its tier's budget,
            ``resume=True`` without ``engine.AdamW``, an optimizer holding none of the model's
            parameters, ...), or weights that do not fit the model; nothing is left changed.
        tiered.TieredError: the store could not be opened (locked, damaged, full).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap takes an nn.Module, got {type(model).__name__}")
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an engine.EngineConfig, got {type(config).__name__}")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be callable (module) -> None, got {type(init_fn).__name__}")
    if not isinstance(extensions, Extensions):
        raise TypeError(f"extensions must be an engine.extensions.Extensions, got {type(extensions).__name__}")
    _check_optimizer(optimizer)
    _check_optimizer_params(model, optimizer)
    _check_loss_scaling(config, optimizer)
    if config.resume and (state_dict is not None or not _is_engine_optimizer(optimizer)):
        raise ValueError(
            "EngineConfig(resume=True) takes parameters and optimizer state from the store: pass "
            "optimizer=engine.AdamW(...) and no state_dict"
        )
    group, rank, world = _rank_and_world(process_group)
    device = torch.device(config.compute_device) if config.compute_device is not None else model_device(model)
    plan = _check_fits(model, config, world, training=_is_engine_optimizer(optimizer), device=device)
    if plan.mode == "total":
        limit_heap_retention()  # [Note: One memory budget]: freed transients go back to the system
    store_config = plan.store_config(config.store)
    config = plan.engine_config(config)
    source = open_weights(state_dict)
    if source is not None:  # a library's on-disk layout, under the model's own names
        source = extensions.loading(model, source)
    collectives = Collectives(group) if group is not None else None  # its thread starts on first use
    try:
        store = TieredStore.open(rank_store_config(store_config, rank, world))
    except BaseException:
        # A source the caller opened stays open: a wrap refused before it began (the store locked by
        # another engine) may be retried with it, as the DeepSpeed integration does in another directory.
        if source is not None and not isinstance(state_dict, WeightSource):
            source.close()
        raise
    try:
        shard_io = ShardIO(store, config.param_tier, collectives, cache=config.cache_tier)
        meter = MemoryMeter(
            sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()
                if p.device.type != "meta")
        )
        from engine.optim.stored_state import check_resumable, discard_training_state, roll_back_interrupted_step

        if config.resume:
            check_resumable(store)
            roll_back_interrupted_step(store)  # updates inside backward a crash came in the middle of
        else:
            discard_training_state(store)  # this wrap's parameters replace the earlier run's
        discard_activations(store)
        if collectives is not None and not config.resume:
            take_rank0_values(model, collectives)
        placement = Placement(
            model, device=device, shard_io=shard_io, meter=meter, rank=rank, world=world, source=source,
            init_fn=init_fn, dtype=_train_dtype(config), from_store=config.resume,
            initialize_missing=initialize_missing, cast_unloaded_buffers=cast_unloaded_buffers,
        )
        try:
            bar = byte_progress("wrap: parameters to the store", placement.total_bytes(),
                                enabled=config.progress and not config.resume, rank=rank)
            same_draws = contextlib.nullcontext()
            if collectives is not None and not config.resume and _has_meta_tensors(model):
                same_draws = rank0_random_state(collectives, device)  # meta tensors: drawn alike on every rank
            with bar, same_draws:
                placement.run(on_placed=bar.advance)
            engine = engine_class(model, config, store, placement, meter, shard_io, optimizer, extensions=extensions,
                                  memory_plan=plan)
            try:
                engine._start_training(config.resume)
            except BaseException:
                engine._remove_hooks()
                raise
            _log.info("engine.wrap: %s parameters in %s; optimizer steps: %s%s",
                      f"{sum(h.layout.numel for h in engine._handles):,}", store.config.path, engine.step_mode,
                      f"; AdamW math: {optimizer.math_path}" if _is_engine_optimizer(optimizer) else "")
            return engine
        except BaseException:
            _restore(placement, shard_io, meter)
            raise
    except BaseException:
        if collectives is not None:
            collectives.close()
        store.sync.close()
        raise
    finally:
        if source is not None:
            source.close()


def _has_meta_tensors(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def _is_engine_optimizer(optimizer: object) -> bool:
    """True for an ``engine.AdamW`` (imported lazily: paging alone needs no optimizer modules)."""
    if optimizer is None or not hasattr(optimizer, "_bind"):
        return False
    from engine.optim.adamw import AdamW

    return isinstance(optimizer, AdamW)


def _check_loss_scaling(config: EngineConfig, optimizer: object) -> None:
    if config.step_in_backward and not _is_engine_optimizer(optimizer):
        raise ValueError(
            "EngineConfig.step_in_backward applies engine.AdamW's updates inside backward: pass "
            f"optimizer=engine.AdamW(...) (got {type(optimizer).__name__ if optimizer is not None else 'no optimizer'})"
        )
    if config.loss_scaling is not None and not _is_engine_optimizer(optimizer):
        raise ValueError(
            "EngineConfig.loss_scaling is applied by engine.AdamW's step: pass optimizer=engine.AdamW(...) "
            f"(got {type(optimizer).__name__ if optimizer is not None else 'no optimizer'})"
        )
    if config.train_dtype == "float16" and config.loss_scaling is None and _is_engine_optimizer(optimizer):
        warnings.warn(
            "EngineConfig(train_dtype='float16') without loss_scaling: small fp16 gradients underflow to zero. "
            "Pass loss_scaling=engine.LossScaling() and call eng.backward(loss), or train in bfloat16",
            UserWarning, stacklevel=3,
        )


def _train_dtype(config: EngineConfig) -> Optional[torch.dtype]:
    return getattr(torch, config.train_dtype) if config.train_dtype is not None else None


def _check_optimizer(optimizer: object) -> None:
    if optimizer is None:
        return
    if _is_engine_optimizer(optimizer):
        if optimizer.bound:  # type: ignore[attr-defined]
            raise ValueError("this engine.AdamW is already bound to a model; create one optimizer per engine.wrap")
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def _check_optimizer_params(model: nn.Module, optimizer: object) -> None:
    """A torch optimizer must hold some of the model's parameters (one built on a copy of the model
    would step the copy while the wrapped model never changes)."""
    if optimizer is None or _is_engine_optimizer(optimizer):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]  # type: ignore[attr-defined]
    mine = {id(p) for p in model.parameters()}
    if params and not any(id(p) in mine for p in params):
        raise ValueError(
            f"none of the optimizer's {len(params)} parameters is a parameter of the model being wrapped: build it "
            "on model.parameters() (before wrap), or pass optimizer=engine.AdamW(...)"
        )


def _rank_and_world(process_group: Any) -> tuple[Any, int, int]:
    """(group to shard over or None, rank, world): the default group when None and torch.distributed
    is initialized."""
    return group_rank_and_world(process_group)


def _check_fits(model: nn.Module, config: EngineConfig, world: int, *, training: bool,
                device: torch.device) -> MemoryPlan:
    """The memory plan, after refusing, before anything is written, a budget below the model's
    minimum (MemoryBudgetError) and what the store would refuse later: a memory tier without a
    budget for the parameters, or a shard larger than its tier's whole budget (for a gradient shard
    that would surface in the middle of backward, with the gradient lost)."""
    from engine.paging.memory_estimate import estimate_memory

    est = estimate_memory(model, config.replace(compute_device=str(device)), world_size=world, training=training)
    est.plan.check()
    if est.problems:
        raise ValueError("; ".join(est.problems) + " (engine.estimate_memory shows what each tier needs)")
    return est.plan


def _restore(placement: Placement, shard_io: ShardIO, meter: MemoryMeter) -> None:
    """After a failed placement, give parameters that had values before wrap their values back."""
    for handle in placement.handles.values():
        if handle.state is HandleState.RELEASED and id(handle.param) in placement.was_materialized:
            try:
                handle.allocate(meter)
                shard_io.fetch(handle).result()
            except Exception:  # noqa: BLE001 - best effort: the original error is the one to raise
                continue
            finally:
                handle.state = HandleState.READY
