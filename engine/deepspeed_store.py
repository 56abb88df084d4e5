"""Where ``engine.initialize`` and ``EngineTrainer`` keep the store when the script names none, as
DeepSpeed scripts do not: under the config's ``nvme_path`` when something is offloaded to NVMe,
otherwise in a temporary directory that lives as long as the engine, which removes it
(:class:`ScratchStoreEngine`; DeepSpeed keeps CPU-offloaded state in memory only, so such a run has
nothing on disk worth keeping)."""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
from typing import Any, Mapping, Optional

from torch import nn

from engine.config import EngineConfig
from engine.deepspeed_config import deepspeed_settings
from engine.engine import Engine
from engine.memory_estimate import estimate_memory
from tiered import StoreConfig

#: The store's subdirectory of each ``nvme_path``: DeepSpeed's own swap folders stay apart from it.
SUBDIR = "tiered"

#: The offload sections whose ``device`` and ``nvme_path`` place the store.
_SECTIONS = ("zero_optimization.offload_param", "zero_optimization.offload_optimizer")


@dataclasses.dataclass(frozen=True)
class DefaultStore:
    """The store a DeepSpeed config implies: ``config``, and ``scratch``, the temporary directory
    it lives in (None when it lives under the config's ``nvme_path``)."""

    config: StoreConfig
    scratch: Optional[str]

    def apply(self, engine_config: EngineConfig, model: nn.Module, world_size: int) -> EngineConfig:
        """``engine_config`` (mapped from the DeepSpeed config, which points the swap files at each
        ``nvme_path``) with the swap files in this store's directories instead. Parameters the
        config does not offload (``offload_param.device: "none"``) stay on the accelerator in
        DeepSpeed: the device tier gets a budget of ``model``'s parameter shards on one of
        ``world_size`` ranks (a script naming its own store sets ``device_bytes`` itself)."""
        store = engine_config.store.replace(nvme_paths=self.config.nvme_paths)
        if engine_config.param_tier == "device" and store.device_bytes == 0:
            estimate = estimate_memory(model, engine_config, world_size=world_size, training=False)
            shards = sum(part.nbytes for part in estimate.parts if part.tier == "device")
            # A step writes a group's new shards before their old ones go: room for one group more.
            store = store.replace(device_bytes=shards + min(shards, engine_config.optimizer_group_bytes))
        return engine_config.replace(store=store)

    def remove(self) -> None:
        """Delete the scratch directory, if there is one (the store must be closed)."""
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


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


__all__ = ["SUBDIR", "DefaultStore", "ScratchStoreEngine", "default_store"]
