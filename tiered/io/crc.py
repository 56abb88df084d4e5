"""CRC-32 (the zlib/gzip polynomial) of iovec lists, with libdeflate's SIMD version when the system has it.

zlib's crc32 runs at about 2 GB/s a core; on a 2-core machine writing 3 GB/s that alone takes more
than a core. libdeflate (a common system library: libtiff depends on it) computes the same values
at about 10 GB/s, so it is used when present; values are identical either way, so files written
with one verify with the other.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import zlib
from typing import Callable, Optional, Sequence

_Crc = Callable[[int, memoryview], int]


def _zlib_crc(crc: int, view: memoryview) -> int:
    return zlib.crc32(view, crc)


#: Buffers below this are checksummed holding the GIL: a few microseconds of work costs less than
#: handing the GIL to another thread and waiting to get it back, which a releasing call does.
_GIL_HELD_BELOW = 256 * 1024


def _load_libdeflate() -> Optional[_Crc]:
    name = ctypes.util.find_library("deflate")
    if name is None:
        return None
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


#: The CRC-32 update function in use: ``fn(crc, view) -> crc``.
CRC32_UPDATE: _Crc = _load_libdeflate() or _zlib_crc
#: "libdeflate" or "zlib", for reports.
CRC32_IMPL = "zlib" if CRC32_UPDATE is _zlib_crc else "libdeflate"


def crc32(views: Sequence[memoryview], length: int) -> int:
    """CRC-32 of the first ``length`` bytes of an iovec list (the GIL is released while it runs)."""
    crc = 0
    for v in views:
        if length <= 0:
            break
        crc = CRC32_UPDATE(crc, v[:length])
        length -= len(v)
    return crc
