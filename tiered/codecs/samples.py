"""Synthetic auxiliary-data tensors, the issue's ratio targets, and the order-0 entropy floor.

Used by the codec benchmark and tests. The Adam states are what AdamW stores after its first
step on a gradient g ~ N(0, 1e-3), up to rounding: exp_avg = (1 - beta1) g and
exp_avg_sq = (1 - beta2) g^2. That is the least compressible step for exp_avg_sq here: the
states of later steps spread over fewer exponents.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

#: Compressed/original ratio each kind must reach on 64 MiB tensors.
TARGETS: dict[str, float] = {
    "bf16_weights": 0.675,
    "fp32_master": 0.840,
    "adam_exp_avg": 0.850,
    "adam_exp_avg_sq": 0.835,
    "fp32_grad": 0.862,
    "fp32_upcast_bf16": 0.345,
}
KINDS = tuple(TARGETS)
BETA1, BETA2 = 0.9, 0.999


def synthetic(kind: str, nbytes: int, seed: int = 0) -> torch.Tensor:
    """A 1-D tensor of about ``nbytes`` bytes of the named kind (see ``KINDS``)."""
    make = _MAKERS.get(kind)
    if make is None:
        raise ValueError(f"unknown tensor kind {kind!r}; expected one of {KINDS}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    return make(torch.Generator().manual_seed(seed), nbytes)


def entropy_floor(tensor: torch.Tensor) -> float:
    """Order-0 entropy of each byte plane, summed, over 8 bits per byte: the ratio a coder of
    independent bytes per plane cannot beat."""
    width = tensor.element_size()
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    if data.size == 0:
        return 1.0
    columns = data.reshape(-1, width)
    bits = 0.0
    for j in range(width):
        counts = np.bincount(columns[:, j], minlength=256).astype(np.float64)
        p = counts[counts > 0] / columns.shape[0]
        bits += float(-(p * np.log2(p)).sum())
    return bits / (8 * width)


def _normal(g: torch.Generator, count: int, std: float) -> torch.Tensor:
    return torch.randn(count, generator=g) * std


_MAKERS: dict[str, Callable[[torch.Generator, int], torch.Tensor]] = {
    "bf16_weights": lambda g, n: _normal(g, n // 2, 0.02).bfloat16(),
    "fp32_master": lambda g, n: _normal(g, n // 4, 0.02),
    "adam_exp_avg": lambda g, n: _normal(g, n // 4, 1e-3).mul_(1 - BETA1),
    "adam_exp_avg_sq": lambda g, n: _normal(g, n // 4, 1e-3).square_().mul_(1 - BETA2),
    "fp32_grad": lambda g, n: _normal(g, n // 4, 1e-3),
    "fp32_upcast_bf16": lambda g, n: _normal(g, n // 4, 0.02).bfloat16().float(),
}
