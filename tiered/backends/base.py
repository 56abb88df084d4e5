"""The interface every tier backend implements, and the copy record they hand out."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional, Sequence

from tiered.errors import CapacityError
from tiered.io.spans import Span
from tiered.tier import Tier


@dataclasses.dataclass(eq=False)
class Copy:
    """Space one backend holds for one entry's bytes.

    ``nbytes`` is the logical size of what the copy holds; ``footprint`` what it costs against the
    tier's budget. ``readers`` counts transfers reading it; a copy released while read is freed
    when the last reader finishes (see [Note: versions and copies] in tiered.store.entry).
    """

    nbytes: int
    footprint: int
    readers: int = 0
    released: bool = False
    #: A copy in CUDA memory: the :func:`~tiered.backends.device.allocation_event` of its memory,
    #: which copies into it wait for. None for every other copy.
    allocated: Any = None


class TierBackend(abc.ABC):
    """Space and byte movement for one tier. Eviction policy lives in the store, not here.

    Backends are driven from the store's event loop; every method that moves bytes is a
    coroutine that does its work on worker threads.
    """

    tier: Tier
    #: Bytes this tier may hold, or None for "bounded by the hardware" (free disk space).
    budget: Optional[int]

    def __init__(self) -> None:
        self.used = 0  # bytes of footprint currently allocated

    @abc.abstractmethod
    def footprint(self, nbytes: int) -> int:
        """Bytes an allocation of ``nbytes`` would charge against the budget."""

    def check_fits_budget(self, nbytes: int) -> None:
        """Raise CapacityError when ``nbytes`` exceeds the tier's whole budget."""
        need = self.footprint(nbytes)
        if self.budget is not None and need > self.budget:
            raise CapacityError(
                f"{self.tier.value} tier: a tensor of {nbytes} bytes needs {need} bytes but the tier's "
                f"whole budget is {self.budget} bytes; raise the budget or store the tensor in a lower tier"
            )

    def has_room(self, nbytes: int) -> bool:
        """Whether an allocation of ``nbytes`` fits in the budget right now."""
        return self.budget is None or self.used + self.footprint(nbytes) <= self.budget

    @abc.abstractmethod
    async def allocate(self, nbytes: int) -> Copy:
        """Reserve space for ``nbytes``; raise CapacityError when it does not fit now."""

    def release(self, copy: Copy) -> None:
        """Give the copy's space back (deferred while the copy has readers)."""
        if copy.released:
            return
        copy.released = True
        if copy.readers == 0:
            self._free(copy)

    def end_read(self, copy: Copy) -> None:
        """Mark one reader done; frees a copy released meanwhile."""
        assert copy.readers > 0
        copy.readers -= 1
        if copy.readers == 0 and copy.released:
            self._free(copy)

    @abc.abstractmethod
    def _free(self, copy: Copy) -> None:
        """Return the space (called once, when released and unread)."""

    @abc.abstractmethod
    async def store(self, copy: Copy, src: Sequence[Span]) -> None:
        """Write ``src`` (exactly ``copy.nbytes`` bytes) into the copy."""

    @abc.abstractmethod
    async def load(self, copy: Copy, dst: Sequence[Span]) -> None:
        """Read the copy's bytes into ``dst`` (exactly ``copy.nbytes`` bytes)."""

    def spans(self, copy: Copy) -> Optional[list[Span]]:
        """The copy's bytes as memory spans, or None when it is not directly addressable (files)."""
        return None

    async def close(self) -> None:
        """Release the backend's resources; copies must not be used afterwards."""
