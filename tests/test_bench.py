"""`tiered bench --quick` on a tiny size: the report's structure and that every tensor round-tripped.

No timing assertions: the figures depend on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tiered.bench import fio_best
from tiered.bench.cli import main
from tiered.bench.deepspeed_aio import load_aio
from tiered.bench.fio import fio_status
from tiered.bench.fio_cache import cached_best, disk_key, keep_best
from tiered.bench.options import BenchOptions, quick_overrides
from tiered.bench.phases import Context, run_round_robin
from tiered.bench.results import BenchResult, Figure, Run
from tiered.bench.targets import check_targets
from tiered.bench.tensors import TensorFactory
from tiered.cli import main as tiered_main

TINY = [
    "--quick", "--quiet", "--size", "4MiB", "--tensor-sizes", "1MiB,512KiB", "--small-count", "12",
    "--small-sizes", "4KiB,64KiB", "--concurrency", "4", "--prefetch-count", "3", "--prefetch-size", "256KiB",
    "--compute-ms", "1", "--block-size", "256KiB", "--fio-size", "4MiB",
    "--fio-jobs", "1", "--fio-queue-depths", "64", "--fio-cache", "none",
]


@pytest.fixture
def no_deepspeed(monkeypatch):
    """Make `import deepspeed` fail, as on a machine without the optional extra."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)


def test_quick_run_reports_every_phase_and_round_trips(tmp_path, no_deepspeed, capsys):
    out = tmp_path / "bench.json"
    work = tmp_path / "disk"
    assert main(["--dir", str(work), "--json", str(out), "--device", "cpu", *TINY]) == 0
    report = json.loads(out.read_text())
    table = capsys.readouterr().out

    assert not work.exists()  # the scratch directory is gone, and so is the --dir the run made
    phases = report["phases"]
    for prefix in ("large (", "large, zstd", "small 64KiB", "small mix", "prefetch", "device ("):
        assert any(p.startswith(prefix) for p in phases), (prefix, phases)

    figures = {f["name"]: f for f in report["figures"]}
    for f in figures.values():
        assert len(f["runs"]) == report["options"]["repeats"] == 3, f["name"]
        assert f["min"] <= f["median"] <= f["max"], f["name"]
        assert f["verified"] is not False, f["name"]
        assert f["name"] in table or f["op"] in table
    large = next(p for p in phases if p.startswith("large ("))
    for tool in ("store", "torch.save"):
        read = figures[f"{large} / {tool} read"]
        assert all(r["verified"] is True for r in read["runs"]), tool
    for name, f in figures.items():
        if f["tool"] == "store" and ("read" in f["op"] or "get" in f["op"]):
            assert all(r["verified"] is True for r in f["runs"]), name
    zstd = next(f for f in report["figures"] if f["phase"].startswith("large, zstd") and f["op"] == "write")
    assert all(0 < r["detail"]["stored_ratio"] <= 1 for r in zstd["runs"])

    fio = report["tools"]["fio"]
    if fio["present"]:
        assert f"{large} / fio write" in figures and f"{large} / fio read" in figures
        assert figures[f"{large} / store write"]["ratio_to_fio"] is not None
        # fio's limit is its best setting of a sweep (here 1 MiB blocks at depth 64), not one of ours.
        sweep = report["fio_sweep"]
        assert {(g["block_size"], g["queue_depth"]) for g in sweep["grid"]} == {(1 << 20, 64)}
        for rw in ("write", "read"):
            best = sweep[f"best_{rw}"]
            assert best["median"] == max(g[f"{rw}_bytes_per_s"] for g in sweep["grid"])
            assert all(r["detail"] | best["setting"] == r["detail"] for r in figures[f"{large} / fio {rw}"]["runs"])
    else:
        assert "not installed" in fio["note"] and f"{large} / fio write" not in figures
    ds = report["tools"]["deepspeed"]
    assert ds["skipped"] and "not installed" in ds["note"]
    assert not any(f["tool"].startswith("deepspeed") for f in report["figures"])
    targets = {t["name"]: t for t in report["targets"]}
    # Like for like: aligned tensors vs DeepSpeed's locked ones, plain tensors vs DeepSpeed given plain ones.
    assert targets["store write, aligned tensors vs deepspeed write, one tensor at a time"]["met"] is None
    assert targets["store write, aligned tensors, puts in flight vs deepspeed write"]["met"] is None
    assert targets["store write vs deepspeed (plain tensors) write"]["met"] is None
    assert "store write vs deepspeed write" not in targets
    for op in ("write, aligned tensors", "write, aligned tensors, puts in flight", "read into out=, aligned tensors",
               "read into out=, gets in flight", "read into out=, aligned tensors, gets in flight"):
        assert figures[f"{large} / store {op}"]["verified"] is not False
    # Gets awaited together are held against DeepSpeed's async_pread x N + wait(), like the puts;
    # sequential gets against DeepSpeed reading one tensor at a time.
    assert "store read into out=, aligned tensors, gets in flight vs deepspeed read" in targets
    assert "store read into out=, aligned tensors vs deepspeed read, one tensor at a time" in targets
    assert "store read into out=, aligned tensors vs deepspeed read" not in targets
    # The target is one call per tensor; the batched row (put_many/get_many) is reported beside it.
    small = targets["small 64 KiB put+get, one call per tensor"]
    per_call = max((f for f in report["figures"] if f["phase"] == "small 64KiB" and f["op"].startswith("put+get")),
                   key=lambda f: f["median"])
    assert small["measured"] == per_call["median"] and small["runs"] == 3
    batched = [f for f in report["figures"] if f["phase"] == "small 64KiB" and f["op"].startswith("put_many+get_many")]
    assert len(batched) == 1 and all(r["verified"] is True for r in batched[0]["runs"])
    assert "batched (put_many+get_many" in small["note"]
    # Three runs are reported, never judged: a verdict needs five; and fio's short grid is not the disk's limit.
    assert all(t["met"] is None for t in report["targets"])
    for t in report["targets"]:
        if t["measured"] is not None:
            why = "fio's short grid is not the disk's limit" if " vs fio " in t["name"] else "a verdict needs >= 5 runs"
            assert why in t["note"], t
    if fio["present"]:
        assert report["fio_reference"] == "short grid" and "vs fio*" in table and "NOT the disk's limit" in table
    # The device phase: puts from and gets into the device's memory beside host memory, every get checked.
    device = next(p for p in phases if p.startswith("device ("))
    for op in ("put from cpu", "put from host", "get into cpu", "get into host"):
        assert len(figures[f"{device} / store {op}"]["runs"]) == 3, op
    assert all(r["verified"] is True for r in figures[f"{device} / store get into cpu"]["runs"])
    assert "of host memory's speed" in figures[f"{device} / store get into cpu"]["note"]
    assert any("wrote its files once, untimed" in note for note in report["notes"])


