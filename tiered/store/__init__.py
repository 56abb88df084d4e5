"""The store itself: :class:`TieredStore` and the pieces it is assembled from.

``tiered_store`` holds its lifecycle, public API and single-key operations; ``batch``, ``modify``
and ``tiers`` are mixins of it (batched calls, modify blocks, tier bookkeeping); ``sync`` and
``prefetch`` are the handles callers get; ``validation``, ``error_messages``, ``payload`` and
``process`` are small helpers. Import the public names from :mod:`tiered`.
"""

from tiered.store.modify import Modification
from tiered.store.prefetch import Prefetch
from tiered.store.sync import SyncStore
from tiered.store.tiered_store import TieredStore

__all__ = ["Modification", "Prefetch", "SyncStore", "TieredStore"]
