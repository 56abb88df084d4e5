"""The offloaded AdamW step (engine.optim.step) against torch.optim.AdamW on the same tensors."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading

import pytest
import torch

import tiered
from engine.optim import step as optimizer_step
from engine.optim.clip import clip_coefficient, global_grad_norm, grad_norms
from engine.optim.step_io import plan_groups
from engine.optim.types import AdamHyper, OptimShard
from engine.errors import OptimizerStateError

KiB = 1024
#: Odd sizes; with GROUP_BYTES they make several groups, one shard larger than a group on its own.
SIZES = (1, 7, 1000, 4099, 333, 12345, 2)
GROUP_BYTES = 16 * KiB
LR = 1e-2


def store_config(tmp_path, **changes) -> tiered.StoreConfig:
    return tiered.StoreConfig(
        path=str(tmp_path / "store"), host_bytes=2 * 1024 * KiB, block_size=64 * KiB, queue_depth=8, io_threads=4,
        swap_grow_bytes=1024 * KiB, prefault_host=False, result_pool_bytes=0, **changes,
    )


@pytest.fixture
def store(tmp_path):
    s = tiered.TieredStore.open(store_config(tmp_path))
    yield s
    s.sync.close()


def make_shard(i: int, n: int, dtype: torch.dtype = torch.float32, group: int = 0) -> OptimShard:
    return OptimShard(f"p{i}", n, dtype, f"param/p{i}", f"grad/p{i}", f"master/p{i}", f"m/p{i}", f"v/p{i}", group)


class Run:
    """Shards in a store plus the oracle: torch.optim.AdamW on fp32 Parameters of the same values."""

    def __init__(self, store, sizes=SIZES, dtype=torch.float32, seed=0, param_tier="nvme", **adam) -> None:
        self.store = store
        self.gen = torch.Generator().manual_seed(seed)
        self.shards = [make_shard(i, n, dtype) for i, n in enumerate(sizes)]
        self.params = []
        for shard in self.shards:
            value = torch.randn(shard.numel, generator=self.gen).to(dtype)
            store.sync.put(shard.param_key, value, param_tier)
            self.params.append(torch.nn.Parameter(value.float()))  # the fp32 master the oracle updates
        self.adam = dict(lr=LR, **adam)
        self.oracle = torch.optim.AdamW(self.params, **self.adam)
        self.steps: dict[str, int] = {}

    def hyper(self) -> AdamHyper:
        a = self.adam
        betas = a.get("betas", (0.9, 0.999))
        return AdamHyper(a["lr"], betas[0], betas[1], a.get("eps", 1e-8), a.get("weight_decay", 1e-2),
                         a.get("foreach"), a.get("fused"))

    def new_grads(self, skip: frozenset = frozenset()) -> None:
        for i, (shard, p) in enumerate(zip(self.shards, self.params)):
            if i in skip:
                p.grad = None
                if shard.grad_key in self.store:
                    self.store.sync.delete(shard.grad_key)
                continue
            grad = torch.randn(shard.numel, generator=self.gen)
            p.grad = grad.clone()
            self.store.sync.put(shard.grad_key, grad, "host")

    def step(self, **options):
        stats = optimizer_step.step(self.store, self.shards, self.hyper(), self.steps, group_bytes=GROUP_BYTES,
                                    **options)
        self.steps = dict(stats.step_counts)
        return stats

    def assert_equal(self) -> None:
        for shard, p in zip(self.shards, self.params):
            state = self.oracle.state.get(p)
            if not state:
                assert shard.master_key not in self.store
                continue
            master = self.store.sync.get(shard.master_key)
            assert torch.equal(master, p.detach()), shard.name
            assert torch.equal(self.store.sync.get(shard.exp_avg_key), state["exp_avg"]), shard.name
            assert torch.equal(self.store.sync.get(shard.exp_avg_sq_key), state["exp_avg_sq"]), shard.name
            assert torch.equal(self.store.sync.get(shard.param_key), master.to(shard.train_dtype)), shard.name
            assert self.steps[shard.name] == int(state["step"].item()), shard.name


def test_plan_groups_packs_in_order_and_isolates_large_shards():
    shards = [make_shard(i, n) for i, n in enumerate(SIZES)]
    groups = plan_groups(shards, GROUP_BYTES)
    assert [s for g in groups for s in g] == shards
    assert len(groups) >= 3
    for g in groups:
        assert len(g) == 1 or sum(s.fp32_bytes for s in g) <= GROUP_BYTES
    assert [s.numel for s in groups[-2]] == [12345]  # 48 KiB > one group: alone
    with pytest.raises(ValueError, match="group_bytes"):
        plan_groups(shards, 0)


@pytest.mark.parametrize("tier,compress", [("host", False), ("nvme", False), ("nvme", True), ("host", True)])
def test_ten_steps_equal_torch_adamw(store, tier, compress):
    run = Run(store)
    for _ in range(10):
        run.new_grads()
        run.oracle.step()
        stats = run.step(state_tier=tier, param_tier=tier, compress=compress)
        assert stats.groups == len(plan_groups(run.shards, GROUP_BYTES)) and stats.shards_updated == len(SIZES)
    run.assert_equal()
    big = store.info(run.shards[SIZES.index(12345)].master_key)
    assert big.tiers == (tiered.Tier(tier),)
    if tier == "nvme":
        assert big.codec == ("bplane-zstd" if compress else "raw")
        assert (big.stored_nbytes < big.nbytes) == compress


@pytest.mark.parametrize("path", [{"fused": True}, {"foreach": True}])
def test_fused_and_foreach_math_equal_torch_with_the_same_choice(store, path):
    run = Run(store, **path)
    for _ in range(3):
        run.new_grads()
        run.oracle.step()
        run.step(state_tier="host", param_tier="host")
    run.assert_equal()


@pytest.mark.parametrize("path", [{}, {"fused": True}, {"foreach": True}])
def test_math_in_chunks_equals_torch_on_whole_tensors(store, path):
    """[Note: Chunked AdamW math]: shards cut into 4096-element pieces, several pieces per call and
    several shards per piece run, give torch's bits and step counts on every math path."""
    run = Run(store, sizes=(9000, 5, 4096, 12345), weight_decay=0.1, **path)
    for _ in range(3):
        run.new_grads()
        run.oracle.step()
        run.step(state_tier="host", param_tier="host", math_chunk_bytes=4 * 4096)
    run.assert_equal()
    with pytest.raises(ValueError, match="math_chunk_bytes"):
        run.step(math_chunk_bytes=1000)


