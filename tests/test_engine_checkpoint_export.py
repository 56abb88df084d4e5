"""A checkpoint read without an engine (DeepSpeed's zero_to_fp32): engine.checkpoint_state_dict,
engine.export_checkpoint and ``tiered export``. The oracles are the engine's own consolidated
state dict and transformers' from_pretrained. Resharding across world sizes, where the same reader
serves load_checkpoint, is tested with two real ranks in test_engine_distributed.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import engine
import engine.cli
from engine.checkpoint.sharded import METADATA_FILE, rank_file
from engine.errors import CheckpointError
from engine.checkpoint.export import INDEX_FILE
from engine_models import TinyGPT, gpt_tokens, store_config

KiB = 1024
GPT2 = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)


def config(path, train_dtype=None) -> engine.EngineConfig:
    return engine.EngineConfig(host_budget="host_tier", store=store_config(path), param_tier="nvme",
                               optimizer_tier="nvme",
                               train_dtype=train_dtype, optimizer_group_bytes=8 * KiB, prefetch_bytes=16 * KiB)


def trained_checkpoint(tmp_path, model: nn.Module, train_dtype=None, steps: int = 2):
    """Train ``model`` a few AdamW steps, save a checkpoint; return it with the engine's state dict."""
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-2), config=config(tmp_path / "store", train_dtype))
    try:
        for step in range(steps):
            model(gpt_tokens(seed=step)).float().pow(2).mean().backward()
            eng.step()
            eng.zero_grad()
        eng.save_checkpoint(tmp_path / "ckpt")
        return tmp_path / "ckpt", eng.state_dict()
    finally:
        eng.close()


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_fp32_checkpoint_consolidates_to_the_engines_state_dict(tmp_path):
    torch.manual_seed(0)
    ckpt, want = trained_checkpoint(tmp_path, TinyGPT())
    got = engine.checkpoint_state_dict(ckpt)
    assert equal(got, want)  # fp32 training: the masters are the weights
    assert got["lm_head.weight"] is got["wte.weight"]  # tied, under both names
    assert equal(engine.checkpoint_state_dict(ckpt, master_weights=False), want)
    torch.manual_seed(1)
    TinyGPT().load_state_dict(got)  # strict: every key a plain model has, nothing else


