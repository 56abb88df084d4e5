"""Checkpoints (one process): sharded save and load, the consolidated state dict, resume exactness,
atomic saves and the errors a mismatched or damaged checkpoint raises."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from typing import Optional

import pytest
import safetensors.torch
import torch
from torch import nn

import engine
from engine.checkpoint.sharded import METADATA_FILE, rank_file
from engine.errors import CheckpointError
from engine_models import ConvNet, TinyGPT, engine_config, gpt_tokens, images, store_config

KiB = 1024
LR = 1e-2


def train_config(path, *, optimizer_tier: str = "nvme", compress: bool = False, train_dtype: Optional[str] = None,
                 max_grad_norm: Optional[float] = None) -> engine.EngineConfig:
    return engine.EngineConfig(host_budget="host_tier",
        store=store_config(path), param_tier="nvme", optimizer_tier=optimizer_tier, compress_optimizer=compress,
        train_dtype=train_dtype, max_grad_norm=max_grad_norm, optimizer_group_bytes=8 * KiB, prefetch_bytes=16 * KiB,
    )


def train(model: nn.Module, eng: engine.Engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model(gpt_tokens(seed=step)).float().pow(2).mean()
        loss.backward()
        eng.step()
        eng.zero_grad()
        losses.append(loss.item())
    return losses


def model_with_seed(seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def train_scaled(model: nn.Module, eng: engine.Engine, steps: range) -> list[float]:
    """:func:`train` through eng.backward (which scales the loss under loss scaling)."""
    losses = []
    for step in steps:
        loss = model(gpt_tokens(seed=step)).float().pow(2).mean()
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
        losses.append(loss.item())
    return losses


def masters_of(eng: engine.Engine) -> dict[str, torch.Tensor]:
    return {n: eng.full_fp32_param(p) for n, p in eng.model.named_parameters()}


# ---------------------------------------------------------------------------- torch-style checkpoints


@pytest.mark.parametrize("variant", ["fp32-model-first", "bf16-optimizer-first", "fp16-loss-scaled"])
def test_a_torch_style_checkpoint_resumes_bit_for_bit(tmp_path, variant):
    """torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}) of a wrapped model and
    engine.AdamW holds the whole optimizer state (torch's AdamW format with the fp32 masters, the
    loss scale); loaded into a fresh engine, in either order, the run continues bit for bit."""
    kw = {"fp32-model-first": {}, "bf16-optimizer-first": dict(train_dtype="bfloat16", max_grad_norm=0.05),
          "fp16-loss-scaled": dict(train_dtype="float16")}[variant]
    scaling = engine.LossScaling(2.0**10, growth_interval=1) if variant.startswith("fp16") else None

    def wrapped(seed: int, path: str) -> tuple[nn.Module, engine.AdamW, engine.Engine]:
        model = model_with_seed(seed)
        opt = engine.AdamW(lr=LR, weight_decay=0.01)
        eng = engine.wrap(model, optimizer=opt, config=train_config(tmp_path / path, **kw).replace(
            loss_scaling=scaling))
        return model, opt, eng

    model, opt, eng = wrapped(0, "a")
    train_scaled(model, eng, range(2))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    want = train_scaled(model, eng, range(2, 4))
    want_masters, want_scale = masters_of(eng), eng.loss_scale
    eng.close()

    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    state = saved["optimizer"]["state"]
    assert len(state) == len(list(model.parameters())) and all(s["step"] == 2 for s in state.values())
    assert all(s["master"].dtype == torch.float32 for s in state.values())
    fresh, fresh_opt, eng = wrapped(1, "b")  # other initial values: everything comes from the file
    if variant.endswith("model-first"):
        fresh.load_state_dict(saved["model"])
        fresh_opt.load_state_dict(saved["optimizer"])
    else:
        fresh_opt.load_state_dict(saved["optimizer"])
        fresh.load_state_dict(saved["model"])
    assert eng.completed_steps == 2 and set(fresh_opt.shard_steps.values()) == {2}
    assert train_scaled(fresh, eng, range(2, 4)) == want
    assert all(torch.equal(m, want_masters[n]) for n, m in masters_of(eng).items())
    assert eng.loss_scale == want_scale
    eng.close()


def test_the_optimizer_state_dict_is_refused_where_it_would_not_be_whole(tmp_path, monkeypatch):
    """Never an empty state in silence: beyond half the memory available, opt.state_dict() raises
    naming eng.save_checkpoint; a whole state loads only into a bound optimizer, and one that does
    not fit the model changes nothing."""
    import engine.checkpoint.optimizer_state as optimizer_state

    model = model_with_seed(0)
    opt = engine.AdamW(lr=LR)
    eng = engine.wrap(model, optimizer=opt, config=train_config(tmp_path / "a"))
    train(model, eng, range(1))
    sd = opt.state_dict()
    monkeypatch.setattr(optimizer_state, "memory_sizes", lambda: (1 << 30, 8 * KiB))
    with pytest.raises(RuntimeError, match=r"more than 50% of the .* available.*eng\.save_checkpoint"):
        opt.state_dict()
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"after engine\.wrap"):
        engine.AdamW(lr=LR).load_state_dict(sd)
    before = masters_of(eng)
    bad = copy.deepcopy(sd)
    bad["state"][3]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"has shape \(3,\)"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="parameter groups do not match"):
        opt.load_state_dict(dict(sd, param_groups=[]))
    assert all(torch.equal(m, before[n]) for n, m in masters_of(eng).items())
    assert set(opt.shard_steps.values()) == {1}
    opt.leave_state_to_checkpoints()  # what EngineTrainer and register_engine_state ask for
    assert opt.state_dict()["state"] == {} and set(opt.state_dict()["shard_steps"].values()) == {1}
    eng.close()
    opt.leave_state_to_checkpoints(False)
    with pytest.raises(engine.EngineClosedError):  # the state stays in the closed engine's store
        opt.state_dict()


# ---------------------------------------------------------------------------- weights and state dict


def test_state_dict_is_consolidated_and_loads_into_a_plain_model(tmp_path):
    model = model_with_seed(0)
    want = copy.deepcopy(model).state_dict()
    with engine.wrap(model, config=engine_config(tmp_path)) as eng:
        sd = eng.state_dict()
    assert list(sd) == list(want)
    for name, value in want.items():
        assert torch.equal(sd[name], value) and sd[name].device.type == "cpu", name
    assert sd["lm_head.weight"] is sd["wte.weight"]  # tied, as in state_dict()
    plain = model_with_seed(1)
    plain.load_state_dict(sd)
    assert torch.equal(plain.blocks[0].qkv.weight, want["blocks.0.qkv.weight"])


def test_weights_round_trip_with_buffers(tmp_path):
    model = ConvNet()
    model.train()
    model(images())  # batch norm running statistics move away from their initial values
    ref = copy.deepcopy(model)
    want_out = copy.deepcopy(model).eval()(images(seed=1))
    with engine.wrap(model, config=engine_config(tmp_path / "a", tier="host")) as eng:
        eng.save_checkpoint(tmp_path / "ckpt")
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert files == [METADATA_FILE, rank_file(0)]
    assert not os.path.exists(str(tmp_path / "ckpt") + ".partial")
    # the rank file is plain safetensors: the library reads it
    tensors = safetensors.torch.load_file(str(tmp_path / "ckpt" / rank_file(0)))
    assert torch.equal(tensors["param/head.weight"], ref.head.weight.detach().reshape(-1))
    assert torch.equal(tensors["buffer/features.1.running_mean"], ref.features[1].running_mean)

    torch.manual_seed(5)
    fresh = ConvNet()
    with engine.wrap(fresh, config=engine_config(tmp_path / "b")) as eng:
        eng.load_checkpoint(tmp_path / "ckpt")
        assert torch.equal(fresh.features[1].running_var, ref.features[1].running_var)
        assert torch.equal(fresh.eval()(images(seed=1)), want_out)


def test_channels_last_parameter_keeps_its_memory_order(tmp_path):
    conv = nn.Conv2d(3, 5, 3)
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
    want = conv.weight.detach().clone()
    with engine.wrap(conv, config=engine_config(tmp_path / "a")) as eng:
        eng.save_checkpoint(tmp_path / "ckpt")
        meta = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())
        assert meta["params"][0]["stride"] == list(want.stride())
    other = nn.Conv2d(3, 5, 3)  # row-major: its shards would be in another memory order
    with engine.wrap(other, config=engine_config(tmp_path / "b")) as eng:
        with pytest.raises(CheckpointError, match="strides"):
            eng.load_checkpoint(tmp_path / "ckpt")
    other = nn.Conv2d(3, 5, 3)
    other.weight.data = other.weight.data.contiguous(memory_format=torch.channels_last)
    with engine.wrap(other, config=engine_config(tmp_path / "c")) as eng:
        eng.load_checkpoint(tmp_path / "ckpt")
        assert torch.equal(eng.state_dict()["weight"], want)


# ---------------------------------------------------------------------------- resume exactness


@pytest.mark.parametrize("variant", ["fp32-nvme-compressed", "bf16-host-clipped"])
def test_resume_continues_the_loss_curve_exactly(tmp_path, variant):
    kw = (dict(compress=True) if variant.startswith("fp32")
          else dict(optimizer_tier="host", train_dtype="bfloat16", max_grad_norm=0.05))
    model = model_with_seed(0)
    opt = engine.AdamW(lr=LR, weight_decay=0.01)
    eng = engine.wrap(model, optimizer=opt, config=train_config(tmp_path / "a", **kw))
    train(model, eng, range(2))
    eng.save_checkpoint(tmp_path / "ckpt")
    want = train(model, eng, range(2, 4))
    want_sd = eng.state_dict()
    eng.close()

    fresh = model_with_seed(1)  # other initial values: everything must come from the checkpoint
    fresh_opt = engine.AdamW(lr=0.5, weight_decay=0.0)  # other hyperparameters: restored from the checkpoint
    eng = engine.wrap(fresh, optimizer=fresh_opt, config=train_config(tmp_path / "b", **kw))
    eng.load_checkpoint(tmp_path / "ckpt")
    assert fresh_opt.param_groups[0]["lr"] == LR and fresh_opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert eng.completed_steps == 2 and set(fresh_opt.shard_steps.values()) == {2}
    got = train(fresh, eng, range(2, 4))
    assert got == want  # bit for bit
    for name, value in eng.state_dict().items():
        assert torch.equal(value, want_sd[name]), name
    eng.close()


@pytest.mark.parametrize("make", [
    lambda params, lr: torch.optim.AdamW(params, lr=lr, betas=(0.8, 0.95)),  # tensors, tuple hyperparameters
    lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),  # momentum buffers
], ids=["AdamW", "SGD"])
def test_a_torch_optimizers_state_resumes_with_the_checkpoint(tmp_path, make):
    """A plain torch optimizer's state goes into rank 0's file; a resume continues bit for bit
    (before, its moments started afresh: the checkpoint held engine.AdamW state only)."""
    model = model_with_seed(0)
    eng = engine.wrap(model, optimizer=make(model.parameters(), LR), config=train_config(tmp_path / "a"))
    train(model, eng, range(2))
    eng.save_checkpoint(tmp_path / "ckpt")
    want = train(model, eng, range(2, 4))
    eng.close()

    fresh = model_with_seed(1)
    fresh_opt = make(fresh.parameters(), 0.5)  # other hyperparameters: restored from the checkpoint
    with engine.wrap(fresh, optimizer=fresh_opt, config=train_config(tmp_path / "b")) as eng:
        eng.load_checkpoint(tmp_path / "ckpt")
        assert fresh_opt.param_groups[0]["lr"] == LR
        assert train(fresh, eng, range(2, 4)) == want  # bit for bit

    other = model_with_seed(1)
    with engine.wrap(other, optimizer=torch.optim.Adagrad(other.parameters()), config=train_config(tmp_path / "c")) \
            as eng:
        before = eng.state_dict()
        with pytest.raises(CheckpointError, match="this engine's optimizer is a torch.optim.adagrad.Adagrad"):
            eng.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(v, before[k]) for k, v in eng.state_dict().items())  # refused before any change
        eng.load_checkpoint(tmp_path / "ckpt", load_optimizer=False)  # the weights alone


def test_resume_in_a_new_process(tmp_path):
    """Train 2 steps, save, go on 2 steps; a new process wraps a fresh model, loads, trains 2 steps:
    the same losses, bit for bit."""
    model = model_with_seed(0)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=train_config(tmp_path / "a"))
    train(model, eng, range(2))
    eng.save_checkpoint(tmp_path / "ckpt")
    want = train(model, eng, range(2, 4))
    eng.close()
    script = textwrap.dedent(f"""
        import json, pathlib, sys
        sys.path[:0] = {[os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]!r}
        import engine
        from test_engine_checkpoint import model_with_seed, train, train_config
        model = model_with_seed(7)
        eng = engine.wrap(model, optimizer=engine.AdamW(), config=train_config(pathlib.Path({str(tmp_path / "b")!r})))
        eng.load_checkpoint({str(tmp_path / "ckpt")!r})
        print(json.dumps(train(model, eng, range(2, 4))))
        eng.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == want


