"""Ratio and throughput of ``bplane-zstd`` on one tensor, for benchmarks (``tiered bench --compress``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import statistics
import time
from typing import Optional, Union

import torch

from tiered.codecs.bplane import FRAME_BYTES, BytePlaneCodec
from tiered.codecs.buffers import BufferPool
from tiered.io.spans import Span

Number = Union[int, float, str, None]


def measure_codec(
    tensor: torch.Tensor, *, repeats: int = 3, threads: int = 1, frame_bytes: int = FRAME_BYTES
) -> dict[str, Number]:
    """Compress and decompress ``tensor`` ``repeats`` times on ``threads`` worker threads.

    Returns (medians over the repeats; GB = 1e9 bytes of the original tensor):

    - ``ratio``: stored / original bytes (1.0 when the codec would store the tensor raw);
    - ``compress_gbps`` / ``decompress_gbps``: per second of wall time;
    - ``compress_gbps_per_core`` / ``decompress_gbps_per_core``: per CPU second of this process,
      so other load on the machine barely moves them;
    - ``nbytes``, ``stored_nbytes``, ``codec`` ("bplane-zstd" or "raw"), ``threads``.

    Decompression throughputs are None when the tensor is stored raw. Buffers are reused across
    repeats, as in a store. Raises RuntimeError if a round trip is not bit-exact.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    # A fresh loop on its own thread, so callers may be inside an event loop themselves.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiered-measure") as runner:
        return runner.submit(asyncio.run, _measure(data, tensor.dtype, repeats, threads, frame_bytes)).result()


async def _measure(
    data: torch.Tensor, dtype: torch.dtype, repeats: int, threads: int, frame_bytes: int
) -> dict[str, Number]:
    n = data.numel()
    buffers = BufferPool(4 * max(n, 1))
    out = torch.empty_like(data)
    out.zero_()  # first-touch faults belong to the caller's allocation, not to the codec
    enc_wall, enc_cpu, dec_wall, dec_cpu = [], [], [], []
    stored: Optional[int] = None
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tiered-codec") as pool:
        codec = BytePlaneCodec(pool, buffers, frame_bytes)
        try:
            for _ in range(repeats + 1):  # the first round warms buffers and thread state
                w0, c0 = time.perf_counter(), time.process_time()
                encoded = await codec.encode(data, dtype)
                w1, c1 = time.perf_counter(), time.process_time()
                enc_wall.append(w1 - w0)
                enc_cpu.append(c1 - c0)
                if encoded is None:
                    stored = n
                    continue
                try:
                    stored = encoded.nbytes
                    w0, c0 = time.perf_counter(), time.process_time()
                    await codec.decode(encoded.buffer.view[: encoded.nbytes], encoded.meta, [Span(out)] if n else [])
                    w1, c1 = time.perf_counter(), time.process_time()
                finally:
                    encoded.close()
                dec_wall.append(w1 - w0)
                dec_cpu.append(c1 - c0)
                if not torch.equal(out, data):
                    raise RuntimeError(f"bplane-zstd round trip of a {dtype} tensor of {n} bytes is not bit-exact")
        finally:
            buffers.close()

    def gbps(seconds: list[float]) -> Optional[float]:
        s = statistics.median(seconds[1:]) if len(seconds) > 1 else None
        return n / s / 1e9 if s else None

    raw = stored is None or stored >= n
    return {
        "ratio": (stored / n) if n and stored is not None else 1.0,
        "compress_gbps": gbps(enc_wall),
        "decompress_gbps": None if raw else gbps(dec_wall),
        "compress_gbps_per_core": gbps(enc_cpu),
        "decompress_gbps_per_core": None if raw else gbps(dec_cpu),
        "nbytes": n,
        "stored_nbytes": stored if stored is not None else n,
        "codec": "raw" if raw else BytePlaneCodec.name,
        "threads": threads,
    }
