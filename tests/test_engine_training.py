"""Single-process training through the engine: engine.AdamW bound by wrap, gradient shards offloaded
to the store in backward, eng.step() streaming the offloaded AdamW. The oracle is plain torch:
the same model unwrapped with torch.optim.AdamW (losses and parameters compared exactly)."""

from __future__ import annotations

import copy
import math
from typing import Callable, Optional

import pytest
import torch
from torch import nn

import engine
import tiered
from engine.demo import GPT, BigramStream, GPTConfig
from engine.paging.layout import grad_key, optim_keys
from engine.optim.step_record import StepRecord
from engine_models import ConvNet, TinyGPT, gpt_tokens, images, store_config

KiB = 1024
LR = 1e-2


def training_config(tmp_path, *, param_tier: str = "nvme", optimizer_tier: str = "nvme", grad_tier: str = "host",
                    compress: bool = False, max_grad_norm: Optional[float] = None, train_dtype: Optional[str] = None,
                    group_bytes: int = 8 * KiB, **store_kw) -> engine.EngineConfig:
    """Small groups (several per step) and budgets tight enough to evict."""
    return engine.EngineConfig(host_budget="host_tier",
        store=store_config(tmp_path, **store_kw), param_tier=param_tier, optimizer_tier=optimizer_tier,
        grad_tier=grad_tier, compress_optimizer=compress, max_grad_norm=max_grad_norm, train_dtype=train_dtype,
        optimizer_group_bytes=group_bytes, prefetch_bytes=16 * KiB,
    )


def gpt_loss(model: nn.Module, i: int) -> torch.Tensor:
    return model(gpt_tokens(seed=i)).float().pow(2).mean()


def train_both(
    model: nn.Module,
    config: engine.EngineConfig,
    *,
    steps: int = 10,
    micro: int = 1,
    weight_decay: float = 0.01,
    loss_fn: Callable[[nn.Module, int], torch.Tensor] = gpt_loss,
    scheduler: Optional[Callable[[torch.optim.Optimizer], object]] = None,
    norms: Optional[list[tuple[Optional[float], float]]] = None,
) -> tuple[list[float], list[float], engine.Engine, nn.Module]:
    """Train ``model`` wrapped (engine.AdamW) and an unwrapped copy (torch.optim.AdamW) on the same
    batches; returns both loss curves, the open engine and the reference model. ``norms`` gets
    each step's (eng.get_global_grad_norm(), the reference's total gradient norm)."""
    ref = copy.deepcopy(model)
    opt = engine.AdamW(lr=LR, weight_decay=weight_decay)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=weight_decay)
    sched = scheduler(opt) if scheduler is not None else None  # created before wrap: the group exists already
    ref_sched = scheduler(ref_opt) if scheduler is not None else None
    eng = engine.wrap(model, optimizer=opt, config=config)
    losses, ref_losses = [], []
    try:
        for step in range(steps):
            total = ref_total = 0.0
            for m in range(micro):
                loss = loss_fn(model, step * micro + m) / micro
                loss.backward()
                ref_loss = loss_fn(ref, step * micro + m) / micro
                ref_loss.backward()
                total += loss.item()
                ref_total += ref_loss.item()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), config.max_grad_norm or float("inf"))
            eng.step()
            if norms is not None:
                norms.append((eng.get_global_grad_norm(), ref_norm.item()))
            eng.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
            if sched is not None:
                sched.step()
                ref_sched.step()
            losses.append(total)
            ref_losses.append(ref_total)
    except BaseException:
        eng.close()
        raise
    return losses, ref_losses, eng, ref


def assert_trained_equal(model: nn.Module, eng: engine.Engine, ref: nn.Module) -> None:
    eng.unwrap()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("param_tier,optimizer_tier,grad_tier,compress", [
    ("nvme", "nvme", "host", False),
    ("nvme", "nvme", "nvme", True),
    ("host", "host", "host", False),
    ("host", "nvme", "host", True),
    ("device", "host", "nvme", False),
])
def test_losses_equal_torch_adamw_over_ten_steps(tmp_path, param_tier, optimizer_tier, grad_tier, compress):
    torch.manual_seed(0)
    model = TinyGPT()
    config = training_config(tmp_path, param_tier=param_tier, optimizer_tier=optimizer_tier, grad_tier=grad_tier,
                             compress=compress, device_bytes=64 * KiB)
    losses, ref_losses, eng, ref = train_both(model, config, weight_decay=0.1)
    assert losses == ref_losses and losses[-1] < losses[0]
    stats = eng.stats()
    assert stats.optimizer_steps == 10 and stats.optimizer_seconds > 0
    assert eng.completed_steps == 10 and set(eng.optimizer.shard_steps.values()) == {10}
    if compress:
        _, exp_avg_key, _ = optim_keys("blocks.0.fc.weight", 0)
        assert eng.store.info(exp_avg_key).codec == "bplane-zstd"  # one slot, written in place
        if param_tier == optimizer_tier:  # the parameter is its own master, stored as a parameter: raw
            assert optim_keys("blocks.0.fc.weight", 0)[0] not in eng.store
            assert eng.store.info("param/blocks.0.fc.weight").codec == "raw"
        else:
            assert eng.store.info(optim_keys("blocks.0.fc.weight", 0)[0]).codec == "bplane-zstd"
    assert_trained_equal(model, eng, ref)