def test_a_save_without_the_frozen_parameters_resumes_with_the_models_own(tmp_path):
    """exclude_frozen_parameters (a LoRA fine-tune's checkpoints): the frozen weights are not
    written; a load keeps the wrapped model's own values for them (the base model's) and the run
    goes on bit for bit; a model in which one of them trains is refused."""
    frozen = "blocks.0.qkv.weight"
    model = model_with_seed(0)
    model.blocks[0].qkv.weight.requires_grad_(False)
    base = model.blocks[0].qkv.weight.detach().clone()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=train_config(tmp_path / "a"))
    train(model, eng, range(2))
    eng.save_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True)
    # The weights without it too (DeepSpeed's save_16bit_model and consolidated state dict take the flag)
    whole = eng.state_dict()
    assert eng.state_dict(exclude_frozen_parameters=True).keys() == whole.keys() - {frozen}
    for exclude in (False, True):
        eng.save_weights(tmp_path / f"weights{exclude}", exclude_frozen_parameters=exclude)
    everything, saved = (safetensors.torch.load_file(str(tmp_path / f"weights{exclude}" / "model.safetensors"))
                         for exclude in (False, True))
    assert saved.keys() == everything.keys() - {frozen} and all(torch.equal(v, whole[k]) for k, v in saved.items())
    want = train(model, eng, range(2, 4))
    eng.close()
    meta = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())
    assert meta["frozen_excluded"] and frozen not in {p["name"] for p in meta["params"]}
    assert f"param/{frozen}" not in safetensors.torch.load_file(str(tmp_path / "ckpt" / rank_file(0)))
    assert "blocks.0.qkv.bias" in engine.checkpoint_state_dict(tmp_path / "ckpt")
    assert frozen not in engine.checkpoint_state_dict(tmp_path / "ckpt")

    fresh = model_with_seed(1)  # other values for the trained weights: they come from the checkpoint
    fresh.blocks[0].qkv.weight.requires_grad_(False)
    with torch.no_grad():
        fresh.blocks[0].qkv.weight.copy_(base)  # the frozen one comes from the base model, as in the run
    eng = engine.wrap(fresh, optimizer=engine.AdamW(lr=LR), config=train_config(tmp_path / "b"))
    eng.load_checkpoint(tmp_path / "ckpt")
    assert train(fresh, eng, range(2, 4)) == want
    eng.close()

    trains = model_with_seed(1)  # the parameter takes a gradient here, and the checkpoint has no value for it
    with engine.wrap(trains, optimizer=engine.AdamW(lr=LR), config=train_config(tmp_path / "c")) as eng:
        with pytest.raises(CheckpointError, match=r"lacks \['blocks\.0\.qkv\.weight'\].*freeze them"):
            eng.load_checkpoint(tmp_path / "ckpt")


