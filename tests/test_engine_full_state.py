"""A parameter's whole training state between steps (``eng.full_fp32_param``, ``full_grad``,
``full_optimizer_state`` and the ``set_full_*`` calls: DeepSpeed's ``safe_get_full_*`` /
``safe_set_full_*``). The oracle is the same model in plain PyTorch with ``torch.optim.AdamW``:
its parameters, ``.grad`` and ``optimizer.state``."""

from __future__ import annotations

import copy

import pytest
import torch

import engine
import tiered
from test_engine_distributed import run_ranks

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    model[0].bias.requires_grad_(False)  # a frozen parameter: no master, gradient or optimizer state
    return model


def batch(step: int, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, 6, generator=torch.Generator().manual_seed(step))


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def wrapped(root, model: torch.nn.Module, **config) -> engine.Engine:
    optimizer = engine.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS,
                             weight_decay=WD)
    return engine.wrap(model, optimizer=optimizer, config=engine.EngineConfig(
        store=tiered.StoreConfig(path=f"{root}/store"), param_tier="nvme", optimizer_tier="nvme", **config))


def oracle() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS,
                                    weight_decay=WD)


def assert_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got is not None
    torch.testing.assert_close(got.cpu(), expected.detach().float(), rtol=1e-6, atol=1e-7)


def test_full_state_is_plain_pytorchs_through_steps_and_sets(tmp_path):
    model = make_model()
    eng = wrapped(tmp_path, model)
    plain, opt = oracle()
    try:
        pairs = list(zip(model.parameters(), plain.parameters()))
        frozen, (w, pw) = pairs[1], pairs[0]
        for p, q in pairs:  # before any step: the values, zero moments, no gradient
            if p.requires_grad:
                assert_equal(eng.full_fp32_param(p), q)
                assert torch.count_nonzero(eng.full_optimizer_state(p, "exp_avg")) == 0
            assert eng.full_grad(p) is None
        assert eng.full_fp32_param(frozen[0]) is None and eng.full_optimizer_state(frozen[0], "exp_avg") is None

        for step in range(3):
            for micro in range(2):  # gradients accumulate over two backward passes
                loss_of(model(batch(2 * step + micro))).backward()
                loss_of(plain(batch(2 * step + micro))).backward()
            for p, q in pairs:
                if p.requires_grad:
                    assert_equal(eng.full_grad(p), q.grad)
            eng.step()
            opt.step()
            opt.zero_grad()
            for p, q in pairs:
                assert eng.full_grad(p) is None  # the step used them
                if p.requires_grad:
                    assert_equal(eng.full_fp32_param(p), q)
                    for key in ("exp_avg", "exp_avg_sq"):
                        assert_equal(eng.full_optimizer_state(p, key), opt.state[q][key])

        # Set the weights, a moment and a gradient on both, step both: the same parameters after.
        new = torch.linspace(-1, 1, w.numel()).reshape(w.shape)
        eng.set_full_fp32_param(w, new)
        with torch.no_grad():
            pw.copy_(new)
        with eng.gathered(w):
            assert torch.equal(w, new)  # the parameter itself, for the next forward
        assert_equal(eng.full_fp32_param(w), new)
        eng.set_full_optimizer_state(w, torch.full(w.shape, 0.5), "exp_avg")
        opt.state[pw]["exp_avg"].fill_(0.5)
        assert_equal(eng.full_optimizer_state(w, "exp_avg"), torch.full(w.shape, 0.5))
        grad = torch.ones(w.shape)
        eng.set_full_grad(w, grad)
        pw.grad = grad.clone()
        assert_equal(eng.full_grad(w), grad)
        loss_of(model(batch(99))).backward()  # a backward adds to a set gradient, as to .grad
        loss_of(plain(batch(99))).backward()
        assert_equal(eng.full_grad(w), pw.grad)
        eng.step()
        opt.step()
        for p, q in pairs:
            if p.requires_grad:
                assert_equal(eng.full_fp32_param(p), q)
    finally:
        eng.close()


def test_full_grad_leaves_out_the_loss_scale(tmp_path):
    model = make_model()
    eng = wrapped(tmp_path, model, loss_scaling=engine.LossScaling(initial_scale=2.0**10, dynamic=False))
    plain, _ = oracle()
    try:
        eng.backward(loss_of(model(batch(0))))
        loss_of(plain(batch(0))).backward()
        for p, q in zip(model.parameters(), plain.parameters()):
            if p.requires_grad:
                assert_equal(eng.full_grad(p), q.grad)
        w = next(model.parameters())
        eng.set_full_grad(w, torch.ones(w.shape))  # set unscaled, kept scaled, read unscaled
        assert_equal(eng.full_grad(w), torch.ones(w.shape))
    finally:
        eng.close()


