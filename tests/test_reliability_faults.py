"""Faults: a full disk, I/O errors, short transfers, flipped bits and a damaged manifest.

Faults come through the I/O layer's injection seam (``Syscalls``: pwritev/preadv/fdatasync), a
manifest whose commits fail, and, where this machine lets a test mount one, a real small
filesystem (a size-limited tmpfs and a loop-mounted ext4 image; skipped with the reason
otherwise). What must hold: a clear typed error that names the key; no committed value lost or
changed; a tensor being written down stays in its upper tier; never wrong data; the store stays
usable; and space accounting stays exact.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import sqlite3

import pytest
import torch
from conftest import KiB, MiB, random_tensor, same_bytes
from short_transfers import random_prefix as chunky
from small_filesystems import fill, mounted

import tiered
from tiered import CapacityError, ChecksumError, ManifestError, Tier, TransferError
from tiered.io import Syscalls
from tiered.offline import StoreDirectory, check_store, inspect_store

pytestmark = pytest.mark.timeout(120)


def small_config(path, **changes) -> tiered.StoreConfig:
    settings = dict(path=str(path), device_bytes=128 * KiB, host_bytes=256 * KiB, block_size=16 * KiB,
                    queue_depth=4, io_threads=2, swap_grow_bytes=256 * KiB, result_pool_bytes=0)
    settings.update(changes)
    return tiered.StoreConfig(**settings)


def failing(err: int):
    def call(*args):
        raise OSError(err, os.strerror(err))

    return call


def assert_no_leak(store: tiered.TieredStore) -> None:
    space = store.nvme_space()
    assert space.allocated_bytes == space.charged_bytes == space.entry_bytes, space


# ------------------------------------------------------------------- injected ENOSPC, EIO


@pytest.mark.parametrize("compress", [False, True])
async def test_enospc_during_put_keeps_the_old_value_and_the_store_usable(tmp_path, compress):
    cfg = small_config(tmp_path / "s")
    old, new = random_tensor((40_000,), torch.float32, seed=1), torch.randn(40_000)
    async with await tiered.TieredStore.open_async(cfg) as store:
        await store.put("k", old)
        real = store._io.syscalls
        store._io.syscalls = Syscalls(pwritev=failing(errno.ENOSPC))
        with pytest.raises(CapacityError, match=r"writing entry 'k' failed.*No space left on device"):
            await store.put("k", new, compress=compress)
        with pytest.raises(CapacityError, match="'fresh'"):
            await store.put("fresh", new, compress=compress)
        assert "fresh" not in store and same_bytes(await store.get("k"), old)
        assert_no_leak(store)
        store._io.syscalls = real
        await store.put("k", new, compress=compress)
        await store.put("fresh", old)
    async with await tiered.TieredStore.open_async(cfg) as store:
        assert same_bytes(await store.get("k"), new) and same_bytes(await store.get("fresh"), old)
        assert_no_leak(store)


@pytest.mark.parametrize("how", ["evict", "flush", "host admission", "device cascade"])
async def test_enospc_during_demotion_keeps_the_tensor_in_its_upper_tier(tmp_path, how):
    cfg = small_config(tmp_path / "s")
    x = random_tensor((50_000,), torch.float32, seed=2)  # 200 KB: the host tier (256 KiB) holds one
    async with await tiered.TieredStore.open_async(cfg) as store:
        await store.put("on-disk", torch.arange(100))
        await store.put("h", x, tier="host")
        real = store._io.syscalls
        store._io.syscalls = Syscalls(pwritev=failing(errno.ENOSPC))
        with pytest.raises(CapacityError, match="entry 'h' failed.*No space left"):
            if how == "evict":
                await store.evict("h")
            elif how == "flush":
                await store.flush()
            elif how == "host admission":  # room for another host put means writing 'h' down
                await store.put("other", torch.ones(40_000), tier="host")
            else:  # a device put pushes a device entry to host, which pushes 'h' to nvme
                await store.put("d", torch.ones(25_000), tier="device")
                await store.put("d2", torch.ones(25_000), tier="device")
        info = store.info("h")
        assert info.tiers == (Tier.HOST,) and info.dirty
        assert same_bytes(await store.get("h"), x)
        assert_no_leak(store)
        store._io.syscalls = real
        await store.flush()  # the same write-down now succeeds
        assert store.info("h").tiers == (Tier.HOST, Tier.NVME)
    async with await tiered.TieredStore.open_async(cfg) as store:
        assert same_bytes(await store.get("h"), x)
        assert_no_leak(store)


async def test_eio_on_read_names_the_key_and_installs_nothing(tmp_path):
    x = random_tensor((30_000,), torch.int32, seed=3)
    async with await tiered.TieredStore.open_async(small_config(tmp_path / "s")) as store:
        await store.put("k", x, compress=True)
        real = store._io.syscalls
        store._io.syscalls = Syscalls(preadv=failing(errno.EIO))
        with pytest.raises(TransferError, match=r"reading entry 'k' failed.*Input/output error"):
            await store.get("k")
        with pytest.raises(TransferError, match="'k'"):
            await store.prefetch("k", "host")
        assert store.info("k").tiers == (Tier.NVME,), "a failed read must not install a copy"
        assert store.stats().tiers[Tier.HOST].used_bytes == 0
        store._io.syscalls = real
        assert same_bytes(await store.get("k"), x)


@pytest.mark.parametrize("striped", [False, True])
async def test_a_puts_data_is_flushed_before_its_record_is_written(tmp_path, striped):
    # One swap file: the manifest thread flushes it and writes the record in one job; several:
    # they are flushed in parallel on I/O threads first. Either way, data before record.
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")] if striped else None
    cfg = small_config(tmp_path / "s", nvme_paths=dirs, durable=True)
    events: list[tuple[str, object]] = []
    async with await tiered.TieredStore.open_async(cfg) as store:
        await store.put("warm-up", torch.ones(1))  # the swap files exist
        write_records = store._manifest.commit

        def flush_data(fd: int) -> None:
            events.append(("data", fd))
            os.fdatasync(fd)

        def commit(upserts, deletes, **flush) -> None:
            events.append(("record", tuple(r.key for r in upserts)))
            write_records(upserts, deletes, **flush)

        store._io.syscalls = Syscalls(fdatasync=flush_data)
        store._manifest.commit = commit
        value = random_tensor((40_000,), torch.float32, seed=9)  # 10 blocks of 16 KiB
        await store.put("k", value)
        files = {e.path for e in store.nvme_layout("k")}
        assert len(files) == (2 if striped else 1)
        assert [kind for kind, _ in events] == ["data"] * len(files) + ["record"], events
        assert events[-1][1] == ("k",)
    async with await tiered.TieredStore.open_async(cfg) as store:
        assert same_bytes(await store.get("k"), value)


@pytest.mark.parametrize("fault", ["pwritev", "fdatasync"])
async def test_eio_on_write_or_sync_keeps_the_committed_value(tmp_path, fault):
    cfg = small_config(tmp_path / "s")
    old = random_tensor((20_000,), torch.float16, seed=4)
    async with await tiered.TieredStore.open_async(cfg) as store:
        await store.put("k", old)
        real = store._io.syscalls
        store._io.syscalls = Syscalls(**{fault: failing(errno.EIO)})
        doing = "writing" if fault == "pwritev" else "committing"
        with pytest.raises(TransferError, match=rf"{doing} entry 'k' failed.*Input/output error"):
            await store.put("k", torch.zeros(20_000, dtype=torch.float16))
        store._io.syscalls = real
        assert same_bytes(await store.get("k"), old)
        assert_no_leak(store)
    async with await tiered.TieredStore.open_async(cfg) as store:
        assert same_bytes(await store.get("k"), old), "a put that raised must not have replaced the value"


@pytest.mark.parametrize("direct", [True, False])
async def test_short_reads_and_writes_are_continued(tmp_path, direct):
    rng = random.Random(5)
    # O_DIRECT transfers stop short only at block boundaries; buffered ones anywhere.
    align = 4096 if direct else 1
    cfg = small_config(tmp_path / "s", direct_io=direct, nvme_paths=[str(tmp_path / "a"), str(tmp_path / "b")])
    values = {f"k{i}": random_tensor((rng.randint(0, 60_000),), torch.bfloat16, seed=i) for i in range(12)}
    async with await tiered.TieredStore.open_async(cfg) as store:
        store._io.syscalls = Syscalls(preadv=chunky(os.preadv, rng, align), pwritev=chunky(os.pwritev, rng, align))
        for i, (key, value) in enumerate(values.items()):
            await store.put(key, value, compress=i % 3 == 0)
        for key, value in values.items():
            assert same_bytes(await store.get(key), value), key
        assert store.stats().write_requests > 0
    async with await tiered.TieredStore.open_async(cfg) as store:
        for key, value in values.items():
            assert same_bytes(await store.get(key), value), key


# ------------------------------------------------------------------- a manifest that cannot commit


class FailingManifest:
    """The store's manifest, with commits that fail while ``armed``."""

    def __init__(self, real, error: Exception) -> None:
        self._real = real
        self.error = error
        self.armed = True

    def commit(self, upserts, deletes=(), **flush):
        if self.armed:
            raise self.error
        return self._real.commit(upserts, deletes, **flush)

    def __getattr__(self, name):
        return getattr(self._real, name)


