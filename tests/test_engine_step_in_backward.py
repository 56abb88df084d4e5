"""Updates inside backward (EngineConfig.step_in_backward): each shard's AdamW update runs the moment its
gradient is final, and eng.step() validates it against the global norm, an overflow and the
hyperparameters, then commits, rolls back or redoes it ([Note: Speculative updates]). The oracle is
plain torch: the model in its training dtype, fp32 master copies, clip_grad_norm_ on the masters,
GradScaler's unscale and skip for fp16, torch.optim.AdamW. Losses, loss scales and masters compare
bit for bit, in fp32, bf16 and fp16, clipped or not, binding or not, with gradient accumulation; a
SIGKILL anywhere in a step resumes from the last committed step."""

from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
import textwrap
from typing import Optional

import pytest
import torch
from engine_models import TinyGPT, gpt_tokens, store_config

import engine
import tiered
from engine.optim.step_record import StepRecord

KiB = 1024
LR = 1e-2
STEPS = 6
#: GradScaler's starting scale: large enough that the first fp16 steps overflow and are skipped.
INITIAL_SCALE = 2.0**15


def config_at(path, **kw) -> engine.EngineConfig:
    """Parameters and state on nvme, several update batches per step."""
    from pathlib import Path

    return engine.EngineConfig(host_budget="host_tier", store=store_config(Path(path), host_bytes=64 * KiB),
                               param_tier="nvme", optimizer_tier="nvme", grad_tier="nvme",
                               optimizer_group_bytes=8 * KiB, prefetch_bytes=16 * KiB, **kw)


def loss_of(model: torch.nn.Module, step: int, micro: int = 0) -> torch.Tensor:
    return model(gpt_tokens(seed=100 * step + micro)).float().pow(2).mean()