def test_bf16_params_with_fp32_master_equal_torch_on_fp32_master(store):
    run = Run(store, dtype=torch.bfloat16, weight_decay=0.1)
    for _ in range(5):
        run.new_grads()
        run.oracle.step()
        run.step(state_tier="nvme", param_tier="host", compress=True)
    run.assert_equal()
    shard = run.shards[2]
    assert store.info(shard.param_key).dtype == torch.bfloat16
    assert store.info(shard.master_key).dtype == torch.float32


def test_shards_without_gradient_are_skipped_like_torch(store):
    run = Run(store)
    skips = [frozenset({1}), frozenset(), frozenset({0, 3}), frozenset({1}), frozenset()]
    for skip in skips:
        run.new_grads(skip)
        run.oracle.step()
        stats = run.step(state_tier="host", param_tier="host")
        assert stats.shards_skipped == len(skip) and stats.shards_updated == len(SIZES) - len(skip)
    run.assert_equal()
    assert run.steps["p1"] == 3 and run.steps["p0"] == 4 and run.steps["p2"] == 5


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_equals_clip_grad_norm(store, max_norm):
    run = Run(store)
    for _ in range(4):
        run.new_grads()
        expected = torch.nn.utils.clip_grad_norm_(run.params, max_norm)
        run.oracle.step()
        stats = run.step(state_tier="host", param_tier="host", max_grad_norm=max_norm)
        assert stats.grad_norm == float(expected)
        assert (stats.clip_coef < 1.0) == (max_norm < 1.0)
    run.assert_equal()


def test_clipping_with_precomputed_norms_and_all_reduce(store):
    run = Run(store)
    run.new_grads(skip=frozenset({2}))
    norms = grad_norms(store, run.shards, group_bytes=GROUP_BYTES)
    assert set(norms) == {s.name for s in run.shards} - {"p2"}
    local = global_grad_norm(norms, run.shards)
    assert torch.equal(local, torch.nn.utils.get_total_norm([p.grad for p in run.params if p.grad is not None]))
    seen = []

    def all_reduce(sq: torch.Tensor) -> torch.Tensor:  # as if a second rank held the same gradients
        seen.append(sq.clone())
        return sq * 2

    stats = run.step(state_tier="host", param_tier="host", max_grad_norm=0.1, grad_norms=norms, all_reduce=all_reduce)
    assert len(seen) == 1 and torch.allclose(seen[0], local * local)
    assert stats.grad_norm == pytest.approx(float(local) * 2 ** 0.5, rel=1e-6)
    assert stats.clip_coef == pytest.approx(float(clip_coefficient(torch.tensor(stats.grad_norm), 0.1)), rel=1e-6)
    # The step applied exactly that coefficient: equal to torch AdamW on grads scaled by it.
    coef = clip_coefficient((local * local * 2).sqrt(), 0.1)
    for p in run.params:
        if p.grad is not None:
            p.grad.mul_(coef)
    run.oracle.step()
    run.assert_equal()


