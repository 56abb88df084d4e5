"""The hard cases of paging parameters through hooks, each its own test, each checked against the
unwrapped model (plain PyTorch) as the oracle."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import engine
from engine_models import (
    TinyGPT,
    assert_same_grads,
    assert_same_params,
    engine_config,
    gpt_tokens,
    train_parity,
)


def test_tied_weights_share_one_entry_and_get_both_gradients(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    eng = train_parity(model, engine_config(tmp_path), [gpt_tokens(seed=s) for s in range(2)])
    assert model.lm_head.weight is model.wte.weight
    assert "param/wte.weight" in eng.store and "param/lm_head.weight" not in eng.store
    eng.unwrap()


class Repeated(nn.Module):
    """One block applied three times per forward, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.block(x)
        return self.head(x)


def test_module_called_several_times_per_step(tmp_path):
    torch.manual_seed(0)
    model = Repeated()
    eng = train_parity(model, engine_config(tmp_path, prefetch_bytes=2048), [torch.randn(4, 16) for _ in range(3)])
    assert eng.stats().rerecords == 0 and eng.stats().prefetch_hits > 0
    eng.unwrap()


class ReadsOutside(nn.Module):
    """The parent reads a child's weight directly (as weight-tied heads and adapters do)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.other(x)
        return F.linear(h, self.inner.weight) + self.inner.bias.sum() * h.T.sum()


def test_parameters_read_outside_their_module(tmp_path):
    torch.manual_seed(0)
    model = ReadsOutside()
    eng = train_parity(model, engine_config(tmp_path), [torch.randn(3, 8) for _ in range(3)])
    stats = eng.stats()
    # Found by the access mode once (weight and bias in step 1), then acquired by the parent's pre-hook,
    # which moves them earlier in the order: step 2 re-records once, step 3 follows it.
    assert stats.on_demand_fetches == 2
    assert stats.rerecords == 1
    assert stats.prefetch_hits > 0
    eng.unwrap()


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_activation_checkpointing(tmp_path, mode):
    torch.manual_seed(0)
    model = TinyGPT(checkpoint=mode)
    eng = train_parity(model, engine_config(tmp_path, prefetch_bytes=4096), [gpt_tokens(seed=s) for s in range(3)])
    assert eng.stats().materialized_bytes == 0  # backward released everything it brought back
    eng.unwrap()


class CheckpointedOwnParameter(nn.Module):
    """A checkpointed method that multiplies by the module's own parameter (no submodule holds it)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(8, 8)
        self.inner = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(8))

    def _region(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(h)) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self._region, self.inp(x), use_reentrant=self.reentrant)


class CheckpointedOtherWeight(nn.Module):
    """A checkpointed function that uses another module's weight through F.linear."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def _region(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(h), self.head.weight, self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self._region, self.inp(x), use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("model_class", [CheckpointedOwnParameter, CheckpointedOtherWeight])
def test_parameter_read_directly_inside_a_checkpointed_function(tmp_path, model_class, reentrant):
    """The recompute in backward reads the parameter outside any hooked module: the engine fetches
    it there and holds it for that backward; training equals torch's bit for bit."""
    torch.manual_seed(0)
    model = model_class(reentrant)
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-2),
                      config=dataclasses.replace(engine_config(tmp_path), max_grad_norm=None))
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss, want = model(x).square().mean(), ref(x).square().mean()
        assert torch.equal(loss, want)
        loss.backward(), want.backward()
        eng.step(), torch_opt.step()
        eng.zero_grad(), torch_opt.zero_grad()
    assert eng.stats().materialized_bytes == 0  # backward released what the recompute fetched
    assert_same_params(eng.unwrap(), ref)


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True}])
def test_hugging_faces_activation_checkpointing_enable(tmp_path, kwargs):
    """model.activation_checkpointing_enable() (gradient_checkpointing_enable() before transformers
    5), a Hugging Face user's first memory saver: the same losses, bit for bit, as the plain model
    with the same checkpointing."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0,
                                     embd_pdrop=0, attn_pdrop=0, use_cache=False)

    def losses(wrapped: bool) -> list[float]:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).train()
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if wrapped:
            eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-3), config=dataclasses.replace(
                engine_config(tmp_path), max_grad_norm=None))
            optimizer = eng.optimizer
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for step in range(3):
            ids = gpt_tokens(batch=2, t=16, vocab=128, seed=step)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        if wrapped:
            eng.close()
        return out

    assert losses(wrapped=True) == losses(wrapped=False)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "eval"])
def test_no_grad_inference_mode_and_eval(tmp_path, context):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, config=engine_config(tmp_path, prefetch_bytes=512))
    for seed in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
        if context == "eval":
            model.eval(), ref.eval()
            out, want = model(x), ref(x)
        else:
            ctx = torch.no_grad if context == "no_grad" else torch.inference_mode
            with ctx():  # dropout is active: the same seed gives both the same mask
                torch.manual_seed(seed)
                out = model(x)
                torch.manual_seed(seed)
                want = ref(x)
            assert not out.requires_grad
        assert torch.equal(out, want)
        # Forward-only steps may keep the next step's first parameters prefetched (within the window).
        assert eng.stats().materialized_bytes <= (0 if context == "eval" else 512)
    if context == "eval":  # eval keeps autograd: gradients still match
        model(x).sum().backward(), ref(x).sum().backward()
        assert_same_grads(model, ref)
    assert eng.stats().prefetch_hits > 0
    eng.unwrap()


def test_buffers_stay_resident_and_update(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, config=engine_config(tmp_path))
    bn = model[1]
    for seed in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(model(x), ref(x))
        assert bn.running_mean.untyped_storage().nbytes() == 8 * 4  # buffers are never released
    assert int(bn.num_batches_tracked) == 3
    assert torch.equal(bn.running_mean, ref[1].running_mean) and torch.equal(bn.running_var, ref[1].running_var)
    assert "param/1.weight" in eng.store and not any("running" in k for k in eng.store.keys())
    eng.unwrap()


def test_frozen_parameters(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    for p in model[2].parameters():  # frozen in the middle: backward still needs its weight
        p.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    eng = train_parity(model, engine_config(tmp_path, prefetch_bytes=1024), [torch.randn(3, 8) for _ in range(3)])
    assert model[2].weight.grad is None
    assert eng.stats().materialized_bytes == 0
    eng.unwrap()


class Nested(nn.Module):
    """Parameters deep inside dicts, lists and sequentials, plus one on the root itself."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.stages = nn.ModuleDict({
            "a": nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.LayerNorm(8), nn.GELU()))]),
            "b": nn.Sequential(nn.ModuleList([nn.Linear(8, 8)])[0], nn.Linear(8, 8)),
        })

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages["a"][0](x * self.scale)
        return self.stages["b"](x)


