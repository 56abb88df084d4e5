"""Crash resume from the store's own persisted state: a process training with engine.AdamW is
SIGKILLed in the middle of a step (some groups written, others not: the resume finishes that step
from its durable gradients) or between steps (gradients in the store, no step taken: the resume
drops them); a new process wraps with EngineConfig(resume=True) and continues from the last
completed step. Its losses and parameters equal an uninterrupted plain-torch run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import engine
import tiered
from engine.paging.layout import optim_keys
from engine.optim.step_record import StepRecord
from engine.errors import StepRecordError
from engine_models import TinyGPT, gpt_tokens, store_config

KiB = 1024
LR = 1e-2
STEPS_BEFORE = 3  # completed steps before the crash
STEPS_AFTER = 3

CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, engine
    from engine_models import TinyGPT, gpt_tokens
    from test_engine_training_resume import config_at

    mode = {mode!r}  # "mid_step" or "between"
    torch.manual_seed(0)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr={lr!r}, weight_decay=0.1), config=config_at({path!r}, {tier!r}))
    for step in range({before}):
        model(gpt_tokens(seed=step)).float().pow(2).mean().backward()
        eng.step()
        eng.zero_grad()
    model(gpt_tokens(seed={before})).float().pow(2).mean().backward()
    if mode == "between":
        eng._training.grads.flush()  # the gradients are in the store; no step has started
        os.kill(os.getpid(), signal.SIGKILL)

    def kill(event, group):
        if event == "write" and group == 3:  # groups 0-2 written: parameters and state half updated
            os.kill(os.getpid(), signal.SIGKILL)

    eng._training.on_event = kill
    eng.step()
    print("not killed", flush=True)
""")


def config_at(path: str, optimizer_tier: str = "nvme") -> engine.EngineConfig:
    """Parameters and gradients on nvme (durable: resume must drop the interrupted step's gradients),
    several groups per step; a host budget that holds the whole optimizer state when it is put there."""
    from pathlib import Path

    return engine.EngineConfig(host_budget="host_tier", store=store_config(Path(path), host_bytes=4096 * KiB),
                               param_tier="nvme",
                               optimizer_tier=optimizer_tier, grad_tier="nvme", optimizer_group_bytes=8 * KiB,
                               prefetch_bytes=16 * KiB, step_in_backward=False)


def run_child(path: str, mode: str, optimizer_tier: str = "nvme") -> None:
    """Train in a subprocess that SIGKILLs itself at ``mode``."""
    code = CHILD.format(tests=os.path.dirname(__file__), mode=mode, lr=LR, path=path, before=STEPS_BEFORE,
                        tier=optimizer_tier)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    return model(gpt_tokens(seed=step)).float().pow(2).mean()


def reference() -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses of an uninterrupted run and its parameters after each step (index k: after k steps)."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, params = [], [{n: p.detach().clone() for n, p in model.named_parameters()}]
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        loss = loss_of(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params


@pytest.mark.parametrize("mode", ["mid_step", "between"])
def test_resume_after_sigkill_continues_the_uninterrupted_run(tmp_path, mode):
    path = str(tmp_path)
    run_child(path, mode)
    ref_losses, ref_params = reference()
    completed = STEPS_BEFORE + (mode == "mid_step")  # a step stopped part way is finished by the resume
    done = ref_params[completed]

    with tiered.TieredStore.open(config_at(path).store) as store:  # what the crash left
        record = StepRecord.read(store)
        assert record is not None and record.step == STEPS_BEFORE
        before = ref_params[STEPS_BEFORE]
        changed = [n for n, p in before.items() if n != "lm_head.weight"
                   and not torch.equal(store.sync.get(f"param/{n}"), p.reshape(-1))]
        assert not any(optim_keys(n, 1)[1] in store for n in record.shards)  # one slot only
        if mode == "mid_step":
            assert changed and record.applying is not None and record.applying.step == STEPS_BEFORE + 1
            assert any(k.startswith("engine/step/done/") for k in store.keys())
        else:
            assert not changed and record.applying is None and any(k.startswith("grad/") for k in store.keys())

    torch.manual_seed(1234)
    model = TinyGPT()  # different initial values: everything must come from the store
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1),
                      config=config_at(path).replace(resume=True))
    try:
        assert eng.completed_steps == completed
        assert set(eng.optimizer.shard_steps.values()) == {completed}
        assert not any(k.startswith(("grad/", "engine/step/done/")) for k in eng.store.keys())
        for name, value in model.state_dict().items():
            if name in done:
                assert torch.equal(value, done[name]), name
        losses = []
        for step in range(completed, STEPS_BEFORE + STEPS_AFTER):
            loss = loss_of(model, step)
            loss.backward()
            eng.step()
            eng.zero_grad()
            losses.append(loss.item())
        assert losses == ref_losses[completed:]
        assert eng.completed_steps == STEPS_BEFORE + STEPS_AFTER
    finally:
        eng.close()


