"""fio as the reference: sequential O_DIRECT libaio writes and reads of one file, in the same run
and directory as the store, so the store's figures can be stated as a fraction of the disk's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Optional

from tiered.bench.results import Run, ToolStatus
from tiered.config import MiB

FIO_MIN_BLOCK = 1 * MiB
FIO_MAX_BLOCK = 8 * MiB


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


class Fio:
    """Runs fio jobs on one file under ``directory``: block size clamped to 1-8 MiB, depth 16-32."""

    def __init__(self, directory: str, nbytes: int, block_size: int, queue_depth: int) -> None:
        self.path = os.path.join(directory, "fio.dat")
        os.makedirs(directory, exist_ok=True)
        self.nbytes = nbytes - nbytes % 4096
        self.block_size = min(max(block_size, FIO_MIN_BLOCK), FIO_MAX_BLOCK)
        self.queue_depth = min(max(queue_depth, 16), 32)
        self.direct = True
        self.note = ""

    def describe(self) -> str:
        """The job parameters, for the report."""
        io = "O_DIRECT" if self.direct else "buffered (O_DIRECT refused here)"
        return (f"libaio, {io}, bs={self.block_size // MiB}MiB, iodepth={self.queue_depth}, "
                f"one {self.nbytes // MiB} MiB "
                "file; writes with end_fsync=1 and overwrite=1, reads with zero_buffers=1")

    def write(self, *, fresh: bool = False) -> Run:
        """One sequential write of the whole file, fsync'ed at the end (durable, like a put).
        ``fresh``: into a new file (allocated as it is written, as a checkpoint file is), not over
        the blocks of the last one."""
        if fresh:
            self.close()
        return self._job("write", overwrite=not fresh)

    def read(self) -> Run:
        """One sequential read of the whole file (O_DIRECT: the page cache is bypassed)."""
        return self._job("read")

    def close(self) -> None:
        """Remove the file."""
        if os.path.exists(self.path):
            os.unlink(self.path)

    def _job(self, rw: str, overwrite: bool = True) -> Run:
        try:
            out = self._run_fio(rw, overwrite)
        except RuntimeError:
            if not self.direct:
                raise
            self.direct = False  # tmpfs and some others refuse O_DIRECT: measure buffered, and say so
            self.note = "fio could not use O_DIRECT in this directory; its figures are buffered I/O"
            out = self._run_fio(rw, overwrite)
        job = out["jobs"][0][rw]
        seconds = job["runtime"] / 1000.0
        nbytes = int(job["io_bytes"])
        if seconds <= 0 or nbytes <= 0:
            raise RuntimeError(f"fio {rw} reported no I/O: {job}")
        return Run(value=nbytes / seconds / 1e9, seconds=seconds, nbytes=nbytes, ops=int(job.get("total_ios", 0)),
                   detail={"bw_bytes": job.get("bw_bytes"), "direct": self.direct})

    def _run_fio(self, rw: str, overwrite: bool = True) -> dict:
        cmd = [
            "fio", "--name=tiered-bench", f"--filename={_escape(self.path)}", f"--size={self.nbytes}",
            f"--bs={self.block_size}", f"--iodepth={self.queue_depth}", "--ioengine=libaio",
            f"--direct={int(self.direct)}", f"--rw={rw}", "--numjobs=1", "--output-format=json",
        ]
        if rw == "read":
            # zero_buffers=1: fio writes its buffers before the clock starts, so a read does not land
            # in never-touched malloc'd pages whose first-touch faults would count against the disk;
            # the store's get(out=) and DeepSpeed read into memory that is already touched too.
            cmd += ["--zero_buffers=1"]
        if rw == "write":
            # overwrite=1: fio lays the file out fully before the first timed write, so every run
            # overwrites allocated blocks (its fastest case; the store's median run reuses extents too)
            cmd += ["--end_fsync=1", f"--overwrite={int(overwrite)}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        parsed = _parse(proc.stdout)
        if proc.returncode != 0 or parsed is None:
            why = (proc.stderr or proc.stdout).strip()[-400:]
            raise RuntimeError(f"fio {rw} failed (exit {proc.returncode}): {why}")
        return parsed


def _escape(path: str) -> str:
    return path.replace(":", "\\:")  # fio splits --filename on ':'


def _parse(stdout: str) -> Optional[dict]:
    start = stdout.find("{")  # fio may print notes before the JSON
    if start < 0:
        return None
    try:
        return json.loads(stdout[start:])
    except json.JSONDecodeError:
        return None
