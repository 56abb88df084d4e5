"""fp16 training with loss scaling (EngineConfig.loss_scaling, eng.backward). The oracle is plain
torch: the model cast to fp16, its gradients upcast onto fp32 master copies, torch.amp.GradScaler
unscaling them and skipping overflowing steps, torch.optim.AdamW on the masters (and
clip_grad_norm_ between unscale and step when clipping). Losses, scales and masters compare exactly."""

from __future__ import annotations

import copy
import json
import math
import warnings
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

import engine
from engine.optim.loss_scaler import LossScaler
from engine.config import LossScaling
from engine.optim.step_record import StepRecord
from engine_models import TinyGPT, store_config
from conftest import MiB
from test_engine_training import LR, gpt_loss, training_config

#: Large enough that the first steps' fp16 gradients overflow, so the run skips steps, halves the
#: scale, then grows it again every GROWTH good steps and overflows again.
INITIAL = 2.0**15
GROWTH = 2


def scaled_config(tmp_path, *, max_grad_norm: Optional[float] = None, optimizer_tier: str = "nvme",
                  **policy) -> engine.EngineConfig:
    policy = {"initial_scale": INITIAL, "growth_interval": GROWTH, "hysteresis": 1, **policy}
    room = {"host_bytes": 16 * MiB} if optimizer_tier == "host" else {}  # state and gradients in host memory
    return training_config(tmp_path, train_dtype="float16", max_grad_norm=max_grad_norm,
                           optimizer_tier=optimizer_tier, **room).replace(
        loss_scaling=LossScaling(**policy)
    )


class Reference:
    """The plain-torch fp16 + GradScaler + fp32-master AdamW loop."""

    def __init__(self, model: torch.nn.Module, max_grad_norm: Optional[float] = None) -> None:
        self.model = copy.deepcopy(model).half()
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.masters, lr=LR, weight_decay=0.1)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=INITIAL, growth_interval=GROWTH)
        self.max_grad_norm = max_grad_norm

    def step(self, i: int) -> float:
        scale = self.scaler.get_scale()
        loss = gpt_loss(self.model, i)
        self.scaler.scale(loss).backward()
        for master, p in zip(self.masters, self.model.parameters()):
            master.grad = p.grad.float()
            p.grad = None
        self.scaler.unscale_(self.opt)
        #: The unscaled gradient's norm (inf or NaN when it overflowed), clipped to max_grad_norm if given.
        self.norm = torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm or float("inf")).item()
        self.scaler.step(self.opt)
        self.scaler.update()
        #: Whether the step was applied (as accelerate's ``optimizer_step_was_skipped`` tells: a skip halves the scale).
        self.applied = self.scaler.get_scale() >= scale
        self.opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(self.masters, self.model.parameters()):
                p.copy_(master)
        return loss.item()

    def assert_masters_equal(self, eng: engine.Engine) -> None:
        """The engine's fp32 master weights in the store are this reference's, bit for bit."""
        live = {s.name: s for s in eng._training.live_shards()}
        for (name, _), master in zip(self.model.named_parameters(), self.masters):
            assert torch.equal(eng.store.sync.get(live[name].master_key), master.detach().reshape(-1)), name


def backward(eng: engine.Engine, loss: torch.Tensor, through: str) -> None:
    """The scaled backward: ``eng.backward(loss)``, ``eng.with_loss_scale(loss).backward()`` (a loop
    that calls backward itself), or both (scaled once)."""
    if through == "eng.backward":
        eng.backward(loss)
    elif through == "with_loss_scale":
        scaled = eng.with_loss_scale(loss)
        assert scaled.item() == loss.item()  # the value is the loss's; only its backward is scaled
        scaled.backward()
    else:
        assert through == "both", through
        eng.backward(eng.with_loss_scale(loss))


def train(eng: engine.Engine, model: torch.nn.Module, steps: range, applied: Optional[list[bool]] = None,
          through: str = "eng.backward") -> tuple[list[float], list[float]]:
    """Loss and loss scale after each step; what ``eng.step()`` returned appended to ``applied``."""
    losses, scales = [], []
    for i in steps:
        loss = gpt_loss(model, i)
        backward(eng, loss, through)
        pending = eng.pending_grad_norm()  # the norm the step is about to use
        stepped = eng.step()
        assert stepped == eng.was_step_applied()
        norm = eng.get_global_grad_norm()
        assert pending == norm or not (math.isfinite(pending) or math.isfinite(norm)), (pending, norm)
        if applied is not None:
            applied.append(stepped)
        eng.zero_grad()
        losses.append(loss.item())
        scales.append(eng.loss_scale)
    return losses, scales


