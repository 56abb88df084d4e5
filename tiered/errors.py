"""The store's typed exceptions.

Every error the store raises on purpose derives from :class:`TieredError`, so callers can catch the
whole family; each subclass also derives from the builtin a Python programmer would expect.
"""

from __future__ import annotations


class TieredError(Exception):
    """Base class of every error the store raises on purpose."""


class CapacityError(TieredError, MemoryError):
    """A tier cannot hold the requested bytes, even after evicting everything it may evict."""


class ChecksumError(TieredError, IOError):
    """Bytes read back from a swap file do not match the checksum recorded when they were written."""


class TransferError(TieredError, IOError):
    """A read or write syscall failed or moved fewer bytes than asked and could not be continued."""


class StoreLockedError(TieredError, RuntimeError):
    """Another process (or another open store in this process) owns the store directory."""


class StoreClosedError(TieredError, RuntimeError):
    """The store was closed; open it again to use it."""


class StoreForkedError(TieredError, RuntimeError):
    """The store was opened by the process this one was forked from, and belongs to it: a forked
    child (a DataLoader worker, say) opens a store of its own, on other directories."""


class ManifestError(TieredError, RuntimeError):
    """The manifest is unreadable or does not match the configuration it is opened with."""


class KeyNotFoundError(TieredError, KeyError):
    """The key is not in the store."""

    def __str__(self) -> str:  # KeyError's default repr-quotes the message
        return str(self.args[0]) if self.args else "key not found"
