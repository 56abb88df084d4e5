"""benchmarks/checkpoint_bench.py runs every contender on a small model, finds every tensor read back
equal and writes its JSON (no timing assertions), making the directories it is given."""

from __future__ import annotations

import json
import os


def test_every_contender_runs_and_round_trips(tmp_path, benchmark_script, capsys):
    module = benchmark_script("checkpoint_bench")
    out = tmp_path / "results" / "checkpoint.json"  # neither directory exists yet: the script makes them
    scratch = tmp_path / "disk" / "scratch"
    assert module.main(["--dir", str(scratch), "--layers", "2", "--width", "512", "--rounds", "2",
                        "--fio-size", str(1 << 20), "--fio-quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["verified"] is True and report["bytes"] == 2 * 512 * 512 * 4
    rows = {r["contender"]: r for r in report["rows"]}
    assert set(module.CONTENDERS) <= set(rows)
    assert all(len(r["runs"]) == 2 and r["median"] > 0 for r in rows.values())
    if report["fio_sweep"] is not None:  # fio at its best setting of each direction, swept on this disk
        assert {"fio write", "fio read"} <= set(rows) and report["fio_sweep"]["best_read"]["median"] > 0
    assert "| tiered save_checkpoint |" in capsys.readouterr().out
    assert os.listdir(scratch) == []  # the store, checkpoint, exports and torch file are removed
