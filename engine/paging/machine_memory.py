"""The machine's memory, as ``/proc/meminfo`` reports it: what budgets sized from the machine (a
DeepSpeed config's host tier, the optimizer's whole state in one dict) are measured against."""

from __future__ import annotations

from typing import Optional


def memory_sizes() -> Optional[tuple[int, int]]:
    """The machine's memory and the part of it available to new allocations, in bytes, from
    ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``); None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = {name: int(value.split()[0]) * 1024 for name, value in
                      (line.split(":", 1) for line in f if ":" in line) if value.split()}
    except (OSError, ValueError):
        return None
    total, available = fields.get("MemTotal"), fields.get("MemAvailable")
    if not total or available is None:
        return None
    return total, available


__all__ = ["memory_sizes"]
