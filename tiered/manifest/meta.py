"""The manifest's ``meta`` table: the store's id, the layout of its swap files, and a checksum over both.

Format 2 records swap directories as the store last saw them, relative to the store's path when
they lie inside it (the default layout keeps the swap files in the store's own directory), so a
store directory copied or moved elsewhere names its own swap files, never the original's. Format
1 (earlier versions) recorded absolute paths and no checksums; a store upgrades it on open.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Optional, Sequence

from tiered.errors import ManifestError

#: The manifest format this version writes.
FORMAT_VERSION = 2
#: The earlier format a store upgrades in place when it opens one.
LEGACY_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Meta:
    """What the meta table says."""

    format: int
    #: None only in a format-1 manifest that no store of this version has opened yet.
    store_id: Optional[str]
    #: Swap directories as recorded: relative to ``store_path`` when inside it, else absolute.
    swap_dirs: tuple[str, ...]
    files_per_dir: int
    #: The store's path when it was last opened (format 1: unknown, None).
    store_path: Optional[str]

    @property
    def legacy(self) -> bool:
        """Whether this is a format-1 manifest, to be upgraded."""
        return self.format == LEGACY_FORMAT

    def swap_paths(self, store_path: str) -> list[str]:
        """The recorded swap directories as absolute paths, for a store directory now at ``store_path``."""
        return [os.path.normpath(os.path.join(store_path, d)) for d in self.swap_dirs]

    def moved_from(self, store_path: str) -> Optional[str]:
        """Where the store was last opened, when that is not ``store_path`` (it was copied or moved since)."""
        if self.store_path is None or _same_path(self.store_path, store_path):
            return None
        return self.store_path


def new_meta(store_id: str, store_path: str, swap_paths: Sequence[str], files_per_dir: int) -> dict[str, str]:
    """The rows of a format-2 meta table (name -> value), checksum included."""
    body = {
        "format": str(FORMAT_VERSION),
        "store_id": json.dumps(store_id),
        "swap_dirs": json.dumps(recorded_paths(store_path, swap_paths)),
        "swap_files_per_dir": json.dumps(files_per_dir),
        "store_path": json.dumps(store_path),
    }
    return {**body, "checksum": _checksum(body)}


def recorded_paths(store_path: str, swap_paths: Sequence[str]) -> list[str]:
    """Swap directories as the meta table records them: relative to ``store_path`` when inside it."""
    out = []
    for path in swap_paths:
        rel = os.path.relpath(path, store_path)
        out.append(rel if rel == os.curdir or not rel.startswith(os.pardir) else path)
    return out


def parse_meta(rows: dict[str, str], where: str) -> Meta:
    """The meta table's rows (name -> value) as a :class:`Meta`; ManifestError naming ``where`` when
    the format is unknown, the checksum does not match or a value does not parse."""
    version = rows.get("format")
    if version not in (str(FORMAT_VERSION), str(LEGACY_FORMAT)):
        raise ManifestError(
            f"{where} has format {version!r}, this version of tiered reads {FORMAT_VERSION} (and upgrades "
            f"{LEGACY_FORMAT}); open it with the version of tiered that wrote it"
        )
    try:
        if version == str(FORMAT_VERSION):
            body = {k: v for k, v in rows.items() if k != "checksum"}
            if rows.get("checksum") != _checksum(body):
                raise ValueError("its checksum does not match its values")
            swap_dirs = json.loads(rows["swap_dirs"])
            store_id, store_path = json.loads(rows["store_id"]), json.loads(rows["store_path"])
        else:
            swap_dirs = json.loads(rows["nvme_paths"])
            store_id = json.loads(rows["store_id"]) if "store_id" in rows else None
            store_path = None
        files_per_dir = json.loads(rows["swap_files_per_dir"])
    except (KeyError, ValueError) as exc:
        raise ManifestError(
            f"{where} lacks a readable store layout ({exc}); restore the store directory from a backup"
        ) from None
    if not (isinstance(swap_dirs, list) and swap_dirs and all(isinstance(p, str) for p in swap_dirs)):
        raise ManifestError(f"{where} names swap directories {swap_dirs!r}, not a list of paths")
    if not (type(files_per_dir) is int and files_per_dir >= 1):
        raise ManifestError(f"{where} names swap_files_per_dir {files_per_dir!r}, not a positive count")
    if not isinstance(store_id, (str, type(None))) or not isinstance(store_path, (str, type(None))):
        raise ManifestError(f"{where} names store id {store_id!r} and path {store_path!r}, not text")
    return Meta(int(version), store_id, tuple(swap_dirs), files_per_dir, store_path)


def _checksum(body: dict[str, str]) -> str:
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode("utf-8", "surrogateescape"),
                           digest_size=16).hexdigest()


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.normpath(a) == os.path.normpath(b)