def test_a_torch_optimizers_state_is_where_torch_keeps_it(tmp_path):
    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    eng = engine.wrap(model, optimizer=torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
                      config=engine.EngineConfig(store=tiered.StoreConfig(path=str(tmp_path / "store"))))
    plain, opt = oracle()
    try:
        w, pw = params[0], next(plain.parameters())
        assert eng.full_optimizer_state(w, "exp_avg") is None  # torch makes it at the first step
        loss_of(model(batch(0))).backward()
        loss_of(plain(batch(0))).backward()
        assert_equal(eng.full_grad(w), pw.grad)
        eng.step()
        eng.zero_grad()
        opt.step()
        opt.zero_grad()
        assert_equal(eng.full_fp32_param(w), pw)
        assert_equal(eng.full_optimizer_state(w, "exp_avg_sq"), opt.state[pw]["exp_avg_sq"])
        eng.set_full_optimizer_state(w, torch.zeros(w.shape), "exp_avg")
        opt.state[pw]["exp_avg"].zero_()
        assert torch.count_nonzero(eng.optimizer.state[w]["exp_avg"]) == 0
        eng.set_full_grad(w, torch.ones(w.shape))  # param.grad, for a step without backward
        pw.grad = torch.ones(w.shape)
        eng.step()
        opt.step()
        assert_equal(eng.full_fp32_param(w), pw)
    finally:
        eng.close()


def test_wrong_arguments_are_refused_with_what_was_given(tmp_path):
    model = make_model()
    eng = wrapped(tmp_path, model)
    try:
        w, frozen = model[0].weight, model[0].bias
        with pytest.raises(ValueError, match=r"not a parameter of the wrapped model \(shape \(3,\)\)"):
            eng.full_grad(torch.nn.Parameter(torch.zeros(3)))
        with pytest.raises(ValueError, match="keeps the optimizer states .* got 'momentum_buffer'"):
            eng.full_optimizer_state(w, "momentum_buffer")
        with pytest.raises(ValueError, match=r"has shape \(10, 6\); got a value of shape \(6, 10\)"):
            eng.set_full_fp32_param(w, torch.zeros(6, 10))
        with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
            eng.set_full_grad(w, [0.0])
        with pytest.raises(ValueError, match="takes no gradient"):
            eng.set_full_grad(frozen, torch.zeros(10))
        with pytest.raises(RuntimeError, match="no optimizer state yet"):
            eng.set_full_optimizer_state(w, torch.zeros(w.shape), "exp_avg")
        before = eng.full_fp32_param(w)
        eng.set_full_fp32_param(frozen, torch.ones(10))  # a frozen parameter's value is set; it has no master
        with eng.gathered(frozen):
            assert torch.equal(frozen, torch.ones(10))
        assert torch.equal(eng.full_fp32_param(w), before)
    finally:
        eng.close()


def _full_state_rank(rank: int, root: str, expected: dict) -> None:
    model = make_model()
    eng = wrapped(root, model)  # each rank its rank<N> folder of the store
    try:
        assert eng.world_size == 2
        for step in range(2):
            loss_of(model(batch(step, rows=4)[2 * rank:2 * rank + 2])).backward()  # each rank half the batch
            for name, p in model.named_parameters():
                if p.requires_grad:
                    assert_equal(eng.full_grad(p), expected[f"grad{step}/{name}"])
            eng.step()
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert_equal(eng.full_fp32_param(p), expected[f"param/{name}"])
                assert_equal(eng.full_optimizer_state(p, "exp_avg"), expected[f"exp_avg/{name}"])
        w = model[2].weight  # 30 elements over 2 ranks; set on every rank, each writes its shard
        eng.set_full_optimizer_state(w, torch.arange(30.0).reshape(3, 10), "exp_avg_sq")
        assert_equal(eng.full_optimizer_state(w, "exp_avg_sq"), torch.arange(30.0).reshape(3, 10))
    finally:
        eng.close()


def test_full_state_at_two_ranks_is_the_whole_batchs(tmp_path):
    plain, opt = oracle()
    expected = {}
    for step in range(2):
        loss_of(plain(batch(step, rows=4))).backward()
        for name, q in plain.named_parameters():
            if q.requires_grad:
                expected[f"grad{step}/{name}"] = q.grad.clone()
        opt.step()
        opt.zero_grad()
    for name, q in plain.named_parameters():
        if q.requires_grad:
            expected[f"param/{name}"] = q.detach().clone()
            expected[f"exp_avg/{name}"] = copy.deepcopy(opt.state[q]["exp_avg"])
    run_ranks(_full_state_rank, str(tmp_path), expected)
