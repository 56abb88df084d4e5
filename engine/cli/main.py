"""The ``tiered`` console command: the store's commands (bench, inspect, fsck) plus ``train``,
``estimate``, ``export``, ``import-deepspeed`` and ``launch``.

It lives in the engine because those need the engine and the store never imports it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from tiered.cli import COMMANDS, USAGE
from tiered.cli import main as store_main

TRAIN_USAGE = "  train         train a GPT-style model with parameters and optimizer states on NVMe (--demo)"
ESTIMATE_USAGE = "  estimate      memory and disk a model needs per tier under a config, before allocating any"
EXPORT_USAGE = "  export        a training checkpoint's weights as Hugging Face safetensors files (zero_to_fp32)"
IMPORT_USAGE = "  import-deepspeed  a DeepSpeed ZeRO (1, 2, 3) checkpoint as an engine checkpoint, to resume from"
LAUNCH_USAGE = "  launch        run a training script on several processes with the deepspeed launcher's options"


def _train(argv: Sequence[str]) -> int:
    from engine.cli.train import main

    return main(list(argv))


def _estimate(argv: Sequence[str]) -> int:
    from engine.cli.estimate import main

    return main(list(argv))


def _export(argv: Sequence[str]) -> int:
    from engine.cli.export import main

    return main(list(argv))


def _import_deepspeed(argv: Sequence[str]) -> int:
    from engine.cli.import_deepspeed import main

    return main(list(argv))


def _launch(argv: Sequence[str]) -> int:
    from engine.cli.launch import main

    return main(list(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch ``tiered <command> ...``; return the exit status."""
    commands = {"train": _train, "estimate": _estimate, "export": _export, "import-deepspeed": _import_deepspeed,
                "launch": _launch, **COMMANDS}
    engine_usage = "".join(line + "\n" for line in (TRAIN_USAGE, ESTIMATE_USAGE, EXPORT_USAGE, IMPORT_USAGE,
                                                      LAUNCH_USAGE))
    usage = USAGE.replace("commands:\n", "commands:\n" + engine_usage, 1)
    return store_main(argv, commands=commands, usage=usage)


if __name__ == "__main__":
    raise SystemExit(main())