async def test_failed_tombstone_keeps_the_key_and_its_extents(tmp_path):
    """A delete whose tombstone cannot commit raises and changes nothing; the extents its record
    points at must not be handed to a later put (a reopen would read someone else's bytes)."""
    cfg = small_config(tmp_path / "s")
    a, b = random_tensor((30_000,), torch.float32, seed=6), random_tensor((30_000,), torch.float32, seed=7)
    async with await tiered.TieredStore.open_async(cfg) as store:
        await store.put("a", a)
        manifest = FailingManifest(store._commits._manifest, ManifestError("injected: the manifest is gone"))
        store._commits._manifest = manifest
        with pytest.raises(ManifestError, match="'a'.*injected"):
            await store.delete("a")
        assert "a" in store and same_bytes(await store.get("a"), a)
        with pytest.raises(ManifestError):  # a memory-tier put over it cannot remove the old record either
            await store.put("a", b, tier="host")
        manifest.armed = False
        await store.put("b", b)  # must get new extents, not a's
        await store.delete("a")  # the put above left a tombstone to write: now it commits
    async with await tiered.TieredStore.open_async(cfg) as store:
        assert store.keys() == ["b"] and same_bytes(await store.get("b"), b)
        assert_no_leak(store)


async def test_failed_tombstone_of_a_memory_put_is_retried_by_the_next_delete(tmp_path):
    cfg = small_config(tmp_path / "s")
    async with await tiered.TieredStore.open_async(cfg) as store:
        await store.put("k", torch.ones(1000))
        manifest = FailingManifest(store._commits._manifest, ManifestError("injected"))
        store._commits._manifest = manifest
        with pytest.raises(ManifestError):
            await store.put("k", torch.zeros(1000), tier="host")
        manifest.armed = False
        await store.delete("k")
    async with await tiered.TieredStore.open_async(cfg) as store:
        assert "k" not in store, "the old record outlived a delete that returned"


