"""Run by tests/test_engine_released.py in a subprocess: touch released parameters of a wrapped model
in the ways users do between steps and print one JSON line per access with what happened. A crash
(what reading a 0-byte storage used to do) kills this process, which the test sees as its exit code.

    python released_probe.py STORE_DIR SCENARIO [SCENARIO ...]
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import sys
from typing import Any, Callable

import torch
from torch import nn

import engine
import tiered
from engine.errors import ReleasedParameterError

SCENARIO = [""]  # the scenario running, for the output lines


def model_and_ref() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    return model, copy.deepcopy(model)


def config(path: str) -> engine.EngineConfig:
    store = tiered.StoreConfig(path=path, host_bytes=1 << 20)
    return engine.EngineConfig(store=store, host_budget="host_tier", param_tier="nvme", prefetch_bytes=0)


def probe(case: str, fn: Callable[[], Any]) -> None:
    """Run one access; print what happened."""
    try:
        result = fn()
    except ReleasedParameterError as exc:
        outcome = "released" if "eng.gathered" in str(exc) else "released-without-hint"
    except Exception as exc:  # noqa: BLE001 - the test wants the kind of every other error
        outcome = f"error:{type(exc).__name__}"
    else:
        if isinstance(result, torch.Tensor) and result.device.type == "meta":
            outcome = "meta"
        else:
            outcome = "ok"
    print(json.dumps({"scenario": SCENARIO[0], "case": case, "outcome": outcome}), flush=True)


def accesses(model: nn.Module) -> None:
    """Every access a user makes between steps, against the first layer's weight."""
    w = model[0].weight
    probe("metadata", lambda: (tuple(w.shape), w.dtype, w.device, w.numel(), w.requires_grad, w.grad, w.is_leaf))
    probe("repr", lambda: repr(w) + str(w) + f"{w}")
    probe("print_model", lambda: repr(model))
    probe("add", lambda: w + 1)
    probe("clone", lambda: w.clone())
    probe("detach_numpy", lambda: w.detach().numpy())
    probe("item", lambda: w.sum().item())
    probe("matmul", lambda: torch.ones(2, 8) @ w.t())
    probe("data_copy", lambda: w.data.copy_(torch.zeros_like(w)))
    probe("inplace", lambda: w.mul_(2))
    probe("torch_save", lambda: torch.save(w, io.BytesIO()))
    probe("to_same_device", lambda: model.to("cpu").float())
    probe("half", lambda: model.half())
    probe("to_meta", lambda: model.to("meta"))
    probe("hash", lambda: {w: 1}[w])
    probe("state_dict", lambda: model.state_dict()["0.weight"] + 0)


def main(scenario: str, path: str) -> None:
    model, ref = model_and_ref()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    if scenario == "between_steps":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        eng = engine.wrap(model, config=config(path), optimizer=opt)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().sum().backward()
            o.step()
        probe("clip_grad_norm", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        accesses(model)
        opt.zero_grad()
        check_same(model(x), ref(x))
        eng.unwrap()
    elif scenario == "engine_adamw":
        eng = engine.wrap(model, config=config(path), optimizer=engine.AdamW(lr=1e-2))
        model(x).square().sum().backward()
        eng.step()
        eng.zero_grad()
        accesses(model)
        eng.close()
    elif scenario == "forward_only":
        eng = engine.wrap(model, config=dataclasses.replace(config(path), prefetch_bytes=1 << 20))
        with torch.inference_mode():
            check_same(model(x), ref(x))
        accesses(model)
        with torch.inference_mode():
            check_same(model(x), ref(x))
        eng.close()
    elif scenario == "between_forward_and_backward":
        eng = engine.wrap(model, config=config(path))
        out = model(x)
        accesses(model)
        out.square().sum().backward()
        ref(x).square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            check_same(p.grad, q.grad)
        eng.unwrap()
    elif scenario == "after_close":
        eng = engine.wrap(model, config=config(path))
        saved = eng.state_dict()
        eng.close()
        accesses(model)
        model.float()  # `half` above converted the meta parameters
        eng2 = engine.wrap(model, config=config(path + "-again"), state_dict=saved)  # the same model object again
        with torch.no_grad():
            check_same(model(x), ref(x))
        eng2.unwrap()
    elif scenario == "after_unwrap":
        eng = engine.wrap(model, config=config(path))
        eng.unwrap()
        accesses(model)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    probe("done", lambda: None)


def check_same(a: torch.Tensor, b: torch.Tensor) -> None:
    if not torch.equal(a, b):
        raise SystemExit(f"results differ from plain torch: {a} vs {b}")


if __name__ == "__main__":
    for name in sys.argv[2:]:
        SCENARIO[0] = name
        main(name, f"{sys.argv[1]}/{name}")
