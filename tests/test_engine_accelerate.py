"""accelerate's training loop (``Accelerator``: ``prepare``, ``accumulate``, ``backward``) over a
wrapped model. The oracle is the same loop over a plain copy with torch.optim.AdamW, clipped with
``accelerator.clip_grad_norm_``: the same losses, bit for bit, in one process and in two (where
the plain copy is in DistributedDataParallel, as ``prepare(model)`` puts it, and the wrapped model
is left out of ``prepare``; there the clipped steps agree to rounding)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from accelerate import Accelerator
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin, DistributedType
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # accelerate.utils has them only beside deepspeed
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

import engine
from engine.integrations.hf.accelerate import deepspeed_config_from_accelerate, register_engine_state
from engine.errors import ReleasedParameterError
from engine_models import store_config
from test_engine_distributed import run_ranks

CONFIG = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
#: Dropout off, for loops whose random masks would differ from their oracle's.
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LR, CLIP, ACCUMULATION = 1e-3, 0.5, 2


def examples() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids]


def train(path: Path, *, wrapped: bool, prepare_model: bool = True, clip_in_loop: bool = False,
          norms: list[float] | None = None, mixed_precision: str = "no", autocast: bool = False,
          save_model: Path | None = None, accelerate_config: Path | None = None,
          compute_device: str | None = None) -> list[float]:
    """Sixteen examples in micro-batches of 2 (split over the ranks) through accelerate's loop; the
    losses. The wrapped model is clipped by ``EngineConfig.max_grad_norm``, or with
    ``clip_in_loop`` by ``eng.clip_grad_norm_`` where the plain loop calls accelerate's
    (which would find no gradients on it); ``norms`` gets what the clipping call returned.
    ``autocast``: the forward in ``accelerator.autocast()`` (for a model left out of prepare).
    ``save_model``: at the end, ``accelerator.save_model`` there, and the wrapped model's
    ``eng.state_dict()`` as ``expected.safetensors`` beside it (main process).
    ``accelerate_config``: the wrapped model by ``engine.initialize`` from the DeepSpeed config of
    that ``accelerate config`` file, and the accumulation and clipping the file sets.
    ``compute_device``: the wrapped model's EngineConfig.compute_device (default: the model's, the CPU)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    AcceleratorState._reset_state()  # accelerate sets it once per process (its own tests reset it so too)
    accumulation = 1 if accelerate_config is not None else ACCUMULATION
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation, mixed_precision=mixed_precision)
    eng = None
    if wrapped and accelerate_config is not None:
        ds_config = deepspeed_config_from_accelerate(accelerator, accelerate_config)
        eng, optimizer, _, _ = engine.initialize(model=model, optimizer=engine.AdamW(lr=LR), config=ds_config)
    elif wrapped:
        eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=engine.EngineConfig(
            host_budget="host_tier", store=store_config(path), param_tier="nvme", optimizer_tier="nvme",
            max_grad_norm=None if clip_in_loop else CLIP, compute_device=compute_device))
        optimizer = eng.optimizer
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(examples(), batch_size=2)
    if prepare_model:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        optimizer, loader = accelerator.prepare(optimizer, loader)
    losses = []
    try:
        for batch in loader:
            with accelerator.accumulate(model):
                with accelerator.autocast() if autocast else contextlib.nullcontext():
                    loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and (not wrapped or clip_in_loop):
                    if eng is not None:
                        norm = eng.clip_grad_norm_(CLIP)
                    else:
                        norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
                    if norms is not None:
                        norms.append(norm.item())
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        if save_model is not None:
            accelerator.wait_for_everyone()
            accelerator.save_model(model, save_model)  # every rank: the state dict gathers collectively
            expected = eng.state_dict() if eng is not None else None
            if accelerator.is_main_process and expected is not None:
                safetensors.torch.save_file({k: v.clone() for k, v in expected.items()},
                                            str(save_model / "expected.safetensors"))
    finally:
        if eng is not None:
            eng.close()
        AcceleratorState._reset_state()  # the next test's Accelerator may take another mixed precision
    return losses


