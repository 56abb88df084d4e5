"""Hugging Face models on the engine: generate() on a wrapped model, and a sharded save_pretrained
directory (model.safetensors.index.json) loaded into a meta-device model, against the plain model."""

from __future__ import annotations

import contextlib
import copy
import json
import os

import pytest
import torch
from engine_models import engine_config

import engine

transformers = pytest.importorskip("transformers")
try:
    from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: F401
    HAS_CONVERSIONS = True
except ImportError:
    HAS_CONVERSIONS = False
#: transformers 5 renames and fuses some models' weights on load; before 5 there is nothing to convert.
needs_conversions = pytest.mark.skipif(not HAS_CONVERSIONS, reason="transformers < 5 converts no checkpoints")


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


def test_a_llama_model_on_the_meta_device_loads_and_generates(tmp_path):
    """accelerate's init_empty_weights keeps buffers real; torch.device("meta") does not, so a rotary
    embedding's inv_freq (computed in __init__, in no weights file) is on meta too. A module without
    reset_parameters gets the model's own _init_weights, which computes it (transformers 5)."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).eval()
    ref.save_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    assert model.model.rotary_emb.inv_freq.is_meta
    with engine.wrap(model, config=engine_config(tmp_path / "store"), state_dict=str(tmp_path / "hf")):
        assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
        ids = torch.tensor([[5, 6, 7, 8]])
        got = model.generate(ids, max_new_tokens=5, do_sample=False)
        assert torch.equal(got, ref.generate(ids, max_new_tokens=5, do_sample=False))


class _Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4), persistent=False)
        self.register_buffer("count", torch.zeros(4, dtype=torch.int64), persistent=False)


class _ModelWithInit(torch.nn.Module):
    """A Hugging Face-like root whose _init_weights sets _Counted's scale, and its count if asked."""

    def __init__(self, sets_count: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)  # has reset_parameters, which _init_weights leaves as it is
        self.counted = _Counted()
        self.sets_count = sets_count

    def _init_weights(self, module: torch.nn.Module) -> None:
        if not isinstance(module, _Counted):
            return
        module.scale.fill_(2.0)
        if self.sets_count:
            module.count.copy_(torch.arange(4))


def test_tensors_the_models_init_weights_leaves_unset_are_an_error(tmp_path):
    with torch.device("meta"):
        model = _ModelWithInit(sets_count=True)
    with engine.wrap(model, config=engine_config(tmp_path / "a")):
        assert model.counted.scale.tolist() == [2.0] * 4 and model.counted.count.tolist() == [0, 1, 2, 3]
    with torch.device("meta"):
        model = _ModelWithInit(sets_count=False)
    with pytest.raises(ValueError, match=r"the model's _init_weights left unset: \['counted.count'\]"):
        engine.wrap(model, config=engine_config(tmp_path / "b"))


def _hf_init_cases() -> dict[str, tuple[type, object]]:
    small = dict(vocab_size=512)
    return {
        # GPT-2's attention and MLP scale their child c_proj.weight by 1/sqrt(2 n_layer)
        "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, **small)),
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            **small)),
        # T5's attention sets q, k, v and o, each with its own scale: placing k touches q, already in the store
        "t5": (transformers.T5ForConditionalGeneration, transformers.T5Config(
            d_model=128, d_ff=256, num_layers=2, num_heads=4, d_kv=32, **small)),
    }


