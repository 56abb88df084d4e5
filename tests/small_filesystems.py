"""Real, small filesystems for disk-full tests: mount one, fill it. Tests skip where mounting is not permitted."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import uuid
from typing import Iterator

import pytest

MiB = 1024 * 1024


def mount_small(kind: str, where: str, image: str, *, mib: int, read_only: bool = False) -> None:
    """Mount a ``mib``-MiB ``kind`` ("tmpfs" or "ext4-loop", backed by ``image``) at ``where``."""
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"{'ro,' if read_only else ''}size={mib}m,mode=0700", "tmpfs", where]
    else:
        mkfs = shutil.which("mkfs.ext4") or "/sbin/mkfs.ext4"
        with open(image, "wb") as f:
            f.truncate(mib * MiB)
        subprocess.run([mkfs, "-q", "-F", "-m", "0", image], check=True, capture_output=True, timeout=60)
        cmd = ["mount", "-o", "loop,ro" if read_only else "loop", image, where]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


def mounted(kind: str, tmp_path, *, mib: int, read_only: bool = False) -> Iterator[str]:
    """Yield a freshly mounted filesystem's path (skip the test when this process may not mount); unmount after."""
    where = str(tmp_path / f"mnt-{uuid.uuid4().hex[:8]}")
    os.mkdir(where)
    try:
        mount_small(kind, where, str(tmp_path / "fs.img"), mib=mib, read_only=read_only)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        what = f"{'read-only ' if read_only else ''}{kind}"
        pytest.skip(f"cannot mount a {what} here: {exc} {detail.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], capture_output=True, timeout=60)


def fill(directory: str) -> str:
    """Fill the filesystem of ``directory`` with one file; return its path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = b"\xa5" * 65536
        while True:
            try:
                if os.write(fd, chunk) == 0:
                    break
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)
    return path
