"""Security: private files, nothing unpickled from the store, keys never reaching the filesystem.

- Swap files, the manifest (and its -wal/-shm), and LOCK are 0600; directories the store creates
  are 0700, whatever the umask.
- Nothing the store reads back is ever unpickled: no pickle/torch.load/eval in the store's code (a
  grep), and no unpickling happens at run time (an audit hook), even when a manifest field holds
  a pickle that would run code.
- Keys are data, never paths: every file the store opens or creates has a fixed name, whatever the
  keys look like (an audit hook watches every open and every os.* path call).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import sqlite3
import stat
import sys
from typing import Iterator

import pytest
import torch

import tiered
from tiered import TieredStore

from conftest import KiB, MiB, random_tensor, same_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)


def make_config(path, **changes) -> tiered.StoreConfig:
    settings = dict(path=str(path), device_bytes=256 * KiB, host_bytes=512 * KiB, block_size=64 * KiB,
                    io_threads=2, swap_grow_bytes=1 * MiB, result_pool_bytes=0)
    settings.update(changes)
    return tiered.StoreConfig(**settings)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def audit(prefixes: tuple[str, ...]) -> Iterator[list[tuple[str, tuple]]]:
    """Audit events whose names start with one of ``prefixes``, raised (by any thread) inside the block.

    Audit hooks cannot be removed, so the hook outlives the block but records nothing after it.
    """
    seen: list[tuple[str, tuple]] = []
    active = [True]

    def hook(event: str, args: tuple) -> None:
        if active[0] and event.startswith(prefixes):
            seen.append((event, args))

    sys.addaudithook(hook)
    try:
        yield seen
    finally:
        active[0] = False


def modes(*dirs: str) -> dict[str, int]:
    out = {}
    for top in dirs:
        for d, _, files in os.walk(top):
            out[d] = stat.S_IMODE(os.stat(d).st_mode)
            for n in files:
                out[os.path.join(d, n)] = stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode)
    return out


# ----------------------------------------------------------------------------------- permissions


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077])
def test_files_are_0600_and_directories_0700_whatever_the_umask(tmp_path, mask):
    cfg = make_config(tmp_path / "store", nvme_paths=[str(tmp_path / "nvme0"), str(tmp_path / "nvme1")])
    with umask(mask):
        with TieredStore.open(cfg) as store:
            for i in range(6):
                store.sync.put(f"k{i}", torch.randn(50_000), tier=["nvme", "host"][i % 2])
            store.sync.flush()
            live = modes(cfg.path, *cfg.nvme_paths)  # while open: the WAL and shared-memory files exist
        closed = modes(cfg.path, *cfg.nvme_paths)
    for snapshot in (live, closed):
        names = {os.path.basename(p) for p in snapshot}
        assert {"LOCK", "manifest.sqlite", "swap-00.bin", "swap-01.bin"} <= names
        for path, mode in snapshot.items():
            want = 0o700 if os.path.isdir(path) else 0o600
            assert mode == want, f"{path} has mode {oct(mode)} under umask {oct(mask)}"
    assert any(p.endswith("manifest.sqlite-wal") for p in live), "expected a WAL while the store is open"


def test_an_existing_directory_keeps_its_mode_but_files_are_private(tmp_path):
    path = tmp_path / "shared"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    with umask(0):
        with TieredStore.open(make_config(path)) as store:
            store.sync.put("k", torch.ones(10))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755  # the caller's directory, the caller's choice
    for name in os.listdir(path):
        assert stat.S_IMODE(os.stat(path / name).st_mode) == 0o600, name


def test_the_lock_file_holds_only_the_owner_pid_and_store(tmp_path):
    cfg = make_config(tmp_path / "s", nvme_paths=[str(tmp_path / "n0")])
    with TieredStore.open(cfg):
        for directory in (cfg.path, *cfg.nvme_paths):
            with open(os.path.join(directory, "LOCK"), "rb") as f:
                assert f.read() == f"{os.getpid()}\n{cfg.path}\n".encode()


# ----------------------------------------------------------------------------------- no unpickling

#: Calls that would deserialize objects (and so could run code) from bytes.
UNSAFE = re.compile(
    r"^\s*(import|from)\s+(pickle|_pickle|cPickle|dill|cloudpickle|shelve|marshal|joblib)\b"
    r"|\b(pickle|_pickle|dill|cloudpickle|marshal)\.(loads?|Unpickler)\b"
    r"|\btorch\.load\s*\(|\b(np|numpy)\.load\s*\(|allow_pickle\s*=\s*True|\beval\s*\(|\bexec\s*\(",
    re.MULTILINE,
)


def test_no_code_in_the_store_can_unpickle():
    """grep: the store (tiered/, except the benchmark's torch.save contender, which reads back only
    files it wrote itself) has no pickle, marshal, torch.load, np.load or eval."""
    offenders = []
    for d, _, files in os.walk(os.path.join(ROOT, "tiered")):
        if os.path.relpath(d, ROOT).startswith(os.path.join("tiered", "bench")):
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(d, name)
                with open(path, encoding="utf-8") as f:
                    for match in UNSAFE.finditer(f.read()):
                        offenders.append(f"{os.path.relpath(path, ROOT)}: {match.group(0).strip()}")
    assert not offenders, offenders
    assert UNSAFE.search("x = pickle.loads(blob)") and UNSAFE.search("import pickle") and UNSAFE.search(
        "torch.load(path)"), "the pattern itself must catch what it is for"


class Boom:
    """Unpickling this would call the audit-visible ``pickle.find_class`` (and then os.system)."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_nothing_is_unpickled_at_run_time(tmp_path):
    cfg = make_config(tmp_path / "s")
    values = {"raw": random_tensor((30_000,), torch.float32, seed=1), "zstd": torch.randn(30_000),
              "tiny": torch.tensor(1.5), "host": torch.arange(100)}
    with audit(("pickle.", "marshal.loads")) as seen:
        with TieredStore.open(cfg) as store:
            for key, value in values.items():
                store.sync.put(key, value, tier="host" if key == "host" else "nvme", compress=key == "zstd")
            store.sync.prefetch("raw", "device").result(timeout=60)
        with TieredStore.open(cfg) as store:
            for key, value in values.items():
                assert same_bytes(store.sync.get(key), value)
        # A manifest whose fields hold a pickle that would run code: refused or read as bytes, never loaded.
        payload = pickle.dumps(Boom())
        db = sqlite3.connect(os.path.join(cfg.path, "manifest.sqlite"), isolation_level=None)
        db.execute("UPDATE entries SET codec_meta = ? WHERE key = 'zstd'", (payload,))
        db.execute("UPDATE entries SET shape = ? WHERE key = 'raw'", (payload,))
        db.close()
        with pytest.raises((tiered.ManifestError, tiered.TieredError, ValueError)):
            with TieredStore.open(cfg) as store:
                store.sync.get("zstd")
    assert not [e for e in seen if e[0].startswith("pickle.")], seen
    with audit(("pickle.",)) as control:  # the hook does see unpickling (of the class only: nothing runs)
        pickle.loads(pickle.dumps(Boom))
    assert control and control[0][0] == "pickle.find_class"


