"""Aligned asynchronous file I/O: buffers, files and a block scheduler. Knows nothing of tensors."""

from tiered.io.aligned import AlignedBuffer, round_up
from tiered.io.blocks import BlockRead, BlockWrite, IOEngine
from tiered.io.files import FileHandle, Syscalls, open_file

__all__ = [
    "AlignedBuffer",
    "BlockRead",
    "BlockWrite",
    "FileHandle",
    "IOEngine",
    "Syscalls",
    "open_file",
    "round_up",
]
