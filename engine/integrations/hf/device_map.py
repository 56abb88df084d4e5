"""accelerate's big-model arguments (``device_map``, ``max_memory``, ``offload_folder``) as an
:class:`EngineConfig`, so a call carried over from ``AutoModelForCausalLM.from_pretrained(name,
device_map="auto", max_memory={0: "20GiB", "cpu": "60GiB"}, offload_folder="offload")`` runs as
``engine.from_pretrained(...)`` unchanged, and accelerate's ``load_checkpoint_and_dispatch`` as
:func:`load_checkpoint_and_dispatch` here.

There is no device map to compute: every weight lives in the store and is fetched to the one
compute device just before its module runs. So ``device_map`` only names that device (a dict map:
its one GPU, else the CPU), ``max_memory`` becomes the store's budget per tier (the compute
device's entry, ``"cpu"``, ``"disk"``), and ``offload_folder`` the store's directory.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Mapping, Optional

import torch

from engine.config import EngineConfig
from engine.engine import Engine, wrap
from engine.io.weights import StateDictLike
from engine.paging.distributed_init import local_rank
from tiered import StoreConfig

#: ``device_map`` strings accelerate accepts that spread a model over what is available.
SPREAD_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def accelerate_config(
    config: Optional[EngineConfig], *, device_map: Any = None, max_memory: Optional[Mapping[Any, Any]] = None,
    offload_folder: "str | os.PathLike[str] | None" = None,
) -> EngineConfig:
    """``config`` with accelerate's arguments applied, or a new EngineConfig whose store is
    ``offload_folder`` when ``config`` is None. ``ValueError`` for neither (or both) of ``config``
    and ``offload_folder``, a device map over several GPUs, or a size or key ``max_memory`` cannot
    have."""
    if config is None:
        if offload_folder is None:
            raise ValueError("the engine needs config=engine.EngineConfig(store=...) or offload_folder=DIR "
                             "(accelerate's name for where offloaded weights go: here the store's directory)")
        config = EngineConfig(store=StoreConfig(path=os.fspath(offload_folder)))
    elif offload_folder is not None:
        raise ValueError(f"offload_folder={os.fspath(offload_folder)!r} and config= both name the store (config's "
                         f"is {config.store.path!r}): pass one")
    if config.compute_device is None:
        device = _compute_device(device_map, torch.cuda.is_available())
        if device is not None:
            config = config.replace(compute_device=device)
    if max_memory is not None:
        config = config.replace(store=_budgets(config.store, max_memory, config.compute_device))
    return config


def load_checkpoint_and_dispatch(
    model: torch.nn.Module,
    checkpoint: StateDictLike,
    device_map: Any = None,
    max_memory: Optional[Mapping[Any, Any]] = None,
    no_split_module_classes: Optional[list[str]] = None,
    offload_folder: "str | os.PathLike[str] | None" = None,
    offload_buffers: bool = False,
    dtype: "torch.dtype | str | None" = None,
    offload_state_dict: Optional[bool] = None,
    *,
    config: Optional[EngineConfig] = None,
    initialize_missing_weights: bool = False,
) -> Engine:
    """accelerate's ``load_checkpoint_and_dispatch`` for a model built under ``init_empty_weights()``
    (or ``torch.device("meta")``): ``engine.wrap(model, state_dict=checkpoint, ...)`` with the
    store in ``offload_folder`` (or ``config``'s), ``max_memory`` its budgets and ``device_map``
    the compute device (:func:`accelerate_config`). Returns the engine; the model object is the same
    and is called as before.

    As accelerate's: a parameter or buffer on the meta device that the checkpoint does not hold is
    a ValueError naming it, before anything is loaded (transformers 5 builds GPT-2 under
    ``init_empty_weights`` with its output layer untied from the embedding the checkpoint holds:
    call ``model.tie_weights()`` first, as accelerate asks); ``initialize_missing_weights=True``
    initializes such tensors as the model initializes them instead (with a warning naming them),
    which accelerate cannot. ``dtype`` casts what the checkpoint holds as it is placed (the engine's
    ``train_dtype``), and leaves the model's own buffers (a rotary embedding's ``inv_freq``) in
    their dtype, as accelerate leaves them. ``no_split_module_classes``, ``offload_buffers`` and
    ``offload_state_dict`` are accepted: modules are never split across devices here, buffers stay
    with the model and the checkpoint is read one tensor at a time."""
    del no_split_module_classes, offload_buffers, offload_state_dict
    if not isinstance(initialize_missing_weights, bool):
        raise TypeError(f"initialize_missing_weights must be a bool, got {type(initialize_missing_weights).__name__}")
    config = accelerate_config(config, device_map=device_map, max_memory=max_memory, offload_folder=offload_folder)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        config = config.replace(train_dtype=name)
    return wrap(model, config=config, state_dict=checkpoint, initialize_missing=initialize_missing_weights,
                cast_unloaded_buffers=False)


def parse_size(value: Any) -> int:
    """Bytes from an int or a string as accelerate writes them: ``"20GiB"`` (powers of 2),
    ``"20GB"`` (powers of 10), ``"512MiB"``, ``"1000"``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", value.upper())
        if match:
            return int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    raise ValueError(f"max_memory: {value!r} is not a size (bytes, or a string such as '20GiB' or '500MB')")


