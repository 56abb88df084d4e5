"""`tiered env`: the checks run against a real directory, leave nothing behind, and say what to do."""

from __future__ import annotations

import io
import json
import os

import pytest

from tiered.bench.system import filesystem_of
from tiered.cli import main as tiered_main
from tiered.env_report import collect, main


def by_name(checks):
    return {c.name: c for c in checks}


def test_the_directory_is_probed_with_real_io_and_left_as_it_was(tmp_path):
    (tmp_path / "kept").write_text("x")
    checks = by_name(collect(str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["kept"]  # the probe file is gone
    assert checks["swap-file directory"].found == str(tmp_path)
    assert checks["filesystem"].found == (filesystem_of(str(tmp_path)) or "unknown")
    assert checks["O_DIRECT"].status in ("ok", "note")  # a refusal is a fallback, not a failure
    if checks["O_DIRECT"].status == "ok":
        assert "written, synced and read back" in checks["O_DIRECT"].found
        assert "-byte alignment, so torch's own CPU tensors" in checks["O_DIRECT"].found
    else:
        assert "buffered I/O" in checks["O_DIRECT"].advice
    assert checks["fallocate"].status in ("ok", "note")
    assert all(c.status != "problem" for c in checks.values())
    assert all(c.advice for c in checks.values() if c.status != "ok")  # every note says what to do


def test_a_directory_that_does_not_exist_yet_is_probed_through_its_parent(tmp_path):
    checks = by_name(collect(str(tmp_path / "a" / "b")))
    assert f"probed its parent {tmp_path}" in checks["swap-file directory"].found
    assert not (tmp_path / "a").exists()


@pytest.mark.skipif(filesystem_of("/dev/shm") != "tmpfs", reason="needs /dev/shm on tmpfs")
def test_a_memory_backed_directory_is_called_out():
    fs = by_name(collect("/dev/shm"))["filesystem"]
    assert fs.status == "note" and "take RAM" in fs.advice


def test_the_command_prints_a_table_or_json_and_is_listed(tmp_path, capsys):
    out = io.StringIO()
    assert main(["--dir", str(tmp_path)], out=out) == 0
    assert "O_DIRECT" in out.getvalue() and "transparent huge pages" in out.getvalue()
    out = io.StringIO()
    assert main(["--dir", str(tmp_path), "--json"], out=out) == 0
    rows = json.loads(out.getvalue())
    assert {"name", "found", "status", "advice"} <= set(rows[0]) and any(r["name"] == "cuda" for r in rows)
    assert tiered_main(["--help"]) == 0 and "env" in capsys.readouterr().out
