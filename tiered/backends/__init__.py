"""Tier backends: one class per tier, all behind the :class:`TierBackend` interface."""

from tiered.backends.base import Copy, TierBackend
from tiered.backends.device import DeviceBackend, DeviceCopy
from tiered.backends.host import HostBackend, HostCopy
from tiered.backends.nvme import FileExtent, NvmeBackend, NvmeCopy

__all__ = [
    "Copy",
    "DeviceBackend",
    "DeviceCopy",
    "FileExtent",
    "HostBackend",
    "HostCopy",
    "NvmeBackend",
    "NvmeCopy",
    "TierBackend",
]
