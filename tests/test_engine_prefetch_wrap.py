"""Forward-only loops: the prefetch window runs into the next forward (the tied embedding / head is
not read twice per forward, the next forward's first parameters load between calls), and any write
between forwards (an optimizer step) drops what was prefetched, so no forward sees stale values."""

from __future__ import annotations

import copy

import torch

import engine
from engine_models import KiB, TinyGPT, engine_config, gpt_tokens

WINDOW = 64 * KiB


def test_forward_only_loop_reads_each_parameter_once_per_forward(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    unique = len(list(model.parameters()))  # the tied wte / lm_head weight counts once
    eng = engine.wrap(model, config=engine_config(tmp_path, prefetch_bytes=WINDOW))
    with torch.inference_mode():
        for seed in range(5):
            x = gpt_tokens(seed=seed)
            before = eng.stats()
            out = model(x)
            after = eng.stats()
            assert torch.equal(out, ref(x))
            if seed >= 2:  # recorded in forward 1, wrapping around from forward 2 on
                # The tied weight, needed first and last, stays in the window: never read again.
                assert after.fetches - before.fetches == unique - 1
                assert after.prefetch_misses == before.prefetch_misses
    assert 0 < eng.stats().materialized_bytes <= WINDOW  # the next forward's first parameters
    eng.drop_prefetched()
    assert eng.stats().materialized_bytes == 0
    eng.unwrap()


def test_optimizer_step_between_forward_only_calls_is_seen(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-2), config=engine_config(tmp_path, prefetch_bytes=WINDOW))
    x = gpt_tokens(seed=7)
    for step in range(3):
        for m, opt in ((model, None), (ref, ref_opt)):
            m(gpt_tokens(seed=step)).float().pow(2).mean().backward()
        with torch.no_grad():  # between backward and step: forward-only calls prefetch across calls
            for _ in range(2):
                assert torch.equal(model(x), ref(x))
        assert eng.stats().materialized_bytes > 0
        eng.step()
        eng.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))  # the new values, not the prefetched old ones
    eng.unwrap()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_torch_optimizer_and_load_state_dict_between_forward_only_calls(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    eng = engine.wrap(model, optimizer=opt, config=engine_config(tmp_path, prefetch_bytes=WINDOW))
    x = gpt_tokens(seed=3)
    for m in (model, ref):
        m(gpt_tokens(seed=1)).sum().backward()
    with torch.no_grad():
        model(x), model(x)
    opt.step(), ref_opt.step()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
        model(x)
    new = {k: v + 0.5 for k, v in ref.state_dict().items()}
    model.load_state_dict(new), ref.load_state_dict(new)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    eng.unwrap()
