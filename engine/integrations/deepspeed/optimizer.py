"""engine.AdamW and an LR scheduler from a DeepSpeed config's ``optimizer`` and ``scheduler`` sections.

``EngineConfig.from_deepspeed`` validates both sections (the optimizer is an object passed to
``engine.wrap``, not a config field); these functions build them:

```python
config = engine.EngineConfig.from_deepspeed("ds.json", store=store_config)
optimizer = optimizer_from_deepspeed("ds.json")
scheduler = scheduler_from_deepspeed("ds.json", optimizer)   # None when the JSON has none
```
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Iterable, Mapping, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from engine.config.deepspeed import (
    ACCEPT,
    DEFAULT_ONLY,
    MAP,
    DeepSpeedConfig,
    Key,
    _Bad,
    _bool,
    _choice,
    _int,
    _number,
    _walk,
    load_deepspeed_config,
)
from engine.integrations.deepspeed.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR
from engine.optim.adamw import AdamW

#: DeepSpeed's Adam default is AdamW mode; its CPU and fused Adams default to weight_decay 0, and
#: ``torch_adam`` selects torch.optim.AdamW, whose default is 0.01.
DEEPSPEED_WEIGHT_DECAY = 0.0
TORCH_WEIGHT_DECAY = 0.01


def _betas(v: Any) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise _Bad("must be a pair [beta1, beta2]")
    beta1, beta2 = (_number(0.0, 1.0)(b) for b in v)
    if beta1 >= 1.0 or beta2 >= 1.0:
        raise _Bad("betas must be in [0, 1)")
    return beta1, beta2


_WHY_GRAD_CLIP = "not an optimizer parameter: use the top-level gradient_clipping (DeepSpeed refuses it too)"

ADAM_PARAMS = {
    "lr": Key(_number(), MAP, "AdamW lr"),
    "betas": Key(_betas, MAP, "AdamW betas"),
    "eps": Key(_number(), MAP, "AdamW eps"),
    "weight_decay": Key(_number(), MAP, "AdamW weight_decay (DeepSpeed's default 0; 0.01 with torch_adam)"),
    "adam_w_mode": Key(_bool, MAP, "must be true for type Adam: L2-regularized Adam is not supported"),
    "torch_adam": Key(_bool, MAP, "true: torch's single-tensor AdamW math (bit for bit torch.optim.AdamW); "
                                   "false, DeepSpeed's default (its own fused Adam): torch's fused AdamW kernel"),
    "bias_correction": Key(_bool, DEFAULT_ONLY, "Adam without bias correction is not supported", True),
    "amsgrad": Key(_bool, DEFAULT_ONLY, "AMSGrad is not supported", False),
}

OPTIMIZER = {
    "type": Key(_choice("adam", "adamw"), MAP, "engine.AdamW (the only optimizer the engine offloads)"),
    "params": ADAM_PARAMS,
    "legacy_fusion": Key(_bool, ACCEPT, "DeepSpeed fp16 fused-optimizer detail; the engine steps its own AdamW"),
}

_WARMUP = {
    "warmup_num_steps": Key(_int(1), MAP, "steps of warmup"),
    "warmup_type": Key(_choice("log", "linear"), MAP, "shape of the warmup ramp"),
    "last_batch_iteration": Key(_int(None), DEFAULT_ONLY, "resume through the scheduler's state_dict", -1),
}
_MIN_MAX = {
    "warmup_min_lr": Key(_number(), MAP, "lr at the start of warmup"),
    "warmup_max_lr": Key(_number(), MAP, "lr at the end of warmup"),
}
_TOTAL = {"total_num_steps": Key(_int(), MAP, "steps of the whole schedule")}

#: DeepSpeed's own schedules this module rebuilds, with the parameters each takes.
SCHEDULES: Mapping[str, tuple[type, Mapping[str, Key]]] = {
    "WarmupLR": (WarmupLR, {**_WARMUP, **_MIN_MAX}),
    "WarmupDecayLR": (WarmupDecayLR, {**_WARMUP, **_MIN_MAX, **_TOTAL}),
    "WarmupCosineLR": (WarmupCosineLR, {
        **_WARMUP, **_TOTAL,
        "warmup_min_ratio": Key(_number(), MAP, "lr ratio at the start of warmup"),
        "cos_min_ratio": Key(_number(), MAP, "lr ratio at the end of the cosine"),
    }),
}
REQUIRED = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",)}


def optimizer_problems(section: Mapping[str, Any], path: str = "optimizer") -> list[str]:
    """Every unsupported or invalid setting of a DeepSpeed ``optimizer`` section."""
    return _optimizer_settings(section, path)[1]


def scheduler_problems(section: Mapping[str, Any], path: str = "scheduler") -> list[str]:
    """Every unsupported or invalid setting of a DeepSpeed ``scheduler`` section."""
    return _scheduler_settings(section, path)[2]


def optimizer_from_deepspeed(ds_config: DeepSpeedConfig, model_parameters: Optional[Iterable[Any]] = None) -> AdamW:
    """An :class:`engine.AdamW` from the config's ``optimizer`` section (type Adam or AdamW);
    without one, ``engine.AdamW()`` with torch's defaults. ``model_parameters``: parameter groups
    with their own settings, as ``deepspeed.initialize(model_parameters=...)`` takes them (default:
    every parameter, one group). ValueError names unsupported settings."""
    section = load_deepspeed_config(ds_config).get("optimizer")
    if section is None:
        return AdamW(model_parameters)
    if not isinstance(section, Mapping):
        raise ValueError(f"optimizer: must be an object, got {section!r}")
    params, problems = _optimizer_settings(section, "optimizer")
    _raise(problems)
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
    DeepSpeed's), or any ``torch.optim.lr_scheduler`` class by name, as DeepSpeed allows."""
    section = load_deepspeed_config(ds_config).get("scheduler")
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f"scheduler: must be an object, got {section!r}")
    cls, params, problems = _scheduler_settings(section, "scheduler")
    _raise(problems)
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


