"""``engine.initialize``: DeepSpeed's training loop as its users write it (``deepspeed.initialize``,
``model_engine(batch)``, ``backward``, ``step``, the scheduler stepped inside ``step``), with only
the initialize call changed. The oracle is DeepSpeed 0.19.8 itself: the losses of a run it made
and the checkpoints it wrote (tests/fixtures/deepspeed, by tests/deepspeed_fixtures.py); DeepSpeed
is not needed to run these tests."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import engine
from deepspeed_fixtures import (
    BATCH, FIXTURES, STEPS_AFTER, STEPS_BEFORE, TRAINING_CONFIG, TRAINING_FILE, batch, continue_run, ds_config,
    make_model, param_groups,
)
from engine.integrations.deepspeed.schedules import WarmupDecayLR
from test_engine_distributed import run_ranks

FIXTURE_DIR = Path(__file__).parent / "fixtures" / "deepspeed"
RECORD = json.loads((FIXTURE_DIR / TRAINING_FILE).read_text())
#: A DeepSpeed run with an LR schedule (WarmupDecayLR), whose iteration its checkpoint keeps.
SCHEDULED = "zero3_offload_world2"


def test_deepspeeds_loop_as_written_reaches_deepspeeds_losses(tmp_path):
    """The loop DeepSpeed's run was recorded with (tests/deepspeed_fixtures.py), word for word but
    for the initialize call: gradient accumulation, clipping, parameter groups and the config's
    WarmupDecayLR, which model_engine.step() steps, as DeepSpeed's does."""
    model = make_model()
    model_engine, optimizer, loader, scheduler = engine.initialize(
        model=model, model_parameters=param_groups(model), config=RECORD["config"], store=tmp_path)
    try:
        assert optimizer is model_engine.optimizer and loader is None and isinstance(scheduler, WarmupDecayLR)
        assert model_engine.module is model and model_engine.lr_scheduler is scheduler
        losses, lrs = [], []
        for micro in range(len(RECORD["losses"])):
            ids, targets = batch(micro)
            loss = model_engine(ids[:2], targets[:2])
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            lrs.append(model_engine.get_lr())
        assert losses == pytest.approx(RECORD["losses"], rel=1e-6, abs=0)
        steps = len(losses) // TRAINING_CONFIG["gradient_accumulation_steps"]
        assert model_engine.completed_steps == steps and scheduler.iteration == steps - 1
        # The schedule moves on each optimizer step (every second micro-batch) only.
        assert all(lrs[i] == lrs[i + 1] for i in range(1, len(lrs) - 1, 2)) and lrs[3] != lrs[1]
    finally:
        model_engine.close()


def test_a_deepspeed_checkpoint_resumes_with_its_lr_schedule(tmp_path):
    """An imported DeepSpeed checkpoint loads into an engine from engine.initialize: the schedule
    goes on from DeepSpeed's iteration by itself, the run reaches DeepSpeed's losses, and the
    engine's own checkpoint then carries the schedule to a second engine."""
    meta = json.loads((FIXTURE_DIR / SCHEDULED / "expected.json").read_text())
    out = engine.import_deepspeed_checkpoint(FIXTURE_DIR / SCHEDULED, tmp_path / "imported", progress=False)
    ds = ds_config(meta["world_size"], FIXTURES[SCHEDULED][1])

    def initialized(store: str) -> tuple[torch.nn.Module, engine.DeepSpeedEngine, WarmupDecayLR]:
        model = make_model()
        eng, _, _, scheduler = engine.initialize(model=model, model_parameters=param_groups(model), config=ds,
                                                 store=tmp_path / store)
        return model, eng, scheduler

    model, eng, scheduler = initialized("a")
    try:
        eng.load_checkpoint(out)
        assert scheduler.iteration == STEPS_BEFORE - 1  # DeepSpeed's, not warmup's start
        assert continue_run(eng, eng) == pytest.approx(meta["losses_after"], rel=1e-6)  # model_engine(batch)
        eng.save_checkpoint(tmp_path / "ours", "step6", {"epoch": 1})  # DeepSpeed's positional (dir, tag, state)
        lrs = eng.get_lr()
    finally:
        eng.close()
    model, eng, scheduler = initialized("b")
    try:
        load_path, client_sd = eng.load_checkpoint(tmp_path / "ours", "step6")  # DeepSpeed's two results
        assert load_path == str(tmp_path / "ours" / "step6") and client_sd["epoch"] == 1
        assert scheduler.iteration == STEPS_BEFORE + STEPS_AFTER - 1 and eng.get_lr() == lrs
    finally:
        eng.close()


