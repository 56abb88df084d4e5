"""engine.checkpoint_files: any element range of a parameter, from a checkpoint saved at any world
size. Checkpoints of 1-5 ranks are written here in the engine's format from known values (the
ranks' files, their CRC-32s and the metadata), so the oracle is the flattened value itself;
test_engine_distributed.py resumes real two-rank and one-process checkpoints across the change."""

from __future__ import annotations

import json
import math
import os
import tempfile

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.checkpoint_files import FORMAT, METADATA_FILE, VERSION, CheckpointFiles, rank_file, tensor_name
from engine.layout import ShardLayout
from engine.safetensors_stream import SafetensorsWriter, TensorSpec


def write_checkpoint(directory: str, params: dict[str, torch.Tensor], world: int) -> None:
    """The files ``eng.save_checkpoint`` writes for ``params`` at ``world`` ranks: each rank's
    shards of the flattened (memory order), zero-padded parameters, their masters (the values
    negated, so the two are told apart) and the metadata."""
    files, records = {}, []
    for name, value in params.items():
        layout = ShardLayout(tuple(value.shape), value.dtype, tuple(value.stride()), 0, world)
        records.append({"name": name, "names": [name], "shape": list(value.shape), "dtype": "float32",
                        "stride": list(value.stride()), "numel": layout.numel})
    for rank in range(world):
        shards = {}
        for name, value in params.items():
            layout = ShardLayout(tuple(value.shape), value.dtype, tuple(value.stride()), rank, world)
            flat = torch.zeros(layout.padded_numel)
            flat[:layout.numel] = layout.flat_view(value)
            shard = flat[layout.shard_offset:layout.shard_offset + layout.shard_numel]
            shards[tensor_name(name)] = shard.clone()
            shards[tensor_name(name, "master")] = -shard
        writer = SafetensorsWriter(os.path.join(directory, rank_file(rank)),
                                   [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in shards.items()])
        for spec in writer.order:
            writer.write(spec.name, shards[spec.name])
        writer.close()
        files[rank_file(rank)] = {"bytes": writer.nbytes, "crc32": writer.crc32}
    optimizer = {"step": 1, "shard_steps": {n: 1 for n in params}, "param_groups": [], "with_state": list(params)}
    metadata = {"format": FORMAT, "version": VERSION, "world_size": world, "params": records, "buffers": [],
                "optimizer": optimizer, "files": files}
    with open(os.path.join(directory, METADATA_FILE), "w", encoding="utf-8") as f:
        json.dump(metadata, f)


shapes = st.lists(st.integers(1, 7), min_size=1, max_size=3)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, saved_world=st.integers(1, 5), new_world=st.integers(1, 5), transposed=st.booleans())
def test_every_new_rank_reads_its_shard_from_the_saved_ones(shape, saved_world, new_world, transposed):
    value = torch.arange(1, math.prod(shape) + 1, dtype=torch.float32).reshape(shape)
    if transposed and value.dim() >= 2:
        value = value.transpose(0, 1)  # not row-major: shards follow the memory order
    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(directory, {"w": value}, saved_world)
        with CheckpointFiles(directory) as files:
            assert torch.equal(files.whole("w"), value) and files.whole("w").stride() == value.stride()
            assert torch.equal(files.whole("w", "master"), -value)
            for rank in range(new_world):
                layout = ShardLayout(tuple(value.shape), value.dtype, tuple(value.stride()), rank, new_world)
                want = torch.zeros(layout.padded_numel)
                want[:layout.numel] = layout.flat_view(value)
                want = want[layout.shard_offset:layout.shard_offset + layout.shard_numel]
                got = files.read_elements("w", layout.shard_offset, layout.shard_offset + layout.shard_numel)
                assert torch.equal(got, want), (rank, got, want)
                used = files.ranks_holding("w", layout.shard_offset, layout.shard_offset + layout.shard_numel)
                assert set(used) <= set(range(saved_world))
            if saved_world == new_world:  # a rank at the saved world size opens its own file only
                for rank in range(saved_world):
                    layout = ShardLayout(tuple(value.shape), value.dtype, tuple(value.stride()), rank, saved_world)
                    assert list(files.ranks_holding("w", layout.shard_offset,
                                                    layout.shard_offset + layout.shard_numel)) == [rank]
