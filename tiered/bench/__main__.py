"""``python -m tiered.bench``: the standalone benchmark."""

from tiered.bench.cli import main

raise SystemExit(main(prog="python -m tiered.bench"))
