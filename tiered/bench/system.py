"""The machine under test: page-cache control and a description for the report."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from tiered.util import nearest_existing_directory

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


def disk_info(path: str) -> dict[str, Any]:
    """The block device holding ``path`` (its whole disk, for a partition): name, model (or, where
    the device reports none, as virtio disks do, its driver), size and whether it rotates, from
    /sys; {} where /sys says nothing (a network or in-memory filesystem)."""
    try:
        st = os.stat(nearest_existing_directory(path))
        node = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    except OSError:
        return {}
    if not os.path.isdir(node):
        return {}
    if os.path.exists(os.path.join(node, "partition")):
        node = os.path.dirname(node)
    info: dict[str, Any] = {"device": os.path.basename(node)}
    model = _read(os.path.join(node, "device", "model"))
    driver = os.path.basename(os.path.realpath(os.path.join(node, "device", "driver")))
    info["model"] = model or (f"({driver})" if os.path.exists(os.path.join(node, "device", "driver")) else "")
    sectors = _read(os.path.join(node, "size"))
    if sectors.isdigit():
        info["size_bytes"] = int(sectors) * 512
    rotational = _read(os.path.join(node, "queue", "rotational"))
    if rotational in ("0", "1"):
        info["rotational"] = rotational == "1"
    return info


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def machine_info(directory: str) -> dict[str, Any]:
    """CPU, memory, disk, kernel, filesystem, library versions and the load average now, for the report."""
    info: dict[str, Any] = {
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "directory": os.path.abspath(directory),
        "filesystem": filesystem_of(directory),
        "disk": disk_info(directory),
        "loadavg": list(os.getloadavg()),
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
