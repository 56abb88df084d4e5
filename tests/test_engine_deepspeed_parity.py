"""A DeepSpeed config trains as DeepSpeed trains it: every loss of a run DeepSpeed 0.19.8 made
(tests/fixtures/deepspeed/training_losses.json, by tests/deepspeed_fixtures.py), reproduced by the
engine from the same JSON, with no DeepSpeed installed: bit for bit on the machine type the fixture
was recorded on (2 x86 cores, torch 2.13), to float rounding elsewhere (a 16-core machine with
torch 2.11 differed in the last bit of one loss in twelve: its matmuls sum in another order)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import engine
import tiered
from deepspeed_fixtures import TRAINING_CONFIG, TRAINING_FILE, batch, make_model, param_groups
from engine.integrations.deepspeed.optimizer import optimizer_from_deepspeed, scheduler_from_deepspeed

RECORD = json.loads((Path(__file__).parent / "fixtures" / "deepspeed" / TRAINING_FILE).read_text())


def test_a_deepspeed_config_reaches_deepspeeds_losses(tmp_path):
    """Gradient accumulation (the loss divided, the step on every second micro-batch), clipping,
    weight decay off the second parameter group and WarmupDecayLR, all from the JSON."""
    ds = RECORD["config"]
    assert ds == TRAINING_CONFIG  # the run recorded is the one the fixture file describes
    model = make_model()
    optimizer = optimizer_from_deepspeed(ds, param_groups(model))
    eng = engine.wrap(model, optimizer=optimizer,
                      config=engine.EngineConfig.from_deepspeed(ds, store=tiered.StoreConfig(path=str(tmp_path))))
    scheduler = scheduler_from_deepspeed(ds, optimizer)
    try:
        losses = []
        for micro in range(len(RECORD["losses"])):
            ids, targets = batch(micro)
            loss = model(ids[:2], targets[:2])
            eng.backward(loss)
            if eng.step():
                scheduler.step()  # where DeepSpeed's model_engine.step() steps it
            losses.append(loss.item())
        assert losses == pytest.approx(RECORD["losses"], rel=1e-6, abs=0)
        assert eng.completed_steps == len(losses) // ds["gradient_accumulation_steps"]
    finally:
        eng.close()
