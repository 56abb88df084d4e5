"""Integrity: a store owns its directories, checks its own manifest records, moves with its files,
follows no link, and a call that raises changes nothing.

- Ownership: a swap directory (or store path) in use by one store is refused to another, whatever
  path names it (the same path, a symlink, a bind mount, a symlinked parent); one directory named
  twice in ``nvme_paths`` is refused; deleting ``LOCK`` lets no second process in.
- Record checksums: 200 random single-bit flips of a closed store's manifest (fixed seed), each
  opened by a store and checked by fsck: never wrong data, never a key that was not put, and every
  record the store refuses is named by fsck.
- Relocation: a store copied (or moved) with its swap files opens and is checked at its new place
  with the original deleted; fsck never checks another directory's files, and ``--delete-damaged``
  removes only records whose own bytes failed; swap files of another store, or directories given
  in another order, are refused by name.
- Links and foreign files: a symlink planted for any file of a store is refused by name, and its
  target is left alone; so is a hard link, and a directory or file of another user.
- Failed calls: a put that fails on a real full filesystem (a loop-mounted ext4 image) leaves the
  old value, before and after reopen; a close on a full disk writes what fits, says how many bytes
  it could not write, and leaves no task or thread behind.
- Typed errors for a missing swap file, an unknown codec, a meta or absent CUDA device, a key that
  is not a string; and a store of the earlier manifest format is upgraded in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
import warnings

import pytest
import torch

import tiered
from tiered import CapacityError, ManifestError, StoreLockedError, TieredStore
from tiered.cli import main as tiered_cli
from tiered.offline import StoreDirectory, check_store
from tiered.manifest.records import COLUMN_NAMES, row_checksum

from conftest import KiB, MiB, random_tensor, same_bytes
from small_filesystems import fill, mounted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(180)


def small_config(path, **changes) -> tiered.StoreConfig:
    settings = dict(path=str(path), device_bytes=0, host_bytes=256 * KiB, block_size=16 * KiB, queue_depth=2,
                    io_threads=2, cpu_threads=1, staging_buffers=1, swap_grow_bytes=64 * KiB, prefault_host=False,
                    result_pool_bytes=0)
    settings.update(changes)
    return tiered.StoreConfig(**settings)


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = tiered_cli([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def store_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("tiered")}


# ----------------------------------------------------------------------------------- ownership


@contextlib.contextmanager
def second_path(kind: str, directory: str, tmp_path):
    """Another path to ``directory``: itself, a symlink to it, a bind mount of it, or it under a symlinked parent."""
    if kind == "same path":
        yield directory
    elif kind == "symlink":
        link = str(tmp_path / "link")
        os.symlink(directory, link)
        yield link
    elif kind == "symlinked parent":
        parent = str(tmp_path / "parent-link")
        os.symlink(os.path.dirname(directory), parent)
        yield os.path.join(parent, os.path.basename(directory))
    else:
        where = str(tmp_path / "bind")
        os.mkdir(where)
        proc = subprocess.run(["mount", "--bind", directory, where], capture_output=True, timeout=60)
        if proc.returncode != 0:
            pytest.skip(f"cannot bind-mount here: {proc.stderr.decode(errors='replace').strip()}")
        try:
            yield where
        finally:
            subprocess.run(["umount", "-l", where], capture_output=True, timeout=60)


@pytest.mark.parametrize("kind", ["same path", "symlink", "bind mount", "symlinked parent"])
def test_two_stores_never_share_a_swap_directory(tmp_path, kind):
    scratch = str(tmp_path / "scratch")
    a = small_config(tmp_path / "runA", nvme_paths=[scratch])
    with TieredStore.open(a) as store:
        store.sync.put("k", torch.arange(10.0))
        with second_path(kind, scratch, tmp_path) as other:
            owner = rf"in use by pid {os.getpid()} \(store {re.escape(a.path)}\)"
            with pytest.raises(StoreLockedError, match=rf"{re.escape(other)} \(StoreConfig.nvme_paths\[0\]\).*{owner}"):
                TieredStore.open(small_config(tmp_path / "runB", nvme_paths=[other]))
            with pytest.raises(StoreLockedError, match=owner):  # a store path is owned the same way
                TieredStore.open(small_config(other))
        store.sync.put("k2", torch.ones(3))
        assert torch.equal(store.sync.get("k"), torch.arange(10.0))
    assert not os.path.exists(tmp_path / "runB" / "manifest.sqlite")


def test_one_directory_named_twice_in_nvme_paths_is_refused(tmp_path):
    real = tmp_path / "n0"
    real.mkdir()
    os.symlink(real, tmp_path / "n0-link")
    paths = [str(real), str(tmp_path / "n0-link")]
    with pytest.raises(ValueError, match="names one directory twice.*n0-link"):
        TieredStore.open(small_config(tmp_path / "s", nvme_paths=paths))
    with TieredStore.open(small_config(tmp_path / "s", nvme_paths=paths[:1])) as store:  # nothing stayed locked
        store.sync.put("k", torch.ones(2))


CONTENDER = """
    import sys, tiered
    path, nvme = sys.argv[1], sys.argv[2]
    try:
        tiered.TieredStore.open(tiered.StoreConfig(path=path, nvme_paths=[nvme], host_bytes=1 << 20,
                                                   prefault_host=False)).sync.close()
        print("opened")
    except tiered.StoreLockedError as exc:
        print("locked:", exc)