@pytest.mark.parametrize("arch", sorted(_hf_init_cases()))
def test_a_meta_hugging_face_model_starts_as_its_own_construction_initializes_it(tmp_path, arch):
    """Training from scratch on the meta device: every tensor takes the distribution transformers
    gives it (reset_parameters, then _init_weights children before parents). Before, wrap ran only
    reset_parameters where a module had one: embeddings N(0, 1) where transformers draws N(0, 0.02),
    Kaiming-uniform linears, GPT-2's c_proj unscaled."""
    cls, config = _hf_init_cases()[arch]
    torch.manual_seed(0)
    expected = cls(config).state_dict()
    with torch.device("meta"):
        model = cls(config)
    with engine.wrap(model, config=engine_config(tmp_path / "store")) as eng:
        got = eng.state_dict()
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        have = got[name]
        assert have.dtype == want.dtype and have.shape == want.shape, name
        if not want.is_floating_point() or want.numel() < 2 or want.std() == 0:
            assert torch.equal(have, want), name  # constants: norms' ones, zero biases, int buffers
            continue
        # random draws: the same distribution (the draws themselves come in another order)
        assert have.std().item() == pytest.approx(want.std().item(), rel=0.1 if want.numel() > 2000 else 0.4), name
        assert abs(have.mean().item() - want.mean().item()) < 0.05 + 3 * want.std().item() / want.numel() ** 0.5, name


class _ScaledEmbedding(torch.nn.Embedding):
    """As Gemma's: reset_parameters() initializes the weight, not the buffer beside it."""

    def __init__(self) -> None:
        super().__init__(10, 4)
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)


def test_a_buffer_reset_parameters_leaves_is_an_error_not_garbage(tmp_path):
    """Before, the buffer kept whatever the fresh memory held and the model computed with it."""
    with torch.device("meta"):
        model = torch.nn.Sequential(_ScaledEmbedding())
    with pytest.raises(ValueError, match=r"its reset_parameters\(\) left unset: \['0.scale'\]"):
        engine.wrap(model, config=engine_config(tmp_path / "a"))
    with torch.device("meta"):
        model = torch.nn.Sequential(_ScaledEmbedding())
    with pytest.raises(ValueError, match=r"init_fn left unset: \['0.weight'\]"):
        engine.wrap(model, config=engine_config(tmp_path / "b"), init_fn=lambda m: m.scale.fill_(2.0))
    with torch.device("meta"):
        model = torch.nn.Sequential(_ScaledEmbedding())

    def init(module: torch.nn.Module) -> None:
        module.reset_parameters()
        module.scale.fill_(2.0)

    with engine.wrap(model, config=engine_config(tmp_path / "c"), init_fn=init) as eng:
        assert eng.state_dict()["0.weight"].isfinite().all() and model[0].scale.item() == 2.0


def test_gemmas_scaled_embedding_gets_its_scale_from_the_model(tmp_path):
    """Gemma's embedding has reset_parameters (nn.Embedding's), which leaves its embed_scale buffer:
    the model's _init_weights sets it (the forward was silently wrong before)."""
    config = transformers.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=100)
    torch.manual_seed(0)
    ref = transformers.GemmaForCausalLM(config).eval()
    ref.save_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        model = transformers.GemmaForCausalLM(config).eval()
    with engine.wrap(model, config=engine_config(tmp_path / "store"), state_dict=str(tmp_path / "hf")), torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4]])
        assert torch.equal(model(ids).logits, ref(ids).logits)


def _converted_models() -> dict[str, tuple[object, str]]:
    """transformers 5 models whose weights it renames or fuses on load: their config, and a name
    only the checkpoint's (older) layout has."""
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    return {
        "gpt_neox": (transformers.GPTNeoXConfig(**small), "embed_out.weight"),  # the model's lm_head
        "mixtral": (transformers.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                               **small), "model.layers.1.block_sparse_moe.experts.3.w3.weight"),
    }


@needs_conversions
@pytest.mark.parametrize("name", ["gpt_neox", "mixtral"])
def test_checkpoints_in_the_layout_transformers_5_converts_load(tmp_path, name):
    """save_pretrained writes (and the Hub holds) the older layout; transformers 5's from_pretrained
    converts it (renames, per-expert matrices stacked into fused tensors), and so does wrap, reading
    each converted tensor's pieces when it is placed: the same logits, from one file and from shards."""
    config, old_name = _converted_models()[name]
    cls = transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    ref = cls.from_config(config).eval()
    ref.save_pretrained(tmp_path / "one")
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "one" / "model.safetensors"), "pt") as f:
        assert old_name in set(f.keys())  # the layout on disk is the old one
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # a fused tensor's pieces in several files
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    for source in ("one", "sharded"):
        with torch.device("meta"):
            model = cls.from_config(config).eval()
        with engine.wrap(model, config=engine_config(tmp_path / f"store-{source}"),
                         state_dict=str(tmp_path / source)), torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits), source