def test_gradient_accumulation_over_two_micro_batches(tmp_path):
    torch.manual_seed(1)
    model = TinyGPT()
    with engine.wrap(copy.deepcopy(model), config=training_config(tmp_path / "plain")) as plain:
        assert plain.get_global_grad_norm() is None  # no engine.AdamW
    norms: list = []
    losses, ref_losses, eng, ref = train_both(model, training_config(tmp_path), steps=5, micro=2, norms=norms)
    assert losses == ref_losses
    assert all(got == want > 0 for got, want in norms), norms  # without clipping too: clip_grad_norm_'s norm
    assert eng.stats().grad_norm == norms[-1][0]
    assert_trained_equal(model, eng, ref)


@pytest.mark.parametrize("grad_tier,optimizer_tier", [("host", "nvme"), ("nvme", "nvme"), ("host", "host")])
def test_global_norm_clipping_equals_clip_grad_norm(tmp_path, grad_tier, optimizer_tier):
    """Also with the gradients lent to an in-place step (both tiers host), which clips new tensors."""
    torch.manual_seed(2)
    model = TinyGPT()
    room = {"host_bytes": 16 * 1024 * KiB} if optimizer_tier == "host" else {}  # else tight enough to evict
    config = training_config(tmp_path, max_grad_norm=0.5, grad_tier=grad_tier, optimizer_tier=optimizer_tier, **room)
    norms: list = []
    losses, ref_losses, eng, ref = train_both(model, config, steps=6, micro=2, norms=norms)
    last = eng._training.counters.last
    assert last is not None and last.clip_coef is not None and last.clip_coef < 1.0  # clipping was active
    if optimizer_tier == "host":
        assert last.bytes_read == 0  # every gradient was lent, not copied
    assert losses == ref_losses
    assert all(got == want > 0.5 for got, want in norms), norms  # the norm before clipping
    assert_trained_equal(model, eng, ref)


def clip_then_step(model: nn.Module, ref: nn.Module, eng: engine.Engine, ref_opt: torch.optim.Optimizer, step: int,
                   clip: float, ref_clip: float) -> torch.Tensor:
    """Two micro-batches' backward on both models, ``eng.clip_grad_norm_(clip)`` and torch's
    ``clip_grad_norm_(ref_clip)`` (asserted to return the same norm), then both steps."""
    for m in range(2):
        (gpt_loss(model, 2 * step + m) / 2).backward()
        (gpt_loss(ref, 2 * step + m) / 2).backward()
    got = eng.clip_grad_norm_(clip)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), ref_clip)
    assert got.dtype == torch.float32 and got.shape == () and torch.equal(got, want), (got, want)
    eng.step()
    eng.zero_grad()
    ref_opt.step()
    ref_opt.zero_grad()
    assert eng.get_global_grad_norm() == want.item()
    return want


@pytest.mark.parametrize("config_clip,call_clip", [(None, 0.5), (0.3, 1.0), (1.0, 0.3)])
def test_clip_grad_norm_clips_the_next_step_as_torch_does(tmp_path, config_clip, call_clip):
    """eng.clip_grad_norm_ where a plain loop calls torch's (after the window's last backward): the
    same norm, and the step clips to the smaller of its max_norm and EngineConfig.max_grad_norm,
    bit for bit; every other step passes math.inf, which only measures (and the config clips)."""
    torch.manual_seed(5)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=training_config(tmp_path, max_grad_norm=config_clip))
    clipped = 0
    try:
        for step in range(6):
            clip = call_clip if step % 2 == 0 else math.inf
            smaller = min(clip, config_clip or math.inf)
            norm = clip_then_step(model, ref, eng, ref_opt, step, clip, smaller)
            clipped += bool(norm > smaller)
    except BaseException:
        eng.close()
        raise
    assert clipped >= 2  # the clipping acted
    assert_trained_equal(model, eng, ref)


