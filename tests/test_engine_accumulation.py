"""Gradient accumulation counted by the engine (EngineConfig.gradient_accumulation_steps): the
DeepSpeed loop, eng.backward + eng.step after every micro-batch, trains exactly as plain torch
does with the loss divided by N and a step every N micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch

import engine
from engine.config import LossScaling
from engine_models import TinyGPT
from test_engine_loss_scaling import INITIAL, GROWTH, Reference
from test_engine_training import LR, assert_trained_equal, gpt_loss, training_config

N = 3  # not a power of two: loss / 3 rounds, so the division must be the same one torch's loop does


def deepspeed_loop(eng: engine.Engine, model: torch.nn.Module, micro_batches: int, scheduler=None) -> list[bool]:
    """The loop a DeepSpeed user writes: backward and step after every micro-batch, no zero_grad."""
    stepped = []
    for i in range(micro_batches):
        eng.backward(gpt_loss(model, i))
        stepped.append(eng.step())
        if stepped[-1] and scheduler is not None:
            scheduler.step()
    return stepped


def torch_loop(ref: torch.nn.Module, opt: torch.optim.Optimizer, micro_batches: int, scheduler=None,
               max_grad_norm=None) -> None:
    """The same training in plain torch: loss / N, a step and zero_grad every N micro-batches."""
    for i in range(micro_batches):
        (gpt_loss(ref, i) / N).backward()
        if (i + 1) % N == 0:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
            opt.step()
            opt.zero_grad()
            if scheduler is not None:
                scheduler.step()


@pytest.mark.parametrize("grad_tier", ["host", "nvme"])
def test_deepspeed_loop_equals_torch_with_engine_adamw(tmp_path, grad_tier):
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    opt = engine.AdamW(lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    config = training_config(tmp_path, grad_tier=grad_tier, max_grad_norm=0.5).replace(gradient_accumulation_steps=N)
    eng = engine.wrap(model, optimizer=opt, config=config)
    try:
        stepped = deepspeed_loop(eng, model, 4 * N + 1, sched)
        torch_loop(ref, ref_opt, 4 * N + 1, ref_sched, max_grad_norm=0.5)
        assert stepped == [(i + 1) % N == 0 for i in range(4 * N + 1)]
        assert eng.completed_steps == 4 and eng.optimizer.param_groups[0]["lr"] == LR / 5
        assert eng.is_gradient_accumulation_boundary() is False  # one micro-batch into the fifth window
        # The open window keeps accumulating across these calls: nothing is dropped between them.
        eng.backward(gpt_loss(model, 4 * N + 1))
        assert eng.step() is False and eng.is_gradient_accumulation_boundary() is True
        eng.backward(gpt_loss(model, 4 * N + 2))
        assert eng.step() is True and eng.completed_steps == 5
        for i in range(4 * N + 1, 5 * N):
            (gpt_loss(ref, i) / N).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        assert not [k for k in eng.store.keys() if k.startswith("grad/")]  # zeroed at the boundary
    except BaseException:
        eng.close()
        raise
    assert_trained_equal(model, eng, ref)


def test_deepspeed_loop_equals_torch_with_a_torch_optimizer(tmp_path):
    torch.manual_seed(1)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    eng = engine.wrap(model, optimizer=opt, config=training_config(tmp_path).replace(gradient_accumulation_steps=N))
    try:
        assert deepspeed_loop(eng, model, 3 * N).count(True) == 3
        torch_loop(ref, ref_opt, 3 * N)
        assert all(p.grad is None for p in model.parameters())  # zeroed after the last boundary
    except BaseException:
        eng.close()
        raise
    assert_trained_equal(model, eng, ref)


def test_fp16_loss_scaling_divides_then_scales(tmp_path):
    """Under loss scaling the loss is divided by N, then scaled: GradScaler over (loss / N)."""
    torch.manual_seed(2)
    model = TinyGPT()
    ref = Reference(model)
    config = training_config(tmp_path, train_dtype="float16").replace(
        loss_scaling=LossScaling(initial_scale=INITIAL, growth_interval=GROWTH, hysteresis=1),
        gradient_accumulation_steps=2,
    )
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1), config=config)
    try:
        scales, applied = [], []
        for window in range(6):
            for m in range(2):
                eng.backward(gpt_loss(model, 2 * window + m))
                assert eng.is_gradient_accumulation_boundary() is (m == 1)
                stepped = eng.step()
                assert not stepped or m == 1
            applied.append(stepped)  # the window's last call: False when the overflow skipped its step
            scales.append(eng.loss_scale)
        for window in range(6):
            for m in range(2):
                loss = gpt_loss(ref.model, 2 * window + m) / 2
                ref.scaler.scale(loss).backward()
                for master, p in zip(ref.masters, ref.model.parameters()):  # the engine sums in fp32
                    master.grad = p.grad.float() if master.grad is None else master.grad + p.grad.float()
                    p.grad = None
            scale = ref.scaler.get_scale()
            ref.scaler.step(ref.opt)
            ref.scaler.update()
            assert applied[window] is (ref.scaler.get_scale() >= scale), window  # a skip halves the scale
            ref.opt.zero_grad()
            with torch.no_grad():
                for master, p in zip(ref.masters, ref.model.parameters()):
                    p.copy_(master)
            assert scales[window] == ref.scaler.get_scale(), window
        assert eng.stats().skipped_steps > 0  # the scale started high enough to overflow
        ref.assert_masters_equal(eng)
    finally:
        eng.close()


def test_a_plain_loss_backward_is_refused(tmp_path):
    model = TinyGPT()
    config = training_config(tmp_path).replace(gradient_accumulation_steps=2)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config)
    try:
        with pytest.raises(RuntimeError, match=r"gradient_accumulation_steps=2, so call eng\.backward\(loss\)"):
            gpt_loss(model, 0).backward()
        eng.zero_grad()  # the window has not started: allowed, and the engine stays usable
        assert deepspeed_loop(eng, model, 4) == [False, True, False, True]
        assert eng.completed_steps == 2
    finally:
        eng.close()


def test_zero_grad_inside_a_window_is_refused(tmp_path):
    model = TinyGPT()
    config = training_config(tmp_path).replace(gradient_accumulation_steps=N)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config)
    try:
        eng.zero_grad()  # before any micro-batch: nothing to lose
        eng.backward(gpt_loss(model, 0))
        assert eng.step() is False
        with pytest.raises(RuntimeError, match=f"after 1 of {N} micro-batches would drop"):
            eng.zero_grad()
        assert [k for k in eng.store.keys() if k.startswith("grad/")]  # the refused call kept them
    finally:
        eng.close()


def test_without_accumulation_every_step_steps_and_keeps_zero_grad_to_the_loop(tmp_path):
    model = TinyGPT()
    # the step after backward, which keeps the gradients it used until zero_grad
    config = training_config(tmp_path).replace(step_in_backward=False)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config)
    try:
        for i in range(2):
            assert eng.is_gradient_accumulation_boundary() is True
            gpt_loss(model, i).backward()  # a plain backward is fine at N = 1
            assert eng.step() is True
            assert [k for k in eng.store.keys() if k.startswith("grad/")]  # step does not zero at N = 1
            eng.zero_grad()
        assert eng.completed_steps == 2
    finally:
        eng.close()


def test_config_refuses_a_count_below_one(tmp_path):
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            training_config(tmp_path).replace(gradient_accumulation_steps=bad)
