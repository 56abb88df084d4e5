"""benchmarks/result_memory.py on small sizes: both kinds of result for each tier and size in the
JSON, the bytes checked, the store's threshold put back, the scratch directory removed (no timing
assertions)."""

from __future__ import annotations

import json
import os

import tiered.spans


def test_every_tier_and_size_has_both_kinds_of_result(tmp_path, benchmark_script, capsys):
    module = benchmark_script("result_memory")
    out = tmp_path / "results.json"
    scratch = tmp_path / "scratch"
    default = tiered.spans.DIRECT_RESULT_BYTES
    assert module.main(["--dir", str(scratch), "--sizes", "1,2", "--gets", "2", "--rounds", "2",
                        "--json", str(out)]) == 0
    assert tiered.spans.DIRECT_RESULT_BYTES == default
    rows = json.loads(out.read_text())["rows"]
    assert {(r["tier"], r["size_mib"], r["results"]) for r in rows} == {
        (tier, size, kind) for tier in ("host", "nvme") for size in (1, 2) for kind in (module.POOL, module.HEAP)}
    assert all(len(r["gbps"]) == 2 and min(r["gbps"]) > 0 for r in rows)
    assert "| host | 1 | pooled mapping |" in capsys.readouterr().out
    assert os.listdir(scratch) == []
