"""Importing DeepSpeed ZeRO checkpoints, stages 1 to 3 (``engine.import_deepspeed_checkpoint``, ``tiered
import-deepspeed``), against checkpoints DeepSpeed 0.19.8 itself wrote (tests/fixtures/deepspeed,
made by tests/deepspeed_fixtures.py) and DeepSpeed's own view of their state and of the training
that followed. DeepSpeed is not needed to run these tests."""

from __future__ import annotations

import json
import shutil
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import engine
import tiered
from deepspeed_fixtures import (
    BETAS, EPS, FIXTURES, FIXTURES_ALL, FROZEN_EXCLUDED, LR, STEPS_AFTER, STEPS_BEFORE, WEIGHT_DECAY, ZERO12_FIXTURES,
    batch, continue_run, ds_config, make_model, param_groups,
)
from engine.io.checkpoint_files import STATE_NAMES, CheckpointFiles, tensor_name
from engine.errors import CheckpointError
from engine.cli import main as cli_main
from engine.config import EngineConfig
from engine.integrations.deepspeed.optimizer import optimizer_from_deepspeed, scheduler_from_deepspeed
from test_engine_distributed import run_ranks

FIXTURE_DIR = Path(__file__).parent / "fixtures" / "deepspeed"
TRAINABLE = ["embed.weight", "proj.weight", "proj.bias", "norm.weight", "norm.bias"]
#: Every ZeRO stage: 3 (each rank's pieces become a rank file) and 1/2 (parameters joined whole).
ALL_STAGES = sorted(FIXTURES) + sorted(ZERO12_FIXTURES)