def test_clip_grad_norm_applies_to_one_step_and_refuses_a_backward_after_it(tmp_path):
    """The clipping asked for covers the next step only, zero_grad drops it, a backward between it
    and the step is refused (it would clip gradients the norm did not cover), and bad arguments
    are refused with their value."""
    torch.manual_seed(6)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=training_config(tmp_path))
    try:
        for bad in (0, -1.0, True, "1"):
            with pytest.raises(ValueError, match=repr(bad)):
                eng.clip_grad_norm_(bad)
        with pytest.raises(ValueError, match="norm_type=1"):
            eng.clip_grad_norm_(1.0, norm_type=1)
        assert clip_then_step(model, ref, eng, ref_opt, 0, 0.1, 0.1) > 0.1
        assert clip_then_step(model, ref, eng, ref_opt, 1, math.inf, math.inf) > 0.1  # not clipped again
        eng.clip_grad_norm_(0.1)
        eng.zero_grad()  # drops the gradients and the clipping asked for them
        assert clip_then_step(model, ref, eng, ref_opt, 2, math.inf, math.inf) > 0.1
        gpt_loss(model, 6).backward()
        eng.clip_grad_norm_(0.1)
        with pytest.raises(RuntimeError, match=r"after eng.clip_grad_norm_\(0.1\) and before the step"):
            gpt_loss(model, 7).backward()
        eng.zero_grad()  # the refused backward's gradients go with the others: training goes on
        ref_opt.zero_grad()
        assert clip_then_step(model, ref, eng, ref_opt, 4, 0.1, 0.1) > 0.1
        gpt_loss(model, 10).backward()
        gpt_loss(ref, 10).backward()
        eng.clip_grad_norm_(0.1)
        assert eng.clip_grad_norm_(math.inf) > 0.1  # asked twice: the smaller norm, as two clips in a row
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        eng.step()
        ref_opt.step()
        eng.zero_grad()
        ref_opt.zero_grad()
    except BaseException:
        eng.close()
        raise
    assert_trained_equal(model, eng, ref)


def test_clip_grad_norm_with_a_torch_optimizer_is_torchs(tmp_path):
    """With a torch optimizer the gradients are the parameters' .grad: eng.clip_grad_norm_ is
    torch's clip_grad_norm_ over the model, any norm type."""
    torch.manual_seed(7)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    with engine.wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     config=training_config(tmp_path)) as eng:
        gpt_loss(model, 0).backward()
        gpt_loss(ref, 0).backward()
        got = eng.clip_grad_norm_(0.05, norm_type=1.0)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=1.0)
        assert torch.equal(got, want) and want > 0.05
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_a_torch_lr_scheduler_drives_the_learning_rate(tmp_path):
    torch.manual_seed(3)
    model = TinyGPT()
    losses, ref_losses, eng, ref = train_both(
        model, training_config(tmp_path), steps=6,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    )
    assert eng.optimizer.param_groups[0]["lr"] == LR / 7
    assert losses == ref_losses
    assert_trained_equal(model, eng, ref)


def test_demo_gpt_with_tied_head_and_a_frozen_layer(tmp_path):
    torch.manual_seed(4)
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_embd=32, n_head=4)
    model = GPT(cfg)
    model.blocks[0].fc.weight.requires_grad_(False)  # frozen: no gradient, no optimizer state, never changes
    data = BigramStream(cfg.vocab_size, cfg.seq_len, 2)

    def loss_fn(m: nn.Module, i: int) -> torch.Tensor:
        x, y = data.batch(i)
        return m(x, y)

    losses, ref_losses, eng, ref = train_both(model, training_config(tmp_path), steps=6, loss_fn=loss_fn)
    assert losses == ref_losses
    assert "blocks.0.fc.weight" not in eng.optimizer.shard_steps
    assert not any(k.startswith("optim/blocks.0.fc.weight/") for k in eng.store.keys())
    assert not any(k.startswith("optim/lm_head") for k in eng.store.keys())  # tied: one shard, named wte.weight
    assert_trained_equal(model, eng, ref)


def test_conv_net_with_batch_norm_buffers(tmp_path):
    torch.manual_seed(5)
    model = ConvNet()
    losses, ref_losses, eng, ref = train_both(
        model, training_config(tmp_path), steps=4, loss_fn=lambda m, i: m(images(seed=i)).pow(2).mean()
    )
    assert losses == ref_losses
    assert_trained_equal(model, eng, ref)


