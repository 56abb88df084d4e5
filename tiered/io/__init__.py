"""Aligned asynchronous file I/O: buffers, files and a block scheduler. Knows nothing of tensors."""

from tiered.io.aligned import AlignedBuffer, round_up
from tiered.io.blocks import BlockRead, BlockWrite, IOEngine
from tiered.io.files import FileHandle, Syscalls, open_file
from tiered.io.host_memory import empty_aligned, is_page_aligned
from tiered.io.results import ResultPool

__all__ = [
    "AlignedBuffer",
    "BlockRead",
    "BlockWrite",
    "FileHandle",
    "IOEngine",
    "ResultPool",
    "Syscalls",
    "empty_aligned",
    "is_page_aligned",
    "open_file",
    "round_up",
]
