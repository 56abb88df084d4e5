"""benchmarks/inference_bench.py and benchmarks/train_bench.py on a tiny model on the CPU: every
contender's outputs (or losses) agree with the in-memory model's and the JSON says where it computed
(no timing assertions; docs/results.md has real runs, GPU ones included)."""

from __future__ import annotations

import json
import os

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
        "--host-mib", "1", "--prefetch-mib", "16", "--queue-depth", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
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
        assert run["losses"] == pytest.approx(memory["losses"], rel=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
@pytest.mark.parametrize("script", ["inference_bench", "train_bench"])
def test_cuda_without_a_gpu_is_refused_before_any_work(tmp_path, benchmark_script, capsys, script):
    with pytest.raises(SystemExit) as exc:
        benchmark_script(script).main(["--dir", str(tmp_path), "--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