class Reference:
    """Plain torch: the model in ``dtype`` with fp32 masters (fp32: the parameters themselves),
    gradients accumulated in fp32 over ``accum`` micro-batches of ``loss / accum``, GradScaler for
    fp16, clip_grad_norm_ to ``max_norm``, torch.optim.AdamW."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, accum: int, max_norm: Optional[float]) -> None:
        self.model = copy.deepcopy(model).to(dtype)
        self.fp32 = dtype == torch.float32
        self.masters = list(self.model.parameters()) if self.fp32 else [
            p.detach().float().clone().requires_grad_() for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.masters, lr=LR, weight_decay=0.1)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE, growth_interval=2) \
            if dtype == torch.float16 else None
        self.accum, self.max_norm = accum, max_norm
        self.norms: list[float] = []

    def step(self, step: int) -> list[float]:
        losses = []
        for micro in range(self.accum):
            loss = loss_of(self.model, step, micro)
            losses.append(loss.item())
            scaled = loss / self.accum
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            if not self.fp32:
                for master, p in zip(self.masters, self.model.parameters()):
                    master.grad = p.grad.float() if master.grad is None else master.grad + p.grad.float()
                    p.grad = None
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        self.norms.append(torch.nn.utils.clip_grad_norm_(self.masters, self.max_norm or math.inf).item())
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad()
        if not self.fp32:
            with torch.no_grad():
                for master, p in zip(self.masters, self.model.parameters()):
                    p.copy_(master)
        return losses

    def assert_masters_equal(self, eng: engine.Engine) -> None:
        live = {s.name: s for s in eng._training.live_shards()}
        for (name, _), master in zip(self.model.named_parameters(), self.masters):
            assert torch.equal(eng.store.sync.get(live[name].master_key), master.detach().reshape(-1)), name


def clip_norm(dtype: torch.dtype, accum: int, where: str) -> Optional[float]:
    """A clip norm for the unclipped reference's gradient norms: "never" binds; "half" (their median)
    binds on about half the steps; "late" binds on the first step only when its last gradients come
    in, so that step's updates run inside backward and are redone."""
    if where == "never":
        return 1e4
    torch.manual_seed(0)
    ref = Reference(TinyGPT(), dtype, accum, None)
    for step in range(STEPS):
        ref.step(step)
    finite = sorted(n for n in ref.norms if math.isfinite(n))
    return finite[len(finite) // 2] if where == "half" else ref.norms[0] * 0.999


CASES = {
    # name: (train dtype, EngineConfig.step_in_backward, clipping (None, or how it binds, and "call" for
    # clip_grad_norm_ in place of max_grad_norm), accumulation)
    "fp32 default": (torch.float32, None, None, 1),
    "fp32 clip binds half, accumulation": (torch.float32, True, "half", 2),
    "fp32 clip binds late: redone": (torch.float32, True, "late", 1),
    "fp32 clip never binds": (torch.float32, True, "never", 1),
    "bf16 default, clip binds half": (torch.bfloat16, None, "half", 1),
    "bf16 default, clip_grad_norm_ binds late": (torch.bfloat16, None, "late call", 1),
    "bf16 accumulation": (torch.bfloat16, True, None, 2),
    "bf16 clip binds late: redone": (torch.bfloat16, True, "late", 1),
    "fp16 scaled, clip binds half": (torch.float16, True, "half", 1),
    "fp16 scaled default, accumulation": (torch.float16, None, None, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_updates_inside_backward_equal_torch(tmp_path, case):
    dtype, setting, clip, accum = CASES[case]
    call = clip is not None and clip.endswith(" call")
    max_norm = clip_norm(dtype, accum, clip.split()[0]) if clip else None
    torch.manual_seed(0)
    model = TinyGPT()
    ref = Reference(model, dtype, accum, max_norm)
    name = {torch.float32: None, torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    scaling = engine.LossScaling(initial_scale=INITIAL_SCALE, growth_interval=2, hysteresis=1) \
        if dtype == torch.float16 else None
    config = config_at(tmp_path, train_dtype=name, loss_scaling=scaling, step_in_backward=setting,
                       gradient_accumulation_steps=accum, max_grad_norm=None if call else max_norm)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1), config=config)
    inside = redone = 0
    with eng:
        for step in range(STEPS):
            losses = []
            for micro in range(accum):
                loss = loss_of(model, step, micro)
                eng.backward(loss)
                losses.append(loss.item())
                if micro == accum - 1 and call:
                    eng.clip_grad_norm_(max_norm)
                eng.step()
            assert losses == ref.step(step), step
            assert eng.get_global_grad_norm() == ref.norms[-1] or not math.isfinite(ref.norms[-1]), step
            if ref.scaler is not None:
                assert eng.loss_scale == ref.scaler.get_scale(), step
            counters = eng._training.counters
            inside, redone = counters.steps_inside, counters.steps_redone
        ref.assert_masters_equal(eng)
        assert not any("/before/" in k or "/after/" in k for k in eng.store.keys())
        state = eng.state_dict()
    for (name, _), p in zip(ref.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(state[name], p.detach()), name
    # the updates ran inside backward where asked for, from the second step on by default (skipped
    # steps aside), and a step whose clip bound late was redone after backward
    skipped = eng.stats().skipped_steps
    assert inside >= (STEPS - 1 - skipped if clip in (None, "never") else 1), (inside, redone)
    if setting and clip == "late":
        assert redone >= 1


def test_bytes_of_a_step_inside_backward(tmp_path):
    """fp32 without clipping: 12 bytes a parameter written (parameter, two moments) and only the moments
    read by the update; with clipping the gradient is kept too (4 more written); bf16 with clipping:
    the parameter (2), its master (4), the moments (8) and the gradient in bf16 (2), and backward reads
    the master instead of the parameter, so the update reads only the moments."""
    torch.manual_seed(0)
    for dtype, clip, written in ((None, None, 12), (None, 1e4, 16), ("bfloat16", 1e4, 16)):
        model = TinyGPT()
        numel = sum(p.numel() for p in model.parameters())
        eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config_at(
            tmp_path / f"{dtype}{clip}", train_dtype=dtype, max_grad_norm=clip, step_in_backward=True))
        with eng:
            for step in range(3):
                eng.backward(loss_of(model, step))
                eng.step()
            last = eng._training.counters.last
            kept = eng._training.grads.bytes_offloaded
            stats = eng.stats()
            # the moments, and the masters of the parameters backward did not need (biases, embeddings)
            assert 8 * numel <= last.bytes_read < 12 * numel, (dtype, clip)
            assert last.bytes_written + (kept // 3 if clip else 0) == written * numel, (dtype, clip)
            assert stats.optimizer_update_seconds > 0


def test_the_default_watches_the_first_step_and_a_loop_that_adds_backwards_up_stays_after_backward(tmp_path):
    """By default the first step runs after backward; a loop that calls backward twice per step itself
    (no gradient_accumulation_steps) then keeps every step after backward, and trains as torch does."""
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config_at(tmp_path))
    assert eng._training.step_mode.startswith("the step after backward for the first step")
    with eng:
        for step in range(3):
            for micro in range(2):
                (loss_of(model, step, micro) / 2).backward()
                (loss_of(ref, step, micro) / 2).backward()
            eng.step()
            eng.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        assert eng._training.counters.steps_inside == 0
        assert "two backwards" in eng._training.step_mode
        eng.unwrap()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_the_first_step_inside_backward_reads_ahead_along_the_order_of_the_step_before_it(tmp_path):
    """By default the first step runs after backward; the order its gradients became final in is the
    order the next step's updates take, so that step reads their moments ahead from its forward on,
    as every later one does, and trains as torch does."""
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config_at(tmp_path))
    inside = eng._training._inside
    orders, ahead = [], []
    with eng:
        for step in range(3):
            loss = loss_of(model, step)
            ahead.append(sorted(inside._worker._ahead))  # read ahead by the forward
            eng.backward(loss)
            eng.step()
            eng.zero_grad()
            orders.append(list(inside._ahead_order))
            ref_loss = loss_of(ref, step)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert loss.item() == ref_loss.item()
        assert eng._training.counters.steps_inside == 2
        eng.unwrap()
    assert sorted(orders[0]) == sorted(name for name, _ in model.named_parameters())
    assert orders[0] == orders[1] == orders[2]  # a step after backward takes its gradients in the same order
    assert ahead[0] == [] and ahead[1] and ahead[1] == ahead[2]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_calls_between_backward_and_step_see_the_last_committed_step(tmp_path):
    """With the updates already run inside backward: an evaluation forward, state_dict and full_grad
    between backward and step see what torch shows there (the parameters before the step); zero_grad
    drops the step; an LR changed before the step is redone with the new LR; a second backward with
    gradients kept is added up and redone after backward (and later steps run after backward).
    Everything equals torch."""
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR),
                      config=config_at(tmp_path, step_in_backward=True, max_grad_norm=1e4))
    probe = gpt_tokens(seed=5)
    with eng:
        for step in range(6):
            loss_of(model, step).backward()
            loss_of(ref, step).backward()
            if step == 1:  # an evaluation forward and a state_dict before the step
                with torch.no_grad():
                    assert torch.equal(model(probe), ref(probe))
                for state in (eng.state_dict(), model.state_dict()):
                    for name, p in ref.named_parameters():
                        assert torch.equal(state[name], p.detach()), name
                full = eng.full_grad(model.wte.weight)
                assert torch.equal(full, ref.wte.weight.grad)
            if step == 2:  # zero_grad drops the step
                eng.zero_grad()
                ref_opt.zero_grad()
                continue
            if step == 3:  # the LR changes between backward and step
                for group in (*eng.optimizer.param_groups, *ref_opt.param_groups):
                    group["lr"] = LR / 2
            if step == 4:  # a second backward before the step adds up
                loss_of(model, 10).backward()
                loss_of(ref, 10).backward()
            eng.step()
            eng.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        assert eng._training.counters.steps_redone >= 2
        assert not any("/before/" in k or "/after/" in k for k in eng.store.keys())
        eng.unwrap()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_what_cannot_be_redone_without_kept_gradients_is_refused_and_changes_nothing(tmp_path):
    """Updates that ran without keeping gradients (step_in_backward=True, no clipping configured): a
    gradient read or set, or a second backward, between backward and step is refused by name; the
    step still takes the first backward's updates; a clip_grad_norm_ that binds rolls the step back
    and says to run it again; from then on the gradients are kept."""
    torch.manual_seed(1)
    model = TinyGPT()
    with engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config_at(tmp_path, step_in_backward=True)) as eng:
        loss_of(model, 0).backward()
        for call in (lambda: eng.full_grad(model.wte.weight),
                     lambda: eng.set_full_grad(model.wte.weight, torch.zeros(model.wte.weight.shape))):
            with pytest.raises(RuntimeError, match="kept no gradient"):
                call()
        loss = loss_of(model, 1)
        with pytest.raises(RuntimeError, match="second backward"):
            loss.backward()
        with torch.no_grad():
            model(gpt_tokens(seed=3))  # a forward lets go of what the failed backward held
        eng.step()  # the first backward's updates
        assert eng.completed_steps == 1
        assert "two backwards" in eng._training.step_mode  # later steps run after backward
    model = TinyGPT()
    with engine.wrap(model, optimizer=engine.AdamW(lr=LR),
                     config=config_at(tmp_path / "clip", step_in_backward=True)) as eng:
        loss_of(model, 2).backward()
        eng.clip_grad_norm_(1e-6)
        with pytest.raises(RuntimeError, match="was not applied"):
            eng.step()
        assert eng.completed_steps == 0
        assert not any("/before/" in k for k in eng.store.keys())
        loss_of(model, 2).backward()  # run again: the gradients are kept now, so the clip redoes it
        eng.clip_grad_norm_(1e-6)
        eng.step()
        assert eng.completed_steps == 1 and eng._training.counters.steps_redone == 1
    with pytest.raises(ValueError, match="param_tier='nvme'"):
        engine.EngineConfig(store=store_config(tmp_path / "cfg"), step_in_backward=True, param_tier="host")
    with pytest.raises(ValueError, match="None, True or False"):
        engine.EngineConfig(store=store_config(tmp_path / "cfg"), step_in_backward=1)
    with pytest.raises(ValueError, match="engine.AdamW"):
        engine.wrap(TinyGPT(), optimizer=torch.optim.AdamW(TinyGPT().parameters()),
                    config=config_at(tmp_path / "t", step_in_backward=True))


