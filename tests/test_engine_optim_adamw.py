"""engine.AdamW: a torch.optim.Optimizer built without parameters, bound by the engine, whose step
runs the offloaded pipeline; torch LR schedulers drive its lr."""

from __future__ import annotations

import warnings

import pytest
import torch

import tiered
from engine.optim.adamw import AdamW
from engine.config import EngineConfig
from engine.optim.types import AdamHyper, OptimShard

KiB = 1024
SIZES = (5, 300, 2049)


@pytest.fixture
def config(tmp_path) -> EngineConfig:
    store = tiered.StoreConfig(path=str(tmp_path / "store"), host_bytes=1024 * KiB, block_size=64 * KiB,
                               swap_grow_bytes=1024 * KiB, prefault_host=False, result_pool_bytes=0)
    return EngineConfig(store=store, param_tier="host", optimizer_tier="nvme", optimizer_group_bytes=4 * KiB,
                        compress_optimizer=True)


class Bound:
    """An engine.AdamW bound the way the engine binds it: its step runs ``run_step`` on the store."""

    def __init__(self, store: tiered.TieredStore, config: EngineConfig, optimizer: AdamW, seed: int = 0) -> None:
        self.store, self.config, self.optimizer = store, config, optimizer
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]
        self.shards = [OptimShard(f"w{i}", n, torch.float32, f"param/w{i}", f"grad/w{i}", f"master/w{i}",
                                  f"m/w{i}", f"v/w{i}") for i, n in enumerate(SIZES)]
        for shard, p in zip(self.shards, self.params):
            store.sync.put(shard.param_key, p.detach(), config.param_tier)
        self.gen = gen
        self.zeroed: list[bool] = []
        self.stats = None
        optimizer._bind(self.params, self._step, self.zeroed.append)

    def _step(self) -> None:
        self.stats = self.optimizer.run_step(self.store, self.shards, config=self.config)

    def grads(self) -> list[torch.Tensor]:
        grads = [torch.randn(n, generator=self.gen) for n in SIZES]
        for shard, g in zip(self.shards, grads):
            self.store.sync.put(shard.grad_key, g, self.config.grad_tier)
        return grads

    def master(self, i: int) -> torch.Tensor:
        return self.store.sync.get(self.shards[i].master_key)


def test_defaults_and_validation():
    opt = AdamW()
    group = opt.param_groups[0]
    assert group["params"] == [] and group["lr"] == 1e-3 and group["betas"] == (0.9, 0.999)
    assert group["eps"] == 1e-8 and group["weight_decay"] == 0.01 and not opt.bound
    assert opt.hyperparameters() == [AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01)]
    assert isinstance(opt, torch.optim.Optimizer)
    for bad in (dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(betas=(0.9,)), dict(eps=-1e-8), dict(weight_decay=-0.1)):
        with pytest.raises(ValueError):
            AdamW(**bad)
    with pytest.raises(ValueError, match="foreach and fused"):
        AdamW(foreach=True, fused=True)


def test_step_before_bind_is_a_clear_error():
    with pytest.raises(RuntimeError, match="before the optimizer was bound.*engine.wrap"):
        AdamW().step()


def test_bind_once_with_torch_checks(config):
    opt = AdamW()
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="non-leaf"):
        opt._bind([p * 2], lambda: None)
    assert opt.param_groups[0]["params"] == [] and not opt.bound
    opt._bind([p], lambda: None)
    assert opt.param_groups[0]["params"] == [p] and opt.bound
    with pytest.raises(RuntimeError, match="already bound"):
        opt._bind([p], lambda: None)


def test_steps_equal_torch_adamw_and_state_dict_round_trips(config):
    with tiered.TieredStore.open(config.store) as store:
        bound = Bound(store, config, AdamW(lr=0.05, betas=(0.8, 0.99), weight_decay=0.1))
        oracle_params = [torch.nn.Parameter(p.detach().clone()) for p in bound.params]
        oracle = torch.optim.AdamW(oracle_params, lr=0.05, betas=(0.8, 0.99), weight_decay=0.1)
        for _ in range(4):
            for p, g in zip(oracle_params, bound.grads()):
                p.grad = g
            oracle.step()
            bound.optimizer.step()
        for i, p in enumerate(oracle_params):
            assert torch.equal(bound.master(i), p.detach())
        assert bound.optimizer.shard_steps == {"w0": 4, "w1": 4, "w2": 4}
        assert bound.stats.shards_updated == 3 and bound.stats.bytes_written > 0
        assert store.info("master/w2").codec == "bplane-zstd"  # optimizer_tier nvme, compressed
        assert store.info("param/w2").tiers == (tiered.Tier.HOST,)  # param_tier host
        sd = bound.optimizer.state_dict()
        assert sd["shard_steps"] == {"w0": 4, "w1": 4, "w2": 4}
        fresh = AdamW()
        fresh._bind([torch.nn.Parameter(torch.zeros(n)) for n in SIZES], lambda: None)
        fresh.load_state_dict(sd)
        assert fresh.shard_steps == bound.optimizer.shard_steps
        assert fresh.param_groups[0]["lr"] == 0.05 and fresh.param_groups[0]["betas"] == (0.8, 0.99)
        with pytest.raises(ValueError, match="shard_steps"):
            fresh.load_state_dict(dict(sd, shard_steps={"w0": -1}))


@pytest.mark.parametrize("make_scheduler", [
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3),
])
@pytest.mark.parametrize("before_bind", [True, False])
def test_lr_scheduler_drives_the_learning_rate(config, make_scheduler, before_bind):
    with tiered.TieredStore.open(config.store) as store:
        optimizer = AdamW(lr=0.1)
        scheduler = make_scheduler(optimizer) if before_bind else None
        bound = Bound(store, config, optimizer)
        scheduler = scheduler or make_scheduler(optimizer)
        oracle_params = [torch.nn.Parameter(p.detach().clone()) for p in bound.params]
        oracle = torch.optim.AdamW(oracle_params, lr=0.1)
        oracle_scheduler = make_scheduler(oracle)
        lrs = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
            for _ in range(5):
                for p, g in zip(oracle_params, bound.grads()):
                    p.grad = g
                oracle.step()
                oracle_scheduler.step()
                optimizer.step()
                lrs.append(optimizer.param_groups[0]["lr"])
                scheduler.step()
        assert len(set(lrs)) > 1
        assert optimizer.param_groups[0]["lr"] == oracle.param_groups[0]["lr"]
        for i, p in enumerate(oracle_params):
            assert torch.equal(bound.master(i), p.detach())


def test_zero_grad_clears_params_and_calls_the_engine(config):
    with tiered.TieredStore.open(config.store) as store:
        bound = Bound(store, config, AdamW())
        bound.params[0].grad = torch.ones(SIZES[0])
        bound.optimizer.zero_grad()
        assert bound.params[0].grad is None and bound.zeroed == [True]
        bound.optimizer.zero_grad(set_to_none=False)
        assert bound.zeroed == [True, False]


def test_closure_runs_with_grad_enabled(config):
    with tiered.TieredStore.open(config.store) as store:
        bound = Bound(store, config, AdamW())
        bound.grads()
        with torch.no_grad():
            loss = bound.optimizer.step(lambda: torch.is_grad_enabled())
        assert loss is True and bound.stats is not None