"""


def test_a_deleted_lock_file_lets_no_second_process_in(tmp_path):
    cfg = small_config(tmp_path / "s", nvme_paths=[str(tmp_path / "n0")])
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with TieredStore.open(cfg) as store:
        for directory in (cfg.path, *cfg.nvme_paths):
            os.unlink(os.path.join(directory, "LOCK"))
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CONTENDER), cfg.path, cfg.nvme_paths[0]],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.stdout.startswith("locked:"), proc.stdout + proc.stderr
        assert "already open" in proc.stdout
        store.sync.put("k", torch.ones(3))  # the first store never noticed
    with TieredStore.open(cfg) as store:  # the lock went with the descriptors
        assert torch.equal(store.sync.get("k"), torch.ones(3))


# ----------------------------------------------------------------------------------- record checksums


def manifest_view(path: str) -> tuple:
    """What a store reads from the manifest at ``path`` (schema, meta and entry rows), or the error SQLite gives."""
    try:
        db = sqlite3.connect(f"file:{urllib.parse.quote(path)}?immutable=1", uri=True)
        db.text_factory = bytes
        try:
            return (db.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall(),
                    db.execute("SELECT name, value FROM meta ORDER BY name").fetchall(),
                    db.execute("SELECT rowid, * FROM entries ORDER BY rowid").fetchall(),
                    db.execute("PRAGMA integrity_check").fetchall())
        finally:
            db.close()
    except (sqlite3.Error, UnicodeDecodeError) as exc:
        return ("error", repr(exc))


def flip_store(tmp_path) -> tuple[tiered.StoreConfig, dict[str, torch.Tensor]]:
    """A closed store whose swap files lie outside its directory (so copies of its manifest share them):
    same-shape tensors under similar keys, compressed, odd-sized, 0-d and empty ones, and one entry
    written without data checksums."""
    cfg = small_config(tmp_path / "original", nvme_paths=[str(tmp_path / "swap")])
    values = {f"param/h.{i}.attn.weight": random_tensor((4, 8), torch.float32, seed=i) for i in range(40)}
    values.update({
        "compressed": torch.randn(3000).to(torch.bfloat16),
        "odd": random_tensor((4099,), torch.int8, seed=7),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    })
    with TieredStore.open(cfg.replace(checksum=False)) as store:
        store.sync.put("unverified", random_tensor((100,), torch.float64, seed=8))
    values["unverified"] = random_tensor((100,), torch.float64, seed=8)
    with TieredStore.open(cfg) as store:
        for key, value in values.items():
            if key != "unverified":
                store.sync.put(key, value, compress=key == "compressed")
        assert store.info("compressed").codec != "raw"
    return cfg, values


def test_manifest_bit_flips_never_serve_wrong_data_or_phantom_keys(tmp_path):
    cfg, values = flip_store(tmp_path)
    with open(os.path.join(cfg.path, "manifest.sqlite"), "rb") as f:
        pristine = f.read()
    original_view = manifest_view(os.path.join(cfg.path, "manifest.sqlite"))
    rng = random.Random(39)
    outcomes = {"no effect": 0, "refused at open": 0, "records refused": 0, "served whole": 0}
    for n in range(200):
        damaged = bytearray(pristine)
        bit = rng.randrange(len(damaged) * 8)
        damaged[bit // 8] ^= 1 << (bit % 8)
        where = tmp_path / "flipped"
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(mode=0o700)
        with open(where / "manifest.sqlite", "wb") as f:
            f.write(damaged)
        if manifest_view(str(where / "manifest.sqlite")) == original_view:
            outcomes["no effect"] += 1  # the flip hit bytes SQLite never reads: the store sees what it saw
            continue
        flipped = cfg.replace(path=str(where), nvme_paths=cfg.nvme_paths)  # the original swap files
        refused: set[str] = set()
        try:
            store = TieredStore.open(flipped)
        except ManifestError:
            outcomes["refused at open"] += 1
            store = None
        if store is not None:
            with store:
                keys = set(store.keys())
                assert keys <= set(values), f"flip {n} (bit {bit}): phantom keys {keys - set(values)}"
                for key in keys:
                    assert same_bytes(store.sync.get(key), values[key]), f"flip {n} (bit {bit}): wrong data in {key!r}"
                for key in set(values) - keys:
                    with pytest.raises((ManifestError, KeyError)):
                        store.sync.get(key)
                refused = set(store._versions.damaged)
                missing = set(values) - keys
            outcomes["records refused" if missing else "served whole"] += 1
            if not missing and not refused:
                continue
        try:
            with StoreDirectory.open(str(where), nvme_paths=cfg.nvme_paths) as directory:
                report = check_store(directory, threads=1)
        except ManifestError:
            assert store is None or refused, f"flip {n} (bit {bit}): fsck cannot read a manifest the store opened"
            continue
        assert not report.healthy, f"flip {n} (bit {bit}): the store refused {refused or missing}, fsck said healthy"
        assert refused <= {d.key for d in report.damaged}, f"flip {n} (bit {bit}): fsck missed {refused}"
    # With this seed about a quarter of the flips change what SQLite reads; the rest hit unused bytes.
    assert outcomes["records refused"] >= 20 and outcomes["refused at open"] >= 1, outcomes


def test_fsck_reports_sqlite_s_integrity_check(tmp_path, capsys):
    cfg = small_config(tmp_path / "s")
    with TieredStore.open(cfg) as store:
        for i in range(5):
            store.sync.put(f"k{i}", torch.full((10,), float(i)))
    code, out, _ = cli(capsys, "fsck", cfg.path)
    assert code == 0 and "SQLite's integrity check: ok" in out
    path = os.path.join(cfg.path, "manifest.sqlite")
    db = sqlite3.connect(path)
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'sqlite_autoindex_entries_1'").fetchone()[0]
    page = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    with open(path, "r+b") as f:  # rename one key in the primary-key index only: the rows stay intact
        data = f.read()
        at = data.rfind(b"k3", (root - 1) * page, root * page)
        f.seek(at + 1)
        f.write(b"7")
    code, out, _ = cli(capsys, "fsck", cfg.path, "--json")
    report = json.loads(out)
    assert code == 1 and not report["healthy"] and not report["damaged"]
    assert any("missing from index" in line for line in report["integrity_check"]), report["integrity_check"]
    code, out, _ = cli(capsys, "fsck", cfg.path)
    assert code == 1 and "integrity check of the manifest FAILED" in out


# ----------------------------------------------------------------------------------- relocation


def test_a_copied_store_opens_and_is_checked_with_its_original_deleted(tmp_path, capsys):
    original, copy = tmp_path / "original", tmp_path / "copy"
    values = {f"k{i}": random_tensor((20_000,), torch.float32, seed=i) for i in range(3)}
    with TieredStore.open(small_config(original)) as store:
        for key, value in values.items():
            store.sync.put(key, value)
    shutil.copytree(original, copy, symlinks=True)
    os.unlink(copy / "LOCK")
    with StoreDirectory.open(str(copy)) as directory:  # its own swap files, before any open
        assert all(f.path.startswith(str(copy)) for f in directory.swap_files)
        victim = next(r.record for r in directory.rows if r.record.key == "k1")
        damaged_file = directory.swap_files[victim.extents[0].file].path
    with open(damaged_file, "r+b") as f:  # damage the copy only: fsck must see it, the original is fine
        f.seek(victim.extents[0].offset + 100)
        byte = f.read(1)
        f.seek(victim.extents[0].offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    code, out, _ = cli(capsys, "fsck", copy)
    assert code == 1 and "DAMAGED 'k1'" in out and "k0" not in out
    assert cli(capsys, "fsck", original)[0] == 0
    shutil.rmtree(original)
    code, out, _ = cli(capsys, "fsck", copy, "--delete-damaged")
    assert code == 1 and "deleted 1 damaged record: 'k1'" in out
    with TieredStore.open(small_config(copy)) as store:
        assert sorted(store.keys()) == ["k0", "k2"]
        for key in ("k0", "k2"):
            assert same_bytes(store.sync.get(key), values[key])
    assert cli(capsys, "fsck", copy)[0] == 0


def test_a_moved_store_with_outside_swap_directories(tmp_path, capsys):
    a, s, b, t = (str(tmp_path / name) for name in ("a", "s", "b", "t"))
    value = random_tensor((30_000,), torch.float32, seed=1)
    with TieredStore.open(small_config(a, nvme_paths=[s])) as store:
        store.sync.put("k", value)
    shutil.copytree(a, b)
    shutil.copytree(s, t)
    code, _, err = cli(capsys, "fsck", b)  # the recorded swap directory may be the original's: not guessed
    assert code == 2 and "--nvme-path" in err and a in err
    code, out, _ = cli(capsys, "fsck", b, "--nvme-path", t)
    assert code == 0 and out.splitlines()[-1] == "clean"
    shutil.rmtree(a)
    shutil.rmtree(s)
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, _ = cli(capsys, "fsck", b, "--nvme-path", empty, "--delete-damaged")
    assert code == 1 and "NOT CHECKED 'k'" in out and "none of this store's" in out
    assert not [line for line in out.splitlines() if line.startswith("deleted")], out
    with TieredStore.open(small_config(b, nvme_paths=[t])) as store:
        assert same_bytes(store.sync.get("k"), value)
    code, out, _ = cli(capsys, "fsck", b)  # the open recorded where the swap directory is now
    assert code == 0 and out.splitlines()[-1] == "clean"


def test_swap_files_of_another_store_or_another_order_are_refused(tmp_path):
    dirs = [str(tmp_path / "s0"), str(tmp_path / "s1")]
    cfg = small_config(tmp_path / "a", nvme_paths=dirs)
    with TieredStore.open(cfg) as store:
        store.sync.put("k", random_tensor((50_000,), torch.float32, seed=2))
    with TieredStore.open(small_config(tmp_path / "x", nvme_paths=[str(tmp_path / "x0")])) as other:
        other.sync.put("x", torch.ones(10))
    before = {d: sorted(os.listdir(d)) for d in dirs}
    with pytest.raises(ManifestError, match=r"swap-00\.bin is file 0 of swap directory #1 .*original order"):
        TieredStore.open(cfg.replace(nvme_paths=dirs[::-1]))
    with pytest.raises(ManifestError, match=r"x0/swap-00\.bin belongs to another store"):
        TieredStore.open(cfg.replace(nvme_paths=[str(tmp_path / "x0"), dirs[1]]))
    assert {d: sorted(os.listdir(d)) for d in dirs} == before
    with TieredStore.open(cfg) as store:
        assert same_bytes(store.sync.get("k"), random_tensor((50_000,), torch.float32, seed=2))


# ----------------------------------------------------------------------------------- links and foreign files


@pytest.mark.parametrize("name", ["swap-00.bin", "swap-00.id", "LOCK", "manifest.sqlite", "manifest.sqlite-wal",
                                  "manifest.sqlite-shm"])
def test_a_planted_symlink_is_refused_by_name_and_its_target_left_alone(tmp_path, name, capsys):
    cfg = small_config(tmp_path / "s")
    with TieredStore.open(cfg) as store:
        store.sync.put("k", torch.arange(1000.0))
    planted = os.path.join(cfg.path, name)
    target = tmp_path / "victim"
    if os.path.exists(planted):
        shutil.move(planted, target)  # the real file, now behind the link
    else:
        target.write_bytes(b"precious")
    os.chmod(target, 0o644)
    before = (target.read_bytes(), os.stat(target).st_mode)
    os.symlink(target, planted)
    with pytest.raises(OSError, match=re.escape(planted) + ".*symbolic link"):
        TieredStore.open(cfg)
    assert (target.read_bytes(), os.stat(target).st_mode) == before
    assert os.path.islink(planted)
    if name != "LOCK":
        code, _, err = cli(capsys, "fsck", cfg.path)
        assert code != 0 and "symbolic link" in err
        assert (target.read_bytes(), os.stat(target).st_mode) == before


def test_a_hard_link_a_fifo_or_a_file_of_another_user_is_refused(tmp_path):
    cfg = small_config(tmp_path / "s")
    with TieredStore.open(cfg) as store:
        store.sync.put("k", torch.arange(1000.0))
    swap = os.path.join(cfg.path, "swap-01.bin")
    os.link(swap, tmp_path / "elsewhere")
    with pytest.raises(OSError, match=re.escape(swap) + " has 2 hard links"):
        TieredStore.open(cfg)
    os.unlink(tmp_path / "elsewhere")
    ident = os.path.join(cfg.path, "swap-00.id")
    os.rename(ident, tmp_path / "id")
    os.mkfifo(ident, 0o600)  # opening it to read would block: it is refused before it is opened
    with pytest.raises(OSError, match=re.escape(ident) + " is not a regular file"):
        TieredStore.open(cfg)
    os.unlink(ident)
    os.rename(tmp_path / "id", ident)
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    os.chown(swap, 54321, -1)
    with pytest.raises(PermissionError, match=re.escape(swap) + " belongs to user 54321"):
        TieredStore.open(cfg)
    os.chown(swap, 0, -1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 54321, -1)
    role = r" \(StoreConfig.nvme_paths\[0\]\) belongs to user 54321"
    with pytest.raises(PermissionError, match=re.escape(repr(str(foreign))) + role):
        TieredStore.open(small_config(tmp_path / "t", nvme_paths=[str(foreign)]))
    with TieredStore.open(cfg) as store:
        assert torch.equal(store.sync.get("k"), torch.arange(1000.0))


# ----------------------------------------------------------------------------------- failed calls


@pytest.fixture
def small_ext4(tmp_path):
    """A freshly mounted 8 MiB ext4 filesystem (skipped where this process may not mount a loop device)."""
    yield from mounted("ext4-loop", tmp_path, mib=8)


def test_a_failed_put_changes_nothing_on_a_full_filesystem(small_ext4):
    cfg = small_config(os.path.join(small_ext4, "s"))
    old = random_tensor((20_000,), torch.float32, seed=3)
    new = random_tensor((20_000,), torch.float32, seed=4)
    with TieredStore.open(cfg) as store:
        store.sync.put("k", old)
    with TieredStore.open(cfg) as store:  # a fresh WAL: a commit must grow it
        filler = fill(small_ext4)
        for tier in ("host", "nvme"):
            with pytest.raises(CapacityError, match="'k'"):
                store.sync.put("k", new, tier=tier)
            assert same_bytes(store.sync.get("k"), old), tier
            assert store.info("k").tiers == (tiered.Tier.NVME,)
        with pytest.raises(CapacityError):
            store.sync.put("fresh", new)
        assert "fresh" not in store
        os.unlink(filler)
    with TieredStore.open(cfg) as store:
        assert store.keys() == ["k"] and same_bytes(store.sync.get("k"), old)
        space = store.nvme_space()
        assert space.allocated_bytes == space.charged_bytes == space.entry_bytes


def test_close_on_a_full_filesystem_writes_what_fits_and_says_what_it_could_not(small_ext4):
    cfg = small_config(os.path.join(small_ext4, "s"), host_bytes=1 * MiB)
    kept = random_tensor((20_000,), torch.float32, seed=5)
    threads_before = store_threads()
    with TieredStore.open(cfg) as store:
        store.sync.put("kept", kept)
    store = TieredStore.open(cfg)
    for i in range(4):
        store.sync.put(f"host{i}", random_tensor((30_000,), torch.float32, seed=i), tier="host")
    filler = fill(small_ext4)
    with pytest.raises(CapacityError, match=r"close could not write 4 of 5 entries down \(480000 bytes\)"):
        store.sync.close()
    assert store._loop_thread.loop.is_closed()
    assert not [t for t in asyncio.all_tasks(store._loop_thread.loop) if not t.done()], "a task was left pending"
    deadline = time.monotonic() + 10
    while store_threads() - threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not store_threads() - threads_before, store_threads() - threads_before
    with pytest.raises(tiered.StoreClosedError):
        store.sync.get("kept")
    os.unlink(filler)
    with TieredStore.open(cfg) as store:
        assert store.keys() == ["kept"] and same_bytes(store.sync.get("kept"), kept)


# ----------------------------------------------------------------------------------- typed errors


def test_a_record_in_a_missing_swap_file_is_named_at_open(tmp_path):
    cfg = small_config(tmp_path / "s", nvme_paths=[str(tmp_path / "n0"), str(tmp_path / "n1")])
    with TieredStore.open(cfg) as store:
        store.sync.put("striped", random_tensor((100_000,), torch.float32, seed=6))
    lost = next(os.path.join(d, n) for d in cfg.nvme_paths for n in sorted(os.listdir(d))
                if n.endswith(".bin") and os.path.getsize(os.path.join(d, n)))
    os.unlink(lost)
    for _ in range(2):  # refused the same way again: the open created nothing
        with pytest.raises(ManifestError, match=rf"entry 'striped' lies in the swap file {re.escape(lost)}, which is "
                                                "missing"):
            TieredStore.open(cfg)
    assert not os.path.exists(lost)


def test_an_unknown_codec_is_named_with_its_key(tmp_path):
    cfg = small_config(tmp_path / "s")
    with TieredStore.open(cfg) as store:
        store.sync.put("k", torch.zeros(10_000), compress=True)
        store.sync.put("other", torch.ones(10))
    db = sqlite3.connect(os.path.join(cfg.path, "manifest.sqlite"))
    with db:  # as a newer version would write it: an intact record with a codec this one lacks
        db.execute("UPDATE entries SET codec = 'lz-future' WHERE key = 'k'")
        rowid, *values = db.execute(f"SELECT rowid, {', '.join(COLUMN_NAMES[:-1])} FROM entries WHERE key = 'k'"
                                    ).fetchone()
        db.execute("UPDATE entries SET checksum = ? WHERE rowid = ?", (row_checksum(values), rowid))
    db.close()
    with pytest.raises(ManifestError, match="entry 'k' .*unknown codec 'lz-future'.*version of tiered that wrote it"):
        TieredStore.open(cfg)


def test_bad_devices_and_keys_are_typed_errors(tmp_path):
    with TieredStore.open(small_config(tmp_path / "s")) as store:
        store.sync.put("k", torch.ones(4))
        with pytest.raises(ValueError, match="'meta' holds no data"):
            store.sync.get("k", device="meta")
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="'cuda' is not available"):
                store.sync.get("k", device="cuda")
            with pytest.raises(ValueError, match="'cuda:0' is not available"):
                store.sync.get_many(["k"], device="cuda:0")
        for call in (store.info, store.nvme_layout, store.prefetch, store.sync.get, store.sync.delete):
            with pytest.raises(TypeError, match="keys are strings, got int"):
                call(1)
        assert torch.equal(store.sync.get("k"), torch.ones(4))


# ----------------------------------------------------------------------------------- the earlier format


def downgrade(cfg: tiered.StoreConfig) -> None:
    """Make a closed store's directory look as an earlier version of tiered left it (manifest format 1)."""
    db = sqlite3.connect(os.path.join(cfg.path, "manifest.sqlite"), isolation_level=None)
    try:
        db.execute("ALTER TABLE entries DROP COLUMN checksum")
        db.execute("ALTER TABLE entries DROP COLUMN flags")
        db.execute("DELETE FROM meta")
        db.executemany("INSERT INTO meta VALUES (?, ?)", [
            ("format", "1"), ("nvme_paths", json_list(cfg.nvme_paths)), ("swap_files_per_dir", "2")])
    finally:
        db.close()
    for d in cfg.nvme_paths:
        for name in os.listdir(d):
            if name.endswith(".id"):
                os.unlink(os.path.join(d, name))


