"""Activations in the store (EngineConfig.activation_tier): tensors saved for backward go to the
store during forward and come back in backward. The oracle is plain PyTorch: outputs, gradients and
AdamW losses equal exactly; the store is checked to hold no activation once backward is done."""

from __future__ import annotations

import copy
import gc
import pathlib
import shutil
import tempfile
from typing import Optional

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import engine
import tiered
from engine.paging.saved_activations import ACTIVATION_KEY_PREFIX
from engine_models import KiB, TinyGPT, assert_same_grads, engine_config, gpt_tokens, train_parity
from test_engine_training import train_both, training_config

TIERS = ["host", "nvme"]


def offload_config(tmp_path, tier: str, *, window: int = 256 * KiB, **kw) -> engine.EngineConfig:
    """Every saved tensor offloaded (min 1 byte); a small window, so puts finish before backward."""
    return engine_config(tmp_path, **kw).replace(
        activation_tier=tier, activation_min_bytes=1, activation_window_bytes=window)


def activation_keys(eng: engine.Engine) -> list[str]:
    return [k for k in eng.store.keys() if k.startswith(ACTIVATION_KEY_PREFIX)]


@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
@pytest.mark.parametrize("tier", TIERS)
def test_outputs_and_gradients_equal_plain_pytorch(tmp_path, tier, checkpoint):
    torch.manual_seed(0)
    model = TinyGPT(checkpoint=checkpoint)
    eng = train_parity(model, offload_config(tmp_path, tier, window=4 * KiB), [gpt_tokens(seed=s) for s in range(3)])
    try:
        stats = eng.stats()
        assert stats.activation_bytes_offloaded > 0
        assert stats.activation_bytes_read > 0  # a 4 KiB window: most puts were done, their tensors let go
        assert activation_keys(eng) == []  # every entry deleted by the end of its backward
    finally:
        eng.close()


@pytest.mark.parametrize("tier", TIERS)
def test_adamw_losses_equal_torch_adamw(tmp_path, tier):
    torch.manual_seed(0)
    config = training_config(tmp_path).replace(activation_tier=tier, activation_min_bytes=1)
    losses, ref_losses, eng, _ = train_both(TinyGPT(), config, steps=4)
    try:
        assert losses == ref_losses
        assert eng.stats().activation_bytes_offloaded > 0
    finally:
        eng.close()


def _saved_storage_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages plain PyTorch's forward saves, other than parameters'."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in params and not (t.is_leaf and t.requires_grad):
            storages[s._cdata] = s.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(storages.values())


def test_views_of_one_storage_move_once(tmp_path):
    """q, k and v are views of one projection's output (and transposes of them): one entry each storage."""
    torch.manual_seed(0)
    model = TinyGPT()
    x = gpt_tokens(seed=0)
    want = _saved_storage_bytes(copy.deepcopy(model), x)
    eng = engine.wrap(model, config=offload_config(tmp_path, "nvme", host_bytes=1024 * KiB))
    try:
        model(x).pow(2).mean().backward()
        assert eng.stats().activation_bytes_offloaded == want
    finally:
        eng.close()


def test_backward_twice_with_retain_graph(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, config=offload_config(tmp_path, "nvme"))
    try:
        x = gpt_tokens(seed=1)
        loss, ref_loss = model(x).pow(2).mean(), ref(x).pow(2).mean()
        loss.backward(retain_graph=True)
        ref_loss.backward(retain_graph=True)
        read_once = eng.stats().activation_bytes_read
        loss.backward()
        ref_loss.backward()
        assert_same_grads(model, ref)  # gradients accumulated over both backwards
        assert eng.stats().activation_bytes_read > read_once  # the second backward read them again
        assert activation_keys(eng) == []
    finally:
        eng.close()


