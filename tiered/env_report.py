"""``tiered env``: what this machine and directory give the store, checked before a long run
(DeepSpeed's ``ds_report``): O_DIRECT and fallocate on the swap-file directory, free space,
huge pages, the locked-memory limit, CUDA pinning, page-cache control, library versions."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
from typing import Optional, Sequence, TextIO

import torch

from tiered.bench.system import DROP_CACHES, filesystem_of
from tiered.config import ALIGNMENT, StoreConfig
from tiered.io.aligned import AlignedBuffer
from tiered.io.crc import CRC32_IMPL
from tiered.io.files import direct_io_memory_alignment, open_file
from tiered.util import nearest_existing_directory

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, what was found, and what to do if it matters."""

    name: str
    found: str
    #: "ok", "note" (works, but slower or less than it could) or "problem" (the store cannot work as configured).
    status: str = "ok"
    advice: str = ""


def collect(directory: str) -> list[Check]:
    """Every check, for swap files under ``directory`` (the nearest existing parent is probed when
    it does not exist yet; nothing is left behind)."""
    checks = [
        Check("python", platform.python_version()),
        Check("torch", torch.__version__),
        Check("tiered", _version("tiered")),
        _crc(),
        Check("cpus", str(os.cpu_count())),
    ]
    checks += _directory_checks(directory)
    checks.append(_huge_pages())
    checks.append(_memlock())
    checks.append(_cuda())
    droppable = os.access(DROP_CACHES, os.W_OK)
    checks.append(Check("page cache control", "permitted" if droppable else "not permitted",
                        "ok" if droppable else "note", "" if droppable else
                        "tiered bench --drop-caches needs root; cold reads are O_DIRECT either way"))
    fio = shutil.which("fio")
    checks.append(Check("fio (for tiered bench)", fio or "absent", "ok" if fio else "note",
                        "" if fio else "apt install fio, for the bench's fio rows"))
    return checks


def _directory_checks(directory: str) -> list[Check]:
    path = os.path.abspath(directory)
    probe_dir = nearest_existing_directory(path)
    where = path if probe_dir == path else f"{path} (absent; probed its parent {probe_dir})"
    kind = filesystem_of(probe_dir) or "unknown"
    in_memory = kind in ("tmpfs", "ramfs")
    checks = [Check("swap-file directory", where),
              Check("filesystem", kind, "note" if in_memory else "ok",
                    "memory-backed: swap files here take RAM, not disk; use a directory on the NVMe disk"
                    if in_memory else "")]
    free = shutil.disk_usage(probe_dir).free
    checks.append(Check("free space", f"{free / 2**30:.1f} GiB", "ok" if free >= 1 << 30 else "note",
                        "" if free >= 1 << 30 else "under 1 GiB free: the nvme tier will fill quickly"))
    if not os.access(probe_dir, os.W_OK):
        checks.append(Check("writable", "no", "problem", f"the store cannot create files under {probe_dir}"))
        return checks
    fd, name = tempfile.mkstemp(prefix=".tiered-env-", dir=probe_dir)
    os.close(fd)
    try:
        checks.append(_direct_io(name))
        checks.append(_fallocate(name))
    finally:
        os.unlink(name)
    return checks


def _direct_io(path: str) -> Check:
    """Open with O_DIRECT and move one aligned block through it, checked byte for byte."""
    handle = open_file(path, direct=True, create=False)
    buf = AlignedBuffer(ALIGNMENT)
    try:
        if not handle.direct:
            return Check("O_DIRECT", "refused by the filesystem", "note",
                         "the store falls back to buffered I/O here (reads may come from the page cache); "
                         "put swap files on ext4 or xfs on the NVMe disk")
        buf.tensor.copy_(torch.arange(ALIGNMENT, dtype=torch.int32).to(torch.uint8))
        written = os.pwritev(handle.fd, [buf.view], 0)
        os.fdatasync(handle.fd)
        back = AlignedBuffer(ALIGNMENT)
        try:
            read = os.preadv(handle.fd, [back.view], 0)
            same = written == read == ALIGNMENT and torch.equal(back.tensor, buf.tensor)
        finally:
            back.close()
        if not same:
            return Check("O_DIRECT", f"wrote {written} and read {read} bytes, not the same", "problem",
                         "an aligned block did not come back intact: check the disk and filesystem")
        align = direct_io_memory_alignment(handle)
        in_place = ("so torch's own CPU tensors of 1 MiB and more move in place" if align <= 64 else
                    "so torch's own CPU tensors (64 bytes into a page) are staged; tiered.empty_aligned ones "
                    "move in place")
        return Check("O_DIRECT", f"works ({ALIGNMENT}-byte aligned block written, synced and read back; "
                                 f"buffers need {align}-byte alignment, {in_place})")
    except OSError as exc:
        return Check("O_DIRECT", f"opened, but I/O failed: {exc}", "problem",
                     "pass StoreConfig(direct_io=False) or use another directory")
    finally:
        buf.close()
        handle.close()


