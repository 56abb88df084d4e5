"""eng.gathered(): full parameters in memory for a block, read-only or written back (world 1 and 2).

Oracle: the same model unwrapped, with the same change made to it."""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch
import torch.distributed as dist
from engine_models import TinyGPT, engine_config, gpt_tokens
from test_engine_distributed import run_ranks
from torch import nn

import engine
from engine.errors import ReleasedParameterError


def small_gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab=61, d=33, heads=3, layers=1, ctx=16)


def change(model: nn.Module) -> None:
    """The edit a user makes to a gathered model (in place, and by re-assigning .data)."""
    with torch.no_grad():
        params = list(model.parameters())
        params[0].mul_(0.5)
        params[-1].data = torch.full_like(params[-1], 0.25)


def test_gathered_reads_full_values_and_releases_after(tmp_path):
    model = small_gpt()
    ref = copy.deepcopy(model)
    eng = engine.wrap(model, config=engine_config(tmp_path))
    with eng.gathered() as params:
        assert len(params) == len({id(p) for p in ref.parameters()})
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(snapshot[k], v) for k, v in ref.state_dict().items())
    assert eng.stats().materialized_bytes == 0
    with pytest.raises(ReleasedParameterError):
        next(model.parameters()) + 1
    with eng.gathered(model.blocks[0]) as params:  # a module: its parameters only
        assert [id(p) for p in params] == [id(p) for p in model.blocks[0].parameters()]
    eng.unwrap()


def test_read_only_gathered_discards_changes_and_writeback_keeps_them(tmp_path):
    model = small_gpt()
    ref = copy.deepcopy(model)
    x = gpt_tokens(vocab=61)
    eng = engine.wrap(model, config=engine_config(tmp_path))
    with eng.gathered():
        change(model)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))  # discarded
    with eng.gathered(writeback=True):
        change(model)
    change(ref)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert all(torch.equal(a, b) for a, b in zip(eng.state_dict().values(), ref.state_dict().values()))
    eng.unwrap()


def test_writeback_with_engine_adamw_resets_master_weights(tmp_path):
    model = small_gpt()
    ref = copy.deepcopy(model)
    x = gpt_tokens(vocab=61)
    eng = engine.wrap(model, config=engine_config(tmp_path), optimizer=engine.AdamW(lr=1e-2, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        for m in (model, ref):
            m(x).float().pow(2).mean().backward()
        eng.step(), eng.zero_grad(), ref_opt.step(), ref_opt.zero_grad()
        if step == 0:  # between the two steps: the second step must start from the changed values
            with eng.gathered(writeback=True):
                change(model)
            change(ref)
    with eng.gathered():
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
    eng.close()


def test_bf16_masters_follow_only_the_values_a_write_changes(tmp_path):
    """bf16 parameters with fp32 masters: loading the model's own state dict back keeps every master
    bit for bit (the Hugging Face Trainer's resume does that after the engine's checkpoint); a write
    that changes one row moves that row's masters to the written values and no other."""
    model = small_gpt()
    config = engine_config(tmp_path).replace(train_dtype="bfloat16")
    eng = engine.wrap(model, config=config, optimizer=engine.AdamW(lr=1e-2))
    model(gpt_tokens(vocab=61)).float().pow(2).mean().backward()
    eng.step()
    params = dict(model.named_parameters())
    masters = {n: eng.full_fp32_param(p) for n, p in params.items()}
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())  # bits a bf16 copy lacks

    model.load_state_dict(model.state_dict())
    assert all(torch.equal(eng.full_fp32_param(p), masters[n]) for n, p in params.items())

    weight = params["blocks.0.fc.weight"]
    with eng.gathered([weight], writeback=True):
        with torch.no_grad():
            weight[0] = 0.5
    got = eng.full_fp32_param(weight)
    assert torch.equal(got[0], torch.full_like(got[0], 0.5)) and torch.equal(got[1:], masters["blocks.0.fc.weight"][1:])
    assert all(torch.equal(eng.full_fp32_param(p), masters[n]) for n, p in params.items() if p is not weight)
    eng.close()


def test_gathered_rejects_bad_arguments(tmp_path):
    model = small_gpt()
    eng = engine.wrap(model, config=engine_config(tmp_path))
    with pytest.raises(ValueError, match="modifier_rank"):
        eng.gathered(modifier_rank=1)
    with pytest.raises(ValueError, match="does not manage"):
        eng.gathered([nn.Parameter(torch.zeros(2))])
    with pytest.raises(TypeError, match="params must be"):
        eng.gathered("blocks")
    first = next(model.parameters())
    shape = first.shape
    with eng.gathered([first]):
        before = first.detach().clone()
    with pytest.raises(ValueError, match=r"replaced inside eng.gathered\(\) by a tensor of shape \(3,\)"):
        with eng.gathered(writeback=True):
            first.data = torch.zeros(3)
    assert eng.stats().materialized_bytes == 0  # released despite the error
    assert first.shape == shape  # back on the engine's storage, with the stored values
    with eng.gathered([first]):
        assert torch.equal(first, before)
    eng.close()
    with pytest.raises(engine.EngineClosedError):
        eng.gathered()


# ---------------------------------------------------------------------------- world size 2


def _ranks_gathered(rank: int, root: str) -> None:
    model = small_gpt()
    ref = copy.deepcopy(model)
    x = gpt_tokens(vocab=61)
    eng = engine.wrap(model, config=engine_config(pathlib.Path(root)))
    assert eng.store.config.path.endswith(f"rank{rank}")
    with eng.gathered():  # every rank sees every parameter whole
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
    with eng.gathered(modifier_rank=0):  # only rank 0 changes them; rank 1 gets rank 0's values
        if rank == 0:
            change(model)
        else:
            with torch.no_grad():
                next(model.parameters()).fill_(7.0)  # overwritten by the broadcast
    change(ref)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    with eng.gathered(writeback=True):  # every rank makes the same change
        change(model)
    change(ref)
    sd = eng.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    dist.barrier()
    eng.close()


def test_gathered_at_world_size_two(tmp_path):
    run_ranks(_ranks_gathered, str(tmp_path))
