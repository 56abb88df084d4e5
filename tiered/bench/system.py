"""The machine under test: page-cache control and a description for the report."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache() -> tuple[bool, str]:
    """Write back dirty pages and empty the page cache. Returns ``(done, why_not)``."""
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True, ""
    except OSError as exc:
        return False, f"cannot write {DROP_CACHES} ({exc.strerror}); run as root to drop caches"


def evict_file_pages(path: str) -> None:
    """Drop one file's clean pages from the page cache (fsync first so all of them are clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def filesystem_of(path: str) -> str:
    """The filesystem type mounted at (or above) ``path``, from /proc/mounts; "" when unknown."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return ""
    path = os.path.realpath(path)
    best, kind = "", ""
    for m in mounts:
        if len(m) >= 3 and (path == m[1] or path.startswith(m[1].rstrip("/") + "/")) and len(m[1]) >= len(best):
            best, kind = m[1], m[2]
    return kind


def machine_info(directory: str) -> dict[str, Any]:
    """CPU, memory, kernel, filesystem and library versions, for the report."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "directory": os.path.abspath(directory),
        "filesystem": filesystem_of(directory),
    }
    try:
        with open("/proc/meminfo") as f:
            first = f.readline().split()
        info["memory_bytes"] = int(first[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return info
