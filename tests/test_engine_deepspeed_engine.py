"""``engine.initialize``'s engine as DeepSpeed scripts use it (``engine.DeepSpeedEngine``): its
checkpoint calls' arguments and results, its counters, ``save_16bit_model``, and joining the
process group torchrun describes, as ``deepspeed.initialize`` does. The oracle for training is
DeepSpeed 0.19.8 itself: a checkpoint it wrote at two ranks and the losses it went on to
(tests/fixtures/deepspeed, by tests/deepspeed_fixtures.py)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import engine
import tiered
from deepspeed_fixtures import (
    FIXTURES, STEPS_AFTER, STEPS_BEFORE, batch, ds_config, make_model, param_groups,
)
from engine.integrations.deepspeed.initialize import _compute_device
from test_engine_distributed import run_ranks

FIXTURE_DIR = Path(__file__).parent / "fixtures" / "deepspeed"
#: DeepSpeed at two ranks with a WarmupDecayLR schedule.
TWO_RANKS = "zero3_offload_world2"
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}


def _initialized(store: Path | tiered.StoreConfig, config: dict = CONFIG) -> engine.DeepSpeedEngine:
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, model_parameters=param_groups(model), config=config, store=store)
    return eng


def _train(eng: engine.DeepSpeedEngine, micro_batches: range | int) -> list[float]:
    losses = []
    for micro in range(micro_batches) if isinstance(micro_batches, int) else micro_batches:
        ids, targets = batch(micro)
        loss = eng(ids.to(eng.device), targets.to(eng.device))
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def _tutorial_at_two_ranks(rank: int, root: str) -> None:
    """DeepSpeed's getting-started loop, engine.initialize for deepspeed.initialize and nothing else
    changed: no init_process_group (initialize joins torchrun's group), batches moved to
    ``model_engine.device``, ``_, client_sd = load_checkpoint(dir)``, a save with the default tag."""
    model = make_model()
    monitor = {"csv_monitor": {"enabled": True, "output_path": root, "job_name": "csv"}}  # written by rank 0 alone
    model_engine, _, _, _ = engine.initialize(model=model, model_parameters=param_groups(model),
                                              config=ds_config(2, {**FIXTURES[TWO_RANKS][1], **monitor}),
                                              store=Path(root, "store"))
    try:
        load_path, client_sd = model_engine.load_checkpoint(Path(root, "imported"))
        loaded_steps = model_engine.global_steps
        losses = []
        for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
            ids, targets = batch(step)
            ids, targets = ids[rank::2].to(model_engine.device), targets[rank::2].to(model_engine.device)
            loss = model_engine(ids, targets)
            model_engine.backward(loss)
            model_engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / 2)
            model_engine.monitor.write_events([("Train/loss", losses[-1], model_engine.global_samples)])
        rng = torch.get_rng_state()  # tensors in client_state, as DeepSpeed scripts keep them; rank 0's are kept
        model_engine.save_checkpoint(Path(root, "ours"), client_state={
            "step": model_engine.global_steps, "rng": rng, "mine": [torch.full((2, 3), float(rank))]})
        try:  # DeepSpeed's tag_validation: each rank would otherwise write its file under its own tag
            model_engine.save_checkpoint(Path(root, "ours"), f"rank{rank}")
            mismatch = None
        except ValueError as exc:
            mismatch = str(exc)
        _, saved = model_engine.load_checkpoint(Path(root, "ours"))
        rank0_state = (saved["step"] == model_engine.global_steps and torch.equal(saved["rng"], rng)
                       and torch.equal(saved["mine"][0], torch.zeros(2, 3)))
        record = {"mismatch": mismatch, "rank0_state": rank0_state, "load_path": load_path, "client_sd": client_sd,
                  "loaded_steps": loaded_steps,
                  "losses": losses, "world": model_engine.world_size,
                  "ranks": [model_engine.global_rank, model_engine.local_rank],
                  "steps": model_engine.global_steps, "samples": model_engine.global_samples}
    finally:
        model_engine.close()
    Path(root, f"rank{rank}.json").write_text(json.dumps(record))


def test_deepspeeds_tutorial_loop_at_two_ranks_reaches_deepspeeds_losses(tmp_path):
    meta = json.loads((FIXTURE_DIR / TWO_RANKS / "expected.json").read_text())
    imported = engine.import_deepspeed_checkpoint(FIXTURE_DIR / TWO_RANKS, tmp_path / "imported", progress=False)
    run_ranks(_tutorial_at_two_ranks, str(tmp_path), join=False)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        assert record["world"] == 2 and record["ranks"] == [rank, rank]  # sharded: the group was joined
        assert record["load_path"] == imported and isinstance(record["client_sd"], dict)
        assert record["loaded_steps"] == meta["global_steps"] == STEPS_BEFORE
        assert record["losses"] == pytest.approx(meta["losses_after"], rel=1e-6)
        assert record["steps"] == STEPS_BEFORE + STEPS_AFTER and record["samples"] == 4 * record["steps"]
        assert "every rank must save under the same tag; the ranks passed ['rank0', 'rank1']" in record["mismatch"]
        assert record["rank0_state"]
    assert (tmp_path / "ours" / "latest").read_text() == f"global_step{STEPS_BEFORE + STEPS_AFTER}"
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["global_step6", "latest"]
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["rank0", "rank1"]
    samples = [4 * step for step in range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1)]
    for name, values in (("Train_loss", records[0]["losses"]), ("Train_Samples_lr", None)):
        rows = (tmp_path / "csv" / f"{name}.csv").read_text().splitlines()
        assert rows[0].startswith("step,") and [int(r.split(",")[0]) for r in rows[1:]] == samples  # once each
        assert values is None or [float(r.split(",")[1]) for r in rows[1:]] == values


def test_load_before_the_first_save_starts_afresh_and_saves_are_tagged_by_step(tmp_path):
    """A DeepSpeed script loads at start-up: (None, None) and a warning until something is saved."""
    eng = _initialized(tmp_path / "store")
    try:
        with pytest.warns(UserWarning, match="no checkpoint to load"):
            assert eng.load_checkpoint(tmp_path / "ckpt") == (None, None)
        _train(eng, 4)
        assert eng.global_steps == 2 and eng.global_samples == 8 and eng.train_batch_size() == 4
        assert eng.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 3}) is True
        assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
        eng.save_checkpoint(tmp_path / "ckpt", 0.25, save_latest=False)  # a tag of any type, as str(tag)
        assert (tmp_path / "ckpt" / "0.25" / "metadata.json").is_file()
        assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
        eng.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 4})  # the same tag: replaced, as DeepSpeed
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["0.25", "global_step2", "latest"]
        with pytest.raises(FileExistsError, match="overwrite=True"):
            eng.save_checkpoint(tmp_path / "ckpt", overwrite=False)
        (tmp_path / "ckpt" / "notes").mkdir()  # not a checkpoint: never replaced unasked
        with pytest.raises(FileExistsError, match="overwrite=True"):
            eng.save_checkpoint(tmp_path / "ckpt", "notes")
        assert (tmp_path / "ckpt" / "notes").is_dir() and not (tmp_path / "ckpt" / "notes" / "metadata.json").exists()
        with pytest.raises(ValueError, match=r"load_module_strict=False\) is not supported"):
            eng.load_checkpoint(tmp_path / "ckpt", load_module_strict=False)
        weights = {k: v.clone() for k, v in eng.state_dict().items()}
    finally:
        eng.close()

    eng = _initialized(tmp_path / "fresh")
    try:
        load_path, client_sd = eng.load_checkpoint(tmp_path / "ckpt")
        assert load_path == str(tmp_path / "ckpt" / "global_step2") and client_sd["epoch"] == 4
        assert eng.global_steps == 2 and eng.lr_scheduler.iteration == 1  # the schedule with the optimizer
        assert all(torch.equal(v, weights[k]) for k, v in eng.state_dict().items())
    finally:
        eng.close()

    eng = _initialized(tmp_path / "module-only")
    try:
        eng.load_checkpoint(tmp_path / "ckpt", load_module_only=True)  # weights only: no optimizer steps
        assert eng.global_steps == 0 and eng.lr_scheduler.iteration == -1
        assert all(torch.equal(v, weights[k]) for k, v in eng.state_dict().items())
    finally:
        eng.close()

    eng = _initialized(tmp_path / "no-schedule")
    try:
        eng.load_checkpoint(tmp_path / "ckpt", load_lr_scheduler_states=False)
        assert eng.global_steps == 2 and eng.lr_scheduler.iteration == -1  # the schedule as built
    finally:
        eng.close()

    eng = _initialized(tmp_path / "no-optimizer")
    try:
        eng.load_checkpoint(tmp_path / "ckpt", load_optimizer_states=False)  # the schedule still loads, as DeepSpeed's
        assert eng.global_steps == 2 and eng.lr_scheduler.iteration == 1  # and global_steps, as DeepSpeed's
        assert all(torch.count_nonzero(eng.full_optimizer_state(p, "exp_avg")) == 0
                   for p in eng.parameters() if p.requires_grad)
        _train(eng, 2)  # fresh moments from the loaded weights; the count goes on
        assert eng.global_steps == 3 and eng.save_checkpoint(tmp_path / "after")
        assert (tmp_path / "after" / "latest").read_text() == "global_step3"
    finally:
        eng.close()


def test_a_torch_optimizer_counts_its_steps_and_resumes_with_them(tmp_path):
    """engine.initialize(optimizer=torch.optim.AdamW(...)), a client optimizer as DeepSpeed takes
    one: global_steps counts its steps (the default tag follows them), and a resume continues the
    run bit for bit, its moments and the step count included."""
    config = {k: v for k, v in CONFIG.items() if k not in ("optimizer", "scheduler")}

    def initialized(store: Path) -> engine.DeepSpeedEngine:
        model = make_model()
        eng, _, _, _ = engine.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=0.01),
                                         config=config, store=store)
        return eng

    eng = initialized(tmp_path / "a")
    try:
        _train(eng, 4)  # accumulation 2: two optimizer steps
        assert eng.global_steps == 2 and eng.global_samples == 8
        eng.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 1})
        assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
        want = _train(eng, range(4, 8))
    finally:
        eng.close()
    eng = initialized(tmp_path / "b")
    try:
        _, client_sd = eng.load_checkpoint(tmp_path / "ckpt")
        assert client_sd == {"epoch": 1} and eng.global_steps == 2  # the step count is the engine's, not yours
        assert _train(eng, range(4, 8)) == want and eng.global_steps == 4
    finally:
        eng.close()


def test_batch_sizes_precision_and_save_16bit_model(tmp_path):
    config = {"train_batch_size": 12, "gradient_accumulation_steps": 3, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    eng = _initialized(tmp_path / "store", config)
    try:
        assert (eng.train_batch_size(), eng.train_micro_batch_size_per_gpu(), eng.gradient_accumulation_steps()) == \
            (12, 4, 3)
        assert [get() for get in eng.get_batch_info()] == [12, 4, 3]  # DeepSpeed returns the methods
        assert eng.steps_per_print() is None and eng.gradient_clipping() == 1.0 and not eng.wall_clock_breakdown()
        assert eng.get_wall_clock_timers() == {}
        assert eng.bfloat16_enabled() and not eng.fp16_enabled() and eng.zero_optimization_stage() == 3
        assert eng.get_mom() == [(0.9, 0.999)] * 2 and eng.get_lr() == [0.01] * 2  # two groups: its progress line
        assert eng.save_16bit_model(tmp_path / "out") is True
        saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
        expected = eng.state_dict()
        assert saved.keys() == expected.keys() and all(torch.equal(saved[k], v) for k, v in expected.items())
        assert saved["proj.weight"].dtype == torch.bfloat16
        assert eng.save_fp16_model(tmp_path / "old") is True  # DeepSpeed's older name
        old = torch.load(tmp_path / "old" / "pytorch_model.bin", weights_only=True)
        assert old.keys() == saved.keys() and all(torch.equal(old[k], v) for k, v in saved.items())
        eng.save_16bit_model(tmp_path / "out", "model.safetensors")  # the Trainer's name: save_weights' file
        assert [p.name for p in (tmp_path / "out").glob("model*")] == ["model.safetensors"]
        with pytest.raises(ValueError, match="save_filename must be a file name"):
            eng.save_16bit_model(tmp_path / "out", "weights.safetensors")
    finally:
        eng.destroy()
    assert eng.closed

    eng = _initialized(tmp_path / "no-batch", {"zero_optimization": {"stage": 3}, "gradient_clipping": 0,
                                               "steps_per_print": 10})
    try:
        assert eng.gradient_clipping() == 0.0 and eng.steps_per_print() == 10
        with pytest.raises(ValueError, match="neither train_batch_size nor train_micro_batch_size_per_gpu"):
            eng.train_batch_size()
        with pytest.raises(RuntimeError, match="get_mom.. needs an optimizer"):
            eng.get_mom()
    finally:
        eng.close()
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.8),
                                     config={"zero_optimization": {"stage": 3}}, store=tmp_path / "sgd")
    try:
        assert eng.get_mom() == [0.8]  # SGD's momentum, as DeepSpeed reports it
    finally:
        eng.close()


def test_initialize_takes_deepspeeds_other_argument_spellings(tmp_path):
    parser = engine.add_config_arguments(argparse.ArgumentParser())
    config_file = tmp_path / "ds.json"
    config_file.write_text(json.dumps(CONFIG))
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(config_file)])
    assert args.deepspeed and args.deepspeed_config == str(config_file)
    eng, optimizer, _, _ = engine.initialize(args=args, model=make_model(), store=tmp_path / "a")
    try:
        assert isinstance(eng, engine.DeepSpeedEngine) and isinstance(optimizer, engine.AdamW)
        assert eng.gradient_accumulation_steps() == 2
    finally:
        eng.close()
    eng, _, _, _ = engine.initialize(model=make_model(), config_params=CONFIG, store=tmp_path / "b")
    eng.close()
    with pytest.raises(ValueError, match="config= or config_params=, not both"):
        engine.initialize(model=make_model(), config=CONFIG, config_params=CONFIG, store=tmp_path / "c")
    with pytest.raises(ValueError, match=r"dist_init_required=True\): no launcher"):
        engine.initialize(model=make_model(), config=CONFIG, store=tmp_path / "d", dist_init_required=True)


def test_without_a_launcher_there_is_no_group_to_join(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert engine.init_distributed() is False and not dist.is_initialized()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"not \['WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\]"):
        engine.init_distributed()


def test_wrap_refuses_a_launched_rank_without_a_process_group(tmp_path, monkeypatch):
    """Each of torchrun's processes would otherwise train a copy of its own (or collide on one store)."""
    config = engine.EngineConfig(store=tiered.StoreConfig(path=str(tmp_path)))
    model = make_model()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="launched as one of WORLD_SIZE=2 ranks"):
        engine.wrap(model, config=config)
    monkeypatch.setenv("WORLD_SIZE", "1")
    engine.wrap(model, config=config).close()