def test_the_optimizer_and_scheduler_may_come_from_the_caller(tmp_path):
    """As deepspeed.initialize takes them: an optimizer or a callable building one from
    model_parameters, a scheduler or a callable taking the optimizer (over the config's section);
    without either optimizer there is none. Both optimizers, or a scheduler without one, are refused."""
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    model = make_model()
    eng, optimizer, _, scheduler = engine.initialize(
        model=model, config=ds, store=tmp_path / "a", model_parameters=param_groups(model),
        optimizer=lambda params: engine.AdamW(params, lr=0.5),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1 * (step + 1)))
    try:
        assert isinstance(optimizer, engine.AdamW) and len(optimizer.param_groups) == 2
        assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and eng.get_lr() == [0.05, 0.05]
        eng.backward(eng(*batch(0)))
        assert eng.step() and eng.get_lr() == pytest.approx([0.1, 0.1])
    finally:
        eng.close()

    eng, optimizer, _, scheduler = engine.initialize(
        args=Namespace(deepspeed_config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}),
        model=make_model(), store=tmp_path / "b")
    try:
        assert optimizer is None and scheduler is None
        with pytest.raises(RuntimeError, match="needs an optimizer"):
            eng.get_lr()
    finally:
        eng.close()

    with pytest.raises(ValueError, match="DeepSpeed refuses both"):
        engine.initialize(model=make_model(), config=TRAINING_CONFIG, store=tmp_path / "c",
                          optimizer=engine.AdamW(lr=0.1))
    model = make_model()
    with pytest.raises(ValueError, match="an LR scheduler needs an optimizer"):
        engine.initialize(model=model, config=ds, store=tmp_path / "d")
    with pytest.raises(ValueError, match="needs train_micro_batch_size_per_gpu or train_batch_size"):
        engine.initialize(model=model, config={"zero_optimization": {"stage": 3}}, store=tmp_path / "d",
                          training_data=TensorDataset(torch.arange(4)))
    fresh = make_model()  # refused before wrap: the model keeps its own values
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    with pytest.raises(ValueError, match="needs config="):
        engine.initialize(model=make_model(), store=tmp_path / "e")
    with pytest.raises(TypeError, match="needs model="):
        engine.initialize(model=None, config=ds, store=tmp_path / "f")
    with pytest.raises(ValueError, match="stage3_prefetch_bucket_sise"):  # every key checked, as from_deepspeed
        engine.initialize(model=make_model(), store=tmp_path / "g",
                          config={"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 1}})


def test_a_skipped_fp16_step_leaves_the_schedule_where_it_is(tmp_path):
    """DeepSpeed steps its scheduler only on a step it applied: an overflowing fp16 step moves nothing."""
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "fp16": {"enabled": True, "initial_scale_power": 32, "hysteresis": 1},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    eng, _, _, scheduler = engine.initialize(model=make_model(), config=ds, store=tmp_path)
    try:
        eng.backward(eng(*batch(0)))
        assert not eng.step() and eng.skipped_steps == 1  # 2**32 overflows fp16
        assert scheduler.iteration == -1  # as built (DeepSpeed's last_batch_iteration starts there too)
        eng.backward(eng(*batch(1)))
        steps = 0
        while not eng.step():  # the scale halves until a step goes through
            eng.backward(eng(*batch(1)))
            steps += 1
            assert steps < 40
        assert scheduler.iteration == 0
    finally:
        eng.close()


def test_training_data_is_loaded_in_micro_batches(tmp_path):
    ds = {"train_batch_size": 6, "gradient_accumulation_steps": 3, "zero_optimization": {"stage": 3},
          "dataloader_drop_last": True}
    data = TensorDataset(torch.arange(7))
    eng, _, loader, _ = engine.initialize(model=make_model(), config=ds, store=tmp_path, training_data=data)
    try:
        batches = [b for (b,) in loader]
        assert [len(b) for b in batches] == [2, 2, 2]  # 6 / 3 per micro-batch; the seventh dropped
        assert len(set(torch.cat(batches).tolist())) == 6
    finally:
        eng.close()


def _two_ranks(rank: int, root: str) -> None:
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    ids, targets = batch(0)
    data = TensorDataset(torch.cat([ids, batch(1)[0]]), torch.cat([targets, batch(1)[1]]))
    model_engine, _, loader, _ = engine.initialize(model=make_model(), config=ds, store=root, training_data=data)
    seen = []
    try:
        for ids, targets in loader:
            model_engine.backward(model_engine(ids, targets))
            model_engine.step()
            seen.append(ids.tolist())
    finally:
        model_engine.close()
    Path(root, f"rank{rank}.json").write_text(json.dumps(seen))


def test_two_ranks_each_load_their_own_share(tmp_path):
    """Under torchrun each rank's loader takes its own part of the data (DeepSpeed's DistributedSampler)."""
    run_ranks(_two_ranks, str(tmp_path))
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [len(s) for s in seen] == [BATCH // 2] * 2
    rows = [tuple(row) for s in seen for b in s for row in b]
    assert len(rows) == 2 * BATCH and len(set(rows)) == len(rows)
