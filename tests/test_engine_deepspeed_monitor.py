"""DeepSpeed's monitors and ``wall_clock_breakdown`` on ``engine.initialize``'s engine: the events
DeepSpeed writes at each optimizer step (``Train/Samples/lr``, ``loss_scale`` with fp16, the
``elapsed_time_ms_*`` timings), a script's own through ``model_engine.monitor.write_events``, and
the files each monitor leaves (TensorBoard's event files read back with TensorBoard's reader, the
CSV files as DeepSpeed lays them out). W&B and Comet are held to their calls through stand-in
modules (neither is a test dependency)."""

from __future__ import annotations

import csv
import importlib.machinery
import importlib.util
import re
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import engine
import tiered
from deepspeed_fixtures import batch, make_model, param_groups
from engine.integrations.deepspeed.monitor import CsvMonitor, DeepSpeedMonitor
from tiered.offline.render import format_bytes

#: 2 samples a micro-batch, 2 micro-batches a step, one rank: 4 samples a step.
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
SAMPLES_PER_STEP = 4


def _initialized(store: Path, config: dict) -> engine.DeepSpeedEngine:
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, model_parameters=param_groups(model), config=config, store=store)
    return eng


def _train_steps(eng: engine.DeepSpeedEngine, steps: int, *, log_loss: bool = False) -> list[float]:
    """``steps`` optimizer steps; the LR after each. With ``log_loss``, each micro-batch's loss goes to
    the monitor as a script's own event (a tensor, at ``global_samples``)."""
    lrs = []
    for micro in range(2 * steps):
        ids, targets = batch(micro)
        loss = eng(ids, targets)
        eng.backward(loss)
        eng.step()
        if log_loss:
            eng.monitor.write_events([("Train/Samples/train_loss", loss.detach(), eng.global_samples)])
        if micro % 2:
            lrs.append(eng.get_lr()[0])
    return lrs


