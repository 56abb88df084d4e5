"""``engine.initialize`` without ``store=``, as DeepSpeed scripts call ``deepspeed.initialize``: the
store goes under the config's ``nvme_path``, or, with nothing offloaded to NVMe, into a temporary
directory that is gone once the engine closes or the process exits."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Callable

import pytest
import torch

import engine
import engine.integrations.deepspeed.store as deepspeed_store
import tiered

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def ds_config(offload_param: dict, offload_optimizer: dict) -> dict:
    return {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 3, "offload_param": offload_param, "offload_optimizer": offload_optimizer}}


def train_steps(eng: engine.DeepSpeedEngine, steps: int) -> list[float]:
    losses = []
    for i in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
        loss = eng(x).square().mean()
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def plain_losses(steps: int) -> list[float]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for i in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def scratch_dirs(root: str) -> list[str]:
    return sorted(d for d in os.listdir(root) if d.startswith("tiered-store-"))


def test_the_store_goes_under_the_configs_nvme_paths(tmp_path):
    params, optim = tmp_path / "nvme-params", tmp_path / "nvme-optim"
    ds = ds_config({"device": "nvme", "nvme_path": str(params)}, {"device": "nvme", "nvme_path": str(optim)})
    for run in range(2):  # the second run takes the same directory over, as DeepSpeed's swap folders
        eng, _, _, _ = engine.initialize(model=make_model(), config=ds)
        try:
            assert train_steps(eng, 3) == pytest.approx(plain_losses(3), rel=1e-6)
            assert eng.config.store.path == str(params / "tiered")
            assert eng.config.store.nvme_paths == (str(params / "tiered"), str(optim / "tiered"))
            assert os.path.isfile(params / "tiered" / "manifest.sqlite")
            assert any(name.startswith("swap-") for name in os.listdir(optim / "tiered"))
            assert sorted(os.listdir(params)) == ["tiered"], run  # nothing of the store's beside its folder
        finally:
            eng.close()


def test_with_nothing_on_nvme_the_store_is_a_temporary_directory_removed_at_close(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # an nvme_path beside device "cpu" is unused, as in DeepSpeed
    ds = ds_config({"device": "cpu", "nvme_path": str(tmp_path / "unused")}, {"device": "cpu"})
    eng, _, _, _ = engine.initialize(model=make_model(), config=ds)
    try:
        assert train_steps(eng, 3) == pytest.approx(plain_losses(3), rel=1e-6)
        (scratch,) = scratch_dirs(str(tmp_path))
        assert eng.config.store.path == str(tmp_path / scratch) and not eng.config.store.flush_on_close
        assert os.path.isfile(tmp_path / scratch / "manifest.sqlite")
    finally:
        eng.destroy()
    assert scratch_dirs(str(tmp_path)) == [] and not os.path.exists(tmp_path / "unused")
    assert all(p.device.type == "meta" for p in eng.module.parameters())  # closed, as close() leaves them

    # unwrap keeps the values in the model, then removes the directory all the same
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=ds)
    eng.unwrap()
    assert scratch_dirs(str(tmp_path)) == []
    assert all(torch.equal(p.cpu(), q) for p, q in zip(model.parameters(), make_model().parameters()))


def test_parameters_not_offloaded_stay_whole_in_the_device_tier(tmp_path, monkeypatch):
    """``offload_param.device: "none"`` keeps the parameters on the accelerator in DeepSpeed: the
    default store's device tier gets room for every parameter shard and a step's new ones, so none
    is evicted; a store the script names keeps its own budgets (none here: refused, saying so)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ds = ds_config({"device": "none"}, {"device": "cpu"})
    eng, _, _, _ = engine.initialize(model=make_model(), config=ds)
    try:
        assert train_steps(eng, 3) == pytest.approx(plain_losses(3), rel=1e-6)
        device = eng.store.stats().tiers[tiered.Tier.DEVICE]
        shards = sum(p.numel() * 4 for p in make_model().parameters())
        assert eng.config.store.device_bytes == 2 * shards and device.used_bytes == shards
        assert device.evictions == 0
    finally:
        eng.destroy()
    with pytest.raises(ValueError, match="param_tier is 'device' but the store's device_bytes is 0"):
        engine.initialize(model=make_model(), config=ds, store=str(tmp_path / "named"))