def expected(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    folder = FIXTURE_DIR / name
    return json.loads((folder / "expected.json").read_text()), load_file(folder / "expected.safetensors")


def imported(tmp_path: Path, name: str, source: Path | None = None) -> str:
    return engine.import_deepspeed_checkpoint(source or FIXTURE_DIR / name, tmp_path / "imported", progress=False)


def wrap_as_deepspeed(tmp_path: Path, name: str, world: int):
    """The fixture's model under the engine, configured from the same DeepSpeed config."""
    model = make_model()
    ds = ds_config(world, FIXTURES_ALL[name][1])  # as written: a stage-1 or stage-2 config runs as ZeRO-3
    config = EngineConfig.from_deepspeed(ds, store=tiered.StoreConfig(path=str(tmp_path / "store")))
    return model, engine.wrap(model, optimizer=optimizer_from_deepspeed(ds, param_groups(model)), config=config)


def scheduler_as_deepspeed(eng: engine.Engine, name: str, world: int):
    """The fixture's LR scheduler from its DeepSpeed config (None when it has none), built before the load."""
    return scheduler_from_deepspeed(ds_config(world, FIXTURES_ALL[name][1]), eng.optimizer)


@pytest.mark.parametrize("name", ALL_STAGES)
def test_import_holds_deepspeeds_own_view_of_its_state(tmp_path, name):
    meta, want = expected(name)
    dtype = getattr(torch, meta["dtype"])
    with CheckpointFiles(imported(tmp_path, name)) as files:
        assert meta["world_size"] == FIXTURES_ALL[name][0] == files.metadata["imported_from"]["dp_world_size"]
        assert files.world_size == (meta["world_size"] if name in FIXTURES else 1)  # ZeRO-1/2: written whole
        for param in TRAINABLE:  # safe_get_full_fp32_param / safe_get_full_optimizer_state, bit for bit
            for state in STATE_NAMES:
                assert torch.equal(files.whole(param, state), want[f"{param}/{state}"]), (param, state)
            assert torch.equal(files.whole(param), want[f"{param}/master"].to(dtype)), param
        assert not files.has_state("gate")
        assert torch.equal(files.whole("gate"), make_model().gate.detach().to(dtype))  # frozen: its pieces
        assert torch.equal(files.buffer("offset", files.world_size - 1), make_model().offset)
        if files.world_size == 2:  # the last rank's padding is zero (DeepSpeed's files hold leftovers there)
            for param, state in (("gate", None), ("proj.bias", None), ("proj.bias", "exp_avg_sq")):
                assert files.read(1, tensor_name(param, state))[-1] == 0, (param, state)
        optimizer = files.optimizer
        taken = STEPS_BEFORE - meta["skipped_steps"]  # fp16: DeepSpeed skipped the steps that overflowed
        assert meta["global_steps"] == STEPS_BEFORE and optimizer["step"] == taken
        assert optimizer["shard_steps"] == {param: taken for param in TRAINABLE}
        groups = optimizer["param_groups"]
        assert [g["param_names"] for g in groups] == [["embed.weight", "proj.weight"],
                                                      ["proj.bias", "norm.weight", "norm.bias"]]
        assert [(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in groups] == [
            (LR, BETAS, EPS, WEIGHT_DECAY), (LR, BETAS, EPS, 0.0)]
        scale = optimizer["loss_scale"]
        assert (scale and scale["scale"]) == meta["loss_scale"]
    # Padding beyond a parameter's end is zero, whatever DeepSpeed's memory held there.
    state_dict = engine.checkpoint_state_dict(tmp_path / "imported")
    assert torch.equal(state_dict["embed.weight"], want["embed.weight/master"])


@pytest.mark.parametrize("name", ALL_STAGES)
def test_resumed_run_continues_deepspeeds(tmp_path, name):
    """The engine, in one process, resumes DeepSpeed's run from the imported checkpoint (ZeRO 1,
    2 or 3, saved by 1 or 2 ranks) and reaches the losses DeepSpeed reached. fp32 agrees to float
    rounding (the ranks' reductions); under bf16 and fp16 DeepSpeed's ZeRO-3 linear layers add the
    bias in a separate kernel, which rounds differently from the first step on, before any import."""
    meta, _ = expected(name)
    out = imported(tmp_path, name)
    model, eng = wrap_as_deepspeed(tmp_path, name, meta["world_size"])
    scheduler = scheduler_as_deepspeed(eng, name, meta["world_size"])
    try:
        client_state = eng.load_checkpoint(out)
        assert eng.completed_steps == STEPS_BEFORE - meta["skipped_steps"]
        if scheduler is not None:  # the schedule goes on from DeepSpeed's iteration, not from warmup
            assert client_state["lr_scheduler"] == {"last_batch_iteration": STEPS_BEFORE - 1}
            scheduler.load_state_dict(client_state["lr_scheduler"])
        losses, scales = [], []
        for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
            loss = model(*batch(step))
            eng.backward(loss)
            if eng.step() and scheduler is not None:
                scheduler.step()
            losses.append(loss.item())
            scales.append(eng.loss_scale)
        tolerance = 1e-6 if meta["dtype"] == "float32" else 2e-3
        assert losses == pytest.approx(meta["losses_after"], rel=tolerance)
        if meta["dtype"] == "float16":
            # The scale doubles on the step it doubled on in DeepSpeed's run. Whether fp16 gradients
            # overflow at a scale near the limit depends on rounding the two do differently, so the
            # scales are compared up to DeepSpeed's first overflow after the save.
            first = (meta["skipped_after"] + [True]).index(True)
            assert first >= 2 and scales[:first] == meta["loss_scales_after"][:first]
            assert meta["loss_scales_after"][1] == 2 * meta["loss_scale"]  # ...which includes a doubling
        else:
            assert scales == [None] * STEPS_AFTER
    finally:
        eng.close()


def test_a_checkpoint_saved_without_frozen_parameters_resumes_with_the_models_own(tmp_path, capsys):
    """DeepSpeed's save_checkpoint(exclude_frozen_parameters=True), which the Trainer uses for a
    PEFT model, records no frozen parameter at all: the import says so, the load keeps the model's
    own value for the frozen ``gate`` (the base model's) and the run goes on to DeepSpeed's losses."""
    meta, want = expected(FROZEN_EXCLUDED)
    out = tmp_path / "imported"
    assert cli_main(["import-deepspeed", str(FIXTURE_DIR / FROZEN_EXCLUDED), str(out)]) == 0
    assert "saved with exclude_frozen_parameters" in capsys.readouterr().out
    with CheckpointFiles(out) as files:
        assert files.frozen_excluded and sorted(files.params) == sorted(TRAINABLE)
        for param in TRAINABLE:
            for state in STATE_NAMES:
                assert torch.equal(files.whole(param, state), want[f"{param}/{state}"]), (param, state)
    model, eng = wrap_as_deepspeed(tmp_path, FROZEN_EXCLUDED, 2)
    try:
        eng.load_checkpoint(out)
        assert continue_run(model, eng) == pytest.approx(meta["losses_after"], rel=1e-6)
    finally:
        eng.close()
    model = make_model()
    model.gate.requires_grad_(True)  # trained here: the checkpoint has no value for it
    trains = engine.wrap(model, optimizer=engine.AdamW(param_groups(model), lr=LR),
                         config=EngineConfig(store=tiered.StoreConfig(path=str(tmp_path / "other"))))
    try:
        with pytest.raises(CheckpointError, match=r"lacks \['gate'\].*left out the parameters that were frozen"):
            trains.load_checkpoint(out)
    finally:
        trains.close()


def _resume_at_two_ranks(rank: int, root: str) -> None:
    model, eng = wrap_as_deepspeed(Path(root) / f"rank{rank}", "zero3_fp32_world2", 2)
    try:
        eng.load_checkpoint(Path(root) / "imported")  # each rank reads its own file, DeepSpeed's rank's pieces
        losses = []
        for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
            ids, targets = batch(step)
            loss = model(ids[rank::2], targets[rank::2])  # the rows DeepSpeed's rank took
            eng.backward(loss)
            eng.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / 2)
        torch.save(losses, Path(root) / f"losses{rank}.pt")
    finally:
        eng.close()


def test_two_ranks_resume_deepspeeds_two_rank_run(tmp_path):
    name = "zero3_fp32_world2"
    meta, _ = expected(name)
    imported(tmp_path, name)
    run_ranks(_resume_at_two_ranks, str(tmp_path))
    losses = [torch.load(tmp_path / f"losses{r}.pt") for r in range(2)]
    assert losses[0] == losses[1] == pytest.approx(meta["losses_after"], rel=1e-6)


def test_resumed_fp32_run_equals_torch_adamw_from_deepspeeds_state(tmp_path):
    """Bit for bit against torch.optim.AdamW given DeepSpeed's weights, moments and step counts, and
    clipping at DeepSpeed's default gradient_clipping of 1.0."""
    name = "zero3_fp32_world2"
    _, want = expected(name)
    ref = make_model()
    opt = torch.optim.AdamW(param_groups(ref), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    with torch.no_grad():
        for param_name, p in ref.named_parameters():
            if p.requires_grad:
                p.copy_(want[f"{param_name}/master"])
                opt.state[p] = {"step": torch.tensor(float(STEPS_BEFORE)), "exp_avg": want[f"{param_name}/exp_avg"],
                                "exp_avg_sq": want[f"{param_name}/exp_avg_sq"]}
    model, eng = wrap_as_deepspeed(tmp_path, name, 2)
    try:
        eng.load_checkpoint(imported(tmp_path, name))
        for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
            ref_loss = ref(*batch(step))
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            loss = model(*batch(step))
            eng.backward(loss)
            eng.step()
            assert loss.item() == ref_loss.item(), step
        weights = eng.state_dict()
        for param_name, p in ref.named_parameters():
            assert torch.equal(weights[param_name], p.detach()), param_name
    finally:
        eng.close()


def test_optimizer_groups_must_hold_the_same_parameters(tmp_path):
    out = imported(tmp_path, "zero3_fp32_world2")
    model = make_model()
    one_group = engine.wrap(model, optimizer=engine.AdamW(lr=LR),
                            config=EngineConfig(store=tiered.StoreConfig(path=str(tmp_path / "a"))))
    try:
        with pytest.raises(CheckpointError, match="2 parameter groups, this one 1"):
            one_group.load_checkpoint(out)
    finally:
        one_group.close()
    model = make_model()
    groups = param_groups(model)
    groups[0]["params"].append(model.proj.bias)  # decayed here, not in DeepSpeed's run
    groups[1]["params"] = [p for p in groups[1]["params"] if p is not model.proj.bias]
    moved = engine.wrap(model, optimizer=engine.AdamW(groups, lr=LR),
                        config=EngineConfig(store=tiered.StoreConfig(path=str(tmp_path / "b"))))
    try:
        with pytest.raises(CheckpointError, match=r"'proj\.bias' is in the checkpoint's parameter group 1"):
            moved.load_checkpoint(out)
        moved.load_checkpoint(out, load_optimizer=False)  # the weights alone load into any grouping
    finally:
        moved.close()


def test_a_deepspeed_directory_given_to_load_names_the_import(tmp_path):
    model, eng = wrap_as_deepspeed(tmp_path, "zero3_fp32_world2", 2)
    try:
        for name in ("zero3_fp32_world2", "zero2_fp32_world2"):
            with pytest.raises(CheckpointError, match="DeepSpeed checkpoint; convert it once with `tiered import"):
                eng.load_checkpoint(FIXTURE_DIR / name)
    finally:
        eng.close()


def test_client_state_pickles_and_unsupported_checkpoints(tmp_path):
    source = tmp_path / "ds"
    shutil.copytree(FIXTURE_DIR / "zero3_fp32_world2", source)
    states = source / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=True)
    rng = torch.get_rng_state()
    torch.save({**saved, "epoch": 4, "rng": rng, "args": Namespace(lr=0.1)}, states)  # as training scripts save it
    with pytest.raises(CheckpointError, match=r"argparse\.Namespace.*trust_pickle=True"):
        imported(tmp_path, "", source)
    assert not (tmp_path / "imported").exists() and not (tmp_path / "imported.partial").exists()
    with pytest.warns(UserWarning, match=r"client_state keys \['args'\] are neither JSON .* nor tensors"):
        out = engine.import_deepspeed_checkpoint(source, tmp_path / "imported", trust_pickle=True, progress=False)
    model, eng = wrap_as_deepspeed(tmp_path, "zero3_fp32_world2", 2)
    try:
        client = eng.load_checkpoint(out)  # what DeepSpeed's load returns, less what neither JSON nor tensors hold
        assert sorted(client) == ["epoch", "rng"] and client["epoch"] == 4 and torch.equal(client["rng"], rng)
    finally:
        eng.close()
    with pytest.raises(FileExistsError):
        engine.import_deepspeed_checkpoint(source, out, trust_pickle=True)
    with pytest.warns(UserWarning):
        engine.import_deepspeed_checkpoint(source, out, trust_pickle=True, overwrite=True, progress=False)

    lamb = tmp_path / "lamb"
    shutil.copytree(FIXTURE_DIR / "zero3_fp32_world2", lamb)
    states = lamb / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=True)
    saved["ds_config"]["optimizer"]["type"] = "Lamb"  # the same state names, other math
    torch.save(saved, states)
    with pytest.raises(CheckpointError, match="optimizer 'lamb'.*only Adam and AdamW import"):
        engine.import_deepspeed_checkpoint(lamb, tmp_path / "other")

    (source / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="no optimizer states file for rank 1"), pytest.warns(UserWarning):
        engine.import_deepspeed_checkpoint(source, tmp_path / "other", trust_pickle=True)
    stage0 = tmp_path / "stage0"  # no ZeRO: the optimizer's state is pickled into the model states
    stage0.mkdir()
    torch.save({"module": {}, "dp_world_size": 1, "mp_world_size": 1}, stage0 / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="no optimizer states file for rank 0.*without ZeRO, stage 0"):
        engine.import_deepspeed_checkpoint(stage0, tmp_path / "other")


def test_cli_imports_and_export_reads_the_result(tmp_path, capsys):
    out, weights = tmp_path / "imported", tmp_path / "hf"
    assert cli_main(["import-deepspeed", str(FIXTURE_DIR / "zero3_fp16_world2"), str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("6 parameters (5 with optimizer state) from 2 DeepSpeed rank(s) (zero3) at step 3, 2 of them "
            "skipped") in printed
    assert cli_main(["export", str(out), str(weights)]) == 0
    exported = load_file(weights / "model.safetensors")
    _, want = expected("zero3_fp16_world2")
    assert torch.equal(exported["embed.weight"], want["embed.weight/master"])  # the fp32 masters, not fp16
    assert "head.weight" not in exported  # tied: written once, as save_pretrained does
    tied = engine.checkpoint_state_dict(out)  # DeepSpeed recorded the tie in this checkpoint
    assert tied["head.weight"] is tied["embed.weight"]
    assert cli_main(["import-deepspeed", str(tmp_path / "missing"), str(tmp_path / "x")]) == 1
    assert "is not a DeepSpeed checkpoint" in capsys.readouterr().err