def test_weights_only_load_starts_the_optimizer_afresh(tmp_path):
    model = model_with_seed(0)
    eng = engine.wrap(model, config=engine_config(tmp_path / "a"))
    eng.save_checkpoint(tmp_path / "weights")
    eng.close()
    trained = model_with_seed(3)
    opt = engine.AdamW(lr=LR)
    eng = engine.wrap(trained, optimizer=opt, config=train_config(tmp_path / "b"))
    train(trained, eng, range(2))  # state exists now; the load must drop it
    with pytest.raises(CheckpointError, match="no optimizer state"):
        eng.load_checkpoint(tmp_path / "weights")
    eng.load_checkpoint(tmp_path / "weights", load_optimizer=False)
    assert opt.shard_steps == {} or set(opt.shard_steps.values()) == {0}
    got = train(trained, eng, range(2))
    eng.close()

    ref = model_with_seed(0)  # the oracle: the saved weights trained from a fresh optimizer
    ref_eng = engine.wrap(ref, optimizer=engine.AdamW(lr=LR), config=train_config(tmp_path / "c"))
    assert train(ref, ref_eng, range(2)) == got
    ref_eng.close()


# ---------------------------------------------------------------------------- errors and atomicity


def test_mismatches_are_reported_before_anything_changes(tmp_path):
    model = model_with_seed(0)
    opt = engine.AdamW(lr=LR)
    eng = engine.wrap(model, optimizer=opt, config=train_config(tmp_path / "a"))
    train(model, eng, range(1))
    eng.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        eng.save_checkpoint(tmp_path / "ckpt")
    before = eng.state_dict()

    meta_file = tmp_path / "ckpt" / METADATA_FILE
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps(dict(meta, world_size=2)))  # rank 0's shards now look twice too large
    # (a parameter that is its own master is loaded from the saved master: that is the entry named)
    with pytest.raises(CheckpointError, match=r"'optim/blocks.0.fc.bias/master' is torch.float32 \(128,\), expected "
                                              r".* \(64,\)"):
        eng.load_checkpoint(tmp_path / "ckpt")
    meta_file.write_text(json.dumps(meta))

    with engine.wrap(TinyGPT(d=64), config=engine_config(tmp_path / "b")) as other:
        with pytest.raises(CheckpointError, match="wte.weight"):
            other.load_checkpoint(tmp_path / "ckpt", load_optimizer=False)
    with engine.wrap(nn.Sequential(nn.Linear(2, 2)), config=engine_config(tmp_path / "c")) as other:
        with pytest.raises(CheckpointError, match="do not match the model's"):
            other.load_checkpoint(tmp_path / "ckpt", load_optimizer=False)
    with engine.wrap(model_with_seed(0), config=engine_config(tmp_path / "d")) as plain:
        with pytest.raises(CheckpointError, match="load_optimizer=False"):
            plain.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        eng.load_checkpoint(tmp_path)

    data = tmp_path / "ckpt" / rank_file(0)
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF  # one bit pattern in the last tensor's data
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="damaged"):
        eng.load_checkpoint(tmp_path / "ckpt")
    data.write_bytes(bytes(raw[:-8]))
    with pytest.raises(CheckpointError, match="size differs"):
        eng.load_checkpoint(tmp_path / "ckpt")
    after = eng.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    eng.close()


