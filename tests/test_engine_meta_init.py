"""Models too big to materialize: built on the meta device, materialized module by module straight
into the store during wrap (reset_parameters or an init function), or loaded tensor by tensor from
a safetensors file or a torch state dict; never more than one module's parameters in memory."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import engine
import tiered
from engine_models import TinyGPT, assert_same_params, engine_config, largest_module_bytes


def _build() -> nn.Module:
    # Built in the same order as named_modules() visits it, so eager init and per-module
    # reset_parameters() draw the same random numbers.
    return nn.Sequential(
        nn.Embedding(50, 16),
        nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.BatchNorm1d(32)),
        nn.Linear(32, 8),
    )


def _meta(build=_build) -> nn.Module:
    with torch.device("meta"):
        return build()


def _assert_store_closed(tmp_path) -> None:
    # The lock is released: the same directory opens again.
    config = tiered.StoreConfig(path=str(tmp_path / "store"), host_bytes=0, prefault_host=False)
    tiered.TieredStore.open(config).sync.close()


def test_meta_model_materialized_module_by_module_with_reset_parameters(tmp_path):
    torch.manual_seed(1)
    eager = _build()
    model = _meta()
    ids = [id(p) for p in model.parameters()]
    torch.manual_seed(1)
    eng = engine.wrap(model, config=engine_config(tmp_path))
    stats = eng.stats()
    assert 0 < stats.wrap_peak_materialized_bytes <= largest_module_bytes(eager)
    assert stats.materialized_bytes == 0
    assert [id(p) for p in model.parameters()] == ids
    assert model[1][2].running_var.device.type == "cpu"  # buffers materialized too (reset by BatchNorm)
    eng.unwrap()
    assert_same_params(model, eager)


def test_meta_tied_gpt_matches_eager_construction(tmp_path):
    torch.manual_seed(2)
    eager = TinyGPT()
    model = _meta(TinyGPT)
    torch.manual_seed(2)
    eng = engine.wrap(model, config=engine_config(tmp_path))
    assert eng.stats().wrap_peak_materialized_bytes <= largest_module_bytes(eager)
    x = torch.randint(0, 64, (2, 8))
    assert torch.equal(model(x), eager(x))
    eng.unwrap()
    assert model.lm_head.weight is model.wte.weight
    assert_same_params(model, eager)


def test_meta_model_with_an_init_function(tmp_path):
    seen = []

    def init(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)
        for b in module.buffers(recurse=False):
            b.fill_(0)

    model = _meta()
    eng = engine.wrap(model, config=engine_config(tmp_path), init_fn=init)
    assert seen == ["Embedding", "Linear", "LayerNorm", "BatchNorm1d", "Linear"]  # modules with meta tensors only
    eng.unwrap()
    assert all(torch.all(p == 0.5) for p in model.parameters())


@pytest.mark.parametrize("kind", ["safetensors", "torch_file", "dict"])
def test_meta_model_loaded_tensor_by_tensor(tmp_path, kind):
    torch.manual_seed(3)
    eager = _build()
    eager(torch.randint(0, 50, (4,)))  # batch-norm statistics away from their reset values
    if kind == "safetensors":
        safetensors_torch = pytest.importorskip("safetensors.torch")
        source = tmp_path / "model.safetensors"
        safetensors_torch.save_file(eager.state_dict(), str(source))
    elif kind == "torch_file":
        source = tmp_path / "model.pt"
        torch.save(eager.state_dict(), source)
    else:
        source = eager.state_dict()
    model = _meta()
    eng = engine.wrap(model, config=engine_config(tmp_path), state_dict=source)
    assert eng.stats().wrap_peak_materialized_bytes <= largest_module_bytes(eager)
    eng.unwrap()
    assert_same_params(model, eager)


def test_tied_weights_load_from_a_state_dict_with_both_names(tmp_path):
    torch.manual_seed(4)
    eager = TinyGPT()
    state = eager.state_dict()
    assert "lm_head.weight" in state and "wte.weight" in state
    model = _meta(TinyGPT)
    engine.wrap(model, config=engine_config(tmp_path), state_dict=state).unwrap()
    assert_same_params(model, eager)


def test_a_state_dict_loads_into_a_materialized_model_too(tmp_path):
    torch.manual_seed(5)
    source = _build().state_dict()
    model = _build()
    engine.wrap(model, config=engine_config(tmp_path), state_dict=source).unwrap()
    for name, value in model.state_dict().items():
        assert torch.equal(value, source[name]), name


def test_what_a_state_dict_leaves_out_is_named_in_a_warning(tmp_path):
    """transformers warns that weights are "newly initialized" when a checkpoint lacks them (a new
    head); a file that silently lacked some tensors would otherwise train or serve unnoticed."""
    torch.manual_seed(6)
    source = {k: v for k, v in _build().state_dict().items() if not k.startswith("2.")}  # no head
    with pytest.warns(UserWarning, match=r"2 parameters and buffers of the model are not in .* \['2.weight', "
                                         r"'2.bias'\]; train them"):
        engine.wrap(_meta(), config=engine_config(tmp_path / "a"), state_dict=source).unwrap()
    del source["1.2.running_mean"]  # a persistent buffer counts too
    with pytest.warns(UserWarning, match=r"\['1.2.running_mean', '2.weight', '2.bias'\]"):
        engine.wrap(_meta(), config=engine_config(tmp_path / "b"), state_dict=source).unwrap()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.wrap(_meta(), config=engine_config(tmp_path / "c"), state_dict=_build().state_dict()).unwrap()
        engine.wrap(_meta(), config=engine_config(tmp_path / "d"), state_dict=source,  # the caller initializes
                    init_fn=lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None).unwrap()


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_meta_module_without_an_initializer_is_refused(tmp_path):
    model = _meta(lambda: nn.Sequential(nn.Linear(4, 4), NoReset()))
    with pytest.raises(ValueError, match="init_fn"):
        engine.wrap(model, config=engine_config(tmp_path))
    _assert_store_closed(tmp_path)


def test_state_dict_problems_are_refused(tmp_path):
    source = _build().state_dict()
    with pytest.raises(ValueError, match="match no parameter"):
        engine.wrap(_meta(), config=engine_config(tmp_path), state_dict={**source, "extra.weight": torch.ones(1)})
    _assert_store_closed(tmp_path)
    source["2.weight"] = torch.ones(3, 3)
    model = _build()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="shape"):
        engine.wrap(model, config=engine_config(tmp_path), state_dict=source)
    _assert_store_closed(tmp_path)
    # A failed wrap gives a materialized model its values back.
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_wrap_that_fails_half_way_gives_parameters_their_values_back(tmp_path):
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    before = [p.detach().clone() for p in model.parameters()]
    config = engine_config(tmp_path, host_bytes=0, nvme_bytes=16 * 1024)  # room for 4 of the 6 shards
    with pytest.raises(tiered.CapacityError):
        engine.wrap(model, config=config)
    _assert_store_closed(tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