def test_resume_refuses_state_that_lived_in_the_host_tier(tmp_path):
    """Host-tier entries die with the process: the record names state that is gone, and resume says so
    instead of training on from wrong values."""
    path = str(tmp_path)
    run_child(path, "between", optimizer_tier="host")
    with pytest.raises(StepRecordError, match="optimizer_tier='nvme'"):
        engine.wrap(TinyGPT(), optimizer=engine.AdamW(lr=LR), config=config_at(path, "host").replace(resume=True))
    with tiered.TieredStore.open(config_at(path).store) as store:
        assert StepRecord.read(store).step == STEPS_BEFORE  # the refused resume changed nothing


LOAD_CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, engine
    from engine_models import TinyGPT, gpt_tokens
    from test_engine_training_resume import config_at

    torch.manual_seed(0)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr={lr!r}, weight_decay=0.1), config=config_at({path!r}))
    for step in range(3):
        model(gpt_tokens(seed=step)).float().pow(2).mean().backward()
        eng.step()
        eng.zero_grad()
        if step == 1:
            eng.save_checkpoint({ckpt!r})

    def kill(event, group):
        if event == "staged":  # the load's record has committed; its parameters are not renamed yet
            os.kill(os.getpid(), signal.SIGKILL)

    eng._training.on_event = kill
    eng.load_checkpoint({ckpt!r})
    print("not killed", flush=True)
""")


def test_a_kill_while_a_load_installs_its_parameters_resumes_at_the_loaded_step(tmp_path):
    """Parameters that are their own masters are loaded to staging keys and renamed into place once
    the load's record commits; killed between the two, the resume finishes the renames."""
    path, ckpt = str(tmp_path / "store"), str(tmp_path / "ckpt")
    code = LOAD_CHILD.format(tests=os.path.dirname(__file__), lr=LR, path=path, ckpt=ckpt)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    ref_losses, ref_params = reference()
    with tiered.TieredStore.open(config_at(path).store) as store:
        record = StepRecord.read(store)
        assert record.step == 2 and all(s.staged for s in record.shards.values())
        assert all(f"optim/{n}/staged" in store for n in record.shards)
    torch.manual_seed(99)
    model = TinyGPT()
    config = config_at(path).replace(resume=True)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1), config=config)
    try:
        assert eng.completed_steps == 2
        assert not any(k.endswith("/staged") for k in eng.store.keys())
        for name, value in model.state_dict().items():
            if name in ref_params[2]:  # (lm_head.weight is wte.weight, tied)
                assert torch.equal(value, ref_params[2][name]), name
        losses = []
        for step in range(2, STEPS_BEFORE + STEPS_AFTER):
            loss = loss_of(model, step)
            loss.backward()
            eng.step()
            eng.zero_grad()
            losses.append(loss.item())
        assert losses == ref_losses[2:]
    finally:
        eng.close()
