"""Optimizer state read while backward runs (EngineConfig.optimizer_prefetch_groups,
engine/optim/prefetch.py): the step's first groups of master + moments are in flight when
eng.step() starts, and training is bit for bit what torch.optim.AdamW and the engine without the
prefetch give, through gradient accumulation, skipped steps, forward-only calls and a checkpoint
load between backward and step."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy

import pytest
import torch

import engine
from engine.optim.step_io import plan_groups
from engine.optim.prefetch import PrefetchedStore
from engine_models import TinyGPT, gpt_tokens, store_config

KiB = 1024
LR = 1e-2


def config(tmp_path, groups: int, name: str = "store") -> engine.EngineConfig:
    return engine.EngineConfig(host_budget="host_tier",
        store=store_config(tmp_path / name), param_tier="nvme", optimizer_tier="nvme", grad_tier="host",
        optimizer_group_bytes=8 * KiB, prefetch_bytes=16 * KiB, optimizer_prefetch_groups=groups,
        step_in_backward=False,  # the step after backward, whose state these tests read ahead
    )


def loss_of(model: torch.nn.Module, i: int) -> torch.Tensor:
    return model(gpt_tokens(seed=i)).float().pow(2).mean()


def test_first_groups_state_is_in_flight_after_backward_and_losses_equal_torch(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config(tmp_path, groups=2))
    training = eng._training
    try:
        losses, ref_losses = [], []
        for step in range(4):
            loss = loss_of(model, step)
            loss.backward()
            ref_loss = loss_of(ref, step)
            ref_loss.backward()
            prefetch = training._after.prefetch
            assert prefetch.started
            if step == 0:
                assert not prefetch._futures  # no state before the first step
            else:
                shards = training.live_shards()
                groups = plan_groups(shards, 8 * KiB)
                assert len(groups) > 2  # the premise: the prefetch covers only part of the step
                expected = {k for g in groups[:2] for s in g for k in (s.master_key, s.exp_avg_key, s.exp_avg_sq_key)}
                assert set(prefetch._futures) == expected
            eng.step()
            eng.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
            assert not training._after.prefetch.started
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        assert losses == ref_losses
    finally:
        eng.close()


def run_mixed(tmp_path, groups: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Accumulation, a skipped step, forward-only calls, zero_grad without a step and a checkpoint
    load between backward and step."""
    torch.manual_seed(0)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config(tmp_path, groups, f"store{groups}"))
    losses = []
    try:
        for step in range(3):
            for micro in range(2):
                loss = loss_of(model, 2 * step + micro) / 2
                loss.backward()
                losses.append(loss.item())
            with torch.no_grad():
                losses.append(loss_of(model, 100 + step).item())  # forward only, between backward and step
            eng.step()
            eng.zero_grad()
        eng.step()  # skipped: no gradients
        eng.save_checkpoint(tmp_path / f"ckpt{groups}")
        loss_of(model, 50).backward()  # its state prefetch read the state the load replaces
        eng.zero_grad()
        assert eng._training._after.prefetch.started
        eng.load_checkpoint(tmp_path / f"ckpt{groups}")
        assert not eng._training._after.prefetch.started
        for step in range(2):
            loss = loss_of(model, 60 + step)
            loss.backward()
            losses.append(loss.item())
            eng.step()
            eng.zero_grad()
        eng.unwrap()
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        eng.close()


def test_accumulation_skips_forward_only_and_checkpoint_load_equal_the_engine_without_prefetch(tmp_path):
    losses, params = run_mixed(tmp_path, groups=2)
    base_losses, base_params = run_mixed(tmp_path, groups=0)
    assert losses == base_losses
    for name, value in base_params.items():
        assert torch.equal(params[name], value), name


def test_the_setting_is_checked(tmp_path):
    with pytest.raises(ValueError, match="optimizer_prefetch_groups"):
        config(tmp_path, groups=-1)


class _CountingStore:
    """A minimal AsyncTensorStore that counts gets."""

    def __init__(self) -> None:
        self.gets: list[str] = []

    async def get(self, key, device="cpu", *, out=None):
        self.gets.append(key)
        return torch.full((4,), 7.0)

    async def put(self, key, tensor, tier="nvme", compress=None, *, keep=None):
        raise AssertionError("not used")

    def __contains__(self, key):
        return True


def test_prefetched_reads_are_served_once_and_a_failed_one_is_read_again():
    done, failed = concurrent.futures.Future(), concurrent.futures.Future()
    done.set_result(torch.ones(4))
    failed.set_exception(OSError("injected read error"))
    store = _CountingStore()
    view = PrefetchedStore(store, {"a": done, "b": failed})

    async def run():
        return [await view.get(k) for k in ("a", "b", "a")]

    a, b, again = asyncio.run(run())
    assert torch.equal(a, torch.ones(4))
    assert torch.equal(b, torch.full((4,), 7.0)) and torch.equal(again, torch.full((4,), 7.0))
    assert store.gets == ["b", "a"]  # "a" came from the prefetch the first time only
