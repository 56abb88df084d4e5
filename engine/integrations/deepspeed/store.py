"""Where ``engine.initialize`` and ``EngineTrainer`` keep the store when the script names none, as
DeepSpeed scripts do not: under the config's ``nvme_path`` when something is offloaded to NVMe,
otherwise in a temporary directory that lives as long as the engine, which removes it
(:class:`ScratchStoreEngine`; DeepSpeed keeps CPU-offloaded state in memory only, so such a run has
nothing on disk worth keeping). Its budgets follow what DeepSpeed keeps in memory under the config
(:func:`deepspeed_budgets`, which ``tiered estimate --ds-config`` uses too). Several engines from
one config each get a directory of their own (:func:`wrap_in_own_directory`)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import shutil
import tempfile
import warnings
from typing import Any, Callable, Iterator, Mapping, Optional

from torch import nn

from engine.config import EngineConfig
from engine.config.deepspeed import deepspeed_settings
from engine.engine import Engine
from engine.integrations.deepspeed.memory import memory_sizes
from engine.paging.memory_estimate import estimate_memory
from engine.paging.memory_plan import plan_memory
from tiered import StoreConfig, StoreLockedError
from tiered.util import format_bytes

MiB = 1 << 20

#: The store's subdirectory of each ``nvme_path``: DeepSpeed's own swap folders stay apart from it.
SUBDIR = "tiered"

#: The most engines that can keep their default stores under one ``nvme_path`` at once.
MAX_ENGINES = 64

#: The offload sections whose ``device`` and ``nvme_path`` place the store.
_SECTIONS = ("zero_optimization.offload_param", "zero_optimization.offload_optimizer")


@dataclasses.dataclass(frozen=True)
class DefaultStore:
    """The store a DeepSpeed config implies: ``config``, and ``scratch``, the temporary directory
    it lives in (None when it lives under the config's ``nvme_path``)."""

    config: StoreConfig
    scratch: Optional[str]

    def apply(self, engine_config: EngineConfig, model: nn.Module, world_size: int, *,
              training: bool = True) -> EngineConfig:
        """``engine_config`` (mapped from the DeepSpeed config, which points the swap files at each
        ``nvme_path``) with the swap files in this store's directories instead, and the budgets
        :func:`deepspeed_budgets` gives for ``model`` on one of ``world_size`` ranks (``training``:
        with the optimizer's state). A script naming its own store sets its budgets itself."""
        config = engine_config.replace(store=engine_config.store.replace(nvme_paths=self.config.nvme_paths))
        return config.replace(store=deepspeed_budgets(config, model, world_size, training=training))

    def numbered(self, index: int) -> "DefaultStore":
        """The default store of the ``index``-th engine open at once under the same ``nvme_path``
        (see [Note: One directory per engine]): this one for 0, else the same directories with
        ``-<index + 1>`` appended (``tiered-2``, ``tiered-3``, ...). A scratch store is its own."""
        if index == 0 or self.scratch is not None:
            return self
        paths = tuple(f"{p}-{index + 1}" for p in self.config.nvme_paths)
        return DefaultStore(self.config.replace(path=paths[0], nvme_paths=paths), scratch=None)

    def place(self, engine_config: EngineConfig) -> EngineConfig:
        """``engine_config`` with its store's directories (path and swap directories) this store's."""
        store = engine_config.store.replace(path=self.config.path, nvme_paths=self.config.nvme_paths)
        return engine_config.replace(store=store)

    def remove(self) -> None:
        """Delete the scratch directory, if there is one (the store must be closed)."""
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


@contextlib.contextmanager
def removed_on_failure(default: Optional[DefaultStore]) -> Iterator[None]:
    """Run the block; when it raises, remove ``default``'s scratch directory first (None: there is
    no default store to remove), so a refused set-up leaves nothing behind."""
    try:
        yield
    except BaseException:
        if default is not None:
            default.remove()
        raise


# [Note: One directory per engine]
# A script may build several engines from one DeepSpeed config (a DPO policy and its reference
# model), as DeepSpeed allows. Each store owns its directories, so each engine's default store gets
# directories of its own under every ``nvme_path``: the first of ``tiered``, ``tiered-2``,
# ``tiered-3``, ... that no open store holds (the wrap is tried there and, refused with
# StoreLockedError before it changed anything, tried at the next). The choice is made from the
# directories' locks, not from a count kept in the process: an engine closed frees its directory
# for the next one, and a script that opens its engines in the same order finds the same
# directories again in its next run. A directory open in another process is passed over as well,
# so two runs on one ``nvme_path`` never share a store. These engines start fresh (they resume from
# checkpoints, not from the store), so which free directory one takes never changes a result;
# ``store=`` names a directory explicitly.


def wrap_in_own_directory(default: Optional[DefaultStore], engine_config: EngineConfig,
                          wrap_engine: Callable[[EngineConfig], Engine]) -> Engine:
    """``wrap_engine(engine_config)`` with the store in the first of ``default``'s numbered
    directories (:meth:`DefaultStore.numbered`) that no open store holds; ``engine_config`` as it is
    when ``default`` is None (the script named its store) or a scratch directory.

    Raises:
        StoreLockedError: all :data:`MAX_ENGINES` directories are open (naming the first).
        Whatever ``wrap_engine`` raises otherwise.
    """
    if default is None or default.scratch is not None:
        return wrap_engine(engine_config)
    refused: Optional[StoreLockedError] = None
    for index in range(MAX_ENGINES):
        try:
            return wrap_engine(default.numbered(index).place(engine_config))
        except StoreLockedError as exc:  # raised by the store's open, before wrap changed anything
            refused = refused or exc
    raise StoreLockedError(
        f"{MAX_ENGINES} engines already keep their stores under {os.path.dirname(default.config.path)} "
        f"({default.config.path} to {default.numbered(MAX_ENGINES - 1).config.path} are all open): close some of "
        "them, or pass the store's directory (engine.initialize(store=...), EngineTrainer(store=...))"
    ) from refused


#: The most of the memory available on the machine that the host tiers of its ranks' default stores
#: take together; the rest is left to the processes, their activations and the system.
HOST_SHARE = 0.8
#: A budget no estimate reaches, to learn what the engine would put in a tier.
UNBOUNDED = 1 << 62


def deepspeed_budgets(config: EngineConfig, model: nn.Module, world_size: int, *, training: bool) -> StoreConfig:
    """``config.store`` with device and host budgets for what DeepSpeed keeps in memory under the
    DeepSpeed config ``config`` was mapped from, sized with :func:`engine.estimate_memory` for
    ``model`` on one of ``world_size`` ranks (``training``: with the optimizer's state).
    Parameters not offloaded (``offload_param.device: "none"``) stay on the accelerator: a device
    tier without a budget gets room for every shard. What is offloaded to ``"cpu"`` stays in host
    memory: the host tier gets room for all the engine puts there during a step, when that is more
    than its budget, up to :data:`HOST_SHARE` of the memory available on the machine (shared by
    its ranks), with a warning when that is less; the rest goes to the nvme tier."""
    store = config.store
    # What each tier would hold with no budget in the way (one pass over the model's parameters).
    unbounded = config.replace(host_budget="host_tier",
                               store=store.replace(device_bytes=UNBOUNDED, host_bytes=UNBOUNDED))
    wanted = estimate_memory(model, unbounded, world_size=world_size, training=training).during_step
    if config.param_tier == "device" and store.device_bytes == 0:
        # A step writes a group's new shards before their old ones go: room for one group more.
        store = store.replace(device_bytes=wanted.device + min(wanted.device, config.optimizer_group_bytes))
    if "host" in (config.param_tier, config.optimizer_tier):
        host = wanted.host + max(0, wanted.device - store.device_bytes)  # what the device tier cannot hold
        overhead = 0
        if config.host_budget == "total":  # host_bytes covers the working set and the store's buffers too
            roomy = config.replace(store=store.replace(host_bytes=UNBOUNDED))
            overhead = sum(p.nbytes for p in plan_memory(model, roomy, world_size=world_size,
                                                         training=training).pieces)
            # At a finite budget the plan may size its pieces differently (the pool of a step whose
            # state is lent by the host tier): grow the overhead until the host tier gets ``host``.
            for _ in range(4):
                sized = config.replace(store=store.replace(host_bytes=host + overhead))
                short = host - plan_memory(model, sized, world_size=world_size, training=training).host_tier_bytes
                if short <= 0:
                    break
                overhead += short
        if host + overhead > store.host_bytes:
            store = store.replace(host_bytes=_host_budget(host, overhead, store.host_bytes, store.path))
    return store


def _host_budget(state: int, overhead: int, default: int, path: str) -> int:
    """``state`` bytes for this rank's host tier and ``overhead`` for the rest of host_bytes (the
    working set, staging), or, when the machine has less available, this rank's share of
    :data:`HOST_SHARE` of it (never below ``default``), with a warning naming the difference and
    where it goes."""
    wanted = state + overhead
    sizes = memory_sizes()
    if sizes is None:
        return wanted
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # torchrun's processes on this machine
    share = int(sizes[1] * HOST_SHARE / ranks) // MiB * MiB
    if wanted <= share:
        return wanted
    budget = max(share, default)
    warnings.warn(
        f"the DeepSpeed config keeps {format_bytes(state)} of this rank's state in host memory (\"cpu\" "
        f"offload), more than its share of the {format_bytes(sizes[1])} this machine has available; the "
        f"store's host budget is {format_bytes(budget)} (its host tier gets what the working set leaves) and "
        f"the rest goes to its nvme tier under {path}: name an nvme_path on a fast disk, or pass "
        "engine.initialize(store=...) with your own budgets",
        stacklevel=2)
    return budget


class ScratchStoreEngine(Engine):
    """An :class:`~engine.Engine` whose store lives in ``scratch_dir``, a temporary directory
    (:attr:`DefaultStore.scratch`) it removes once it has closed the store; None: it keeps its
    store, as any engine does."""

    def __init__(self, *args: Any, scratch_dir: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scratch_dir = scratch_dir

    def _shutdown(self) -> None:
        super()._shutdown()
        if self._scratch_dir is not None:  # the store is closed: nothing reads its files again
            shutil.rmtree(self._scratch_dir, ignore_errors=True)


def default_store(ds: Mapping[str, Any]) -> DefaultStore:
    """The store for the DeepSpeed config ``ds`` when ``engine.initialize`` gets no ``store=``:
    ``<nvme_path>/tiered`` (swap files striped over each ``nvme_path``'s ``tiered`` folder), or a
    new temporary directory, removed when the engine closes or, failing that, when the process
    exits. ``ValueError`` when the config offloads to NVMe without naming where."""
    found, _ = deepspeed_settings(ds)  # its problems are reported when the whole config is mapped
    to_nvme = [s for s in _SECTIONS if found.get(f"{s}.device") == "nvme"]
    missing = [s for s in to_nvme if not found.get(f"{s}.nvme_path")]
    if missing:
        raise ValueError(f"{missing[0]}.device is \"nvme\" but the config names no nvme_path: set "
                         f"{missing[0]}.nvme_path (DeepSpeed needs it too), or pass engine.initialize(store=DIR)")
    # An nvme_path beside another device is unused, as in DeepSpeed (Hugging Face's configs keep one there).
    paths = [os.path.abspath(found[f"{s}.nvme_path"]) for s in to_nvme]
    if paths:
        dirs = [os.path.join(p, SUBDIR) for p in dict.fromkeys(paths)]
        return DefaultStore(StoreConfig(path=dirs[0], nvme_paths=dirs), scratch=None)
    scratch = tempfile.mkdtemp(prefix="tiered-store-")
    # atexit runs after the store's own close at exit (threading's exit hooks come first).
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return DefaultStore(StoreConfig(path=scratch, flush_on_close=False), scratch=scratch)


__all__ = ["HOST_SHARE", "MAX_ENGINES", "SUBDIR", "DefaultStore", "ScratchStoreEngine", "deepspeed_budgets",
           "default_store", "removed_on_failure", "wrap_in_own_directory"]
