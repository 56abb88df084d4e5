"""Engine bad input not covered elsewhere: a step before any backward, every call after close, a torch
optimizer over parameters that are not the model's.

Covered by other suites (each a test there): wrapping a wrapped model and a non-Module
(test_engine_lifecycle.py), a meta parameter without an initializer (test_engine_meta_init.py),
step() without an optimizer and resume=True on an empty directory (test_engine_training.py,
test_wrap_checks_the_optimizer_and_resume), unwrap twice (test_engine_lifecycle.py), loading the
checkpoint of another model (test_engine_checkpoint.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_models import TinyGPT, engine_config, gpt_tokens
from torch import nn

import engine
from engine.paging.layout import OPTIM_KEY_PREFIX

LR = 1e-2


def test_a_step_before_any_backward_changes_nothing(tmp_path):
    """As torch skips parameters without a gradient: no update, no optimizer state; training then
    goes on exactly as torch's."""
    torch.manual_seed(1)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    with engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=engine_config(tmp_path)) as eng:
        before = eng.state_dict()
        eng.step()
        ref_opt.step()
        after = eng.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert not any(k.startswith(OPTIM_KEY_PREFIX) for k in eng.store.keys())
        assert set(eng.optimizer.shard_steps.values()) <= {0}
        for step in range(2):
            losses = [m(gpt_tokens(seed=step)).float().pow(2).mean() for m in (model, ref)]
            assert losses[0].item() == losses[1].item()
            for loss in losses:
                loss.backward()
            eng.step()
            ref_opt.step()
            eng.zero_grad()
            ref_opt.zero_grad()


def test_every_call_after_close_is_refused(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    reference = copy.deepcopy(model)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=engine_config(tmp_path))
    eng.close()
    eng.close()  # idempotent
    for call in (eng.step, eng.zero_grad, eng.state_dict, eng.unwrap, lambda: eng.save_checkpoint(tmp_path / "c"),
                 lambda: eng.load_checkpoint(tmp_path / "c")):
        with pytest.raises(engine.EngineClosedError, match="wrap again"):
            call()
    with pytest.raises(RuntimeError, match="closed or unwrapped"):
        eng.optimizer.step()
    assert eng.closed and eng.stats().store is not None  # the last stats stay readable
    assert all(p.device.type == "meta" for p in model.parameters())  # closed: meta parameters, no hooks
    with pytest.raises(RuntimeError, match="meta"):
        model(torch.ones(1, 3))  # torch refuses (docs/engine.md, "Optimizers, state dicts, unwrap")
    config = engine_config(tmp_path).replace(resume=True)
    # The same model object (or a new one built on meta) takes up the store's contents and computes
    # what it did before close.
    with torch.device("meta"):
        new = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    for again_model in (model, new):
        with engine.wrap(again_model, optimizer=engine.AdamW(lr=LR), config=config) as again:
            assert torch.equal(again_model(torch.ones(1, 3)), reference(torch.ones(1, 3)))
            assert again.completed_steps == 0


def test_a_torch_optimizer_over_parameters_that_are_not_the_models(tmp_path):
    model, other = nn.Linear(3, 3), nn.Linear(3, 3)
    with pytest.raises(ValueError, match="none of the optimizer's 2 parameters"):
        engine.wrap(model, config=engine_config(tmp_path / "a"), optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    assert model.weight.untyped_storage().nbytes() == 36  # untouched

    # Some of the model's and an extra tensor: legal in torch, and each is updated as torch does.
    torch.manual_seed(2)
    model = nn.Linear(3, 3)
    extra = nn.Parameter(torch.ones(3))
    ref, ref_extra = copy.deepcopy(model), extra.detach().clone().requires_grad_()
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    ref_opt = torch.optim.SGD([*ref.parameters(), ref_extra], lr=0.1)
    with engine.wrap(model, config=engine_config(tmp_path / "b"), optimizer=opt) as eng:
        x = torch.randn(2, 3)
        (model(x) * extra).sum().backward()
        (ref(x) * ref_extra).sum().backward()
        eng.step()
        ref_opt.step()
        assert torch.equal(extra, ref_extra)
        assert torch.equal(model(x), ref(x))
