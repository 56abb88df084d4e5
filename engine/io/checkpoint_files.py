"""A saved checkpoint directory opened for reading, at any world size.

Rank ``q`` of a checkpoint saved by ``W`` ranks holds elements ``[q * S, (q + 1) * S)`` of every
parameter flattened in memory order and padded to ``W * S`` (``S = ceil(numel / W)``, the
parameter's :class:`engine.paging.layout.ShardLayout` at that world size), and the optimizer's fp32
``master``, ``exp_avg`` and ``exp_avg_sq`` of the same elements. :meth:`CheckpointFiles.read_elements`
assembles any element range from the rank files that hold it, so a checkpoint loads at another
world size (each rank reads the old shards that overlap its new one) and a whole parameter can be
read back without any process group (:mod:`engine.checkpoint.offline_export`).

Only the rank files a range needs are opened: at the saved world size a rank reads its own file
only, so ranks on machines that do not share a filesystem each need just their own file. A saved
shard wholly inside the range is read whole and checked against its CRC-32; of one the range
covers in part, only the ``CRC_CHUNK_BYTES`` pieces holding that part are read, each checked
against its own CRC-32 (checkpoints written before those were recorded are read whole), so a
rank of a larger world reads about its share, not every shard it touches.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Optional

import torch

from engine.errors import CheckpointError, SafetensorsFormatError
from engine.io.safetensors_stream import SafetensorsReader, TensorSpec
from tiered.util import crc32

FORMAT = "tiered-engine-checkpoint"
VERSION = 1
METADATA_FILE = "metadata.json"
PARTIAL_SUFFIX = ".partial"
#: The optimizer state kept per parameter shard, in the order of ``engine.paging.layout.optim_keys``.
STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
#: Saves record a CRC-32 per this many bytes of each larger tensor, so a part can be read and checked alone.
CRC_CHUNK_BYTES = 8 << 20


def rank_file(rank: int) -> str:
    """The file name of ``rank``'s part of a checkpoint."""
    return f"rank{rank}.safetensors"


def tensor_name(param: str, state: Optional[str] = None) -> str:
    """The name in a rank file of ``param``'s shard (``state`` None) or of its optimizer ``state``."""
    if state is None:
        return "param/" + param
    assert state in STATE_NAMES, state
    return f"optim/{param}/{state}"


