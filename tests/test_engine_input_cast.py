"""EngineConfig.cast_forward_inputs: fp32 inputs meet fp16 weights. The oracle is the same wrapped
model called with the inputs cast by hand. And the root's inputs moved to the compute device."""

from __future__ import annotations

import collections
from typing import NamedTuple

import pytest
import torch
from torch import nn

import engine
from engine.paging.input_cast import InputCast
from engine_models import engine_config


class Pair(NamedTuple):
    x: torch.Tensor
    scale: torch.Tensor


class TakesNestedInputs(nn.Module):
    """A forward whose floating inputs sit in a namedtuple, a dict and a keyword, beside integer ids."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, pair: Pair, extra: dict, *, bias: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids) + pair.x) * pair.scale + extra["shift"] + bias


def inputs(dtype: torch.dtype) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (4,), generator=g)
    x, scale, shift, bias = (torch.randn(4, 8, generator=g).to(dtype) for _ in range(4))
    return (ids, Pair(x, scale), {"shift": shift}), {"bias": bias}


def test_floating_inputs_are_cast_and_ids_are_not(tmp_path):
    torch.manual_seed(0)
    config = engine_config(tmp_path).replace(train_dtype="float16", cast_forward_inputs=True)
    model = TakesNestedInputs()
    eng = engine.wrap(model, config=config)
    try:
        args, kwargs = inputs(torch.float32)
        out = model(*args, **kwargs)  # without the cast, fp32 x + fp16 embedding would upcast, then fail in lin
        want_args, want_kwargs = inputs(torch.float16)
        eng.unwrap()
    except BaseException:
        eng.close()
        raise
    assert out.dtype == torch.float16
    assert torch.equal(out, model(*want_args, **want_kwargs))  # the same as casting by hand
    assert args[0].dtype == torch.int64  # the caller's tensors are not changed in place


def test_without_it_fp32_inputs_fail_and_unwrap_removes_the_hook(tmp_path):
    model = nn.Linear(4, 4)
    eng = engine.wrap(model, config=engine_config(tmp_path).replace(train_dtype="float16"))
    try:
        with pytest.raises(RuntimeError, match="dtype"):
            model(torch.randn(2, 4))
    finally:
        eng.close()
    model = nn.Linear(4, 4)
    eng = engine.wrap(model, config=engine_config(tmp_path / "b").replace(train_dtype="float16",
                                                                           cast_forward_inputs=True))
    assert model(torch.randn(2, 4)).dtype == torch.float16
    eng.unwrap()
    assert not model._forward_pre_hooks  # the engine's hooks are all gone with it


def test_config_needs_a_train_dtype(tmp_path):
    with pytest.raises(ValueError, match="cast_forward_inputs casts inputs to train_dtype, which is None"):
        engine_config(tmp_path).replace(cast_forward_inputs=True)
    with pytest.raises(ValueError, match="cast_forward_inputs must be True or False"):
        engine_config(tmp_path).replace(train_dtype="float16", cast_forward_inputs=1)


class Devices(nn.Module):
    """Returns where each of its inputs arrived."""

    def forward(self, ids: torch.Tensor, pair: Pair, extra: dict, *, bias: torch.Tensor) -> list[torch.device]:
        return [ids.device, pair.x.device, pair.scale.device, extra["shift"].device, bias.device]


def test_inputs_move_to_the_compute_device_with_their_dtypes_kept():
    """The move the engine makes when it computes on an accelerator (tests/test_cuda.py runs it on a
    GPU): every tensor, nested ones too, goes to the device; dtypes stay unless a cast is asked."""
    model = Devices()
    hook = InputCast(model, None, torch.device("meta"))  # a device this machine is sure to have
    args, kwargs = inputs(torch.float32)
    assert model(*args, **kwargs) == [torch.device("meta")] * 5
    assert args[0].device.type == "cpu"  # the caller's tensors stay where they were
    hook.remove()
    both = InputCast(Identity(), torch.float16, torch.device("meta"))
    ids, x = both._cast((torch.arange(3), torch.ones(2)))
    assert (ids.device.type, ids.dtype, x.device.type, x.dtype) == ("meta", torch.int64, "meta", torch.float16)
    ordered = collections.OrderedDict(x=torch.ones(2), n=3)
    moved = both._cast(ordered)  # a dict subclass keeps its type, and the caller's is not changed
    assert type(moved) is collections.OrderedDict and moved["x"].is_meta and moved["n"] == 3
    assert not ordered["x"].is_meta
    both.remove()
    assert not model._forward_pre_hooks


class Identity(nn.Module):
    def forward(self, *args):
        return args
