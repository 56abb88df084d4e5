"""What ties a store to its process: the close at interpreter exit (its directory locks:
tiered/manifest/ownership.py; a forked child's copy: [Note: a store belongs to its process] in
tiered.store.calls)."""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiered.store.tiered_store import TieredStore


def close_at_exit(store: TieredStore) -> None:
    """Close ``store`` at interpreter exit if the program forgot to, so host and device entries
    are flushed and the lock released.

    It must run before concurrent.futures stops its worker pools, which happens in threading's
    exit hooks (run last-registered first), ahead of atexit handlers. A forked child inherits the
    hook and leaves the store alone: it is the parent's to close.
    """
    ref = weakref.ref(store)
    opener = os.getpid()

    def close() -> None:
        s = ref()
        if s is not None and os.getpid() == opener:
            s.sync.close()  # nothing when it is closed already

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every CPython since 3.9 has it
        import atexit

        atexit.register(close)
    else:
        register(close)