class _Unsaveable(nn.Module):
    """A model whose complex128 buffer safetensors cannot name: its save fails while writing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("phase", torch.zeros(2, dtype=torch.complex128))


def test_tagged_checkpoints_latest_and_client_state(tmp_path):
    """DeepSpeed's layout: save(dir, tag=...) writes dir/<tag> and dir/latest; load(dir) takes the
    latest and returns the client_state saved with it (here an LR scheduler's and an epoch)."""
    model = model_with_seed(0)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=train_config(tmp_path / "a"))
    scheduler = torch.optim.lr_scheduler.StepLR(eng.optimizer, step_size=1, gamma=0.5)
    root = tmp_path / "ckpts"
    states = {}
    for step in (1, 2):
        train(model, eng, range(step - 1, step))
        scheduler.step()
        eng.save_checkpoint(root, tag=f"step{step}", client_state={"epoch": step, "scheduler": scheduler.state_dict()})
        states[step] = eng.state_dict()
    assert sorted(os.listdir(root)) == ["latest", "step1", "step2"] and (root / "latest").read_text() == "step2"
    with pytest.raises(TypeError, match=r"client_state must hold JSON values .* and tensors.*torch.from_numpy"):
        eng.save_checkpoint(root, tag="bad", client_state={"t": torch.ones(2).numpy()})
    with pytest.raises(ValueError, match="may not use the key '__tensor__'"):
        eng.save_checkpoint(root, tag="bad", client_state={"x": [{"__tensor__": 0}]})
    circular: dict = {"epoch": 1, "history": []}
    circular["history"].append(circular)
    with pytest.raises(TypeError, match="client_state contains itself .*circular reference"):
        eng.save_checkpoint(root, tag="bad", client_state=circular)
    shared = [1, 2]  # the same list twice is no cycle: saved as two copies
    eng.save_checkpoint(tmp_path / "shared", client_state={"a": shared, "b": shared, "c": (shared, shared)})
    assert eng.load_checkpoint(tmp_path / "shared") == {"a": [1, 2], "b": [1, 2], "c": [[1, 2], [1, 2]]}
    for tag in ("a/b", "latest", ""):
        with pytest.raises(ValueError, match="tag"):
            eng.save_checkpoint(root, tag=tag)
    assert sorted(os.listdir(root)) == ["latest", "step1", "step2"]  # nothing written by the refusals
    eng.close()

    model = model_with_seed(1)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=0.5), config=train_config(tmp_path / "b"))
    scheduler = torch.optim.lr_scheduler.StepLR(eng.optimizer, step_size=1, gamma=0.5)
    client = eng.load_checkpoint(root)  # dir/latest -> step2
    scheduler.load_state_dict(client["scheduler"])
    assert client["epoch"] == 2 and eng.completed_steps == 2
    assert scheduler.get_last_lr() == [LR * 0.25] and eng.optimizer.param_groups[0]["lr"] == LR * 0.25
    assert all(torch.equal(v, states[2][k]) for k, v in eng.state_dict().items())
    assert eng.load_checkpoint(root, tag="step1")["epoch"] == 1 and eng.completed_steps == 1
    assert all(torch.equal(v, states[1][k]) for k, v in eng.state_dict().items())
    eng.save_checkpoint(tmp_path / "plain")
    assert eng.load_checkpoint(tmp_path / "plain") == {}  # saved without client_state
    eng.close()
    offline = engine.checkpoint_state_dict(root)  # the latest too
    assert all(torch.equal(v, states[2][k]) for k, v in offline.items())


