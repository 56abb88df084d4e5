"""The device tier: CUDA memory when present, otherwise the compute device's (CPU) memory."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any, Iterable, Optional, Sequence

import torch

from tiered.backends.base import Copy, TierBackend
from tiered.errors import CapacityError
from tiered.spans import Span, copy_spans
from tiered.tier import Tier


@dataclasses.dataclass(eq=False)
class DeviceCopy(Copy):
    """A copy held in one uint8 tensor on the device."""

    tensor: Optional[torch.Tensor] = None


def allocation_event(tensor: torch.Tensor) -> Any:
    """For memory the caller just allocated on CUDA, an event on the allocating thread's current stream.

    The caching allocator hands back a freed block at once, while kernels queued on that stream may
    still read it: a side-stream copy into the new tensor must wait for this event. None off CUDA.
    """
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


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
        return DeviceCopy(nbytes=nbytes, footprint=nbytes, tensor=tensor, allocated=allocation_event(tensor))

    def _free(self, copy: Copy) -> None:
        assert isinstance(copy, DeviceCopy)
        self.used -= copy.footprint
        copy.tensor = None

    def spans(self, copy: Copy) -> list[Span]:
        assert isinstance(copy, DeviceCopy) and copy.tensor is not None
        return [Span(copy.tensor)] if copy.nbytes else []

    async def store(self, copy: Copy, src: Sequence[Span]) -> None:
        await self.copy(self.spans(copy), src, after=(copy.allocated,))

    async def load(self, copy: Copy, dst: Sequence[Span]) -> None:
        await self.copy(dst, self.spans(copy))

    async def copy(self, dst: Sequence[Span], src: Sequence[Span], after: Iterable[Any] = ()) -> None:
        """Copy between any two span lists (host or device memory) on a worker thread.

        On CUDA the copy starts once the CUDA events in ``after`` (None entries are skipped) have
        fired: those of memory just allocated in ``dst`` (:func:`allocation_event`).
        """
        if not dst:
            return
        events = [e for e in after if e is not None]
        await asyncio.get_running_loop().run_in_executor(self._pool, self._copy_blocking, dst, src, events)

    def _copy_blocking(self, dst: Sequence[Span], src: Sequence[Span], after: Sequence[Any]) -> None:
        if self._stream is None or not any(s.tensor.is_cuda for s in (*dst, *src)):
            copy_spans(dst, src)
            return
        # The store has already waited for the caller's stream (put and a get into `out` record an
        # event there); what remains is memory the store itself allocated, named by `after`.
        with torch.cuda.stream(self._stream):
            for event in after:
                self._stream.wait_event(event)
            copy_spans(dst, src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