def test_with_cuda_a_cpu_model_computes_on_its_local_rank(monkeypatch):
    """Where DeepSpeed moves the model: the device of LOCAL_RANK (checked without a GPU)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _compute_device(make_model(), cuda_available=True) == "cuda:1"
    assert _compute_device(make_model(), cuda_available=False) is None
    with torch.device("meta"):
        meta = make_model()
    assert _compute_device(meta, cuda_available=True) == "cuda:1"


def test_steps_per_print_prints_deepspeeds_progress_line_every_n_steps(tmp_path, capsys):
    """DeepSpeed prints ``step=N, skipped=S, lr=[...], mom=[...]`` on rank 0 after every
    ``steps_per_print``-th optimizer step (not micro-batch), with the LR the schedule just set, and
    its throughput timer's samples/second (the first two optimizer steps left out of it)."""
    eng = _initialized(tmp_path / "store", {**CONFIG, "steps_per_print": 2})
    try:
        expected = []
        for micro in range(10):  # 5 optimizer steps at 2 micro-batches each
            _train(eng, range(micro, micro + 1))
            if micro % 4 == 3:
                expected.append(f"[Rank 0] step={eng.global_steps}, skipped=0, lr={eng.get_lr()}, "
                                f"mom=[(0.9, 0.999), (0.9, 0.999)]")
        assert eng.global_steps == 5
        lines = capsys.readouterr().out.splitlines()
        assert lines[0::2] == expected
        assert [line.split(",")[0] for line in expected] == ["[Rank 0] step=2", "[Rank 0] step=4"]
        # On an accelerator DeepSpeed's line ends with its memory figures
        memory = r", MemAllocated=\d+\.\d\dGB, MaxMemAllocated=\d+\.\d\dGB" if eng.device.type == "cuda" else ""
        assert re.fullmatch(r"\[Rank 0\] micro_step=4/global_step=2, RunningAvgSamplesPerSec=-, CurrSamplesPerSec=-"
                            + memory, lines[1]), lines[1]
        timed = re.fullmatch(r"\[Rank 0\] micro_step=8/global_step=4, RunningAvgSamplesPerSec=(\d+\.\d\d), "
                             r"CurrSamplesPerSec=(\d+\.\d\d)" + memory, lines[3])
        assert timed and min(map(float, timed.groups())) > 0 and len(lines) == 4
    finally:
        eng.close()
    untimed = _initialized(tmp_path / "untimed", {**CONFIG, "steps_per_print": 1,
                                                  "timers": {"throughput": {"enabled": False}}})
    try:
        _train(untimed, 2)
        assert capsys.readouterr().out.splitlines() == [
            "[Rank 0] step=1, skipped=0, lr=[0.0, 0.0], mom=[(0.9, 0.999), (0.9, 0.999)]"]
    finally:
        untimed.close()
    quiet = _initialized(tmp_path / "quiet", {**CONFIG, "steps_per_print": None})  # DeepSpeed's default
    try:
        _train(quiet, 4)
        assert capsys.readouterr().out == ""
    finally:
        quiet.close()


