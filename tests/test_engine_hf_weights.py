"""Hugging Face models on the engine: generate() on a wrapped model, and a sharded save_pretrained
directory (model.safetensors.index.json) loaded into a meta-device model, against the plain model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from engine_models import engine_config

import engine

transformers = pytest.importorskip("transformers")


def tiny_gpt2() -> "transformers.GPT2LMHeadModel":
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_generate_on_a_wrapped_model_matches_the_plain_model(tmp_path):
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, config=engine_config(tmp_path))
    ids = torch.tensor([[5, 6, 7, 8]])
    got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, ref.generate(ids, max_new_tokens=6, do_sample=False))
    assert model.device == torch.device("cpu")  # what generate() places its tensors by
    eng.close()


def test_sharded_safetensors_directory_loads_into_a_meta_model(tmp_path):
    ref = tiny_gpt2()
    ref.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    for source in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors.index.json"):
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(ref.config).eval()
        eng = engine.wrap(model, config=engine_config(tmp_path / source.name), state_dict=str(source))
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)
        eng.close()


def test_a_broken_index_is_a_clear_error(tmp_path):
    ref = tiny_gpt2()
    ref.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(ref.config)
    with pytest.raises(ValueError, match="not a file next to it"):
        engine.wrap(model, config=engine_config(tmp_path), state_dict=str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="neither"):
        engine.wrap(model, config=engine_config(tmp_path / "x"), state_dict=str(tmp_path))


def save_torch_shards(model: torch.nn.Module, folder, shards: int) -> None:
    """A model directory as transformers 4 wrote it without safetensors: pytorch_model.bin, or
    pytorch_model-0000i-of-0000n.bin files and pytorch_model.bin.index.json."""
    folder.mkdir()
    model.config.save_pretrained(folder)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return
    names = list(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({n: state[n] for n in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 3])
def test_pytorch_model_bin_directories_load_into_a_meta_model(tmp_path, shards):
    """Older Hub models ship torch files rather than safetensors: the directory loads the same, the
    files memory-mapped (weights_only), and safetensors win where both are present."""
    ref = tiny_gpt2()
    save_torch_shards(ref, tmp_path / "hf", shards)
    ids = torch.tensor([[1, 2, 3]])
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(ref.config).eval()
    with engine.wrap(model, config=engine_config(tmp_path / "store"), state_dict=str(tmp_path / "hf")), torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)

    other = tiny_gpt2()
    torch.nn.init.zeros_(other.transformer.wte.weight)
    other.save_pretrained(tmp_path / "hf")  # model.safetensors beside the .bin files
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(ref.config).eval()
    with engine.wrap(model, config=engine_config(tmp_path / "store2"), state_dict=str(tmp_path / "hf")) as eng:
        assert not eng.state_dict()["transformer.wte.weight"].any()  # read from model.safetensors


def test_a_pickled_object_in_a_torch_file_is_refused(tmp_path):
    """weights_only: a .bin holding anything but tensors is not unpickled."""
    ref = tiny_gpt2()
    save_torch_shards(ref, tmp_path / "hf", 3)
    bad = {"transformer.wte.weight": torch.zeros(100, 32), "x": object()}
    torch.save(bad, tmp_path / "hf" / "pytorch_model-00001-of-00003.bin")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(ref.config)
    with pytest.raises(Exception, match="[Ww]eights only load failed|weights_only"):
        engine.wrap(model, config=engine_config(tmp_path / "store"), state_dict=str(tmp_path / "hf"))