def test_accelerator_loop_trains_a_wrapped_model_as_the_plain_one(tmp_path):
    want_norms: list[float] = []
    got_norms: list[float] = []
    want = train(tmp_path / "plain", wrapped=False, norms=want_norms)
    assert train(tmp_path / "engine", wrapped=True) == want and len(want) == 8
    assert train(tmp_path / "call", wrapped=True, clip_in_loop=True, norms=got_norms) == want
    assert got_norms == want_norms and min(want_norms) > CLIP  # every step clipped


def test_accelerates_mixed_precision_reaches_a_wrapped_model(tmp_path):
    """Accelerator(mixed_precision="bf16") autocasts the forward of a model it prepares (one
    process), or, for a model left out of prepare (as at world size > 1), a forward run in
    accelerator.autocast(): either way the plain model's bf16 losses, bit for bit; a forward in
    neither runs in fp32."""
    want = train(tmp_path / "plain", wrapped=False, mixed_precision="bf16")
    assert train(tmp_path / "prepared", wrapped=True, mixed_precision="bf16") == want
    assert train(tmp_path / "autocast", wrapped=True, prepare_model=False, mixed_precision="bf16",
                 autocast=True) == want
    assert train(tmp_path / "fp32", wrapped=True, prepare_model=False, mixed_precision="bf16") != want


def accelerate_file(path: Path, *, mixed_precision: str = "no", distributed_type: str = "DEEPSPEED",
                    **answers) -> Path:
    """An ``accelerate config`` file as accelerate writes it (its own ClusterConfig), with the
    DeepSpeed answers ``answers``."""
    ClusterConfig(compute_environment="LOCAL_MACHINE", distributed_type=DistributedType(distributed_type),
                  mixed_precision=mixed_precision, use_cpu=False, debug=False, num_processes=2,
                  deepspeed_config=answers).to_yaml_file(str(path))
    return path


def test_accelerates_deepspeed_config_trains_as_the_engine_config_it_describes(tmp_path):
    """The ZeRO-3 NVMe answers of ``accelerate config`` (accumulation 2, clipping 0.5) through
    deepspeed_config_from_accelerate and engine.initialize: the losses of the engine configured by
    hand with that accumulation, clipping and tiers, bit for bit; the store under the nvme path."""
    nvme = tmp_path / "nvme"
    path = accelerate_file(tmp_path / "zero3.yaml", zero_stage=3, offload_param_device="nvme",
                           offload_param_nvme_path=str(nvme), offload_optimizer_device="nvme",
                           offload_optimizer_nvme_path=str(nvme), gradient_accumulation_steps=ACCUMULATION,
                           gradient_clipping=CLIP, zero3_init_flag=True, zero3_save_16bit_model=True)
    # where engine.initialize computes: the GPU where there is one
    want = train(tmp_path / "engine", wrapped=True, prepare_model=False,
                 compute_device="cuda" if torch.cuda.is_available() else None)
    assert train(tmp_path / "ds", wrapped=True, prepare_model=False, accelerate_config=path) == want
    assert any((nvme / "tiered").iterdir())


def engine_config_of(accelerator: Accelerator, source, tmp_path: Path) -> engine.EngineConfig:
    ds_config = deepspeed_config_from_accelerate(accelerator, source)
    return engine.EngineConfig.from_deepspeed(ds_config, store=store_config(tmp_path))


