"""Whether ``compress_optimizer`` pays on this machine: the codec on its cores against its disk
(``tiered estimate --measure-codec``).

The rule is the one the store's ``compress_policy="auto"`` applies to each write
(tiered/codecs/policy.py): compressing pays when encoding, writing the smaller payload, reading it
back and decoding take less time than writing and reading the raw bytes. The codec is measured on
AdamW moments (three steps on random gradients) on the store's ``cpu_threads``, the disk by the
store's own O_DIRECT writes and reads of a scratch file under the swap-file directory, removed
afterwards.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
import time

import torch

from tiered import StoreConfig, TieredStore, measure_codec, round_trip_seconds
from tiered.util import format_bytes, nearest_existing_directory

MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class CodecVerdict:
    """The codec's and the disk's speeds on this machine, and what they make of a step's moments.

    Rates are bytes per second of original (logical) data for the codec and of stored bytes for the
    disk; ``ratio`` is compressed over original bytes on the sample.
    """

    encode_bps: float
    decode_bps: float
    ratio: float
    write_bps: float
    read_bps: float
    threads: int
    #: Both AdamW moments of one rank's trainable parameters: what a step writes and reads back.
    moment_bytes: int

    @property
    def raw_seconds(self) -> float:
        """Writing the moments and reading them back, raw."""
        return self._round_trip()[0]

    @property
    def compressed_seconds(self) -> float:
        """Encoding, writing, reading back and decoding the moments, compressed."""
        return self._round_trip()[1]

    def _round_trip(self) -> tuple[float, float]:
        return round_trip_seconds(self.moment_bytes, encode_bps=self.encode_bps, decode_bps=self.decode_bps,
                                  write_bps=self.write_bps, read_bps=self.read_bps, ratio=self.ratio)

    @property
    def pays(self) -> bool:
        """Whether compressing the moments makes a step's optimizer I/O faster on this machine."""
        return self.compressed_seconds < self.raw_seconds

    def render(self) -> str:
        """Two lines: what was measured, and the verdict."""
        gb = 1e9
        measured = (f"codec on {self.threads} thread(s): encode {self.encode_bps / gb:.2f} GB/s, decode "
                    f"{self.decode_bps / gb:.2f} GB/s, moments to {self.ratio:.2f} of their size; disk: write "
                    f"{self.write_bps / gb:.2f} GB/s, read {self.read_bps / gb:.2f} GB/s")
        saved = self.raw_seconds - self.compressed_seconds
        what = (f"a step's moments ({format_bytes(self.moment_bytes)}) take {self.raw_seconds:.1f} s to write and "
                f"read raw, {self.compressed_seconds:.1f} s compressed")
        if self.pays:
            verdict = f"compress_optimizer pays here: {what}, {saved:.1f} s less; turn it on"
        else:
            verdict = (f"compress_optimizer does not pay here: {what}, {-saved:.1f} s more; leave it off (the "
                       "default) unless the disk is short of room")
        return measured + "\n" + verdict


def measure_codec_verdict(directory: str, moment_bytes: int, store: StoreConfig, *, sample_bytes: int = 64 * MiB,
                          disk_bytes: int = 256 * MiB, repeats: int = 3) -> CodecVerdict:
    """Measure the codec and the disk under ``directory`` and judge ``compress_optimizer``.

    Args:
        directory: where the swap files would go (a scratch directory is made and removed under the
            nearest existing directory).
        moment_bytes: bytes of both AdamW moments of one rank's trainable parameters.
        store: the store's configuration (its ``cpu_threads``, ``direct_io``, ``block_size``).
        sample_bytes: bytes of each moment sample the codec is measured on.
        disk_bytes: bytes written and read per disk repeat.
        repeats: repeats of each measurement (medians are taken).

    Returns:
        The :class:`CodecVerdict`.

    Raises:
        ValueError: a size or ``repeats`` below 1, or ``moment_bytes`` below 0.
        OSError: the scratch directory cannot be made or written.
    """
    for name, value in (("sample_bytes", sample_bytes), ("disk_bytes", disk_bytes), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(moment_bytes, bool) or not isinstance(moment_bytes, int) or moment_bytes < 0:
        raise ValueError(f"moment_bytes must be an int >= 0, got {moment_bytes!r}")
    encode, decode, ratio = _measure_moments(sample_bytes, store.cpu_threads, repeats)
    write, read = _measure_disk(directory, store, disk_bytes, repeats)
    return CodecVerdict(encode, decode, ratio, write, read, store.cpu_threads, moment_bytes)


def _adamw_moments(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW's two moments after three steps on random gradients, ``nbytes`` each."""
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(nbytes // 4, generator=generator) * 0.02)
    optimizer = torch.optim.AdamW([param], lr=1e-4)
    for _ in range(3):
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
        optimizer.step()
    state = optimizer.state[param]
    return state["exp_avg"], state["exp_avg_sq"]


def _measure_moments(nbytes: int, threads: int, repeats: int) -> tuple[float, float, float]:
    """Encode and decode bytes per second and the ratio, over both moments."""
    figures = [measure_codec(m, repeats=repeats, threads=threads) for m in _adamw_moments(nbytes)]
    total = sum(int(f["nbytes"]) for f in figures)
    stored = sum(int(f["stored_nbytes"]) for f in figures)

    def rate(field: str) -> float:
        # Seconds add up over the two moments; a moment stored raw costs its encode but no decode.
        seconds = sum(int(f["nbytes"]) / (float(f[field]) * 1e9) for f in figures if f[field])
        return total / seconds if seconds > 0 else float("inf")

    return rate("compress_gbps"), rate("decompress_gbps"), stored / total if total else 1.0


def _measure_disk(directory: str, config: StoreConfig, nbytes: int, repeats: int) -> tuple[float, float]:
    """The store's write and read bytes per second to and from a scratch file under ``directory``."""
    scratch = tempfile.mkdtemp(prefix="tiered-codec-verdict-", dir=nearest_existing_directory(directory))
    try:
        probe = StoreConfig(path=scratch, host_bytes=0, direct_io=config.direct_io, block_size=config.block_size,
                            queue_depth=config.queue_depth, io_threads=config.io_threads)
        data = torch.randint(0, 2**31 - 1, (nbytes // 4,), dtype=torch.int32).view(torch.float32)
        out = torch.empty_like(data)
        writes, reads = [], []
        store = TieredStore.open(probe)
        try:
            for i in range(repeats + 1):  # the first round grows the swap file
                started = time.perf_counter()
                store.sync.put(f"probe/{i}", data, "nvme")
                writes.append(time.perf_counter() - started)
                started = time.perf_counter()
                store.sync.get(f"probe/{i}", out=out)
                reads.append(time.perf_counter() - started)
                store.sync.delete(f"probe/{i}")
        finally:
            store.sync.close()
        if not torch.equal(out.view(torch.int32), data.view(torch.int32)):
            raise OSError(f"the disk probe under {scratch} read back different bytes than it wrote")
        return nbytes / statistics.median(writes[1:]), nbytes / statistics.median(reads[1:])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def moment_bytes(model: torch.nn.Module, world_size: int) -> int:
    """Bytes of both fp32 AdamW moments of one rank's share of ``model``'s trainable parameters."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return 8 * -(-numel // max(1, world_size))


__all__ = ["CodecVerdict", "measure_codec_verdict", "moment_bytes"]
