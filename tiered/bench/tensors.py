"""Test data: tensors whose values look like trained weights (N(0, 0.02)), so compression figures
mean something, built fast enough that a run spends its time on I/O."""

from __future__ import annotations

from typing import Sequence

import torch

#: Values are drawn once into a pool this large, then each tensor copies a window of it, shifted
#: per tensor, so tensors differ (a mix-up fails verification) at memcpy speed.
_POOL_ELEMENTS = 8 * 1024 * 1024


class TensorFactory:
    """Makes distinct N(0, 0.02) tensors of a given byte size and dtype."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self._pool = (torch.randn(_POOL_ELEMENTS, generator=g) * 0.02).to(dtype)
        self._count = 0

    def make(self, nbytes: int) -> torch.Tensor:
        """A new 1-D tensor of ``nbytes`` (rounded down to whole elements, at least one)."""
        itemsize = self._pool.element_size()
        n = max(nbytes // itemsize, 1)
        self._count += 1
        start = (self._count * 1_000_003) % _POOL_ELEMENTS
        out = torch.empty(n, dtype=self.dtype)
        pos = 0
        while pos < n:
            take = min(n - pos, _POOL_ELEMENTS - start)
            out[pos : pos + take] = self._pool[start : start + take]
            pos += take
            start = 0
        out[0] = float(self._count)  # no two tensors are equal, even when windows coincide
        return out

    def make_all(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        """One tensor per size."""
        return [self.make(n) for n in sizes]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    x, y = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if x.numel() % 8 == 0 and x.data_ptr() % 8 == 0 and y.data_ptr() % 8 == 0:
        x, y = x.view(torch.int64), y.view(torch.int64)  # compares 6x faster than bytes
    return torch.equal(x, y)