def test_accelerates_deepspeed_answers_map_as_accelerate_maps_them(tmp_path, monkeypatch):
    """The file's mixed_precision, unless the Accelerator has its own; a deepspeed_config_file with
    its optimizer section; a DeepSpeedPlugin; "auto" accumulation and clipping filled as prepare
    fills them; a file's accumulation against the Accelerator's own: DeepSpeed's, with accelerate's
    warning; refusals naming the problem, an Accelerator that does not see the launcher's processes
    among them."""
    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    try:
        nvme = dict(zero_stage=3, offload_param_device="nvme", offload_param_nvme_path=str(tmp_path))
        bf16 = engine_config_of(accelerator, accelerate_file(tmp_path / "bf16.yaml", mixed_precision="bf16", **nvme),
                                tmp_path)
        assert (bf16.train_dtype, bf16.param_tier, bf16.max_grad_norm) == ("bfloat16", "nvme", 1.0)
        assert bf16.gradient_accumulation_steps == 1 and accelerator.gradient_accumulation_steps == 3
        fp16 = engine_config_of(accelerator, accelerate_file(tmp_path / "fp16.yaml", mixed_precision="fp16", **nvme),
                                tmp_path)
        assert fp16.train_dtype == "float16" and fp16.cast_forward_inputs and fp16.loss_scaling is not None
        plugin = engine_config_of(accelerator, DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="nvme",
                                                               offload_optimizer_nvme_path=str(tmp_path)), tmp_path)
        assert (plugin.train_dtype, plugin.optimizer_tier, plugin.param_tier) == (None, "nvme", "device")

        ds_file = tmp_path / "ds.json"
        ds_file.write_text(json.dumps({"gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                                       "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                                       "zero_optimization": {"stage": 3}}))
        from_file = deepspeed_config_from_accelerate(
            accelerator, accelerate_file(tmp_path / "file.yaml", deepspeed_config_file=str(ds_file)))
        assert from_file["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4}}
        assert (from_file["gradient_accumulation_steps"], from_file["gradient_clipping"]) == (1, 1.0)
        assert "steps_per_print" not in from_file  # accelerate's float("inf"): DeepSpeed's line off

        with pytest.raises(ValueError, match=r"does not train with DeepSpeed \(distributed_type: MULTI_GPU\)"):
            deepspeed_config_from_accelerate(accelerator, accelerate_file(tmp_path / "ddp.yaml",
                                                                          distributed_type="MULTI_GPU"))
        monkeypatch.setattr("engine.integrations.hf.accelerate_deepspeed.default_config_file",
                            str(tmp_path / "none.yaml"))
        with pytest.raises(FileNotFoundError, match="none.yaml does not exist: run `accelerate config`"):
            deepspeed_config_from_accelerate(accelerator)  # accelerate's default file, absent
        monkeypatch.setattr("engine.integrations.hf.accelerate_deepspeed.default_config_file",
                            str(tmp_path / "bf16.yaml"))
        assert deepspeed_config_from_accelerate(accelerator)["bf16"] == {"enabled": True}
        with pytest.raises(ValueError, match="answers accelerate's DeepSpeedPlugin does not take: zero_stages"):
            deepspeed_config_from_accelerate(accelerator, accelerate_file(tmp_path / "typo.yaml", zero_stages=3))
        with pytest.raises(ValueError, match="'fp8' is not supported"):
            deepspeed_config_from_accelerate(accelerator, accelerate_file(tmp_path / "fp8.yaml", mixed_precision="fp8",
                                                                          **nvme))
        with pytest.warns(UserWarning, match="the Accelerator has 3, the DeepSpeed config 2. Using DeepSpeed's"):
            deepspeed_config_from_accelerate(accelerator, accelerate_file(tmp_path / "two.yaml",
                                                                          gradient_accumulation_steps=2, **nvme))
        assert accelerator.gradient_accumulation_steps == 2
        with pytest.raises(ValueError, match="names no nvme_path"):  # accelerate's "none": no path given
            engine.initialize(model=torch.nn.Linear(2, 2), config=deepspeed_config_from_accelerate(
                accelerator, DeepSpeedPlugin(zero_stage=3, offload_param_device="nvme")))
        monkeypatch.setenv("WORLD_SIZE", "2")  # a launcher's two processes, and an Accelerator that sees one
        with pytest.raises(ValueError, match=r"started 2 processes but the Accelerator runs as one of 1: .*cpu=True"):
            deepspeed_config_from_accelerate(accelerator, tmp_path / "bf16.yaml")
        monkeypatch.delenv("WORLD_SIZE")
        with pytest.raises(ValueError, match=r"runs 1 process\(es\) but the engine is sharded over 2: .*cpu=True"):
            register_engine_state(accelerator, SimpleNamespace(world_size=2))
        AcceleratorState._reset_state()
        bf16_accelerator = Accelerator(cpu=True, mixed_precision="bf16")  # its own precision wins over the file's
        assert engine_config_of(bf16_accelerator, tmp_path / "fp16.yaml", tmp_path).train_dtype == "bfloat16"
    finally:
        AcceleratorState._reset_state()


def test_accelerates_stand_ins_fill_the_optimizer_and_scheduler_sections(tmp_path):
    """accelerate's DeepSpeed scripts stand a DummyOptim and a DummyScheduler in for a config file's
    optimizer and scheduler sections, whose "auto" values prepare fills from them: filled so here,
    and engine.initialize builds that AdamW and WarmupDecayLR over the DummyOptim's parameters."""
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 3}}))
    path = accelerate_file(tmp_path / "file.yaml", deepspeed_config_file=str(ds_file))
    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=True)
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = DummyOptim(model.parameters(), lr=2e-3, weight_decay=0.01)
        scheduler = DummyScheduler(optimizer, total_num_steps=8, warmup_num_steps=2)
        ds_config = deepspeed_config_from_accelerate(accelerator, path, optimizer=optimizer, scheduler=scheduler)
        assert ds_config["optimizer"]["params"] == {"lr": 2e-3, "weight_decay": 0.01, "betas": [0.9, 0.95]}
        assert ds_config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-3,
                                                    "warmup_num_steps": 2, "total_num_steps": 8}
        eng, built, _, schedule = engine.initialize(model=model, model_parameters=optimizer.params,
                                                    config=ds_config, store=store_config(tmp_path, host_bytes=1 << 20))
        with eng:
            group = built.param_groups[0]
            assert (group["weight_decay"], group["betas"], type(schedule).__name__) == (0.01, (0.9, 0.95),
                                                                                         "WarmupDecayLR")
            assert len(group["params"]) == 2 and schedule.base_lrs == [2e-3]
        with pytest.raises(ValueError, match="DummyOptim stands for the config's optimizer section, but"):
            deepspeed_config_from_accelerate(accelerator, accelerate_file(tmp_path / "bare.yaml", zero_stage=3),
                                             optimizer=optimizer)
    finally:
        AcceleratorState._reset_state()


