"""fio's best settings per disk, kept by full runs of ``tiered bench`` for ``--quick`` runs.

A quick run cannot afford fio's full sweep (32 settings per direction on 512 MiB), and a short grid
on a small file does not find the disk's best: held against it, the store looks faster than the
disk. So a run that sweeps the full grid keeps each direction's best setting here, keyed by the disk
under ``--dir`` (its block device, model, size and filesystem); a later ``--quick`` run on the same
disk runs fio at those settings instead of its short grid, measured in its own run like every other
figure. Without an entry, a quick run says that its fio figure is not the disk's limit and judges
nothing against it.

The file is JSON, ``{disk key: entry}``; a missing, unreadable or malformed file is an empty cache.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Optional

from tiered.bench.fio import FioSetting
from tiered.bench.system import disk_info, filesystem_of

#: ``--fio-cache`` value that neither reads nor writes a cache.
NO_CACHE = "none"


def default_cache_path() -> str:
    """``$XDG_CACHE_HOME/tiered/fio-best.json`` (``~/.cache`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tiered", "fio-best.json")


def disk_key(directory: str) -> Optional[str]:
    """What identifies the disk under ``directory``: device, model, size and filesystem; None where
    /sys does not say which block device it is (nothing is cached for such a disk)."""
    disk = disk_info(directory)
    if not disk.get("device"):
        return None
    return " ".join(str(x) for x in (disk["device"], disk.get("model", ""), disk.get("size_bytes", ""),
                                       filesystem_of(directory)))


def cached_best(path: str, directory: str) -> Optional[dict[str, Any]]:
    """The entry of the disk under ``directory`` (``date``, ``fio``, ``nbytes``, ``settings`` and
    ``best_write``/``best_read`` as :func:`tiered.bench.fio_sweep.fio_best` gives them), or None."""
    key = disk_key(directory)
    if path == NO_CACHE or key is None:
        return None
    entry = _read(path).get(key)
    try:
        for rw in ("write", "read"):
            FioSetting(**entry[f"best_{rw}"]["setting"])  # type: ignore[index]
            float(entry[f"best_{rw}"]["median"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None
    return entry


def keep_best(path: str, directory: str, details: dict[str, Any]) -> Optional[str]:
    """Keep a full sweep's best settings (``fio_best``'s details) for the disk under ``directory``;
    return why not (no cache, an unknown disk, a file that cannot be written), or None."""
    key = disk_key(directory)
    if path == NO_CACHE:
        return "--fio-cache none"
    if key is None:
        return f"the block device under {directory} is unknown"
    entries = _read(path)
    entries[key] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "fio": details.get("fio", ""), "nbytes": details["nbytes"], "settings": len(details["grid"]),
        "best_write": details["best_write"], "best_read": details["best_read"],
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(entries, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return f"cannot write {path}: {exc.strerror or exc}"
    return None


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
