"""StoreConfig: every knob of a store, validated on construction."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: Swap-file extents, O_DIRECT offsets and sizes, and host slabs are multiples of this.
ALIGNMENT = 4096
#: Values of ``StoreConfig.compress_policy`` (tiered.codecs.policy implements them).
COMPRESS_POLICIES = ("auto", "always")


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """Configuration of a :class:`~tiered.TieredStore`.

    Budgets are bytes. ``device_bytes=0`` disables the device tier; ``nvme_bytes=None`` bounds the
    nvme tier by free disk space. ``path`` holds the manifest and lock file and, unless
    ``nvme_paths`` names other directories, the swap files.
    """

    path: str
    device_bytes: int = 0
    host_bytes: int = 1 * GiB
    nvme_bytes: Optional[int] = None
    #: Directories for swap files; data is striped across them. Default: ``(path,)``.
    nvme_paths: Optional[Sequence[str]] = None
    #: Torch device for the device tier; default "cuda" when available, else "cpu".
    device: Optional[str] = None
    #: Bytes per I/O request; large transfers are split into blocks of this size.
    block_size: int = 8 * MiB
    #: Most blocks in flight at once over the whole store: the disk's queue depth, since each block
    #: is one syscall on its own thread. Reads gain most from depth; `tiered bench --only sweep`
    #: measures block size x queue depth x io threads on a disk (docs/tuning.md).
    queue_depth: int = 64
    #: Staging buffers of ``block_size`` bytes (page-aligned; pinned under CUDA). A block whose memory
    #: cannot take O_DIRECT (a caller's tensor, a device copy) moves through one, so at most this many
    #: such blocks are in flight; blocks of host-tier copies and get results need none. Capped at
    #: ``queue_depth``. 16 x 8 MiB keeps the disk busy while blocks are being copied and checksummed.
    staging_buffers: int = 16
    #: Worker threads issuing pread/pwrite (each blocks in one syscall at a time, so at most this
    #: many blocks are at the disk). Threads start on demand; a blocked one costs no CPU.
    io_threads: int = 64
    #: nvme transfers up to this many bytes that arrive in the same event-loop iteration (puts or
    #: gets in flight together) run as one batch: back-to-back chunks in one syscall
    #: (tiered/backends/coalesce.py). 0 runs every transfer on its own.
    coalesce_bytes: int = 1 * MiB
    #: Worker threads for memory copies, checksums and codecs.
    cpu_threads: int = 2
    #: Swap files per directory (extents go round-robin over them).
    swap_files_per_dir: int = 2
    #: Swap files grow (fallocate) in steps of this many bytes.
    swap_grow_bytes: int = 256 * MiB
    #: Use O_DIRECT; falls back to buffered I/O with one warning where the filesystem refuses it.
    direct_io: bool = True
    #: fdatasync swap files before a record commits. Turning this off trades crash safety for speed.
    durable: bool = True
    #: Verify a CRC32 of every block read from a swap file.
    checksum: bool = True
    #: Compress puts to nvme unless a put says otherwise (see ``compress_policy``).
    compress: bool = False
    #: How ``compress=True`` above applies to puts that do not say: "auto" compresses only when the
    #: measured codec and disk throughputs say it makes transfers faster; "always" compresses.
    #: A put with ``compress=True`` asks for capacity and is always compressed. docs/compression.md.
    compress_policy: str = "auto"
    #: Write every entry that has no nvme copy down to nvme on close, so a reopen returns it.
    flush_on_close: bool = True
    #: Open a new store in a ``path`` that already holds other files, putting the store's beside them
    #: (by default that is refused, naming the files, so a store never mixes its files with a user's).
    allow_other_files: bool = False
    #: The host tier takes memory a slab (64 MiB) at a time as it fills, up to host_bytes, and keeps
    #: each slab once taken ([Note: host slabs] in tiered/backends/host_arena.py): opening costs the
    #: same at any budget. True populates a slab in one kernel call when it is taken, so no transfer
    #: takes first-touch page faults (O_DIRECT reads into never-touched pages ran at 0.25 GiB/s here,
    #: vs 0.9+ populated); False leaves its pages to fault in as copies first touch them.
    prefault_host: bool = True
    #: Large CPU results of get are page-aligned mappings that nvme reads fill directly; once the
    #: caller frees one, up to this many bytes of them wait to be reused by later gets of the same
    #: size, which then skip first-touch page faults (tiered/io/results.py). 0 unmaps them at once.
    result_pool_bytes: int = 1 * GiB
    #: Idle page-aligned buffers the codec keeps for reuse (compressed payloads being written or read).
    codec_cache_bytes: int = 128 * MiB

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError(f"StoreConfig.path must be a non-empty path, got {self.path!r}")
        object.__setattr__(self, "path", os.path.abspath(os.fspath(self.path)))
        paths = (self.path,) if self.nvme_paths is None else self.nvme_paths
        if isinstance(paths, (str, bytes, os.PathLike)) or not paths:
            raise ValueError(f"StoreConfig.nvme_paths must be a non-empty list of directories, got {self.nvme_paths!r}")
        resolved = tuple(os.path.abspath(os.fspath(p)) for p in paths)
        if len(set(resolved)) != len(resolved):
            raise ValueError(f"StoreConfig.nvme_paths names a directory twice: {self.nvme_paths!r}")
        object.__setattr__(self, "nvme_paths", resolved)

        _check_int("device_bytes", self.device_bytes, minimum=0)
        _check_int("host_bytes", self.host_bytes, minimum=0)
        if self.nvme_bytes is not None:
            _check_int("nvme_bytes", self.nvme_bytes, minimum=0)
        _check_int("block_size", self.block_size, minimum=ALIGNMENT)
        if self.block_size % ALIGNMENT:
            raise ValueError(f"StoreConfig.block_size must be a multiple of {ALIGNMENT}, got {self.block_size}")
        _check_int("queue_depth", self.queue_depth, minimum=1)
        _check_int("staging_buffers", self.staging_buffers, minimum=1)
        _check_int("io_threads", self.io_threads, minimum=1)
        _check_int("coalesce_bytes", self.coalesce_bytes, minimum=0)
        _check_int("cpu_threads", self.cpu_threads, minimum=1)
        _check_int("swap_files_per_dir", self.swap_files_per_dir, minimum=1)
        _check_int("result_pool_bytes", self.result_pool_bytes, minimum=0)
        _check_int("codec_cache_bytes", self.codec_cache_bytes, minimum=0)
        _check_int("swap_grow_bytes", self.swap_grow_bytes, minimum=ALIGNMENT)
        if self.swap_grow_bytes % ALIGNMENT:
            raise ValueError(
                f"StoreConfig.swap_grow_bytes must be a multiple of {ALIGNMENT}, got {self.swap_grow_bytes}"
            )
        for name in ("direct_io", "durable", "checksum", "compress", "flush_on_close", "prefault_host",
                     "allow_other_files"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"StoreConfig.{name} must be True or False, got {value!r}")
        if self.compress_policy not in COMPRESS_POLICIES:
            raise ValueError(
                f"StoreConfig.compress_policy must be one of {COMPRESS_POLICIES}, got {self.compress_policy!r}"
            )
        if self.device is not None and not isinstance(self.device, str):
            raise ValueError(f"StoreConfig.device must be a device string such as 'cuda:0', got {self.device!r}")

    def replace(self, **changes: object) -> "StoreConfig":
        """A copy with some fields changed (validated again). A new ``path`` takes the swap files with
        it when they were in the old one (``nvme_paths`` left to its default) and ``nvme_paths`` is
        not changed too: two stores never share a swap directory by accident."""
        if "path" in changes and "nvme_paths" not in changes and self.nvme_paths == (self.path,):
            changes["nvme_paths"] = None
        return dataclasses.replace(self, **changes)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"StoreConfig.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"StoreConfig.{name} must be >= {minimum}, got {value}")