def one_copy_shard(i: int, n: int) -> OptimShard:
    """A shard whose fp32 parameter is its own master."""
    return OptimShard(f"p{i}", n, torch.float32, f"param/p{i}", f"grad/p{i}", f"param/p{i}", f"m/p{i}", f"v/p{i}")


def test_a_parameter_that_is_its_own_master_is_written_once_per_step(store):
    run = Run(store)
    run.shards = [one_copy_shard(i, n) for i, n in enumerate(SIZES)]
    numel = sum(SIZES)
    for k in range(4):
        run.new_grads()
        run.oracle.step()
        stats = run.step(state_tier="nvme", param_tier="nvme", compress=True)
        # read: gradient and parameter (+ two moments after the first step); written: parameter + moments
        assert stats.bytes_read == (8 if k == 0 else 16) * numel and stats.bytes_written == 12 * numel
    run.assert_equal()
    assert not any(k.startswith("master/") for k in store.keys())
    assert store.info("param/p5").codec == "raw" and store.info("m/p5").codec == "bplane-zstd"
    with pytest.raises(ValueError, match="one tier"):
        run.step(state_tier="nvme", param_tier="host")
    with pytest.raises(ValueError, match="only when it is fp32"):
        OptimShard("x", 3, torch.bfloat16, "param/x", "grad/x", "param/x", "m/x", "v/x")


def test_atomic_groups_commit_with_their_progress_entry_and_a_recorded_clip_coefficient(store):
    run = Run(store)
    run.shards = [one_copy_shard(i, n) for i, n in enumerate(SIZES)]
    groups = plan_groups(run.shards, GROUP_BYTES)
    run.new_grads()
    coef = torch.tensor(0.25)
    for p in run.params:
        p.grad.mul_(coef)
    run.oracle.step()
    marks: list[list[str]] = []

    def progress(names: list[str]) -> tuple[str, torch.Tensor]:
        marks.append(names)
        return f"done/{names[0]}", torch.tensor([len(names)], dtype=torch.int32)

    commits = store.stats().manifest_commits
    run.step(state_tier="nvme", param_tier="nvme", clip_coef=coef, max_grad_norm=1e-9, atomic=True,
             progress=progress)  # the recorded coefficient wins over max_grad_norm
    run.assert_equal()
    assert marks == [[s.name for s in g] for g in groups]
    assert all(f"done/{g[0].name}" in store for g in groups)
    assert store.stats().manifest_commits - commits == len(groups)  # one transaction per group
    with pytest.raises(ValueError, match="atomic=True"):
        run.step(state_tier="host", param_tier="host", atomic=True)


def test_init_state_ahead_equals_lazy_init(tmp_path):
    results = []
    for eager in (False, True):
        with tiered.TieredStore.open(store_config(tmp_path / str(eager))) as store:
            run = Run(store)
            if eager:
                created = optimizer_step.init_state(store, run.shards, state_tier="nvme", group_bytes=GROUP_BYTES)
                assert created == len(SIZES)
                assert optimizer_step.init_state(store, run.shards, group_bytes=GROUP_BYTES) == 0
                assert torch.equal(store.sync.get(run.shards[3].exp_avg_key), torch.zeros(SIZES[3]))
            for _ in range(2):
                run.new_grads()
                run.step()
            results.append([store.sync.get(s.master_key) for s in run.shards])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_stats_count_every_byte(store):
    run = Run(store, dtype=torch.bfloat16)
    run.new_grads(skip=frozenset({0}))
    first = run.step(state_tier="host", param_tier="host")
    n = sum(SIZES[1:])
    # first step: read grad (4) + param (2); write master, moments (12) + param (2)
    assert (first.bytes_read, first.bytes_written) == (6 * n, 14 * n)
    run.new_grads()
    second = run.step(state_tier="host", param_tier="host")
    total = sum(SIZES)
    assert second.bytes_read == 16 * n + 6 * SIZES[0]  # p0 starts now: grad + param
    assert second.bytes_written == 14 * total
    assert second.seconds >= second.io_stall_seconds >= 0 and second.update_seconds > 0


