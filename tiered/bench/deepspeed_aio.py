"""DeepSpeed's aio handle (``AsyncIOBuilder().load().aio_handle``) writing and reading the same
tensors, one file each, as ZeRO-Infinity swaps them. An optional extra: skipped with a note when
deepspeed or libaio is missing."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

from tiered.bench.results import Run, ToolStatus
from tiered.bench.tensors import same


def load_aio(announce: Optional[Callable[[str], None]] = None) -> tuple[Optional[Any], ToolStatus]:
    """Import deepspeed and build (first time: minutes, cached after) or load its aio op; ``announce``
    is told, once deepspeed is found and its op can be built here, that the build may take a while."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        # deepspeed logs to stdout; keep stdout for the table.
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401
            from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, ToolStatus("deepspeed", False, skipped=True, note=(
            f"deepspeed is not installed ({type(exc).__name__}: {exc}); it is an optional extra: "
            'pip install -e ".[bench]" in the checkout (or pip install deepspeed) and apt-get install libaio-dev to '
            "compare with its aio handle (docs/benchmarks.md)"))
    version = getattr(deepspeed, "__version__", "")
    # Its once-per-process SSD-endurance warning would land in the middle of the progress bars.
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            builder = AsyncIOBuilder()
            if not builder.is_compatible(verbose=False):
                return None, ToolStatus("deepspeed", True, skipped=True, version=version, note=(
                    "deepspeed is installed but its aio op cannot be built here (libaio headers missing?); "
                    "apt-get install libaio-dev"))
            if announce is not None:
                announce("loading DeepSpeed's aio op (built on first use, which takes minutes; cached after)...")
            module = builder.load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - a failed JIT build is reported, not fatal
        return None, ToolStatus("deepspeed", True, skipped=True, version=version,
                                note=f"building DeepSpeed's aio op failed: {type(exc).__name__}: {exc}")
    return module, ToolStatus("deepspeed", True, version=version)


#: Where one tensor's bytes go: (path, file offset, length) ranges, in order.
Placement = Sequence[tuple[str, int, int]]


