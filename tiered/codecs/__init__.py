"""Codecs for the bytes of nvme copies: ``bplane-zstd`` (written), ``zstd`` (read only), and the
policy that decides when compressing pays. docs/compression.md explains the format and numbers.

[Note: compressed copies]
Only an nvme copy is ever compressed; copies in memory hold the tensor's own bytes. Whether a write
to nvme compresses is decided when it happens (``Entry.compress``: True, False, or None for the
config's default, which :mod:`tiered.codecs.policy` applies). An encoding that would save less
than ``MIN_SAVING`` is not used and the copy is stored ``raw``. The CRCs cover the stored, encoded
bytes, and the record names the codec and its metadata, so entries of the earlier ``zstd``
codec still read. The codec does not overlap the I/O: a compressed write encodes the whole tensor
into an aligned buffer before writing it, and a compressed read reads the whole payload into a
buffer from the codec's pool before decoding it into the destination.
"""

from tiered.codecs.bplane import FRAME_BYTES, MIN_SAVING, BytePlaneCodec, plane_width
from tiered.codecs.buffers import BufferPool, Encoded
from tiered.codecs.measure import measure_codec
from tiered.codecs.policy import CompressionPolicy, Estimates, round_trip_seconds
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
    "round_trip_seconds",
]
