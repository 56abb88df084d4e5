"""``tiered bench``: the store's write, cold read, small-tensor and prefetch performance through its
public API, side by side with fio, torch.save/load and DeepSpeed's aio handle in the same run."""

from tiered.bench.cli import main

__all__ = ["main"]
