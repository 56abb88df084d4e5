"""Opening a store's files: owning its directories, reading its manifest, and checking that every
record's swap files are there, before the store touches any of them (tiered/manifest/ownership.py,
tiered/manifest/database.py, tiered/backends/swap_ids.py)."""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from tiered.backends.swap_ids import id_file_name, swap_file_name
from tiered.config import StoreConfig
from tiered.errors import ManifestError
from tiered.manifest.database import MANIFEST_NAME, Loaded, Manifest, side_files
from tiered.manifest.ownership import OWNER_NOTE, OwnedDirectories, OwnedDirectory
from tiered.manifest.records import Record


@dataclasses.dataclass
class OpenedFiles:
    """What :func:`open_files` holds for a store: its locked directories, its manifest, its rows."""

    directories: OwnedDirectories
    manifest: Manifest
    loaded: Loaded

    def close(self) -> None:
        """Close the manifest and release the directories."""
        try:
            self.manifest.close()
        finally:
            self.directories.close()


def open_files(config: StoreConfig, codecs: Sequence[str]) -> OpenedFiles:
    """Lock ``config``'s directories, open its manifest and load its records (blocking).

    Raises StoreLockedError when another store holds a directory, ValueError when ``nvme_paths``
    names one directory twice or a new store's path holds other files (unless
    ``config.allow_other_files``), ManifestError when the manifest is unreadable or of another layout,
    a row written by a newer version cannot be read (an unknown codec or dtype) or a record lies in
    a swap file that is missing, and OSError when a directory cannot be used or a file in it is a
    symlink or not the store's own. Nothing stays locked or open after an error.
    """
    directories = OwnedDirectories.open(config.path, config.nvme_paths or (config.path,), exclusive=True,
                                        create=True)
    try:
        if not config.allow_other_files:
            _refuse_other_files(directories.store, config)
        directories.write_owner(config.path)
        swap = directories.swap
        manifest = Manifest(directories.store, [d.path for d in swap], config.swap_files_per_dir,
                            swap_bytes=_swap_bytes(swap, config.swap_files_per_dir))
        try:
            loaded = manifest.load(codecs)
            _refuse_unreadable(loaded, manifest, config.path)
            _check_swap_files(loaded.records, swap, config.swap_files_per_dir, config.path)
        except BaseException:
            manifest.close()
            raise
    except BaseException:
        directories.close()
        raise
    return OpenedFiles(directories, manifest, loaded)


def _refuse_other_files(directory: OwnedDirectory, config: StoreConfig) -> None:
    """ValueError naming them when ``directory`` holds no manifest (a new store) but files that are not
    a store's (its own files, or the directories of its ``nvme_paths`` placed inside it): the store would
    put its own among the user's."""
    if directory.status(MANIFEST_NAME) is not None:
        return
    own = {OWNER_NOTE, *side_files(),
           *(name(i) for i in range(config.swap_files_per_dir) for name in (swap_file_name, id_file_name)),
           *(os.path.basename(p) for p in config.nvme_paths or ()
             if os.path.dirname(os.path.abspath(p)) == os.path.abspath(config.path))}
    other = sorted(set(os.listdir(directory.fd)) - own)
    if other:
        shown = ", ".join(repr(n) for n in other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        raise ValueError(f"StoreConfig.path {directory.path} is not empty and holds no store ({shown}): give a new or "
                         "empty directory, or StoreConfig(allow_other_files=True) to put the store's files beside "
                         "these")


def _swap_bytes(swap: Sequence[OwnedDirectory], files_per_dir: int) -> int:
    """Bytes the swap files of these directories already hold (never following a link)."""
    total = 0
    for directory in swap:
        for i in range(files_per_dir):
            st = directory.check_file(swap_file_name(i))
            total += st.st_size if st is not None else 0
    return total


def _refuse_unreadable(loaded: Loaded, manifest: Manifest, store_path: str) -> None:
    """An intact row with problems was written by something this version cannot read (a newer
    version's codec or dtype): refuse to open rather than treat its space as free."""
    for row in loaded.damaged:
        if row.intact:
            raise ManifestError(
                f"entry {row.record.key!r} in {manifest.path} cannot be read by this version of tiered: "
                f"{'; '.join(row.problems)}; open the store with the version of tiered that wrote it, or "
                f"`tiered fsck {store_path} --delete-damaged` removes the record"
            )


def _check_swap_files(records: Sequence[Record], swap: Sequence[OwnedDirectory], files_per_dir: int,
                      store_path: str) -> None:
    """ManifestError naming the key and the file when a record lies in a swap file that is missing."""
    count = len(swap) * files_per_dir
    present: dict[int, bool] = {}
    for record in records:
        for extent in record.extents:
            index = extent.file
            if index >= count:
                raise ManifestError(
                    f"entry {record.key!r} lies in swap file #{index}, but the store has {count} ({len(swap)} "
                    f"directories x {files_per_dir} files); `tiered fsck {store_path} --delete-damaged` removes it"
                )
            if index not in present:
                directory = swap[index // files_per_dir]
                present[index] = directory.status(swap_file_name(index % files_per_dir)) is not None
            if not present[index]:
                path = swap[index // files_per_dir].join(swap_file_name(index % files_per_dir))
                raise ManifestError(
                    f"entry {record.key!r} lies in the swap file {path}, which is missing; give the directory "
                    "that holds the store's swap files in nvme_paths (in their original order), or, if the file "
                    f"is lost, `tiered fsck {store_path} --delete-damaged` removes the records that lie in it"
                )
