"""benchmarks/inference_bench.py, train_bench.py and scaling_bench.py on a tiny model on the CPU:
every contender's outputs (or losses) equal the in-memory model's, a mismatch exits 1, and the JSON
holds the verdict and the machine (no timing assertions: docs/results.md has real runs)."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_inference_contenders_match_the_in_memory_model(tmp_path, benchmark_script):
    out = tmp_path / "inference.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert benchmark_script("inference_bench").main([
        "--dir", str(scratch), "--layers", "1", "--embd", "64", "--tokens", "8", "--repeats", "1", "--loop", "2",
        "--host-mib", "1", "--prefetch-mib", "16", "--queue-depth", "4", "--fio-size", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    assert report["verdict"]["runs"] == 1 and report["verdict"]["met"] is None  # one repetition: not judged
    assert report["machine"]["cpus"] == os.cpu_count() and "loadavg_after" in report["machine"]
    assert "queue depth 4" in report["contenders"][2]["note"]
    assert [c["equal_outputs"] for c in report["contenders"]] == [True] * 4
    assert all(len(c["seconds"]) == 1 for c in report["contenders"])
    assert report["engine_bytes_read_during_cold_forward"][0] > 0  # the cold forward read its weights
    assert os.listdir(scratch) == []


@pytest.mark.parametrize("options", [
    [], ["--fused", "--tier", "host", "--two-slots", "--back-to-back", "--cpu-threads", "3", "--queue-depth", "8"]])
def test_training_contenders_match_torch_adamw(tmp_path, benchmark_script, options):
    out = tmp_path / "train.json"
    assert benchmark_script("train_bench").main([
        "--dir", str(tmp_path), "--layers", "1", "--embd", "64", "--vocab", "128", "--seq", "16", "--batch", "2",
        "--steps", "2", "--skip", "fsdp2", "--json", str(out), *options]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    assert report["schedule"] == ("back to back" if "--back-to-back" in options else "turns, order rotated every step")
    memory, *ours = report["runs"]
    assert len(ours) == (2 if "--two-slots" in options else 1)
    assert memory["vs_first"] == 1.0
    for run in ours:
        assert len(run["losses"]) == 2 and len(run["optimizer_seconds"]) == 2
        assert run["losses"] == memory["losses"] and run["max_loss_diff"] == 0.0  # bit for bit
    assert report["losses_match"] and report["verdict"]["runs"] == 1 and report["verdict"]["met"] is None


def test_training_exits_1_when_a_contender_trains_to_other_losses(tmp_path, benchmark_script, monkeypatch, capsys):
    module = benchmark_script("train_bench")
    reference = module.in_memory

    def other_lr(model, args):  # the reference contender, at another learning rate: its losses differ
        return reference(model, argparse.Namespace(**{**vars(args), "lr": args.lr * 2}))

    monkeypatch.setattr(module, "in_memory", other_lr)
    out = tmp_path / "train.json"
    assert module.main(["--dir", str(tmp_path), "--layers", "1", "--embd", "64", "--vocab", "128", "--seq", "16",
                        "--batch", "2", "--steps", "3", "--skip", "fsdp2", "--json", str(out)]) == 1
    assert "losses differ" in capsys.readouterr().err
    assert json.loads(out.read_text())["losses_match"] is False


def test_scaling_holds_the_step_against_fio_and_the_in_memory_step(tmp_path, benchmark_script):
    out = tmp_path / "scaling.json"
    assert benchmark_script("scaling_bench").main([
        "--dir", str(tmp_path / "scratch"), "--embd", "64", "--layers", "1", "--vocab", "128", "--seq", "16",
        "--batch", "1", "--steps", "3", "--fio-size", str(1 << 20), "--fio-quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    # A model this small stays in the host tier's kept copies: the step writes through, reads may be 0.
    assert row["losses_match"] and row["bytes_read_per_step"] >= 0 and row["bytes_written_per_step"] > 0
    if report["fio"] is None:
        pytest.skip("fio is not installed here: no floor")
    floors = [r / report["fio"]["read_bytes_per_s"] + w / report["fio"]["write_bytes_per_s"]
              for r, w in zip(row["bytes_read"][1:], row["bytes_written"][1:])]
    assert row["io_floor_s"] == pytest.approx(sum(floors) / 2)  # the median of the two timed steps
    ratios = [t / max(f, row["memory_step_s"]) for t, f in zip(row["tiered_steps"][1:], floors)]
    assert row["verdict"]["values"] == pytest.approx(ratios) and row["verdict"]["met"] is None  # 2 runs: not judged
    assert os.listdir(tmp_path / "scratch") == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
@pytest.mark.parametrize("script", ["inference_bench", "train_bench"])
def test_cuda_without_a_gpu_is_refused_before_any_work(tmp_path, benchmark_script, capsys, script):
    with pytest.raises(SystemExit) as exc:
        benchmark_script(script).main(["--dir", str(tmp_path), "--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_beyond_memory_refuses_a_disk_without_room_before_measuring_anything(tmp_path, benchmark_script, capsys):
    free = shutil.disk_usage(tmp_path).free
    code = benchmark_script("beyond_memory").main(["--dir", str(tmp_path), "--state-gib", str(4 * free / 2 ** 30),
                                                   "--json", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert code == 2 and "GB free; this run needs about" in err and "fio" not in err
    assert not (tmp_path / "out.json").exists() and os.listdir(tmp_path) == []  # nothing written or left behind


def test_beyond_memory_reads_the_busy_time_of_the_disk_under_its_directory(tmp_path, benchmark_script):
    ticks = benchmark_script("beyond_memory").disk_ticks
    assert ticks("/proc") is None  # no block device: no line in /proc/diskstats
    found = ticks(str(tmp_path))
    if found is not None:  # a filesystem on a block device: busy seconds, at most the request-weighted ones
        busy, weighted = found
        assert 0 <= busy <= weighted


def test_beyond_memory_refuses_a_device_this_machine_lacks_before_measuring_anything(tmp_path, benchmark_script,
                                                                                     capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    code = benchmark_script("beyond_memory").main(["--dir", str(tmp_path), "--device", "cuda",
                                                   "--json", str(tmp_path / "out.json")])
    assert code == 2 and "torch sees no CUDA device" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