def test_nested_containers(tmp_path):
    torch.manual_seed(0)
    model = Nested()
    eng = train_parity(model, engine_config(tmp_path), [torch.randn(2, 8) for _ in range(3)])
    assert eng.stats().prefetch_hits > 0
    eng.unwrap()


def test_reading_a_released_parameter_outside_forward_is_refused_by_matmul(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    eng = engine.wrap(model, config=engine_config(tmp_path))
    assert model.weight.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="released by the tiered engine.*eng.gathered"):
        torch.mm(torch.ones(1, 4), model.weight)
    eng.unwrap()
    assert model.weight.untyped_storage().nbytes() == 64


def test_identity_and_an_optimizer_built_before_wrap(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    ids = [id(p) for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    eng = engine.wrap(model, config=engine_config(tmp_path), optimizer=optimizer)
    assert [id(p) for p in model.parameters()] == ids
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], model.parameters()))
    for seed in range(2):
        x = gpt_tokens(seed=seed)
        model(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        optimizer.step(), ref_opt.step()
        optimizer.zero_grad(), ref_opt.zero_grad()
    eng.unwrap()
    assert [id(p) for p in model.parameters()] == ids
    assert_same_params(model, ref)


def test_autograd_grad_and_a_retained_graph(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, config=engine_config(tmp_path, prefetch_bytes=512))
    x = torch.randn(4, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    # Only the input's gradient: no parameter's AccumulateGrad runs; the end of backward releases.
    (gx,) = torch.autograd.grad(model(x).sum(), [x])
    (gx_ref,) = torch.autograd.grad(ref(x_ref).sum(), [x_ref])
    assert torch.equal(gx, gx_ref) and eng.stats().materialized_bytes == 0
    # Two backward passes through one graph: the second brings the parameters back again.
    out, want = model(x), ref(x_ref)
    out.sum().backward(retain_graph=True), want.sum().backward(retain_graph=True)
    out.pow(2).sum().backward(), want.pow(2).sum().backward()
    assert_same_grads(model, ref)
    assert torch.equal(x.grad, x_ref.grad)
    assert eng.stats().materialized_bytes == 0
    eng.unwrap()


def test_bfloat16_parameters_and_an_empty_parameter(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT().to(torch.bfloat16)
    model.empty = nn.Parameter(torch.zeros(0, 4, dtype=torch.bfloat16))
    eng = train_parity(model, engine_config(tmp_path), [gpt_tokens(seed=s) for s in range(2)])
    assert eng.store.info("param/wte.weight").dtype == torch.bfloat16
    eng.unwrap()


class Views(nn.Module):
    """Parameters that are views: two slices of one buffer, and a transposed (non-contiguous) one."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(2, 6, 6)
        self.a = nn.Parameter(base[0])
        self.b = nn.Parameter(base[1])
        self.c = nn.Parameter(torch.randn(6, 6).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a) @ self.b + x @ self.c


def test_parameters_sharing_storage_or_not_contiguous(tmp_path):
    torch.manual_seed(0)
    model = Views()
    assert not model.c.is_contiguous()
    eng = train_parity(model, engine_config(tmp_path), [torch.randn(3, 6) for _ in range(2)])
    eng.unwrap()


class ChangesItsWeight(nn.Module):
    """Changes its own weight in place during forward, after using it (as nn.Embedding(max_norm) and
    weight clipping do); ``after_use`` decides whether autograd needs the old value."""

    def __init__(self, after_use: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.after_use = after_use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.after_use:
            with torch.no_grad():
                self.lin.weight.clamp_(-0.1, 0.1)
        y = self.lin(x)
        if self.after_use:
            with torch.no_grad():
                self.lin.weight.mul_(2)
        return y


def test_in_place_changes_in_forward_are_kept_and_checked(tmp_path):
    torch.manual_seed(0)
    model = ChangesItsWeight(after_use=False)
    eng = train_parity(model, engine_config(tmp_path), [torch.randn(2, 4) for _ in range(2)])
    eng.unwrap()
    assert model.lin.weight.abs().max() <= 0.1  # the change reached the store
    # Changing a saved parameter before backward is autograd's "modified by an inplace operation" error.
    model = ChangesItsWeight(after_use=True)
    ref = copy.deepcopy(model)
    x = torch.ones(2, 4, requires_grad=True)  # so the linear saves its weight for the input's gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref(x).sum().backward()
    eng = engine.wrap(model, config=engine_config(tmp_path / "second"))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    eng.unwrap()
    assert torch.equal(model.lin.weight, ref.lin.weight)  # both doubled once
