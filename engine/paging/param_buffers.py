"""ParamBuffers: page-aligned, pre-faulted memory for parameter storage, from the store's buffer pool.

A released parameter's storage has 0 bytes; a fetch gives it bytes again. Had they come from
``resize_`` (torch's CPU allocator, i.e. malloc), every fetch of a large parameter would get a fresh
mapping: glibc returns large freed blocks to the system, so each forward takes a first-touch page
fault per 4 KiB page (~100k faults for a 0.66 GB model, about 1.5 GB/s a core here), and the memory
is only 64-byte aligned, so the store's O_DIRECT reads go through a staging buffer and a copy.

Here a large CPU parameter's storage is instead given a buffer from the store's pool
(:meth:`tiered.TieredStore.host_buffer`: page-aligned, populated): ``UntypedStorage._swap_data_ptr_``
exchanges the bytes of the parameter's own ``StorageImpl`` with the buffer's, so the
``nn.Parameter``, its storage object and every view of it stay the same objects, and the store reads
into the buffer in place. Release swaps the buffer back out and drops it: its memory returns to the
store's pool, already mapped, for the next fetch of a parameter of the same size (the layers of a
transformer share a handful of sizes) or for a get of the same size (the optimizer step's state of
the same parameters, in fp32 training).

Memory: the pool is the one large get results come from, so parameter buffers and the step's
state share one bound (``StoreConfig.result_pool_bytes``, which the engine's memory plan sizes to
the larger of the two phases' needs: [Note: One memory budget] in engine/paging/memory_plan.py).
"""

from __future__ import annotations

from typing import Callable

import torch

#: Parameters smaller than this keep torch's allocator: malloc serves them from heap memory already
#: touched, and below 1 MiB the store does not read in place anyway (tiered.io.spans.DIRECT_TENSOR_BYTES).
POOLED_MIN_BYTES = 1024 * 1024

#: Gives a page-aligned uint8 tensor of exactly the bytes asked for (``TieredStore.host_buffer``).
TakeBuffer = Callable[[int], torch.Tensor]


def swap_supported() -> bool:
    """Whether this torch can exchange two storages' bytes (``UntypedStorage._swap_data_ptr_``)."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class ParamBuffers:
    """Which parameter storage holds which pooled buffer now.

    ``take(nbytes)`` gives a buffer (``TieredStore.host_buffer``). Not thread-safe: the engine
    calls it under the pager's lock.
    """

    def __init__(self, take: TakeBuffer, *, min_bytes: int = POOLED_MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self._take = take
        self._lent: dict[int, torch.UntypedStorage] = {}  # StorageImpl (_cdata) -> what its own memory was swapped into
        self._lent_bytes = 0
        #: Buffers lent over the engine's life.
        self.lent = 0

    @property
    def lent_bytes(self) -> int:
        """Bytes of buffers that parameter storages hold now."""
        return self._lent_bytes

    def wants(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Whether a storage of ``nbytes`` on its device should get a pooled buffer."""
        return storage.device.type == "cpu" and nbytes >= self.min_bytes and swap_supported()

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` holds one of the pool's buffers."""
        return storage._cdata in self._lent

    def lend(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the allocated ``storage`` (exactly ``nbytes``, contents undefined) a pooled buffer of
        the same size instead of its own memory, which is freed untouched."""
        assert storage.nbytes() == nbytes and not self.holds(storage), (storage.nbytes(), nbytes)
        buffer = self._take(nbytes).untyped_storage()
        assert buffer.nbytes() == nbytes, (buffer.nbytes(), nbytes)
        storage._swap_data_ptr_(buffer)
        buffer.resize_(0)  # the memory the storage came with (it got the storage's allocator and flags)
        self._lent[storage._cdata] = buffer
        self._lent_bytes += nbytes
        self.lent += 1

    def give_back(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s buffer back to the pool (the storage is left with 0 bytes, resizable as before)."""
        holder = self._lent.pop(storage._cdata)
        storage._swap_data_ptr_(holder)
        self._lent_bytes -= holder.nbytes()
        del holder  # the last reference to the buffer's memory: it goes back to the store's pool
