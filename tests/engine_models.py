"""Small models and helpers shared by the engine's tests (test_engine_*.py)."""

from __future__ import annotations

import copy
import math
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import engine
import tiered

KiB = 1024


# ---------------------------------------------------------------------------- models


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT in plain torch with tied token embedding and LM head. ``checkpoint``: None,
    "reentrant" or "non_reentrant" activation checkpointing of every block."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, ctx: int = 16,
                 checkpoint: Optional[str] = None) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.checkpoint is None:
                x = block(x)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
        return self.lm_head(self.ln_f(x))


class ConvNet(nn.Module):
    """Conv, batch norm (running-stat buffers), pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def gpt_tokens(batch: int = 2, t: int = 12, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    """Random token ids."""
    return torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(seed))


def images(batch: int = 4, seed: int = 0) -> torch.Tensor:
    """Random 3x16x16 images."""
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- engine helpers


def store_config(tmp_path, *, host_bytes: int = 64 * KiB, device_bytes: int = 0, **kw) -> tiered.StoreConfig:
    """A small, fast store under ``tmp_path`` (budgets tight enough for small models to evict)."""
    return tiered.StoreConfig(
        path=str(tmp_path / "store"), host_bytes=host_bytes, device_bytes=device_bytes, device="cpu",
        prefault_host=False, durable=False, block_size=64 * KiB, swap_grow_bytes=1024 * KiB, io_threads=4,
        queue_depth=8, staging_buffers=4, result_pool_bytes=0, **kw,
    )


def engine_config(tmp_path, *, tier: str = "nvme", prefetch_bytes: int = 16 * KiB, **store_kw) -> engine.EngineConfig:
    """An EngineConfig over :func:`store_config`."""
    return engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path, **store_kw), param_tier=tier,
                               prefetch_bytes=prefetch_bytes)


def param_bytes(model: nn.Module) -> int:
    """Bytes of the model's unique parameters."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def largest_module_bytes(model: nn.Module) -> int:
    """Bytes of the largest set of parameters any one module owns directly."""
    return max(
        sum(p.numel() * p.element_size() for p in {id(p): p for p in m._parameters.values() if p is not None}.values())
        for m in model.modules()
    )


def assert_same_grads(model: nn.Module, ref: nn.Module) -> None:
    """Every parameter's gradient equals the reference's exactly (None where it is None)."""
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            assert p.grad is not None, name
            assert torch.equal(p.grad, q.grad), name


def assert_same_params(model: nn.Module, ref: nn.Module) -> None:
    """Every parameter and buffer equals the reference's exactly."""
    for (name, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(p, q), name


def train_parity(
    model: nn.Module,
    config: engine.EngineConfig,
    inputs: Iterable[torch.Tensor],
    loss_fn: Callable[[object], torch.Tensor] = lambda out: out.float().pow(2).mean(),
    *,
    forward: Callable[[nn.Module, torch.Tensor], object] = lambda m, x: m(x),
    output: Callable[[object], torch.Tensor] = lambda out: out,
) -> engine.Engine:
    """Run forward + backward on ``model`` wrapped and on an unwrapped deep copy, for each input;
    assert outputs and gradients are exactly equal. Returns the (still open) engine."""
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, config=config)
    try:
        for x in inputs:
            out, want = forward(model, x), forward(ref, x)
            assert torch.equal(output(out), output(want))
            loss_fn(out).backward()
            loss_fn(want).backward()
            assert_same_grads(model, ref)
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
    except BaseException:
        eng.close()
        raise
    return eng