def test_bf16_training_with_fp32_master_weights(tmp_path):
    """Oracle: the model cast to bf16, its gradients upcast to fp32 and stepped by torch.optim.AdamW on
    fp32 master copies (upcast from the bf16 weights), the masters cast back to bf16 after each step."""
    torch.manual_seed(6)
    model = TinyGPT()
    ref = copy.deepcopy(model).to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.1)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1),
                      config=training_config(tmp_path, train_dtype="bfloat16", compress=True))
    try:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert eng.store.info("param/wte.weight").dtype == torch.bfloat16
        losses, ref_losses = [], []
        for step in range(6):
            loss = gpt_loss(model, step)
            loss.backward()
            eng.step()
            eng.zero_grad()
            ref_loss = gpt_loss(ref, step)
            ref_loss.backward()
            for master, p in zip(masters, ref.parameters()):
                master.grad = p.grad.float()
                p.grad = None
            ref_opt.step()
            ref_opt.zero_grad()
            with torch.no_grad():
                for master, p in zip(masters, ref.parameters()):
                    p.copy_(master)
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        assert losses == ref_losses and losses[-1] < losses[0]
        live = {s.name: s for s in eng._training.live_shards()}
        for (name, _), master in zip(ref.named_parameters(), masters):
            assert torch.equal(eng.store.sync.get(live[name].master_key), master.detach().reshape(-1)), name
    finally:
        eng.close()


def test_gradients_go_to_the_store_in_backward(tmp_path):
    torch.manual_seed(7)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, optimizer=engine.AdamW(), config=training_config(tmp_path))
    try:
        for _ in range(2):  # accumulation: the stored shard is the sum
            gpt_loss(model, 0).backward()
            gpt_loss(ref, 0).backward()
        assert all(p.grad is None for p in model.parameters())  # the full gradients are gone
        eng._training.grads.flush()
        for name, q in ref.named_parameters():
            if name == "lm_head.weight":
                continue  # tied to wte.weight: one shard
            assert torch.equal(eng.store.sync.get(grad_key(name)), q.grad.reshape(-1)), name
        numel = sum(p.numel() for p in ref.parameters())
        assert eng.stats().grad_bytes_offloaded == 2 * 4 * numel
        eng.zero_grad()
        assert not any(k.startswith("grad/") for k in eng.store.keys())
    finally:
        eng.close()


def test_model_zero_grad_after_a_step_clears_what_the_step_used(tmp_path):
    """model.zero_grad() never reaches the store (the gradients are not on the parameters), but the
    step consumed them: the next backward starts afresh, as torch's would after model.zero_grad().
    A second step with no backward between still sees the same gradients, as in torch."""
    torch.manual_seed(4)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    # (updates inside backward keep no gradient for a second step: tests/test_engine_step_in_backward.py)
    config = training_config(tmp_path).replace(step_in_backward=False)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1), config=config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    losses = {}
    for m, step in ((model, eng.step), (ref, ref_opt.step)):
        losses[m] = []
        for i in range(3):
            loss = gpt_loss(m, i)
            loss.backward()
            step()
            if i == 1:
                step()  # the same gradients again
            m.zero_grad()
            losses[m].append(loss.item())
    assert losses[model] == losses[ref]
    assert eng.optimizer.shard_steps["wte.weight"] == 4
    assert_trained_equal(model, eng, ref)


def test_step_stats_count_the_bytes_of_every_shard(tmp_path):
    torch.manual_seed(8)
    model = TinyGPT()
    numel = sum(p.numel() for p in model.parameters())
    _, _, eng, _ = train_both(model, training_config(tmp_path).replace(step_in_backward=False), steps=3)
    stats = eng.stats()
    # The step after backward (inside backward: tests/test_engine_step_in_backward.py). The parameter is its own master. The first step reads the gradient and the parameter (its
    # moments are zeros); the later ones the gradient, the parameter and two moments. Each writes
    # the parameter and two moments once (and a small progress entry per group).
    assert stats.optimizer_bytes_read == (8 + 16 + 16) * numel
    assert 3 * 12 * numel <= stats.optimizer_bytes_written < 3 * 12 * numel + 3 * 4096
    assert 0 <= stats.optimizer_stall_seconds <= stats.optimizer_seconds
    as_dict = stats.as_dict()
    assert as_dict["optimizer_steps"] == 3 and as_dict["grad_bytes_offloaded"] == 3 * 4 * numel
    eng.close()


def test_zero_grad_without_set_to_none_keeps_zero_gradients(tmp_path):
    """torch steps a parameter with a zero gradient (its moments decay, weight decay applies) but
    skips one whose gradient is None: zero_grad(set_to_none=False) must keep that difference."""
    torch.manual_seed(9)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.1), config=training_config(tmp_path))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    for m, step, zero in ((model, eng.step, eng.zero_grad), (ref, ref_opt.step, ref_opt.zero_grad)):
        gpt_loss(m, 0).backward()
        step()
        zero(set_to_none=False)
        step()  # zero gradients: still an update
        zero()
        step()  # no gradients: skipped
    assert eng.optimizer.shard_steps["wte.weight"] == 2
    assert_trained_equal(model, eng, ref)


