"""benchmarks/small_op_cpu.py runs end to end on a few tensors and attributes CPU to the store's
threads (no timing assertions: the figures are the benchmark's business)."""

from __future__ import annotations

import gc
import json
import os

import pytest


@pytest.fixture
def small_op_cpu(benchmark_script):
    return benchmark_script("small_op_cpu")


def test_both_phases_report_cpu_by_thread_group(tmp_path, small_op_cpu, capsys):
    out = tmp_path / "cpu.json"
    assert small_op_cpu.main(["--dir", str(tmp_path), "--count", "40", "--concurrency", "8", "--rounds", "2",
                              "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["phase"] for row in report["rows"]] == ["put", "get"]
    assert len(report["rounds"]) == 2 and all(row["ops_per_s"] > 0 for row in report["rows"])
    groups = {g for rnd in report["rounds"] for phase in rnd.values() for g in phase["cpu_seconds"]}
    assert {"MainThread", "tiered-store", "tiered-io", "tiered-manifest"} <= groups
    assert all(0 <= row["gc_share"] < 1 for row in report["rows"])
    assert "| put |" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["cpu.json"]  # the scratch store is gone


def test_gc_freeze_is_undone_when_the_run_ends(tmp_path, small_op_cpu, capsys):
    before = gc.get_freeze_count()
    assert small_op_cpu.main(["--dir", str(tmp_path), "--count", "20", "--concurrency", "4", "--rounds", "1",
                              "--gc-freeze"]) == 0
    if before:  # a freeze made before the run (by another test or a plugin) stays, and the run's own with it
        assert gc.get_freeze_count() > before
    else:
        assert gc.get_freeze_count() == 0
    assert "gc.freeze() after setup" in capsys.readouterr().out


def test_gc_pauses_are_counted_by_generation(small_op_cpu):
    with small_op_cpu.GcPauses() as pauses:
        gc.collect()
    assert pauses.runs[2] == 1 and pauses.seconds[2] > 0
    gc.collect()
    assert pauses.runs[2] == 1  # no longer listening once left


@pytest.mark.parametrize("name, value", [("MainThread", "MainThread"), ("tiered-io_12", "tiered-io"),
                                         ("tiered-store:/nvme/run", "tiered-store"),
                                         ("tiered-manifest", "tiered-manifest")])
def test_thread_names_group_without_index_or_directory(small_op_cpu, name, value):
    assert small_op_cpu.thread_group(name) == value


def test_a_tensor_size_that_is_not_whole_floats_is_refused(tmp_path, small_op_cpu):
    with pytest.raises(SystemExit):
        small_op_cpu.main(["--dir", str(tmp_path), "--tensor-size", "1001"])