@pytest.mark.parametrize("warm_up", [False, True])
def test_round_robin_warm_up_runs_every_writer_once_untimed_before_the_timed_runs(tmp_path, warm_up):
    options = BenchOptions(directory=str(tmp_path), repeats=3, quiet=True)
    context = Context(options, str(tmp_path), BenchResult(options={}, machine={}), TensorFactory(seed=0))
    calls: list[str] = []

    def step(name: str, value: float):
        def run() -> Run:
            calls.append(name)
            return Run(value, 1.0)
        return run

    writers = {"a:write": ("a", step("a write", 1.0)), "b:write": ("b", step("b write", 2.0))}
    readers = {"a:read": ("a", step("a read", 3.0))}
    run_round_robin(context, "phase", writers, readers, "label", warm_up=warm_up)

    figures = {f.name: f for f in context.result.figures}
    assert [len(figures[n].runs) for n in ("phase / a write", "phase / b write", "phase / a read")] == [3, 3, 3]
    warm = ["a write", "b write"] if warm_up else []
    assert calls[:len(warm)] == warm  # untimed, before anything else: no figure holds their runs
    assert calls.count("a write") == calls.count("b write") == 3 + bool(warm_up)
    assert calls.count("a read") == 3


def test_skip_and_only_select_contenders_and_phases(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--dir", str(tmp_path / "disk"), "--json", str(out), "--skip", "fio,torch,deepspeed", "--only", "large"]
    assert main([*args, *TINY]) == 0
    report = json.loads(out.read_text())
    assert {f["tool"] for f in report["figures"]} == {"store"}
    assert all(p.startswith("large (") for p in report["phases"])
    assert report["tools"]["fio"]["skipped"] and report["tools"]["deepspeed"]["skipped"]


def test_deepspeed_absent_is_a_note_not_an_error(no_deepspeed):
    announced: list[str] = []
    module, status = load_aio(announced.append)
    assert module is None and status.skipped and 'pip install -e ".[bench]"' in status.note
    assert announced == []  # no "building DeepSpeed's op" line for a DeepSpeed that is not there


def test_bad_options_are_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--dir", str(tmp_path), "--repeats", "2"])
    assert exc.value.code == 2
    assert "--repeats must be >= 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--dir", str(tmp_path), "--size", "lots"])
    assert "not a size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--dir", str(tmp_path), "--only", "device"])
    assert "--only device needs --device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["--dir", str(tmp_path), "--device", "cuda"])
        assert "CUDA is not available" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # refused before any work


