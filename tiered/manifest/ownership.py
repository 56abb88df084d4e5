"""Which store owns a directory, and opening the files inside it safely.

[Note: directory ownership]
A store owns its path and each of its swap directories for as long as it is open. It holds each
directory open (``O_DIRECTORY``) and ``flock``s that descriptor: a kernel lock, released when the
descriptor closes or the process dies, that no file operation inside the directory can undo
(deleting or replacing the ``LOCK`` file changes nothing). Directories are the same when their
device and inode are, so a symlink or a bind mount of a directory in use is refused as in use.
The ``LOCK`` file only tells a refused opener who the owner is (pid and store path).

A ``flock`` belongs to the open file description, which a ``fork()`` shares with the child: the
lock would last as long as any child's copy of the descriptor (a DataLoader worker's, say), and
the owner could not reopen its directory after closing it. So a child closes its copies of the
descriptors as it is forked (``os.register_at_fork``), without unlocking: the lock stays the
parent's, and goes when the parent closes its own.

Files inside an owned directory are opened relative to its descriptor with ``O_NOFOLLOW`` and
must be regular files of this user with one link: a planted symlink, hard link, FIFO or device
is an error naming it, never followed. A directory that belongs to another user is refused.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import stat
import weakref
from typing import Iterable, Optional, Sequence

from tiered.errors import StoreLockedError

#: The file in every owned directory that names its owner (one line: pid, then the store path).
OWNER_NOTE = "LOCK"


class OwnedDirectory:
    """One directory held open and locked: by a running store (exclusive), or by a tool that reads
    it (shared). Create it with :meth:`open`; :meth:`close` releases the lock."""

    def __init__(self, path: str, fd: int, identity: tuple[int, int], exclusive: bool, role: str) -> None:
        self.path = path
        #: The setting the directory comes from ("StoreConfig.path", "StoreConfig.nvme_paths[1]"), for errors.
        self.role = role
        self.fd = fd
        #: (device, inode): two paths name the same directory exactly when these are equal.
        self.identity = identity
        self.exclusive = exclusive

    @classmethod
    def open(cls, path: str, *, role: str, exclusive: bool, create: bool) -> "OwnedDirectory":
        """Open and lock the directory ``path`` (``role`` names the setting it comes from, for errors).

        ``create`` makes it (mode 0700) when missing. Raises StoreLockedError when another owner
        holds the lock (naming the directory and that owner), PermissionError when the directory
        belongs to another user, NotADirectoryError/FileNotFoundError/OSError when it cannot be used.
        """
        path = os.path.abspath(os.fspath(path))
        try:
            if create:
                os.makedirs(path, mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise unusable(exc, path, role) from exc
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise PermissionError(
                    errno.EPERM,
                    f"{path!r} ({role}) belongs to user {st.st_uid}, not to this process's user {os.geteuid()}; "
                    "a store only uses directories of its own user",
                    path,
                )
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreLockedError(
                    f"the directory {path} ({role}) is already open: it is in use by {describe_owner(read_owner(fd))}; "
                    "close that store first, or give this one other directories"
                ) from None
        except BaseException:
            os.close(fd)
            raise
        directory = cls(path, fd, (st.st_dev, st.st_ino), exclusive, role)
        os.register_at_fork(after_in_child=functools.partial(_forget_in_child, weakref.ref(directory)))
        return directory

    def close(self) -> None:
        """Release the lock and the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def join(self, name: str) -> str:
        """The path of ``name`` inside this directory, for messages."""
        return os.path.join(self.path, name)

    def status(self, name: str) -> Optional[os.stat_result]:
        """``lstat`` of ``name`` in this directory (a symlink is not followed); None when it does not exist."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def check_file(self, name: str) -> Optional[os.stat_result]:
        """:meth:`status` of ``name``, refusing anything but a regular file of ours (see :func:`check_own_file`)."""
        st = self.status(name)
        if st is not None:
            check_own_file(st, self.join(name))
        return st

    def open_file(self, name: str, flags: int, *, create: bool = False) -> int:
        """Open ``name`` in this directory with ``flags`` (plus ``O_NOFOLLOW``, ``O_CLOEXEC`` and, with
        ``create``, ``O_CREAT`` and mode 0600); return the descriptor.

        A symlink is refused with an OSError naming it; so is anything that :func:`check_own_file` refuses.
        """
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        self.check_file(name)  # before opening: opening a planted FIFO could block, a device could act
        try:
            fd = os.open(name, flags, 0o600, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise symlink_refused(self.join(name)) from None
            if exc.errno == errno.ENOENT and not create:
                raise
            raise unusable(exc, self.path, self.role, f"cannot open {name}") from exc
        try:
            check_own_file(os.fstat(fd), self.join(name))
            if create:
                os.fchmod(fd, 0o600)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write_owner(self, store_path: str) -> None:
        """Write this process's pid and ``store_path`` into the directory's ``LOCK`` file (mode 0600)."""
        fd = self.open_file(OWNER_NOTE, os.O_RDWR, create=True)
        try:
            note = f"{os.getpid()}\n{store_path}\n".encode("utf-8", "surrogateescape")
            os.ftruncate(fd, 0)
            if os.pwrite(fd, note, 0) != len(note):
                raise OSError(errno.EIO, f"short write to {self.join(OWNER_NOTE)}")
        except OSError as exc:
            raise unusable(exc, self.path, self.role, f"cannot write {OWNER_NOTE}") from exc
        finally:
            os.close(fd)


def _forget_in_child(ref: "weakref.ref[OwnedDirectory]") -> None:
    """In a child just forked: close its copy of the locked descriptor, leaving the lock to the
    parent (see [Note: directory ownership])."""
    directory = ref()
    if directory is not None and directory.fd >= 0:
        fd, directory.fd = directory.fd, -1
        try:
            os.close(fd)  # never flock(LOCK_UN): that would unlock the parent's description too
        except OSError:
            pass


def read_owner(directory_fd: int) -> tuple[str, str]:
    """(pid, store path) from the ``LOCK`` file of the directory open at ``directory_fd``; empty strings
    where it is missing, unreadable or not a regular file (it is never followed through a symlink)."""
    try:
        fd = os.open(OWNER_NOTE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=directory_fd)
    except OSError:
        return "", ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "", ""
        text = os.pread(fd, 8192, 0).decode("utf-8", "replace")
    except OSError:
        return "", ""
    finally:
        os.close(fd)
    lines = text.splitlines()
    return (lines[0].strip() if lines else ""), (lines[1] if len(lines) > 1 else "")


def describe_owner(owner: tuple[str, str]) -> str:
    """``"pid 123 (store /path)"`` for what :func:`read_owner` returned."""
    pid, store = owner
    if not pid:
        return "an unknown owner"
    return f"pid {pid} (store {store})" if store else f"pid {pid}"


def check_own_file(st: os.stat_result, path: str) -> None:
    """Refuse (OSError naming ``path``) a store file that is a symlink, not a regular file, belongs to
    another user, or has other hard links: the store would write through it into something else."""
    if stat.S_ISLNK(st.st_mode):
        raise symlink_refused(path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, f"{path} is not a regular file; remove it (the store keeps only its own "
                                    "regular files there)", path)
    if st.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"{path} belongs to user {st.st_uid}, not to this process's user "
                                           f"{os.geteuid()}; remove it, or use another directory", path)
    if st.st_nlink != 1:
        raise OSError(errno.EMLINK, f"{path} has {st.st_nlink} hard links; the store writes its files in place, "
                                    "so it refuses one that is also elsewhere (copy it instead of linking it)", path)


def unusable(exc: OSError, path: str, role: str, doing: str = "") -> OSError:
    """An OSError (of ``exc``'s subclass) saying that ``path`` cannot serve as ``role`` and why."""
    reason = f"{doing}: {exc.strerror or exc}" if doing else (exc.strerror or str(exc))
    return OSError(exc.errno, f"cannot use {path!r} ({role}) as a store directory: {reason}; give a directory "
                              "this process can create and write")


def symlink_refused(path: str) -> OSError:
    """The error for a symlink found where the store keeps a file of its own."""
    return OSError(errno.ELOOP, f"{path} is a symbolic link; the store never follows links inside its directories "
                                "(remove it, or put the real file there)", path)


class OwnedDirectories:
    """The directories one store owns: its path and its swap directories (the same directory is held once).

    Use :meth:`open`; :meth:`close` releases every lock.
    """

    def __init__(self, store: OwnedDirectory, swap: list[OwnedDirectory]) -> None:
        self.store = store
        #: One per swap directory, in order; an entry may be ``store`` itself.
        self.swap = swap

    @classmethod
    def open(cls, store_path: str, swap_paths: Sequence[str], *, exclusive: bool,
             create: bool) -> "OwnedDirectories":
        """Open and lock ``store_path`` and every swap directory (see :meth:`OwnedDirectory.open`).

        Raises ValueError when two of ``swap_paths`` name one directory (through a symlink, a bind
        mount or another spelling), besides what :meth:`OwnedDirectory.open` raises; nothing stays
        locked after an error.
        """
        held: list[OwnedDirectory] = []
        try:
            store = OwnedDirectory.open(store_path, role="StoreConfig.path", exclusive=exclusive, create=create)
            held.append(store)
            swap: list[OwnedDirectory] = []
            for i, path in enumerate(swap_paths):
                path = os.path.abspath(os.fspath(path))
                same = _same_directory(path, [store, *swap])
                if same is None:
                    same = OwnedDirectory.open(path, role=f"StoreConfig.nvme_paths[{i}]", exclusive=exclusive,
                                               create=create)
                    held.append(same)
                elif same is not store:
                    raise ValueError(
                        f"StoreConfig.nvme_paths names one directory twice: {same.path!r} and {path!r} are the same "
                        "directory (a symlink, a bind mount or another spelling of it); give each directory once"
                    )
                swap.append(same)
        except BaseException:
            for d in held:
                d.close()
            raise
        return cls(store, swap)

    @property
    def distinct(self) -> list[OwnedDirectory]:
        """Every directory held, each once (the store's path first)."""
        out = [self.store]
        for d in self.swap:
            if all(d is not o for o in out):
                out.append(d)
        return out

    def write_owner(self, store_path: str) -> None:
        """Write the owner note into every directory held."""
        for d in self.distinct:
            d.write_owner(store_path)

    def close(self) -> None:
        """Release every lock (idempotent)."""
        for d in self.distinct:
            d.close()


def _same_directory(path: str, held: Iterable[OwnedDirectory]) -> Optional[OwnedDirectory]:
    """The held directory that ``path`` names too, if any (compared by device and inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # does not exist yet: not one of the held ones
    return next((d for d in held if d.identity == (st.st_dev, st.st_ino)), None)