def test_a_second_step_with_no_backward_applies_the_same_gradients_or_is_refused(tmp_path):
    """torch applies the same gradients again when step() runs twice: so does a step whose updates ran
    inside backward and kept the gradients (clipping configured); one that kept none refuses, changing
    nothing, unless zero_grad came between (then, as in torch, the step changes nothing)."""
    for clip in (1e4, None):
        torch.manual_seed(4)
        model = TinyGPT()
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR),
                          config=config_at(tmp_path / str(clip), step_in_backward=True, max_grad_norm=clip))
        with eng:
            for m, step, zero in ((model, eng.step, eng.zero_grad), (ref, ref_opt.step, ref_opt.zero_grad)):
                loss_of(m, 0).backward()
                step()
                if clip is None:
                    if m is model:
                        with pytest.raises(RuntimeError, match="no backward since step 1"):
                            step()
                        assert eng.completed_steps == 1
                    zero()
                step()  # the same gradients again, or (after zero_grad) none: nothing changes
            assert eng.completed_steps == 2
            eng.unwrap()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), clip


CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, engine
    from engine_models import TinyGPT, gpt_tokens
    from test_engine_step_in_backward import config_at, loss_of

    torch.manual_seed(0)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr={lr!r}, weight_decay=0.1),
                      config=config_at({path!r}, step_in_backward=True, train_dtype={dtype!r}, max_grad_norm={clip!r}))
    for step in range(2):
        eng.backward(loss_of(model, step))
        eng.step()
    if {reload!r}:  # the loaded state goes to the other key set, which is live from then on
        eng.save_checkpoint({path!r} + ".ckpt")
        eng.load_checkpoint({path!r} + ".ckpt")

    def kill(event, batch):
        if event == {event!r} and batch >= {batch!r}:
            os.kill(os.getpid(), signal.SIGKILL)

    eng._training.on_event = kill
    eng.backward(loss_of(model, 2))
    {between}
    eng.step()
    print("not killed", flush=True)