def test_judged_targets_need_five_runs_and_use_the_median_of_paired_ratios():
    def figure(tool: str, op: str, values: list[float]) -> Figure:
        return Figure("large (1MiB as 1 tensors)", tool, op, "GB/s", runs=[Run(v, 1.0) for v in values])

    def target(store: list[float], fio: list[float]) -> dict:
        result = BenchResult(options={}, machine={}, figures=[figure("store", "write", store),
                                                              figure("fio", "write", fio)])
        return next(t for t in check_targets(result) if t.name == "store write vs fio write")

    # Five repetitions: each ratio within its repetition, the median judged (0.96 >= 0.95), the range kept.
    met = target([1.9, 0.9, 2.0, 1.0, 1.8], [2.0, 1.0, 2.0, 1.0, 1.875])
    assert met.met is True and met.measured == pytest.approx(0.96) and (met.low, met.high) == (0.9, 1.0)
    missed = target([1.8, 0.9, 2.0, 0.9, 1.8], [2.0, 1.0, 2.0, 1.0, 2.0])
    assert missed.met is False and missed.measured == pytest.approx(0.9)
    assert target([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]).met is None  # three runs: reported, not judged


def test_quick_runs_fio_at_the_best_settings_a_full_run_kept_for_this_disk(tmp_path):
    """A full sweep's best settings are kept per disk; --quick then times fio at them, not at its short grid,
    and holds the store against that figure."""
    if not fio_status().present:
        pytest.skip("fio is not installed here")
    disk, cache = tmp_path / "disk", str(tmp_path / "cache" / "fio-best.json")
    disk.mkdir()
    if disk_key(str(disk)) is None:
        pytest.skip("the block device under the test's directory is unknown")
    assert BenchOptions(directory=str(disk)).full_fio_sweep() and not BenchOptions(directory=str(disk), quick=True,
                                                                                    **quick_overrides()).full_fio_sweep()
    assert cached_best(cache, str(disk)) is None
    best = {"setting": {"block_size": 512 << 10, "queue_depth": 8, "jobs": 1}, "median": 1.5e9}
    assert keep_best(cache, str(disk), {"fio": "fio-x", "nbytes": 512 << 20, "grid": [{}] * 32, "best_write": best,
                                        "best_read": best}) is None
    assert cached_best(cache, str(disk))["best_read"] == best and cached_best("none", str(disk)) is None
    out = tmp_path / "bench.json"
    assert main(["--dir", str(disk), "--json", str(out), "--only", "large", "--skip", "torch,deepspeed",
                 *TINY[:-1], cache]) == 0
    report = json.loads(out.read_text())
    assert report["fio_reference"] == "best settings of a kept full sweep" and "grid" not in report["fio_sweep"]
    for rw in ("write", "read"):
        fio = next(f for f in report["figures"] if (f["tool"], f["op"]) == ("fio", rw))
        assert all(r["detail"] | best["setting"] == r["detail"] for r in fio["runs"])
    assert any("best settings of the full sweep of" in n for n in report["notes"])
    fio_targets = [t for t in report["targets"] if " vs fio " in t["name"] and t["measured"] is not None]
    assert fio_targets and all("a verdict needs >= 5 runs" in t["note"] for t in fio_targets)
    with open(cache, "w") as f:
        f.write("{not json")
    assert cached_best(cache, str(disk)) is None  # a damaged cache is an empty one


def test_fio_best_is_the_best_setting_of_its_sweep(tmp_path):
    if not fio_status().present:
        pytest.skip("fio is not installed here")
    read, write, details = fio_best(str(tmp_path / "disk"), nbytes=1 << 20, block_sizes=(1 << 20,),
                                    queue_depths=(64,), jobs=(1, 2), repeats=2)
    grid = {(g["block_size"], g["queue_depth"], g["jobs"]) for g in details["grid"]}
    assert grid == {(1 << 20, 64, 1)}  # with 2 jobs each one's share of the file would hold no whole block
    assert read == details["best_read"]["median"] and write == details["best_write"]["median"]
    for rw in ("read", "write"):
        best = details[f"best_{rw}"]
        assert len(best["bytes_per_s"]) == 2 and best["bytes_per_s"][0] == max(
            g[f"{rw}_bytes_per_s"] for g in details["grid"])
    assert os.listdir(tmp_path / "disk") == []  # its scratch folder is removed
    with pytest.raises(ValueError, match="repeats"):
        fio_best(str(tmp_path), repeats=0)
    with pytest.raises(ValueError, match="fits"):
        fio_best(str(tmp_path), nbytes=4096, block_sizes=(1 << 20,), queue_depths=(1,), jobs=(1,))


