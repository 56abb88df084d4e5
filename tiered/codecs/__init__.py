"""Codecs for the bytes of nvme copies: ``bplane-zstd`` (written), ``zstd`` (read only), and the
policy that decides when compressing pays. docs/compression.md explains the format and numbers."""

from tiered.codecs.bplane import FRAME_BYTES, MIN_SAVING, BytePlaneCodec, plane_width
from tiered.codecs.buffers import BufferPool, Encoded
from tiered.codecs.measure import measure_codec
from tiered.codecs.policy import CompressionPolicy, Estimates
from tiered.codecs.registry import READABLE_CODECS, Codecs
from tiered.codecs.zstd import ZstdCodec

__all__ = [
    "FRAME_BYTES",
    "MIN_SAVING",
    "READABLE_CODECS",
    "BufferPool",
    "BytePlaneCodec",
    "Codecs",
    "CompressionPolicy",
    "Encoded",
    "Estimates",
    "ZstdCodec",
    "measure_codec",
    "plane_width",
]