""")

KILLS = {
    # name: (train dtype, clip norm, event, batch, what runs between backward and step, a checkpoint
    # saved and loaded before the step)
    "fp32, keeping aside": (None, None, "renamed", 2, "", False),
    "bf16, clip binds, redoing": ("bfloat16", 1e-3, "write", 1, "", False),
    "bf16, written": ("bfloat16", None, "written", 2, "", False),
    "fp32 clipped, set aside for a forward": (None, 1e4, "set aside", 0, "model(gpt_tokens(seed=5))", False),
    "bf16, written after a checkpoint load": ("bfloat16", None, "written", 2, "", True),
}


@pytest.mark.parametrize("case", list(KILLS))
def test_a_kill_in_a_step_inside_backward_resumes_from_the_last_committed_step(tmp_path, case):
    """SIGKILL while updates inside backward keep values aside, write, are redone after backward, or wait
    set aside for a forward: the resume rolls the step back (or finishes a redo the record says is
    under way), nothing is left aside, and training continues equal to torch."""
    dtype, clip, event, batch, between, reload = KILLS[case]
    path = str(tmp_path / "store")
    code = CHILD.format(tests=os.path.dirname(__file__), lr=LR, path=path, event=event, batch=batch, dtype=dtype,
                        clip=clip, between=between, reload=reload)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    torch.manual_seed(0)
    ref = Reference(TinyGPT(), torch.bfloat16 if dtype else torch.float32, 1, clip)
    ref_losses = [ref.step(step)[0] for step in range(2)]
    torch.manual_seed(99)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1),
                      config=config_at(path, step_in_backward=True, train_dtype=dtype, max_grad_norm=clip,
                                       resume=True))
    with eng:
        first = eng.completed_steps
        assert first in (2, 3)  # rolled back, or a redo under way finished
        assert not any("/before/" in k or "/after/" in k for k in eng.store.keys())
        assert StepRecord.read(eng.store).in_backward is None
        if first == 3:
            ref_losses.append(ref.step(2)[0])
        losses = []
        for step in range(first, 5):
            loss = loss_of(model, step)
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
            ref_losses.append(ref.step(step)[0])
        assert losses == ref_losses[first:]
        ref.assert_masters_equal(eng)


def test_a_failed_update_inside_backward_is_redone_by_running_the_batch_again(tmp_path):
    """An update that fails (an error after the third batch committed): the backward raises and says
    to run the batch again; its forward puts the last completed step's parameters back, and the
    step equals torch's, with no shard updated twice."""
    torch.manual_seed(0)
    ref = Reference(TinyGPT(), torch.float32, 1, None)
    ref_losses = [ref.step(step)[0] for step in range(4)]
    torch.manual_seed(0)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1),
                      config=config_at(tmp_path, step_in_backward=True))

    def fail(event: str, batch: int) -> None:
        if event == "written" and batch == 2:
            raise OSError("injected")

    with eng:
        losses = []
        for step in range(4):
            if step == 2:
                eng._training.on_event = fail
                with pytest.raises(RuntimeError, match="update inside backward failed") as failure:
                    loss_of(model, step).backward()
                eng._training.on_event = None
                assert "run its batch again" in "".join(failure.value.__notes__)
                assert eng.completed_steps == 2
            loss = loss_of(model, step)
            loss.backward()
            eng.step()
            eng.zero_grad()
            losses.append(loss.item())
        assert losses == ref_losses