@needs_conversions
def test_a_tensor_no_conversion_maps_is_still_reported(tmp_path):
    config, _ = _converted_models()["mixtral"]
    ref = transformers.AutoModelForCausalLM.from_config(config)
    ref.save_pretrained(tmp_path / "hf")
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    save_file({**tensors, "model.layers.0.block_sparse_moe.stray.weight": torch.zeros(2)},
              tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"1 entries that match no parameter.*block_sparse_moe.stray.weight"):
        engine.wrap(model, config=engine_config(tmp_path / "store"), state_dict=str(tmp_path / "hf"))


def test_from_pretrained_gives_the_model_from_pretrained_gives(tmp_path):
    """engine.from_pretrained(dir): built on meta, filled from the files, in the checkpoint's dtype,
    in eval mode, with its generation config; generate() as transformers' own from_pretrained."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    saved.generation_config.max_new_tokens = 4
    saved.save_pretrained(tmp_path / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert ref.dtype == torch.bfloat16 and not ref.training
    with engine.from_pretrained(tmp_path / "hf", config=engine_config(tmp_path / "store")) as eng:
        model = eng.model
        assert isinstance(model, transformers.LlamaForCausalLM) and not model.training
        assert eng.state_dict()["lm_head.weight"].dtype == torch.bfloat16  # the checkpoint's, as from_pretrained
        assert model.generation_config.max_new_tokens == 4
        assert model.model.rotary_emb.inv_freq.dtype == ref.model.rotary_emb.inv_freq.dtype == torch.float32
        ids = torch.tensor([[5, 6, 7]])
        assert torch.equal(model.generate(ids, do_sample=False), ref.generate(ids, do_sample=False))
    with engine.from_pretrained(tmp_path / "hf", config=engine_config(tmp_path / "fp32"), dtype=torch.float32,
                                model_class=transformers.LlamaForCausalLM) as eng:
        assert eng.state_dict()["lm_head.weight"].dtype == torch.float32
    # transformers' older torch_dtype= and its attn_implementation=, as a from_pretrained call has them
    with engine.from_pretrained(tmp_path / "hf", config=engine_config(tmp_path / "eager"), torch_dtype=torch.float32,
                                attn_implementation="eager") as eng:
        assert eng.state_dict()["lm_head.weight"].dtype == torch.float32
        assert eng.model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="dtype must be"):
        engine.from_pretrained(tmp_path / "hf", config=engine_config(tmp_path / "x"), dtype=torch.int8)
    with pytest.raises(ValueError, match="not both"):
        engine.from_pretrained(tmp_path / "hf", config=engine_config(tmp_path / "x"), dtype=torch.float32,
                               torch_dtype=torch.float32)


def test_from_pretrained_names_a_missing_directory(tmp_path):
    """A path that does not exist is said to be one, not sent to the Hub as a malformed repo id."""
    for missing in (str(tmp_path / "no" / "such"), "./not-here", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            engine.from_pretrained(missing, config=engine_config(tmp_path / "store"))


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="torch_dtype is deprecated from 5")
def test_from_pretrained_never_reads_the_deprecated_torch_dtype(tmp_path):
    """A configuration without a saved dtype loads in fp32 without asking for ``torch_dtype``, which
    transformers 5 answers with a deprecation warning."""

    class Config(transformers.GPT2Config):
        @property
        def torch_dtype(self):
            raise AssertionError("torch_dtype was read")

    tiny_gpt2().save_pretrained(tmp_path / "hf")
    config = Config.from_pretrained(tmp_path / "hf")
    config.dtype = None
    with engine.from_pretrained(tmp_path / "hf", config=config, offload_folder=str(tmp_path / "store"),
                                model_class=transformers.GPT2LMHeadModel) as eng:
        assert eng.state_dict()["lm_head.weight"].dtype == torch.float32


def test_from_pretrained_fetches_a_hub_name_with_huggingface_hub(tmp_path, monkeypatch):
    """A name that is no directory goes to snapshot_download (configs and safetensors first; torch
    files only when the snapshot has no safetensors weights). The Hub itself is faked here."""
    ref = tiny_gpt2()
    save_torch_shards(ref, tmp_path / "snapshot", 1)  # an older model: pytorch_model.bin only
    (tmp_path / "configs").mkdir()
    ref.config.save_pretrained(tmp_path / "configs")  # what the first fetch, without *.bin, gets
    calls = []

    def snapshot_download(name, *, revision, allow_patterns, local_files_only, cache_dir, token):
        calls.append((name, revision, tuple(allow_patterns), local_files_only, cache_dir, token))
        return str(tmp_path / ("snapshot" if "*.bin" in allow_patterns else "configs"))

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with engine.from_pretrained("someone/tiny-gpt2", config=engine_config(tmp_path / "store"), revision="v1",
                                cache_dir=str(tmp_path / "cache"), token="hf_x") as eng:
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            assert torch.equal(eng.model(ids).logits, ref(ids).logits)
    assert [c[0] for c in calls] == ["someone/tiny-gpt2"] * 2 and calls[0][1] == "v1"
    assert all(c[4:] == (str(tmp_path / "cache"), "hf_x") for c in calls)
    assert "*.safetensors" in calls[0][2] and "*.bin" not in calls[0][2] and "*.bin" in calls[1][2]


@needs_conversions
@pytest.mark.parametrize("name", ["gpt_neox", "mixtral"])
def test_save_weights_writes_the_layout_save_pretrained_writes(tmp_path, name):
    """What transformers 5 fuses or renames in memory, eng.save_weights splits and renames back as
    save_pretrained does (the layout vLLM, transformers 4 and the Hub know): the same names, shapes
    and values as save_pretrained's file, in one file and across shards; from_pretrained reloads it."""
    from safetensors.torch import load_file

    config, old_name = _converted_models()[name]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    ref.save_pretrained(tmp_path / "hf")
    want = load_file(tmp_path / "hf" / "model.safetensors")
    with engine.from_pretrained(tmp_path / "hf", config=engine_config(tmp_path / "store")) as eng:
        eng.save_weights(tmp_path / "one")
        eng.save_weights(tmp_path / "sharded", max_shard_bytes=40_000)
    got = load_file(tmp_path / "one" / "model.safetensors")
    assert old_name in got and sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(want) and len(set(index["weight_map"].values())) > 2
    ref.config.save_pretrained(tmp_path / "sharded")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, ref(ids).logits)