class GatedStore:
    """Delegates to a real store. A get of group g cannot finish before the update of group g-1 has
    started, nor a put of group g before the update of group g+1; and the update of group i waits
    (up to a timeout) until gets of group i+1 and puts of group i-1 are in flight, then records what
    it saw. A step that does not overlap them records zeros (after waiting out the timeouts)."""

    def __init__(self, store, group_of: dict[str, int], timeout: float = 2.0) -> None:
        self.store = store
        self.group_of = group_of
        self.timeout = timeout
        self.updates_started: set[int] = set()
        self.gets_in_flight: dict[int, int] = {}
        self.puts_in_flight: dict[int, int] = {}
        self.seen_at_update: dict[int, tuple[int, int]] = {}
        self.changed = threading.Condition()
        self.last_group = -1

    def __contains__(self, key: object) -> bool:
        return key in self.store

    def on_event(self, event: str, group: int) -> None:
        if event != "update":
            return
        with self.changed:
            self.updates_started.add(group)
            self.changed.wait_for(
                lambda: (group == self.last_group or self.gets_in_flight.get(group + 1, 0) > 0)
                and (group == 0 or self.puts_in_flight.get(group - 1, 0) > 0),
                timeout=self.timeout,
            )
            self.seen_at_update[group] = (self.gets_in_flight.get(group + 1, 0), self.puts_in_flight.get(group - 1, 0))

    def _count(self, counts: dict[int, int], group: int, delta: int) -> None:
        with self.changed:
            counts[group] = counts.get(group, 0) + delta
            self.changed.notify_all()

    async def _gate(self, group: int) -> None:
        for _ in range(int(self.timeout / 0.01)):
            if group in self.updates_started:
                return
            await asyncio.sleep(0.01)

    async def get(self, key, device="cpu", *, out=None):
        g = self.group_of[key.split("/", 1)[1]]
        self._count(self.gets_in_flight, g, 1)
        try:
            result = await self.store.get(key, device, out=out)
            if g > 0:
                await self._gate(g - 1)
            return result
        finally:
            self._count(self.gets_in_flight, g, -1)

    async def put(self, key, tensor, tier="nvme", compress=None, *, keep=None):
        g = self.group_of[key.split("/", 1)[1]]
        self._count(self.puts_in_flight, g, 1)
        try:
            await self.store.put(key, tensor, tier, compress, keep=keep)
            if g < self.last_group:
                await self._gate(g + 1)
        finally:
            self._count(self.puts_in_flight, g, -1)

    async def put_many(self, items, tier="nvme", compress=None, *, atomic=False, keep=None):
        g = self.group_of[next(iter(items)).split("/", 1)[1]]
        self._count(self.puts_in_flight, g, 1)
        try:
            await self.store.put_many(items, tier, compress, atomic=atomic, keep=keep)
            if g < self.last_group:
                await self._gate(g + 1)
        finally:
            self._count(self.puts_in_flight, g, -1)


def test_pipeline_reads_ahead_and_writes_behind_while_updating(store):
    run = Run(store)
    groups = plan_groups(run.shards, GROUP_BYTES)
    gated = GatedStore(store, {s.name: i for i, g in enumerate(groups) for s in g})
    gated.last_group = len(groups) - 1
    for _ in range(2):
        run.new_grads()
        stats = optimizer_step.step(gated, run.shards, run.hyper(), run.steps, group_bytes=GROUP_BYTES,
                                    state_tier="host", param_tier="host", on_event=gated.on_event)
        run.steps = dict(stats.step_counts)
        run.oracle.step()
        last = len(groups) - 1
        for i in range(len(groups)):
            reading_next, writing_previous = gated.seen_at_update[i]
            assert (reading_next > 0) == (i < last), (i, gated.seen_at_update)
            assert (writing_previous > 0) == (i > 0), (i, gated.seen_at_update)
        gated.updates_started.clear()
    run.assert_equal()


def test_step_from_inside_a_running_event_loop(store):
    run = Run(store)
    run.new_grads()
    run.oracle.step()

    async def trainer():
        return run.step(state_tier="host", param_tier="host")

    stats = asyncio.run(trainer())
    assert stats.shards_updated == len(SIZES)
    run.assert_equal()