def _compute_device(device_map: Any, cuda_available: bool) -> Optional[str]:
    """The compute device ``device_map`` names: a GPU (this process's, under a launcher) for the
    spreading maps when CUDA is there, else the device given; None leaves the model's own."""
    if device_map is None:
        return None
    if isinstance(device_map, Mapping):
        return _device_of_map(device_map)
    if isinstance(device_map, str) and device_map in SPREAD_MAPS:
        return f"cuda:{local_rank()}" if cuda_available else "cpu"
    return _device(device_map, f"device_map={device_map!r} is neither one of {SPREAD_MAPS} nor a device")


def _device_of_map(device_map: Mapping[Any, Any]) -> str:
    """The compute device of a device map given as a dict (module name -> a device, ``"cpu"`` or
    ``"disk"``; ``{"": 0}`` as PEFT scripts write it, or what ``infer_auto_device_map`` returns):
    the one accelerator it names, else the CPU. Modules it offloads to ``"cpu"`` or ``"disk"`` are
    in the store's tiers like every other; modules on several accelerators are a ValueError (one
    device per process here)."""
    if not device_map:
        raise ValueError("device_map={} names no device: pass device_map='auto', a device, or {'': device}")
    devices = {"cpu" if where == "disk" else _device(where, f"device_map[{name!r}]={where!r} is not a device, "
                                                            "'cpu' or 'disk'")
               for name, where in device_map.items()}
    accelerators = sorted(devices - {"cpu"})
    if len(accelerators) > 1:
        raise ValueError(f"the device_map spreads the model over {', '.join(accelerators)}, but the engine computes "
                         "on one device per process, fetching every weight from its store just in time: map "
                         "everything to one device ({'': 0}), or pass device_map='auto' under torchrun, which "
                         "starts one process per GPU")
    return accelerators[0] if accelerators else "cpu"


def _device(where: Any, problem: str) -> str:
    """``where`` (an accelerator index, a device string or a ``torch.device``) as a device string."""
    if isinstance(where, int) and not isinstance(where, bool):
        return f"cuda:{where}"
    try:
        return str(torch.device(where))
    except (RuntimeError, TypeError):
        raise ValueError(problem) from None


def _budgets(store: StoreConfig, max_memory: Mapping[Any, Any], compute_device: Optional[str]) -> StoreConfig:
    """The store with its tier budgets from ``max_memory``: the compute device's GPU entry (an
    index or ``"cuda:N"``) -> device tier, ``"cpu"`` -> host tier, ``"disk"`` -> nvme tier."""
    if not isinstance(max_memory, Mapping):
        raise TypeError(f"max_memory must be a dict such as {{0: '20GiB', 'cpu': '60GiB'}}, got "
                        f"{type(max_memory).__name__}")
    device = torch.device(compute_device) if compute_device is not None else None
    budgets: dict[str, int] = {}
    unused: list[Any] = []
    for key, value in max_memory.items():
        size = parse_size(value)
        if key == "cpu":
            budgets["host_bytes"] = size
        elif key == "disk":
            budgets["nvme_bytes"] = size
        elif _gpu_index(key) is not None:
            if device is not None and device.type == "cuda" and (device.index or 0) == _gpu_index(key):
                budgets["device_bytes"] = size
            else:
                unused.append(key)
        else:
            raise ValueError(f"max_memory: unknown key {key!r}; use a GPU index (0, 1, ...), 'cpu' or 'disk'")
    if unused:
        warnings.warn(f"max_memory: the engine computes on {compute_device or 'the CPU'} only (one device per "
                      f"process; torchrun starts one per GPU), so the entries for {unused} are not used",
                      UserWarning, stacklevel=4)
    return store.replace(**budgets)


def _gpu_index(key: Any) -> Optional[int]:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str):
        match = re.fullmatch(r"cuda:(\d+)", key)
        if match:
            return int(match.group(1))
    return None


__all__ = ["SPREAD_MAPS", "accelerate_config", "load_checkpoint_and_dispatch", "parse_size"]
