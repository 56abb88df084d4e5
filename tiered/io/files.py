"""Opening files for O_DIRECT and moving bytes with every syscall result checked."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

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


def open_file(path: str, *, direct: bool, create: bool = True, read_only: bool = False) -> FileHandle:
    """Open ``path`` read-write with mode 0600 (``read_only``: an existing file, for reading), with
    O_DIRECT when asked and the filesystem allows.

    Returns a handle whose ``direct`` says what was obtained; the caller decides how to warn.
    """
    flags = (os.O_RDONLY if read_only else os.O_RDWR) | getattr(os, "O_CLOEXEC", 0)
    if create and not read_only:
        flags |= os.O_CREAT
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return FileHandle(os.open(path, flags | os.O_DIRECT, 0o600), path, True)
        except OSError as exc:
            if exc.errno != 22:  # EINVAL: the filesystem (tmpfs, for one) refuses O_DIRECT
                raise
    return FileHandle(os.open(path, flags, 0o600), path, False)


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
