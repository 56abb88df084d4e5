"""ParamBuffers: page-aligned, pre-faulted memory for parameter storage, reused across fetches.

A released parameter's storage has 0 bytes; a fetch gives it bytes again. Had they come from
``resize_`` (torch's CPU allocator, i.e. malloc), every fetch of a large parameter would get a fresh
mapping: glibc returns large freed blocks to the system, so each forward takes a first-touch page
fault per 4 KiB page (~100k faults for a 0.66 GB model, about 1.5 GB/s a core here), and the memory
is only 64-byte aligned, so the store's O_DIRECT reads go through a staging buffer and a copy.

Here a large CPU parameter's storage is instead given one of these buffers (anonymous mmap,
populated at creation, page-aligned): ``UntypedStorage._swap_data_ptr_`` exchanges the bytes of the
parameter's own ``StorageImpl`` with a buffer's, so the ``nn.Parameter``, its storage object and
every view of it stay the same objects, and the store reads into the buffer in place. Release swaps
the buffer back out, and it waits, already mapped, for the next fetch of a parameter of the same
size (the layers of a transformer share a handful of sizes).

Memory: idle buffers are kept only while buffers in use plus idle ones stay within the most bytes
ever in use at once plus the largest buffer: at most one parameter above the peak of parameter
memory the engine already reached (held + prefetch window); beyond that idle buffers of the size
returned least recently are unmapped first. The one buffer of slack is what lets a parameter used at both ends of a
forward (a tied embedding / LM head, larger than the window's other contents) keep its buffer
while the layers stream through the window between its uses, instead of populating it anew every
forward (0.08-0.12 s for 206 MB here).
"""

from __future__ import annotations

import collections
import mmap

import torch

from tiered.util import anonymous_map

#: Parameters smaller than this keep torch's allocator: malloc serves them from heap memory already
#: touched, and below 1 MiB the store does not read in place anyway (tiered.spans.DIRECT_TENSOR_BYTES).
POOLED_MIN_BYTES = 1024 * 1024


def swap_supported() -> bool:
    """Whether this torch can exchange two storages' bytes (``UntypedStorage._swap_data_ptr_``)."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class ParamBuffers:
    """Idle page-aligned buffers by size, and which parameter storage holds which buffer now.

    Not thread-safe: the engine calls it under the pager's lock.
    """

    def __init__(self, *, min_bytes: int = POOLED_MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self._idle: collections.OrderedDict[int, list[torch.UntypedStorage]] = collections.OrderedDict()
        self._idle_bytes = 0
        self._lent: dict[int, torch.UntypedStorage] = {}  # StorageImpl (_cdata) -> what its own memory was swapped into
        self._lent_bytes = 0
        self._peak_lent = 0
        self._largest = 0
        self.created = 0
        self.reused = 0

    @property
    def idle_bytes(self) -> int:
        """Bytes of buffers waiting for reuse (mapped, not holding any parameter)."""
        return self._idle_bytes

    @property
    def lent_bytes(self) -> int:
        """Bytes of buffers that parameter storages hold now."""
        return self._lent_bytes

    def wants(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Whether a storage of ``nbytes`` on its device should get a pooled buffer."""
        return storage.device.type == "cpu" and nbytes >= self.min_bytes and swap_supported()

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` holds one of this pool's buffers."""
        return storage._cdata in self._lent

    def lend(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the allocated ``storage`` (exactly ``nbytes``, contents undefined) a pooled buffer of
        the same size instead of its own memory, which is freed untouched."""
        assert storage.nbytes() == nbytes and not self.holds(storage), (storage.nbytes(), nbytes)
        buffer = self._take(nbytes)
        storage._swap_data_ptr_(buffer)
        buffer.resize_(0)  # the memory the storage came with (it got the storage's allocator and flags)
        self._lent[storage._cdata] = buffer
        self._lent_bytes += nbytes
        self._peak_lent = max(self._peak_lent, self._lent_bytes)
        self._largest = max(self._largest, nbytes)
        self._trim()

    def give_back(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s buffer back (the storage is left with 0 bytes, resizable as before)."""
        holder = self._lent.pop(storage._cdata)
        storage._swap_data_ptr_(holder)
        nbytes = holder.nbytes()
        self._lent_bytes -= nbytes
        self._idle.setdefault(nbytes, []).append(holder)
        self._idle.move_to_end(nbytes)
        self._idle_bytes += nbytes
        self._trim()

    def clear(self) -> None:
        """Unmap every idle buffer (buffers lent out stay with their storages until given back)."""
        self._idle.clear()
        self._idle_bytes = 0

    def _take(self, nbytes: int) -> torch.UntypedStorage:
        bucket = self._idle.get(nbytes)
        if bucket:
            self._idle_bytes -= nbytes
            self.reused += 1
            buffer = bucket.pop()
            if not bucket:
                del self._idle[nbytes]
            return buffer
        self.created += 1
        return _new_buffer(nbytes)

    def _trim(self) -> None:
        """Unmap idle buffers, of the size returned least recently first, until lent + idle <= the peak
        lent + the largest buffer."""
        while self._idle and self._lent_bytes + self._idle_bytes > self._peak_lent + self._largest:
            nbytes, bucket = next(iter(self._idle.items()))
            bucket.pop(0)
            self._idle_bytes -= nbytes
            if not bucket:
                del self._idle[nbytes]


def _new_buffer(nbytes: int) -> torch.UntypedStorage:
    """A storage of exactly ``nbytes`` over its own page-aligned anonymous mapping, backed by transparent
    huge pages where the system allows it, with every page populated now (one kernel call instead of a
    fault per page)."""
    region = anonymous_map(nbytes, populate=True, huge_pages=True)
    # The storage keeps the mapping alive (torch.frombuffer holds a reference to it); it is unmapped
    # when the last reference goes.
    storage = torch.frombuffer(region, dtype=torch.uint8, count=nbytes).untyped_storage()
    assert storage.data_ptr() % mmap.PAGESIZE == 0 and storage.nbytes() == nbytes
    return storage
