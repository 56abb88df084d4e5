"""The ``optimizer`` and ``scheduler`` sections of a DeepSpeed config: their key tables and checks.

``EngineConfig.from_deepspeed`` validates both sections here (the optimizer is an object passed to
``engine.wrap``, not a config field); :mod:`engine.integrations.deepspeed.optimizer` builds the
``engine.AdamW`` and the LR scheduler they describe from the settings these functions return.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from engine.config.deepspeed_schema import (
    ACCEPT,
    DEFAULT_ONLY,
    MAP,
    InvalidValue,
    Key,
    Schema,
    check_bool,
    check_choice,
    check_int,
    check_number,
    walk_schema,
)


def _betas(v: Any) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise InvalidValue("must be a pair [beta1, beta2]")
    beta1, beta2 = (check_number(0.0, 1.0)(b) for b in v)
    if beta1 >= 1.0 or beta2 >= 1.0:
        raise InvalidValue("betas must be in [0, 1)")
    return beta1, beta2


_WHY_GRAD_CLIP = "not an optimizer parameter: use the top-level gradient_clipping (DeepSpeed refuses it too)"

ADAM_PARAMS: Schema = {
    "lr": Key(check_number(), MAP, "AdamW lr"),
    "betas": Key(_betas, MAP, "AdamW betas"),
    "eps": Key(check_number(), MAP, "AdamW eps"),
    "weight_decay": Key(check_number(), MAP, "AdamW weight_decay (DeepSpeed's default 0; 0.01 with torch_adam)"),
    "adam_w_mode": Key(check_bool, MAP, "must be true for type Adam: L2-regularized Adam is not supported"),
    "torch_adam": Key(check_bool, MAP, "true: torch's single-tensor AdamW math (bit for bit torch.optim.AdamW); "
                                       "false, DeepSpeed's default (its own fused Adam): torch's fused AdamW kernel"),
    "bias_correction": Key(check_bool, DEFAULT_ONLY, "Adam without bias correction is not supported", True),
    "amsgrad": Key(check_bool, DEFAULT_ONLY, "AMSGrad is not supported", False),
}

OPTIMIZER: Schema = {
    "type": Key(check_choice("adam", "adamw"), MAP, "engine.AdamW (the only optimizer the engine offloads)"),
    "params": ADAM_PARAMS,
    "legacy_fusion": Key(check_bool, ACCEPT, "DeepSpeed fp16 fused-optimizer detail; the engine steps its own AdamW"),
}

_WARMUP = {
    "warmup_num_steps": Key(check_int(1), MAP, "steps of warmup"),
    "warmup_type": Key(check_choice("log", "linear"), MAP, "shape of the warmup ramp"),
    "last_batch_iteration": Key(check_int(None), DEFAULT_ONLY, "resume through the scheduler's state_dict", -1),
}
_MIN_MAX = {
    "warmup_min_lr": Key(check_number(), MAP, "lr at the start of warmup"),
    "warmup_max_lr": Key(check_number(), MAP, "lr at the end of warmup"),
}
_TOTAL = {"total_num_steps": Key(check_int(), MAP, "steps of the whole schedule")}

#: DeepSpeed's own schedules the engine rebuilds (``engine.integrations.deepspeed.schedules``), with
#: the parameters each takes.
SCHEDULE_PARAMS: Mapping[str, Schema] = {
    "WarmupLR": {**_WARMUP, **_MIN_MAX},
    "WarmupDecayLR": {**_WARMUP, **_MIN_MAX, **_TOTAL},
    "WarmupCosineLR": {
        **_WARMUP, **_TOTAL,
        "warmup_min_ratio": Key(check_number(), MAP, "lr ratio at the start of warmup"),
        "cos_min_ratio": Key(check_number(), MAP, "lr ratio at the end of the cosine"),
    },
}
REQUIRED = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",)}


def optimizer_problems(section: Mapping[str, Any], path: str = "optimizer") -> list[str]:
    """Every unsupported or invalid setting of a DeepSpeed ``optimizer`` section (empty when none)."""
    return optimizer_settings(section, path)[1]


def scheduler_problems(section: Mapping[str, Any], path: str = "scheduler") -> list[str]:
    """Every unsupported or invalid setting of a DeepSpeed ``scheduler`` section (empty when none)."""
    return scheduler_settings(section, path)[2]


def torch_scheduler(kind: object) -> Optional[type]:
    """The ``torch.optim.lr_scheduler`` class called ``kind`` (DeepSpeed accepts any by name), or None."""
    cls = getattr(torch.optim.lr_scheduler, kind, None) if isinstance(kind, str) else None
    if isinstance(cls, type) and issubclass(cls, LRScheduler) and cls is not LRScheduler:
        return cls
    return None


def optimizer_settings(section: Mapping[str, Any], path: str) -> tuple[dict[str, Any], list[str]]:
    """The ``optimizer`` section at ``path``: (its ``params`` as AdamW keyword arguments, without the
    keys that only take their default; every problem)."""
    found: dict[str, Any] = {}
    problems: list[str] = []
    raw_params = section.get("params")
    if isinstance(raw_params, Mapping) and "max_grad_norm" in raw_params:
        problems.append(f"{path}.params.max_grad_norm: {_WHY_GRAD_CLIP}")
        section = dict(section, params={k: v for k, v in raw_params.items() if k != "max_grad_norm"})
    walk_schema(section, OPTIMIZER, path, found, problems)
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


def scheduler_settings(section: Mapping[str, Any], path: str) -> tuple[Optional[str], dict[str, Any], list[str]]:
    """The ``scheduler`` section at ``path``: (its type, a name of :data:`SCHEDULE_PARAMS` or of a
    ``torch.optim.lr_scheduler`` class, None when unsupported; its ``params`` as the scheduler's
    keyword arguments, without ``"auto"`` ones; every problem)."""
    kind = section.get("type")
    params = section.get("params") or {}
    if isinstance(params, Mapping):
        params = {k: v for k, v in params.items() if not (isinstance(v, str) and v == "auto")}
    problems = [f"{path}.{k}: unknown key" for k in section if k not in ("type", "params")]
    if not isinstance(params, Mapping):
        return None, {}, problems + [f"{path}.params: must be an object, got {params!r}"]
    if kind in SCHEDULE_PARAMS:
        found: dict[str, Any] = {}
        walk_schema(params, SCHEDULE_PARAMS[kind], f"{path}.params", found, problems)
        values = {k.rsplit(".", 1)[1]: v for k, v in found.items()}
        values.pop("last_batch_iteration", None)
        missing = [k for k in REQUIRED.get(kind, ()) if k not in values]
        problems += [f"{path}.params.{k}: missing (required by {kind})" for k in missing]
        return kind, values, problems
    torch_cls = torch_scheduler(kind)
    if torch_cls is not None:
        try:
            inspect.signature(torch_cls).bind(None, **params)
        except TypeError as exc:
            problems.append(f"{path}.params: {exc} (for torch.optim.lr_scheduler.{kind})")
        return str(kind), dict(params), problems
    supported = list(SCHEDULE_PARAMS) + ["any torch.optim.lr_scheduler class"]
    problems.append(f"{path}.type: not supported (supported: {', '.join(supported)}), got {kind!r}")
    return None, {}, problems