def failed_step(eng: engine.Engine, model: nn.Module, group: int) -> tuple[dict, dict]:
    """``eng.step()`` with an OSError injected into the update of ``group``: the parameter shards in the
    store before and after it."""

    def fail(event: str, index: int) -> None:
        if event == "update" and index == group:
            raise OSError("injected")

    def stored() -> dict:  # the shards as the store holds them (model.state_dict() would finish the step)
        return {n: eng.store.sync.get(f"param/{n}") for n, _ in model.named_parameters()}

    before = stored()
    eng._training.on_event = fail
    try:
        with pytest.raises(OSError, match="injected"):
            eng.step()
    finally:
        eng._training.on_event = None
    return before, stored()


@pytest.mark.parametrize("state", ["nvme", "host-two-slots"])
def test_a_failed_step_is_finished_or_rolled_back(tmp_path, state):
    """State on nvme: a step that fails part way keeps the groups it committed, and the next
    eng.step() (or zero_grad, or forward) finishes it from the stored gradients with the recorded
    values. State in host memory with two slots: it is rolled back and the next step runs again.
    Either way the training equals torch's."""
    torch.manual_seed(10)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    config = training_config(tmp_path).replace(step_in_backward=False)  # the step after backward
    if state != "nvme":
        config = config.replace(optimizer_tier="host", optimizer_in_place=False)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config)
    try:
        for step in range(4):
            gpt_loss(model, step).backward()
            gpt_loss(ref, step).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            if step == 2:
                eng.optimizer.param_groups[0]["lr"] = LR  # the step's values are the ones recorded ...
                before, after = failed_step(eng, model, group=2)
                changed = [k for k in before if not torch.equal(before[k], after[k])]
                assert eng.completed_steps == 2
                if state == "nvme":
                    assert changed and len(changed) < len(before)  # groups 0 and 1 committed
                    eng.optimizer.param_groups[0]["lr"] = 10 * LR  # ... so a change now does not reach it
                    eng.zero_grad()  # the step's gradients are still needed: it is finished first
                    assert eng.completed_steps == 3
                    eng.optimizer.param_groups[0]["lr"] = LR
                    continue
                assert not changed  # rolled back
            eng.step()  # the gradients are still in the store: the step runs again
            eng.zero_grad()
    except BaseException:
        eng.close()
        raise
    assert_trained_equal(model, eng, ref)


@pytest.mark.parametrize("param_tier", ["host", "nvme"])
def test_state_in_host_memory_is_updated_where_it_lies(tmp_path, param_tier):
    """optimizer_tier="host" steps on the store's own memory (store.modify): the same losses as torch
    and as the two-slot step, the state stays in slot 0, and only parameters bound for nvme move
    (the gradients, in host memory, are lent too)."""
    torch.manual_seed(3)
    model = TinyGPT()
    in_place, two_slots = (training_config(tmp_path / d, param_tier=param_tier, optimizer_tier="host",
                                           host_bytes=16 * 1024 * KiB) for d in ("a", "b"))
    two_slots = two_slots.replace(optimizer_in_place=False)
    assert in_place.updates_in_place and not two_slots.updates_in_place
    losses, ref_losses, eng, ref = train_both(copy.deepcopy(model), in_place, steps=3)
    with eng:
        assert losses == ref_losses
        names = [n for n, _ in model.named_parameters()]
        live = [k for n in names for k in optim_keys(n, 0)[1 if param_tier == "host" else 0:]]  # host: one copy
        assert all(k in eng.store for k in live)
        assert not any(k in eng.store for n in names for k in optim_keys(n, 1))
        last = eng._training.counters.last
        assert last.bytes_read == 0
        assert last.bytes_written == (0 if param_tier == "host" else sum(p.numel() * p.element_size()
                                                                           for p in model.parameters()))
    slot_losses, _, eng, _ = train_both(copy.deepcopy(model), two_slots, steps=3)
    with eng:
        assert slot_losses == losses
        assert all(k in eng.store for n in names for k in optim_keys(n, 1))  # three steps: slot 1 is live
    resumed = TinyGPT()
    with engine.wrap(resumed, optimizer=engine.AdamW(lr=LR), config=in_place.replace(resume=True)) as eng:
        state = live
        assert all(eng.store.info(k).tiers == (tiered.Tier.NVME,) for k in state)  # written down at close
        gpt_loss(resumed, 3).backward()
        eng.step()
        assert all(eng.store.info(k).tiers == (tiered.Tier.HOST,) for k in state)  # and back in host memory