class DeepSpeedAio:
    """One aio handle moving the same tensors with ``async_pwrite``/``async_pread`` x N, then ``wait()``
    (or one tensor at a time: its requests, then ``wait()``, then the next).

    ``locked=True`` uses DeepSpeed's page-locked tensors (its fast path); ``locked=False`` passes the
    caller's plain tensors, which it bounces through a copy. Each call takes where the bytes go:
    :meth:`own_files` (one file per tensor, as ZeRO-Infinity lays out its swap files) or any other
    placement, such as the ranges a store holds the same tensors in (``TieredStore.nvme_layout``):
    the same file and the same disk blocks, so where a file happens to land on the disk cannot
    favour either side.
    """

    def __init__(
        self, module: Any, directory: str, tensors: Sequence[torch.Tensor], *, block_size: int, queue_depth: int,
        threads: int, locked: bool,
    ) -> None:
        os.makedirs(directory, exist_ok=True)
        self.tensors = list(tensors)
        self.locked = locked
        self.params = {"block_size": block_size, "queue_depth": queue_depth, "single_submit": False,
                       "overlap_events": True, "intra_op_parallelism": threads}
        self.handle = module.aio_handle(block_size, queue_depth, False, True, threads)
        self.paths = [os.path.join(directory, f"ds{i:05d}.swp") for i in range(len(self.tensors))]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        if locked:
            like = torch.empty(0, dtype=torch.uint8)  # the locked buffers' dtype: bytes
            self.buffers = [self.handle.new_cpu_locked_tensor(t.numel() * t.element_size(), like)
                            for t in self.tensors]
            for buf, t in zip(self.buffers, self.tensors):
                buf.copy_(_as_bytes(t))
        else:
            self.buffers = [_as_bytes(t) for t in self.tensors]
        self.targets = self.buffers if locked else [torch.zeros_like(b) for b in self.buffers]

    def describe(self) -> str:
        """The handle's parameters, for the report."""
        p = self.params
        kind = "its page-locked tensors" if self.locked else "plain tensors (bounced through a locked copy)"
        return (f"aio_handle(block_size={p['block_size']}, queue_depth={p['queue_depth']}, "
                f"intra_op_parallelism={p['intra_op_parallelism']}) on {kind}; fdatasync after wait()")

    def buffer_tensors(self) -> Optional[list[torch.Tensor]]:
        """The page-locked buffers as tensors of the original dtypes and shapes, for another contender to
        move the same bytes from and to the same memory; None when not locked or not page-aligned."""
        if not self.locked or any(b.data_ptr() % 4096 for b in self.buffers):
            return None
        return [b.view(t.dtype).view(t.shape) for b, t in zip(self.buffers, self.tensors)]

    def own_files(self) -> list[Placement]:
        """One file per tensor in this object's directory, written from offset 0."""
        return [[(path, 0, b.numel())] for path, b in zip(self.paths, self.buffers)]

    def write(self, placements: Sequence[Placement], *, one_at_a_time: bool = False) -> Run:
        """async_pwrite every tensor to its ranges, wait(), then fdatasync every file (durable, like a put).

        ``one_at_a_time``: each tensor is written, waited for and made durable before the next starts,
        as sequential puts (each durable on return) are.
        """
        groups = self._groups(self.buffers, placements, one_at_a_time)
        start = time.perf_counter()
        for requests in groups:
            for view, path, offset in requests:
                self._check(self.handle.async_pwrite(view, path, offset), "async_pwrite", path)
            self._wait(len(requests))
            for path in dict.fromkeys(path for _, path, _ in requests):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
        seconds = time.perf_counter() - start
        return Run(self.nbytes / seconds / 1e9, seconds, self.nbytes, len(self.tensors))

    def read(self, placements: Sequence[Placement], *, one_at_a_time: bool = False) -> Run:
        """async_pread every tensor's ranges into its buffer (O_DIRECT), wait(), and verify the bytes.

        ``one_at_a_time``: each tensor is read and waited for before the next starts, as sequential gets are.
        """
        for t in self.targets:
            t.zero_()  # so a read that moves nothing cannot pass verification
        groups = self._groups(self.targets, placements, one_at_a_time)
        start = time.perf_counter()
        for requests in groups:
            for view, path, offset in requests:
                self._check(self.handle.async_pread(view, path, offset), "async_pread", path)
            self._wait(len(requests))
        seconds = time.perf_counter() - start
        ok = all(same(b.view(t.dtype).reshape(t.shape), t) for b, t in zip(self.targets, self.tensors))
        return Run(self.nbytes / seconds / 1e9, seconds, self.nbytes, len(self.tensors), verified=ok)

    def close(self) -> None:
        """Free the locked buffers and remove this object's own files."""
        if self.locked:
            for buf in self.buffers:
                self.handle.free_cpu_locked_tensor(buf)
            self.buffers = self.targets = []
        for path in self.paths:
            if os.path.exists(path):
                os.unlink(path)

    def _groups(self, buffers: Sequence[torch.Tensor], placements: Sequence[Placement],
                one_at_a_time: bool) -> list[list[tuple[torch.Tensor, str, int]]]:
        """The requests, in one group submitted before a single wait(), or one group per tensor."""
        requests = self._requests(buffers, placements)
        if not one_at_a_time:
            return [requests]
        each = iter(requests)
        return [list(itertools.islice(each, len(p))) for p in placements]

    def _requests(self, buffers: Sequence[torch.Tensor],
                  placements: Sequence[Placement]) -> list[tuple[torch.Tensor, str, int]]:
        """(buffer slice, path, offset) per range; slices of a locked buffer stay on the fast path."""
        if len(placements) != len(buffers):
            raise ValueError(f"{len(placements)} placements for {len(buffers)} tensors")
        out = []
        for buf, placement in zip(buffers, placements):
            if sum(length for _, _, length in placement) != buf.numel():
                raise ValueError(f"placement {placement} does not hold {buf.numel()} bytes")
            pos = 0
            for path, offset, length in placement:
                out.append((buf[pos:pos + length], path, offset))
                pos += length
        return out

    def _wait(self, expected: int) -> None:
        done = self.handle.wait()
        if done != expected:
            raise RuntimeError(f"DeepSpeed aio wait() completed {done} of {expected} requests")

    @staticmethod
    def _check(rc: int, what: str, path: str) -> None:
        if rc != 0:
            raise RuntimeError(f"DeepSpeed {what} of {path} failed (returned {rc})")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)
