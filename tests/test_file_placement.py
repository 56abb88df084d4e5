"""benchmarks/file_placement.py runs end to end on a few MiB and reports every file set (no timing
assertions: the figures are the benchmark's business)."""

from __future__ import annotations

import json
import os

import pytest


@pytest.fixture
def file_placement(benchmark_script):
    return benchmark_script("file_placement")


def test_placement_reports_every_set_and_cleans_up(tmp_path, file_placement, capsys):
    out = tmp_path / "placement.json"
    assert file_placement.main(["--dir", str(tmp_path), "--size", str(4 << 20), "--block-size", str(1 << 20),
                                "--files", "1,4", "--copies", "2", "--rounds", "3", "--threads", "4",
                                "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    sets = {(row["op"], row["set"]) for row in report["rows"]}
    assert sets == {(op, f"{n}, set {c}") for op in ("write", "read") for n in ("1 file", "4 files") for c in "AB"}
    assert all(len(row["runs"]) == 3 and row["min"] > 0 for row in report["rows"])
    assert "| write | 4 files, set B |" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["placement.json"]


def test_bad_options_are_clear_errors(tmp_path, file_placement, capsys):
    with pytest.raises(SystemExit):
        file_placement.main(["--dir", str(tmp_path), "--block-size", "1000"])
    assert "multiple of 4096, got 1000" in capsys.readouterr().err