def test_bf16_checkpoint_gives_the_fp32_master_weights(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    model.wpe.weight.requires_grad_(False)  # frozen: no optimizer state, comes out as trained
    ckpt, want = trained_checkpoint(tmp_path, model, train_dtype="bfloat16")
    assert equal(engine.checkpoint_state_dict(ckpt, master_weights=False), want)
    masters = engine.checkpoint_state_dict(ckpt)
    assert masters.keys() == want.keys()
    assert masters["wpe.weight"].dtype == torch.bfloat16 and torch.equal(masters["wpe.weight"], want["wpe.weight"])
    stepped = [k for k in want if k != "wpe.weight"]
    for name in stepped:
        assert masters[name].dtype == torch.float32
        assert torch.equal(masters[name].to(torch.bfloat16), want[name]), name  # the weights are the rounded masters
    assert any(not torch.equal(masters[k], want[k].float()) for k in stepped)  # and the masters hold more bits
    half = engine.checkpoint_state_dict(ckpt, dtype=torch.float16)
    assert all(v.dtype == torch.float16 and torch.equal(v, masters[k].half()) for k, v in half.items())


class _WithBuffers(nn.Module):
    """A persistent buffer and a non-persistent one (like Llama's rotary ``inv_freq``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))
        self.register_buffer("freq", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.scale)[..., :4] * self.freq


def test_non_persistent_buffers_stay_out_of_the_export(tmp_path):
    model = _WithBuffers()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-2), config=config(tmp_path / "store"))
    model(torch.randn(3, 8)).sum().backward()
    eng.step()
    eng.save_checkpoint(tmp_path / "ckpt")
    want = eng.state_dict()
    eng.close()
    got = engine.checkpoint_state_dict(tmp_path / "ckpt")
    assert equal(got, want) and "freq" not in got and "scale" in got
    _WithBuffers().load_state_dict(got)


def test_export_loads_with_from_pretrained(tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-3), config=config(tmp_path / "store"))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    eng.step()
    eng.save_checkpoint(tmp_path / "ckpt")
    want = eng.state_dict()
    eng.close()

    out = tmp_path / "hf"
    files = engine.export_checkpoint(tmp_path / "ckpt", out, max_shard_bytes=40_000)
    names = [os.path.basename(f) for f in files]
    assert names[-1] == INDEX_FILE and sorted(os.listdir(out)) == sorted(names)
    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map  # tied to transformer.wte.weight: written once
    GPT2.save_pretrained(out)
    loaded = GPT2LMHeadModel.from_pretrained(out).state_dict()
    assert equal(loaded, want)

    again = engine.export_checkpoint(tmp_path / "ckpt", out)  # a second export replaces the first
    assert [os.path.basename(f) for f in again] == ["model.safetensors"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_tiered_export_command(tmp_path, capsys):
    torch.manual_seed(0)
    ckpt, want = trained_checkpoint(tmp_path, TinyGPT())
    out = tmp_path / "out"
    assert engine.cli.main(["export", str(ckpt), str(out), "--dtype", "bfloat16", "--max-shard-size", "16KiB"]) == 0
    printed = capsys.readouterr().out
    assert "saved by 1 rank(s)" in printed and "fp32 master weights of" in printed and INDEX_FILE in printed
    got = {k: v for f in sorted(out.glob("model-*.safetensors")) for k, v in load_file(f).items()}
    assert got.keys() == want.keys() - {"lm_head.weight"}
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, want[k].bfloat16()) for k, v in got.items())

    assert engine.cli.main(["export", str(tmp_path / "nowhere"), str(out)]) == 1
    assert "is not a checkpoint" in capsys.readouterr().err


def test_damaged_or_incomplete_checkpoints_are_refused(tmp_path):
    torch.manual_seed(0)
    ckpt, _ = trained_checkpoint(tmp_path, TinyGPT())
    data = ckpt / rank_file(0)
    good = data.read_bytes()
    raw = bytearray(good)
    header_bytes = int.from_bytes(raw[:8], "little")
    begin, _ = json.loads(raw[8:8 + header_bytes])["optim/wte.weight/master"]["data_offsets"]
    raw[8 + header_bytes + begin + 5] ^= 0xFF  # one byte of a master weight the export reads
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="damaged"):
        engine.checkpoint_state_dict(ckpt)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="damaged"):
        engine.export_checkpoint(ckpt, out, max_shard_bytes=16 * KiB)
    assert os.listdir(out) == []  # no .partial file left

    data.write_bytes(good)
    meta_file = ckpt / METADATA_FILE
    meta_file.write_text(json.dumps(dict(json.loads(meta_file.read_text()), world_size=2)))
    with pytest.raises(CheckpointError, match=r"is torch.float32 \(2048,\), expected torch.float32 \(1024,\)"):
        engine.checkpoint_state_dict(ckpt)  # rank 0's shards are twice what two ranks would have saved
    data.rename(ckpt / "elsewhere")
    with pytest.raises(CheckpointError, match=r"no file rank0\.safetensors \(saved rank 0 of 2\)"):
        engine.checkpoint_state_dict(ckpt)
    with pytest.raises(TypeError, match="dtype"):
        engine.checkpoint_state_dict(ckpt, dtype=torch.int8)


def test_wrap_loads_a_checkpoint_directory_as_its_weights(tmp_path):
    """engine.wrap(state_dict=<checkpoint>) on a meta model: inference (or another run) straight from a
    training checkpoint, one tensor at a time, through dir/latest too."""
    torch.manual_seed(0)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-2), config=config(tmp_path / "store", "bfloat16"))
    model(gpt_tokens(seed=0)).float().pow(2).mean().backward()
    eng.step()
    eng.save_checkpoint(tmp_path / "ckpts", tag="step1")
    eng.close()
    masters = engine.checkpoint_state_dict(tmp_path / "ckpts")
    with torch.device("meta"):
        fresh = TinyGPT()
    with engine.wrap(fresh, config=engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path / "serve")),
                     state_dict=tmp_path / "ckpts") as served:
        got = served.state_dict()
    assert equal(got, masters)  # fp32 masters into the fp32 model, bit for bit
    with torch.device("meta"):
        other = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="match no parameter or buffer of the model"):  # another model's
        engine.wrap(other, config=engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path / "x")),
                    state_dict=tmp_path / "ckpts" / "step1")
