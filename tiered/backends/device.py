"""The device tier: CUDA memory when present, otherwise the compute device's (CPU) memory."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Optional, Sequence

import torch

from tiered.backends.base import Copy, TierBackend
from tiered.errors import CapacityError
from tiered.spans import Span, copy_spans
from tiered.tier import Tier


@dataclasses.dataclass(eq=False)
class DeviceCopy(Copy):
    """A copy held in one uint8 tensor on the device."""

    tensor: Optional[torch.Tensor] = None


class DeviceBackend(TierBackend):
    """Device memory under ``budget`` bytes. On CUDA, copies run on a side stream and are waited
    for with an event on a worker thread, so the event loop never blocks."""

    tier = Tier.DEVICE

    def __init__(self, device: torch.device, budget: int, pool: concurrent.futures.Executor) -> None:
        super().__init__()
        self.device = device
        self.budget = budget
        self._pool = pool
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def footprint(self, nbytes: int) -> int:
        return nbytes

    async def allocate(self, nbytes: int) -> DeviceCopy:
        self.check_fits_budget(nbytes)
        if not self.has_room(nbytes):
            raise CapacityError(
                f"device tier: {nbytes} bytes do not fit ({self.used} of {self.budget} bytes in use)"
            )
        try:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as exc:
            raise CapacityError(
                f"device tier: the device has no room for {nbytes} bytes although the budget allows it; "
                f"lower device_bytes ({self.budget})"
            ) from exc
        self.used += nbytes
        return DeviceCopy(nbytes=nbytes, footprint=nbytes, tensor=tensor)

    def _free(self, copy: Copy) -> None:
        assert isinstance(copy, DeviceCopy)
        self.used -= copy.footprint
        copy.tensor = None

    def spans(self, copy: Copy) -> list[Span]:
        assert isinstance(copy, DeviceCopy) and copy.tensor is not None
        return [Span(copy.tensor)] if copy.nbytes else []

    async def store(self, copy: Copy, src: Sequence[Span]) -> None:
        await self.copy(self.spans(copy), src)

    async def load(self, copy: Copy, dst: Sequence[Span]) -> None:
        await self.copy(dst, self.spans(copy))

    async def copy(self, dst: Sequence[Span], src: Sequence[Span]) -> None:
        """Copy between any two span lists (host or device memory) on a worker thread."""
        if not dst:
            return
        await asyncio.get_running_loop().run_in_executor(self._pool, self._copy_blocking, dst, src)

    def _copy_blocking(self, dst: Sequence[Span], src: Sequence[Span]) -> None:
        if self._stream is None or not any(s.tensor.is_cuda for s in (*dst, *src)):
            copy_spans(dst, src)
            return
        # The store has already waited for the caller's stream (put records an event there).
        with torch.cuda.stream(self._stream):
            copy_spans(dst, src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