@needs_conversions
def test_tiered_export_with_the_config_writes_save_pretrained_s_layout(tmp_path, capsys):
    """`tiered export CKPT OUT --hf-config DIR`: without the model's code at hand, the model its
    config describes (built on meta) gives the layout; OUT gets config.json and from_pretrained
    loads it, a Mixtral's experts written one by one as save_pretrained writes them."""
    from safetensors.torch import load_file

    from engine.cli import main as cli_main

    config, old_name = _converted_models()["mixtral"]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    ref.save_pretrained(tmp_path / "hf")
    with engine.from_pretrained(tmp_path / "hf", config=engine_config(tmp_path / "store")) as eng:
        eng.save_checkpoint(tmp_path / "ckpt")
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--hf-config", str(tmp_path / "hf")]) == 0
    assert "config.json" in capsys.readouterr().out
    got, want = load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert old_name in got and sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, ref(ids).logits)


def test_from_pretrained_takes_accelerates_big_model_arguments(tmp_path):
    """A call carried over from from_pretrained(device_map="auto", max_memory=..., offload_folder=...):
    the folder is the store, max_memory its budgets, "auto" the local compute device."""
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([[5, 6, 7]])
    no_gpu = contextlib.nullcontext() if torch.cuda.is_available() else pytest.warns(UserWarning, match=r"for \[0\]")
    with no_gpu:
        eng = engine.from_pretrained(tmp_path / "hf", device_map="auto", offload_folder=tmp_path / "offload",
                                     max_memory={0: "1GiB", "cpu": "64MiB", "disk": "2GB"}, low_cpu_mem_usage=True,
                                     torch_dtype=torch.float32)
    with eng:
        store = eng.config.store
        assert store.path == str(tmp_path / "offload") and os.path.isfile(tmp_path / "offload" / "manifest.sqlite")
        assert (store.host_bytes, store.nvme_bytes) == (64 << 20, 2 * 10**9)
        assert eng.config.compute_device == ("cuda:0" if torch.cuda.is_available() else "cpu")
        assert store.device_bytes == (1 << 30 if torch.cuda.is_available() else 0)  # no GPU: its entry unused
        assert torch.equal(eng.model.generate(ids, do_sample=False, max_new_tokens=4),
                           ref.generate(ids, do_sample=False, max_new_tokens=4))
    with pytest.raises(ValueError, match="needs config=engine.EngineConfig"):
        engine.from_pretrained(tmp_path / "hf", device_map="auto")
    with pytest.raises(ValueError, match="both name the store"):
        engine.from_pretrained(tmp_path / "hf", config=engine_config(tmp_path / "x"), offload_folder=tmp_path / "y")
    with pytest.raises(ValueError, match="spreads the model over cuda:0, cuda:1"):
        engine.from_pretrained(tmp_path / "hf", offload_folder=tmp_path / "z",
                               device_map={"transformer.h.0": 0, "transformer.h.1": 1, "lm_head": "disk"})
    with pytest.raises(ValueError, match=r"'20 gigs' is not a size"):
        engine.from_pretrained(tmp_path / "hf", offload_folder=tmp_path / "z", max_memory={"cpu": "20 gigs"})
    with pytest.raises(ValueError, match="unknown key 'mps:0'"):
        engine.from_pretrained(tmp_path / "hf", offload_folder=tmp_path / "z", max_memory={"mps:0": 1})


