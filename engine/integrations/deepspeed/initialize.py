"""``engine.initialize``: DeepSpeed's ``deepspeed.initialize`` over the engine, so a DeepSpeed
training script runs with one changed line::

    model_engine, optimizer, loader, scheduler = engine.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json",
        store="/nvme/run1", training_data=dataset)          # was: deepspeed.initialize(...)
    for batch in loader:
        loss = model_engine(batch)
        model_engine.backward(loss)
        model_engine.step()                                   # steps the scheduler, as DeepSpeed's does

It composes what the engine already has: ``EngineConfig.from_deepspeed`` (every key checked),
the ``optimizer`` and ``scheduler`` sections (``engine.integrations.deepspeed.optimizer``), ``engine.wrap``, and
``Engine.lr_scheduler`` (stepped by ``model_engine.step()`` after each applied step, saved and
restored with the engine's checkpoints), :func:`engine.init_distributed` (DeepSpeed scripts leave
joining the process group to ``initialize``) and :class:`engine.integrations.deepspeed.engine.DeepSpeedEngine`
(DeepSpeed's checkpoint calls and counters). DeepSpeed's ``mpu`` and ``mesh_param`` have no
counterpart and are not parameters here (Python's ``TypeError`` names them) rather than ignored.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from engine.config import EngineConfig
from engine.config.deepspeed import (
    INITIALIZE_REPORTS,
    DeepSpeedConfig,
    config_from_deepspeed,
    load_deepspeed_config,
    micro_batch_size,
)
from engine.engine import wrap
from engine.integrations.deepspeed.engine import DeepSpeedEngine
from engine.integrations.deepspeed.monitor import DeepSpeedMonitor, enabled_monitors
from engine.integrations.deepspeed.optimizer import optimizer_from_deepspeed, scheduler_from_deepspeed
from engine.integrations.deepspeed.store import (
    DefaultStore,
    default_store,
    removed_on_failure,
    wrap_in_own_directory,
)
from engine.io.weights import StateDictLike
from engine.paging.collectives import group_rank_and_world
from engine.paging.distributed_init import init_distributed, local_rank
from engine.paging.placement import InitFn, model_device
from tiered import StoreConfig

OptimizerArg = Union[torch.optim.Optimizer, Callable[[Iterable[Any]], torch.optim.Optimizer], None]
SchedulerArg = Union[Any, Callable[[torch.optim.Optimizer], Any], None]


def initialize(
    args: Any = None,
    model: Optional[nn.Module] = None,
    optimizer: OptimizerArg = None,
    model_parameters: Optional[Iterable[Any]] = None,
    training_data: Optional[Dataset] = None,
    lr_scheduler: SchedulerArg = None,
    collate_fn: Optional[Callable[[list[Any]], Any]] = None,
    config: Optional[DeepSpeedConfig] = None,
    *,
    store: "StoreConfig | str | os.PathLike[str] | None" = None,
    dist_init_required: Optional[bool] = None,
    config_params: Optional[DeepSpeedConfig] = None,
    init_fn: Optional[InitFn] = None,
    state_dict: Optional[StateDictLike] = None,
) -> tuple[DeepSpeedEngine, Optional[torch.optim.Optimizer], Optional[DataLoader], Optional[Any]]:
    """``deepspeed.initialize``'s arguments and return value: ``(engine, optimizer, training
    dataloader or None, lr scheduler or None)``; the engine is called as ``model_engine(batch)``.

    ``config``: the DeepSpeed config (a dict or a JSON path; else ``args.deepspeed_config``).
    ``optimizer``: an optimizer (``engine.AdamW`` keeps its state in the store) or a callable
    building one from ``model_parameters``; neither it nor the config's ``optimizer`` section:
    no optimizer, as DeepSpeed. Both: ``ValueError``, as DeepSpeed refuses. ``lr_scheduler``: a
    scheduler or a callable taking the optimizer; it takes precedence over the config's
    ``scheduler`` section, as in DeepSpeed. ``training_data``: a dataset, loaded in micro-batches
    of ``train_micro_batch_size_per_gpu`` (shuffled; each rank its own share under torchrun).
    ``store``: where the engine's store lives (a ``tiered.StoreConfig`` or its directory; the
    config's ``nvme_path`` places the swap files); by default, as a DeepSpeed script passes none,
    ``<nvme_path>/tiered`` (``tiered-2``, ``tiered-3``, ... for further engines open at the same
    time: [Note: One directory per engine]), or a temporary directory removed when the engine
    closes when nothing is offloaded to NVMe (:func:`engine.integrations.deepspeed.store.default_store`).
    ``init_fn``/``state_dict``: as for :func:`engine.wrap` (a model built on the meta device,
    ``zero.Init``'s counterpart).

    As DeepSpeed's, it joins the process group a launcher (``torchrun``) describes when the script
    has not (:func:`engine.init_distributed`); ``dist_init_required=True`` requires a launcher,
    ``False`` leaves torch.distributed alone. With CUDA, a model on the CPU computes on
    ``cuda:<local rank>``, where DeepSpeed moves it. ``config_params``: DeepSpeed's older name
    for ``config``. The engine is a :class:`engine.integrations.deepspeed.engine.DeepSpeedEngine`: its
    ``load_checkpoint`` returns ``(path, client_state)`` and its ``save_checkpoint`` tags
    ``global_step<N>``, as DeepSpeed's."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"engine.initialize needs model=, an nn.Module, got {type(model).__name__}")
    if config is not None and config_params is not None:
        raise ValueError("engine.initialize: pass the DeepSpeed config as config= or config_params=, not both")
    config = config if config is not None else config_params
    if config is None:
        config = getattr(args, "deepspeed_config", None)
        if config is None:
            raise ValueError("engine.initialize needs config= (a DeepSpeed config dict or JSON path), or "
                             "args.deepspeed_config")
    ds = load_deepspeed_config(config)
    _join_process_group(dist_init_required)  # before the config: the batch sizes involve the world size
    default = default_store(ds) if store is None else None
    with removed_on_failure(default):
        eng, loader, scheduler = _initialize(model, optimizer, model_parameters, training_data, lr_scheduler,
                                             collate_fn, ds, store, default, init_fn, state_dict)
    return eng, eng.optimizer, loader, scheduler


def _initialize(
    model: nn.Module, optimizer: OptimizerArg, model_parameters: Optional[Iterable[Any]],
    training_data: Optional[Dataset], lr_scheduler: SchedulerArg, collate_fn: Optional[Callable[[list[Any]], Any]],
    ds: dict[str, Any], store: "StoreConfig | str | os.PathLike[str] | None", default: Optional[DefaultStore],
    init_fn: Optional[InitFn], state_dict: Optional[StateDictLike],
) -> tuple[DeepSpeedEngine, Optional[DataLoader], Any]:
    """:func:`initialize` after the config is loaded, the process group joined and the store chosen."""
    if default is not None:
        engine_config = default.apply(config_from_deepspeed(EngineConfig, ds, store=default.config,
                                                            reports=INITIALIZE_REPORTS),
                                       model, group_rank_and_world(None)[2],
                                       training=optimizer is not None or ds.get("optimizer") is not None)
    else:
        store_config = store if isinstance(store, StoreConfig) else StoreConfig(path=os.fspath(store))
        engine_config = config_from_deepspeed(EngineConfig, ds, store=store_config, reports=INITIALIZE_REPORTS)
    if engine_config.compute_device is None:
        device = _compute_device(model, torch.cuda.is_available())
        engine_config = engine_config.replace(compute_device=device) if device is not None else engine_config

    params = list(model_parameters) if model_parameters is not None else None
    if optimizer is not None and ds.get("optimizer") is not None:
        raise ValueError("engine.initialize: an optimizer is given and the config has an \"optimizer\" section; "
                         "DeepSpeed refuses both too: drop one")
    if optimizer is None and ds.get("optimizer") is not None:
        optimizer = optimizer_from_deepspeed(ds, params)
    elif optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable building one, "
                            f"got {type(optimizer).__name__}")
        optimizer = optimizer(params if params is not None else model.parameters())

    if optimizer is None and (lr_scheduler is not None or ds.get("scheduler") is not None):
        raise ValueError("engine.initialize: an LR scheduler needs an optimizer (an optimizer= or the config's "
                         "\"optimizer\" section)")
    if optimizer is None and engine_config.loss_scaling is not None:
        # ZeRO-Inference's fp16 section: no optimizer, so no step to unscale and no loss to scale;
        # DeepSpeed builds no loss scaler then either, and runs the model in fp16.
        engine_config = engine_config.replace(loss_scaling=None)
    # Everything that can be refused is checked before wrap, which moves the model's values into the store.
    loader = (_loader(training_data, ds, engine_config.gradient_accumulation_steps, collate_fn)
              if training_data is not None else None)
    monitor = _monitor(ds, engine_config.gradient_accumulation_steps)
    scratch = default.scratch if default is not None else None
    engine_class = functools.partial(DeepSpeedEngine, deepspeed_config=ds, scratch_dir=scratch, monitor=monitor)
    try:
        eng = wrap_in_own_directory(default, engine_config, lambda config: wrap(
            model, optimizer=optimizer, config=config, init_fn=init_fn, state_dict=state_dict,
            engine_class=engine_class))
    except BaseException:
        monitor.close()
        raise
    try:
        scheduler = _scheduler(lr_scheduler, ds, eng.optimizer)
        eng.lr_scheduler = scheduler
    except BaseException:
        eng.unwrap()  # the model as it was, values in memory again; the monitor closed with the engine
        raise
    return eng, loader, scheduler


