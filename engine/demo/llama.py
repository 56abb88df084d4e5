"""A Llama-style decoder in plain torch: RMSNorm, rotary attention, a SwiGLU MLP, an untied head.

It is the model of the beyond-memory benchmark and of ``tiered train --beyond-memory``: sized from
a byte budget of training state rather than from a named checkpoint, so it needs no download and
no dependency beyond torch. Built under ``torch.device("meta")`` it takes no memory until
``engine.wrap`` initializes it one module at a time (every module here has ``reset_parameters``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

#: Bytes of training state per fp32 parameter: the parameter, its gradient and AdamW's two moments.
STATE_BYTES_PER_PARAM = 16


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a :class:`Llama`. ``ffn_dim`` 0 takes Llama's 8/3 x ``dim``, rounded up to 256."""

    vocab_size: int = 32000
    dim: int = 2560
    n_layers: int = 28
    n_heads: int = 20
    ffn_dim: int = 0
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.ffn_dim, bool) or not isinstance(self.ffn_dim, int) or self.ffn_dim < 0:
            raise ValueError(f"LlamaConfig.ffn_dim must be an int >= 0, got {self.ffn_dim!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"LlamaConfig.dim ({self.dim}) must split into n_heads ({self.n_heads}) heads of an "
                             "even width")
        if self.ffn_dim == 0:
            object.__setattr__(self, "ffn_dim", -(-(8 * self.dim // 3) // 256) * 256)

    @property
    def params_per_layer(self) -> int:
        """Parameters of one block: four attention projections, three MLP matrices, two norms."""
        return 4 * self.dim * self.dim + 3 * self.dim * self.ffn_dim + 2 * self.dim

    @property
    def num_params(self) -> int:
        """Parameters of the whole model (embedding and head untied)."""
        return self.n_layers * self.params_per_layer + 2 * self.vocab_size * self.dim + self.dim

    @classmethod
    def for_state_bytes(cls, state_bytes: int, **sizes: int) -> "LlamaConfig":
        """The config with the fewest layers whose fp32 training state (:data:`STATE_BYTES_PER_PARAM`
        bytes a parameter) reaches ``state_bytes``; ``sizes`` override the width, vocabulary and heads.

        Raises:
            ValueError: ``state_bytes`` is not a positive int.
        """
        if isinstance(state_bytes, bool) or not isinstance(state_bytes, int) or state_bytes < 1:
            raise ValueError(f"state_bytes must be a positive int, got {state_bytes!r}")
        one = cls(n_layers=1, **sizes)
        rest = state_bytes // STATE_BYTES_PER_PARAM - (one.num_params - one.params_per_layer)
        return dataclasses.replace(one, n_layers=max(1, -(-rest // one.params_per_layer)))


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in the input's dtype."""

    def __init__(self, dim: int, eps: float, device: "torch.device | str | None" = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, tokens, head_dim), pairs of halves rotated."""
    t, half = x.shape[-2], x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class Block(nn.Module):
    """Pre-norm Llama block: rotary causal self-attention, then a SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.theta = cfg.n_heads, cfg.rope_theta
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attention_norm(x)
        heads = (w(h).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k, v = heads
        y = F.scaled_dot_product_attention(rotate(q, self.theta), rotate(k, self.theta), v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Token embedding, ``n_layers`` blocks, a final RMSNorm and an untied output head.

    ``forward(idx, targets=None)`` returns the logits, or the mean cross-entropy loss when
    ``targets`` is given.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.apply(init_weights)

    def forward(self, idx: torch.Tensor, targets: "torch.Tensor | None" = None) -> torch.Tensor:
        if idx.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than max_seq_len={self.cfg.max_seq_len}")
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def init_weights(module: nn.Module) -> None:
    """Llama's initialization of one module (normal, std 0.02; norms at one); an ``init_fn`` for
    ``engine.wrap`` of a model built on the meta device."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, RMSNorm):
        module.reset_parameters()