def test_an_accelerator_running_deepspeed_is_refused(monkeypatch):
    """An Accelerator with DeepSpeed (an accelerate config that trains with it, or a deepspeed_plugin)
    would hand prepare's model and backward to DeepSpeed: refused, saying how to launch instead."""
    pytest.importorskip("deepspeed")  # accelerate makes a DeepSpeed Accelerator only with it installed
    from transformers.integrations import unset_hf_deepspeed_config

    # Such an Accelerator sets ACCELERATE_USE_DEEPSPEED=true for the process and points transformers at
    # its config (stage 2 here, so no model is built under zero.Init meanwhile); both are undone after.
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    AcceleratorState._reset_state()
    try:
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
        assert accelerator.distributed_type == DistributedType.DEEPSPEED
        with pytest.raises(ValueError, match="runs DeepSpeed itself.*tiered launch"):
            deepspeed_config_from_accelerate(accelerator, DeepSpeedPlugin(zero_stage=3))
        with pytest.raises(ValueError, match="runs DeepSpeed itself"):
            register_engine_state(accelerator, SimpleNamespace(world_size=1))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # its distributed type is DeepSpeed's too
        unset_hf_deepspeed_config()


def _two_ranks(rank: int, root: str) -> None:
    root_path = Path(root)
    losses = {"ddp": train(root_path / f"plain{rank}", wrapped=False),
              "engine": train(root_path / f"engine{rank}", wrapped=True, prepare_model=False,
                              save_model=root_path / "saved-model"),
              "call": train(root_path / f"call{rank}", wrapped=True, prepare_model=False, clip_in_loop=True),
              # save_state / load_state with register_engine_state: the engine's checkpoint is collective
              "saved": checkpointed_run(root_path, seed=0, save_after=2)}
    losses["resumed"] = checkpointed_run(root_path, seed=1, save_after=2, resume_from=str(root_path / "state"))
    AcceleratorState._reset_state()
    try:  # an engine wrapped before the Accelerator joined the processes, unsharded
        register_engine_state(Accelerator(cpu=True), SimpleNamespace(world_size=1))
        losses["wrapped_first"] = ""
    except ValueError as exc:
        losses["wrapped_first"] = str(exc)
    finally:
        AcceleratorState._reset_state()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    with engine.wrap(model, config=engine.EngineConfig(host_budget="host_tier",
                                                       store=store_config(root_path / f"ddp{rank}"))):
        try:
            DistributedDataParallel(model)
            losses["refused"] = ""
        except ReleasedParameterError as exc:
            losses["refused"] = str(exc)
    (root_path / f"rank{rank}.json").write_text(json.dumps(losses))