def _monitor(ds: dict[str, Any], accumulation_steps: int) -> DeepSpeedMonitor:
    """The config's monitors (opened on rank 0). Their events are at ``global_samples``, which needs
    the batch size: ValueError without one, as DeepSpeed requires it."""
    monitors = enabled_monitors(ds)
    if monitors and micro_batch_size(ds, accumulation_steps, 1) is None:
        raise ValueError(f"the DeepSpeed config turns on {', '.join(monitors)}, whose events are "
                         f"counted in samples: set train_micro_batch_size_per_gpu or train_batch_size")
    return DeepSpeedMonitor.from_config(ds, rank=dist.get_rank() if dist.is_available() and dist.is_initialized()
                                        else 0)


def _join_process_group(required: Optional[bool]) -> None:
    """DeepSpeed's ``dist_init_required``: None joins the launcher's group when there is one."""
    if required is False:
        return
    if not init_distributed() and required and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("engine.initialize(dist_init_required=True): no launcher started this process (RANK, "
                         "WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set); run it under torchrun")


def _compute_device(model: nn.Module, cuda_available: bool) -> Optional[str]:
    """Where DeepSpeed would compute: ``cuda:<local rank>`` for a model on the CPU (or meta) when
    CUDA is available; None (the model's own device) otherwise."""
    if not cuda_available or model_device(model).type != "cpu":
        return None
    return f"cuda:{local_rank()}"


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's ``deepspeed.add_config_arguments``: adds ``--deepspeed`` and
    ``--deepspeed_config PATH`` (which :func:`initialize` reads from ``args``) and returns ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="accepted for DeepSpeed scripts; the engine is always used")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed JSON config file")
    return parser


