"""Synthetic token batches a small model can learn: walks on a fixed sparse bigram table."""

from __future__ import annotations

import torch


class BigramStream:
    """Endless ``(inputs, targets)`` batches of walks on a random bigram table.

    Each token has ``branching`` possible successors, so a model that learns the table reaches
    a loss of ``ln(branching)``; the loss falls visibly within tens of steps. Deterministic in
    ``seed``; a stream restarted at the same ``step`` yields the same batches (checkpoint resume).
    """

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, *, branching: int = 4, seed: int = 0) -> None:
        if vocab_size < 2 or seq_len < 1 or batch_size < 1 or branching < 1:
            raise ValueError(
                f"BigramStream needs vocab_size >= 2, seq_len >= 1, batch_size >= 1, branching >= 1; "
                f"got {vocab_size}, {seq_len}, {batch_size}, {branching}"
            )
        self.vocab_size, self.seq_len, self.batch_size, self.seed = vocab_size, seq_len, batch_size, seed
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
        self.step = 0

    @property
    def loss_floor(self) -> float:
        """The best achievable mean cross-entropy (the table's entropy, ignoring repeated successors)."""
        return float(torch.log(torch.tensor(float(self.successors.shape[1]))))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch for ``step`` (independent of the stream's position)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(self.batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (self.batch_size,), generator=g)
        choices = torch.randint(0, self.successors.shape[1], (self.batch_size, self.seq_len), generator=g)
        for i in range(self.seq_len):
            tokens[:, i + 1] = self.successors[tokens[:, i], choices[:, i]]
        return tokens[:, :-1], tokens[:, 1:]

    def __iter__(self) -> "BigramStream":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out
