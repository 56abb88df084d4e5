"""engine.io.checkpoint_files: any element range of a parameter, from a checkpoint saved at any world
size. Checkpoints of 1-5 ranks are written here in the engine's format from known values (the
ranks' files, their CRC-32s and the metadata), so the oracle is the flattened value itself;
test_engine_distributed.py resumes real two-rank and one-process checkpoints across the change."""

from __future__ import annotations

import json
import math
import os
import tempfile

from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.io.checkpoint_files import FORMAT, METADATA_FILE, VERSION, CheckpointFiles, rank_file, tensor_name
from engine.errors import CheckpointError
from engine.paging.layout import ShardLayout
from engine.io.safetensors_stream import SafetensorsWriter, TensorSpec


def write_checkpoint(directory: str, params: dict[str, torch.Tensor], world: int, chunk: Optional[int] = None) -> None:
    """The files ``eng.save_checkpoint`` writes for ``params`` at ``world`` ranks: each rank's
    shards of the flattened (memory order), zero-padded parameters, their masters (the values
    negated, so the two are told apart) and the metadata; with ``chunk``, a CRC-32 per ``chunk``
    bytes of each tensor (what a save records every CRC_CHUNK_BYTES), else none (older saves)."""
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
                                   [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in shards.items()],
                                   chunk_crc_bytes=chunk)
        for spec in writer.order:
            writer.write(spec.name, shards[spec.name])
        writer.close()
        files[rank_file(rank)] = {"bytes": writer.nbytes, "crc32": writer.crc32}
        if chunk is not None:
            files[rank_file(rank)].update(chunk_bytes=chunk, chunk_crc32=writer.chunk_crc32)
    optimizer = {"step": 1, "shard_steps": {n: 1 for n in params}, "param_groups": [], "with_state": list(params)}
    metadata = {"format": FORMAT, "version": VERSION, "world_size": world, "params": records, "buffers": [],
                "optimizer": optimizer, "files": files}
    with open(os.path.join(directory, METADATA_FILE), "w", encoding="utf-8") as f:
        json.dump(metadata, f)


shapes = st.lists(st.integers(1, 7), min_size=1, max_size=3)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, saved_world=st.integers(1, 5), new_world=st.integers(1, 5), transposed=st.booleans(),
       chunk=st.sampled_from([None, 8, 12, 20]))
def test_every_new_rank_reads_its_shard_from_the_saved_ones(shape, saved_world, new_world, transposed, chunk):
    value = torch.arange(1, math.prod(shape) + 1, dtype=torch.float32).reshape(shape)
    if transposed and value.dim() >= 2:
        value = value.transpose(0, 1)  # not row-major: shards follow the memory order
    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(directory, {"w": value}, saved_world, chunk)
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


def test_a_part_is_read_and_checked_by_its_own_chunks(tmp_path):
    """A rank of a larger world reads only the chunks holding its part of a saved shard, each
    checked alone: damage elsewhere in the shard does not stop it, damage in its part does."""
    value = torch.arange(40, dtype=torch.float32)
    write_checkpoint(str(tmp_path), {"w": value}, 1, chunk=16)  # 10 chunks of 4 elements
    data = tmp_path / rank_file(0)
    raw = bytearray(data.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    begin, _ = json.loads(raw[8:8 + header])["param/w"]["data_offsets"]
    raw[8 + header + begin + 30 * 4] ^= 0x01  # element 30, in chunk 7 (bytes [112, 128))
    data.write_bytes(bytes(raw))
    with CheckpointFiles(tmp_path) as files:
        assert torch.equal(files.read_elements("w", 0, 20), value[:20])  # new rank 0 of 2
        assert torch.equal(files.read_elements("w", 32, 40), value[32:])
        with pytest.raises(CheckpointError, match=r"'param/w' is damaged in bytes \[112, 128\)"):
            files.read_elements("w", 20, 40)  # new rank 1 of 2
        with pytest.raises(CheckpointError, match="damaged"):
            files.whole("w")


def test_a_save_records_chunk_crcs_of_its_large_tensors(tmp_path):
    import engine
    from engine.io.checkpoint_files import CRC_CHUNK_BYTES
    from engine_models import store_config

    model = torch.nn.Linear(1024, CRC_CHUNK_BYTES // 4096 + 1)  # a weight just over one chunk
    config = engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path, host_bytes=64 << 20),
                                 param_tier="nvme")
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-2), config=config)
    model(torch.randn(2, 1024)).sum().backward()
    eng.step()
    eng.save_checkpoint(tmp_path / "ckpt")
    weight = eng.state_dict()["weight"].reshape(-1)
    eng.close()
    info = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())["files"][rank_file(0)]
    assert info["chunk_bytes"] == CRC_CHUNK_BYTES
    assert sorted(info["chunk_crc32"]) == ["optim/weight/exp_avg", "optim/weight/exp_avg_sq", "optim/weight/master",
                                           "param/weight"]  # the bias is under one chunk: its CRC-32 suffices
    assert all(len(crcs) == 2 for crcs in info["chunk_crc32"].values())
    with CheckpointFiles(tmp_path / "ckpt") as files:
        tail = weight.numel() - 10
        assert torch.equal(files.read_elements("weight", tail, weight.numel()), weight[tail:])  # the 2nd chunk only
