"""benchmarks/disk_alternation.py runs end to end on a few MiB and reports every contender (no
timing assertions: the figures are the benchmark's business)."""

from __future__ import annotations

import json
import os
import sys

import pytest


@pytest.fixture
def disk_alternation(benchmark_script):
    return benchmark_script("disk_alternation")


def test_alternation_reports_every_contender(tmp_path, disk_alternation, monkeypatch, capsys):
    monkeypatch.setattr(disk_alternation, "load_aio", lambda: (None, type("S", (), {"note": "skipped here"})()))
    out = tmp_path / "alt.json"
    assert disk_alternation.main([
        "--dir", str(tmp_path), "--size", str(4 << 20), "--tensor-size", str(2 << 20), "--block-size", str(1 << 20),
        "--rounds", "3", "--threads", "4", "--queue-depth", "8", "--faulted", "--reused", "--crc", "--json", str(out),
    ]) == 0
    report = json.loads(out.read_text())
    names = {(row["op"], row["contender"]) for row in report["rows"]}
    for op in ("write", "read"):
        for name in ("store, sequential puts" if op == "write" else "store, sequential gets", "python threads",
                     "python threads, memory faulted by a copy", "python threads + CRC-32"):
            assert (op, name) in names, names
    assert ("write", "python threads, one reused buffer") in names
    assert all(len(row["runs"]) == 3 and row["min"] > 0 for row in report["rows"])
    assert "| write | store, puts in flight |" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["alt.json"]  # the scratch directory is gone
    assert sys.modules["disk_alternation"] is disk_alternation
