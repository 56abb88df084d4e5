"""wrap's argument checks, stats, unwrap and close, and no thread or store left behind."""

from __future__ import annotations

import copy
import json
import threading

import pytest
import torch
from torch import nn

import engine
import tiered
from engine_models import TinyGPT, assert_same_params, engine_config, gpt_tokens, store_config


def _store_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tiered-store")]


def test_wrap_refuses_bad_arguments(tmp_path):
    model = nn.Linear(2, 2)
    config = engine_config(tmp_path)
    with pytest.raises(TypeError, match="nn.Module"):
        engine.wrap("model", config=config)
    with pytest.raises(TypeError, match="EngineConfig"):
        engine.wrap(model, config=config.store)
    with pytest.raises(TypeError, match="optimizer"):
        engine.wrap(model, config=config, optimizer=object())
    with pytest.raises(TypeError, match="init_fn"):
        engine.wrap(model, config=config, init_fn=3)
    with pytest.raises(TypeError, match="state_dict"):
        engine.wrap(model, config=config, state_dict=42)
    with pytest.raises(ValueError, match="host_bytes is 0"):
        engine.wrap(model, config=engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path,
                                                      host_bytes=0), param_tier="host"))
    assert not _store_threads()
    assert model.weight.untyped_storage().nbytes() == 16  # untouched


def test_wrapping_a_wrapped_model_is_refused(tmp_path):
    model = nn.Linear(2, 2)
    eng = engine.wrap(model, config=engine_config(tmp_path))
    with pytest.raises(ValueError, match="already wrapped"):
        engine.wrap(model, config=engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path / "other")))
    eng.unwrap()


def test_stats_unwrap_and_close(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    with engine.wrap(model, config=engine_config(tmp_path)) as eng:
        assert _store_threads()
        model(gpt_tokens()).sum().backward()
        stats = eng.stats()
        assert stats.steps == 1 and stats.fetches > 0 and stats.stall_seconds > 0
        assert 0.0 <= stats.prefetch_hit_rate <= 1.0
        json.dumps(stats.as_dict())
        assert eng.unwrap() is model
        assert eng.closed and not _store_threads()
        for p in model.parameters():
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
        assert eng.stats().steps == 1  # still readable
        with pytest.raises(engine.EngineClosedError):
            eng.unwrap()
    model.zero_grad()
    assert_same_params(model, ref)
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert hooks == 0
    assert torch.equal(model(gpt_tokens()), ref(gpt_tokens()))  # a plain model again


def test_close_leaves_the_shards_in_the_store(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    weight = model.weight.detach().clone()
    config = engine_config(tmp_path)
    engine.wrap(model, config=config).close()
    assert not _store_threads()
    with tiered.TieredStore.open(config.store) as store:
        assert torch.equal(store.sync.get("param/weight"), weight.reshape(-1))


def test_calling_a_submodule_directly_and_an_exception_in_forward(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, config=engine_config(tmp_path, prefetch_bytes=0))
    x = torch.randn(2, 4)
    assert torch.equal(model[1](x), ref[1](x))  # not through the root: fetched on demand
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # shape error inside the first Linear
    assert eng.stats().materialized_bytes == 0  # the always-called post-hooks released it
    assert torch.equal(model(x), ref(x))
    eng.unwrap()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_cuda_parity_with_the_device_tier_on_the_gpu(tmp_path, tier):
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    ref = copy.deepcopy(model)
    config = engine.EngineConfig(
        store=tiered.StoreConfig(path=str(tmp_path / "store"), device="cuda", device_bytes=64 * 1024,
                                 host_bytes=64 * 1024, prefault_host=False, durable=False),
        param_tier=tier, prefetch_bytes=32 * 1024, compute_device="cuda",
    )
    eng = engine.wrap(model, config=config)
    for seed in range(3):
        x = gpt_tokens(seed=seed).cuda()
        out, want = model(x), ref(x)
        assert torch.equal(out, want)
        out.pow(2).mean().backward(), want.pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        model.zero_grad(), ref.zero_grad()
    assert eng.stats().prefetch_hits > 0
    eng.unwrap()
    assert_same_params(model, ref)


def test_state_dict_and_load_state_dict_on_a_wrapped_model(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, config=engine_config(tmp_path))
    state = model.state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name
    torch.save(state, tmp_path / "ckpt.pt")  # a checkpoint plain torch loads
    assert torch.equal(torch.load(tmp_path / "ckpt.pt")["wte.weight"], ref.wte.weight)
    assert model.state_dict(keep_vars=True)["wte.weight"] is model.wte.weight

    torch.manual_seed(1)
    other = TinyGPT()
    model.load_state_dict(other.state_dict())
    assert eng.stats().materialized_bytes == 0
    x = gpt_tokens()
    assert torch.equal(model(x), other(x))
    with pytest.raises(ValueError, match="assign"):
        model.load_state_dict(other.state_dict(), assign=True)
    eng.unwrap()
    assert_same_params(model, other)


class _Marker:
    """An object a graph holds (in a custom Function's ctx): alive exactly as long as the graph."""


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, marker):
        ctx.marker = marker
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _MarkedGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT()
        self.markers: list = []

    def forward(self, idx):
        import weakref

        marker = _Marker()
        self.markers.append(weakref.ref(marker))
        gpt = self.gpt
        x = gpt.wte(idx) + gpt.wpe(torch.arange(idx.shape[1]))
        x = _Mark.apply(x, marker)  # at the bottom of the graph: every node above holds it
        for block in gpt.blocks:
            x = block(x)
        return gpt.lm_head(gpt.ln_f(x))


@pytest.mark.parametrize("activation_tier", [None, "nvme"])
def test_a_graph_never_run_backward_is_freed(tmp_path, activation_tier):
    """A forward with gradients whose output is dropped (an evaluation loss outside no_grad) must not
    keep its graph: the saved-tensor hooks and the post-backward hooks each made a cycle through
    C++ that the garbage collector cannot break, and every such forward leaked its activations."""
    import gc

    torch.manual_seed(0)
    model = _MarkedGPT()
    eng = engine.wrap(model, config=engine_config(tmp_path).replace(activation_tier=activation_tier))
    try:
        out = model(gpt_tokens(seed=0))
        gc.collect()
        assert model.markers[0]() is not None  # the graph is alive while its output is
        del out
        gc.collect()
        with torch.no_grad():
            model(gpt_tokens(seed=1))  # the next step removes the last one's post-backward hooks
        gc.collect()
        assert model.markers[0]() is None
    finally:
        eng.close()