def test_client_state_carries_tensors_without_pickle(tmp_path):
    """DeepSpeed pickles client_state and scripts keep tensors in it (RNG states, running figures):
    they go into rank 0's safetensors file, come back where they were, and a damaged one is refused."""
    model = model_with_seed(0)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=train_config(tmp_path / "a"))
    train(model, eng, range(1))
    torch.manual_seed(5)
    tensors = {"rng": torch.get_rng_state(), "scalar": torch.tensor(2.5, dtype=torch.float64),
               "strided": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t(), "empty": torch.zeros(0, 2),
               "flags": torch.tensor([True, False])}
    eng.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 3, "state": tensors, "history": [torch.ones(2), 1.5]})
    expected_draw = torch.rand(4)
    meta = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())
    assert meta["client_state"]["state"]["rng"] == {"__tensor__": 0}  # the JSON holds markers, not bytes
    client = eng.load_checkpoint(tmp_path / "ckpt")
    assert client["epoch"] == 3 and client["history"][1] == 1.5 and torch.equal(client["history"][0], torch.ones(2))
    for name, tensor in tensors.items():
        got = client["state"][name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name
    torch.set_rng_state(client["state"]["rng"])
    assert torch.equal(torch.rand(4), expected_draw)  # the resumed run draws what the saved one would have

    file = tmp_path / "ckpt" / rank_file(0)
    header = int.from_bytes(file.read_bytes()[:8], "little")
    offsets = json.loads(file.read_bytes()[8:8 + header])["client_state/0"]["data_offsets"]
    data = bytearray(file.read_bytes())
    data[8 + header + offsets[0]] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="'client_state/0' is damaged"):
        eng.load_checkpoint(tmp_path / "ckpt")
    eng.close()


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    model = _Unsaveable()
    with engine.wrap(model, config=engine_config(tmp_path / "a")) as eng:
        with pytest.raises(ValueError, match="complex128"):
            eng.save_checkpoint(tmp_path / "ckpt")
        assert not os.path.exists(tmp_path / "ckpt")
        model.phase = torch.zeros(2)  # now it can be saved
        eng.save_checkpoint(tmp_path / "ckpt")
        good = (tmp_path / "ckpt" / rank_file(0)).read_bytes()
        model.phase = torch.zeros(2, dtype=torch.complex128)
        with pytest.raises(ValueError, match="complex128"):
            eng.save_checkpoint(tmp_path / "ckpt", overwrite=True)
        assert (tmp_path / "ckpt" / rank_file(0)).read_bytes() == good
        assert sorted(os.listdir(tmp_path)) == ["a", "ckpt"]  # no .partial or .old left behind
        model.phase = torch.ones(2)
        eng.save_checkpoint(tmp_path / "ckpt", overwrite=True)
        assert safetensors.torch.load_file(str(tmp_path / "ckpt" / rank_file(0)))["buffer/phase"].sum() == 2