def _scheduler(client: SchedulerArg, ds: dict[str, Any], optimizer: Optional[torch.optim.Optimizer]) -> Any:
    if client is None and ds.get("scheduler") is None:
        return None
    assert optimizer is not None, "checked before wrap"
    if client is None:
        return scheduler_from_deepspeed(ds, optimizer)
    if callable(client) and not callable(getattr(client, "step", None)):
        return client(optimizer)
    return client


def _loader(data: Dataset, ds: dict[str, Any], accumulation_steps: int,
            collate_fn: Optional[Callable[[list[Any]], Any]]) -> DataLoader:
    """DeepSpeed's training loader: micro-batches, shuffled, each rank (of the default process
    group, which the engine shards over) its own share."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if distributed else 1
    micro = micro_batch_size(ds, accumulation_steps, world)
    if micro is None:
        raise ValueError("engine.initialize(training_data=...) needs train_micro_batch_size_per_gpu or "
                         "train_batch_size in the config for the loader's batch size")
    if world > 1:
        sampler: Any = DistributedSampler(data, num_replicas=world, rank=torch.distributed.get_rank())
    else:
        sampler = RandomSampler(data)
    return DataLoader(data, batch_size=micro, sampler=sampler, collate_fn=collate_fn,
                      drop_last=bool(ds.get("dataloader_drop_last", False)))


__all__ = ["add_config_arguments", "initialize"]
