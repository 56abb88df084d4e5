"""benchmarks/memory_contention.py runs end to end on a few MiB and reports every load (no timing
assertions: the figures are the benchmark's business)."""

from __future__ import annotations

import json
import os

import pytest


@pytest.fixture
def memory_contention(benchmark_script):
    return benchmark_script("memory_contention")


def test_contention_reports_every_load_paired_to_alone_and_cleans_up(tmp_path, memory_contention, capsys):
    out = tmp_path / "contention.json"
    assert memory_contention.main(["--dir", str(tmp_path), "--size", str(4 << 20), "--tensor-size", str(2 << 20),
                                   "--block-size", str(1 << 20), "--threads", "2", "--rounds", "2",
                                   "--stream-size", str(8 << 20), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(row["op"], row["load"]) for row in rows} == {
        (op, load) for op in ("write", "read") for load in ("alone", "cpu", "memory", "checksum")}
    for row in rows:
        assert len(row["runs"]) == 2 and row["min"] > 0
        assert (row["paired_to_alone"] is None) == (row["load"] == "alone")
        assert (row["load_gb_per_s"] is not None) == (row["load"] in ("cpu", "memory"))
    assert "| read | memory |" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["contention.json"]


def test_a_subset_of_loads_runs_only_those(tmp_path, memory_contention):
    out = tmp_path / "contention.json"
    assert memory_contention.main(["--dir", str(tmp_path), "--size", str(2 << 20), "--tensor-size", str(1 << 20),
                                   "--block-size", str(1 << 20), "--threads", "1", "--rounds", "1",
                                   "--loads", "alone,checksum", "--json", str(out)]) == 0
    assert {row["load"] for row in json.loads(out.read_text())["rows"]} == {"alone", "checksum"}


@pytest.mark.parametrize("args, message", [
    (["--block-size", "1000"], "multiple of 4096 dividing --tensor-size, got 1000"),
    (["--loads", "alone,disk"], "must include alone, got alone,disk"),
    (["--loads", "cpu"], "must include alone, got cpu"),
    (["--size", "4096"], "holds no whole tensor"),
    (["--stream-size", "4096"], "at least 8 MiB, got 4096"),
    (["--threads", "0"], "must be >= 1, got 5 and 0"),
])
def test_bad_options_are_clear_errors(tmp_path, memory_contention, capsys, args, message):
    with pytest.raises(SystemExit):
        memory_contention.main(["--dir", str(tmp_path), *args])
    assert message in capsys.readouterr().err
