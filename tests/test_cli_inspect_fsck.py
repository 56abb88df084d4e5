"""``tiered inspect`` and ``tiered fsck`` on real store directories: clean, corrupted, crashed, in use."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import tiered
from tiered.cli import main as tiered_main
from tiered.offline import StoreDirectory, check_store
from tiered.offline.progress import ByteProgress
from tiered.offline.render import display_width, fit, safe_text
from tiered.manifest.records import COLUMN_NAMES, row_checksum

from conftest import KiB, MiB, random_tensor, same_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A key a terminal must not interpret: an escape sequence, a right-to-left override, a newline.
HOSTILE = "evil\x1b[2J\u202etxt.exe\nkey"
WIDE = "重み/層.0 ключ"


def small_config(path, **kw) -> tiered.StoreConfig:
    return tiered.StoreConfig(path=str(path), host_bytes=2 * MiB, device_bytes=0, block_size=64 * KiB,
                              swap_grow_bytes=1 * MiB, prefault_host=False, io_threads=2, queue_depth=4, **kw)


def write_store(path, tensors: dict, compressed=()) -> None:
    with tiered.TieredStore.open(small_config(path)) as store:
        for key, value in tensors.items():
            store.sync.put(key, value, compress=key in compressed)


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = tiered_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(path) -> dict:
    """Every file under ``path`` with its size, mtime and content hash."""
    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        with open(full, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        st = os.stat(full)
        files[name] = (st.st_size, st.st_mtime_ns, st.st_mode, digest)
    return files


def file_position(path, key: str, logical: int) -> tuple[str, int]:
    """Swap file and offset holding byte ``logical`` of ``key``'s stored bytes."""
    with StoreDirectory.open(path) as d:
        record = next(r.record for r in d.rows if r.record.key == key)
        for e in record.extents:
            if logical < e.length:
                return d.swap_files[e.file].path, e.offset + logical
            logical -= e.length
    raise AssertionError("offset beyond the record")


def first_gap(path, nbytes: int) -> tuple[str, int]:
    """A swap file and the offset of the first ``nbytes`` between its records' extents."""
    with StoreDirectory.open(str(path)) as d:
        for f in d.swap_files:
            used = sorted((e.offset, e.offset + e.length) for r in d.rows for e in r.record.extents if e.file == f.index)
            for (_, prev_end), (start, _) in zip([(0, 0)] + used, used):
                if start - prev_end >= nbytes:
                    return f.path, prev_end
    raise AssertionError("no gap between extents")


