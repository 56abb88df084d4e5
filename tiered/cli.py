"""The ``tiered`` command: ``tiered bench``, ``tiered inspect DIR``, ``tiered fsck DIR`` and ``tiered env``.

A public module: :data:`COMMANDS`, :data:`USAGE` and :func:`main`'s ``commands`` and ``usage`` let a
package built on the store add its own commands (the engine's ``tiered train`` and the rest).
"""

from __future__ import annotations

import sys
from typing import Callable, Mapping, Optional, Sequence

USAGE = """usage: tiered <command> [options]   (tiered <command> --help for its options)

commands:
  bench         measure the store on this machine, next to fio, torch.save and DeepSpeed's aio
  inspect DIR   show a store directory's entries, codec ratios and swap-file space
  fsck DIR      verify every checksum of a closed store; --reclaim orphaned space, --delete-damaged
  env           what this machine and --dir give the store: O_DIRECT, fallocate, huge pages, locked memory, CUDA"""


def _bench(argv: Sequence[str]) -> int:
    from tiered.bench.cli import main

    return main(list(argv))


def _inspect(argv: Sequence[str]) -> int:
    from tiered.offline.commands import inspect_main

    return inspect_main(argv)


def _fsck(argv: Sequence[str]) -> int:
    from tiered.offline.commands import fsck_main

    return fsck_main(argv)


def _env(argv: Sequence[str]) -> int:
    from tiered.env_report import main

    return main(argv)


#: Subcommands; each imports its module only when run, so ``tiered --help`` stays fast.
COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "bench": _bench,
    "inspect": _inspect,
    "fsck": _fsck,
    "env": _env,
}


def main(
    argv: Optional[Sequence[str]] = None,
    *,
    commands: Mapping[str, Callable[[Sequence[str]], int]] = COMMANDS,
    usage: str = USAGE,
) -> int:
    """Dispatch ``tiered <command> ...``; return the exit status (2 for an unknown command).

    ``commands`` and ``usage`` let a package built on the store add commands (the engine adds
    ``train``; the store never imports the engine).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0 if args else 2
    command = commands.get(args[0])
    if command is None:
        print(f"tiered: unknown command {args[0]!r}\n{usage}", file=sys.stderr)
        return 2
    return command(args[1:])


__all__ = ["COMMANDS", "USAGE", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
