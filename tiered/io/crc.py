"""CRC-32 (the zlib/gzip polynomial) of iovec lists, with libdeflate's SIMD version where there is one.

zlib's crc32 runs at about 2 GB/s a core, so on a machine with few cores and a fast disk the
checksums alone can take more than a core. libdeflate computes the same values several times
faster, so it is used when found: first the copy the ``deflate`` package bundles (a recent
libdeflate, whose CRC uses VPCLMULQDQ with AVX2 where the CPU has them), then the system's. It is
called through ctypes so that the GIL is released while it runs (the package's own
``deflate.crc32`` keeps it). Values are identical either way, so files written with one verify
with another. Where the store checks them: [Note: data checksums] in tiered.backends.nvme.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import zlib
from typing import Callable, Optional, Sequence

_Crc = Callable[[int, memoryview], int]


def _zlib_crc(crc: int, view: memoryview) -> int:
    return zlib.crc32(view, crc)


#: Buffers below this are checksummed holding the GIL: a few microseconds of work costs less than
#: handing the GIL to another thread and waiting to get it back, which a releasing call does.
_GIL_HELD_BELOW = 256 * 1024


def _libdeflate_candidates() -> list[str]:
    """Shared objects that may export ``libdeflate_crc32``, the fastest first."""
    found = []
    try:  # the deflate package's extension links libdeflate in and exports its C API
        spec = importlib.util.find_spec("deflate._deflate")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        found.append(spec.origin)
    system = ctypes.util.find_library("deflate")
    if system is not None:
        found.append(system)
    return found


def _load_libdeflate(name: str) -> Optional[_Crc]:
    try:
        releasing = ctypes.CDLL(name).libdeflate_crc32  # a CDLL call releases the GIL
        holding = ctypes.PyDLL(name).libdeflate_crc32  # a PyDLL call keeps it
    except (OSError, AttributeError):
        return None
    for fn in (releasing, holding):
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]

    def crc(value: int, view: memoryview) -> int:
        if view.readonly or not view.contiguous:
            return zlib.crc32(view, value)
        n = view.nbytes
        if n == 0:
            return value
        holder = ctypes.c_char.from_buffer(view)  # the view's first byte; its address is the view's
        try:
            fn = holding if n < _GIL_HELD_BELOW else releasing
            return fn(value, ctypes.addressof(holder), n)
        finally:
            del holder  # drop the buffer export at once, so the memory can be unmapped later

    if crc(0, memoryview(bytearray(b"123456789"))) != zlib.crc32(b"123456789"):
        return None
    return crc


def _pick() -> tuple[_Crc, str]:
    for name in _libdeflate_candidates():
        fn = _load_libdeflate(name)
        if fn is not None:
            return fn, f"libdeflate ({name})"
    return _zlib_crc, "zlib"


#: The CRC-32 update function in use, ``fn(crc, view) -> crc``, and where it comes from (for reports:
#: "zlib", or "libdeflate (path of the shared object)").
CRC32_UPDATE, CRC32_IMPL = _pick()


def crc32(views: Sequence[memoryview], length: int) -> int:
    """CRC-32 of the first ``length`` bytes of an iovec list (the GIL is released while it runs)."""
    crc = 0
    for v in views:
        if length <= 0:
            break
        crc = CRC32_UPDATE(crc, v[:length])
        length -= len(v)
    return crc
