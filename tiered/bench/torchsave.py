"""torch.save / torch.load of the same tensors, one file each: what people do without a store."""

from __future__ import annotations

import os
import time
from typing import Sequence

import torch

from tiered.bench.results import Run
from tiered.bench.system import evict_file_pages
from tiered.bench.tensors import same


class TorchSave:
    """Writes each tensor with torch.save and fsyncs it (so a write is durable, like a put); reads
    with torch.load after dropping the files' pages from the page cache (so a read is cold)."""

    def __init__(self, directory: str, tensors: Sequence[torch.Tensor]) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.tensors = list(tensors)
        self.paths = [os.path.join(directory, f"t{i:05d}.pt") for i in range(len(self.tensors))]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)

    def write(self) -> Run:
        """torch.save every tensor, then fsync every file."""
        start = time.perf_counter()
        for t, path in zip(self.tensors, self.paths):
            with open(path, "wb") as f:
                torch.save(t, f)
                f.flush()
                os.fsync(f.fileno())
        seconds = time.perf_counter() - start
        return Run(self.nbytes / seconds / 1e9, seconds, self.nbytes, len(self.tensors))

    def read(self) -> Run:
        """torch.load every file (pages evicted first), checking and dropping each tensor before the
        next load, like the store's reads; only the loads are timed."""
        for path in self.paths:
            evict_file_pages(path)
        seconds, ok = 0.0, True
        for path, want in zip(self.paths, self.tensors):
            start = time.perf_counter()
            got = torch.load(path, weights_only=True)
            seconds += time.perf_counter() - start
            ok = ok and same(got, want)
            del got
        return Run(self.nbytes / seconds / 1e9, seconds, self.nbytes, len(self.tensors), verified=ok)

    def close(self) -> None:
        """Remove the files."""
        for path in self.paths:
            if os.path.exists(path):
                os.unlink(path)
