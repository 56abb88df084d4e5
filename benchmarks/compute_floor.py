"""The compute floor of a training step: the same model's step in memory, no I/O at all.

fp32: forward + backward + torch AdamW. bf16 (mixed precision, as the engine's
``train_dtype="bfloat16"``): forward + backward of the bf16 model, the gradients cast to fp32
masters, AdamW on the masters, the masters copied back into the bf16 weights. With a clip norm the
gradients are clipped first (``torch.nn.utils.clip_grad_norm_``). The whole model's step is
extrapolated from a 1- and a 2-layer copy timed here: the layers beyond the first cost what the
second costs."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from bench_output import synchronize

from engine.demo.llama import Llama, LlamaConfig


class InMemoryStep:
    """One model in ``device``'s memory and its optimizer: :meth:`__call__` runs a training step."""

    def __init__(self, cfg: LlamaConfig, device: torch.device, dtype: torch.dtype, fused: bool,
                 max_grad_norm: Optional[float]) -> None:
        torch.manual_seed(0)
        self.model = Llama(cfg).to(device=device, dtype=dtype)
        self.params = list(self.model.parameters())
        # fp32 masters beside low-precision weights; in fp32 the parameters are their own masters
        self.masters = self.params if dtype == torch.float32 else [p.detach().float() for p in self.params]
        for m in self.masters:
            m.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.masters, lr=1e-4, weight_decay=0.0, fused=fused or None)
        self.max_grad_norm = max_grad_norm

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self.model(tokens, targets).backward()
        if self.masters is not self.params:
            for p, m in zip(self.params, self.masters):
                m.grad = p.grad.float()
                p.grad = None
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad()
        if self.masters is not self.params:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)


def compute_floor(cfg: LlamaConfig, tokens: torch.Tensor, targets: torch.Tensor, reps: int, device: torch.device,
                  dtype: torch.dtype = torch.float32, fused: bool = False,
                  max_grad_norm: Optional[float] = None) -> dict[str, float]:
    """The in-memory step of ``cfg``'s model, extrapolated from a 1- and a 2-layer copy:
    ``{"one_layer_s", "two_layers_s", "seconds"}``.

    Each copy's time is its fewest seconds over ``reps`` steps (noise only adds to a floor), and the
    two copies' steps alternate: the layers beyond the first are costed at ``n_layers - 1`` times the
    difference, so a slow spell of the machine during the second copy's steps alone would be
    multiplied into the floor, while one that spans both copies' steps cancels out."""
    steps = [InMemoryStep(dataclasses.replace(cfg, n_layers=n), device, dtype, fused, max_grad_norm) for n in (1, 2)]
    tokens, targets = tokens.to(device), targets.to(device)
    times: list[list[float]] = [[], []]
    for rep in range(reps + 1):  # the first step of each builds its optimizer state: not counted
        for step, seconds in zip(steps, times):
            synchronize(device)
            start = time.perf_counter()
            step(tokens, targets)
            synchronize(device)
            if rep:
                seconds.append(time.perf_counter() - start)
    one, two = min(times[0]), min(times[1])
    return {"one_layer_s": one, "two_layers_s": two, "seconds": one + (cfg.n_layers - 1) * max(two - one, 0.0)}
