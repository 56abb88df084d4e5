"""torch.compile over a wrapped model: dynamo traces the forward, breaking the graph at the engine's
module hooks, and training still equals plain PyTorch exactly. The backend is "eager" (dynamo's
tracing and guards, no code generation), so the test needs no C++ compiler."""

from __future__ import annotations

import copy

import torch

import engine
from engine_models import TinyGPT, gpt_tokens
from test_engine_training import LR, assert_trained_equal, training_config


def test_compiled_wrapped_model_trains_as_plain_pytorch(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # torch's cache, else in /tmp
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=training_config(tmp_path))
    compiled = torch.compile(model, backend="eager")
    try:
        for i in range(3):
            x = gpt_tokens(seed=i)
            loss = compiled(x).float().pow(2).mean()
            loss.backward()
            eng.step()
            eng.zero_grad()
            ref_loss = ref(x).float().pow(2).mean()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert loss.item() == ref_loss.item(), i
        assert eng.stats().fetches > 0  # the hooks ran under dynamo: parameters were paged in
    except BaseException:
        eng.close()
        raise
    finally:
        torch.compiler.reset()  # dynamo's caches are per process: leave none to later tests
    assert_trained_equal(model, eng, ref)
