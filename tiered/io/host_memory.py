"""Page-aligned host tensors: memory the store writes from and reads into in place.

``torch.empty`` on the CPU returns memory 64 bytes past a page boundary, which O_DIRECT cannot use,
so a put of such a tensor copies it through a staging buffer and a get into it copies out of one.
A tensor from :func:`empty_aligned` starts on a page boundary, so puts and ``get(out=...)`` move its
bytes with no copy at all: the counterpart of DeepSpeed's ``aio_handle.new_cpu_locked_tensor``.
"""

from __future__ import annotations

import math
import mmap
import weakref
from typing import Optional, Sequence

import numpy as np
import torch

from tiered.io.aligned import anonymous_map

#: Transparent huge pages are 2 MiB on x86-64 and most arm64 kernels; smaller regions cannot hold one.
_HUGE_PAGE = 2 * 1024 * 1024
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def empty_aligned(
    shape: "Sequence[int] | int",
    dtype: torch.dtype = torch.float32,
    *,
    pin: Optional[bool] = None,
    huge_pages: bool = False,
) -> torch.Tensor:
    """An uninitialized CPU tensor whose memory starts on a page boundary (its own anonymous mmap).

    The store writes such a tensor to nvme and reads into it (``get(key, out=t)``) with O_DIRECT in
    place, skipping the staging copy a ``torch.empty`` tensor needs, once it is at least 1 MiB.
    ``pin`` page-locks it for asynchronous host<->GPU copies (``cudaHostRegister``); the default pins
    when CUDA is available. The memory is unpinned and unmapped when the last tensor viewing it dies.
    A new mapping reads as zeros. Its pages are all populated here, in one kernel call, as DeepSpeed's
    ``new_cpu_locked_tensor`` populates its memory by locking it (``tiered.io.aligned.anonymous_map``);
    without ``pin`` it is also page-locked (``mlock``) where the process may lock that much (root,
    or a raised ``RLIMIT_MEMLOCK``), and stays unlocked otherwise (``tiered.io.aligned.lock_pages``).

    ``huge_pages=True`` asks for transparent huge pages (``MADV_HUGEPAGE``) where the kernel gives
    them on request: O_DIRECT then pins one page per 2 MiB instead of 512. Allocation may be slow
    (the kernel may compact memory to find 2 MiB pages: 0.3-5.5 GB/s measured on the development
    VM), so it is off by default.
    """
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"empty_aligned: shape must be non-negative ints, got {shape!r}")
    if not isinstance(dtype, torch.dtype) or dtype in _QUANTIZED:
        raise TypeError(f"empty_aligned: dtype must be a non-quantized torch.dtype, got {dtype!r}")
    nbytes = math.prod(dims) * dtype.itemsize
    if pin is None:
        pin = torch.cuda.is_available()
    elif pin and not torch.cuda.is_available():
        raise ValueError("empty_aligned: pin=True page-locks memory for CUDA, which is not available here; "
                         "leave pin unset (pins only under CUDA) or pass pin=False")
    if not isinstance(huge_pages, bool):
        raise TypeError(f"empty_aligned: huge_pages must be True or False, got {huge_pages!r}")
    buf = anonymous_map(nbytes, populate=True, huge_pages=huge_pages and nbytes >= _HUGE_PAGE, lock=not pin)
    array = np.frombuffer(buf, dtype=np.uint8)
    if pin:
        _pin(array, buf)
    # The tensor keeps `array` alive and `array` keeps the mapping; when the last view dies, both go.
    return torch.from_numpy(array)[:nbytes].view(dtype).view(dims)


def is_page_aligned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a CPU tensor whose data starts on a page boundary."""
    return tensor.device.type == "cpu" and tensor.data_ptr() % mmap.PAGESIZE == 0


def _pin(array: np.ndarray, buf: mmap.mmap) -> None:
    cudart = torch.cuda.cudart()
    address = array.ctypes.data
    err = int(cudart.cudaHostRegister(address, len(buf), 0))
    if err != 0:
        raise RuntimeError(
            f"cudaHostRegister of {len(buf)} bytes failed with CUDA error {err}; "
            "pass pin=False or raise the locked-memory limit (ulimit -l)"
        )
    # The finalizer holds `buf`, so the memory is unregistered before it is unmapped.
    weakref.finalize(array, _unpin, cudart, address, buf).atexit = False


def _unpin(cudart: object, address: int, buf: mmap.mmap) -> None:
    cudart.cudaHostUnregister(address)  # type: ignore[attr-defined]
    del buf
