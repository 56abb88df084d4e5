"""A GPT-2-style decoder in plain torch: tied embeddings, pre-norm blocks, causal attention."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`GPT`."""

    vocab_size: int = 8192
    seq_len: int = 128
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_embd", "n_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")

    @property
    def num_params(self) -> int:
        """Parameters of the model (the tied lm_head counted once)."""
        d = self.n_embd
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return self.vocab_size * d + self.seq_len * d + self.n_layer * block + 2 * d


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a 4x GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block applied to ``x`` (batch, time, channels): attention, then the MLP, each residual."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, a final LayerNorm and a head tied to ``wte``.

    ``forward(idx, targets=None)`` returns the logits, or the mean cross-entropy loss when
    ``targets`` is given.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    def _init(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.Linear) and module.out_features == self.cfg.n_embd:
                # GPT-2's scaled init of residual projections.
                nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    def forward(self, idx: torch.Tensor, targets: "torch.Tensor | None" = None) -> torch.Tensor:
        """Logits for the token ids ``idx`` (batch, time); with ``targets``, the mean cross-entropy loss."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
