"""What ties a store to its process: the directory lock, and the close at interpreter exit."""

from __future__ import annotations

import fcntl
import os
import threading
import weakref
from typing import TYPE_CHECKING

from tiered.errors import StoreLockedError

if TYPE_CHECKING:
    from tiered.store.tiered_store import TieredStore

LOCK_NAME = "LOCK"


def close_at_exit(store: TieredStore) -> None:
    """Close ``store`` at interpreter exit if the program forgot to, so host and device entries
    are flushed and the lock released.

    It must run before concurrent.futures stops its worker pools, which happens in threading's
    exit hooks (run last-registered first), ahead of atexit handlers.
    """
    ref = weakref.ref(store)

    def close() -> None:
        s = ref()
        if s is not None and not s._closed:
            s.sync.close()

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every CPython since 3.9 has it
        import atexit

        atexit.register(close)
    else:
        register(close)


def acquire_lock(path: str) -> int:
    """Open and flock ``path`` (the store's LOCK file) and write our pid into it; StoreLockedError if taken."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise StoreLockedError(
            f"the store directory {os.path.dirname(path)} is already open (owner pid {owner}); "
            "close that store first, or use another path"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