@pytest.mark.parametrize("max_grad_norm,through,optimizer_tier", [
    (None, "eng.backward", "nvme"), (0.5, "eng.backward", "nvme"), (0.5, "with_loss_scale", "nvme"),
    (None, "both", "nvme"), (0.5, "eng.backward", "host")])  # host: in place, the gradients lent
def test_fp16_loss_scaling_equals_grad_scaler(tmp_path, max_grad_norm, through, optimizer_tier):
    torch.manual_seed(6)
    model = TinyGPT()
    ref = Reference(model, max_grad_norm)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1),
                      config=scaled_config(tmp_path, max_grad_norm=max_grad_norm, optimizer_tier=optimizer_tier))
    try:
        assert all(p.dtype == torch.float16 for p in model.parameters())
        losses, ref_losses, scales, ref_scales, applied, ref_applied = [], [], [], [], [], []
        for i in range(14):
            (loss,), (scale,) = train(eng, model, range(i, i + 1), applied, through)
            losses.append(loss)
            scales.append(scale)
            ref_losses.append(ref.step(i))
            ref_scales.append(ref.scaler.get_scale())
            ref_applied.append(ref.applied)
            norm = eng.get_global_grad_norm()
            assert norm == ref.norm or not (math.isfinite(norm) or math.isfinite(ref.norm)), (i, norm, ref.norm)
        assert losses == ref_losses
        assert scales == ref_scales
        assert applied == ref_applied and not all(applied)  # eng.step() is False where the step was skipped
        stats = eng.stats()
        # With hysteresis 1 the scale halves exactly at each skipped step.
        halvings = sum(1 for a, b in zip([INITIAL] + scales, scales) if b < a)
        growths = sum(1 for a, b in zip([INITIAL] + scales, scales) if b > a)
        assert stats.skipped_steps == halvings == eng.skipped_steps > 0 and growths > 0, scales
        assert stats.optimizer_steps == 14 - halvings == eng.completed_steps
        assert stats.loss_scale == scales[-1]
        ref.assert_masters_equal(eng)
        if optimizer_tier == "host":
            assert stats.optimizer_bytes_read == 0  # every gradient was lent to the in-place step, not copied
        # save_weights(master_weights=True) exports the fp32 masters, not the fp16 copies
        saved = load_file(eng.save_weights(tmp_path / "masters", master_weights=True)[0])
        for (name, _), master in zip(ref.model.named_parameters(), ref.masters):
            assert saved[name].dtype == torch.float32 and torch.equal(saved[name], master.detach()), name
    finally:
        eng.close()


def test_unscaled_backward_is_refused(tmp_path):
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=scaled_config(tmp_path))
    try:
        with pytest.raises(RuntimeError, match=r"eng\.backward\(loss\).*eng\.with_loss_scale\(loss\)"):
            gpt_loss(model, 0).backward()
        eng.zero_grad()  # the engine stays usable: the same loop with eng.backward trains
        train(eng, model, range(2))
        assert eng.completed_steps + eng.stats().skipped_steps == 2
        train(eng, model, range(2, 3), through="with_loss_scale")
        with pytest.raises(RuntimeError, match=r"eng\.backward\(loss\)"):  # its scaled backward ended with it
            gpt_loss(model, 3).backward()
    finally:
        eng.close()


def test_overflowing_step_changes_nothing_and_drops_gradients(tmp_path):
    torch.manual_seed(1)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=scaled_config(tmp_path, initial_scale=2.0**40))
    try:
        before = {k: v.clone() for k, v in eng.state_dict().items()}
        eng.backward(gpt_loss(model, 0))
        eng.step()  # fp16 gradients of a loss scaled by 2^40 are inf
        assert eng.completed_steps == 0 and eng.stats().skipped_steps == 1 and eng.loss_scale == 2.0**39
        assert not [k for k in eng.store.keys() if k.startswith("grad/")]
        after = eng.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        # Without zero_grad the next backward starts from no gradient, not from the dropped infs.
        eng.backward(gpt_loss(model, 1))
        eng.step()
        assert eng.stats().skipped_steps == 2 and eng.loss_scale == 2.0**38
    finally:
        eng.close()


