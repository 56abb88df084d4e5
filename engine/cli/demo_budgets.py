"""The memory budgets of ``tiered train``: the ones given, checked against the memory plan, or
defaults sized from the plan for the options chosen, so every option the command offers works at its
defaults and a budget too small is one line naming the option and the value that works.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

MiB = 1024 * 1024
#: The host budget at the demo's defaults: its fp32 training state is about 3.5x this.
DEMO_HOST_MIB = 48
#: At most this many plans are tried while looking for the least host budget that fits (the minimum
#: can grow with the budget: state that fits in the host tier is held there, not streamed).
_SEARCH_STEPS = 32


def size_budgets(model: nn.Module, config_for: "Callable[[int, int], object]", *, host_mib: Optional[int],
                 device_mib: Optional[int], default_host_mib: int, param_tier: str) -> tuple[int, int]:
    """``(host_mib, device_mib)``: as given, or sized for ``model`` under ``config_for(host_bytes,
    device_bytes)`` (an ``engine.EngineConfig``): the host budget at least ``default_host_mib`` and
    what the plan needs; the device budget, with ``param_tier="device"``, the parameters' bytes.

    Raises:
        ValueError: one line naming ``--host-mib`` or ``--device-mib`` (as given), what needs more,
            and the least value that works; or the plan's own problem for anything else.
    """
    import engine

    if device_mib is None:
        device_mib = 0
        if param_tier == "device":
            device_mib = _mib(_device_part(engine.estimate_memory(model, config_for(default_host_mib * MiB, 0))).nbytes)
    if param_tier == "device":
        part = _device_part(engine.estimate_memory(model, config_for(default_host_mib * MiB, device_mib * MiB)))
        if part.largest > device_mib * MiB:
            raise ValueError(f"--device-mib {device_mib} cannot hold the parameter {part.largest_name!r} "
                             f"({_show(part.largest)}) that --param-tier device puts there: pass --device-mib "
                             f"{_mib(part.largest)} or more ({_mib(part.nbytes)} holds every parameter)")
    start = default_host_mib if host_mib is None else host_mib
    least = _least_host_bytes(model, lambda host: config_for(host, device_mib * MiB), start * MiB)
    if host_mib is None:
        host_mib = max(default_host_mib, _mib(least))
    elif least > host_mib * MiB:
        plan = engine.estimate_memory(model, config_for(host_mib * MiB, device_mib * MiB)).plan
        parts = sorted((*plan.minimum_pieces, plan.host_tier_minimum), key=lambda p: -p.nbytes)
        takes = ", ".join(f"{p.what} {_show(p.nbytes)}" for p in parts if p.nbytes)
        raise ValueError(f"--host-mib {host_mib} is below the host memory this model needs with these options "
                         f"({takes}): pass --host-mib {_mib(least)} or more")
    est = engine.estimate_memory(model, config_for(host_mib * MiB, device_mib * MiB))
    if est.problems:
        raise ValueError(est.problems[0])
    return host_mib, device_mib


def _least_host_bytes(model: nn.Module, config_for: "Callable[[int], object]", start: int) -> int:
    """The least host budget from ``start`` up whose memory plan fits (``start`` when it does)."""
    import engine

    budget = start
    for _ in range(_SEARCH_STEPS):
        plan = engine.estimate_memory(model, config_for(budget)).plan
        if plan.fits:
            return budget
        budget = max(budget + MiB, -(-plan.minimum_bytes // MiB) * MiB)
    return budget


def _device_part(est: object) -> object:
    """The estimate's part for the parameters held in the device tier."""
    return next(p for p in est.parts if p.tier == "device")  # type: ignore[attr-defined]


def _mib(nbytes: int) -> int:
    """``nbytes`` in whole MiB, rounded up."""
    return -(-nbytes // MiB)


def _show(nbytes: int) -> str:
    from tiered.util import format_bytes

    return format_bytes(nbytes)