def test_accelerates_sizes_and_device_maps():
    from engine.integrations.hf.device_map import _compute_device, parse_size

    assert parse_size("20GiB") == 20 << 30 and parse_size("20GB") == 20 * 10**9 and parse_size("512mib") == 512 << 20
    assert parse_size(1000) == parse_size("1000") == 1000 and parse_size("1.5GiB") == 3 << 29
    for bad in (-1, True, "GiB", "10 XB", None):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
    assert _compute_device("auto", cuda_available=True) == "cuda:0"
    assert _compute_device("sequential", cuda_available=False) == "cpu"
    assert _compute_device("cpu", cuda_available=True) == "cpu" and _compute_device(1, cuda_available=True) == "cuda:1"
    assert _compute_device("cuda:1", cuda_available=True) == "cuda:1" and _compute_device(None, True) is None
    with pytest.raises(ValueError, match="neither one of"):
        _compute_device("everywhere", cuda_available=True)
    # A dict: its one accelerator ({"": 0}, infer_auto_device_map's maps), else the CPU; offloaded modules
    # ("cpu", "disk") are in the store like the rest.
    assert _compute_device({"": 0}, cuda_available=True) == "cuda:0"
    assert _compute_device({"": "cpu"}, cuda_available=True) == "cpu"
    assert _compute_device({"wte": 1, "h.0": "cuda:1", "h.1": "cpu", "lm_head": "disk"}, True) == "cuda:1"
    assert _compute_device({"h.0": torch.device("cuda", 2), "h.1": "disk"}, True) == "cuda:2"
    assert _compute_device({"h.0": "cpu", "h.1": "disk"}, cuda_available=True) == "cpu"
    with pytest.raises(ValueError, match=r"spreads the model over cuda:0, cuda:1"):
        _compute_device({"h.0": 0, "h.1": "cuda:1"}, cuda_available=True)
    with pytest.raises(ValueError, match=r"device_map\['h.1'\]='somewhere' is not a device"):
        _compute_device({"h.0": 0, "h.1": "somewhere"}, cuda_available=True)
    with pytest.raises(ValueError, match="names no device"):
        _compute_device({}, cuda_available=True)


