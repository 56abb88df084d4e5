"""A plain torch optimizer built on model.parameters() before wrap keeps working: its step fetches
the parameters and writes them back. N steps wrapped == unwrapped, bit-exact in fp32."""

from __future__ import annotations

import copy

import pytest
import torch

import engine
from engine_models import ConvNet, TinyGPT, assert_same_params, engine_config, gpt_tokens, images


def _optimizers(kind: str, model, ref):
    if kind == "sgd":
        return (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9))
    return (torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1))


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_steps_match_unwrapped_bit_exact(tmp_path, kind, tier):
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizers(kind, model, ref)
    eng = engine.wrap(model, config=engine_config(tmp_path, tier=tier, host_bytes=32 * 1024), optimizer=opt)
    for step in range(4):
        x = gpt_tokens(seed=step)
        loss, ref_loss = model(x).pow(2).mean(), ref(x).pow(2).mean()
        assert torch.equal(loss, ref_loss), step
        loss.backward(), ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        assert eng.stats().materialized_bytes == 0  # written back and released after the step
    assert eng.stats().writebacks == 4 * len(list(model.parameters()))
    assert eng.stats().rerecords == 0
    eng.unwrap()
    assert_same_params(model, ref)


def test_gradient_accumulation_and_a_frozen_layer(tmp_path):
    torch.manual_seed(0)
    model = ConvNet()
    model.features[0].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizers("adamw", model, ref)
    eng = engine.wrap(model, config=engine_config(tmp_path), optimizer=opt)
    for step in range(3):
        for micro in range(2):
            x = images(seed=10 * step + micro)
            model(x).sum().backward(), ref(x).sum().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    eng.unwrap()
    assert_same_params(model, ref)


def test_a_step_that_raises_leaves_the_stored_values(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng = engine.wrap(model, config=engine_config(tmp_path), optimizer=opt)
    model(torch.ones(1, 4)).sum().backward()

    def boom(_opt, _args, _kwargs):
        raise RuntimeError("boom")

    hook = opt.register_step_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    hook.remove()
    opt.zero_grad()
    eng.unwrap()  # the engine's holds from the failed step are dropped; the store kept the old values
    assert_same_params(model, ref)
