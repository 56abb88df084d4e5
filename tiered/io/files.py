"""Opening files for O_DIRECT and moving bytes with every syscall result checked."""

from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Callable, Optional

from tiered.config import ALIGNMENT
from tiered.errors import TransferError

PReadV = Callable[[int, list, int], int]
PWriteV = Callable[[int, list, int], int]


@dataclasses.dataclass(frozen=True)
class Syscalls:
    """The read/write primitives the I/O layer uses; tests substitute faulty ones."""

    preadv: PReadV = os.preadv
    pwritev: PWriteV = os.pwritev
    fdatasync: Callable[[int], None] = os.fdatasync


@dataclasses.dataclass
class FileHandle:
    """An open file: its descriptor, path and whether O_DIRECT is in effect."""

    fd: int
    path: str
    direct: bool

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_file(path: str, *, direct: bool, create: bool = True, read_only: bool = False,
              opener: Optional[Callable[[int], int]] = None, mode: int = 0o600) -> FileHandle:
    """Open ``path`` read-write, creating it with ``mode`` (less the umask; 0600 by default) when
    missing (``read_only``: an existing file, for reading), with O_DIRECT when asked and the
    filesystem allows.

    ``opener``, when given, is called with the open flags instead of ``os.open(path, ...)`` and returns
    the descriptor (a store opens its files relative to its locked directory, never following a link);
    ``path`` then only names the file in messages. Returns a handle whose ``direct`` says what was
    obtained; the caller decides how to warn.
    """
    flags = (os.O_RDONLY if read_only else os.O_RDWR) | getattr(os, "O_CLOEXEC", 0)
    if create and not read_only:
        flags |= os.O_CREAT

    def do_open(flags: int) -> int:
        return opener(flags) if opener is not None else os.open(path, flags, mode)

    if direct and hasattr(os, "O_DIRECT"):
        try:
            return FileHandle(do_open(flags | os.O_DIRECT), path, True)
        except OSError as exc:
            if exc.errno != 22:  # EINVAL: the filesystem (tmpfs, for one) refuses O_DIRECT
                raise
    return FileHandle(do_open(flags), path, False)


_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000
#: struct statx: 256 bytes; stx_mask at offset 0, stx_dio_mem_align (u32) at offset 152.
_STATX_SIZE = 256
_STATX_DIO_MEM_ALIGN = 152


def direct_io_memory_alignment(handle: FileHandle) -> int:
    """The memory alignment O_DIRECT needs for this file, as the kernel reports it (``statx``'s
    ``STATX_DIOALIGN``, Linux 6.1 on): NVMe drives take any 4-byte-aligned buffer, virtio disks 512
    bytes. ``ALIGNMENT`` (a page) where the kernel, the C library or the filesystem does not say, or
    says something larger than a page; file offsets and lengths stay page-aligned either way."""
    statx = getattr(ctypes.CDLL(None, use_errno=True), "statx", None)
    if statx is None or not handle.direct:
        return ALIGNMENT
    statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    statx.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(handle.fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return ALIGNMENT
    mask = ctypes.c_uint32.from_buffer_copy(buf.raw, 0).value
    align = ctypes.c_uint32.from_buffer_copy(buf.raw, _STATX_DIO_MEM_ALIGN).value
    if not mask & _STATX_DIOALIGN or align <= 0 or align > ALIGNMENT or align & (align - 1):
        return ALIGNMENT
    return align


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The iovec list with its first ``n`` bytes dropped."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:] if n else v)
        n = 0
    return out


def pwrite_full(sys: Syscalls, handle: FileHandle, views: list[memoryview], offset: int) -> None:
    """Write every byte of ``views`` (an iovec list) at ``offset``, continuing short writes.

    Raises TransferError when a syscall fails or makes no progress.
    """
    _transfer_full(sys.pwritev, "write", "made no progress; is the disk full?", handle, views, offset)


def pread_full(sys: Syscalls, handle: FileHandle, views: list[memoryview], offset: int) -> None:
    """Fill every byte of ``views`` (an iovec list) from ``offset``, continuing short reads.

    Raises TransferError when a syscall fails or the file ends early.
    """
    _transfer_full(
        sys.preadv, "read", "hit end of file; the swap file was truncated or replaced", handle, views, offset
    )


def _transfer_full(
    op: Callable[[int, list, int], int], verb: str, stalled: str, handle: FileHandle, views: list[memoryview],
    offset: int,
) -> None:
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        try:
            n = op(handle.fd, _advance(views, done), offset + done)
        except OSError as exc:
            raise TransferError(
                f"{verb} of {total - done} bytes at offset {offset + done} of {handle.path} failed: {exc}"
            ) from exc
        if n <= 0:
            raise TransferError(
                f"{verb} at offset {offset + done} of {handle.path} {stalled} ({done} of {total} bytes done)"
            )
        done += n
