"""benchmarks/page_contiguity.py runs end to end on a few MiB, checks every byte it reads and cleans up
(no timing assertions: the figures are the benchmark's business)."""

from __future__ import annotations

import json
import os

import torch


def test_every_kind_of_buffer_is_read_and_its_pages_counted(tmp_path, benchmark_script, capsys):
    module = benchmark_script("page_contiguity")
    out = tmp_path / "contiguity.json"
    assert module.main(["--dir", str(tmp_path), "--size", str(4 << 20), "--tensor-size", str(1 << 20),
                        "--block-size", str(256 << 10), "--rounds", "2", "--scatter", str(8 << 20),
                        "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["buffer"] for row in report["rows"]] == list(module.KINDS) and report["scatter"] == 8 << 20
    for row in report["rows"]:
        assert len(row["runs"]) == 2 and row["min"] > 0 and len(row["physical_runs"]) == 4
        assert all(r is None or 1 <= r <= 256 for r in row["physical_runs"])  # 1 MiB is 256 pages
    assert "| huge pages |" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["contiguity.json"]  # the scratch store is gone


def test_physical_runs_of_a_populated_buffer(benchmark_script):
    module = benchmark_script("page_contiguity")
    t = torch.ones(1 << 18)  # 1 MiB, touched
    runs = module.physical_runs(t)
    assert runs is None or 1 <= runs <= 257  # None without root (frame numbers hidden)
    if os.geteuid() == 0:
        assert runs is not None
