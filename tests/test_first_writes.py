"""benchmarks/first_writes.py runs end to end on a few MiB and reports its three writes (no timing
assertions: the figures are the benchmark's business)."""

from __future__ import annotations

import json
import os

import pytest


@pytest.fixture
def first_writes(benchmark_script):
    return benchmark_script("first_writes")


def test_first_writes_reports_each_write_paired_to_the_overwrite_and_cleans_up(tmp_path, first_writes, capsys):
    out = tmp_path / "first.json"
    assert first_writes.main(["--dir", str(tmp_path), "--size", str(4 << 20), "--tensor-size", str(2 << 20),
                              "--block-size", str(1 << 20), "--threads", "2", "--rounds", "2",
                              "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {row["write"]: row for row in report["rows"]}
    expected = {"first write", "overwrite"} | ({"after zero range"} if report["note"] is None else set())
    assert set(rows) == expected
    for name, row in rows.items():
        assert len(row["runs"]) == 2 and row["min"] > 0
        assert (row["paired_to_overwrite"] is None) == (name == "overwrite")
    assert "| first write |" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["first.json"]


def test_zero_range_really_marks_written_blocks_unwritten(tmp_path, first_writes):
    """The third row's premise: after zero_range the file reads back as zeroes, keeping its size; where
    the filesystem refuses, it says so and the file is as it was."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\xff" * (1 << 20))
    fd = os.open(path, os.O_RDWR)
    try:
        why_not = first_writes.zero_range(fd, 1 << 20)
        want = bytes(1 << 20) if why_not is None else b"\xff" * (1 << 20)
        assert why_not is None or "FALLOC_FL_ZERO_RANGE is not supported" in why_not
        assert os.pread(fd, 1 << 20, 0) == want
        assert os.fstat(fd).st_size == 1 << 20
    finally:
        os.close(fd)


def test_bad_options_are_clear_errors(tmp_path, first_writes, capsys):
    with pytest.raises(SystemExit):
        first_writes.main(["--dir", str(tmp_path), "--tensor-size", str(3 << 20)])
    assert "dividing --tensor-size" in capsys.readouterr().err
