"""EngineConfig(step_in_backward=True): each shard's AdamW update runs inside backward, the moment its
gradient is final, and eng.step() commits. Losses and parameters equal torch.optim.AdamW's bit for
bit; what cannot be exact is refused; a crash inside backward's updates resumes by replaying the
step's batch."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from engine_models import TinyGPT, gpt_tokens, store_config

import engine
import tiered
from engine.optim.step_record import StepRecord

KiB = 1024
LR = 1e-2


def config_at(path, **kw) -> engine.EngineConfig:
    """Parameters and state on nvme, several update batches per step."""
    from pathlib import Path

    return engine.EngineConfig(host_budget="host_tier", store=store_config(Path(path), host_bytes=64 * KiB),
                               param_tier="nvme", optimizer_tier="nvme", grad_tier="nvme",
                               optimizer_group_bytes=8 * KiB, prefetch_bytes=16 * KiB, step_in_backward=True, **kw)


def loss_of(model: torch.nn.Module, step: int, micro: int = 0) -> torch.Tensor:
    return model(gpt_tokens(seed=100 * step + micro)).float().pow(2).mean()


@pytest.mark.parametrize("accum,compress", [(1, False), (2, True)])
def test_updates_inside_backward_equal_torch_adamw(tmp_path, accum, compress):
    """Two parameter groups, an LR schedule, gradient accumulation counted by the engine: the same
    losses and parameters as torch; a step reads only the moments and writes parameter and moments."""
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)

    def groups(m: torch.nn.Module) -> list[dict]:
        decay = [p for p in m.parameters() if p.ndim > 1]
        return [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in m.parameters() if p.ndim == 1],
                                                          "weight_decay": 0.0}]

    ref_opt = torch.optim.AdamW(groups(ref), lr=LR)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 2, gamma=0.5)
    eng = engine.wrap(model, optimizer=engine.AdamW(groups(model), lr=LR),
                      config=config_at(tmp_path, gradient_accumulation_steps=accum, compress_optimizer=compress))
    sched = torch.optim.lr_scheduler.StepLR(eng.optimizer, 2, gamma=0.5)
    numel = sum(p.numel() for p in model.parameters())
    with eng:
        for step in range(5):
            losses, ref_losses = [], []
            for micro in range(accum):
                loss = loss_of(model, step, micro)
                eng.backward(loss)
                applied = eng.step()
                losses.append(loss.item())
                ref_loss = loss_of(ref, step, micro) / accum
                ref_loss.backward()
                ref_losses.append(loss_of(ref, step, micro).item())
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
            if applied:
                sched.step()
            assert losses == ref_losses, step
            assert eng.completed_steps == step + 1
            last = eng._training.counters.last
            assert last.bytes_written == 12 * numel and last.shards_updated == len(list(model.parameters()))
        assert not any(k.startswith(("grad/", "optim/")) and k.endswith(("/kept", "/new")) for k in eng.store.keys())
        assert eng.get_global_grad_norm() is not None
        eng.unwrap()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_what_cannot_be_exact_is_refused(tmp_path):
    store = store_config(tmp_path / "cfg")
    for kw, match in (({"max_grad_norm": 1.0}, "cannot clip"), ({"loss_scaling": engine.LossScaling()}, "overflow"),
                      ({"param_tier": "host"}, "param_tier='nvme'"), ({"train_dtype": "bfloat16"}, "fp32"),
                      ({"step_in_backward": 1}, "True or False")):
        with pytest.raises(ValueError, match=match):
            engine.EngineConfig(store=store, **{"step_in_backward": True, **kw})
    torch.manual_seed(1)
    model = TinyGPT()
    with pytest.raises(ValueError, match="engine.AdamW"):
        engine.wrap(TinyGPT(), optimizer=torch.optim.AdamW(model.parameters()), config=config_at(tmp_path / "t"))
    with engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config_at(tmp_path / "e")) as eng:
        loss_of(model, 0).backward()
        for call, match in ((lambda: eng.clip_grad_norm_(1.0), "cannot clip"),
                            (lambda: eng.full_grad(model.wte.weight), "no gradient"),
                            (lambda: eng.set_full_grad(model.wte.weight, torch.zeros(model.wte.weight.shape)),
                             "no gradient"),
                            (lambda: eng.zero_grad(), "call eng.step\\(\\) first"),
                            (lambda: loss_of(model, 1), "call eng.step\\(\\) first"),
                            (lambda: eng.save_checkpoint(tmp_path / "ckpt"), "call eng.step\\(\\) first")):
            with pytest.raises(RuntimeError, match=match):
                call()
        eng.step()
        loss = loss_of(model, 1)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="second backward"):
            loss.backward()
        with pytest.raises(RuntimeError, match="call eng.step\\(\\) first"):
            loss_of(model, 2)  # releases what the failed backward held, and refuses to run
        eng.step()  # the first backward's updates
        assert eng.completed_steps == 2


CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, engine
    from engine_models import TinyGPT
    from test_engine_step_in_backward import config_at, loss_of

    torch.manual_seed(0)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr={lr!r}, weight_decay=0.1), config=config_at({path!r}))
    for step in range(2):
        loss_of(model, step).backward()
        eng.step()
        eng.zero_grad()

    def kill(event, batch):  # batch: how many batches were written (a rename can follow two writes)
        if event == {event!r} and batch >= 2:
            os.kill(os.getpid(), signal.SIGKILL)

    eng._training.on_event = kill
    loss_of(model, 2).backward()
    eng.step()
    print("not killed", flush=True)
""")