def _fallocate(path: str) -> Check:
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        return Check("fallocate", "works (swap files grow without writing zeros)")
    except OSError as exc:
        return Check("fallocate", f"refused ({exc.strerror})", "note", "swap files grow slower here")
    finally:
        os.close(fd)


def _huge_pages() -> Check:
    try:
        with open(THP) as f:
            mode = f.read().strip()
    except OSError:
        return Check("transparent huge pages", "absent", "note",
                     "large get results and staging buffers use 4 KiB pages (docs/tuning.md, 'Memory')")
    if "[never]" in mode:
        return Check("transparent huge pages", mode, "note",
                     "off: large get results and staging buffers use 4 KiB pages (docs/tuning.md, 'Memory')")
    return Check("transparent huge pages", mode)


def _memlock() -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    staging = StoreConfig.block_size * StoreConfig.staging_buffers
    if os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= staging:
        found = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        return Check("locked memory (RLIMIT_MEMLOCK)", found + (" (root)" if os.geteuid() == 0 else ""))
    return Check("locked memory (RLIMIT_MEMLOCK)", f"{soft} bytes", "note",
                 f"staging buffers stay unlocked (writes ~12% slower here); raise `ulimit -l` to {staging} or more")


def _cuda() -> Check:
    if not torch.cuda.is_available():
        return Check("cuda", "not available: the device tier uses the CPU's memory")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    try:
        AlignedBuffer(ALIGNMENT, pin=True).close()
    except RuntimeError as exc:
        return Check("cuda", f"{names}; pinning failed: {exc}", "problem", "raise the locked-memory limit (ulimit -l)")
    return Check("cuda", f"{names}; host buffers pin")


def _crc() -> Check:
    if "zlib" in CRC32_IMPL:
        return Check("crc-32", CRC32_IMPL, "note", "pip install deflate: checksums at memory speed")
    return Check("crc-32", CRC32_IMPL.split(" (")[0])


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed (run from a checkout)"


def _not_a_directory(path: str) -> str:
    """Why swap files could never go to ``path`` (a file is there, or where a parent should be), or ''."""
    at = os.path.abspath(path)
    while not os.path.lexists(at):
        at = os.path.dirname(at)
    if os.path.isdir(at):
        return ""
    where = "is not a directory" if at == os.path.abspath(path) else f"cannot be made: {at} is not a directory"
    return f"--dir {os.path.abspath(path)} {where}; pass the directory the store's swap files would go in"


def main(argv: Optional[Sequence[str]] = None, *, out: TextIO = sys.stdout) -> int:
    """Run ``tiered env``; return 0, 1 when a check found a problem, 2 when ``--dir`` is not a directory."""
    p = argparse.ArgumentParser(prog="tiered env", description="What this machine and directory give the store: "
                                "O_DIRECT, fallocate, free space, huge pages, locked memory, CUDA, versions.")
    p.add_argument("--dir", default=".", help="where swap files would go (default: the current directory)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = p.parse_args(argv)
    problem = _not_a_directory(args.dir)
    if problem:
        print(f"tiered env: {problem}", file=sys.stderr)
        return 2
    checks = collect(args.dir)
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=2), file=out)
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            mark = {"ok": "  ", "note": "~ ", "problem": "! "}[c.status]
            print(f"{mark}{c.name:<{width}}  {c.found}" + (f"  -- {c.advice}" if c.advice else ""), file=out)
    return 1 if any(c.status == "problem" for c in checks) else 0
