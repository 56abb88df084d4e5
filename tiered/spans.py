"""Spans: a logical byte sequence laid over one or more pieces of memory.

A tier copy, a caller's tensor and a result tensor are all presented as a list of spans, so one
copy routine moves bytes between any two of them and one block planner maps them onto file extents.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Span:
    """``tensor`` is a 1-D uint8 tensor (any device). ``view`` is set when the same bytes are
    page-aligned host memory usable for O_DIRECT; it may extend past the tensor up to a page boundary."""

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
    return [Span(tensor.reshape(-1).view(torch.uint8))]


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


def aligned_views(spans: Sequence[Span], start: int, stop: int, alignment: int) -> Optional[list[memoryview]]:
    """iovecs covering ``[start, stop)`` rounded up to ``alignment``, if every piece is aligned host memory.

    Returns None when some piece has no aligned view or starts mid-page, so the caller stages instead.
    """
    views: list[memoryview] = []
    parts = list(pieces(spans, start, stop))
    for i, (span, lo, hi) in enumerate(parts):
        if span.view is None or lo % alignment:
            return None
        last = i == len(parts) - 1
        if not last and hi % alignment:
            return None
        hi_io = -(-hi // alignment) * alignment
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
    """Copy logical bytes ``[start, start + len(into))`` of ``spans`` into a host buffer."""
    dst = torch.frombuffer(into, dtype=torch.uint8) if len(into) else None
    pos = 0
    for span, lo, hi in pieces(spans, start, start + len(into)):
        assert dst is not None
        dst[pos : pos + hi - lo].copy_(span.tensor[lo:hi])
        pos += hi - lo


def copy_in(spans: Sequence[Span], start: int, data: memoryview) -> None:
    """Copy a host buffer into logical bytes ``[start, start + len(data))`` of ``spans``."""
    src = torch.frombuffer(data, dtype=torch.uint8) if len(data) else None
    pos = 0
    for span, lo, hi in pieces(spans, start, start + len(data)):
        assert src is not None
        span.tensor[lo:hi].copy_(src[pos : pos + hi - lo])
        pos += hi - lo