def _optimizer_settings(section: Mapping[str, Any], path: str) -> tuple[dict[str, Any], list[str]]:
    found: dict[str, Any] = {}
    problems: list[str] = []
    raw_params = section.get("params")
    if isinstance(raw_params, Mapping) and "max_grad_norm" in raw_params:
        problems.append(f"{path}.params.max_grad_norm: {_WHY_GRAD_CLIP}")
        section = dict(section, params={k: v for k, v in raw_params.items() if k != "max_grad_norm"})
    _walk(section, OPTIMIZER, path, found, problems)
    kind = found.get(f"{path}.type")
    if kind is None and not any(p.startswith(f"{path}.type") for p in problems):
        problems.append(f"{path}.type: missing (Adam or AdamW)")
    if kind == "adam" and found.get(f"{path}.params.adam_w_mode") is False:
        problems.append(f"{path}.params.adam_w_mode: L2-regularized Adam is not supported, only AdamW, got false")
    prefix = f"{path}.params."
    params = {k[len(prefix):]: v for k, v in found.items() if k.startswith(prefix)}
    for name in ("bias_correction", "amsgrad"):
        params.pop(name, None)
    return params, problems


def _scheduler_settings(section: Mapping[str, Any], path: str) -> tuple[Optional[type], dict[str, Any], list[str]]:
    kind = section.get("type")
    params = section.get("params") or {}
    if isinstance(params, Mapping):
        params = {k: v for k, v in params.items() if not (isinstance(v, str) and v == "auto")}
    problems = [f"{path}.{k}: unknown key" for k in section if k not in ("type", "params")]
    if not isinstance(params, Mapping):
        return None, {}, problems + [f"{path}.params: must be an object, got {params!r}"]
    if kind in SCHEDULES:
        cls, schema = SCHEDULES[kind]
        found: dict[str, Any] = {}
        _walk(params, schema, f"{path}.params", found, problems)
        values = {k.rsplit(".", 1)[1]: v for k, v in found.items()}
        values.pop("last_batch_iteration", None)
        missing = [k for k in REQUIRED.get(kind, ()) if k not in values]
        problems += [f"{path}.params.{k}: missing (required by {kind})" for k in missing]
        return cls, values, problems
    torch_cls = getattr(torch.optim.lr_scheduler, kind, None) if isinstance(kind, str) else None
    if isinstance(torch_cls, type) and issubclass(torch_cls, LRScheduler) and torch_cls is not LRScheduler:
        try:
            inspect.signature(torch_cls).bind(None, **params)
        except TypeError as exc:
            problems.append(f"{path}.params: {exc} (for torch.optim.lr_scheduler.{kind})")
        return torch_cls, dict(params), problems
    supported = list(SCHEDULES) + ["any torch.optim.lr_scheduler class"]
    problems.append(f"{path}.type: not supported (supported: {', '.join(supported)}), got {kind!r}")
    return None, {}, problems


def _raise(problems: list[str]) -> None:
    if problems:
        lines = "\n  ".join(problems)
        raise ValueError(f"the DeepSpeed config has {len(problems)} unsupported or invalid setting(s):\n  {lines}")