def test_the_updates_hold_no_memory_between_steps(tmp_path):
    """Moments and parameter copies are buffers of the store's pool (8 MiB shards: large enough to be
    pooled); once eng.step() returns none of them is held, so the next forward starts with the memory
    plan's whole working set free."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8192, 256), torch.nn.Linear(256, 256),
                                torch.nn.Linear(256, 8192))
    tokens = torch.randint(0, 8192, (4, 8))
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config_at(tmp_path, step_in_backward=True).replace(
        optimizer_group_bytes=64 * KiB, prefetch_bytes=0))
    with eng:
        for _ in range(3):
            eng.backward(model(tokens).pow(2).mean())
            eng.step()
            assert eng.store.stats().pool_lent_bytes == 0
        assert eng.stats().optimizer_update_seconds > 0  # AdamW's math, timed inside backward


def test_what_the_updates_rename_has_its_record_on_nvme(tmp_path):
    """The renames inside backward move only versions whose record is on nvme, with the host tier
    caching clean copies (cache_tier "host", a budget smaller than the model): no write-down can
    race such a rename ([Note: holding a version] in tiered.store.versions; docs/reliability.md)."""
    torch.manual_seed(0)
    model = TinyGPT()
    cfg = config_at(tmp_path, step_in_backward=True)
    assert cfg.cache_tier == "host"
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=cfg)
    renamed: list[tiered.EntryInfo] = []

    def on_event(event: str, _batch: int) -> None:
        if event == "renamed":
            renamed.extend(eng.store.info(k) for k in eng.store.keys() if "/before/" in k)

    eng._training.on_event = on_event
    with eng:
        for step in range(2):
            eng.backward(loss_of(model, step))
            eng.step()
        eng.unwrap()
    assert renamed and not [i for i in renamed if i.dirty], [i for i in renamed if i.dirty]
    assert any(tiered.Tier.HOST in i.tiers for i in renamed)  # the cache was at work


def test_a_large_batch_is_updated_while_the_one_before_is_written_where_the_plan_leaves_room(tmp_path):
    """Shards larger than optimizer_group_bytes (each a batch of its own) in the middle of a model
    whose wide head sets the plan's bound: each may be updated while the one before it is written
    (two "renamed" events with no "written" between them), the losses and parameters still equal
    torch's bit for bit, and the store's pool stays within the plan's bound throughout."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 128), *[torch.nn.Linear(128, 128, bias=False) for _ in range(4)],
                                torch.nn.Linear(128, 4096, bias=False))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    tokens = torch.randint(0, 64, (2, 8))
    cfg = config_at(tmp_path, step_in_backward=True).replace(host_budget="total", optimizer_group_bytes=32 * KiB)
    cfg = cfg.replace(store=cfg.store.replace(host_bytes=32 << 20, durable=True))
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=cfg)
    plan = eng.memory_plan
    assert plan.updates_buffer_bytes >= 3 * 4096 * 128 * 4  # the head, updated alone
    events: list[str] = []

    def on_event(event: str, _batch: int) -> None:
        events.append(event)
        stats = eng.store.stats()
        assert stats.pool_lent_bytes + stats.pool_waiting_bytes <= plan.pool_bytes

    eng._training.on_event = on_event
    with eng:
        for _ in range(3):
            loss = model(tokens).pow(2).mean()
            eng.backward(loss)
            eng.step()
            ref_loss = ref(tokens).pow(2).mean()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert loss.item() == ref_loss.item()
        eng.unwrap()
    paired = sum(a == b == "renamed" for a, b in zip(events, events[1:]))
    assert paired > 0, events
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