def reference(steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, params = [], [{n: p.detach().clone() for n, p in model.named_parameters()}]
    for step in range(steps):
        loss = loss_of(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params


@pytest.mark.parametrize("event", ["renamed", "written"])
def test_a_kill_inside_backwards_updates_resumes_by_replaying_the_batch(tmp_path, event):
    """Killed after two update batches committed and a third kept its old values aside (or wrote its
    new ones): the resume puts the old parameters back, the replayed batch gives the same gradients,
    the shards already updated are not updated twice, and training equals torch; a batch other than
    the one recorded is refused."""
    path = str(tmp_path / "store")
    code = CHILD.format(tests=os.path.dirname(__file__), lr=LR, path=path, event=event)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    ref_losses, ref_params = reference(5)
    with tiered.TieredStore.open(config_at(path).store) as store:
        record = StepRecord.read(store)
        assert record.step == 2 and record.in_backward is not None and record.in_backward.step == 3
        assert any(k.endswith("/kept") for k in store.keys())
        assert not any(k.startswith("grad/") for k in store.keys())  # no gradient is ever stored
    for attempt in ("wrong batch", "replay"):
        torch.manual_seed(99)
        model = TinyGPT()
        eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1),
                          config=config_at(path).replace(resume=True))
        try:
            assert eng.completed_steps == 2
            assert not any(k.endswith("/kept") for k in eng.store.keys())
            state = eng.state_dict()
            for name, value in ref_params[2].items():
                assert torch.equal(state[name], value), name  # the last completed step's values
            if attempt == "wrong batch":
                with pytest.raises(RuntimeError, match="Replay step 3's batch"):
                    loss_of(model, 7).backward()
                continue
            losses = []
            for step in range(2, 5):
                loss = loss_of(model, step)
                loss.backward()
                eng.step()
                eng.zero_grad()
                losses.append(loss.item())
            assert losses == ref_losses[2:]
            assert not any(k.endswith(("/kept", "/new")) for k in eng.store.keys())
        finally:
            eng.close()


def test_a_failed_update_inside_backward_is_redone_by_running_the_batch_again(tmp_path):
    """An update that fails (an error after the third batch committed): the backward raises and says
    to run the batch again; its forward puts the last completed step's parameters back, and the
    step equals torch's, with no shard updated twice."""
    ref_losses, ref_params = reference(4)
    torch.manual_seed(0)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1), config=config_at(tmp_path))

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
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR),
                      config=config_at(tmp_path).replace(optimizer_group_bytes=64 * KiB, prefetch_bytes=0))
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
    cfg = config_at(tmp_path)
    assert cfg.cache_tier == "host"
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=cfg)
    renamed: list[tiered.EntryInfo] = []

    def on_event(event: str, _batch: int) -> None:
        if event == "renamed":
            renamed.extend(eng.store.info(k) for k in eng.store.keys() if k.endswith("/kept"))

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
    cfg = config_at(tmp_path).replace(host_budget="total", optimizer_group_bytes=32 * KiB)
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