def json_list(paths) -> str:
    return "[" + ", ".join(f'"{p}"' for p in paths) + "]"


def test_a_store_of_the_earlier_format_is_upgraded_in_place(tmp_path, capsys):
    cfg = small_config(tmp_path / "s")
    values = {"a": random_tensor((30_000,), torch.float32, seed=1), "b": torch.zeros(5000)}
    with TieredStore.open(cfg) as store:
        for key, value in values.items():
            store.sync.put(key, value, compress=key == "b")
    downgrade(cfg)
    code, out, _ = cli(capsys, "fsck", cfg.path)
    assert code == 0 and "earlier format" in out
    with pytest.warns(RuntimeWarning, match="upgraded the store manifest .* from format 1 to 2"):
        store = TieredStore.open(cfg)
    with store:
        for key, value in values.items():
            assert same_bytes(store.sync.get(key), value)
    assert sorted(n for n in os.listdir(cfg.path) if n.endswith(".id")) == ["swap-00.id", "swap-01.id"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # upgraded once: no warning again
        with TieredStore.open(cfg) as store:
            assert sorted(store.keys()) == ["a", "b"]
    code, out, _ = cli(capsys, "fsck", cfg.path)
    assert code == 0 and out.splitlines()[-1] == "clean" and "earlier format" not in out
