"""Prefetch along the recorded order: the Schedule's bookkeeping, re-recording on data-dependent
control flow, the order handed to the store, and the memory bound (largest module + window)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import engine
from engine.paging.schedule import Schedule
from engine_models import (
    KiB,
    TinyGPT,
    assert_same_grads,
    engine_config,
    gpt_tokens,
    largest_module_bytes,
    param_bytes,
    train_parity,
)


def test_schedule_records_follows_and_rerecords():
    s: Schedule[str] = Schedule()
    s.begin("train")
    assert not s.following
    for item in "abca":
        assert not s.observe(item)
    assert s.begin("train")  # a new record to publish
    assert list(s.order) == list("abca") and s.following
    assert s.observe("a") and s.next_position("a") == 3 and s.next_position("b") == 1
    assert s.observe("b")
    assert not s.begin("train")  # a prefix keeps the record
    assert s.rerecords == 0
    assert s.observe("a") and not s.observe("c")  # departs
    assert not s.following and s.next_position("a") is None
    s.observe("b")
    assert s.begin("train") and s.rerecords == 1
    assert list(s.order) == list("acb")
    assert s.begin("eval") and s.order == ()  # each mode has its own record
    s.observe("z")
    assert s.begin("train") and list(s.order) == list("acb")


class Branchy(nn.Module):
    """Which branch runs depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.left = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.right = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = self.left(h) if h.sum() > 0 else self.right(h)
        return self.head(h)


def _input_taking(model: nn.Module, left: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(4, 8, generator=g)
        with torch.no_grad():
            if (model.stem(x).sum() > 0) == left:
                return x


def test_data_dependent_control_flow_rerecords_and_stays_exact(tmp_path):
    torch.manual_seed(0)
    model = Branchy()
    pattern = [True, True, False, False, True, True]
    inputs = [_input_taking(model, left, seed) for seed, left in enumerate(pattern)]
    eng = train_parity(model, engine_config(tmp_path, prefetch_bytes=1024), inputs)
    stats = eng.stats()
    assert stats.rerecords == 2  # left -> right, right -> left; repeated steps follow their record
    assert stats.prefetch_hits > 0 and stats.materialized_bytes == 0
    eng.unwrap()


def test_the_recorded_order_goes_to_the_store(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    eng = train_parity(model, engine_config(tmp_path), [gpt_tokens(seed=s) for s in range(2)])
    policy = eng.store._policy  # FutureOrderPolicy: keys in the order have a finite next use
    assert all(math.isfinite(policy.next_use(k)) for k in eng.store.keys())
    eng.unwrap()


@pytest.mark.parametrize("prefetch_bytes", [0, 4 * KiB, 40 * KiB])
def test_materialized_parameters_stay_within_largest_module_plus_window(tmp_path, prefetch_bytes):
    torch.manual_seed(0)
    model = TinyGPT(d=64, layers=3)
    bound = largest_module_bytes(model) + prefetch_bytes
    config = engine_config(tmp_path, prefetch_bytes=prefetch_bytes)
    eng = train_parity(model, config, [gpt_tokens(seed=s) for s in range(3)])
    stats = eng.stats()
    assert stats.peak_materialized_bytes <= bound < param_bytes(model)
    assert stats.materialized_bytes == 0
    if prefetch_bytes:
        assert stats.prefetch_hits > 0
    else:
        assert stats.prefetch_issued == 0
    eng.unwrap()


def test_inference_pages_weights_larger_than_device_and_host_budgets(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    ref = copy.deepcopy(model)
    window = 40 * KiB
    config = engine_config(tmp_path, tier="host", device_bytes=16 * KiB, host_bytes=32 * KiB, prefetch_bytes=window)
    assert param_bytes(model) > config.store.device_bytes + config.store.host_bytes
    eng = engine.wrap(model, config=config)
    for seed in range(3):
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            assert torch.equal(model(x), ref(x))
    stats = eng.stats()
    assert stats.prefetch_misses == 16  # only the first forward (which records) fetches on demand
    assert stats.prefetch_hits == 32
    assert stats.bytes_fetched["nvme"] > 0 and stats.bytes_fetched["host"] > 0
    assert stats.peak_materialized_bytes <= largest_module_bytes(model) + window
    eng.unwrap()


def test_training_and_inference_keep_separate_records(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, config=engine_config(tmp_path))
    for seed in range(4):
        x = gpt_tokens(seed=seed)
        model(x).sum().backward(), ref(x).sum().backward()
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
    assert_same_grads(model, ref)
    assert eng.stats().rerecords == 0
    eng.unwrap()