class CheckpointFiles:
    """The checkpoint in directory ``path``: its metadata (checked on open) and its rank files,
    each opened when first needed. Close it, or use it as a context manager."""

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.metadata: dict[str, Any] = read_metadata(self.path)
        self.world_size: int = self.metadata["world_size"]
        #: Parameter records by name: shape, dtype, stride, numel and every tied name (``names``).
        self.params: dict[str, dict[str, Any]] = {p["name"]: p for p in self.metadata["params"]}
        self._readers: dict[int, SafetensorsReader] = {}

    @property
    def optimizer(self) -> Optional[dict[str, Any]]:
        """The saved ``engine.AdamW`` record (step, shard steps, hyperparameters, ``with_state``), or None."""
        return self.metadata["optimizer"]

    def has_state(self, param: str) -> bool:
        """True when the checkpoint holds optimizer state (fp32 master weights, moments) for ``param``."""
        return self.optimizer is not None and param in self.optimizer["with_state"]

    @property
    def frozen_excluded(self) -> bool:
        """True when the save left out the frozen parameters (``exclude_frozen_parameters``, DeepSpeed's
        option too): :attr:`params` holds the trainable ones only, and a load keeps the model's own
        values for the others."""
        return bool(self.metadata.get("frozen_excluded"))

    @property
    def stepped(self) -> list[str]:
        """The parameters with optimizer state (those ``engine.AdamW`` has stepped)."""
        return [name for name in self.params if self.has_state(name)]

    def shard_numel(self, param: str) -> int:
        """Elements of each saved rank's shard of ``param`` (padding included)."""
        numel = _numel(self.params[param])
        return -(-numel // self.world_size)

    def ranks_holding(self, param: str, start: int, stop: int) -> range:
        """The saved ranks whose files :meth:`read_elements` reads for elements ``[start, stop)`` of ``param``."""
        size = self.shard_numel(param)
        if self._is_one_shard(size, start, stop):
            return range(start // size, start // size + 1)
        stop = min(stop, _numel(self.params[param]))  # the padding is not read
        if size == 0 or stop <= start:
            return range(0)
        return range(min(start // size, self.world_size), min(-(-stop // size), self.world_size))

    def _is_one_shard(self, size: int, start: int, stop: int) -> bool:
        return size > 0 and start % size == 0 and stop - start == size and stop <= size * self.world_size

    def reader(self, rank: int) -> SafetensorsReader:
        """Rank ``rank``'s file, opened on first use after checking it is the file the metadata describes."""
        reader = self._readers.get(rank)
        if reader is not None:
            return reader
        name = rank_file(rank)
        file = os.path.join(self.path, name)
        expected = self.metadata["files"].get(name)
        if not os.path.isfile(file):
            raise CheckpointError(
                f"the checkpoint has no file {name} (saved rank {rank} of {self.world_size}) in {self.path!r}; "
                "loading at another world size, or exporting, needs every rank's file in one directory"
            )
        if not isinstance(expected, dict) or os.path.getsize(file) != expected.get("bytes"):
            raise CheckpointError(f"{file!r} is not the file the checkpoint's metadata describes (its size differs)")
        try:
            reader = SafetensorsReader(file)
        except SafetensorsFormatError as exc:
            raise CheckpointError(f"{file!r} is damaged: {exc}") from exc
        self._readers[rank] = reader
        return reader

    def check_shards(self, param: str, state: Optional[str], dtype: torch.dtype, ranks: range) -> None:
        """CheckpointError unless the files of ``ranks`` hold ``param``'s shard (or its ``state``)
        as ``dtype`` with the saved shard size."""
        name, want = tensor_name(param, state), self.shard_numel(param)
        for rank in ranks:
            spec = self.spec(rank, name)
            if spec.dtype != dtype or spec.nbytes != want * dtype.itemsize:
                raise CheckpointError(
                    f"{self.reader(rank).path!r}: {name!r} is {spec.dtype} {spec.shape}, expected {dtype} ({want},)"
                )

    def spec(self, rank: int, name: str) -> TensorSpec:
        """Tensor ``name``'s dtype and shape in rank ``rank``'s file; CheckpointError if it has none."""
        reader = self.reader(rank)
        spec = reader.specs.get(name)
        if spec is None:
            raise CheckpointError(f"{reader.path!r} has no tensor {name!r}")
        return spec

    def read(self, rank: int, name: str) -> torch.Tensor:
        """Tensor ``name`` of rank ``rank``'s file, checked against the metadata's CRC-32."""
        reader = self.reader(rank)
        self.spec(rank, name)
        crcs = self.metadata["files"][rank_file(rank)].get("crc32", {})
        try:
            tensor = reader.read(name)
        except SafetensorsFormatError as exc:
            raise CheckpointError(f"{reader.path!r} is damaged: {exc}") from exc
        return read_checked(tensor, reader.path, name, crcs)

    def read_elements(self, param: str, start: int, stop: int, state: Optional[str] = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``param`` flattened in memory order (its shard, or its optimizer
        ``state`` when given), as a 1-D CPU tensor; elements past the parameter's end (padding) are
        zero, except in a range that is exactly one saved shard, which is returned as saved."""
        assert 0 <= start <= stop, (start, stop)
        size, numel, name = self.shard_numel(param), _numel(self.params[param]), tensor_name(param, state)
        if self._is_one_shard(size, start, stop):
            return self.read(start // size, name).reshape(-1)  # no copy
        dtype = torch.float32 if state is not None else dtype_of(self.params[param]["dtype"])
        out = torch.zeros(stop - start, dtype=dtype)
        holders = self.ranks_holding(param, start, stop)
        self.check_shards(param, state, dtype, holders)  # a part is viewed as dtype: the file must agree
        for rank in holders:
            lo, hi = max(start, rank * size), min(stop, numel, (rank + 1) * size)
            out[lo - start:hi - start] = self._read_part(rank, name, lo - rank * size, hi - rank * size, dtype)
        return out

    def _read_part(self, rank: int, name: str, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name`` in rank ``rank``'s file, checked: by the chunk
        CRC-32s covering them when the save recorded those, else by reading the tensor whole."""
        reader = self.reader(rank)  # checks the file against the metadata first
        info = self.metadata["files"][rank_file(rank)]
        chunks, step = info.get("chunk_crc32", {}).get(name), info.get("chunk_bytes")
        if not chunks or not isinstance(step, int) or step <= 0:
            return self.read(rank, name).reshape(-1)[lo:hi]
        nbytes = reader.specs[name].nbytes
        first, last = lo * dtype.itemsize // step, -(-hi * dtype.itemsize // step)
        begin, end = first * step, min(last * step, nbytes)
        if len(chunks) != -(-nbytes // step):
            raise CheckpointError(f"{reader.path!r}: the metadata has {len(chunks)} chunk CRC-32s for {name!r}")
        try:
            raw = reader.read_bytes(name, begin, end)
        except SafetensorsFormatError as exc:
            raise CheckpointError(f"{reader.path!r} is damaged: {exc}") from exc
        data = memoryview(raw.numpy())
        for index in range(first, last):
            at = index * step
            piece = data[at - begin:min(at + step, nbytes) - begin]
            got = crc32([piece], len(piece))
            if got != chunks[index]:
                raise CheckpointError(
                    f"{reader.path!r}: tensor {name!r} is damaged in bytes [{at}, {at + len(piece)}) (CRC-32 "
                    f"{got:#010x}, expected {chunks[index]:#010x})"
                )
        skip = lo * dtype.itemsize - begin
        return raw[skip:skip + (hi - lo) * dtype.itemsize].view(dtype)

    def whole(self, param: str, state: Optional[str] = None) -> torch.Tensor:
        """``param`` (or its optimizer ``state``) whole, with its saved shape and strides."""
        record = self.params[param]
        flat = self.read_elements(param, 0, _numel(record), state)
        return flat.as_strided(tuple(record["shape"]), tuple(record["stride"]), flat.storage_offset())

    def buffer(self, name: str, rank: int = 0) -> torch.Tensor:
        """Buffer ``name`` as saved by ``rank`` (every rank saves its buffers whole)."""
        return self.read(rank, "buffer/" + name)

    def close(self) -> None:
        """Close every rank file opened."""
        readers, self._readers = self._readers, {}
        for reader in readers.values():
            reader.close()

    def __enter__(self) -> "CheckpointFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class CheckpointSummary:
    """What a checkpoint holds, as the commands that write or read one report it."""

    params: int
    #: Parameters with optimizer state (fp32 master weights and moments).
    stepped: int
    world_size: int
    frozen_excluded: bool
    #: ``imported_from`` of an imported checkpoint (format, DeepSpeed's world size and steps), else None.
    imported_from: Optional[dict[str, Any]]


def summarize(path: "str | os.PathLike[str]") -> CheckpointSummary:
    """The :class:`CheckpointSummary` of the checkpoint at ``path`` (reads its metadata only)."""
    with CheckpointFiles(path) as files:
        return CheckpointSummary(len(files.params), len(files.stepped), files.world_size, files.frozen_excluded,
                                 files.metadata.get("imported_from"))


def deepspeed_model_file(path: "str | os.PathLike[str]", rank: int) -> str:
    """Where DeepSpeed's ZeRO-3 ``save_checkpoint`` puts data-parallel rank ``rank``'s model states
    in a tag directory (``engine.integrations.deepspeed.checkpoint_import`` imports such checkpoints)."""
    return os.path.join(path, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")


def deepspeed_zero12_model_file(path: "str | os.PathLike[str]") -> str:
    """Where DeepSpeed's ``save_checkpoint`` at ZeRO stage 0, 1 or 2 puts the model states (rank 0
    writes them alone: the whole module); at stages 1 and 2 each rank's optimizer states are beside it."""
    return os.path.join(path, "mp_rank_00_model_states.pt")


def jsonable(value: Any, what: str) -> Any:
    """``value`` as JSON can hold it (tuples as lists, one-element tensors as numbers), or a
    CheckpointError naming ``what`` for a value JSON cannot hold."""
    if isinstance(value, dict):
        return {str(k): jsonable(v, what) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, what) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"{what}: {value!r} ({type(value).__name__}) cannot be saved in the checkpoint's JSON")


def read_metadata(path: str) -> dict[str, Any]:
    """The checkpoint's ``metadata.json``, checked for the fields readers rely on."""
    file = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(file):
        hint = ""
        if os.path.isdir(path + PARTIAL_SUFFIX):
            hint = " (a save that did not finish leaves only a .partial directory)"
        elif os.path.isfile(deepspeed_model_file(path, 0)) or os.path.isfile(deepspeed_zero12_model_file(path)):
            hint = (": it is a DeepSpeed checkpoint; convert it once with `tiered import-deepspeed "
                    f"{path} OUT` (or engine.import_deepspeed_checkpoint) and load OUT")
        raise CheckpointError(f"{path!r} is not a checkpoint: it has no {METADATA_FILE}{hint}")
    try:
        with open(file, encoding="utf-8") as f:
            metadata = json.load(f)
    except ValueError as exc:
        raise CheckpointError(f"{file!r} is not valid JSON: {exc}") from exc
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CheckpointError(f"{file!r} is not the metadata of an engine checkpoint")
    if metadata.get("version") != VERSION:
        raise CheckpointError(
            f"{file!r} has checkpoint version {metadata.get('version')!r}; this engine reads version {VERSION}"
        )
    kinds = {"world_size": int, "params": list, "buffers": list, "files": dict, "optimizer": (dict, type(None))}
    for key, kind in kinds.items():
        if not isinstance(metadata.get(key), kind) or (key == "optimizer" and metadata[key] is not None and not all(
                k in metadata[key] for k in ("step", "shard_steps", "param_groups", "with_state"))):
            raise CheckpointError(f"{file!r} is malformed: {key!r} is missing or of the wrong type")
    if metadata["world_size"] < 1:
        raise CheckpointError(f"{file!r} is malformed: world_size {metadata['world_size']!r}")
    for entry, needs in [(p, {"name", "shape", "dtype", "stride"}) for p in metadata["params"]] + [
            (b, {"name", "shape", "dtype"}) for b in metadata["buffers"]]:
        if not isinstance(entry, dict) or not needs <= set(entry):
            raise CheckpointError(f"{file!r} is malformed: {entry!r} is not a parameter or buffer record")
    return metadata


def read_checked(tensor: torch.Tensor, path: str, name: str, crcs: Mapping[str, int]) -> torch.Tensor:
    """``tensor`` (read as ``name`` from ``path``) if its bytes match the CRC-32 in ``crcs``, else CheckpointError."""
    want = crcs.get(name)
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    got = crc32([data], len(data))
    if want is None or got != want:
        expected = f"{want:#010x}" if isinstance(want, int) else "none recorded"
        raise CheckpointError(f"{path!r}: tensor {name!r} is damaged (CRC-32 {got:#010x}, expected {expected})")
    return tensor


def _numel(record: Mapping[str, Any]) -> int:
    n = 1
    for d in record["shape"]:
        n *= int(d)
    return n


def dtype_str(dtype: torch.dtype) -> str:
    """How a checkpoint's metadata names ``dtype`` (``"float32"``, ...); :func:`dtype_of` reads it back."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a checkpoint's metadata calls ``name`` (``"float32"``, ``"bfloat16"``, ...)."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"the checkpoint names an unknown dtype {name!r}")
    return dtype


__all__ = [
    "CRC_CHUNK_BYTES", "CheckpointError", "CheckpointFiles", "CheckpointSummary", "FORMAT", "METADATA_FILE",
    "PARTIAL_SUFFIX", "STATE_NAMES", "VERSION", "deepspeed_model_file", "deepspeed_zero12_model_file", "dtype_of",
    "dtype_str", "jsonable", "read_checked", "read_metadata", "rank_file", "summarize", "tensor_name",
]
