"""The ``tiered`` command: ``tiered bench ...`` runs the benchmark."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = "usage: tiered bench [options]   (tiered bench --help for the options)"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch ``tiered <command>``; the only command is ``bench``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "bench":
        from tiered.bench.cli import main as bench_main

        return bench_main(args[1:])
    print(f"tiered: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
