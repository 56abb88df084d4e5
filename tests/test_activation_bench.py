"""benchmarks/activation_bench.py runs its four contenders end to end on a tiny GPT (each in its own
process), finds their losses equal and writes its JSON (no timing assertions)."""

from __future__ import annotations

import json
import os


def test_four_contenders_train_to_the_same_losses(tmp_path, benchmark_script, capsys):
    module = benchmark_script("activation_bench")
    out = tmp_path / "activations.json"
    scratch = tmp_path / "scratch"
    assert module.main(["--dir", str(scratch), "--layers", "1", "--embd", "64", "--heads", "2", "--vocab", "128",
                        "--seq", "64", "--batch", "2", "--steps", "2", "--window-mib", "1", "--min-kib", "4",
                        "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert list(runs) == list(module.CONTENDERS)
    for run in runs.values():
        assert len(run["losses"]) == 2 and run["losses_equal"]
        assert len(run["forward_backward_peak_bytes"]) == 2 and len(run["optimizer_step_peak_bytes"]) == 2
    assert runs["tiered+activations"]["activation_bytes_offloaded"] > 0
    assert runs["tiered+activations"]["activation_bytes_read"] > 0
    assert runs["tiered"]["activation_bytes_offloaded"] == 0
    assert runs["tiered"]["vs_reference"] == 1.0 and report["reference"] == "tiered, activations in memory"
    assert all(r["forward_backward_peak_gib"] > 0 for r in runs.values()) and "machine" in report
    assert "| tiered, activations on nvme |" in capsys.readouterr().out
    assert os.listdir(scratch) == []  # every contender removed its store
