"""Write and read safetensors files one tensor at a time, so a file larger than memory streams.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length,
a JSON header mapping each tensor name to its dtype, shape and ``[begin, end)`` byte offsets in
the data section (plus an optional ``__metadata__`` of strings), padded with spaces to a multiple
of 8 bytes, then the data: every tensor's bytes, back to back, in offset order. The writer knows
every tensor's dtype and shape up front (from the store's entries), writes the header, then
appends each tensor as the caller produces it; the reader reads the header and then one tensor
at a time into fresh memory. Files written here load with ``safetensors.torch.load_file`` and
``safe_open``; the reader reads files written by the ``safetensors`` library too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import BinaryIO, Callable, Iterable, Mapping, Optional

import torch

from engine.errors import SafetensorsFormatError
from tiered import TransferError
from tiered.util import RangeReader, SequentialWriter, crc32

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in (("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}
#: Header bytes a reader accepts (the safetensors library's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000


#: Reads one tensor when called: what a writer is handed beside each :class:`TensorSpec`.
Reader = Callable[[], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, dtype and shape: all the header needs before its bytes exist."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return math.prod(self.shape) * self.dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (``F32``, ``BF16``, ...); ValueError for dtypes it lacks."""
    name = _NAMES.get(dtype)
    if name is None:
        raise ValueError(f"dtype {dtype} has no safetensors name; supported: {sorted(map(str, _NAMES))}")
    return name


def export_dtype(saved: torch.dtype, dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a tensor held as ``saved`` is exported in (``dtype``, when given, for floating
    tensors); ValueError now, before anything is written, for one safetensors has no name for."""
    target = dtype if dtype is not None and saved.is_floating_point else saved
    dtype_name(target)
    return target


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise SafetensorsFormatError(f"unknown safetensors dtype {name!r}")
    return dtype


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` (moved to the CPU and made contiguous if needed), without a copy
    when it already is both."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class SafetensorsWriter:
    """Writes one safetensors file: the header from ``specs`` at once, then each tensor in turn.

    ``specs`` are laid out largest item size first (so every tensor's offset is aligned to its
    item size, as the safetensors library lays them out); :attr:`order` is that order, and
    :meth:`write` must be called once per spec in it. :meth:`close` checks that every tensor was
    written, flushes and fsyncs. ``crc32`` maps each name to the CRC-32 of its bytes; with
    ``chunk_crc_bytes``, ``chunk_crc32`` maps each tensor larger than that to the CRC-32s of its
    consecutive ``chunk_crc_bytes`` pieces, so a reader of part of it can check just what it read.
    """

    def __init__(self, path: str, specs: Iterable[TensorSpec], metadata: Optional[Mapping[str, str]] = None,
                 *, chunk_crc_bytes: Optional[int] = None) -> None:
        specs = list(specs)
        names = [s.name for s in specs]
        if len(set(names)) != len(names) or "__metadata__" in names:
            raise ValueError(f"tensor names must be unique and not '__metadata__': {names}")
        self.order = self.order_of(specs)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for spec in self.order:
            header[spec.name] = {
                "dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % 8)
        self.path = path
        self.crc32: dict[str, int] = {}
        self.chunk_crc_bytes = chunk_crc_bytes
        self.chunk_crc32: dict[str, list[int]] = {}
        self.nbytes = 8 + len(raw) + offset
        self._next = 0
        # O_DIRECT: the page cache is slower. 0666 less the umask, as any tool's output: checkpoints and
        # exported weights are the user's files to share, unlike the store's own (0600).
        self._file = SequentialWriter(path, size_hint=self.nbytes, mode=0o666)
        try:
            self._file.write(struct.pack("<Q", len(raw)) + raw)
        except BaseException:
            self._file.abort()
            raise

    @staticmethod
    def order_of(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
        """The order a writer of ``specs`` lays them out (and :meth:`write` takes them) in: largest
        item size first, ties in the given order."""
        return sorted(specs, key=lambda s: -s.dtype.itemsize)  # sorted is stable

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor's bytes; ``name``, dtype and shape must match the next spec."""
        if self._next >= len(self.order):
            raise ValueError(f"{self.path}: every tensor was already written, got another one, {name!r}")
        spec = self.order[self._next]
        if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{self.path}: expected {spec.name!r} {spec.dtype} {spec.shape} next, got {name!r} {tensor.dtype} "
                f"{tuple(tensor.shape)}"
            )
        data = tensor_bytes(tensor)
        self.crc32[name] = crc32([data], len(data))
        step = self.chunk_crc_bytes
        if step is not None and len(data) > step:
            self.chunk_crc32[name] = [crc32([data[at:at + step]], min(step, len(data) - at))
                                      for at in range(0, len(data), step)]
        self._file.write(data)
        self._next += 1

    def close(self) -> None:
        """Check that every tensor was written, write out and fsync the file, close it."""
        if self._next != len(self.order):
            self._file.abort()
            missing = [s.name for s in self.order[self._next:]]
            raise ValueError(f"{self.path}: closed before these tensors were written: {missing}")
        assert self._file.nbytes == self.nbytes, (self._file.nbytes, self.nbytes)
        self._file.close()

    def abort(self) -> None:
        """Close the file without checks or errors (the caller removes it)."""
        self._file.abort()