def test_a_graph_dropped_without_backward_leaves_nothing(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    eng = engine.wrap(model, config=offload_config(tmp_path, "nvme"))
    try:
        out = model(gpt_tokens(seed=0))
        assert eng.stats().activation_bytes_offloaded > 0
        del out
        gc.collect()
        model(gpt_tokens(seed=1)).pow(2).mean().backward()  # its forward collects what the first let go of
        assert activation_keys(eng) == []
    finally:
        eng.close()


class _InPlaceAfterSave(nn.Module):
    """sigmoid saves its output, which is then changed in place: autograd refuses the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.a(x))
        h.mul_(2)
        return self.b(h)


def test_an_in_place_change_after_save_is_refused_as_autograd_does(tmp_path):
    torch.manual_seed(0)
    model = _InPlaceAfterSave()
    x = torch.randn(16, 64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        copy.deepcopy(model)(x).sum().backward()
    eng = engine.wrap(model, config=offload_config(tmp_path, "nvme"))
    try:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            model(x).sum().backward()
    finally:
        eng.close()


class _Wide(nn.Module):
    """Saves several 64 KiB activations per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


def test_forward_holds_at_most_the_window_for_unfinished_puts(tmp_path):
    torch.manual_seed(0)
    model = _Wide()
    window = 128 * KiB
    eng = train_parity(model, offload_config(tmp_path, "nvme", window=window, host_bytes=1024 * KiB),
                       [torch.randn(64, 256, generator=torch.Generator().manual_seed(s)) for s in range(2)])
    try:
        stats = eng.stats()
        assert stats.activation_bytes_offloaded >= 2 * 12 * 64 * KiB  # 12 storages of 64 KiB per forward
        assert 0 < stats.activation_peak_write_bytes <= window + 64 * KiB  # the window, plus the one that crossed it
    finally:
        eng.close()


def test_an_activation_the_tier_cannot_hold_stays_in_memory(tmp_path):
    """A saved storage larger than the host budget cannot be put there: a warning, and backward is
    still exact (no gradient lost)."""
    torch.manual_seed(0)
    model = _Wide()
    config = offload_config(tmp_path, "host", host_bytes=32 * KiB)
    with pytest.warns(RuntimeWarning, match="stays in memory"):
        eng = train_parity(model, config, [torch.randn(64, 256)])
    try:
        assert activation_keys(eng) == []
    finally:
        eng.close()


def test_small_saved_tensors_stay_in_memory(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    config = engine_config(tmp_path).replace(activation_tier="nvme", activation_min_bytes=1 << 30)
    eng = train_parity(model, config, [gpt_tokens(seed=0)])
    try:
        assert eng.stats().activation_bytes_offloaded == 0
    finally:
        eng.close()


def test_wrap_deletes_activations_a_crashed_run_left(tmp_path):
    config = offload_config(tmp_path, "nvme")
    with tiered.TieredStore.open(config.store) as store:
        store.sync.put(ACTIVATION_KEY_PREFIX + "7", torch.ones(1024))
    eng = engine.wrap(TinyGPT(), config=config)
    try:
        assert activation_keys(eng) == []
    finally:
        eng.close()


def test_close_deletes_activations_of_a_graph_still_alive(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    config = offload_config(tmp_path, "nvme")
    eng = engine.wrap(model, config=config)
    out = model(gpt_tokens(seed=0))  # a graph kept past close
    eng.close()
    with tiered.TieredStore.open(config.store) as store:
        assert not [k for k in store.keys() if k.startswith(ACTIVATION_KEY_PREFIX)]
    del out


def test_wrap_refuses_activations_for_a_host_tier_without_budget(tmp_path):
    config = engine_config(tmp_path, host_bytes=0, tier="nvme").replace(activation_tier="host")
    with pytest.raises(ValueError, match="activation_tier is 'host' but the store's host_bytes is 0"):
        engine.wrap(TinyGPT(), config=config)


@pytest.mark.parametrize("field, value", [
    ("activation_tier", "disk"), ("activation_tier", "device"), ("activation_min_bytes", 0),
    ("activation_window_bytes", 0), ("activation_window_bytes", 1.5),
])
def test_config_refuses_bad_values(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        engine_config(tmp_path).replace(**{field: value})


class ActivationMachine(RuleBasedStateMachine):
    """Random forwards, backwards (with and without retain_graph), dropped graphs and zero_grads on a
    wrapped model with its activations in the store, each mirrored on a plain copy: gradients equal
    after every backward, and once every graph is gone the store holds no activation."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="activation-machine-")
        torch.manual_seed(0)
        self.model = TinyGPT()
        self.ref = copy.deepcopy(self.model)
        self.graphs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.eng: Optional[engine.Engine] = None

    @initialize(tier=st.sampled_from(TIERS), window=st.sampled_from([4 * KiB, 64 * KiB, 1024 * KiB]))
    def wrap(self, tier: str, window: int) -> None:
        self.eng = engine.wrap(self.model, config=offload_config(pathlib.Path(self.tmp), tier, window=window))

    @rule(seed=st.integers(0, 3))
    def forward(self, seed: int) -> None:
        x = gpt_tokens(seed=seed)
        out, want = self.model(x), self.ref(x)
        assert torch.equal(out, want)
        self.graphs.append((out.pow(2).mean(), want.pow(2).mean()))

    @precondition(lambda self: self.graphs)
    @rule(data=st.data(), retain=st.booleans())
    def backward(self, data: st.DataObject, retain: bool) -> None:
        i = data.draw(st.integers(0, len(self.graphs) - 1))
        loss, ref_loss = self.graphs[i]
        loss.backward(retain_graph=retain)
        ref_loss.backward(retain_graph=retain)
        assert_same_grads(self.model, self.ref)
        if not retain:
            del self.graphs[i]

    @precondition(lambda self: self.graphs)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        del self.graphs[data.draw(st.integers(0, len(self.graphs) - 1))]

    @rule()
    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.ref.zero_grad(set_to_none=True)

    def teardown(self) -> None:
        try:
            if self.eng is not None:
                self.graphs.clear()
                gc.collect()
                self.forward(0)  # its forward collects every entry the dropped graphs let go of
                self._last_backward()
                assert activation_keys(self.eng) == []
                self.eng.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _last_backward(self) -> None:
        loss, ref_loss = self.graphs.pop()
        loss.backward()
        ref_loss.backward()
        assert_same_grads(self.model, self.ref)


ActivationMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=10, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestActivationMachine = ActivationMachine.TestCase
