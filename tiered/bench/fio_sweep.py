"""fio's best on this machine: a sweep over block size, queue depth and job count, then the best
setting of each direction run again, so a benchmark holds the product against the best fio does
here, measured in the same run, never against a constant or one arbitrary setting."""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Sequence

from tiered.bench.fio import READ, WRITE, FioError, FioFile, FioSetting, fio_status
from tiered.bench.options import FIO_BLOCK_SIZES, FIO_JOB_COUNTS, FIO_QUEUE_DEPTHS
from tiered.bench.results import Run
from tiered.config import MiB

#: Settings keeping more bytes in flight than this (or than the file, when larger) are left out:
#: fio allocates every in-flight buffer, and a depth the file cannot fill measures nothing new.
MAX_IN_FLIGHT = 512 * MiB


def sweep_settings(block_sizes: Sequence[int], queue_depths: Sequence[int], jobs: Sequence[int],
                   nbytes: int) -> list[FioSetting]:
    """Every combination of the three lists that fits a file of ``nbytes`` (each job's share holds a
    block) and keeps at most ``max(nbytes, MAX_IN_FLIGHT)`` bytes in flight. Raises ``ValueError``
    when none does."""
    cap = max(nbytes, MAX_IN_FLIGHT)
    settings = [FioSetting(b, q, j) for b, q, j in itertools.product(block_sizes, queue_depths, jobs)]
    kept = [s for s in settings if nbytes // s.jobs >= s.block_size and s.in_flight <= cap]
    if not kept:
        raise ValueError(f"no fio setting of block sizes {list(block_sizes)}, queue depths {list(queue_depths)} and "
                         f"job counts {list(jobs)} fits {nbytes} bytes")
    return kept


def fio_best(directory: str, *, nbytes: int = 512 * MiB, block_sizes: Sequence[int] = FIO_BLOCK_SIZES,
             queue_depths: Sequence[int] = FIO_QUEUE_DEPTHS, jobs: Sequence[int] = FIO_JOB_COUNTS,
             repeats: int = 3) -> tuple[float, float, dict[str, Any]]:
    """fio's best sequential read and write bandwidth on the disk under ``directory``.

    Every setting of the grid (:func:`sweep_settings`) writes, then reads, one file of ``nbytes``
    once; the fastest setting of each direction then runs ``repeats - 1`` more times, writes and
    reads alternating, and its figure is the median of all its runs. The file lives in a scratch
    folder under ``directory``, removed afterwards. Each setting and direction costs fio about half
    a second of start-up beyond its I/O (fio runs once per pass, its groups one after another).

    Args:
        directory: a directory on the disk to measure (created when missing).
        nbytes: bytes of the file each run moves (at least 4096; rounded down to 4 KiB).
        block_sizes, queue_depths, jobs: the grid (fio's ``bs``, ``iodepth``, ``numjobs``); by default
            1, 4, 8 and 16 MiB x depths 4, 16, 64 and 128 x 1 and 4 jobs, the settings that fit.
        repeats: runs of each direction's best setting, >= 1 (the sweep's own run counts).

    Returns:
        ``(read_bytes_per_s, write_bytes_per_s, details)``: the medians, and a JSON-ready dict with
        fio's version, ``nbytes``, ``direct`` (False where the filesystem refused O_DIRECT), every
        setting's figures (``grid``), each direction's best setting with its runs (``best_read``,
        ``best_write``: ``setting``, ``bytes_per_s`` runs, ``median``) and ``seconds``.

    Raises:
        FioError: fio is not installed or a run failed.
        ValueError: ``repeats`` < 1, or no setting of the grid fits ``nbytes``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    status = fio_status()
    if not status.present:
        raise FioError(status.note)
    settings = sweep_settings(block_sizes, queue_depths, jobs, nbytes)
    started = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="tiered-fio-", dir=_existing(directory))
    try:
        file = FioFile(scratch, nbytes)
        sweep = file.run([(WRITE, s) for s in settings] + [(READ, s) for s in settings])
        writes, reads = sweep[:len(settings)], sweep[len(settings):]
        best_write = max(range(len(settings)), key=lambda i: writes[i].value)
        best_read = max(range(len(settings)), key=lambda i: reads[i].value)
        write_runs, read_runs = [writes[best_write]], [reads[best_read]]
        if repeats > 1:
            again = file.run([(rw, s) for _ in range(repeats - 1)
                              for rw, s in ((WRITE, settings[best_write]), (READ, settings[best_read]))])
            write_runs += again[0::2]
            read_runs += again[1::2]
        direct = file.direct
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    details = {
        "fio": status.version, "nbytes": file.nbytes, "direct": direct, "repeats": repeats,
        "grid": [{**s.as_dict(), "write_bytes_per_s": w.value * 1e9, "read_bytes_per_s": r.value * 1e9}
                 for s, w, r in zip(settings, writes, reads)],
        "best_write": _best(settings[best_write], write_runs),
        "best_read": _best(settings[best_read], read_runs),
        "seconds": time.perf_counter() - started,
    }
    return details["best_read"]["median"], details["best_write"]["median"], details


def best_setting(details: dict[str, Any], rw: str) -> FioSetting:
    """The best setting of ``rw`` ("read" or "write") in :func:`fio_best`'s details."""
    if rw not in (READ, WRITE):
        raise ValueError(f"rw is 'read' or 'write', got {rw!r}")
    return FioSetting(**details[f"best_{rw}"]["setting"])


def _best(setting: FioSetting, runs: list[Run]) -> dict[str, Any]:
    values = [r.value * 1e9 for r in runs]
    return {"setting": setting.as_dict(), "describe": setting.describe(), "bytes_per_s": values,
            "median": statistics.median(values)}


def _existing(directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    return directory
