"""benchmarks/device_transfer.py on host memory (``--device cpu``; a GPU run is docs/results.md's):
every contender's runs in the JSON, the table, the scratch directory removed (no timing assertions)."""

from __future__ import annotations

import json
import os

import pytest
import torch


def test_every_contender_moves_the_tensor_each_round(tmp_path, benchmark_script, capsys):
    module = benchmark_script("device_transfer")
    out = tmp_path / "transfer.json"
    scratch = tmp_path / "scratch"
    assert module.main(["--dir", str(scratch), "--size", str(3 << 20), "--rounds", "2", "--device", "cpu",
                        "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert list(runs) == [name for name, _, _ in module.CONTENDERS]
    assert all(len(r["seconds"]) == 2 and min(r["gb_per_s"]) > 0 for r in runs.values())
    assert runs["get into GPU"]["ratio_to_host"] > 0 and runs["get into host"]["ratio_to_host"] is None
    assert "| get into GPU |" in capsys.readouterr().out
    assert os.listdir(scratch) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_without_cuda_it_says_how_to_run(tmp_path, benchmark_script, capsys):
    assert benchmark_script("device_transfer").main(["--dir", str(tmp_path)]) == 2
    assert "--device cpu" in capsys.readouterr().err