# ------------------------------------------------------------------- flipped bits


def record_extents(path: str) -> dict[str, tuple[int, list[tuple[int, int, int]]]]:
    """key -> (stored bytes, [(file, offset, length)]) straight from the manifest."""
    import array

    db = sqlite3.connect(f"file:{os.path.join(path, 'manifest.sqlite')}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT key, stored_nbytes, extents FROM entries").fetchall()
    finally:
        db.close()
    out = {}
    for key, stored, blob in rows:
        a = array.array("q")
        a.frombytes(blob)
        out[key] = (stored, [(a[i], a[i + 1], a[i + 2]) for i in range(0, len(a), 3)])
    return out


def locate(extents: list[tuple[int, int, int]], pos: int) -> tuple[int, int]:
    """(file, offset) of logical byte ``pos`` of a record laid over ``extents``."""
    for file, offset, length in extents:
        if pos < length:
            return file, offset + pos
        pos -= length
    raise AssertionError(f"byte {pos} lies past the extents {extents}")


def flip_bit(file: str, offset: int, bit: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def test_bit_flips_raise_checksum_error_naming_the_key_never_wrong_data(tmp_path):
    dirs = [str(tmp_path / "n0"), str(tmp_path / "n1")]
    cfg = small_config(tmp_path / "s", nvme_paths=dirs, host_bytes=1 * MiB)
    values = {
        "raw multi-block": (random_tensor((100_000,), torch.float32, seed=8), False),
        "compressed": (torch.randn(60_000), True),
        "tiny": (torch.tensor(3.5), False),
        "int8 odd size": (random_tensor((4_099,), torch.int8, seed=9), False),
    }
    with tiered.TieredStore.open(cfg) as store:
        for key, (value, compress) in values.items():
            store.sync.put(key, value, compress=compress)
        assert store.info("compressed").codec != "raw"
    files = [os.path.join(d, f"swap-{i:02d}.bin") for d in dirs for i in range(cfg.swap_files_per_dir)]
    extents = record_extents(cfg.path)
    rng = random.Random(10)
    with tiered.TieredStore.open(cfg) as store:
        for _ in range(40):
            key = rng.choice(sorted(values))
            stored, exts = extents[key]
            file, offset = locate(exts, rng.randrange(stored))  # a logical byte of the stored payload
            where = (files[file], offset, rng.randrange(8))
            flip_bit(*where)
            try:
                with pytest.raises(ChecksumError, match=f"'{key}'"):
                    store.sync.get(key)
                with pytest.raises(ChecksumError, match=f"'{key}'"):
                    store.sync.prefetch(key, "host").result(timeout=60)
                assert store.info(key).tiers == (Tier.NVME,)
            finally:
                flip_bit(*where)
            for other, (value, _) in values.items():  # the rest, and the repaired one, read back intact
                assert same_bytes(store.sync.get(other), value), other
        # Padding past the payload is outside the checksums and never read back as data.
        stored, exts = extents["tiny"]
        file, offset, length = exts[0]
        flip_bit(files[file], offset + length - 1, 0)
        assert same_bytes(store.sync.get("tiny"), values["tiny"][0])


# ------------------------------------------------------------------- a damaged manifest


def damaged_store(tmp_path) -> tiered.StoreConfig:
    cfg = small_config(tmp_path / "s")
    with tiered.TieredStore.open(cfg) as store:
        for i in range(30):
            store.sync.put(f"key-{i}", random_tensor((2_000 + i,), torch.float32, seed=i))
    return cfg


def _sql(cfg: tiered.StoreConfig, *statements: str) -> None:
    db = sqlite3.connect(os.path.join(cfg.path, "manifest.sqlite"), isolation_level=None)
    try:
        for statement in statements:
            db.execute(statement)
    finally:
        db.close()


def _overwrite(cfg: tiered.StoreConfig, offset: int, data: bytes, truncate: bool = False) -> None:
    with open(os.path.join(cfg.path, "manifest.sqlite"), "r+b") as f:
        if truncate:
            f.truncate(offset)
        else:
            f.seek(offset)
            f.write(data)


DAMAGE = {
    "truncated to 0 bytes": lambda cfg: _overwrite(cfg, 0, b"", truncate=True),
    "truncated to 100 bytes": lambda cfg: _overwrite(cfg, 100, b"", truncate=True),
    "truncated to half": lambda cfg: _overwrite(
        cfg, os.path.getsize(os.path.join(cfg.path, "manifest.sqlite")) // 2, b"", truncate=True),
    "garbage header": lambda cfg: _overwrite(cfg, 0, random.Random(1).randbytes(512)),
    "garbage pages": lambda cfg: _overwrite(cfg, 4096, random.Random(2).randbytes(8192)),
    "deleted": lambda cfg: os.unlink(os.path.join(cfg.path, "manifest.sqlite")),
    "wrong schema": lambda cfg: _sql(cfg, "DROP TABLE entries", "CREATE TABLE entries (key TEXT, blob BLOB)"),
    "future format": lambda cfg: _sql(cfg, "UPDATE meta SET value = '99' WHERE name = 'format'"),
    "layout changed": lambda cfg: _sql(cfg, "UPDATE meta SET value = '3' WHERE name = 'swap_files_per_dir'"),
}

#: Damage to one record: the store opens, refuses that key by name and serves the others.
RECORD_DAMAGE = {
    "bad shape": lambda cfg: _sql(cfg, "UPDATE entries SET shape = '{\"a\": 1}' WHERE key = 'key-3'"),
    "size disagrees with shape": lambda cfg: _sql(cfg, "UPDATE entries SET shape = '[9999]' WHERE key = 'key-4'"),
    "unknown dtype": lambda cfg: _sql(cfg, "UPDATE entries SET dtype = 'float7' WHERE key = 'key-5'"),
    "cut extents": lambda cfg: _sql(cfg, "UPDATE entries SET extents = substr(extents, 1, 20) WHERE key = 'key-6'"),
    "missing checksums": lambda cfg: _sql(cfg, "UPDATE entries SET crcs = x'' WHERE key = 'key-7'"),
    "overlapping extents": lambda cfg: _sql(
        cfg, "UPDATE entries SET extents = (SELECT extents FROM entries WHERE key = 'key-1') WHERE key = 'key-2'"),
    "extent past the end": lambda cfg: _sql(
        cfg, "UPDATE entries SET extents = x'000000000000000000000000100000000040000000000000' WHERE key = 'key-8'"),
    "checksums set to NULL": lambda cfg: _sql(cfg, "UPDATE entries SET crcs = NULL WHERE key = 'key-9'"),
    "checksums and flags set to NULL's": lambda cfg: _sql(cfg, "UPDATE entries SET crcs = NULL, flags = 1 "
                                                                 "WHERE key = 'key-10'"),
    "key renamed": lambda cfg: _sql(cfg, "UPDATE entries SET key = 'key-11x' WHERE key = 'key-11'"),
    "record checksum removed": lambda cfg: _sql(cfg, "UPDATE entries SET checksum = NULL WHERE key = 'key-12'"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_manifest_is_a_manifest_error_with_advice(tmp_path, damage):
    cfg = damaged_store(tmp_path)
    for name in os.listdir(cfg.path):  # a clean close leaves no WAL; make sure of it
        assert not name.endswith("-wal") or os.path.getsize(os.path.join(cfg.path, name)) == 0
    DAMAGE[damage](cfg)
    before = {n: _digest(os.path.join(cfg.path, n)) for n in os.listdir(cfg.path) if n != "LOCK"}
    for _ in range(2):  # the failed open released the lock, changed nothing, and fails the same way again
        with pytest.raises(ManifestError) as info:
            tiered.TieredStore.open(cfg)
        message = str(info.value)
        advice = ("backup", "fsck", "open it with", "version")
        assert any(word in message for word in advice), message
        assert cfg.path in message or "key-" in message, message
    after = {n: _digest(os.path.join(cfg.path, n)) for n in os.listdir(cfg.path) if n != "LOCK"}
    assert after == before, "a refused open must leave the directory as it was, for recovery"


@pytest.mark.parametrize("damage", sorted(RECORD_DAMAGE))
def test_a_damaged_record_is_never_served_and_the_rest_is(tmp_path, damage):
    cfg = damaged_store(tmp_path)
    RECORD_DAMAGE[damage](cfg)
    with tiered.TieredStore.open(cfg) as store:
        keys = set(store.keys())
        damaged = {f"key-{i}" for i in range(30)} - keys
        assert len(damaged) == 1 and keys <= {f"key-{i}" for i in range(30)}, "no phantom key, one key refused"
        victim = damaged.pop()
        row_key = victim + "x" if damage == "key renamed" else victim  # the key the damaged row holds now
        with pytest.raises(ManifestError, match=rf"record of '{row_key}'.*damaged.*fsck {cfg.path} --delete-damaged"):
            store.sync.get(row_key)
        if row_key != victim:
            with pytest.raises(KeyError, match="1 damaged manifest record"):
                store.sync.get(victim)
        for key in keys:
            i = int(key.split("-")[1])
            assert same_bytes(store.sync.get(key), random_tensor((2_000 + i,), torch.float32, seed=i)), key
        store.sync.put("fresh", torch.ones(3))  # the store stays usable
    with StoreDirectory.open(cfg.path) as directory:
        report = check_store(directory)
        shown = inspect_store(directory)
    assert [d.key for d in report.damaged] == [row_key] and not report.healthy
    assert shown.damaged == (row_key,), "inspect marks the row it lists as damaged"


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ------------------------------------------------------------------- a real small filesystem


@pytest.fixture(params=["tmpfs", "ext4-loop"])
def small_fs(request, tmp_path):
    """A freshly mounted filesystem of a few MiB (skipped where this process may not mount)."""
    yield from mounted(request.param, tmp_path, mib=3 if request.param == "tmpfs" else 6)


def test_full_swap_filesystem(tmp_path, small_fs):
    """Swap files on a small filesystem: puts and write-downs fail cleanly when it is full, and
    work again once entries are deleted."""
    cfg = small_config(tmp_path / "s", nvme_paths=[os.path.join(small_fs, "nvme")], host_bytes=512 * KiB)
    put = {}
    with tiered.TieredStore.open(cfg) as store:
        for i in range(100):
            value = random_tensor((50_000,), torch.float32, seed=i)
            try:
                store.sync.put(f"k{i}", value)
            except CapacityError as exc:
                assert "free" in str(exc) and ("disk" in str(exc) or "space" in str(exc)), exc
                assert f"k{i}" not in store
                break
            put[f"k{i}"] = value
        else:
            pytest.fail("a 3-6 MiB filesystem took 20 MB")
        host = random_tensor((100_000,), torch.float32, seed=999)
        store.sync.put("h", host, tier="host")
        with pytest.raises(CapacityError):
            store.sync.flush()
        assert store.info("h").tiers == (Tier.HOST,)
        assert_no_leak(store)
        for key, value in put.items():
            assert same_bytes(store.sync.get(key), value), key
        for key in list(put)[:3]:
            store.sync.delete(key)
            del put[key]
        store.sync.flush()
        assert store.info("h").tiers == (Tier.HOST, Tier.NVME)
        put["h"] = host
    with tiered.TieredStore.open(cfg) as store:
        assert set(store.keys()) == set(put)
        for key, value in put.items():
            assert same_bytes(store.sync.get(key), value), key
        assert_no_leak(store)


def test_full_manifest_filesystem(tmp_path, small_fs):
    """The manifest on a full filesystem: commits fail with CapacityError naming the key, a delete
    that cannot commit keeps its key and extents, close still works, and nothing is lost."""
    cfg = small_config(os.path.join(small_fs, "s"))
    a = random_tensor((30_000,), torch.float32, seed=11)
    with tiered.TieredStore.open(cfg) as store:
        store.sync.put("a", a)
    with tiered.TieredStore.open(cfg) as store:  # a fresh WAL: the next commit must grow it
        filler = fill(small_fs)
        with pytest.raises(CapacityError, match="'b'"):
            store.sync.put("b", torch.ones(30_000))
        with pytest.raises(CapacityError, match="'a'"):
            store.sync.delete("a")
        assert same_bytes(store.sync.get("a"), a)
        os.unlink(filler)
        b = random_tensor((30_000,), torch.float32, seed=12)
        store.sync.put("b", b)  # must not land on a's extents
        fill(small_fs)  # and close on a full disk still releases everything
    os.unlink(os.path.join(small_fs, "filler"))
    with tiered.TieredStore.open(cfg) as store:
        assert sorted(store.keys()) == ["a", "b"]
        assert same_bytes(store.sync.get("a"), a) and same_bytes(store.sync.get("b"), b)
        assert_no_leak(store)
