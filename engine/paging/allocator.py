"""glibc's malloc, told to give large freed blocks back to the system: what the memory budget needs
of the process's allocator.

[Note: Heap retention]
torch's CPU tensors come from malloc. glibc serves a block of at least its mmap threshold from a
mapping of its own, unmapped when freed, and smaller ones from heaps that keep freed memory for
reuse. The threshold starts at 128 KiB but is dynamic: each time a mapped block is freed, the
threshold rises to its size (up to 32 MiB), so after a few training steps gradients, AdamW's
temporaries and small get results of up to 32 MiB all come from the heaps, and what one phase of
a step freed there stays resident through the next (measured here: 0.3-0.5 GiB kept free in the
heaps over a step of a 243 M-parameter model). The memory plan's transients are counted as the
larger of two phases, not their sum, so that memory must go back.

``limit_heap_retention`` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops it
moving) at :data:`MMAP_THRESHOLD`: blocks from there up are mapped and unmapped, smaller ones reuse
the heaps. It does nothing where the process uses another allocator (jemalloc, tcmalloc: they
return memory by their own rules), where the environment already sets the threshold
(``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...``: the user's choice
stands), or off Linux. It changes the process's allocator for the rest of its life, as setting
``MALLOC_MMAP_THRESHOLD_`` before starting it would; docs/tuning.md, "Memory", says so.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: Blocks of at least this many bytes get mappings of their own (and go back when freed).
MMAP_THRESHOLD = 1024 * 1024
#: mallopt's parameter number for the mmap threshold (glibc's malloc.h).
_M_MMAP_THRESHOLD = -3


def limit_heap_retention() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` ([Note: Heap retention]).

    Returns:
        True when this call set it; False where it left the allocator alone (not glibc's malloc, or
        the environment already sets the threshold). Idempotent.

    Raises:
        OSError: glibc refused the setting (``mallopt`` returned 0).
    """
    if not sys.platform.startswith("linux") or _set_by_environment():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        process = ctypes.CDLL(None)
        glibc_malloc = ctypes.cast(libc.malloc, ctypes.c_void_p).value
        in_use = ctypes.cast(process.malloc, ctypes.c_void_p).value
        libc.gnu_get_libc_version  # noqa: B018 - musl and others have no such symbol
    except (OSError, AttributeError):
        return False
    if glibc_malloc != in_use:  # another allocator is preloaded
        return False
    if libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD)) != 1:
        raise OSError(ctypes.get_errno(), f"mallopt(M_MMAP_THRESHOLD, {MMAP_THRESHOLD}) failed")
    return True


def _set_by_environment() -> bool:
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in os.environ.get(
        "GLIBC_TUNABLES", "")
