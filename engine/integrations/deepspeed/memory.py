"""DeepSpeed's ``memory_breakdown`` and ``dump_state`` for ``engine.initialize``'s engine: memory
lines after each forward, backward and step (DeepSpeed's accelerator and CPU lines, and where the
store holds the model), and the configuration the engine runs with, as DeepSpeed prints its own."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from engine.paging.machine_memory import memory_sizes
from engine.stats import EngineStats
from tiered import Tier
from tiered.util import format_bytes

GiB = float(1 << 30)


def memory_lines(label: str, device: torch.device, stats: EngineStats) -> list[str]:
    """DeepSpeed's ``see_memory_usage`` lines for ``label`` (the accelerator's allocated and cached
    memory with their peaks since the last call, on CUDA; the machine's memory in use), then the
    store's tiers and the parameters the engine holds materialized."""
    lines = [label]
    if device.type == "cuda":
        lines.append(f"MA {torch.cuda.memory_allocated(device) / GiB:.2f} GB "
                     f"Max_MA {torch.cuda.max_memory_allocated(device) / GiB:.2f} GB "
                     f"CA {torch.cuda.memory_reserved(device) / GiB:.2f} GB "
                     f"Max_CA {torch.cuda.max_memory_reserved(device) / GiB:.2f} GB")
        torch.cuda.reset_peak_memory_stats(device)  # the next line's peaks are its own, as DeepSpeed's
    machine = machine_memory()
    if machine is not None:
        used, percent = machine
        lines.append(f"CPU Virtual Memory:  used = {used / GiB:.2f} GB, percent = {percent:.1f}%")
    tiers = stats.store.tiers
    lines.append(
        f"Store: device {_tier(tiers[Tier.DEVICE])}, host {_tier(tiers[Tier.HOST])}, nvme {_tier(tiers[Tier.NVME])}; "
        f"parameters materialized {format_bytes(stats.materialized_bytes)} "
        f"(peak {format_bytes(stats.peak_materialized_bytes)})")
    return lines


def machine_memory() -> Optional[tuple[int, float]]:
    """Bytes of the machine's memory in use (total less available) and their percentage, from
    ``/proc/meminfo``; None where there is none."""
    sizes = memory_sizes()
    if sizes is None:
        return None
    total, available = sizes
    return total - available, 100.0 * (total - available) / total


def configuration_lines(name: str, config: Any) -> list[str]:
    """DeepSpeed's configuration print: ``name:``, then each field of the dataclass ``config``
    (and of the dataclasses in it), sorted, dotted to one column."""
    lines = [f"{name}:"]
    for field, value in sorted(_fields(config, "")):
        lines.append(f"  {field} {'.' * max(1, 29 - len(field))} {value!r}")
    return lines


def _fields(config: Any, prefix: str) -> list[tuple[str, Any]]:
    found = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found += _fields(value, f"{prefix}{field.name}.")
        else:
            found.append((prefix + field.name, value))
    return found


def _tier(t: Any) -> str:
    if t.budget_bytes is None:
        return format_bytes(t.used_bytes)
    return f"{format_bytes(t.used_bytes)} of {format_bytes(t.budget_bytes)}"


__all__ = ["configuration_lines", "machine_memory", "memory_lines"]