def test_cpu_offload_gets_a_host_tier_for_what_deepspeed_keeps_in_memory(tmp_path, monkeypatch):
    """``"device": "cpu"`` keeps that state in host memory in DeepSpeed: the default store's host
    tier gets room for all the engine puts there during a step (parameters, gradients, the optimizer
    state, updated in place: 20 bytes a parameter), past the 1 GiB default, up to 80% of the memory the
    machine has available, shared by its ranks, with a warning when that is less. NVMe offload keeps
    the default (the engine's gradients in the host tier are not DeepSpeed's state in memory)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)])
    params = sum(p.numel() for p in model.parameters())

    def host_budget(ds: dict, memory: tuple[int, int], world: int = 1, *, tier: bool = False) -> int:
        """host_bytes of the default store (``tier``: what its host tier gets of it)."""
        monkeypatch.setattr(deepspeed_store, "memory_sizes", lambda: memory)
        default = deepspeed_store.default_store(ds)
        try:
            config = default.apply(engine.EngineConfig.from_deepspeed(ds, store=default.config), model, world)
            if tier:
                return engine.estimate_memory(model, config, world_size=world).plan.host_tier_bytes
            return config.store.host_bytes
        finally:
            default.remove()

    cpu = ds_config({"device": "cpu"}, {"device": "cpu"})
    plenty = (64 << 30, 32 << 30)
    # host_bytes covers the working set as well; the host tier gets the rest: room for all that state
    # (every tensor a multiple of 4 KiB here), and no more than staging's share of the budget beyond.
    for ds, world, state in ((cpu, 1, 16 * params), (cpu, 2, 8 * params),  # fp32: parameters are masters
                             (ds_config({"device": "nvme", "nvme_path": str(tmp_path)}, {"device": "cpu"}), 1,
                              16 * params)):  # the parameters on nvme
        assert state <= host_budget(ds, plenty, world, tier=True) <= state + (128 << 20)
        assert state < host_budget(ds, plenty, world) < state + (1 << 30)
    nvme = ds_config({"device": "nvme", "nvme_path": str(tmp_path)}, {"device": "nvme", "nvme_path": str(tmp_path)})
    assert host_budget(nvme, plenty) == 1 << 30
    with pytest.warns(UserWarning, match=r"keeps 2\.0 GiB of this rank's state in host memory .* the store's host "
                                         r"budget is 1\.6 GiB .* the rest goes to its nvme tier"):
        assert host_budget(cpu, (4 << 30, 2 << 30)) == int(0.8 * (2 << 30)) // (1 << 20) * (1 << 20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks on this machine share it
    with pytest.warns(UserWarning, match="host budget is 1.0 GiB"):  # never below the default
        assert host_budget(cpu, (4 << 30, 2 << 30)) == 1 << 30


def test_a_refused_config_leaves_no_directory_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bad = {**ds_config({"device": "cpu"}, {"device": "cpu"}), "no_such_key": 1}
    with pytest.raises(ValueError, match="no_such_key"):
        engine.initialize(model=make_model(), config=bad)
    with pytest.raises(ValueError, match=r"offload_param.device is \"nvme\" but the config names no nvme_path"):
        engine.initialize(model=make_model(), config=ds_config({"device": "nvme"}, {"device": "cpu"}))
    assert scratch_dirs(str(tmp_path)) == []


def test_a_script_that_never_closes_leaves_no_directory_behind(tmp_path):
    """DeepSpeed scripts end without destroy(): the temporary store goes when the process exits."""
    script = textwrap.dedent("""
        import torch, engine
        model = torch.nn.Linear(8, 2)
        ds = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
        eng, _, _, _ = engine.initialize(model=model, config=ds)
        eng.backward(eng(torch.ones(2, 8)).sum())
        eng.step()
        print(eng.config.store.path)
    """)
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmp_path / "tiered-store-")), done.stdout
    assert scratch_dirs(str(tmp_path)) == []


# ---------------------------------------------------------------------------- ZeRO-Inference


def inference_config(nvme: str, world: int) -> dict:
    """The config of DeepSpeed's ZeRO-Inference examples (transformers' "non-Trainer DeepSpeed
    integration"): stage 3, parameters on NVMe, no optimizer."""
    return {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 2000,
            "wall_clock_breakdown": False,
            "zero_optimization": {
                "stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True},
                "overlap_comm": True, "contiguous_gradients": True,
                "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9}}


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def generate(model: torch.nn.Module, prompt: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, **kwargs)


PROMPTS = torch.tensor([[1, 2, 3], [4, 5, 6]])


def test_zero_inference_script_generates_what_the_plain_model_does(tmp_path):
    pytest.importorskip("transformers")
    expected = generate(tiny_gpt2(), PROMPTS)
    ds_engine = engine.initialize(model=tiny_gpt2(), config_params=inference_config(str(tmp_path / "nvme"), 1))[0]
    try:
        ds_engine.module.eval()
        assert ds_engine.optimizer is None
        assert torch.equal(generate(ds_engine.module, PROMPTS.to(ds_engine.device)).cpu(), expected)
        # DeepSpeed's engine hands what it lacks to the model: model_engine.generate(...) and the rest
        assert torch.equal(generate(ds_engine, PROMPTS.to(ds_engine.device)).cpu(), expected)
        assert sum(p.numel() for p in ds_engine.parameters()) == sum(p.numel() for p in tiny_gpt2().parameters())
        with pytest.raises(AttributeError, match="neither the engine nor its model .GPT2LMHeadModel. has an attribute"):
            ds_engine.no_such_method()
        with pytest.raises(AttributeError, match="has no attribute '_private'"):
            ds_engine._private
        assert os.path.isfile(tmp_path / "nvme" / "tiered" / "manifest.sqlite")
    finally:
        ds_engine.destroy()


def test_zero_inference_in_fp16_runs_without_an_optimizer(tmp_path):
    """DeepSpeed's ZeRO-Inference recipe in fp16 (its run_model.py config: an "fp16" section, stage 3,
    parameters on NVMe with its aio settings, no optimizer): no loss to scale, so it loads and
    generates as the plain model converted to fp16 does (DeepSpeed's module.half()), logits bit for bit."""
    pytest.importorskip("transformers")
    nvme, hidden = str(tmp_path / "nvme"), 32
    ds = {"fp16": {"enabled": True}, "bf16": {"enabled": False}, "steps_per_print": 2000, "train_batch_size": 2,
          "wall_clock_breakdown": False,
          "zero_optimization": {
              "stage": 3, "stage3_prefetch_bucket_size": 2 * hidden * hidden,
              "stage3_param_persistence_threshold": hidden, "stage3_max_live_parameters": 2 * hidden * hidden,
              "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 5,
                                "buffer_size": 1 << 20}},
          "aio": {"block_size": 1 << 24, "queue_depth": 64, "thread_count": 8, "use_gds": False,
                  "single_submit": False, "overlap_events": True}}
    prompts = torch.tensor([[5, 17, 33], [40, 2, 61]])
    mask = torch.ones_like(prompts)
    plain = tiny_gpt2().half()
    with torch.no_grad():
        expected_logits = plain(prompts, attention_mask=mask).logits
    expected = generate(plain, prompts, attention_mask=mask)
    ds_engine = engine.initialize(model=tiny_gpt2(), config_params=ds)[0]
    try:
        ds_engine.module.eval()
        assert ds_engine.optimizer is None and ds_engine.fp16_enabled() and ds_engine.loss_scale is None
        assert ds_engine.config.train_dtype == "float16" and ds_engine.config.loss_scaling is None
        with torch.no_grad():
            logits = ds_engine.module(prompts, attention_mask=mask).logits
        assert logits.dtype == torch.float16 and torch.equal(logits, expected_logits)
        assert torch.equal(generate(ds_engine.module, prompts, attention_mask=mask), expected)
    finally:
        ds_engine.destroy()


def _zero_inference_rank(rank: int, nvme: str) -> None:
    """Each rank its own prompt, generating with synced_gpus=True as DeepSpeed's examples do (the
    ranks keep calling forward together until every one is done)."""
    world = int(os.environ["WORLD_SIZE"])
    prompt = PROMPTS[rank:rank + 1]
    expected = generate(tiny_gpt2(), prompt)
    ds_engine = engine.initialize(model=tiny_gpt2(), config_params=inference_config(nvme, world))[0]  # joins the group
    try:
        assert ds_engine.world_size == world
        ds_engine.module.eval()
        assert torch.equal(generate(ds_engine.module, prompt, synced_gpus=True), expected)
        assert os.path.isdir(os.path.join(nvme, "tiered", f"rank{rank}"))
    finally:
        ds_engine.destroy()


def test_zero_inference_at_two_ranks_under_a_launcher(tmp_path):
    pytest.importorskip("transformers")
    from test_engine_distributed import run_ranks

    run_ranks(_zero_inference_rank, str(tmp_path / "nvme"), join=False)


def dpo_style_losses(policy: torch.nn.Module, reference: torch.nn.Module, step: Callable[[torch.Tensor], None],
                     steps: int) -> list[float]:
    """A policy trained against a frozen reference model's outputs, as DPO scripts do."""
    losses = []
    for i in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            target = reference(x)
        loss = (policy(x) - target).square().mean()
        step(loss)
        losses.append(loss.item())
    return losses


def test_two_engines_from_one_config_each_get_a_directory_of_their_own(tmp_path):
    """A DPO-style script: a policy and its reference model each through engine.initialize with the
    same DeepSpeed config, as DeepSpeed runs it. The first engine's store goes to <nvme_path>/tiered,
    the second's to tiered-2; the next run of the script finds the same directories; an engine
    closed frees its directory for the next one."""
    nvme = tmp_path / "nvme"
    ds = ds_config({"device": "nvme", "nvme_path": str(nvme)}, {"device": "nvme", "nvme_path": str(nvme)})
    plain, plain_reference = make_model(), make_model()
    # fused: the config's AdamW without torch_adam is DeepSpeed's fused Adam, which the engine steps as torch's
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)

    def plain_step(loss: torch.Tensor) -> None:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        opt.step()
        opt.zero_grad()

    want = dpo_style_losses(plain, plain_reference, plain_step, 3)
    for run in range(2):
        policy, _, _, _ = engine.initialize(model=make_model(), config=ds)
        reference, _, _, _ = engine.initialize(model=make_model(), config=ds)
        try:
            assert policy.config.store.path == str(nvme / "tiered"), run
            assert reference.config.store.path == str(nvme / "tiered-2"), run
            assert reference.config.store.nvme_paths == (str(nvme / "tiered-2"),)

            def step(loss: torch.Tensor) -> None:
                policy.backward(loss)
                policy.step()

            assert dpo_style_losses(policy, reference, step, 3) == want
        finally:
            policy.close()
            reference.close()
    assert sorted(os.listdir(nvme)) == ["tiered", "tiered-2"]
    first, _, _, _ = engine.initialize(model=make_model(), config=ds)
    second, _, _, _ = engine.initialize(model=make_model(), config=ds)
    first.close()
    third, _, _, _ = engine.initialize(model=make_model(), config=ds)
    try:
        assert third.config.store.path == str(nvme / "tiered")
    finally:
        second.close()
        third.close()
