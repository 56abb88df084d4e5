"""The ``tiered`` console command: the store's commands (bench, inspect, fsck) plus ``train`` and
``estimate``.

It lives in the engine because those two need the engine and the store never imports it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from tiered.cli import COMMANDS, USAGE
from tiered.cli import main as store_main

TRAIN_USAGE = "  train         train a GPT-style model with parameters and optimizer states on NVMe (--demo)"
ESTIMATE_USAGE = "  estimate      memory and disk a model needs per tier under a config, before allocating any"


def _train(argv: Sequence[str]) -> int:
    from engine.train_cli import main

    return main(list(argv))


def _estimate(argv: Sequence[str]) -> int:
    from engine.estimate_cli import main

    return main(list(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch ``tiered <command> ...``; return the exit status."""
    commands = {"train": _train, "estimate": _estimate, **COMMANDS}
    usage = USAGE.replace("commands:\n", "commands:\n" + TRAIN_USAGE + "\n" + ESTIMATE_USAGE + "\n", 1)
    return store_main(argv, commands=commands, usage=usage)


if __name__ == "__main__":
    raise SystemExit(main())
