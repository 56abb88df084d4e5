"""``python -m engine.cli``: the ``tiered`` command."""

from engine.cli.main import main

raise SystemExit(main())
