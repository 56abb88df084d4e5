"""The three storage tiers, ordered fastest (top) to slowest (bottom)."""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    """Where a copy of an entry lives: ``device`` memory, ``host`` buffers or ``nvme`` swap files."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    @property
    def rank(self) -> int:
        """0 for the fastest tier, 2 for the slowest."""
        return _ORDER.index(self)

    def below(self) -> "Tier | None":
        """The next slower tier, or None for ``nvme``."""
        i = self.rank + 1
        return _ORDER[i] if i < len(_ORDER) else None

    def above(self) -> "Tier | None":
        """The next faster tier, or None for ``device``."""
        return _ORDER[self.rank - 1] if self.rank > 0 else None

    @classmethod
    def parse(cls, value: "Tier | str") -> "Tier":
        """Accept a Tier or its string name; raise ValueError showing the value otherwise."""
        if isinstance(value, Tier):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(t.value) for t in cls)
            raise ValueError(f"tier must be one of {names}, got {value!r}") from None

    def __str__(self) -> str:
        return self.value


_ORDER = (Tier.DEVICE, Tier.HOST, Tier.NVME)
TIERS_TOP_DOWN: tuple[Tier, ...] = _ORDER