def test_load_checkpoint_and_dispatch_as_accelerates_tutorial_writes_it(tmp_path):
    """accelerate's big-model inference snippet with engine. in front: an empty model, then
    load_checkpoint_and_dispatch(model, checkpoint=dir, device_map="auto", no_split_module_classes=...)."""
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # sharded
    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # where "auto" computes, and the oracle too
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").to(device)
    with torch.device("meta"):  # accelerate's init_empty_weights()
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plain = model
    model = engine.load_checkpoint_and_dispatch(model, checkpoint=tmp_path / "hf", device_map="auto",
                                                no_split_module_classes=["GPT2Block"], offload_folder=tmp_path / "off")
    ids = torch.tensor([[5, 6, 7]], device=device)
    with model, torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits) and torch.equal(plain(ids).logits, ref(ids).logits)
        # accelerate's returns the model, so the tutorial goes on with model.generate: the engine hands it on
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                           ref.generate(ids, max_new_tokens=4, do_sample=False))
        assert model.config.store.path == str(tmp_path / "off")  # the engine's own names come first
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with engine.load_checkpoint_and_dispatch(model, tmp_path / "hf", offload_folder=tmp_path / "bf16",
                                             dtype=torch.bfloat16) as eng:  # cast as the weights are placed
        assert eng.state_dict()["lm_head.weight"].dtype == torch.bfloat16
        assert torch.equal(eng.state_dict()["lm_head.weight"].cpu(), ref.lm_head.weight.to("cpu", torch.bfloat16))


