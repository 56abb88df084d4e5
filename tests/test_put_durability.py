"""benchmarks/put_durability.py runs end to end on a few MiB and reports every variant (no timing
assertions: the figures are the benchmark's business)."""

from __future__ import annotations

import json
import os

import pytest


@pytest.fixture
def put_durability(benchmark_script):
    return benchmark_script("put_durability")


def test_every_variant_runs_every_round_in_one_directory(tmp_path, put_durability, capsys):
    out = tmp_path / "durability.json"
    assert put_durability.main(["--dir", str(tmp_path), "--size", str(4 << 20), "--tensor-size", str(1 << 20),
                                "--block-size", str(256 << 10), "--rounds", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["variant"] for row in report["rows"]] == list(put_durability.VARIANTS)
    assert all(len(row["runs"]) == 3 and row["min"] > 0 for row in report["rows"])
    assert report["rows"][0]["paired_to_durable"] == 1.0
    assert "| data flushed only |" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["durability.json"]  # the scratch store is gone


def test_a_tensor_size_off_the_page_is_refused(tmp_path, put_durability):
    with pytest.raises(SystemExit):
        put_durability.main(["--dir", str(tmp_path), "--tensor-size", "1000"])