def test_gradients_lent_to_an_in_place_step_are_left_as_they_were(tmp_path):
    """The in-place step reads gradients held in host memory where they lie; clipping multiplies new
    tensors, so after the step the store holds the gradients backward gave, as after a copy."""
    torch.manual_seed(4)
    model = TinyGPT()
    config = training_config(tmp_path, optimizer_tier="host", max_grad_norm=1e-3, host_bytes=16 * 1024 * KiB)
    with engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config) as eng:
        gpt_loss(model, 0).backward()
        eng._training.grads.flush()  # the gradients' puts have landed
        names = [n for n, _ in model.named_parameters()]
        assert all(eng.store.info(grad_key(n)).tiers[0] is tiered.Tier.HOST for n in names)
        before = {n: eng.store.sync.get(grad_key(n)) for n in names}
        eng.step()
        last = eng._training.counters.last
        assert last.clip_coef is not None and last.clip_coef < 0.01 and last.bytes_read == 0
        assert all(torch.equal(eng.store.sync.get(grad_key(n)), before[n]) for n in names)


def test_a_failed_in_place_step_leaves_every_shard_whole(tmp_path):
    """In place, the groups before a failure keep their update (as torch's optimizers would), but
    each shard's parameter still equals its master, and training goes on."""
    torch.manual_seed(10)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=training_config(tmp_path, optimizer_tier="host"))
    with eng:
        for step in range(2):
            gpt_loss(model, step).backward()
            eng.step()
            eng.zero_grad()
        gpt_loss(model, 2).backward()
        before, after = failed_step(eng, model, group=2)
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert changed and len(changed) < len(before)  # groups 0 and 1 were updated, the rest not
        assert eng.completed_steps == 2
        for name, value in after.items():
            if name in dict(model.named_parameters()):
                master = eng.store.sync.get(optim_keys(name, 0)[0])
                assert torch.equal(value.reshape(-1).float(), master.reshape(-1)), name
        eng.step()  # the gradients are still in the store: the step runs again
        assert eng.completed_steps == 3


def test_in_place_updates_need_state_in_host_memory(tmp_path):
    with pytest.raises(ValueError, match="optimizer_tier='host'"):
        training_config(tmp_path).replace(optimizer_in_place=True)
    with pytest.raises(ValueError, match="True, False or None"):
        training_config(tmp_path, optimizer_tier="host").replace(optimizer_in_place="yes")


def test_step_inside_forward_is_refused(tmp_path):
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(), config=training_config(tmp_path))
    try:
        handle = model.ln_f.register_forward_pre_hook(lambda *_: eng.step())
        with pytest.raises(RuntimeError, match="while the model is running"):
            model(gpt_tokens())
        handle.remove()
        gpt_loss(model, 0).backward()
        eng.step()
        assert eng.completed_steps == 1
    finally:
        eng.close()


def test_wrap_checks_the_optimizer_and_resume(tmp_path):
    opt = engine.AdamW()
    eng = engine.wrap(nn.Linear(3, 3), optimizer=opt, config=training_config(tmp_path / "a"))
    eng.close()
    with pytest.raises(ValueError, match="already bound"):
        engine.wrap(nn.Linear(3, 3), optimizer=opt, config=training_config(tmp_path / "b"))
    with pytest.raises(ValueError, match="resume"):
        engine.wrap(nn.Linear(3, 3), config=training_config(tmp_path / "c").replace(resume=True))
    with pytest.raises(ValueError, match="no step record"):
        engine.wrap(nn.Linear(3, 3), optimizer=engine.AdamW(),
                    config=training_config(tmp_path / "d").replace(resume=True))
    with pytest.raises(ValueError, match="resume must be True or False"):
        training_config(tmp_path).replace(resume="yes")
    with pytest.raises(RuntimeError, match="needs an optimizer"):
        with engine.wrap(nn.Linear(3, 3), config=training_config(tmp_path / "e")) as plain:
            plain.step()