def test_loss_scale_survives_resume_and_checkpoints(tmp_path):
    torch.manual_seed(2)
    config = scaled_config(tmp_path, initial_scale=2.0**17)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config)
    try:
        _, scales = train(eng, model, range(6))
        assert eng.stats().skipped_steps > 0
        saved = (eng.loss_scale, eng.stats().skipped_steps)
        eng.save_checkpoint(tmp_path / "ckpt")
        record = StepRecord.read(eng.store)
        assert record is not None and record.loss_scale == eng._training.scaler.state_dict()
    finally:
        eng.close()
    metadata = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert metadata["optimizer"]["loss_scale"]["scale"] == saved[0]

    resumed = engine.wrap(TinyGPT(), optimizer=engine.AdamW(lr=LR), config=config.replace(resume=True))
    try:
        assert (resumed.loss_scale, resumed.stats().skipped_steps) == saved
    finally:
        resumed.close()

    fresh_model = TinyGPT()
    fresh = engine.wrap(fresh_model, optimizer=engine.AdamW(lr=LR), config=scaled_config(tmp_path / "other"))
    try:
        assert fresh.loss_scale == INITIAL
        fresh.load_checkpoint(tmp_path / "ckpt")
        assert (fresh.loss_scale, fresh.stats().skipped_steps) == saved
        train(fresh, fresh_model, range(6, 8))  # and it trains on from there
    finally:
        fresh.close()


def test_backward_without_scaling_is_plain_backward(tmp_path):
    torch.manual_seed(3)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=training_config(tmp_path))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    try:
        assert eng.loss_scale is None and eng.stats().loss_scale is None
        for i in range(3):
            loss = gpt_loss(model, i)
            eng.backward(loss)
            eng.step()
            eng.zero_grad()
            ref_loss = gpt_loss(ref, i)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert loss.item() == ref_loss.item()
        with pytest.raises(TypeError, match="loss tensor"):
            eng.backward(1.0)  # type: ignore[arg-type]
        loss = gpt_loss(model, 0)
        assert eng.with_loss_scale(loss) is loss and eng.skipped_steps == 0
    finally:
        eng.close()


# ---------------------------------------------------------------------------- the policy itself


def test_scaler_follows_deepspeed_hysteresis_and_growth():
    scaler = LossScaler(LossScaling(initial_scale=2.0**4, growth_interval=3, hysteresis=2, min_scale=2.0))
    seen = []
    for overflow in [True, True, True, False, False, False, True, True, True, True, True]:
        scaler.update(overflow)
        seen.append(scaler.scale)
    # The first overflow passes (hysteresis 2), then each halves; three good steps double and restore it.
    assert seen == [16, 8, 4, 4, 4, 8, 8, 4, 2, 2, 2]
    assert scaler.skipped_steps == 8

    consecutive = LossScaler(LossScaling(initial_scale=16.0, hysteresis=2, consecutive_hysteresis=True))
    for overflow in [True, False, True]:
        consecutive.update(overflow)
    assert consecutive.scale == 16  # a good step in between restored the hysteresis

    static = LossScaler(LossScaling.static(1000.0))
    for overflow in [True, False, True]:
        static.update(overflow)
    assert static.scale == 1000.0 and static.skipped_steps == 2

    copy_ = LossScaler(LossScaling())
    copy_.load_state_dict(scaler.state_dict())
    assert copy_.state_dict() == scaler.state_dict()
    with pytest.raises(ValueError, match="scale"):
        copy_.load_state_dict({"scale": -1.0, "good_steps": 0, "hysteresis_left": 1, "skipped_steps": 0})


@pytest.mark.parametrize("kwargs,match", [
    ({"initial_scale": 3.0}, "power of two"),
    ({"initial_scale": 0}, "initial_scale"),
    ({"min_scale": float("inf")}, "min_scale"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"hysteresis": True}, "hysteresis"),
    ({"dynamic": "yes"}, "dynamic"),
    ({"initial_scale": 2.0, "min_scale": 4.0}, "above initial_scale"),
])
def test_bad_policy_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaling(**kwargs)


def test_config_checks(tmp_path):
    with pytest.raises(TypeError, match="LossScaling"):
        engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path), loss_scaling=2.0**16)  # type: ignore[arg-type]
    config = scaled_config(tmp_path)
    with pytest.raises(ValueError, match=r"engine\.AdamW"):
        engine.wrap(TinyGPT(), config=config)
    model = TinyGPT()
    with pytest.raises(ValueError, match=r"engine\.AdamW"):
        engine.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    with pytest.warns(UserWarning, match="loss_scaling"):
        engine.wrap(TinyGPT(), optimizer=engine.AdamW(), config=config.replace(loss_scaling=None)).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.wrap(TinyGPT(), optimizer=engine.AdamW(), config=config).close()


