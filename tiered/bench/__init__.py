"""``tiered bench``: the store's write, cold read, small-tensor and prefetch performance through its
public API, side by side with fio at its best, torch.save/load and DeepSpeed's aio handle in the
same run; and :func:`fio_best`, fio's best read and write bandwidth on a disk, for any benchmark
that holds a figure against what the disk can do."""

from tiered.bench.cli import main
from tiered.bench.fio import FioError, FioSetting
from tiered.bench.fio_sweep import fio_best

__all__ = ["FioError", "FioSetting", "fio_best", "main"]