def test_empty_partition_cache_frees_what_forward_only_calls_keep_prefetched(tmp_path):
    eng = _initialized(tmp_path / "store", {**CONFIG, "zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": 1 << 20, "stage3_param_persistence_threshold": 0}})
    try:
        ids, targets = batch(0)
        with torch.no_grad():
            for _ in range(3):  # recorded once, then the next call's first parameters stay ahead
                eng(ids, targets)
        assert eng.stats().materialized_bytes > 0
        eng.empty_partition_cache()
        assert eng.stats().materialized_bytes == 0
    finally:
        eng.close()


def test_offload_states_empties_the_device_tier_and_reload_states_refills_it(tmp_path):
    """RLHF loops free the training engine's accelerator memory while they generate with another
    engine (DeepSpeed's offload_states/reload_states); training then goes on as if never interrupted."""
    config = {**CONFIG, "zero_optimization": {"stage": 3, "offload_param": {"device": "none"}}}

    def initialized(path: Path) -> engine.DeepSpeedEngine:  # the device tier holds the parameters
        return _initialized(tiered.StoreConfig(path=str(path), device_bytes=1 << 26), config)

    plain = initialized(tmp_path / "plain")
    try:
        want = _train(plain, 8)
    finally:
        plain.close()
    eng = initialized(tmp_path / "store")
    try:
        losses = _train(eng, 4)

        def on_device() -> int:
            return eng.stats().store.tiers[tiered.Tier.DEVICE].entries

        held = on_device()
        assert held > 0 and eng.stats().materialized_bytes >= 0
        eng.offload_states(include=["optim_states", "hp_params"])  # nothing of theirs is on the device here
        assert on_device() == held
        eng.offload_states()
        assert on_device() == 0 and eng.stats().materialized_bytes == 0
        eng.reload_states()
        assert on_device() == held
        eng.offload_states()
        eng.reload_states(non_blocking=True)  # the next forward waits for what it needs
        losses += _train(eng, range(4, 8))
        assert losses == want
        with pytest.raises(ValueError, match=r"unknown state\(s\) \['weights'\]"):
            eng.offload_states(include=["weights"])
        with pytest.raises(ValueError, match="to the CPU only"):
            eng.offload_states(device="nvme")
    finally:
        eng.close()