def flip_byte(file: str, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


TENSORS = {
    "layer.0.weight": random_tensor((256, 300), torch.float32, seed=1),  # 300 KiB: 5 chunks of 64 KiB
    "zeros": torch.zeros(100_000),  # compresses
    HOSTILE: torch.arange(10, dtype=torch.int64),
    WIDE: random_tensor((3, 5), torch.bfloat16, seed=2),
    "empty": torch.empty(0, 4),
}


def test_clean_store_table_json_and_nothing_modified(tmp_path, capsys):
    path = tmp_path / "store"
    write_store(path, TENSORS, compressed={"zeros"})
    before = snapshot(path)

    code, out, _ = cli(capsys, "inspect", path)
    assert code == 0
    assert "\x1b" not in out and "\u202e" not in out, "control characters of keys must never reach the terminal"
    assert safe_text(HOSTILE) in out and WIDE in out and "layer.0.weight" in out
    header = next(line for line in out.splitlines() if line.startswith("key"))
    assert header.split() == ["key", "dtype", "shape", "bytes", "stored", "codec", "tiers", "generation"]
    zeros_row = next(line for line in out.splitlines() if line.startswith("zeros"))
    assert "bplane-zstd" in zeros_row and "nvme" in zeros_row
    # Columns line up in terminal cells even with double-width characters in a key.
    rows = [line for line in out.splitlines() if "nvme" in line]
    assert len({display_width(line[: line.index("nvme")]) for line in rows}) == 1
    assert "5 entries" in out and "0 B orphaned" in out

    code, out, _ = cli(capsys, "inspect", path, "--json")
    assert code == 0
    report = json.loads(out)
    entries = {e["key"]: e for e in report["entries"]}
    assert set(entries) == set(TENSORS)
    for key, value in TENSORS.items():
        e = entries[key]
        assert e["dtype"] == str(value.dtype).removeprefix("torch.")
        assert e["shape"] == list(value.shape)
        assert e["nbytes"] == value.numel() * value.element_size()
        assert e["tiers"] == ["nvme"]
    assert entries["zeros"]["codec"] == "bplane-zstd" and entries["zeros"]["ratio"] > 10
    assert entries["layer.0.weight"]["codec"] == "raw" and entries["layer.0.weight"]["ratio"] == 1.0
    assert sorted(e["generation"] for e in entries.values()) == list(range(len(TENSORS)))
    summary = report["summary"]
    assert summary["entries"] == len(TENSORS)
    assert summary["logical_bytes"] == sum(e["nbytes"] for e in entries.values())
    assert summary["stored_bytes"] == sum(e["stored_nbytes"] for e in entries.values()) < summary["logical_bytes"]
    assert summary["allocated_bytes"] == sum(-(-e["stored_nbytes"] // 4096) * 4096 for e in entries.values())
    assert summary["orphaned_bytes"] == 0
    assert summary["allocated_bytes"] + summary["free_bytes"] == summary["swap_bytes"]
    assert len(summary["swap_files"]) == 2

    code, out, _ = cli(capsys, "fsck", path)
    assert code == 0 and out.splitlines()[-1] == "clean"
    assert "5 entries, 5 verified by checksum (300.2 KiB read)" in out
    assert snapshot(path) == before, "inspect and fsck without options must not modify the store"


def test_flipped_byte_is_named_then_deleted_and_reclaimed(tmp_path, capsys):
    path = tmp_path / "store"
    victim = "ключ/victim\n\x1b[0m"
    data = random_tensor((300 * KiB // 4,), torch.float32, seed=3)
    bystander = random_tensor((20_000,), torch.float16, seed=4)
    write_store(path, {victim: data, "bystander": bystander, "gone": torch.ones(50_000)})
    gone_file, gone_offset = file_position(path, "gone", 0)
    with tiered.TieredStore.open(small_config(path)) as store:
        store.sync.delete("gone")
    # A clean close dropped its bytes; put them back, as a store killed before closing would have left them.
    with open(gone_file, "r+b") as f:
        f.seek(gone_offset)
        f.write(b"\x01" * 196 * KiB)  # its 196 KiB are orphaned now
    flip_byte(*file_position(path, victim, 2 * 64 * KiB + 1234))  # the third of five chunks

    code, out, _ = cli(capsys, "fsck", path)
    assert code == 1
    assert f"DAMAGED '{safe_text(victim)}'" in out and "checksum mismatch in 1 of 5 chunks" in out
    assert "\x1b" not in out
    assert "bystander" not in out
    assert "orphaned: 196.0 KiB in 1 range" in out

    # Reclaiming leaves a damaged record's extents alone: only the deleted key's space goes.
    code, out, _ = cli(capsys, "fsck", path, "--reclaim")
    assert code == 1 and "reclaimed 196.0 KiB" in out
    code, out, _ = cli(capsys, "fsck", path, "--json")
    report = json.loads(out)
    assert code == 1 and [d["key"] for d in report["damaged"]] == [victim] and report["orphaned_bytes"] == 0
    assert report["damaged"][0]["reasons"][0].startswith("checksum mismatch in 1 of 5 chunks")

    with tiered.TieredStore.open(small_config(path)) as store:  # the oracle agrees: the store refuses the bytes
        with pytest.raises(tiered.ChecksumError):
            store.sync.get(victim)

    code, out, _ = cli(capsys, "fsck", path, "--delete-damaged", "--reclaim")
    assert code == 1, "damage was found (and removed): the run reports it"
    assert f"deleted 1 damaged record: '{safe_text(victim)}'" in out and "reclaimed 300.0 KiB" in out
    code, out, _ = cli(capsys, "fsck", path)
    assert code == 0, out
    with tiered.TieredStore.open(small_config(path)) as store:
        assert store.keys() == ["bystander"]
        assert same_bytes(store.sync.get("bystander"), bystander)


def test_a_directory_of_stores_is_inspected_and_checked_store_by_store(tmp_path, capsys):
    """An engine run under torchrun keeps one store per rank (rank0, rank1, ... under its path):
    pointed at that path, inspect and fsck go through each, in rank order, and fsck's status is the
    worst of theirs."""
    run = tmp_path / "run"
    for rank in (10, 0, 1):
        write_store(run / f"rank{rank}", {f"w{rank}": random_tensor((40_000,), torch.float32, seed=rank)})
    flip_byte(*file_position(run / "rank1", "w1", 1000))

    code, out, _ = cli(capsys, "inspect", run, "--summary")
    assert code == 0
    headers = [line.split(" (")[0] for line in out.splitlines() if line.startswith("store ")]
    assert headers == [f"store {run / f'rank{r}'}" for r in (0, 1, 10)]
    code, out, _ = cli(capsys, "inspect", run, "--json")
    assert [s["path"] for s in json.loads(out)["stores"]] == [str(run / f"rank{r}") for r in (0, 1, 10)]

    code, out, _ = cli(capsys, "fsck", run)
    assert code == 1  # rank1's damage
    checked = [line.split(":")[0] for line in out.splitlines() if line.startswith("fsck ")]
    assert checked == [f"fsck {run / f'rank{r}'}" for r in (0, 1, 10)]
    assert out.count("DAMAGED 'w1'") == 1 and "DAMAGED 'w0'" not in out
    code, out, _ = cli(capsys, "fsck", run / "rank0", "--json")  # one store: its report, as before
    assert code == 0 and json.loads(out)["path"] == str(run / "rank0")


CRASHING_WRITER = """
    import sys, time, torch, tiered
    from tiered.manifest import database
    path, marker = sys.argv[1], sys.argv[2]
    cfg = tiered.StoreConfig(path=path, host_bytes=2 << 20, device_bytes=0, block_size=64 << 10,
                             swap_grow_bytes=1 << 20, prefault_host=False, io_threads=2, queue_depth=4)
    store = tiered.TieredStore.open(cfg)
    for i in range(3):
        store.sync.put(f"kept{i}", torch.full((40_000,), float(i)))

    def stall(self, upserts, deletes=()):
        # The worst moment to die: the put's bytes are written and fdatasync'd, its record not committed.
        open(marker, "w").close()
        time.sleep(600)

    database.Manifest.commit = stall
    store.sync.put("lost", torch.full((600_000,), 7.0))
"""


def test_a_clean_close_leaves_free_space_not_orphaned_space(tmp_path, capsys):
    """Versions replaced or deleted while the store ran leave no stale bytes after a clean close, and the
    swap files end at their last record; space that was free at open and untouched since (what a crash
    may have left) stays as it was, for fsck to report."""
    path = tmp_path / "store"
    values = {f"k{i}": random_tensor((40_000 + 1000 * i,), torch.float32, seed=i) for i in range(6)}
    write_store(path, values)
    with tiered.TieredStore.open(small_config(path)) as store:
        for i in (1, 3):
            values[f"k{i}"] = random_tensor((45_000,), torch.float32, seed=10 + i)
            store.sync.put(f"k{i}", values[f"k{i}"])
        store.sync.delete("k5")
        del values["k5"]
    code, out, _ = cli(capsys, "inspect", path, "--json")
    summary = json.loads(out)["summary"]
    assert code == 0 and summary["orphaned_bytes"] == 0 and summary["free_bytes"] > 0, summary
    with StoreDirectory.open(str(path)) as d:
        for f in d.swap_files:
            ends = [e.offset + e.length for r in d.rows for e in r.record.extents if e.file == f.index]
            assert f.size == max(ends, default=0), (f.path, f.size)
    code, out, _ = cli(capsys, "fsck", path)
    assert code == 0 and out.splitlines()[-1] == "clean"

    hole_file, gap = first_gap(path, 4096)
    with open(hole_file, "r+b") as f:  # as a killed store leaves bytes no record names
        f.seek(gap)
        f.write(b"\x07" * 4096)
    with tiered.TieredStore.open(small_config(path)) as store:  # reads only: allocates nothing
        for key, value in values.items():
            assert same_bytes(store.sync.get(key), value)
    code, out, _ = cli(capsys, "inspect", path, "--json")
    assert json.loads(out)["summary"]["orphaned_bytes"] == 4096


def test_orphans_from_a_killed_writer_are_reported_and_reclaimed(tmp_path, capsys):
    path, marker = tmp_path / "store", tmp_path / "stalled"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CRASHING_WRITER), str(path), str(marker)],
                             env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the writer never reached its commit"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
        child.stderr.close()
    lost_bytes = 600_000 * 4

    code, out, _ = cli(capsys, "inspect", path, "--json")
    summary = json.loads(out)["summary"]
    assert code == 0 and summary["entries"] == 3
    assert summary["orphaned_bytes"] >= lost_bytes

    code, out, _ = cli(capsys, "fsck", path, "--json")
    report = json.loads(out)
    assert code == 0 and not report["damaged"] and report["orphaned_bytes"] == summary["orphaned_bytes"]
    assert not report["clean"] and report["healthy"]

    disk_before = summary["disk_bytes"]
    code, out, _ = cli(capsys, "fsck", path, "--reclaim")
    assert code == 0 and "reclaimed" in out and out.splitlines()[-1] == "clean"
    code, out, _ = cli(capsys, "fsck", path)
    assert code == 0 and out.splitlines()[-1] == "clean"
    code, out, _ = cli(capsys, "inspect", path, "--json")
    summary = json.loads(out)["summary"]
    assert summary["orphaned_bytes"] == 0 and summary["disk_bytes"] <= disk_before - lost_bytes

    # The store still returns everything committed, and reuses the space it was given back.
    with tiered.TieredStore.open(small_config(path)) as store:
        assert sorted(store.keys()) == ["kept0", "kept1", "kept2"]
        for i in range(3):
            assert torch.equal(store.sync.get(f"kept{i}"), torch.full((40_000,), float(i)))
        fresh = random_tensor((500_000,), torch.float32, seed=5)
        store.sync.put("fresh", fresh)
        assert same_bytes(store.sync.get("fresh"), fresh)
    with tiered.TieredStore.open(small_config(path)) as store:
        assert same_bytes(store.sync.get("fresh"), fresh)
    code, _, _ = cli(capsys, "fsck", path)
    assert code == 0


def test_manifest_damage_overlaps_eof_codec_and_dtype(tmp_path, capsys):
    path = tmp_path / "store"
    keys = ["a-codec", "b-overlapped", "c-newer", "d-past-eof", "e-dtype", "f-fine"]
    values = {k: random_tensor((5_000,), torch.float32, seed=i) for i, k in enumerate(keys)}
    write_store(path, values)
    db = sqlite3.connect(path / "manifest.sqlite")
    with db:
        db.execute("UPDATE entries SET codec = 'lz77' WHERE key = 'a-codec'")
        c_extents = db.execute("SELECT extents FROM entries WHERE key = 'c-newer'").fetchone()[0]
        db.execute("UPDATE entries SET extents = ? WHERE key = 'b-overlapped'", (c_extents,))
        db.execute("UPDATE entries SET extents = ? WHERE key = 'd-past-eof'",
                   (extent_blob(file=0, offset=64 * MiB, length=20 * KiB),))
        db.execute("UPDATE entries SET dtype = 'float99' WHERE key = 'e-dtype'")
    resign(db)  # as a newer (or faulty) writer would have written them: intact records, fields it cannot use
    db.close()
    with pytest.raises(tiered.ManifestError):
        tiered.TieredStore.open(small_config(path))

    code, out, _ = cli(capsys, "fsck", path, "--json")
    assert code == 1
    damaged = {d["key"]: " | ".join(d["reasons"]) for d in json.loads(out)["damaged"]}
    assert set(damaged) == {"a-codec", "b-overlapped", "d-past-eof", "e-dtype"}
    assert "unknown codec 'lz77'" in damaged["a-codec"]
    assert "overlap those of 'c-newer'" in damaged["b-overlapped"]
    assert "checksum mismatch" in damaged["b-overlapped"]
    assert "past the end" in damaged["d-past-eof"]
    assert "unknown dtype 'float99'" in damaged["e-dtype"]

    code, _, _ = cli(capsys, "fsck", path, "--delete-damaged", "--reclaim")
    assert code == 1
    with tiered.TieredStore.open(small_config(path)) as store:
        assert sorted(store.keys()) == ["c-newer", "f-fine"]
        for key in store.keys():
            assert same_bytes(store.sync.get(key), values[key])
    assert cli(capsys, "fsck", path)[0] == 0


def resign(db: sqlite3.Connection) -> None:
    """Give every row of the manifest a record checksum that matches its fields as they are now."""
    columns = ", ".join(COLUMN_NAMES[:-1])
    with db:
        for rowid, *values in db.execute(f"SELECT rowid, {columns} FROM entries").fetchall():
            db.execute("UPDATE entries SET checksum = ? WHERE rowid = ?", (row_checksum(values), rowid))


def test_reclaim_refuses_while_a_record_s_extents_are_unreadable(tmp_path, capsys):
    path = tmp_path / "store"
    write_store(path, {"torn": torch.full((30_000,), 3.0), "fine": torch.full((1000,), 1.0)})
    with tiered.TieredStore.open(small_config(path)) as store:
        store.sync.put("fine", torch.full((1000,), 2.0))  # the first version's space is orphaned
    torn_file, torn_offset = file_position(path, "torn", 0)
    db = sqlite3.connect(path / "manifest.sqlite")
    with db:
        db.execute("UPDATE entries SET extents = x'0102030405' WHERE key = 'torn'")
    db.close()
    code, out, _ = cli(capsys, "fsck", path)
    assert code == 1 and "DAMAGED 'torn'" in out and "not a whole number of (file, offset, length)" in out
    code, _, err = cli(capsys, "fsck", path, "--reclaim")
    assert code == 1 and "cannot reclaim space" in err
    with open(torn_file, "rb") as f:
        f.seek(torn_offset)
        assert torch.equal(torch.frombuffer(bytearray(f.read(120_000)), dtype=torch.float32),
                           torch.full((30_000,), 3.0)), "nothing may be punched while a record's extents are unknown"
    assert cli(capsys, "fsck", path, "--delete-damaged", "--reclaim")[0] == 1
    assert cli(capsys, "fsck", path)[0] == 0
    with tiered.TieredStore.open(small_config(path)) as store:
        assert store.keys() == ["fine"] and torch.equal(store.sync.get("fine"), torch.full((1000,), 2.0))


def extent_blob(*, file: int, offset: int, length: int) -> bytes:
    import array

    return array.array("q", [file, offset, length]).tobytes()


def test_store_in_use_is_respected(tmp_path, capsys):
    path = tmp_path / "store"
    with tiered.TieredStore.open(small_config(path)) as store:
        store.sync.put("committed", torch.ones(1000))
        code, out, err = cli(capsys, "fsck", path)
        assert code == 2 and f"pid {os.getpid()}" in err and "in use" in err
        code, out, err = cli(capsys, "fsck", path, "--reclaim")
        assert code == 2
        code, out, err = cli(capsys, "inspect", path)
        assert code == 0 and "committed" in out and f"open in process {os.getpid()}" in err
        code, out, err = cli(capsys, "inspect", path, "--json")
        report = json.loads(out)
        assert report["in_use_by"] == str(os.getpid()) and report["summary"]["orphaned_bytes"] is None
        store.sync.put("after", torch.zeros(10))  # inspect left the running store alone
    code, out, _ = cli(capsys, "fsck", path)
    assert code == 0


def test_unverified_entries_of_a_store_without_checksums(tmp_path, capsys):
    path = tmp_path / "store"
    with tiered.TieredStore.open(small_config(path, checksum=False)) as store:
        store.sync.put("x", torch.ones(1000))
    code, out, _ = cli(capsys, "fsck", path)
    assert code == 0 and "1 entry has no checksums" in out


def test_usage_errors(tmp_path, capsys):
    assert cli(capsys, "fsck")[0] == 2
    assert cli(capsys, "inspect")[0] == 2
    code, _, err = cli(capsys, "fsck", tmp_path / "nowhere")
    assert code == 2 and "is not a directory" in err
    code, _, err = cli(capsys, "inspect", tmp_path)
    assert code == 2 and "not a tiered store directory" in err
    assert cli(capsys, "fsck", tmp_path, "--threads", "0")[0] == 2
    code, out, _ = cli(capsys, "--help")
    assert code == 0 and "inspect DIR" in out and "fsck DIR" in out and "bench" in out
    assert cli(capsys, "fsck", "--help")[0] == 0


def test_console_entry_on_an_ascii_terminal(tmp_path):
    path = tmp_path / "store"
    write_store(path, {WIDE: torch.arange(3), "x" * 80: torch.arange(2)})
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    proc = subprocess.run([sys.executable, "-m", "tiered.cli", "inspect", str(path)], cwd=ROOT, env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode("ascii")  # every byte is ASCII: what the terminal cannot show is escaped
    assert safe_text(WIDE, "ascii") in out and "\\u91cd" in out
    assert "x" * 45 + "..." in out and "x" * 49 not in out  # long keys are cut to the key column


def test_progress_counts_every_verified_byte(tmp_path):
    path = tmp_path / "store"
    write_store(path, {"a": random_tensor((100_000,), torch.uint8), "b": torch.ones(70_000)})

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    bars = []

    def progress(total: int) -> ByteProgress:
        bars.append(ByteProgress("verifying", total, stream=screen))
        return bars[-1]

    with StoreDirectory.open(path) as directory:
        report = check_store(directory, threads=3, progress=progress)
    assert report.clean and len(bars) == 1
    assert bars[0].total == bars[0].done == report.verified_bytes == 100_000 + 280_000
    assert "verifying [" in screen.getvalue()


def test_safe_text_and_fit():
    assert safe_text("a\\b") == "a\\\\b"
    assert safe_text(HOSTILE) == "evil\\x1b[2J\\u202etxt.exe\\nkey"
    assert safe_text("\udcff") == "\\udcff"
    assert safe_text("\u0301x") == "\\u0301x"  # a leading combining mark would join the previous column
    assert safe_text("naïve 重", "ascii") == "na\\xefve \\u91cd"
    assert safe_text(WIDE) == WIDE
    assert display_width("重み") == 4 and display_width("é") == 1
    assert fit("重み重み", 5) == "重み…" and display_width(fit("重み重み", 5)) == 5