def test_resume_after_a_clean_close_and_a_fresh_wrap_discards_old_state(tmp_path):
    torch.manual_seed(11)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    config = training_config(tmp_path, param_tier="host", optimizer_tier="host")  # close writes host down
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config)
    for step in range(3):
        gpt_loss(model, step).backward()
        eng.step()
        eng.zero_grad()
    gpt_loss(model, 3).backward()  # a gradient that no step took: dropped by the resume
    eng.close()

    torch.manual_seed(99)
    resumed = TinyGPT()  # other initial values: every value must come from the store
    eng = engine.wrap(resumed, optimizer=engine.AdamW(lr=LR), config=config.replace(resume=True))
    assert eng.completed_steps == 3 and set(eng.optimizer.shard_steps.values()) == {3}
    assert not any(k.startswith("grad/") for k in eng.store.keys())
    losses, ref_losses = [], []
    for step in range(6):
        ref_losses.append(gpt_loss(ref, step).item())
        gpt_loss(ref, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step >= 3:
            loss = gpt_loss(resumed, step)
            loss.backward()
            eng.step()
            eng.zero_grad()
            losses.append(loss.item())
    assert losses == ref_losses[3:]
    eng.close()

    fresh = TinyGPT()
    eng = engine.wrap(fresh, optimizer=engine.AdamW(lr=LR), config=config)  # no resume: start afresh
    try:
        assert eng.completed_steps == 0
        assert not any(k.startswith(("optim/", "grad/")) for k in eng.store.keys())
        assert StepRecord.read(eng.store) == StepRecord.empty([n for n, _ in fresh.named_parameters()],
                                                               master_in_param=True)
    finally:
        eng.close()


def test_resume_refuses_another_model(tmp_path):
    config = training_config(tmp_path)
    eng = engine.wrap(TinyGPT(), optimizer=engine.AdamW(), config=config)
    gpt_loss(eng.model, 0).backward()
    eng.step()
    eng.close()
    with pytest.raises(ValueError, match="no shard of parameter"):
        engine.wrap(TinyGPT(layers=3), optimizer=engine.AdamW(), config=config.replace(resume=True))
    with pytest.raises(ValueError, match="train_dtype"):
        engine.wrap(TinyGPT(), optimizer=engine.AdamW(), config=config.replace(resume=True, train_dtype="bfloat16"))
    with tiered.TieredStore.open(config.store) as store:
        assert StepRecord.read(store).step == 1  # the refused resumes changed nothing


def test_steps_after_close_are_refused(tmp_path):
    model = nn.Linear(3, 3)
    eng = engine.wrap(model, optimizer=engine.AdamW(), config=training_config(tmp_path))
    model(torch.ones(1, 3)).sum().backward()
    eng.unwrap()
    eng.optimizer.zero_grad()  # torch's part only: nothing left in a store
    with pytest.raises(RuntimeError, match="closed or unwrapped"):
        eng.optimizer.step()


def test_installing_staged_state_continues_another_engines_training(tmp_path):
    """The checkpoint seam: state copied into staging keys and committed with commit_staged makes a
    fresh engine continue exactly where the source engine is."""
    torch.manual_seed(12)
    source_model = TinyGPT()
    target_model = copy.deepcopy(source_model)
    source = engine.wrap(source_model, optimizer=engine.AdamW(lr=LR), config=training_config(tmp_path / "a"))
    target = engine.wrap(target_model, optimizer=engine.AdamW(lr=LR), config=training_config(tmp_path / "b"))
    try:
        for step in range(2):
            gpt_loss(source_model, step).backward()
            source.step()
            source.zero_grad()
        gpt_loss(target_model, 0).backward()  # a gradient the install must drop
        for shard in source._training.live_shards():
            staged = target._training.staging_keys(shard.name)
            for key, to in zip((shard.master_key, shard.exp_avg_key, shard.exp_avg_sq_key), staged):
                target.store.sync.put(to, source.store.sync.get(key), "nvme")
        target._training.commit_staged(source.completed_steps, source.optimizer.shard_steps)
        assert target.completed_steps == 2 and target.optimizer.shard_steps == source.optimizer.shard_steps
        assert not any(k.startswith("grad/") for k in target.store.keys())
        for step in range(2, 4):
            losses = []
            for model, eng in ((source_model, source), (target_model, target)):
                loss = gpt_loss(model, step)
                loss.backward()
                eng.step()
                eng.zero_grad()
                losses.append(loss.item())
            assert losses[0] == losses[1]
    finally:
        source.close()
        target.close()


@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
def test_activation_checkpointing(tmp_path, checkpoint):
    torch.manual_seed(13)
    model = TinyGPT(checkpoint=checkpoint)
    losses, ref_losses, eng, ref = train_both(model, training_config(tmp_path), steps=3, micro=2)
    assert losses == ref_losses
    assert_trained_equal(model, eng, ref)


def _groups(model: nn.Module, lr: float) -> list[dict]:
    """nanoGPT's configure_optimizers: weight decay on matrices only, and here a larger lr for the rest."""
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for _, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3 * lr}]


