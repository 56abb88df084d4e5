"""The store itself: :class:`TieredStore` and the parts it is assembled from.

``tiered_store`` is the facade: lifecycle, public API, argument checks. Below it, each part owns
the state it changes: ``versions`` (which version each key holds, the key locks), ``tiers`` (the
copies in each tier), ``transfers`` (admission, eviction and every move of bytes), composed into
the calls by ``operations`` (single keys), ``batch``, ``renames`` and ``modify``; ``calls`` brings
a call from any thread to the store's loop. ``sync``, ``prefetch`` and ``modify.Modification`` are
the handles callers get; ``entry``, ``validation``, ``error_messages``, ``payload``, ``opening``
and ``process`` are small helpers. None of the parts imports the facade. Import the public names
from :mod:`tiered`.
"""

from tiered.store.modify import Modification
from tiered.store.prefetch import Prefetch
from tiered.store.sync import SyncStore
from tiered.store.tiered_store import TieredStore

__all__ = ["Modification", "Prefetch", "SyncStore", "TieredStore"]
