"""Helpers of the store that packages built on it may use, under stable names.

- :func:`crc32`: the CRC-32 the store checksums data with (libdeflate when present, else zlib).
- :func:`round_up`, :func:`anonymous_map`: page- and O_DIRECT-aligned sizes and memory.
- :class:`SequentialWriter`, :class:`RangeReader`: a file written or read in large O_DIRECT blocks.
- :func:`wait_all`: wait for a batch of futures, then raise the first error.
- :func:`format_bytes`, :func:`parse_size`: ``1.5 MiB`` and back; :class:`ByteProgress`: a byte bar.
- :func:`nearest_existing_directory`: where a directory the store would create lives.
- :class:`CommandErrors`: a command's errors as one line and an exit status.
- :class:`OwnedDirectory`: a directory held open and locked, as a store holds its own, so that a tool
  never removes a store in use.
- :data:`CODEC_CACHE_BYTES`: the idle buffers a compressing codec keeps for reuse;
  :data:`POOLED_RESULT_BYTES`: gets of at least this many bytes return memory from the store's result
  pool (``StoreConfig.result_pool_bytes``). Memory estimates count both.

The modules they come from are the store's internals and may move; these names stay. The engine
(``engine/``) reaches the store through ``tiered``, this module and the ``tiered`` command's
:mod:`tiered.cli` only. This package's own submodules (``loop``, ``keylocks``, ``progress``) are
small utilities of the store, not public.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from types import TracebackType
from typing import Any, Mapping, Optional, TextIO, Union

from tiered.config import GiB, KiB, MiB

#: Where each name this module passes on lives (under another name for the two constants): imported
#: on first use, so that the store's own modules may import this package's submodules (``loop``,
#: ``keylocks``, ``progress``) without loading the offline tools these come from.
_HOMES = {
    "CODEC_CACHE_BYTES": ("tiered.codecs.bplane", "CACHE_BYTES"),
    "POOLED_RESULT_BYTES": ("tiered.io.spans", "DIRECT_RESULT_BYTES"),
    "ByteProgress": ("tiered.offline.progress", "ByteProgress"),
    "OwnedDirectory": ("tiered.manifest.ownership", "OwnedDirectory"),
    "RangeReader": ("tiered.io.bulk", "RangeReader"),
    "SequentialWriter": ("tiered.io.bulk", "SequentialWriter"),
    "anonymous_map": ("tiered.io.aligned", "anonymous_map"),
    "crc32": ("tiered.io.crc", "crc32"),
    "format_bytes": ("tiered.offline.render", "format_bytes"),
    "round_up": ("tiered.io.aligned", "round_up"),
    "wait_all": ("tiered.io.futures", "wait_all"),
}


def __getattr__(name: str) -> Any:
    """A name this module passes on, imported from its home when first asked for."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tiered.util' has no attribute {name!r}")
    value = getattr(importlib.import_module(home[0]), home[1])
    globals()[name] = value  # later lookups find it without this function
    return value

_UNITS = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB,
          "g": GiB, "gb": GiB, "gib": GiB}


Errors = Union[type[BaseException], tuple[type[BaseException], ...]]


class CommandErrors:
    """The errors a command reports as one line, ``<prog>: <message>``, with an exit status.

    ``with CommandErrors("tiered export", {(ValueError, OSError): 1}) as failed: ...`` runs the block;
    an exception that is an instance of one of ``statuses``' keys (tried in order) is printed to
    ``stream`` (default: stderr) and swallowed, and ``failed.status`` becomes its status. Any other
    exception propagates. ``status`` stays None when the block raised nothing it handles.
    """

    def __init__(self, prog: str, statuses: Mapping[Errors, int], stream: Optional[TextIO] = None) -> None:
        self.prog = prog
        self.statuses = statuses
        self.stream = stream
        self.status: Optional[int] = None

    def __enter__(self) -> "CommandErrors":
        return self

    def __exit__(self, kind: Optional[type[BaseException]], exc: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> bool:
        if exc is None:
            return False
        for errors, status in self.statuses.items():
            if isinstance(exc, errors):
                print(f"{self.prog}: {exc}", file=self.stream if self.stream is not None else sys.stderr)
                self.status = status
                return True
        return False


def parse_size(text: str) -> int:
    """``"256MiB"``, ``"4k"``, ``"1.5GiB"`` or ``"4096"`` as bytes (binary units).

    Raises:
        ValueError: ``text`` is not a size, or not a positive one; the message names it.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64KiB, 8MiB, 2GiB)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value


def nearest_existing_directory(path: str) -> str:
    """``path`` made absolute if it is a directory, else its nearest ancestor that is one: where a
    directory the store would create lives (its filesystem, its free space)."""
    existing = os.path.abspath(path)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    return existing


__all__ = [
    "CODEC_CACHE_BYTES",
    "POOLED_RESULT_BYTES",
    "ByteProgress",
    "CommandErrors",
    "OwnedDirectory",
    "RangeReader",
    "SequentialWriter",
    "anonymous_map",
    "crc32",
    "format_bytes",
    "nearest_existing_directory",
    "parse_size",
    "round_up",
    "wait_all",
]
