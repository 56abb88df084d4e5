"""What a training process costs the machine, read from /proc: the bytes it moved over storage, its
resident memory now and at its peak, the disk's busy time, a store's footprint, and a sampler
thread that keeps the peaks between steps. Used by the beyond-memory benchmark's contenders, each
in a process of its own."""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

from engine.paging.machine_memory import memory_sizes


def ram_bytes() -> int:
    """The machine's memory (MemTotal)."""
    sizes = memory_sizes()
    if sizes is None:
        raise RuntimeError("/proc/meminfo gives no MemTotal and MemAvailable")
    return sizes[0]


def cpu_flags() -> set[str]:
    """The first CPU's feature flags (/proc/cpuinfo), empty where the file has none."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def bf16_support() -> dict[str, bool]:
    """Whether the CPU has the instructions bf16 matmuls run fast with (AVX512-BF16, AMX-BF16)."""
    flags = cpu_flags()
    return {"avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags}


def process_io() -> tuple[int, int]:
    """Bytes this process has read from and written to storage (``/proc/self/io``: every thread, and
    the children it has waited for)."""
    fields = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            fields[key] = int(value)
    return fields["read_bytes"], fields["write_bytes"]


def disk_ticks(directory: str) -> Optional[tuple[float, float]]:
    """Seconds the disk holding ``directory`` has had I/O in flight, and the same weighted by the
    requests in flight, since boot (``/proc/diskstats``); None where the filesystem is not on a
    block device listed there (tmpfs, overlay)."""
    dev = os.stat(directory).st_dev
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if (int(fields[0]), int(fields[1])) == (os.major(dev), os.minor(dev)):
                return int(fields[12]) / 1000, int(fields[13]) / 1000
    return None


def rss_bytes(pid: str = "self") -> int:
    """The resident set size of process ``pid`` (this one by default) now."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def oom_kills() -> Optional[int]:
    """Processes the kernel's OOM killer has killed since boot (``/proc/vmstat`` oom_kill), None
    where the kernel does not count them."""
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return None


def allocated_bytes(directory: str) -> int:
    """Bytes allocated on disk to the files under ``directory`` (st_blocks, links not followed)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass  # deleted while we walked
    return total


class Sampler:
    """A thread that samples RSS (every ``interval`` s) and the disk footprint of ``directory``
    (every ``disk_every``-th sample), keeping the series and the peaks since :meth:`mark`."""

    def __init__(self, directory: str, interval: float = 0.1, disk_every: int = 10) -> None:
        self.directory, self.interval, self.disk_every = directory, interval, disk_every
        self.t0 = time.perf_counter()
        self.series: list[tuple[float, int]] = []
        self.peak_rss = 0
        self.peak_disk = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="beyond-memory-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self) -> tuple[int, int]:
        """The peaks (RSS, disk) since the last mark; starts new ones."""
        peaks = (max(self.peak_rss, rss_bytes()), max(self.peak_disk, allocated_bytes(self.directory)))
        self.peak_rss = self.peak_disk = 0
        return peaks

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.interval):
            rss = rss_bytes()
            self.peak_rss = max(self.peak_rss, rss)
            self.series.append((time.perf_counter() - self.t0, rss))
            if n % self.disk_every == 0:
                self.peak_disk = max(self.peak_disk, allocated_bytes(self.directory))
            n += 1


class StepMeter:
    """Brackets one training step: wall time, the bytes the process read and wrote, its CPU time and
    the disk's busy time between :meth:`start` and :meth:`stop`, and the sampler's peaks."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def start(self) -> None:
        self._io = process_io()
        self._disk = disk_ticks(self.sampler.directory)
        self._cpu = os.times()
        self._t = time.perf_counter()

    def stop(self) -> dict[str, float]:
        """The step's figures (and the peaks since the last step's)."""
        seconds = time.perf_counter() - self._t
        cpu = os.times()
        read, written = process_io()
        disk = disk_ticks(self.sampler.directory)
        peak_rss, peak_disk = self.sampler.mark()
        out = {"seconds": seconds, "bytes_read": read - self._io[0], "bytes_written": written - self._io[1],
               "cpu_user_s": cpu.user - self._cpu.user, "cpu_system_s": cpu.system - self._cpu.system,
               "peak_rss": peak_rss, "peak_disk_bytes": peak_disk}
        if self._disk and disk:  # the disk's view: seconds with a request in flight, and the mean queue then
            busy = disk[0] - self._disk[0]
            out.update(disk_busy_s=busy, disk_queue=(disk[1] - self._disk[1]) / max(busy, 1e-3))
        return out