class SafetensorsReader:
    """Reads a safetensors file's header at open, then tensors one at a time (``read``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: BinaryIO = open(path, "rb")  # noqa: SIM115 - closed in close()
        try:
            size = os.fstat(self._file.fileno()).st_size
            head = self._file.read(8)
            if len(head) != 8:
                raise SafetensorsFormatError(f"{path}: {size} bytes, too short for a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise SafetensorsFormatError(f"{path}: header length {length} does not fit the file ({size} bytes)")
            try:
                header = json.loads(self._file.read(length))
            except ValueError as exc:
                raise SafetensorsFormatError(f"{path}: the header is not JSON: {exc}") from exc
            if not isinstance(header, dict):
                raise SafetensorsFormatError(f"{path}: the header is not a JSON object")
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            self._data_start = 8 + length
            self.specs: dict[str, TensorSpec] = {}
            self._offsets: dict[str, tuple[int, int]] = {}
            end = 0
            for name, info in sorted(header.items(), key=lambda kv: _offsets_of(path, kv)):
                begin, stop = _offsets_of(path, (name, info))
                spec = TensorSpec(name, dtype_from_name(info.get("dtype")), tuple(int(d) for d in info.get("shape")))
                if begin != end or stop - begin != spec.nbytes:
                    raise SafetensorsFormatError(
                        f"{path}: tensor {name!r} has data_offsets [{begin}, {stop}), expected [{end}, "
                        f"{end + spec.nbytes})"
                    )
                end = stop
                self.specs[name] = spec
                self._offsets[name] = (begin, stop)
            if self._data_start + end != size:
                raise SafetensorsFormatError(
                    f"{path}: {size} bytes, but the header describes {self._data_start + end} (truncated or padded)"
                )
            self._ranges = RangeReader(path)  # tensors: O_DIRECT, parallel (a cold buffered read is slow)
        except BaseException:
            self._file.close()
            raise

    def read(self, name: str) -> torch.Tensor:
        """A new CPU tensor with ``name``'s data."""
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        begin, stop = self._offsets[name]
        raw = self._read(name, self._data_start + begin, stop - begin)
        if (self._data_start + begin) % spec.dtype.itemsize:
            raw = raw.clone()  # a file that does not align its tensors (not one written here or by safetensors)
        return raw.view(spec.dtype).reshape(spec.shape)

    def read_bytes(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Bytes ``[start, stop)`` of ``name``'s data, as a new uint8 tensor."""
        if name not in self.specs:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        begin, end = self._offsets[name]
        if not 0 <= start <= stop <= end - begin:
            raise ValueError(f"{self.path}: bytes [{start}, {stop}) are outside {name!r} ({end - begin} bytes)")
        return self._read(name, self._data_start + begin + start, stop - start)

    def _read(self, name: str, offset: int, length: int) -> torch.Tensor:
        try:
            return self._ranges.read(offset, length)
        except TransferError as exc:
            raise SafetensorsFormatError(f"{self.path}: reading {name!r} failed: {exc}") from exc

    def close(self) -> None:
        """Close the file."""
        self._file.close()
        self._ranges.close()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _offsets_of(path: str, item: tuple[str, object]) -> tuple[int, int]:
    name, info = item
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise SafetensorsFormatError(f"{path}: tensor {name!r} has no valid data_offsets in the header: {info!r}")
    begin, stop = offsets
    if not 0 <= begin <= stop:
        raise SafetensorsFormatError(f"{path}: tensor {name!r} has data_offsets {offsets}")
    return begin, stop
