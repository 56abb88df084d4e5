"""Which store a swap file belongs to: a small id file beside each swap file.

[Note: relocatable swap files]
The manifest names swap files by number, never by path: file ``d * files_per_dir + i`` is
``swap-{i:02d}.bin`` in the ``d``-th swap directory the store is given. Beside each swap file,
``swap-{i:02d}.id`` says which store it belongs to (the store id in the manifest) and which
directory and file number it is. So a store copied or moved with its swap directories opens from
its new place, and a swap directory of another store, or the right directories given in another
order, is refused by name instead of being read as this store's data. The id file is written (and
synced) before its swap file is created, so a swap file without one was not made by this store.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import zlib
from typing import Optional

from tiered.errors import ManifestError
from tiered.manifest.ownership import OwnedDirectory

#: The format of the id files this version writes.
ID_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class SwapFileId:
    """The identity of one swap file: its store, its directory's place in ``nvme_paths``, its number there."""

    store: str
    directory: int
    file: int

    def describe(self) -> str:
        """``"file 0 of swap directory #1 of store 3f2a..."``, for messages."""
        return f"file {self.file} of swap directory #{self.directory} of store {self.store}"


def swap_file_name(index: int) -> str:
    """The name of swap file number ``index`` (counted within its directory)."""
    return f"swap-{index:02d}.bin"


def id_file_name(index: int) -> str:
    """The name of the id file beside swap file number ``index``."""
    return f"swap-{index:02d}.id"


def read_id(directory: OwnedDirectory, index: int) -> Optional[SwapFileId]:
    """The id beside swap file ``index`` of ``directory``; None when there is no id file.

    Raises ManifestError when the id file is damaged or of another format, OSError when it is a
    symlink or otherwise not a file of the store's own (see :mod:`tiered.manifest.ownership`).
    """
    name = id_file_name(index)
    if directory.status(name) is None:
        return None
    fd = directory.open_file(name, os.O_RDONLY)
    try:
        raw = os.pread(fd, 4096, 0)
    finally:
        os.close(fd)
    try:
        fields = json.loads(raw.decode("utf-8"))
        body = {k: fields[k] for k in ("format", "store", "directory", "file")}
        valid = fields.get("crc") == _crc(body) and body["format"] == ID_FORMAT
        ident = SwapFileId(str(body["store"]), int(body["directory"]), int(body["file"]))
    except (ValueError, TypeError, KeyError, AttributeError):
        valid = False
    if not valid:
        raise ManifestError(
            f"the swap file id {directory.join(name)} is damaged or of another version of tiered; if the store's "
            "manifest is intact, delete the id file and open the store again with the original nvme_paths, which "
            "writes it anew"
        )
    return ident


def write_id(directory: OwnedDirectory, index: int, ident: SwapFileId) -> None:
    """Write the id file of swap file ``index`` durably (the file and then the directory are synced)."""
    body = {"format": ID_FORMAT, "store": ident.store, "directory": ident.directory, "file": ident.file}
    data = json.dumps({**body, "crc": _crc(body)}).encode() + b"\n"
    name = id_file_name(index)
    if directory.status(name) is not None:  # a damaged one the caller decided to replace
        os.unlink(name, dir_fd=directory.fd)
    fd = directory.open_file(name, os.O_WRONLY | os.O_EXCL, create=True)
    try:
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(errno.EIO, f"short write to {directory.join(name)}")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.fsync(directory.fd)


def _crc(body: dict) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def claim(directory: OwnedDirectory, index: int, ident: SwapFileId, *, adopt: bool = False) -> None:
    """Make sure swap file ``index`` of ``directory`` is ``ident``'s: check its id file, or write one
    before the swap file is created. ``adopt`` also writes an id for a swap file that has none.

    Raises ManifestError when the id names another store or place, or a swap file has no id (and
    ``adopt`` is off): the directory holds files this store did not make.
    """
    path = directory.join(swap_file_name(index))
    found = read_id(directory, index)
    if found == ident:
        return
    if found is not None:
        if found.store != ident.store:
            raise ManifestError(
                f"{path} belongs to another store (its id file says {found.describe()}, this store is {ident.store}); "
                "give this store its own swap directories, as they were when it was closed"
            )
        raise ManifestError(
            f"{path} is {found.describe()}, but is given here as {ident.describe()}; give the store's nvme_paths "
            "in their original order"
        )
    if directory.check_file(swap_file_name(index)) is not None and not adopt:
        raise ManifestError(
            f"{path} has no id file beside it, so it is not a swap file this store made; move it away (or give "
            "this store another directory)"
        )
    write_id(directory, index, ident)