# ----------------------------------------------------------------------------------- keys are not paths

NASTY_KEYS = ["../../escape", "/tmp/absolute-key", "a/b/c", "..", "swap-00.bin", "LOCK", "manifest.sqlite",
              "nul\x00byte", "~/home", "$(touch pwned)", "C:\\windows", "\u202ertl-override", "KEYMARK-unique"]


def test_keys_never_reach_the_filesystem(tmp_path):
    cfg = make_config(tmp_path / "store", nvme_paths=[str(tmp_path / "n0"), str(tmp_path / "n1")])
    with audit(("open", "os.")) as seen:
        with TieredStore.open(cfg) as store:
            for i, key in enumerate(NASTY_KEYS):
                store.sync.put(key, torch.full((20_000,), float(i)), tier=["nvme", "host", "device"][i % 3])
            store.sync.evict(NASTY_KEYS[1])
            store.sync.delete(NASTY_KEYS[0])
        with TieredStore.open(cfg) as store:
            for i, key in enumerate(NASTY_KEYS[1:], start=1):
                assert torch.equal(store.sync.get(key), torch.full((20_000,), float(i))), key
    paths = [os.fsdecode(a) for _, args in seen for a in args if isinstance(a, (str, bytes, os.PathLike))]
    assert any(p.endswith("swap-01.bin") for p in paths) and any(p.endswith("LOCK") for p in paths), paths[:20]
    for key in NASTY_KEYS:
        leaked = [p for p in paths if key in p and not key.startswith(("swap", "LOCK", "manifest", ".."))]
        assert not leaked, (key, leaked)
    allowed = {"LOCK", "manifest.sqlite", "manifest.sqlite-wal", "manifest.sqlite-shm", "swap-00.bin", "swap-01.bin",
               "swap-00.id", "swap-01.id"}
    created = {os.path.relpath(os.path.join(d, n), tmp_path) for d, _, files in os.walk(tmp_path) for n in files}
    assert {os.path.basename(p) for p in created} <= allowed, created
    assert not os.path.exists("/tmp/absolute-key") and not os.path.exists(tmp_path / "escape")
    # The keys are only in the manifest, as text; swap files hold tensor bytes only.
    for d in cfg.nvme_paths:
        for name in os.listdir(d):
            with open(os.path.join(d, name), "rb") as f:
                assert b"KEYMARK" not in f.read(), name