def test_load_checkpoint_and_dispatch_refuses_a_weight_the_checkpoint_lacks_as_accelerate_does(tmp_path):
    """GPT-2 built under accelerate's init_empty_weights: transformers 5 leaves its output layer
    untied, and the checkpoint holds only the embedding it is tied to. accelerate's
    load_checkpoint_and_dispatch refuses it (a meta tensor left); so does the engine's, naming the
    weight before anything is loaded; initialize_missing_weights=True initializes it instead, with a
    warning. Tied first (model.tie_weights(), as accelerate asks), both give the same logits, bit for bit."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")

    def empty_model():
        with init_empty_weights():
            return transformers.AutoModelForCausalLM.from_config(config).eval()

    untied = empty_model()
    assert untied.lm_head.weight is not untied.transformer.wte.weight and untied.lm_head.weight.is_meta
    with pytest.raises(NotImplementedError, match="meta tensor"):
        load_checkpoint_and_dispatch(untied, tmp_path / "hf", device_map="auto")
    untied = empty_model()
    with pytest.raises(ValueError, match=r"not in .*: \['lm_head.weight'\].*initialize_missing_weights=True"):
        engine.load_checkpoint_and_dispatch(untied, tmp_path / "hf", device_map="auto", offload_folder=tmp_path / "a")
    assert all(p.is_meta for p in untied.parameters())  # refused before anything was loaded
    with pytest.warns(UserWarning, match=r"\['lm_head.weight'\]"):
        eng = engine.load_checkpoint_and_dispatch(untied, tmp_path / "hf", device_map="auto",
                                                  offload_folder=tmp_path / "b", initialize_missing_weights=True)
    with eng:
        weights = eng.state_dict()
        assert not torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])  # its own values

    ids = torch.tensor([[5, 17, 33, 2, 9]])
    ref = empty_model()
    ref.tie_weights()
    ref = load_checkpoint_and_dispatch(ref, tmp_path / "hf", device_map="auto")
    model = empty_model()
    model.tie_weights()
    with engine.load_checkpoint_and_dispatch(model, tmp_path / "hf", device_map="auto",
                                             offload_folder=tmp_path / "c"), torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_load_checkpoint_and_dispatch_with_dtype_keeps_the_buffers_accelerate_keeps(tmp_path):
    """dtype=torch.bfloat16 on a LLaMA checkpoint saved in fp32: the weights in bf16, and the model's
    own buffers (the rotary embedding's fp32 inv_freq, which the checkpoint does not hold) in their
    dtype, as accelerate's load_checkpoint_and_dispatch keeps them: the same logits, bit for bit."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")

    def empty_model():
        with init_empty_weights():
            return transformers.AutoModelForCausalLM.from_config(config).eval()

    ids = torch.tensor([[5, 17, 33, 2, 9]])
    ref = load_checkpoint_and_dispatch(empty_model(), tmp_path / "hf", device_map="auto", dtype=torch.bfloat16)
    model = empty_model()
    with engine.load_checkpoint_and_dispatch(model, tmp_path / "hf", device_map="auto", dtype=torch.bfloat16,
                                             offload_folder=tmp_path / "store") as eng, torch.no_grad():
        buffers = dict(model.named_buffers())
        assert buffers["model.rotary_emb.inv_freq"].dtype == torch.float32
        assert {n: b.dtype for n, b in buffers.items()} == {n: b.dtype for n, b in ref.named_buffers()}
        assert eng.state_dict()["lm_head.weight"].dtype == torch.bfloat16
        logits = model(ids).logits
        assert logits.dtype == torch.bfloat16 and torch.equal(logits, ref(ids).logits)


def test_from_pretrained_puts_a_new_head_on_a_base_checkpoint_as_transformers_does(tmp_path):
    """The fine-tuning start: ``from_pretrained(base, num_labels=3)`` into a classification model.
    The base's weights load under the head model's prefix, the new head is initialized as
    transformers initializes it and named in a warning, as transformers warns."""
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=100)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(tmp_path / "base")
    ref = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=3)
    with pytest.warns(UserWarning, match=r"2 parameters .* \['classifier.weight', 'classifier.bias'\]; train them"):
        eng = engine.from_pretrained(tmp_path / "base", model_class=transformers.BertForSequenceClassification,
                                     num_labels=3, config=engine_config(tmp_path / "store"))
    with eng:
        assert eng.model.config.num_labels == 3 and eng.model.num_labels == 3
        got, want = eng.state_dict(), ref.state_dict()
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want if k != "classifier.weight")
        assert got["classifier.weight"].shape == (3, 64) and torch.equal(got["classifier.bias"], torch.zeros(3))
        assert got["classifier.weight"].std().item() == pytest.approx(0.02, rel=0.4)  # N(0, 0.02), not Kaiming
    with pytest.raises(TypeError, match=r"neither its own nor settings of BertConfig: \['num_lables'\]"):
        engine.from_pretrained(tmp_path / "base", model_class=transformers.BertForSequenceClassification,
                               num_lables=3, config=engine_config(tmp_path / "typo"))


def test_from_pretrained_takes_transformers_config_argument_too(tmp_path):
    """transformers' ``from_pretrained(dir, config=AutoConfig...)``: the model's configuration, the
    store then named by offload_folder (accelerate's name); anything else is a TypeError."""
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                     vocab_size=100)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(tmp_path / "base")
    changed = transformers.BertConfig.from_pretrained(tmp_path / "base", num_labels=4)
    with pytest.warns(UserWarning, match="classifier.weight"), engine.from_pretrained(
            tmp_path / "base", model_class=transformers.BertForSequenceClassification, config=changed,
            offload_folder=tmp_path / "store") as eng:
        assert eng.model.num_labels == 4 and eng.state_dict()["classifier.bias"].shape == (4,)
    with pytest.raises(ValueError, match=r"config= is the model's configuration here \(a BertConfig\), so the store "
                                         r"needs offload_folder=DIR"):
        engine.from_pretrained(tmp_path / "base", config=changed)
    with pytest.raises(TypeError, match="config must be an engine.EngineConfig .* got dict"):
        engine.from_pretrained(tmp_path / "base", config={"store": str(tmp_path / "s")})
