"""Spans: a logical byte sequence laid over one or more pieces of memory.

A tier copy, a caller's tensor and a result tensor are all presented as a list of spans, so one
copy routine moves bytes between any two of them and one block planner maps them onto file extents.

[Note: in-place O_DIRECT]
A block moves straight between its memory and the disk, with no copy, when O_DIRECT is on and
:func:`aligned_views` finds every piece of that memory usable: host memory the store may hand the
kernel (a span with a ``view``), at an address the disk takes, every piece but the last a multiple
of 4 KiB long, and the last one's view reaching the block's end rounded up to 4 KiB. The address
rule is the kernel's (``statx``'s ``STATX_DIOALIGN``: 4 bytes on NVMe drives, 512 on virtio disks,
a page where it does not say; ``tiered.io.files.direct_io_memory_alignment``). So host-tier copies,
codec payloads and decode buffers, large CPU get results (:func:`new_result`) and callers' CPU
tensors of ``DIRECT_TENSOR_BYTES`` or more at a suitable address (those of ``tiered.empty_aligned``
always; torch's own where the disk takes their 64-byte alignment) move in place. Everything else
(GPU memory, a device tier on the CPU, smaller or misaligned tensors, the last partial page of a
caller's tensor: see [Note: tail padding] in tiered.io.blocks), and every block of swap files
opened without O_DIRECT, goes through a staging slot (see [Note: blocks in flight] in
tiered.io.blocks), copied in or out on the I/O thread.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from typing import Iterator, Optional, Sequence

import torch

from tiered.io.results import ResultPool

#: CPU results of a get at least this large get page-aligned memory of their own (see new_result):
#: recycled, already faulted in, and read into with O_DIRECT in place. torch.empty's memory of this
#: size may or may not come back faulted in, depending on the allocator's history; for smaller
#: results the heap's reuse of memory it has touched can beat the pool.
DIRECT_RESULT_BYTES = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Span:
    """``tensor`` is a 1-D uint8 tensor (any device). ``view`` is set when the same bytes are host
    memory O_DIRECT may move in place (whether its address suits the disk is :func:`aligned_views`'
    call); it may extend past the tensor, up to a page boundary, where that memory is the store's."""

    tensor: torch.Tensor
    view: Optional[memoryview] = None

    @property
    def nbytes(self) -> int:
        """Logical bytes in this span."""
        return self.tensor.numel()


def spans_of_tensor(tensor: torch.Tensor) -> list[Span]:
    """The bytes of a contiguous tensor as one span (no copy)."""
    assert tensor.is_contiguous()
    if tensor.numel() == 0:
        return []
    # Each torch call drops and retakes the GIL; skip the ones that would change nothing.
    flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
    data = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    return [Span(data, _direct_view(data))]


#: A CPU tensor at least this large whose memory is aligned as the disk's O_DIRECT needs is read into
#: and written from in place (no staging copy): a page on most disks; 512 bytes on virtio disks and 4
#: on NVMe drives where the kernel says so (tiered.io.files.direct_io_memory_alignment), which takes
#: torch's own 64-byte-aligned tensors. torch gives tensors of 2 MiB and more page-aligned memory
#: when the environment has THP_MEM_ALLOC_ENABLE=1.
DIRECT_TENSOR_BYTES = 1024 * 1024


def _direct_view(data: torch.Tensor) -> Optional[memoryview]:
    """A view of exactly ``data``'s bytes (never past its end) when O_DIRECT may use them in place."""
    if data.device.type != "cpu" or data.numel() < DIRECT_TENSOR_BYTES:
        return None
    return memoryview((ctypes.c_char * data.numel()).from_address(data.data_ptr())).cast("B")


def new_result(
    shape: Sequence[int], dtype: torch.dtype, device: "torch.device | str", pool: ResultPool
) -> tuple[torch.Tensor, list[Span]]:
    """An uninitialized tensor for a get to fill, and its bytes as spans.

    A large CPU result takes page-aligned memory from ``pool`` (recycled from results the caller
    freed, else freshly mapped) with an aligned view, so O_DIRECT reads land in it with no staging
    copy. Other results come from ``torch.empty``.
    """
    device = torch.device(device)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if device.type == "cpu" and nbytes >= DIRECT_RESULT_BYTES:
        raw, view = pool.take(nbytes)
        tensor = typed_view(raw, dtype, shape)
        if tensor is not None:
            return tensor, [Span(raw, view)]
        view.release()  # a dtype uint8 memory cannot be viewed as: use torch.empty
    tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
    return tensor, spans_of_tensor(tensor)


