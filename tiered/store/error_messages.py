"""Typed errors the store raises for one entry or a batch, naming the keys and what to do."""

from __future__ import annotations

import errno

from tiered.errors import CapacityError, ChecksumError, TieredError, TransferError


def batch_error(doing: str, failures: dict[str, BaseException], total: int) -> BaseException:
    """One error for the failed entries of a batched call: the first failure's type, naming every failed key."""
    first = next(iter(failures.values()))
    keys = list(failures)
    message = f"{doing}: {len(keys)} of {total} entries failed, keys {keys!r}; the first error: {first}"
    try:
        error = type(first)(message) if isinstance(first, TieredError) else TransferError(message)
    except TypeError:  # an error type that takes other arguments
        error = TransferError(message)
    error.__cause__ = first
    return error


def read_error(exc: BaseException, key: str) -> BaseException:
    """A failed read of one entry, naming its key."""
    if isinstance(exc, ChecksumError):
        return ChecksumError(f"entry {key!r} is corrupt on disk: {exc}")
    if isinstance(exc, TransferError):
        return TransferError(f"reading entry {key!r} failed: {exc}")
    return exc


def naming_key(exc: BaseException, doing: str, key: str) -> TieredError:
    """A failed write or commit of one entry as a typed error naming the key: CapacityError when
    the disk is full, the same type for store errors, TransferError for other OSErrors."""
    message = f"{doing} entry {key!r} failed: {exc}"
    cause = exc.__cause__ if isinstance(exc, TransferError) else exc
    if getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return CapacityError(f"{message}; free disk space or set nvme_bytes")
    if isinstance(exc, TieredError):
        return type(exc)(message)
    return TransferError(message)


def lost_at_close(failures: dict[str, tuple[int, BaseException]], entries: int) -> TieredError:
    """The error of a close that could not write some entries down (key -> (bytes, error)): those
    entries are lost; everything else is durable. CapacityError when the first failure was one."""
    lost = sum(n for n, _ in failures.values())
    first = next(iter(failures.values()))[1]
    keys = sorted(failures)
    shown = keys if len(keys) <= 8 else keys[:8] + [f"... {len(keys) - 8} more"]
    message = (
        f"close could not write {len(keys)} of {entries} entries down ({lost} bytes), and they are lost: "
        f"{shown!r}; every other entry is durable and the store is closed. The first error: {first}"
    )
    error = CapacityError(message) if isinstance(first, MemoryError) else TransferError(message)
    error.__cause__ = first
    return error
