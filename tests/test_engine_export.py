"""eng.save_weights: the model's weights in Hugging Face's safetensors layout, streamed one
parameter at a time. The oracles are transformers' own from_pretrained and the model's values
before wrap."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file
from small_filesystems import fill
from transformers import GPT2Config, GPT2LMHeadModel

import engine
from engine.checkpoint.export import INDEX_FILE, SINGLE_FILE
from engine_models import TinyGPT, engine_config

CONFIG = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)


def wrapped_gpt2(tmp_path) -> tuple[GPT2LMHeadModel, dict[str, torch.Tensor], engine.Engine]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    return model, values, engine.wrap(model, config=engine_config(tmp_path))


def test_sharded_weights_load_with_from_pretrained_and_with_wrap(tmp_path):
    model, values, eng = wrapped_gpt2(tmp_path)
    out = tmp_path / "export"
    try:
        files = eng.save_weights(out, max_shard_bytes=40_000)
    finally:
        eng.close()
    names = [os.path.basename(f) for f in files]
    assert names[-1] == INDEX_FILE and len(names) > 3
    assert names[:-1] == [f"model-{i:05d}-of-{len(names) - 1:05d}.safetensors" for i in range(1, len(names))]
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(names[:-1])
    assert "lm_head.weight" not in index["weight_map"]  # tied to transformer.wte.weight: written once
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for k, v in values.items() if k in index["weight_map"]
    )
    for name in names[:-1]:  # each shard within the bound, unless one tensor alone exceeds it
        tensors = load_file(out / name)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 40_000

    CONFIG.save_pretrained(out)
    loaded = GPT2LMHeadModel.from_pretrained(out).state_dict()
    assert loaded.keys() == values.keys()
    assert all(torch.equal(loaded[k], v) for k, v in values.items())

    with torch.device("meta"):
        again = GPT2LMHeadModel(CONFIG)
    eng = engine.wrap(again, config=engine_config(tmp_path / "again"), state_dict=str(out))
    try:
        assert all(torch.equal(v, values[k]) for k, v in eng.state_dict().items())
    finally:
        eng.close()


def test_exported_files_are_the_users_to_share(tmp_path):
    """Exported weights get 0666 less the umask, as any tool's output; the store's own files stay 0600."""
    _, _, eng = wrapped_gpt2(tmp_path)  # its store in tmp_path/store
    old = os.umask(0o022)
    try:
        files = eng.save_weights(tmp_path / "export")
    finally:
        os.umask(old)
        eng.close()
    assert files and all(stat.S_IMODE(os.stat(f).st_mode) == 0o644 for f in files)
    assert stat.S_IMODE(os.stat(tmp_path / "store" / "swap-00.bin").st_mode) == 0o600


def test_a_later_save_replaces_the_earlier_one_whatever_its_sharding(tmp_path):
    _, values, eng = wrapped_gpt2(tmp_path)
    out = tmp_path / "export"
    try:
        eng.save_weights(out, max_shard_bytes=40_000)
        assert [os.path.basename(f) for f in eng.save_weights(out)] == [SINGLE_FILE]
        assert sorted(os.listdir(out)) == [SINGLE_FILE]  # the shards and index of the first save are gone
        eng.save_weights(out, max_shard_bytes=100_000)
        assert SINGLE_FILE not in os.listdir(out) and INDEX_FILE in os.listdir(out)
        assert not [f for f in os.listdir(out) if f.endswith(".partial")]
    finally:
        eng.close()


def test_dtype_casts_floating_tensors(tmp_path):
    _, values, eng = wrapped_gpt2(tmp_path)
    try:
        eng.save_weights(tmp_path / "bf16", dtype=torch.bfloat16)
    finally:
        eng.close()
    tensors = load_file(tmp_path / "bf16" / SINGLE_FILE)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert all(torch.equal(t, values[k].to(torch.bfloat16)) for k, t in tensors.items())


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    model = TinyGPT()
    eng = engine.wrap(model, config=engine_config(tmp_path))
    try:
        with pytest.raises(ValueError, match="max_shard_bytes must be an int >= 1, got 0"):
            eng.save_weights(tmp_path / "out", max_shard_bytes=0)
        with pytest.raises(TypeError, match="floating torch.dtype"):
            eng.save_weights(tmp_path / "out", dtype=torch.int8)
        (tmp_path / "file").write_text("x")
        with pytest.raises(FileExistsError):
            eng.save_weights(tmp_path / "file")
        assert not (tmp_path / "out").exists()
    finally:
        eng.close()



def test_a_full_disk_keeps_the_previous_save_and_leaves_no_partial_files(tmp_path, small_tmpfs):
    _, values, eng = wrapped_gpt2(tmp_path)
    out = os.path.join(small_tmpfs, "export")
    try:
        eng.save_weights(out)  # ~0.5 MB
        filler = fill(small_tmpfs)
        with pytest.raises(OSError):
            eng.save_weights(out, max_shard_bytes=100_000)
        assert sorted(os.listdir(out)) == [SINGLE_FILE]  # nothing half-written left beside it
        os.unlink(filler)
        tensors = load_file(os.path.join(out, SINGLE_FILE))
        assert all(torch.equal(t, values[k]) for k, t in tensors.items())
        eng.save_weights(out, max_shard_bytes=100_000)  # with room again, it works
    finally:
        eng.close()


def test_non_tensor_state_is_named(tmp_path):
    class WithExtraState(torch.nn.Linear):
        def get_extra_state(self):
            return {"version": 2}

        def set_extra_state(self, state):
            pass

    eng = engine.wrap(torch.nn.Sequential(WithExtraState(4, 4)), config=engine_config(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"not tensors: \['0._extra_state'\]"):
            eng.save_weights(tmp_path / "out")
    finally:
        eng.close()
