"""When a put's nvme copy is compressed: explicit requests, the config default, and the "auto" rule.

- ``put(..., compress=True)``: capacity was asked for; always compress.
- ``put(..., compress=False)``: never.
- ``put(..., compress=None)``: the config's ``compress``. When that is True, ``compress_policy``
  decides: ``"always"`` compresses; ``"auto"`` compresses only when it makes a write plus a read
  faster, judged from throughputs measured on this store's own transfers:

      raw:        n / write + n / read
      compressed: n / encode + r * n / write + n / decode + r * n / read

  where ``r`` is the compressed/original ratio seen so far. Until the encode, ratio and write
  estimates exist it compresses, which is also how they get measured; a missing read or decode
  rate is taken equal to the write or encode rate.

Each estimate is total bytes over total seconds of recent transfers, older ones fading by
``exp(-bytes since / HORIZON_BYTES)``: weighting by bytes keeps small transfers, whose fixed
costs dominate their time, from dragging the rates down.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from tiered.config import COMPRESS_POLICIES

#: Bytes over which an old measurement's weight falls to 1/e.
HORIZON_BYTES = 512 * 1024 * 1024


@dataclasses.dataclass
class Estimates:
    """Recent throughputs in bytes per second (logical bytes for the codec, stored bytes for the
    disk) and the compressed/original ratio of encodes. None until first measured."""

    encode_bps: Optional[float] = None
    decode_bps: Optional[float] = None
    write_bps: Optional[float] = None
    read_bps: Optional[float] = None
    ratio: Optional[float] = None


def round_trip_seconds(nbytes: float, *, encode_bps: float, decode_bps: float, write_bps: float, read_bps: float,
                       ratio: float) -> tuple[float, float]:
    """Seconds to write ``nbytes`` to nvme and read them back, raw and compressed (the rule above):
    codec rates in original bytes per second, disk rates in stored bytes per second, ``ratio`` the
    compressed/original size. Returns ``(raw, compressed)``."""
    raw = nbytes * (1 / write_bps + 1 / read_bps)
    return raw, nbytes * (1 / encode_bps + 1 / decode_bps) + ratio * raw


class _Rate:
    """Decayed sums of an amount and of what it is measured against; their quotient is the rate."""

    def __init__(self) -> None:
        self.amount = 0.0
        self.per = 0.0

    def add(self, amount: float, per: float, weight_bytes: int) -> None:
        keep = math.exp(-weight_bytes / HORIZON_BYTES)
        self.amount = self.amount * keep + amount
        self.per = self.per * keep + per

    @property
    def value(self) -> Optional[float]:
        return self.amount / self.per if self.per > 0 else None


class CompressionPolicy:
    """Decides per write whether to compress, and keeps the estimates that the decision uses."""

    def __init__(self, default: bool, mode: str = "auto") -> None:
        if mode not in COMPRESS_POLICIES:
            raise ValueError(f"compress_policy must be one of {COMPRESS_POLICIES}, got {mode!r}")
        self.default = default
        self.mode = mode
        self._encode = _Rate()
        self._decode = _Rate()
        self._write = _Rate()
        self._read = _Rate()
        self._ratio = _Rate()
        #: Writes that asked for the default and were left raw because compressing would not pay.
        self.skipped = 0

    @property
    def estimates(self) -> Estimates:
        """The current estimates."""
        return Estimates(
            encode_bps=self._encode.value,
            decode_bps=self._decode.value,
            write_bps=self._write.value,
            read_bps=self._read.value,
            ratio=self._ratio.value,
        )

    def wants(self, requested: Optional[bool]) -> bool:
        """Whether to compress a write that asked for ``requested`` (None: the config default)."""
        if requested is not None:
            return requested
        if not self.default:
            return False
        if self.mode == "always" or self.pays():
            return True
        self.skipped += 1
        return False

    def pays(self) -> bool:
        """True when, by the estimates, compressing makes a write plus a read faster (or the
        encode, ratio or write estimate is still missing)."""
        e = self.estimates
        if e.encode_bps is None or e.ratio is None or e.write_bps is None:
            return True
        raw, compressed = round_trip_seconds(1.0, encode_bps=e.encode_bps, decode_bps=e.decode_bps or e.encode_bps,
                                             write_bps=e.write_bps, read_bps=e.read_bps or e.write_bps, ratio=e.ratio)
        return compressed < raw

    def observe_encode(self, nbytes: int, stored: int, seconds: float) -> None:
        """An encode of ``nbytes`` that left ``stored`` bytes to write and took ``seconds``.

        When the codec chose raw, pass ``stored == nbytes`` and ``seconds=0``: the ratio counts,
        but a sample-only pass says nothing about the codec's speed.
        """
        if nbytes > 0:
            self._ratio.add(stored, nbytes, nbytes)
            if seconds > 0:
                self._encode.add(nbytes, seconds, nbytes)

    def observe_decode(self, nbytes: int, seconds: float) -> None:
        """A decode producing ``nbytes`` in ``seconds``."""
        if nbytes > 0 and seconds > 0:
            self._decode.add(nbytes, seconds, nbytes)

    def observe_write(self, nbytes: int, seconds: float) -> None:
        """An nvme write of ``nbytes`` stored bytes in ``seconds``."""
        if nbytes > 0 and seconds > 0:
            self._write.add(nbytes, seconds, nbytes)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        """An nvme read of ``nbytes`` stored bytes in ``seconds``."""
        if nbytes > 0 and seconds > 0:
            self._read.add(nbytes, seconds, nbytes)