def test_two_ranks_train_as_distributed_data_parallel(tmp_path):
    """accelerate's data loader gives each rank its own batches; the engine averages the gradients
    across the ranks as DDP does; save_state / load_state resume every rank bit for bit. DDP itself
    cannot wrap the engine's model, and says why. The processes start as torchrun starts them and
    the first Accelerator joins their group, as under accelerate launch; wrap comes after it."""
    run_ranks(_two_ranks, str(tmp_path), join=False)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        # The clip's global norm is summed in another order (each rank's shard of the averaged
        # gradient, then across ranks; DDP: every rank over the whole), so it agrees to rounding.
        assert res["engine"] == pytest.approx(res["ddp"], rel=1e-6) and len(res["ddp"]) == 4
        assert res["call"] == res["engine"]  # eng.clip_grad_norm_ in the loop: the config's clipping
        assert res["engine"][:2] == res["ddp"][:2]  # before the first step: bit for bit
        assert res["resumed"] == res["saved"][2:] and len(res["saved"]) == 4
        assert "DistributedDataParallel cannot wrap" in res["refused"]
        assert "runs 2 process(es) but the engine is sharded over 1: the model was wrapped" in res["wrapped_first"]
        assert "prepare only the optimizer" in res["refused"]
    assert results[0]["ddp"] != results[1]["ddp"]  # each rank trained on its own batches
    # accelerator.save_model at the end: the whole trained model in accelerate's file, from rank 0
    saved = safetensors.torch.load_file(str(tmp_path / "saved-model" / "model.safetensors"))
    expected = safetensors.torch.load_file(str(tmp_path / "saved-model" / "expected.safetensors"))
    assert sorted(saved) == sorted(expected) and "transformer.h.1.mlp.c_proj.weight" in saved
    assert all(torch.equal(saved[k], expected[k]) for k in saved)


