"""Progress bars for the engine's long operations: wrap, checkpoints and the weights export.

A 70B-parameter model takes minutes to place into the store, save or load; a bar on stderr
shows how far it got and at what rate. It is drawn only on a terminal, only by rank 0, only
with ``EngineConfig.progress`` (default on), and only for operations of at least
:data:`MIN_BYTES`, so tests, logs and small models see nothing.
"""

from __future__ import annotations

from tiered.util import ByteProgress

#: Operations moving fewer bytes than this draw no bar (they finish in about a second).
MIN_BYTES = 256 * 1024 * 1024


def byte_progress(label: str, total: int, *, enabled: bool, rank: int = 0) -> ByteProgress:
    """A ``with``-able bar counting ``total`` bytes (``advance(n)``); a no-op unless ``enabled``,
    on rank 0, for at least :data:`MIN_BYTES`, with stderr a terminal."""
    return ByteProgress(label, total, enabled=enabled and rank == 0 and total >= MIN_BYTES)
