"""The directory ``tiered train`` keeps its store in: claimed for the run, and afterwards emptied of
what the run made, and only that.

A run holds the directory locked (``tiered.util.OwnedDirectory``, the lock a store holds on its
own) from before it writes anything until it has removed what it made, so a second run on the same
``--dir`` is refused while the first runs instead of deleting its live store. A directory left by an
earlier run (its marker file and its ``store``, nothing else) is cleared, after taking the lock of
that store too, so a store still open elsewhere (a script, ``tiered inspect``) is never removed.
Directories the run had to create (``--dir`` and any missing parents) are removed at the end; a
directory that was there before stays, and every removal is said.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import TextIO

from tiered.cli import make_work_directory, remove_made_directories

#: A file a run leaves in its directory, naming the process: an earlier run's directory may be cleared.
MARKER = ".tiered-train-demo"
#: The store's directory inside the run's.
STORE = "store"
#: Everything a run puts in its directory; a later run removes these and nothing else.
RUN_NAMES = frozenset({MARKER, STORE})


class DemoDirectory:
    """A claimed directory: ``path`` (absolute), ``store_path`` for the store, ``created`` the
    directories the run made (outermost first). Claim with :meth:`claim`; :meth:`release` ends it."""

    def __init__(self, path: str, created: list[str], lock: object) -> None:
        self.path = path
        self.created = created
        self.store_path = os.path.join(path, STORE)
        self._lock = lock

    @classmethod
    def claim(cls, path: str, out: TextIO) -> "DemoDirectory":
        """Make ``path`` (and missing parents), lock it, and clear what an earlier run left there.

        Raises:
            ValueError: one line naming ``--dir`` and why it cannot be used: not a directory, not
                creatable or writable, in use by another run, holding an earlier run's store that
                is open elsewhere, or holding files that no run made. Nothing is removed then
                except directories this call made.
        """
        from tiered import StoreLockedError
        from tiered.util import OwnedDirectory

        directory = os.path.abspath(path)
        created = make_work_directory(directory)
        try:
            try:
                lock = OwnedDirectory.open(directory, role="--dir", exclusive=True, create=False)
            except StoreLockedError:
                created = []  # another run holds it: what we made is its now
                raise ValueError(f"--dir {directory} is in use by another `tiered train`{_owner(directory)}: wait "
                                 "for it to finish, or pass another --dir") from None
            except OSError as exc:
                raise ValueError(f"--dir {directory} cannot be used: {exc.strerror or exc}") from None
            try:
                try:
                    inherited = _clear_earlier_run(directory, out)
                except OSError as exc:  # unreadable, or a file that cannot be removed
                    raise ValueError(f"--dir {directory} cannot be used: {exc.strerror or exc}"
                                     + (f" ({exc.filename})" if exc.filename else "")) from None
                if not created:  # an earlier run made the directory: this one removes it in its place
                    created = inherited
                _write_marker(directory, created)
            except BaseException:
                lock.close()
                raise
        except BaseException:
            remove_made_directories(created)
            raise
        return cls(directory, created, lock)

    def release(self, *, keep: bool, out: TextIO) -> None:
        """Remove what the run made (its store, its marker, the directories it created), saying so,
        unless ``keep``; then unlock. The store must be closed."""
        try:
            if keep:
                return
            shutil.rmtree(self.store_path, ignore_errors=True)
            if os.path.lexists(self.store_path):
                print(f"could not remove the store at {self.store_path}: remove it by hand", file=out)
                return
            try:
                os.unlink(os.path.join(self.path, MARKER))
            except FileNotFoundError:
                pass
            removed = remove_made_directories(self.created)
            if removed:
                print(f"removed {removed[0]} (--keep keeps the store for `tiered inspect`)", file=out)
            else:
                print(f"removed the store from {self.path}, which was there before the run and stays "
                      "(--keep keeps the store for `tiered inspect`)", file=out)
        finally:
            self._lock.close()  # type: ignore[attr-defined]


def _clear_earlier_run(directory: str, out: TextIO) -> list[str]:
    """Remove an earlier run's marker and store from ``directory``, which this process holds locked;
    return the directories that run had created (its marker's list: ``directory`` and its parents)."""
    from tiered import StoreLockedError
    from tiered.util import OwnedDirectory

    names = set(os.listdir(directory))
    if not names:
        return []
    if MARKER not in names or not names <= RUN_NAMES:
        raise ValueError(f"--dir {directory} exists and is not empty (and is not an earlier demo's): pass an empty "
                         "or new directory")
    store = os.path.join(directory, STORE)
    if os.path.lexists(store):
        if os.path.islink(store) or not os.path.isdir(store):
            raise ValueError(f"--dir {directory}: {store} is not a store directory; remove it, or pass another --dir")
        try:
            held = OwnedDirectory.open(store, role="an earlier demo's store", exclusive=True, create=False)
        except StoreLockedError as exc:
            raise ValueError(f"--dir {directory} holds an earlier demo's store that is open elsewhere ({exc})") from None
        try:
            shutil.rmtree(store)
        finally:
            held.close()
        print(f"removed the store an earlier run left in {directory}", file=out)
    marker = _read_marker(directory)
    os.unlink(os.path.join(directory, MARKER))
    ancestors = {directory}
    at = directory
    while os.path.dirname(at) != at:
        at = os.path.dirname(at)
        ancestors.add(at)
    return [d for d in marker[1:] if d in ancestors]


def _write_marker(directory: str, created: list[str]) -> None:
    """The marker: this process's pid, then the directories the run created, one a line."""
    path = os.path.join(directory, MARKER)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise ValueError(f"--dir {directory} is not writable by this user: pass a directory you can write "
                             "in") from None
        raise ValueError(f"--dir {directory} cannot be used: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write("".join(f"{line}\n" for line in (str(os.getpid()), *created)))


def _read_marker(directory: str) -> list[str]:
    """The lines of ``directory``'s marker (pid, created directories); empty when unreadable."""
    try:
        fd = os.open(os.path.join(directory, MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        return os.read(fd, 65536).decode("utf-8", "surrogateescape").splitlines()
    except OSError:
        return []
    finally:
        os.close(fd)


def _owner(directory: str) -> str:
    """`` (pid N)`` from the marker of the run holding ``directory``, or nothing when unknown."""
    lines = _read_marker(directory)
    return f" (pid {lines[0]})" if lines and lines[0].isdigit() else ""