class TwoBlocks(torch.nn.Module):
    """``b`` takes part in the first micro-batch of each step only, so its gradient is final before the
    last micro-batch's backward and its update waits for the step, which runs it after backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, micro: int) -> torch.Tensor:
        return self.a(x) + self.b(x) if micro == 0 else self.a(x)



def test_a_step_that_fails_before_its_waiting_updates_start_is_run_again(tmp_path, monkeypatch):
    """The step after backward for the updates that waited fails before its record is written (the
    gradients cannot be made durable): nothing of the step stands, the next forward puts the last
    completed step back, and the step run again equals torch's, with no shard updated twice."""
    torch.manual_seed(0)
    model = TwoBlocks()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1),
                      config=config_at(tmp_path, step_in_backward=True, gradient_accumulation_steps=2))
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(s)) for s in range(8)]

    def run(m: torch.nn.Module, step: int, backward) -> None:
        for micro in range(2):
            backward(m(inputs[2 * step + micro], micro).pow(2).mean())
            if m is model:
                eng.step()

    with eng:
        for step in range(3):
            run(ref, step, lambda loss: (loss / 2).backward())
            ref_opt.step()
            ref_opt.zero_grad()
            if step == 1:
                with monkeypatch.context() as patch:
                    def fail(keys):
                        raise OSError("injected")
                    patch.setattr(eng.store.sync, "flush", fail)
                    with pytest.raises(OSError, match="injected") as failure:
                        run(model, step, eng.backward)
                assert "run that step's batch again" in "".join(failure.value.__notes__)
                assert eng.completed_steps == 1
            run(model, step, eng.backward)
        assert eng._training.counters.steps_inside >= 1
        assert eng.completed_steps == 3
        eng.unwrap()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_a_non_finite_gradient_without_loss_scaling_is_applied_as_torch_applies_it(tmp_path, max_norm):
    """No loss scaling: NaN gradients are no overflow to skip; torch's AdamW (and clip_grad_norm_'s NaN
    coefficient) turn the parameters into NaN, and the updates inside backward do the same."""
    torch.manual_seed(0)
    model = TwoBlocks()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1),
                      config=config_at(tmp_path, step_in_backward=True, max_grad_norm=max_norm))
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def loss_at(m: torch.nn.Module, step: int) -> torch.Tensor:
        loss = m(inputs[step], 0).pow(2).mean()
        return loss * float("nan") if step == 1 else loss

    with eng:
        for step in range(3):
            loss_at(ref, step).backward()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            ref_opt.step()
            ref_opt.zero_grad()
            eng.backward(loss_at(model, step))
            eng.step()
        assert eng.completed_steps == 3
        eng.unwrap()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)
    assert any(p.isnan().any() for p in model.parameters())