def test_parameter_groups_keep_their_own_hyperparameters(tmp_path):
    torch.manual_seed(5)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    opt = engine.AdamW(_groups(model, LR), lr=LR)
    ref_opt = torch.optim.AdamW(_groups(ref, LR), lr=LR)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)) for o in (opt, ref_opt)]
    eng = engine.wrap(model, optimizer=opt, config=training_config(tmp_path / "a"))
    losses = {}
    for m, o, sched in ((model, opt, schedulers[0]), (ref, ref_opt, schedulers[1])):
        losses[m] = []
        for i in range(4):
            loss = gpt_loss(m, i)
            loss.backward()
            o.step()
            o.zero_grad()
            sched.step()
            losses[m].append(loss.item())
            if m is model and i == 1:
                eng.save_checkpoint(tmp_path / "ckpt")
    assert losses[model] == losses[ref]
    final = eng.state_dict()
    eng.close()
    assert all(torch.equal(final[n], p) for n, p in ref.state_dict().items())

    torch.manual_seed(6)
    resumed = TinyGPT()  # other values; groups built the same way: the checkpoint restores each group
    opt = engine.AdamW(_groups(resumed, 0.5), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    with engine.wrap(resumed, optimizer=opt, config=training_config(tmp_path / "b")) as eng:
        eng.load_checkpoint(tmp_path / "ckpt")
        sched.last_epoch = 2  # where the first run's scheduler stood (its state is the loop's to save)
        again = []
        for i in range(2, 4):
            loss = gpt_loss(resumed, i)
            loss.backward()
            eng.step()
            eng.zero_grad()
            sched.step()
            again.append(loss.item())
    assert again == losses[model][2:]


def test_parameter_groups_must_cover_the_trainable_parameters(tmp_path):
    model = TinyGPT()
    with pytest.raises(TypeError, match=r"pass the learning rate as lr=0.001"):
        engine.AdamW(0.001)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    with pytest.raises(ValueError, match=r"trainable parameter\(s\) are in none of .* \['blocks.0.ln1.weight'"):
        engine.wrap(model, optimizer=engine.AdamW(decay), config=training_config(tmp_path / "a"))
    with pytest.raises(ValueError, match="not the wrapped model's parameters"):
        engine.wrap(TinyGPT(), optimizer=engine.AdamW(model.parameters()), config=training_config(tmp_path / "b"))
    for p in model.parameters():
        p.requires_grad_(p.dim() >= 2)  # the rest frozen: the groups need not hold them
    with engine.wrap(model, optimizer=engine.AdamW(decay), config=training_config(tmp_path / "c")) as eng:
        gpt_loss(model, 0).backward()
        eng.step()
        assert set(eng.optimizer.shard_steps) == {n for n, p in model.named_parameters() if p.dim() >= 2}


def test_a_resume_under_the_other_master_layout_moves_the_masters_over(tmp_path):
    """Trained with parameters that are their own masters, resumed with parameters in another tier
    than the state (their masters then get keys of their own), and back: torch's losses throughout."""
    torch.manual_seed(12)
    ref = TinyGPT()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    one_copy = training_config(tmp_path, host_bytes=16 * 1024 * KiB)
    separate = one_copy.replace(param_tier="host")
    losses, ref_losses = [], []
    step = 0
    for config, steps in ((one_copy, 2), (separate, 2), (one_copy, 1)):
        model = TinyGPT() if step else copy.deepcopy(ref)
        with engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config.replace(resume=step > 0)) as eng:
            masters = [k for k in eng.store.keys() if k.endswith("/master")]
            assert bool(masters) == (config is separate and step > 0)
            for _ in range(steps):
                loss = gpt_loss(model, step)
                loss.backward()
                eng.step()
                eng.zero_grad()
                losses.append(loss.item())
                ref_loss = gpt_loss(ref, step)
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                ref_losses.append(ref_loss.item())
                step += 1
    assert losses == ref_losses


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_the_host_tier_keeps_parameters_across_steps_and_the_losses_stay_torchs(tmp_path, step_in_backward):
    """With the parameters on nvme, the host budget keeps the ones read soonest (fetches and the
    step's writes offer the store clean copies; the recorded order chooses): fewer bytes come from
    the disk each step, and training equals torch's bit for bit."""
    torch.manual_seed(13)
    model = TinyGPT()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    read = {}
    for host in (0, 2 * param_bytes // 3):  # no host tier, and room for about two thirds of the parameters
        config = training_config(tmp_path / str(host), grad_tier="nvme", host_bytes=host)
        trained = copy.deepcopy(model)
        losses, ref_losses, eng, ref = train_both(trained, config.replace(step_in_backward=step_in_backward), steps=5)
        assert losses == ref_losses
        stats = eng.store.stats()
        read[host] = stats.bytes_read
        assert (stats.tiers[tiered.Tier.HOST].hits > 0) == (host > 0)
        assert_trained_equal(trained, eng, ref)
    cached = max(read)
    assert read[0] - read[cached] >= 4 * cached  # the four steps after the first read its worth at least once each
