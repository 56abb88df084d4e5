"""fio as the disk's reference: sequential libaio writes and reads of one file (O_DIRECT where the
filesystem takes it), each group of jobs with its own block size, queue depth and job count.

Several settings run in one fio process (one reporting group each, one after another), so a sweep
pays fio's start-up once. :mod:`tiered.bench.fio_sweep` picks the best of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from typing import Any, Optional, Sequence

from tiered.bench.options import format_size
from tiered.bench.results import Run, ToolStatus

WRITE = "write"
READ = "read"


class FioError(RuntimeError):
    """fio is not installed, or a fio run failed (the message says which, with fio's own words)."""


@dataclasses.dataclass(frozen=True)
class FioSetting:
    """How fio moves the file: bytes per request, requests in flight per job, and jobs.

    With several jobs each takes its own contiguous share of the file (``offset_increment``), so
    the file is written and read once whatever the job count.
    """

    block_size: int
    queue_depth: int
    jobs: int = 1

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "jobs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"FioSetting.{name} must be a positive int, got {value!r}")

    @property
    def in_flight(self) -> int:
        """Bytes fio keeps in flight (and allocates as buffers): block size x depth x jobs."""
        return self.block_size * self.queue_depth * self.jobs

    def describe(self) -> str:
        """fio's own option names, e.g. ``"bs=8MiB iodepth=64 numjobs=1"``."""
        return f"bs={format_size(self.block_size)} iodepth={self.queue_depth} numjobs={self.jobs}"

    def as_dict(self) -> dict[str, int]:
        """JSON-ready form."""
        return dataclasses.asdict(self)


def fio_status() -> ToolStatus:
    """Whether the fio binary is on PATH, and its version."""
    path = shutil.which("fio")
    if path is None:
        return ToolStatus("fio", False, note="fio is not installed (not on PATH), so there is no disk reference; "
                          "install it (apt-get install fio) for ratios to the disk's bandwidth")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return ToolStatus("fio", False, note=f"fio is on PATH at {path} but does not run: {exc}")
    return ToolStatus("fio", True, version=version)


class FioFile:
    """One file of ``nbytes`` (rounded down to 4 KiB) under ``directory``, written and read by fio.

    Writes end with an fsync (``end_fsync=1``: durable, as a put is) and, unless ``fresh``, overwrite
    a file fio lays out before the clock starts (``overwrite=1``: every timed write lands on blocks
    written before). Reads use buffers fio has touched first (``zero_buffers=1``), so no first-touch
    page fault counts against the disk. Where the filesystem refuses O_DIRECT (tmpfs), runs are
    buffered and :attr:`note` says so.
    """

    def __init__(self, directory: str, nbytes: int) -> None:
        if nbytes < 4096:
            raise ValueError(f"a fio file needs at least 4096 bytes, got {nbytes}")
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "fio.dat")
        self.nbytes = nbytes - nbytes % 4096
        self.direct = True
        self.note = ""

    def fits(self, setting: FioSetting) -> bool:
        """Whether each job's share of the file holds at least one whole block."""
        return self.nbytes // setting.jobs >= setting.block_size

    def write(self, setting: FioSetting, *, fresh: bool = False) -> Run:
        """One sequential write of the whole file, fsync'ed at the end. ``fresh``: into a new file
        (allocated as it is written, as a checkpoint file is), not over the blocks of the last one."""
        if fresh:
            self.close()
        return self.run([(WRITE, setting)], overwrite=not fresh)[0]

    def read(self, setting: FioSetting) -> Run:
        """One sequential read of the whole file (O_DIRECT: the page cache is bypassed)."""
        return self.run([(READ, setting)])[0]

    def run(self, groups: Sequence[tuple[str, FioSetting]], *, overwrite: bool = True) -> list[Run]:
        """Run ``groups`` (``("write" | "read", setting)``, in order, one after another) in one fio
        process; one :class:`Run` per group, its value in GB/s. Raises :class:`FioError`."""
        for rw, setting in groups:
            if rw not in (WRITE, READ):
                raise ValueError(f"a fio group is 'write' or 'read', got {rw!r}")
            if not self.fits(setting):
                raise ValueError(f"{setting.describe()} does not fit a {self.nbytes}-byte file: each job's share "
                                 "must hold a whole block")
        if not groups:
            return []
        if any(rw == READ for rw, _ in groups) and not os.path.exists(self.path):
            self.run([(WRITE, groups[0][1])])  # a read needs the file: lay it out first (untimed)
        try:
            out = self._run_fio(groups, overwrite)
        except FioError:
            if not self.direct:
                raise
            self.direct = False  # tmpfs and some others refuse O_DIRECT: measure buffered, and say so
            self.note = "fio could not use O_DIRECT in this directory; its figures are buffered I/O"
            out = self._run_fio(groups, overwrite)
        jobs = out.get("jobs", [])
        if len(jobs) != len(groups):
            raise FioError(f"fio reported {len(jobs)} groups for the {len(groups)} it was given")
        runs = []
        for (rw, setting), job in zip(groups, jobs):
            figures = job[rw]
            seconds = figures["runtime"] / 1000.0
            nbytes = int(figures["io_bytes"])
            if seconds <= 0 or nbytes <= 0:
                raise FioError(f"fio {rw} with {setting.describe()} reported no I/O: {figures}")
            runs.append(Run(value=nbytes / seconds / 1e9, seconds=seconds, nbytes=nbytes,
                            ops=int(figures.get("total_ios", 0)),
                            detail={"rw": rw, **setting.as_dict(), "direct": self.direct}))
        return runs

    def close(self) -> None:
        """Remove the file."""
        if os.path.exists(self.path):
            os.unlink(self.path)

    def _job_file(self, groups: Sequence[tuple[str, FioSetting]], overwrite: bool) -> str:
        lines = ["[global]", "ioengine=libaio", f"direct={int(self.direct)}", f"filename={_escape(self.path)}",
                 f"filesize={self.nbytes}", "group_reporting", "stonewall"]
        for index, (rw, setting) in enumerate(groups):
            share = self.nbytes // setting.jobs
            share -= share % setting.block_size  # whole blocks per job
            lines += [f"[{rw}-{index}]", f"rw={rw}", f"bs={setting.block_size}", f"iodepth={setting.queue_depth}",
                      f"numjobs={setting.jobs}", f"io_size={share}", f"offset_increment={share}"]
            if index:
                lines.append("new_group")
            if rw == WRITE:
                lines += ["end_fsync=1", f"overwrite={int(overwrite)}"]
            else:
                lines.append("zero_buffers=1")
        return "\n".join(lines) + "\n"

    def _run_fio(self, groups: Sequence[tuple[str, FioSetting]], overwrite: bool) -> dict[str, Any]:
        job_path = f"{self.path}.fio"
        with open(job_path, "w") as f:
            f.write(self._job_file(groups, overwrite))
        try:
            proc = subprocess.run(["fio", "--output-format=json", job_path], capture_output=True, text=True)
        except OSError as exc:
            raise FioError(f"fio could not be started: {exc}") from exc
        finally:
            os.unlink(job_path)
        parsed = _parse(proc.stdout)
        if proc.returncode != 0 or parsed is None:
            why = (proc.stderr or proc.stdout).strip()[-400:]
            raise FioError(f"fio failed (exit {proc.returncode}): {why}")
        return parsed


def _escape(path: str) -> str:
    return path.replace(":", "\\:")  # fio splits a filename on ':'


def _parse(stdout: str) -> Optional[dict[str, Any]]:
    start, end = stdout.find("{"), stdout.rfind("}")  # fio may print notes before and after the JSON
    if start < 0 or end < start:
        return None
    try:
        return json.loads(stdout[start:end + 1])
    except json.JSONDecodeError:
        return None