def test_safetensors_streams_interoperate_with_the_library(tmp_path):
    from engine.io.safetensors_stream import SafetensorsReader, SafetensorsWriter, TensorSpec
    from engine.errors import SafetensorsFormatError

    tensors = {
        "a": torch.arange(5, dtype=torch.bfloat16), "b": torch.randn(3, 4), "c": torch.tensor(7, dtype=torch.int64),
        "d": torch.zeros(0, 2, dtype=torch.float16), "e": torch.tensor([True, False]),
    }
    theirs = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(tensors, str(theirs), metadata={"k": "v"})
    with SafetensorsReader(str(theirs)) as reader:
        assert reader.metadata == {"k": "v"}
        for name, value in tensors.items():
            got = reader.read(name)
            assert got.dtype == value.dtype and torch.equal(got, value), name

    ours = tmp_path / "ours.safetensors"
    writer = SafetensorsWriter(str(ours), [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    assert [s.name for s in writer.order] == ["c", "b", "a", "d", "e"]  # largest items first: aligned offsets
    for spec in writer.order:
        writer.write(spec.name, tensors[spec.name])
    writer.close()
    loaded = safetensors.torch.load_file(str(ours))
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())

    ours.write_bytes(ours.read_bytes()[:-1])
    with pytest.raises(SafetensorsFormatError, match="truncated"):
        SafetensorsReader(str(ours))