def _csv_rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_tensorboard_and_csv_get_deepspeeds_events_and_the_scripts_own(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitors = {"tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run1"},
                "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run1"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # produced, so no "not produced" warning
        eng = _initialized(tmp_path / "store", {**CONFIG, **monitors})
    try:
        assert eng.monitor.enabled
        lrs = _train_steps(eng, 3, log_loss=True)
    finally:
        eng.close()
    steps = [SAMPLES_PER_STEP * (i + 1) for i in range(3)]
    csv_dir = tmp_path / "csv" / "run1"
    assert sorted(p.name for p in csv_dir.iterdir()) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    lr_rows = _csv_rows(csv_dir / "Train_Samples_lr.csv")
    assert lr_rows[0] == ["step", "lr"]
    assert [(int(s), float(v)) for s, v in lr_rows[1:]] == list(zip(steps, lrs))
    assert len(set(lrs)) == 3  # the warm-up moved it: each row is its own step's
    loss_rows = _csv_rows(csv_dir / "Train_Samples_train_loss.csv")
    assert loss_rows[0] == ["step", "train_loss"] and len(loss_rows) == 1 + 6  # one per micro-batch
    assert [int(s) for s, _ in loss_rows[1:]] == [0, 4, 4, 8, 8, 12]

    events = EventAccumulator(str(tmp_path / "tb" / "run1"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["Train/Samples/lr", "Train/Samples/train_loss"]
    assert [(e.step, e.value) for e in events.Scalars("Train/Samples/lr")] == [
        (s, pytest.approx(lr, rel=1e-6)) for s, lr in zip(steps, lrs)]  # float32 in the file
    assert [e.value for e in events.Scalars("Train/Samples/train_loss")] == pytest.approx(
        [float(v) for _, v in loss_rows[1:]], rel=1e-6)


def test_fp16_writes_the_loss_scale(tmp_path):
    config = {**CONFIG, "fp16": {"enabled": True, "initial_scale_power": 32, "hysteresis": 1},
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "fp16"}}
    eng = _initialized(tmp_path / "store", config)
    try:
        scales = []
        for _ in range(2):
            _train_steps(eng, 1)
            scales.append(eng.loss_scale)
        assert eng.skipped_steps >= 1 and scales[0] < 2.0 ** 32  # 2**32 overflows fp16: the scale fell
    finally:
        eng.close()
    rows = _csv_rows(tmp_path / "fp16" / "Train_Samples_loss_scale.csv")
    assert rows[0] == ["step", "loss_scale"]
    assert [(int(s), float(v)) for s, v in rows[1:]] == [(4, scales[0]), (8, scales[1])]  # skipped steps count


def test_wall_clock_breakdown_prints_deepspeeds_lines_and_writes_the_timings(tmp_path, capsys):
    config = {**CONFIG, "wall_clock_breakdown": True,
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "timers"}}
    eng = _initialized(tmp_path / "store", config)
    try:
        _train_steps(eng, 2)
        assert eng.wall_clock_breakdown()
        timers = eng.get_wall_clock_timers()  # as of the last step() call: its micro-step, the whole window
    finally:
        eng.close()
    lines = capsys.readouterr().out.splitlines()
    number = r"(\d+\.\d\d)"
    micro = re.compile(rf"\[Rank 0\] time \(ms\) \| fwd_microstep: {number} \| bwd_microstep: {number} \| "
                       rf"step_microstep: {number}$")
    window = re.compile(rf"\[Rank 0\] time \(ms\) \| fwd: {number} \| bwd: {number} \| step: {number} \| "
                        rf"io_wait: {number}$")
    # each step() call prints its micro-step line; every second one (an optimizer step) the window's too
    assert [bool(micro.match(line)) for line in lines] == [True, True, False, True, True, False]
    sums = []
    for first, second, total in (lines[0:3], lines[3:6]):
        a, b = (list(map(float, micro.match(line).groups())) for line in (first, second))
        fwd, bwd, step, io_wait = map(float, window.match(total).groups())
        assert fwd == pytest.approx(a[0] + b[0], abs=0.011) and bwd == pytest.approx(a[1] + b[1], abs=0.011)
        assert step == pytest.approx(a[2] + b[2], abs=0.011) and min(fwd, bwd, step) > 0 and io_wait >= 0
        assert b[2] > a[2]  # the optimizer steps in the second call; the first only counts
        sums.append((fwd, bwd, step))
    last = {**dict(zip(("fwd_microstep", "bwd_microstep", "step_microstep"), b)),
            **dict(zip(("fwd", "bwd", "step"), sums[-1]))}
    assert timers.keys() == last.keys()
    assert all(timers[name] == pytest.approx(ms, abs=0.006) for name, ms in last.items())
    for phase, name in enumerate(("forward", "backward", "step")):
        rows = _csv_rows(tmp_path / "timers" / f"Train_Samples_elapsed_time_ms_{name}.csv")
        assert rows[0] == ["step", f"elapsed_time_ms_{name}"]
        assert [int(s) for s, _ in rows[1:]] == [4, 8]
        assert [float(v) for _, v in rows[1:]] == pytest.approx([s[phase] for s in sums], abs=0.006)


def test_wandb_logs_to_the_scripts_run_or_starts_one(tmp_path, monkeypatch):
    runs = []

    class Run:
        def __init__(self, **init):
            self.init, self.logged = init, []
            runs.append(self)

        def log(self, data, step=None):
            self.logged.append((data, step))

    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    wandb.run = None
    wandb.init = lambda **kw: Run(**kw)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    config = {**CONFIG, "wandb": {"enabled": True, "project": "p", "group": "g", "team": "t"}}
    eng = _initialized(tmp_path / "store", config)
    try:
        lrs = _train_steps(eng, 2)
        eng.monitor.write_events([("Eval/accuracy", 0.5, eng.global_samples)])
    finally:
        eng.close()
    assert len(runs) == 1 and runs[0].init == {"project": "p", "group": "g", "entity": "t"}
    assert runs[0].logged == [({"Train/Samples/lr": lrs[0]}, 4), ({"Train/Samples/lr": lrs[1]}, 8),
                              ({"Eval/accuracy": 0.5}, 8)]
    wandb.run = runs[0]  # the script started its own run: the engine logs there
    eng = _initialized(tmp_path / "store2", {**CONFIG, "wandb": {"enabled": True}})
    try:
        _train_steps(eng, 1)
    finally:
        eng.close()
    assert len(runs) == 1 and runs[0].logged[-1][1] == 4


def test_comet_logs_each_name_once_per_sample_interval(tmp_path, monkeypatch):
    started = []

    class Experiment:
        def __init__(self, **kw):
            self.start, self.name, self.metrics = kw, None, []
            started.append(self)

        def set_name(self, name):
            self.name = name

        def log_metric(self, name, value, step=None):
            self.metrics.append((name, value, step))

    comet_ml = types.ModuleType("comet_ml")
    comet_ml.__spec__ = importlib.machinery.ModuleSpec("comet_ml", None)
    comet_ml.start = lambda **kw: Experiment(**kw)
    monkeypatch.setitem(sys.modules, "comet_ml", comet_ml)
    config = {**CONFIG, "comet": {"enabled": True, "samples_log_interval": 8, "project": "p", "online": False,
                                  "experiment_name": "run1"}}
    eng = _initialized(tmp_path / "store", config)
    try:
        lrs = _train_steps(eng, 3)  # samples 4, 8, 12: 8 - 4 < 8 is thinned out
    finally:
        eng.close()
    (experiment,) = started
    assert experiment.start == {"api_key": None, "project": "p", "workspace": None, "experiment_key": None,
                                "mode": None, "online": False}
    assert experiment.name == "run1"
    assert experiment.metrics == [("Train/Samples/lr", lrs[0], 4), ("Train/Samples/lr", lrs[2], 12)]


def test_refusals_come_before_the_model_is_touched(tmp_path, monkeypatch):
    """A monitor needs the batch size (its events count samples) and its package; both are checked
    before wrap moves the model's values into the store."""
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    no_batch = {k: v for k, v in CONFIG.items() if k != "train_micro_batch_size_per_gpu"}
    with pytest.raises(ValueError, match="turns on csv_monitor, whose events are counted in samples: set "
                                         "train_micro_batch_size_per_gpu or train_batch_size"):
        engine.initialize(model=model, model_parameters=param_groups(model), store=tmp_path / "a",
                          config={**no_batch, "csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    real_find_spec = importlib.util.find_spec  # comet_ml is not installed, whatever this machine has
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "comet_ml" else real_find_spec(name, *a, **k))
    with pytest.raises(ImportError, match=r"turns on 'comet', which needs the comet_ml package: pip install comet_ml"):
        engine.initialize(model=model, model_parameters=param_groups(model), store=tmp_path / "b",
                          config={**CONFIG, "comet": {"enabled": True}})
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not (tmp_path / "DeepSpeedJobName").exists()


def test_events_are_checked_and_a_resumed_csv_file_keeps_one_header(tmp_path):
    monitor = DeepSpeedMonitor([CsvMonitor(str(tmp_path))], enabled=True)
    monitor.write_events([("a/b c", 1.5, 1), ["a/b c", torch.tensor([2.0]), 2]])
    for bad in [("x", 1.0), ("x", "high", 1), ("x", 1.0, 1.5), (3, 1.0, 1), ("x", torch.ones(2), 1)]:
        with pytest.raises(TypeError, match="monitor event"):
            monitor.write_events([bad])
    DeepSpeedMonitor([CsvMonitor(str(tmp_path))], enabled=True).write_events([("a/b c", 3.0, 3)])  # a resumed run
    assert _csv_rows(tmp_path / "a_b_c.csv") == [["step", "b c"], ["1", "1.5"], ["2", "2.0"], ["3", "3.0"]]
    quiet = DeepSpeedMonitor(enabled=True)  # another rank's: enabled, writes nothing
    quiet.write_events([("x", 1.0, 1)])
    assert quiet.enabled and sorted(p.name for p in tmp_path.iterdir()) == ["a_b_c.csv"]


def test_engine_wrap_users_are_told_the_monitors_are_initializes(tmp_path):
    with pytest.warns(UserWarning, match=r"^tensorboard, csv_monitor, wall_clock_breakdown, flops_profiler: not "
                                         r"produced by this engine .*engine.initialize's engine produces them"):
        engine.EngineConfig.from_deepspeed(
            {"zero_optimization": {"stage": 3}, "tensorboard": {"enabled": True}, "csv_monitor": {"enabled": True},
             "wall_clock_breakdown": True, "flops_profiler": {"enabled": True}},
            store=tiered.StoreConfig(path=str(tmp_path)))
    with pytest.raises(ValueError, match=r"tensorboard.output_dir: unknown key.*did you mean 'output_path'\?"
                                         r"[\s\S]*wandb.project: must be a string, got 3"):
        engine.EngineConfig.from_deepspeed(
            {"zero_optimization": {"stage": 3}, "tensorboard": {"enabled": True, "output_dir": "x"},
             "wandb": {"project": 3}}, store=tiered.StoreConfig(path=str(tmp_path)))


def test_flops_profiler_prints_deepspeeds_profile_of_its_step(tmp_path, capsys):
    """At ``profile_step`` (the second optimizer step by default), rank 0 prints DeepSpeed's profile:
    the forward flops of the step's micro-batches, as torch's counter finds them on the plain
    model, the latencies and rates from them, and the busiest modules."""
    from torch.utils.flop_counter import FlopCounterMode

    from engine.integrations.deepspeed.flops import _scaled

    plain = make_model()
    with FlopCounterMode(display=False) as counter:
        for micro in (2, 3):  # the micro-batches of step 1
            plain(*batch(micro))
    expected = counter.get_total_flops()
    config = {**CONFIG, "flops_profiler": {"enabled": True, "top_modules": 2, "detailed": False}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng = _initialized(tmp_path / "store", config)
    try:
        for micro in range(6):
            eng.backward(eng(*batch(micro)))
            eng.step()
            if micro == 2:  # an evaluation forward inside the profiled step: not counted
                eng.eval()
                with torch.no_grad():
                    eng(*batch(9))
                eng.train()
    finally:
        eng.close()
    out = capsys.readouterr().out
    assert out.count("DeepSpeed Flops Profiler") == 1 and "Profile Summary at step 1:" in out
    values = dict(re.findall(r"^(.+?):\s{2,}(.+)$", out, re.MULTILINE))
    assert values["fwd flops per GPU"] == _scaled(expected, "") and expected > 0
    assert values["fwd MACs per GPU"] == _scaled(expected / 2, "MACs")
    assert values["params per GPU"] == _scaled(sum(p.numel() for p in plain.parameters()), "")
    assert values["batch size per GPU"] == "2" and float(values["samples/second"]) > 0
    for name in ("fwd latency", "bwd latency", "step latency", "iter latency"):
        assert re.fullmatch(r"\d+\.\d\d m?s", values[name]), name
    assert re.search(r"^depth 0: +TinyLM: ", out, re.MULTILINE) and "Detailed Profile" not in out

    config["flops_profiler"] = {"enabled": True, "profile_step": 0, "output_file": str(tmp_path / "profile.txt")}
    eng = _initialized(tmp_path / "store2", config)
    try:
        _train_steps(eng, 2)
    finally:
        eng.close()
    assert capsys.readouterr().out == ""
    written = (tmp_path / "profile.txt").read_text()
    assert "Profile Summary at step 0:" in written and "Detailed Profile per GPU" in written


def test_memory_breakdown_and_dump_state_print_memory_and_the_configuration(tmp_path, capsys):
    config = {**CONFIG, "memory_breakdown": True, "dump_state": True,
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng = _initialized(tmp_path / "store", config)
    try:
        dumped = capsys.readouterr().out.splitlines()
        _train_steps(eng, 1)
        stats = eng.stats()
    finally:
        eng.close()
    assert dumped[0] == "[Rank 0] DeepSpeedEngine configuration:"
    settings = dict(re.fullmatch(r"\[Rank 0\]   (\S+) \.+ (.+)", line).groups() for line in dumped[1:])
    assert settings["prefetch_bytes"] == "4000" and settings["gradient_accumulation_steps"] == "2"  # mapped
    assert settings["store.path"] == repr(str(tmp_path / "store")) and list(settings) == sorted(settings)
    lines = capsys.readouterr().out.splitlines()
    labels = [line for line in lines if line.startswith("[Rank 0] Engine after")]
    assert labels == ["[Rank 0] Engine after forward", "[Rank 0] Engine after backward",
                      "[Rank 0] Engine after step"] * 2
    machine = [line for line in lines if "CPU Virtual Memory" in line]
    assert len(machine) == 6 and re.fullmatch(r"\[Rank 0\] CPU Virtual Memory:  used = \d+\.\d\d GB, "
                                              r"percent = \d+\.\d%", machine[0])
    store = [line for line in lines if line.startswith("[Rank 0] Store: ")]
    assert len(store) == 6
    nvme = stats.store.tiers[tiered.Tier.NVME]
    budget = f" of {format_bytes(nvme.budget_bytes)}" if nvme.budget_bytes is not None else ""
    assert f"nvme {format_bytes(nvme.used_bytes)}{budget};" in store[-1]
    assert nvme.used_bytes > 0 and store[-1].endswith(f"(peak {format_bytes(stats.peak_materialized_bytes)})")
