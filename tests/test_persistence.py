"""Durability: data survives close, process exit and crashes; corruption is detected, never returned."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

import tiered

from conftest import KiB, MiB, random_tensor, same_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the project importable."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def small_config(path, **kw) -> tiered.StoreConfig:
    return tiered.StoreConfig(path=str(path), host_bytes=1 * MiB, device_bytes=256 * KiB, block_size=64 * KiB,
                              swap_grow_bytes=1 * MiB, **kw)


WRITER = """
    import torch, tiered
    cfg = tiered.StoreConfig(path={path!r}, host_bytes=1 << 20, device_bytes=1 << 18, block_size=1 << 16,
                             swap_grow_bytes=1 << 20)
    store = tiered.TieredStore.open(cfg)
    for i in range(12):
        g = torch.Generator().manual_seed(i)
        x = torch.randint(0, 256, (1000 * (i + 1) * 17,), dtype=torch.uint8, generator=g)
        store.sync.put(f"t{{i}}", x, tier=["nvme", "host", "device"][i % 3], compress=i % 4 == 0)
    store.sync.put("weird/../key \\u00e9\\n", torch.arange(5))
    {finish}
"""


def expected(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (1000 * (i + 1) * 17,), dtype=torch.uint8, generator=g)


def test_reopen_in_new_process_after_close(tmp_path):
    path = tmp_path / "s"
    proc = run_python(WRITER.format(path=str(path), finish="store.sync.close()"))
    assert proc.returncode == 0, proc.stderr
    with tiered.TieredStore.open(small_config(path)) as store:
        assert len(store) == 13
        for i in range(12):
            assert same_bytes(store.sync.get(f"t{i}"), expected(i))
            assert store.info(f"t{i}").tiers == (tiered.Tier.NVME,)
        assert torch.equal(store.sync.get("weird/../key \u00e9\n"), torch.arange(5))
    names = {n for d, _, files in os.walk(path) for n in files}
    assert all("weird" not in n for n in names), "keys must never become file names"


def test_crash_keeps_every_committed_tensor_and_reclaims_orphans(tmp_path):
    path = tmp_path / "s"
    # os._exit skips close: only puts to nvme were committed; host/device puts are lost by design.
    proc = run_python(WRITER.format(path=str(path), finish="os = __import__('os'); os._exit(0)"))
    assert proc.returncode == 0, proc.stderr
    with tiered.TieredStore.open(small_config(path)) as store:
        committed = {f"t{i}" for i in range(0, 12, 3)} | {"weird/../key \u00e9\n"}
        assert set(store.keys()) == committed
        for i in range(0, 12, 3):
            assert same_bytes(store.sync.get(f"t{i}"), expected(i))
        nvme = store.stats().tiers[tiered.Tier.NVME]
        # Space written by uncommitted work is free again: used is exactly the committed footprint.
        footprint = sum(-(-store.info(k).stored_nbytes // 4096) * 4096 for k in committed)
        assert nvme.used_bytes == footprint


def test_killed_mid_write_loses_nothing_committed(tmp_path):
    path = tmp_path / "s"
    code = f"""
        import os, signal, threading, torch, tiered
        cfg = tiered.StoreConfig(path={str(path)!r}, block_size=1 << 16, swap_grow_bytes=1 << 20)
        store = tiered.TieredStore.open(cfg)
        for i in range(5):
            store.sync.put(f"done{{i}}", torch.full((50_000,), float(i)))
        print("committed", flush=True)
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        i = 0
        while True:
            store.sync.put(f"late{{i % 3}}", torch.full((2_000_000,), float(i)))
            i += 1
    """
    proc = run_python(code)
    assert proc.returncode == -9 and "committed" in proc.stdout, proc.stderr
    with tiered.TieredStore.open(small_config(path)) as store:
        for i in range(5):
            assert torch.equal(store.sync.get(f"done{i}"), torch.full((50_000,), float(i)))
        for key in store.keys():
            if key.startswith("late"):
                value = store.sync.get(key)
                assert torch.all(value == value[0]), f"{key} is torn"


def test_flipped_byte_raises_checksum_error_naming_the_key(tmp_path):
    path = tmp_path / "s"
    x = random_tensor((300_000,), torch.float32, seed=1)
    with tiered.TieredStore.open(small_config(path)) as store:
        store.sync.put("victim", x)
        store.sync.put("bystander", torch.ones(1000))
    swap = [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.startswith("swap-")]
    victim_file = max(swap, key=os.path.getsize)
    with open(victim_file, "r+b") as f:
        f.seek(123_457)
        byte = f.read(1)
        f.seek(123_457)
        f.write(bytes([byte[0] ^ 0x40]))
    with tiered.TieredStore.open(small_config(path)) as store:
        with pytest.raises(tiered.ChecksumError, match="'victim'"):
            store.sync.get("victim")
        assert torch.equal(store.sync.get("bystander"), torch.ones(1000))


def test_second_open_is_refused(tmp_path):
    cfg = small_config(tmp_path / "s")
    with tiered.TieredStore.open(cfg):
        with pytest.raises(tiered.StoreLockedError, match="already open"):
            tiered.TieredStore.open(cfg)
        proc = run_python(f"""
            import tiered
            try:
                tiered.TieredStore.open(tiered.StoreConfig(path={cfg.path!r}))
            except tiered.StoreLockedError as e:
                print("locked:", e)
        """)
        assert "locked:" in proc.stdout, proc.stderr
    with tiered.TieredStore.open(cfg):  # released on close
        pass


def test_permissions(tmp_path):
    path = tmp_path / "s"
    with tiered.TieredStore.open(small_config(path)) as store:
        store.sync.put("k", torch.ones(10_000))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    for name in os.listdir(path):
        mode = stat.S_IMODE(os.stat(path / name).st_mode)
        assert mode == 0o600, f"{name} has mode {oct(mode)}"


def test_reopen_with_other_layout_is_refused(tmp_path):
    path = tmp_path / "s"
    with tiered.TieredStore.open(small_config(path)) as store:
        store.sync.put("k", torch.ones(10))
    with pytest.raises(tiered.ManifestError, match="swap_files_per_dir"):
        tiered.TieredStore.open(small_config(path, swap_files_per_dir=3))


def test_striping_over_several_directories(tmp_path):
    dirs = [str(tmp_path / d) for d in ("n0", "n1", "n2")]
    cfg = small_config(tmp_path / "s", nvme_paths=dirs)
    x = random_tensor((1_000_000,), torch.float32, seed=5)
    with tiered.TieredStore.open(cfg) as store:
        store.sync.put("big", x)
    for d in dirs:
        assert sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)) > 0, f"nothing striped to {d}"
    with tiered.TieredStore.open(cfg) as store:
        assert same_bytes(store.sync.get("big"), x)


def test_space_is_reused_not_leaked(tmp_path):
    cfg = small_config(tmp_path / "s")
    with tiered.TieredStore.open(cfg) as store:
        for i in range(20):
            store.sync.put("k", torch.full((500_000,), float(i)))
        sizes = sum(os.path.getsize(os.path.join(cfg.path, n)) for n in os.listdir(cfg.path) if n.startswith("swap"))
        assert sizes <= 4 * MiB, "overwriting one key must reuse freed extents"
        assert store.stats().tiers[tiered.Tier.NVME].used_bytes == -(-2_000_000 // 4096) * 4096


def test_delete_is_durable(tmp_path):
    cfg = small_config(tmp_path / "s")
    with tiered.TieredStore.open(cfg) as store:
        store.sync.put("a", torch.ones(10))
        store.sync.put("b", torch.ones(10))
        store.sync.delete("a")
    with tiered.TieredStore.open(cfg) as store:
        assert store.keys() == ["b"]


def test_unclosed_store_is_flushed_at_exit(tmp_path):
    path = tmp_path / "s"
    proc = run_python(WRITER.format(path=str(path), finish="# the program forgets store.close()"))
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    with tiered.TieredStore.open(small_config(path)) as store:
        assert len(store) == 13
        for i in range(12):
            assert same_bytes(store.sync.get(f"t{i}"), expected(i))


def test_closed_store_refuses_calls(tmp_path):
    store = tiered.TieredStore.open(small_config(tmp_path / "s"))
    store.sync.put("k", torch.ones(3))
    store.sync.close()
    store.sync.close()  # idempotent
    with pytest.raises(tiered.StoreClosedError):
        store.sync.get("k")
    with pytest.raises(tiered.StoreClosedError):
        store.prefetch("k")


def _tmpfs_refuses_o_direct() -> bool:
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        return False
    probe = os.path.join("/dev/shm", f"tiered-probe-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return False
    except OSError:
        return True
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@pytest.mark.skipif(not _tmpfs_refuses_o_direct(), reason="no tmpfs here refuses O_DIRECT (kernels >= 6.6 accept it)")
def test_buffered_fallback_warns_once(tmp_path):
    import tempfile
    shm = tempfile.mkdtemp(dir="/dev/shm")
    try:
        cfg = small_config(tmp_path / "s", nvme_paths=[shm])
        with pytest.warns(RuntimeWarning, match="O_DIRECT") as record:
            store = tiered.TieredStore.open(cfg)
        assert len([w for w in record if "O_DIRECT" in str(w.message)]) == 1
        with store:
            x = random_tensor((100_003,), torch.int16, seed=2)
            store.sync.put("k", x)
            assert same_bytes(store.sync.get("k"), x)
    finally:
        import shutil
        shutil.rmtree(shm)


def test_crash_after_memory_tier_overwrite_never_returns_the_stale_version(tmp_path):
    path = tmp_path / "s"
    code = f"""
        import os, torch, tiered
        store = tiered.TieredStore.open(tiered.StoreConfig(path={str(path)!r}))
        store.sync.put("k", torch.zeros(1000))              # committed on nvme
        store.sync.put("k", torch.ones(1000), tier="host")  # newer, not yet durable
        os._exit(0)                                          # crash: no flush
    """
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    with tiered.TieredStore.open(small_config(path)) as store:
        assert "k" not in store, "a crash must lose the unflushed version, never resurrect the old one"