def test_entry_points(tmp_path):
    with pytest.raises(SystemExit) as exc:
        tiered_main(["bench", "--help"])
    assert exc.value.code == 0
    assert tiered_main(["frobnicate"]) == 2
    proc = subprocess.run([sys.executable, "-m", "tiered.bench", "--help"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0 and "--sweep" in proc.stdout


def test_sweep_prints_the_best_setting_as_a_config_snippet(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--dir", str(tmp_path / "disk"), "--json", str(out), "--only", "sweep", "--sweep-size", "512KiB",
            "--sweep-block-sizes", "64KiB,256KiB", "--sweep-queue-depths", "4", "--sweep-io-threads", "2"]
    assert main([*args, *TINY]) == 0
    report = json.loads(out.read_text())
    grid = report["sweep"]["grid"]
    assert {(r["block_size"], r["queue_depth"], r["io_threads"]) for r in grid} == {(65536, 4, 2), (262144, 4, 2)}
    assert len(report["figures"]) == 4 and all(len(f["runs"]) == 3 for f in report["figures"])
    snippet = report["sweep"]["snippet"]
    assert "StoreConfig(" in snippet and "queue_depth=4" in snippet
    assert "best setting of the sweep" in capsys.readouterr().out
    namespace: dict = {}
    exec(snippet.replace("path=...", f"path={str(tmp_path / 'x')!r}"), namespace)
    assert namespace["config"].queue_depth == 4


def test_no_checksum_runs_every_store_without_crcs_and_says_so(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--dir", str(tmp_path / "disk"), "--json", str(out), "--only", "sweep", "--sweep-size", "512KiB",
            "--sweep-block-sizes", "64KiB", "--sweep-queue-depths", "4", "--sweep-io-threads", "2", "--no-checksum"]
    assert main([*args, *TINY]) == 0
    report = json.loads(out.read_text())
    assert report["options"]["checksum"] is False
    assert any(note.startswith("checksums: off (--no-checksum)") for note in report["notes"])
    assert "targets (the store without its checksums, --no-checksum):" in capsys.readouterr().out
    namespace: dict = {}
    exec(report["sweep"]["snippet"].replace("path=...", f"path={str(tmp_path / 'x')!r}"), namespace)
    assert namespace["config"].checksum is False  # the snippet is the setting as measured
    options = BenchOptions(directory=str(tmp_path), checksum=False)
    context = Context(options, str(tmp_path), BenchResult(options={}, machine={}), TensorFactory(seed=0))
    assert context.store_config("large").checksum is False
    assert Context(BenchOptions(directory=str(tmp_path)), str(tmp_path), BenchResult(options={}, machine={}),
                   TensorFactory(seed=0)).store_config("large").checksum is True


def test_deepspeed_moves_the_same_tensors_on_the_store_file_and_its_own(tmp_path):
    module, status = load_aio()
    if module is None:
        pytest.skip(f"DeepSpeed's aio op is not available here: {status.note}")
    out = tmp_path / "bench.json"
    assert main(["--dir", str(tmp_path / "disk"), "--json", str(out), "--only", "large", "--skip", "fio,torch",
                 *TINY]) == 0
    report = json.loads(out.read_text())
    figures = {(f["tool"], f["op"]): f for f in report["figures"]}
    for tool in ("deepspeed", "deepspeed (own files)", "deepspeed (plain tensors)"):
        assert all(r["verified"] is True for r in figures[(tool, "read")]["runs"]), tool
        assert len(figures[(tool, "write")]["runs"]) == 3
    assert all(r["verified"] is True for r in figures[("deepspeed", "read, one tensor at a time")]["runs"])
    assert len(figures[("deepspeed", "write, one tensor at a time")]["runs"]) == 3
    # DeepSpeed rewrote the store's ranges between the store's own rounds: the store still reads back its bytes.
    for (tool, op), f in figures.items():
        if tool == "store" and op.startswith("read"):
            assert all(r["verified"] is True for r in f["runs"]), op
    assert any("on the store's swap file" in n for n in report["notes"])
    # The store's aligned rows move the very memory DeepSpeed moves (its locked buffers).
    assert any("DeepSpeed's page-locked buffers" in n for n in report["notes"])
    targets = {t["name"]: t for t in report["targets"]}
    for name in ("store write, aligned tensors vs deepspeed write, one tensor at a time",
                 "store read into out=, aligned tensors vs deepspeed read, one tensor at a time",
                 "store write, aligned tensors, puts in flight vs deepspeed write",
                 "store read into out=, aligned tensors, gets in flight vs deepspeed read"):
        assert targets[name]["measured"] is not None, name
    assert not any("own files" in name for name in targets)  # informative only