def test_step_async_is_awaitable_from_any_loop(store):
    run = Run(store)
    run.new_grads()
    run.oracle.step()
    stats = asyncio.run(optimizer_step.step_async(store, run.shards, run.hyper(), {}, state_tier="host",
                                                  param_tier="host", group_bytes=GROUP_BYTES))
    run.steps = dict(stats.step_counts)
    run.assert_equal()


def test_missing_state_after_steps_is_an_error(store):
    run = Run(store)
    run.new_grads()
    run.step(state_tier="host", param_tier="host")
    store.sync.delete(run.shards[2].master_key)
    run.new_grads()
    with pytest.raises(OptimizerStateError, match="p2.*1 steps.*master/p2"):
        run.step(state_tier="host", param_tier="host")


def test_wrong_gradient_size_is_an_error(store):
    run = Run(store)
    run.new_grads()
    store.sync.put(run.shards[3].grad_key, torch.zeros(5), "host")
    with pytest.raises(OptimizerStateError, match="grad/p3.*5 elements, expected 4099"):
        run.step()


def test_invalid_arguments(store):
    run = Run(store, sizes=(3, 4))
    hyper = run.hyper()
    with pytest.raises(ValueError, match="state_tier"):
        optimizer_step.step(store, run.shards, hyper, {}, state_tier="device")
    with pytest.raises(ValueError, match="named 'p0'"):
        optimizer_step.step(store, [run.shards[0], run.shards[0]], hyper, {})
    with pytest.raises(ValueError, match="group 1"):
        optimizer_step.step(store, [make_shard(9, 3, group=1)], hyper, {})
    with pytest.raises(ValueError, match=r"steps\['p0'\]"):
        optimizer_step.step(store, run.shards, hyper, {"p0": -1})
    with pytest.raises(TypeError, match="AdamHyper"):
        optimizer_step.step(store, run.shards, [], {})
    with pytest.raises(ValueError, match="numel"):
        make_shard(0, 0)
    with pytest.raises(ValueError, match="must differ"):
        OptimShard("x", 1, torch.float32, "k", "k", "a", "b", "c")
    with pytest.raises(ValueError, match="lr"):
        AdamHyper(lr=-1.0)


class FailingStore:
    """A real store whose puts of one key fail."""

    def __init__(self, store, bad_key: str) -> None:
        self.store, self.bad_key = store, bad_key

    def __contains__(self, key: object) -> bool:
        return key in self.store

    async def get(self, key, device="cpu", *, out=None):
        return await self.store.get(key, device, out=out)

    async def put(self, key, tensor, tier="nvme", compress=None, *, keep=None):
        if key == self.bad_key:
            raise tiered.TransferError(f"injected failure writing {key}")
        await self.store.put(key, tensor, tier, compress, keep=keep)

    async def put_many(self, items, tier="nvme", compress=None, *, atomic=False, keep=None):
        if self.bad_key in items:
            raise tiered.TransferError(f"injected failure writing {self.bad_key}")
        await self.store.put_many(items, tier, compress, atomic=atomic, keep=keep)


def test_a_failed_write_fails_the_step_and_leaves_nothing_running(store, caplog):
    run = Run(store)
    run.new_grads()
    failing = FailingStore(store, run.shards[1].exp_avg_key)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(tiered.TransferError, match="m/p1"):
            optimizer_step.step(failing, run.shards, run.hyper(), {}, group_bytes=GROUP_BYTES)
        gc.collect()
    assert not caplog.records  # no task left pending or with an unretrieved exception
    # The group's state write failed, so its new parameters were not written either.
    assert run.shards[1].exp_avg_key not in store and run.shards[1].master_key not in store
    assert torch.equal(store.sync.get(run.shards[1].param_key), run.params[1])


def test_a_failed_update_still_finishes_the_previous_groups_writes(store):
    run = Run(store)
    run.new_grads()
    groups = plan_groups(run.shards, GROUP_BYTES)

    def fail_second_update(event: str, group: int) -> None:
        if event == "update" and group == 1:
            raise RuntimeError("injected failure in the update of group 1")

    with pytest.raises(RuntimeError, match="group 1"):
        optimizer_step.step(store, run.shards, run.hyper(), {}, group_bytes=GROUP_BYTES, on_event=fail_second_update)
    for shard in groups[0]:  # written in full: master, both moments and the new parameter shard
        master = store.sync.get(shard.master_key)
        assert torch.equal(store.sync.get(shard.param_key), master)
        assert shard.exp_avg_key in store and shard.exp_avg_sq_key in store
    assert all(s.master_key not in store for g in groups[1:] for s in g)
