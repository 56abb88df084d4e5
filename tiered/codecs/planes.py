"""Byte-plane split and merge kernels over numpy arrays, without temporaries.

A *part* is ``(first plane, array)``: a uint8 array holds one plane, a uint16 array holds planes
``first`` and ``first + 1`` of each element as one little-endian 16-bit value (``first`` even).

Measured per core here on 4 MiB frames: a numpy 2-D transpose moves 0.4-0.6 GB/s and a strided
copy of one byte column 2.7 GB/s, while shifting a uint16/uint32 view and storing it truncated
moves 4.7-9 GB/s for the split; the merge builds 16-bit halves with shift + or (4-8 GB/s) and,
for width 4, widens the low halves into the destination and copies the high halves in strided
(4.1 GB/s streaming). Width 8 uses strided column copies (numpy's 64-bit shifts are slow);
width 1 is a plain copy.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

Part = tuple[int, np.ndarray]
_UINT = {2: np.uint16, 4: np.uint32}


def split(src: np.ndarray, width: int, parts: Sequence[Part]) -> None:
    """Fill each part from the ``width``-byte elements of ``src`` (uint8)."""
    n = src.size // width
    if width in _UINT:
        kind = _UINT[width]
        words = src.view(kind)
        for first, out in parts:
            np.right_shift(words, kind(8 * first), out=out[:n], casting="unsafe")
        return
    for first, out in parts:
        if out.dtype == np.uint16:
            np.copyto(out[:n], src.view(np.uint16).reshape(n, width // 2)[:, first // 2])
        elif width == 1:
            np.copyto(out[:n], src)
        else:
            np.copyto(out[:n], src.reshape(n, width)[:, first])


def merge(dst: np.ndarray, width: int, parts: Sequence[Part], scratch: np.ndarray) -> None:
    """Interleave ``parts``, which cover every plane once, into ``dst`` (``n * width`` bytes).

    ``scratch`` is a uint16 array of at least ``2 * n`` elements (used for width 4).
    """
    n = dst.size // width
    if width == 2:
        out = dst.view(np.uint16)
        half = _half(parts, 0, n, out)
        if half is not out:
            np.copyto(out, half)
        return
    if width == 4:
        low, high = (_half(parts, h, n, scratch[h * n : (h + 1) * n]) for h in (0, 1))
        # A widening copy, then a strided copy into the high halves: 4.1 GB/s streaming here,
        # against 3.1 for shift + or on uint32.
        np.copyto(dst.view(np.uint32), low)
        np.copyto(dst.view(np.uint16).reshape(n, 2)[:, 1], high)
        return
    for first, plane in parts:
        if plane.dtype == np.uint16:
            np.copyto(dst.view(np.uint16).reshape(n, width // 2)[:, first // 2], plane[:n])
        elif width == 1:
            np.copyto(dst, plane[:n])
        else:
            np.copyto(dst.reshape(n, width)[:, first], plane[:n])


def _half(parts: Sequence[Part], half: int, n: int, scratch: np.ndarray) -> np.ndarray:
    """Planes ``2 * half`` and ``2 * half + 1`` as 16-bit values: a pair part as is, or two byte
    planes combined into ``scratch``."""
    low = high = None
    for first, plane in parts:
        if first == 2 * half and plane.dtype == np.uint16:
            return plane[:n]
        if first == 2 * half:
            low = plane[:n]
        elif first == 2 * half + 1:
            high = plane[:n]
    assert low is not None and high is not None, f"parts do not cover planes {2 * half} and {2 * half + 1}"
    # Widen, then shift in place: 20-30% faster than one shift that casts uint8 to uint16 on the way.
    np.copyto(scratch, high)
    np.left_shift(scratch, np.uint16(8), out=scratch)
    np.bitwise_or(scratch, low, out=scratch)
    return scratch
