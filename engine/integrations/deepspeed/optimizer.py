"""engine.AdamW and an LR scheduler from a DeepSpeed config's ``optimizer`` and ``scheduler`` sections.

``EngineConfig.from_deepspeed`` validates both sections (:mod:`engine.config.deepspeed_optimizer`;
the optimizer is an object passed to ``engine.wrap``, not a config field); these functions build them:

```python
config = engine.EngineConfig.from_deepspeed("ds.json", store=store_config)
optimizer = optimizer_from_deepspeed("ds.json")
scheduler = scheduler_from_deepspeed("ds.json", optimizer)   # None when the JSON has none
```
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from engine.config.deepspeed import DeepSpeedConfig, load_deepspeed_config
from engine.config.deepspeed_optimizer import SCHEDULE_PARAMS, optimizer_settings, scheduler_settings, torch_scheduler
from engine.config.deepspeed_schema import Schema, raise_problems
from engine.integrations.deepspeed.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR
from engine.optim.adamw import AdamW

#: DeepSpeed's Adam default is AdamW mode; its CPU and fused Adams default to weight_decay 0, and
#: ``torch_adam`` selects torch.optim.AdamW, whose default is 0.01.
DEEPSPEED_WEIGHT_DECAY = 0.0
TORCH_WEIGHT_DECAY = 0.01

#: The classes of DeepSpeed's own schedules, by the name its config gives them.
SCHEDULE_CLASSES: Mapping[str, type] = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
                                        "WarmupCosineLR": WarmupCosineLR}
#: DeepSpeed's own schedules this module rebuilds: the class and the parameters each takes.
SCHEDULES: Mapping[str, tuple[type, Schema]] = {
    name: (cls, SCHEDULE_PARAMS[name]) for name, cls in SCHEDULE_CLASSES.items()
}


def optimizer_from_deepspeed(ds_config: DeepSpeedConfig, model_parameters: Optional[Iterable[Any]] = None) -> AdamW:
    """An :class:`engine.AdamW` from the config's ``optimizer`` section (type Adam or AdamW);
    without one, ``engine.AdamW()`` with torch's defaults. ``model_parameters``: parameter groups
    with their own settings, as ``deepspeed.initialize(model_parameters=...)`` takes them (default:
    every parameter, one group).

    Raises:
        ValueError: the section has unsupported or invalid settings (each named by its path), or
            the JSON file cannot be read.
        TypeError: ``ds_config`` is neither a mapping nor a path.
    """
    section = load_deepspeed_config(ds_config).get("optimizer")
    if section is None:
        return AdamW(model_parameters)
    if not isinstance(section, Mapping):
        raise ValueError(f"optimizer: must be an object, got {section!r}")
    params, problems = optimizer_settings(section, "optimizer")
    raise_problems(problems)
    torch_adam = params.pop("torch_adam", False)
    params.setdefault("weight_decay", TORCH_WEIGHT_DECAY if torch_adam else DEEPSPEED_WEIGHT_DECAY)
    params.pop("adam_w_mode", None)
    # Without torch_adam DeepSpeed steps with its own fused Adam (DeepSpeedCPUAdam where the state is
    # offloaded); torch's fused CPU kernel is the counterpart for the engine's step on the host.
    optimizer = AdamW(model_parameters, **params, fused=None if torch_adam else True)
    autos = _auto_params(section, "optimizer")
    if autos:
        used = ", ".join(f"{k}={optimizer.defaults[k]!r}" for k in autos if k in optimizer.defaults)
        _warn_auto("optimizer", autos, f"DeepSpeed's defaults: {used}")
    return optimizer


def scheduler_from_deepspeed(ds_config: DeepSpeedConfig, optimizer: torch.optim.Optimizer) -> Optional[LRScheduler]:
    """The config's ``scheduler`` on ``optimizer`` (None if the config has none): DeepSpeed's
    WarmupLR, WarmupDecayLR or WarmupCosineLR (``engine.integrations.deepspeed.schedules``, same lr sequence as
    DeepSpeed's), or any ``torch.optim.lr_scheduler`` class by name, as DeepSpeed allows.

    Raises:
        ValueError: the section names an unsupported scheduler or has invalid settings (each named
            by its path), or the JSON file cannot be read.
        TypeError: ``ds_config`` is neither a mapping nor a path.
    """
    section = load_deepspeed_config(ds_config).get("scheduler")
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f"scheduler: must be an object, got {section!r}")
    kind, params, problems = scheduler_settings(section, "scheduler")
    raise_problems(problems)
    cls = SCHEDULE_CLASSES[kind] if kind in SCHEDULE_CLASSES else torch_scheduler(kind)
    assert cls is not None
    autos = _auto_params(section, "scheduler")
    if autos:
        _warn_auto("scheduler", autos, f"the defaults of {cls.__name__}")
    return cls(optimizer, **params)


def _auto_params(section: Mapping[str, Any], path: str) -> list[str]:
    """The section's ``params`` set to ``"auto"``."""
    params = section.get("params")
    return [k for k, v in params.items() if v == "auto"] if isinstance(params, Mapping) else []


def _warn_auto(path: str, names: list[str], taken: str) -> None:
    """``"auto"`` is the Hugging Face Trainer's placeholder, which it fills from its TrainingArguments
    (a learning rate of 5e-5 by default); here there are none to fill it from, so say what is used."""
    warnings.warn(
        f"{path}.params {', '.join(names)}: \"auto\" is the Hugging Face Trainer's placeholder, filled from its "
        f"TrainingArguments; built here without them, so these take {taken}. Set them in the config to choose",
        UserWarning, stacklevel=3)
