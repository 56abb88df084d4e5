"""Where a checkpoint is: DeepSpeed's ``<dir>/<tag>/`` layout with a ``<dir>/latest`` file.

``eng.save_checkpoint(dir, tag="step1000")`` writes the checkpoint to ``dir/step1000`` and then
``dir/latest`` (holding ``step1000``), so ``eng.load_checkpoint(dir)``, ``tiered export dir out``
and ``engine.checkpoint_state_dict(dir)`` find the newest one without being told its name.
Without a tag, the path is the checkpoint directory itself.
"""

from __future__ import annotations

import os
from typing import Optional

from engine.errors import CheckpointError
from engine.io.checkpoint_files import METADATA_FILE

LATEST_FILE = "latest"
#: The engine checkpoint's directory inside a Trainer checkpoint or an ``accelerator.save_state`` one.
ENGINE_SUBDIR = "engine"


def engine_checkpoint(checkpoint: "str | os.PathLike[str]") -> str:
    """The engine checkpoint saved inside ``checkpoint``, a Trainer checkpoint
    (``engine.integrations.hf.EngineCheckpointCallback``) or an ``accelerator.save_state`` directory
    (``engine.integrations.hf.register_engine_state``)."""
    return os.path.join(os.fspath(checkpoint), ENGINE_SUBDIR)


def tagged_path(path: "str | os.PathLike[str]", tag: Optional[str]) -> str:
    """The absolute checkpoint directory for ``path`` and ``tag`` (``path`` itself when ``tag`` is None)."""
    root = os.path.abspath(os.fspath(path))
    if tag is None:
        return root
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or (os.altsep and os.altsep in tag):
        raise ValueError(f"tag must be a directory name (no path separators), got {tag!r}")
    if tag == LATEST_FILE:
        raise ValueError(f"tag {tag!r} is the name of the file that points at the newest tag; choose another")
    return os.path.join(root, tag)


def holds_checkpoint(path: "str | os.PathLike[str]") -> bool:
    """True when ``path`` is a checkpoint directory, or a directory of tagged ones (it has ``latest``)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in (METADATA_FILE, LATEST_FILE))


def resolve_checkpoint(path: "str | os.PathLike[str]", tag: Optional[str] = None) -> str:
    """The checkpoint directory to read: ``path/tag`` when ``tag`` is given, else ``path`` when it
    is a checkpoint, else the tag named by ``path/latest``. ``path`` unchanged when none applies
    (reading it then says it is not a checkpoint)."""
    root = os.path.abspath(os.fspath(path))
    if tag is not None or os.path.isfile(os.path.join(root, METADATA_FILE)):
        return tagged_path(root, tag)
    latest = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(latest):
        return root
    with open(latest, encoding="utf-8") as f:
        name = f.read().strip()
    try:
        return tagged_path(root, name)
    except ValueError as exc:
        raise CheckpointError(f"{latest!r} does not name a checkpoint tag: {exc}") from exc


def write_latest(root: str, tag: str) -> None:
    """Point ``root/latest`` at ``tag``, atomically and durably."""
    latest = os.path.join(root, LATEST_FILE)
    with open(latest + ".partial", "w", encoding="utf-8") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest + ".partial", latest)
    fsync_dir(root)


def fsync_dir(path: str) -> None:
    """Make the directory's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["LATEST_FILE", "fsync_dir", "holds_checkpoint", "resolve_checkpoint", "tagged_path", "write_latest"]