def test_a_load_that_is_refused_between_backward_and_step_keeps_the_step(tmp_path):
    """A checkpoint or optimizer-state load between backward and step that is refused (a missing
    checkpoint, a malformed state dict) changes nothing: the step's updates inside backward still
    commit, equal to torch."""
    torch.manual_seed(0)
    ref = Reference(TinyGPT(), torch.float32, 1, None)
    ref_losses = [ref.step(step)[0] for step in range(3)]
    torch.manual_seed(0)
    model = TinyGPT()
    opt = engine.AdamW(lr=LR, weight_decay=0.1)
    eng = engine.wrap(model, optimizer=opt, config=config_at(tmp_path / "store", step_in_backward=True))
    with eng:
        losses = []
        for step in range(3):
            loss = loss_of(model, step)
            eng.backward(loss)
            if step == 1:
                assert eng._training._inside.pending is not None
                with pytest.raises((ValueError, OSError)):
                    eng.load_checkpoint(tmp_path / "no checkpoint here")
                whole = opt.state_dict()
                whole["param_groups"] = [{k: v for k, v in g.items() if k != "lr"} for g in whole["param_groups"]]
                with pytest.raises(ValueError, match="lack"):
                    opt.load_state_dict(whole)
            eng.step()
            losses.append(loss.item())
        assert losses == ref_losses
        assert eng._training.counters.steps_inside == 3
        ref.assert_masters_equal(eng)


def test_steps_stay_inside_backward_while_the_norm_binds_before_any_update_runs():
    """A binding step that updated nothing (or next to nothing) inside backward cost what the step after
    backward costs, so the next step stays inside; one that updated more than 1% of the parameters for
    nothing sends the following steps after backward while the norm keeps binding, and the first step
    that does not bind brings them back."""
    from engine.optim.speculation import WASTED_UPDATES_TO_FALL_BACK, StepModePolicy

    policy = StepModePolicy(None, None, clipping=True)
    policy.after_step(bound=False)  # the first step, watched after backward
    assert policy.decide()
    policy.redone_for_clipping(WASTED_UPDATES_TO_FALL_BACK / 2)
    policy.after_step(bound=True)
    assert policy.decide() and policy.last_bound  # inside, reading nothing ahead
    policy.redone_for_clipping(0.5)
    policy.after_step(bound=True)
    assert not policy.decide()
    policy.after_step(bound=True)  # after backward, still binding
    assert not policy.decide()
    policy.after_step(bound=False)
    assert policy.decide() and not policy.last_bound
