"""What the end-to-end benchmarks share: the load-average record, the JSON file and a headless pyplot."""

from __future__ import annotations

import json
import os
from typing import Any, Optional


def with_load(result: dict[str, Any], load_before: tuple[float, float, float]) -> dict[str, Any]:
    """``result`` with the load average before and now added (the machine may be shared), and the
    change printed."""
    result = {**result, "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    print(f"load average {load_before[0]:.1f} -> {result['loadavg_after'][0]:.1f} ({os.cpu_count()} cores)")
    return result


def write_json(result: dict[str, Any], path: Optional[str]) -> None:
    """Write ``result`` to ``path`` (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (matplotlib is an optional extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
