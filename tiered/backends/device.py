"""The device tier: CUDA memory when present, otherwise the compute device's (CPU) memory.

On the CPU (no CUDA, or ``StoreConfig(device="cpu")``) the tier is one plain tensor per copy under
``device_bytes``, not a pool, so the three-tier logic runs, and is tested, on machines without a GPU.

[Note: CUDA stream order]
Copies between GPU memory and a memory tier or a caller's tensor run on a side stream, issued by a
cpu-pool thread that then waits on an event recorded after them, so the loop never blocks and a
copy is complete when its coroutine returns. Two rules order them against the caller's kernels:

1. Memory the caller hands in (a put's tensor, a get's ``out``): on the caller's thread, the call
   records an event on the caller's current stream (``tiered.store.validation.ready_event``), and
   the store waits for it on a cpu-pool thread before it reads the tensor or writes ``out``, so
   kernels queued to write the tensor, or still reading ``out``, have finished.
2. Memory the store allocates on the GPU (a device-tier copy, a get's new result): the caching
   allocator hands back a block freed on the allocating stream at once, while kernels queued there
   may still read it, so the store records an event right after the allocation (:func:`allocation_event`,
   kept on a copy as ``Copy.allocated``) and the side stream waits for it on the GPU before it
   writes, blocking no thread.

tests/test_cuda.py checks each rule against a kernel queued behind a GPU sleep. Blocks staged
between the disk and GPU memory (tiered.io.spans.copy_out/copy_in) are copied on the I/O thread with a
blocking copy on the default stream: ordered, but the thread waits for the kernels queued there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any, Iterable, Optional, Sequence

import torch

from tiered.backends.base import Copy, TierBackend
from tiered.errors import CapacityError
from tiered.io.spans import Span, copy_spans
from tiered.tier import Tier


@dataclasses.dataclass(eq=False)
class DeviceCopy(Copy):
    """A copy held in one uint8 tensor on the device."""

    tensor: Optional[torch.Tensor] = None


def allocation_event(tensor: torch.Tensor) -> Any:
    """For memory just allocated on CUDA, an event on the allocating thread's current stream, which a
    side-stream copy into it must wait for (rule 2 of [Note: CUDA stream order]). None off CUDA."""
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
        # event there); what remains is memory the store itself allocated, named by `after`
        # (see [Note: CUDA stream order]).
        with torch.cuda.stream(self._stream):
            for event in after:
                self._stream.wait_event(event)
            copy_spans(dst, src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