def test_deepspeed_fp16_section_maps_to_loss_scaling(tmp_path):
    store = store_config(tmp_path)

    def config_from_deepspeed(cls, ds, *, store):
        return cls.from_deepspeed({"zero_optimization": {"stage": 3}, **ds}, store=store)

    dynamic = config_from_deepspeed(engine.EngineConfig, {
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                 "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 2},
    }, store=store)
    assert dynamic.train_dtype == "float16"
    assert dynamic.loss_scaling == LossScaling(initial_scale=4096.0, growth_interval=500, hysteresis=3,
                                               consecutive_hysteresis=True, min_scale=2.0)
    defaults = config_from_deepspeed(engine.EngineConfig, {"fp16": {"enabled": True}}, store=store)
    assert defaults.loss_scaling == LossScaling()
    static = config_from_deepspeed(engine.EngineConfig, {"fp16": {"enabled": True, "loss_scale": 128}}, store=store)
    assert static.loss_scaling == LossScaling.static(128.0)
    off = config_from_deepspeed(engine.EngineConfig, {"fp16": {"enabled": False}}, store=store)
    assert off.train_dtype is None and off.loss_scaling is None
    with pytest.raises(ValueError, match="bf16"):
        config_from_deepspeed(engine.EngineConfig, {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
                              store=store)
    with pytest.raises(ValueError, match="initial_scale_power"):
        config_from_deepspeed(engine.EngineConfig, {"fp16": {"enabled": True, "initial_scale_power": -1}},
                              store=store)


# ---------------------------------------------------------------------------- crash resume

ITERATIONS = 8


def _run_iterations(path: str, *, resume: bool, kill_at: Optional[int] = None, inside: bool = False) -> dict:
    """Train iterations up to ITERATIONS (a skipped step is an iteration too: the data index is
    completed + skipped steps), from the store's record when ``resume``. With ``kill_at``, SIGKILL
    this process inside the step of that iteration: after its first group's writes started (the
    step after backward), or, with ``inside``, once updates inside backward wrote their second batch."""
    import os
    import pathlib
    import signal

    torch.manual_seed(6)
    model = TinyGPT()
    config = scaled_config(pathlib.Path(path)).replace(resume=resume, step_in_backward=inside)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1), config=config)
    first = eng.completed_steps + eng.stats().skipped_steps
    losses = []
    event, at = ("written", 1) if inside else ("write", 1)
    for i in range(first, ITERATIONS):
        if i == kill_at:
            eng._training.on_event = lambda name, group: (
                os.kill(os.getpid(), signal.SIGKILL) if name == event and group == at else None)
        loss = gpt_loss(model, i)
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
        losses.append(loss.item())
    result = {"first": first, "losses": losses, "scale": eng.loss_scale, "skipped": eng.stats().skipped_steps,
              "state": eng.state_dict()}
    eng.close()
    return result


@pytest.mark.parametrize("inside", [False, True])
def test_sigkill_in_a_step_resumes_with_the_same_scale_and_values(tmp_path, inside):
    import multiprocessing

    whole = _run_iterations(str(tmp_path / "whole"), resume=False, inside=inside)
    assert whole["skipped"] > 0
    # A kill in an iteration after the first overflows: the record the resume reads carries the scale.
    kill_at = whole["skipped"] + 2
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_run_iterations, args=(str(tmp_path / "crashed"),),
                        kwargs={"resume": False, "kill_at": kill_at, "inside": inside})
    child.start()
    child.join(120)
    assert child.exitcode == -9, child.exitcode
    resumed = _run_iterations(str(tmp_path / "crashed"), resume=True, inside=inside)
    # After backward, the killed step had committed a group: the resume finished it, with the scale it
    # recorded. Inside backward, the step had not committed: the resume rolled it back, and it runs again.
    assert resumed["first"] == kill_at + (0 if inside else 1)
    assert resumed["losses"] == whole["losses"][resumed["first"]:]
    assert (resumed["scale"], resumed["skipped"]) == (whole["scale"], whole["skipped"])
    assert all(torch.equal(resumed["state"][k], v) for k, v in whole["state"].items())