def typed_view(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> Optional[torch.Tensor]:
    """``raw`` (uint8 bytes) viewed as ``dtype`` and ``shape``, or None for a dtype it cannot be viewed as."""
    try:
        return raw.view(dtype).view(tuple(shape))
    except (RuntimeError, TypeError):
        return None


def total_bytes(spans: Sequence[Span]) -> int:
    """Sum of the spans' logical bytes."""
    return sum(s.nbytes for s in spans)


def pieces(spans: Sequence[Span], start: int, stop: int) -> Iterator[tuple[Span, int, int]]:
    """Yield ``(span, lo, hi)`` for each span overlapping logical bytes ``[start, stop)``."""
    pos = 0
    for span in spans:
        end = pos + span.nbytes
        if end > start and pos < stop:
            yield span, max(start, pos) - pos, min(stop, end) - pos
        if end >= stop:
            return
        pos = end


def aligned_views(
    spans: Sequence[Span], start: int, stop: int, alignment: int, memory_alignment: Optional[int] = None
) -> Optional[list[memoryview]]:
    """iovecs covering ``[start, stop)`` rounded up to ``alignment``, if O_DIRECT can use every piece in place:
    each starts at an address that is a multiple of ``memory_alignment`` (default ``alignment``), each
    but the last is a multiple of ``alignment`` long, and the last one's view reaches its rounded-up end.

    Returns None otherwise, so the caller stages instead.
    """
    memory_alignment = memory_alignment or alignment
    views: list[memoryview] = []
    parts = list(pieces(spans, start, stop))
    for i, (span, lo, hi) in enumerate(parts):
        if span.view is None or (_address(span.view) + lo) % memory_alignment:
            return None
        last = i == len(parts) - 1
        if not last and (hi - lo) % alignment:
            return None
        hi_io = lo + -(-(hi - lo) // alignment) * alignment
        if hi_io > len(span.view):
            return None
        views.append(span.view[lo:hi_io])
    return views


def copy_spans(dst: Sequence[Span], src: Sequence[Span], *, non_blocking: bool = False) -> None:
    """Copy all logical bytes of ``src`` into ``dst`` (equal totals), piece by piece."""
    assert total_bytes(dst) == total_bytes(src), (total_bytes(dst), total_bytes(src))
    si = di = 0
    s_off = d_off = 0
    while si < len(src) and di < len(dst):
        s, d = src[si].tensor, dst[di].tensor
        n = min(s.numel() - s_off, d.numel() - d_off)
        d[d_off : d_off + n].copy_(s[s_off : s_off + n], non_blocking=non_blocking)
        s_off += n
        d_off += n
        if s_off == s.numel():
            si, s_off = si + 1, 0
        if d_off == d.numel():
            di, d_off = di + 1, 0


def copy_out(spans: Sequence[Span], start: int, into: memoryview) -> None:
    """Copy logical bytes ``[start, start + len(into))`` of ``spans`` into a writable host buffer."""
    if not len(into):
        return
    base = _address(into)
    dst = None
    pos = 0
    for span, lo, hi in pieces(spans, start, start + len(into)):
        if span.tensor.device.type == "cpu":
            _memmove(base + pos, _data_ptr(span.tensor) + lo, hi - lo)
        else:
            dst = torch.frombuffer(into, dtype=torch.uint8) if dst is None else dst
            dst[pos : pos + hi - lo].copy_(span.tensor[lo:hi])
        pos += hi - lo


def copy_in(spans: Sequence[Span], start: int, data: memoryview) -> None:
    """Copy a writable host buffer into logical bytes ``[start, start + len(data))`` of ``spans``."""
    if not len(data):
        return
    base = _address(data)
    src = None
    pos = 0
    for span, lo, hi in pieces(spans, start, start + len(data)):
        if span.tensor.device.type == "cpu":
            _memmove(_data_ptr(span.tensor) + lo, base + pos, hi - lo)
        else:
            src = torch.frombuffer(data, dtype=torch.uint8) if src is None else src
            span.tensor[lo:hi].copy_(src[pos : pos + hi - lo])
        pos += hi - lo


# Staged blocks move host bytes with memmove (one thread) rather than Tensor.copy_, which splits
# every copy over torch's intra-op threads: with several I/O threads copying at once on a small
# machine that oversubscribes the cores. Large copies release the GIL (ctypes.memmove); small ones
# keep it, as handing the GIL over and back costs more than copying a few pages.
_GIL_HELD_BELOW = 256 * 1024
_memmove_holding_gil = ctypes.PyDLL(None).memmove
_memmove_holding_gil.restype = ctypes.c_void_p
_memmove_holding_gil.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def _memmove(dst: int, src: int, n: int) -> None:
    (_memmove_holding_gil if n < _GIL_HELD_BELOW else ctypes.memmove)(dst, src, n)


def _address(view: memoryview) -> int:
    holder = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder  # release the buffer export at once; the memory stays owned by the caller


def _data_ptr(tensor: torch.Tensor) -> int:
    assert tensor.dim() == 1 and tensor.stride(0) == 1 and tensor.element_size() == 1
    return tensor.data_ptr()
