"""A LoRA model over a base on the meta device (engine.integrations.hf.peft): the base's weights come from its
save_pretrained files under PEFT's names, the adapters start as PEFT starts them. The oracle is the
same PEFT model built over the materialized base with torch.optim.AdamW: the same outputs at the
start (the base's, lora_B being zero) and the same losses and weights after training, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

import engine
from engine.integrations.hf.peft import base_name, lora_init, peft_base_weights
from engine_models import store_config

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

CONFIG = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
LR = 1e-3


def lora(**kw) -> LoraConfig:
    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_fc"], "lora_dropout": 0.0,
                         "fan_in_fan_out": True, **kw})


def tokens(i: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))


def test_base_names_drop_what_peft_inserts():
    wrapped = "base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"
    assert base_name(wrapped) == "transformer.h.0.attn.c_attn.weight"
    assert base_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert base_name("base_model.model.lm_head.original_module.weight") == "lm_head.weight"
    assert base_name("base_model.model.transformer.wte.weight") == "transformer.wte.weight"


def test_a_lora_model_over_a_meta_base_trains_as_peft_over_the_loaded_base(tmp_path):
    torch.manual_seed(0)
    base = GPT2LMHeadModel(CONFIG)
    base.save_pretrained(tmp_path / "base")
    with torch.no_grad():
        want_logits = base(tokens(0)).logits
    with torch.device("meta"):
        model = get_peft_model(GPT2LMHeadModel(CONFIG), lora())
    config = engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path), param_tier="nvme",
                                 optimizer_tier="nvme")
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.0), config=config,
                      state_dict=peft_base_weights(model, tmp_path / "base"), init_fn=lora_init(model))
    try:
        with torch.no_grad():
            assert torch.equal(model(tokens(0)).logits, want_logits)  # lora_B is zero: the model is its base
        adapter = eng.state_dict(exclude_frozen_parameters=True)
        assert len(adapter) == 8 and all("lora_" in name for name in adapter)
        for name, value in adapter.items():
            if "lora_B" in name:
                assert not value.any(), name
            else:  # Kaiming-uniform with a = sqrt(5), as nn.Linear and PEFT draw it: |w| <= 1/sqrt(fan_in)
                assert value.any() and value.abs().max() <= 1 / math.sqrt(value.shape[1]), name

        ref = get_peft_model(GPT2LMHeadModel.from_pretrained(tmp_path / "base"), lora())
        assert not ref.load_state_dict(adapter, strict=False).unexpected_keys  # the same start
        trainable = [p for p in ref.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
        for i in range(1, 4):
            loss = model(input_ids=tokens(i), labels=tokens(i)).loss
            loss.backward()
            eng.step()
            eng.zero_grad()
            ref_loss = ref(input_ids=tokens(i), labels=tokens(i)).loss
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
            assert loss.item() == ref_loss.item(), i
        got, want = eng.state_dict(), ref.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        eng.close()


def test_what_lora_init_cannot_reproduce_is_refused(tmp_path):
    with torch.device("meta"):
        gaussian = get_peft_model(GPT2LMHeadModel(CONFIG), lora(init_lora_weights="gaussian"))
    with pytest.raises(ValueError, match=r"init_lora_weights='gaussian'.*init_fn of your own"):
        lora_init(gaussian)
    with pytest.raises(TypeError, match="takes a PEFT model"):
        lora_init(GPT2LMHeadModel(CONFIG))


def test_tensors_the_peft_model_lacks_are_reported(tmp_path):
    torch.manual_seed(0)
    weights = dict(GPT2LMHeadModel(CONFIG).state_dict())
    weights["transformer.h.9.mlp.c_fc.weight"] = torch.zeros(2)  # a layer this model does not have
    with torch.device("meta"):
        model = get_peft_model(GPT2LMHeadModel(CONFIG), lora())
    config = engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path))
    with pytest.raises(ValueError, match=r"match no parameter.*transformer\.h\.9\.mlp\.c_fc\.weight"):
        engine.wrap(model, config=config, state_dict=peft_base_weights(model, weights), init_fn=lora_init(model))


def test_lora_over_a_moe_base_whose_checkpoint_transformers_5_converts(tmp_path):
    """A Mixtral base's checkpoint keeps one matrix per expert; the model fuses them (transformers
    5 converts on load). peft_base_weights converts for the base first: the LoRA model starts as
    its base, logits equal."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.conversion_mapping", reason="transformers < 5 converts no checkpoints")
    moe = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=100, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    base = transformers.MixtralForCausalLM(moe).eval()
    base.save_pretrained(tmp_path / "base")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = base(ids).logits
    with torch.device("meta"):
        model = get_peft_model(transformers.MixtralForCausalLM(moe), LoraConfig(r=4, target_modules=["q_proj"]))
    config = engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path))
    with engine.wrap(model, config=config, state_dict=peft_base_weights(model, tmp_path / "base"),
                     init_fn=lora_init(model)), torch.no_grad():
        model.eval()
        assert torch.equal(model(ids).logits, want)
