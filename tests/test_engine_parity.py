"""Parity: outputs and gradients of a wrapped model equal the unwrapped model's exactly (fp32),
with parameters on the host and nvme tiers under budgets that force evictions."""

from __future__ import annotations

import copy

import pytest
import torch

from engine_models import (
    KiB,
    ConvNet,
    TinyGPT,
    assert_same_params,
    engine_config,
    gpt_tokens,
    images,
    param_bytes,
    train_parity,
)

TIERS = ["host", "nvme"]


def _check_paged(eng, tier: str, model) -> None:
    stats = eng.stats()
    assert stats.bytes_fetched["nvme"] > 0  # the budgets push parameters down to the swap files
    if tier == "host":
        assert stats.store.tiers[tier].evictions > 0
    assert stats.prefetch_hits > 0  # steps after the first follow the recorded order
    assert stats.rerecords == 0


@pytest.mark.parametrize("tier", TIERS)
def test_tiny_gpt(tmp_path, tier):
    torch.manual_seed(0)
    model = TinyGPT()
    config = engine_config(tmp_path, tier=tier, host_bytes=param_bytes(model) // 3 // (4 * KiB) * (4 * KiB))
    eng = train_parity(model, config, [gpt_tokens(seed=s) for s in range(3)])
    _check_paged(eng, tier, model)
    assert model.lm_head.weight is model.wte.weight
    eng.unwrap()


def test_tiny_gpt_device_tier(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    config = engine_config(tmp_path, tier="device", device_bytes=32 * KiB, host_bytes=32 * KiB)
    eng = train_parity(model, config, [gpt_tokens(seed=s) for s in range(2)])
    stats = eng.stats()
    assert stats.store.tiers["device"].evictions > 0 and stats.bytes_fetched["device"] > 0
    eng.unwrap()


@pytest.mark.parametrize("tier", TIERS)
def test_conv_net(tmp_path, tier):
    torch.manual_seed(0)
    model = ConvNet()
    config = engine_config(tmp_path, tier=tier, host_bytes=8 * KiB, prefetch_bytes=4 * KiB)
    eng = train_parity(model, config, [images(seed=s) for s in range(3)])
    _check_paged(eng, tier, model)
    eng.unwrap()
    assert model.features[1].running_mean.abs().sum() > 0  # batch norm statistics were updated


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _hf_parity(tmp_path, model, tier):
    config = engine_config(tmp_path, tier=tier, host_bytes=param_bytes(model) // 3 // (4 * KiB) * (4 * KiB))
    batches = [gpt_tokens(vocab=96, seed=s) for s in range(3)]
    eng = train_parity(
        model, config, batches,
        forward=lambda m, x: m(input_ids=x, labels=x),
        output=lambda out: out.logits,
        loss_fn=lambda out: out.loss,
    )
    _check_paged(eng, tier, model)
    return eng


@pytest.mark.parametrize("tier", TIERS)
def test_transformers_gpt2(tmp_path, tier):
    model = _gpt2()
    eng = _hf_parity(tmp_path, model, tier)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, one store entry
    assert len([k for k in eng.store.keys() if k.startswith("param/")]) == len(list(model.parameters()))
    eng.unwrap()


@pytest.mark.parametrize("tier", TIERS)
def test_transformers_llama(tmp_path, tier):
    model = _llama()
    eng = _hf_parity(tmp_path, model, tier)
    eng.unwrap()


def test_unwrap_returns_the_same_values(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    eng = train_parity(model, engine_config(tmp_path), [gpt_tokens()])
    assert eng.unwrap() is model
    assert_same_params(model, ref)


def test_channels_last_conv_net_keeps_its_layout(tmp_path):
    torch.manual_seed(0)
    model = ConvNet().to(memory_format=torch.channels_last)
    conv = model.features[0].weight
    strides = conv.stride()
    eng = train_parity(
        model, engine_config(tmp_path), [images(seed=s).to(memory_format=torch.channels_last) for s in range(2)]
    )
    assert conv.stride() == strides and not conv.is_contiguous()
    eng.unwrap()
