"""benchmarks/store_settings.py runs end to end on a few MiB and reports every setting (no timing
assertions: the figures are the benchmark's business)."""

from __future__ import annotations

import argparse
import json
import os

import pytest


@pytest.fixture
def store_settings(benchmark_script):
    return benchmark_script("store_settings")


@pytest.mark.parametrize("sequential", [False, True])
def test_settings_alternate_on_one_directory(tmp_path, store_settings, monkeypatch, capsys, sequential):
    monkeypatch.setattr(store_settings, "load_aio", lambda: (None, type("S", (), {"note": "skipped here"})()))
    out = tmp_path / "settings.json"
    assert store_settings.main(["--dir", str(tmp_path), "--size", str(4 << 20), "--tensor-size", str(1 << 20),
                                "--block-size", str(256 << 10), "--rounds", "3", "--settings", "2:4:crc,4:8:nocrc",
                                "--json", str(out)] + (["--sequential"] if sequential else [])) == 0
    report = json.loads(out.read_text())
    assert report["sequential"] is sequential
    names = {(row["op"], row["contender"]) for row in report["rows"]}
    assert names == {(op, n) for op in ("write", "read") for n in ("store, 2 threads, depth 4",
                                                                   "store, 4 threads, depth 8, no crc")}
    assert all(len(row["runs"]) == 3 and row["min"] > 0 for row in report["rows"])
    assert report["reference"] == "store, 2 threads, depth 4"
    assert "comparing the settings with each other only" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["settings.json"]


def test_a_malformed_setting_is_named(store_settings):
    with pytest.raises(argparse.ArgumentTypeError, match="'16:32'"):
        store_settings.Setting.parse("16:32")