def fp16_engine(path: Path, accumulation: int) -> tuple[GPT2LMHeadModel, engine.Engine]:
    """A model without dropout (seed 0) wrapped with fp16 parameters and a loss scale that
    overflows some steps (DeepSpeed's fp16 section, initial_scale_power 18, hysteresis 1)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**{**CONFIG.to_dict(), **NO_DROPOUT}))
    scaling = engine.LossScaling(initial_scale=2.0**18, hysteresis=1, growth_interval=2)
    return model, engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=engine.EngineConfig(host_budget="host_tier",
        store=store_config(path), param_tier="nvme", optimizer_tier="nvme", max_grad_norm=CLIP, train_dtype="float16",
        loss_scaling=scaling, gradient_accumulation_steps=accumulation))


def linear_decay(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 8)


def test_accelerator_loop_trains_fp16_with_the_engines_loss_scaling(tmp_path):
    """accelerate's loop over an fp16 engine: backward through eng.with_loss_scale, and the prepared
    LR schedule in engine.OverflowAwareScheduler. The oracle is the engine's own loop
    (eng.backward, the scheduler stepped when eng.step() applied the step): the same losses,
    learning rates and skipped steps, bit for bit."""
    model, eng = fp16_engine(tmp_path / "accelerate", accumulation=1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    losses, lrs = [], []
    try:
        optimizer, loader = accelerator.prepare(eng.optimizer, DataLoader(examples(), batch_size=2))
        # accelerate's scheduler steps at the end of each window; the engine's skips hold it.
        schedule = engine.OverflowAwareScheduler(accelerator.prepare(linear_decay(eng.optimizer)), eng)
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(eng.with_loss_scale(loss))
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            lrs.append(schedule.get_last_lr()[0])
        skipped = eng.skipped_steps
    finally:
        eng.close()

    model, eng = fp16_engine(tmp_path / "own", accumulation=ACCUMULATION)
    want_losses, want_lrs, applied = [], [], []
    try:
        schedule = linear_decay(eng.optimizer)
        for batch in DataLoader(examples(), batch_size=2):
            loss = model(**batch).loss
            eng.backward(loss)
            boundary = eng.is_gradient_accumulation_boundary()
            if eng.step():
                schedule.step()
            if boundary:
                applied.append(eng.was_step_applied())
            want_losses.append(loss.item())
            want_lrs.append(schedule.get_last_lr()[0])
        assert eng.skipped_steps == applied.count(False) > 0
    finally:
        eng.close()
    assert losses == want_losses and lrs == want_lrs and skipped == applied.count(False)
    assert len(set(lrs)) == len(applied) - applied.count(False) + 1  # the LR moved on applied steps only


def checkpointed_run(path: Path, *, seed: int, save_after: int = 0, resume_from: str = "",
                     hooks: bool = True) -> list[float]:
    """accelerate's loop with a prepared LR schedule and (``hooks``) register_engine_state: saved with
    ``accelerator.save_state`` after ``save_after`` micro-batches, or resumed with ``load_state``
    (then the loader skips the batches already trained on). The losses of the micro-batches it ran."""
    torch.manual_seed(seed)
    # Without dropout and shuffling: their random streams are accelerate's to restore, not the engine's.
    model = GPT2LMHeadModel(GPT2Config(**{**CONFIG.to_dict(), **NO_DROPOUT}))
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=engine.EngineConfig(host_budget="host_tier",
        store=store_config(path / f"store{seed}"), param_tier="nvme", optimizer_tier="nvme", max_grad_norm=CLIP))
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    if hooks:
        register_engine_state(accelerator, eng)
    optimizer, loader = accelerator.prepare(eng.optimizer, DataLoader(examples(), batch_size=2))
    schedule = accelerator.prepare(linear_decay(eng.optimizer))
    losses = []
    try:
        if resume_from:
            accelerator.load_state(resume_from)
            loader = accelerator.skip_first_batches(loader, save_after)
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if not resume_from and len(losses) == save_after:
                accelerator.save_state(str(path / ("state" if hooks else "bare-state")))
    finally:
        eng.close()
    return losses


def test_save_state_and_load_state_carry_the_engine_checkpoint(tmp_path):
    """register_engine_state: accelerator.save_state writes the engine's checkpoint beside
    accelerate's files, and a run resumed from it with load_state (other initial weights, a fresh
    store) trains the remaining micro-batches to the same losses, bit for bit."""
    whole = checkpointed_run(tmp_path, seed=0, save_after=4)
    assert (tmp_path / "state" / "engine" / "metadata.json").is_file()
    assert (tmp_path / "state" / "optimizer.bin").is_file()
    resumed = checkpointed_run(tmp_path, seed=1, save_after=4, resume_from=str(tmp_path / "state"))
    assert resumed == whole[4:] and len(whole) == 8

    # Without the hooks accelerate restores the optimizer's step counts alone, which is refused.
    torch.manual_seed(1)
    model = GPT2LMHeadModel(CONFIG)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=engine.EngineConfig(host_budget="host_tier",
        store=store_config(tmp_path / "bare"), param_tier="nvme", optimizer_tier="nvme", max_grad_norm=CLIP))
    try:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
        accelerator.prepare(eng.optimizer, DataLoader(examples(), batch_size=2))
        accelerator.prepare(linear_decay(eng.optimizer))
        with pytest.raises(ValueError, match=r"eng\.load_checkpoint"):
            accelerator.load_state(str(tmp_path / "state"))
    finally:
        eng.close()


def test_save_state_without_the_hooks_saves_the_whole_optimizer_state(tmp_path):
    """Without register_engine_state, accelerator.save_state saves engine.AdamW's state_dict(): the
    whole state with the fp32 masters (the model, kept out of prepare, is not saved), and load_state
    into a fresh engine resumes from it bit for bit."""
    whole = checkpointed_run(tmp_path, seed=0, save_after=4, hooks=False)
    assert not (tmp_path / "bare-state" / "engine").exists()
    resumed = checkpointed_run(tmp_path, seed=1, save_after=4, resume_from=str(tmp_path / "bare-state"), hooks=False)
    assert resumed == whole[4:] and len(whole) == 8


def batch_of_one() -> dict[str, torch.Tensor]:
    return {k: v[None] for k, v in examples()[0].items()}


def test_clipping_through_accelerate_or_torch_is_refused_where_it_would_clip_nothing(tmp_path):
    """With engine.AdamW the gradients are in the store: accelerate's clip_grad_norm_ (and torch's,
    which it calls) would see no .grad, return 0 and leave the step unclipped, so it raises and names
    eng.clip_grad_norm_; unless the engine's step clips at that norm anyway (EngineConfig.max_grad_norm),
    or the norm is math.inf (a measurement). With a torch optimizer the gradients are .grad, and
    torch's clipping runs."""
    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=True)
    model = GPT2LMHeadModel(CONFIG)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=engine.EngineConfig(host_budget="host_tier",
                                                                                       store=store_config(tmp_path)))
    try:
        accelerator.backward(model(**batch_of_one()).loss)
        with pytest.raises(ReleasedParameterError, match=r"clip nothing and return 0\. Call eng\.clip_grad_norm_"):
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
        with pytest.raises(ReleasedParameterError, match="finds no gradient on 'transformer.wte.weight'"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)
        # at math.inf it only measures (the Hugging Face Trainer logs that): no step changes, no error
        assert accelerator.clip_grad_norm_(model.parameters(), float("inf")) == 0
        assert eng.clip_grad_norm_(CLIP) > 0  # the call that clips
        eng.step()
    finally:
        eng.close()

    model = GPT2LMHeadModel(CONFIG)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=engine.EngineConfig(
        host_budget="host_tier", store=store_config(tmp_path / "clipped"), max_grad_norm=CLIP))
    try:
        accelerator.backward(model(**batch_of_one()).loss)
        assert accelerator.clip_grad_norm_(model.parameters(), CLIP) == 0  # the step clips at CLIP anyway
        with pytest.raises(ReleasedParameterError, match="clip nothing"):
            accelerator.clip_grad_norm_(model.parameters(), 2 * CLIP)
        with pytest.raises(ReleasedParameterError, match="clip nothing"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, norm_type=1.0)
        eng.step()
    finally:
        eng.close()
        AcceleratorState._reset_state()

    model = GPT2LMHeadModel(CONFIG)
    eng = engine.wrap(model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                      config=engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path / "torch")))
    try:
        model(**batch_of_one()).loss.backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > 0
    finally:
        eng.close()
