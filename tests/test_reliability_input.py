"""Bad and odd input, one test each: what the store accepts, and the clear error for what it refuses.

Decisions (docs/reliability.md lists them too):
- values: any dense tensor with data is accepted and stored by value: views (non-contiguous,
  overlapping, offset, conjugate and negative views), 0-d and empty tensors, every dtype, tensors
  requiring grad (stored detached). Non-tensors, sparse, meta, nested and quantized tensors are a
  TypeError saying what to do instead.
- keys: any valid Unicode string, including "", very long, "../x", "/abs" and NUL (keys never touch
  the filesystem); a non-string is a TypeError, a string with lone surrogates a ValueError.
- budgets: negative is a ValueError naming the field; zero is allowed and makes every non-empty
  tensor a CapacityError for that tier (empty tensors take no space and are accepted).
- directories: created 0700 when missing; one that cannot be created or written is an OSError
  naming the path and the setting. A store directory open elsewhere is a StoreLockedError.
- after close every operation raises StoreClosedError; introspection (keys, len, in, info, stats,
  nvme_space) keeps showing the state at close.
- the sync facade and Prefetch.result() on the store's own loop thread raise RuntimeError
  instead of deadlocking; from any other thread or event loop they work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import threading

import numpy as np
import pytest
import torch
from conftest import ALL_DTYPES, KiB, MiB, random_tensor, same_bytes
from small_filesystems import mounted

import tiered
from tiered import CapacityError, StoreClosedError, StoreLockedError, Tier, TieredStore

pytestmark = pytest.mark.timeout(120)
TIERS = [Tier.DEVICE, Tier.HOST, Tier.NVME]


def make_config(path, **changes) -> tiered.StoreConfig:
    settings = dict(path=str(path), device_bytes=1 * MiB, host_bytes=2 * MiB, block_size=64 * KiB,
                    queue_depth=4, io_threads=2, swap_grow_bytes=1 * MiB, result_pool_bytes=0)
    settings.update(changes)
    return tiered.StoreConfig(**settings)


@pytest.fixture
def cfg(tmp_path) -> tiered.StoreConfig:
    return make_config(tmp_path / "store")


def files_under(path) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names}


# ----------------------------------------------------------------------------------- values


@pytest.mark.parametrize("value", [None, 3, 2.5, [1.0, 2.0], (1,), "tensor", b"\x00\x01", {"a": 1},
                                   np.ones(3, dtype=np.float32), torch.Size([2, 3])], ids=repr)
async def test_non_tensor_values_are_type_errors(cfg, value):
    async with await TieredStore.open_async(cfg) as store:
        with pytest.raises(TypeError, match=rf"torch\.Tensor, got {type(value).__name__}"):
            await store.put("k", value)
        with pytest.raises(TypeError, match="torch.Tensor"):
            store.sync.put("k", value)
        assert "k" not in store and len(store) == 0
        await store.put("k", torch.ones(2))  # and the store still works
        with pytest.raises(TypeError, match="out must be a torch.Tensor"):
            await store.get("k", out=value if value is not None else [0.0, 0.0])


def _views() -> dict[str, torch.Tensor]:
    base = random_tensor((24, 40), torch.float32, seed=1)
    c = torch.complex(torch.randn(300), torch.randn(300))
    return {
        "transposed": base.t(),
        "strided slice": base[1::3, ::7],
        "storage offset": base.reshape(-1)[17:500],
        "expanded (stride 0)": base[3].expand(5, 40),
        "overlapping windows": base.reshape(-1).as_strided((50, 16), (3, 1)),
        "conjugate view": c.conj(),
        "negative view": c.conj().imag,
        "unfold (overlapping)": base.reshape(-1).unfold(0, 8, 2),
    }


@pytest.mark.parametrize("tier", TIERS, ids=str)
async def test_views_are_stored_by_value(cfg, tier):
    views = _views()
    assert views["conjugate view"].is_conj() and views["negative view"].is_neg()
    expected = {name: v.resolve_conj().resolve_neg().contiguous().clone() for name, v in views.items()}
    async with await TieredStore.open_async(cfg) as store:
        for name, view in views.items():
            await store.put(name, view, tier=tier)
            got = await store.get(name)
            assert got.is_contiguous() and not got.is_conj() and not got.is_neg()
            assert same_bytes(got, expected[name]), name
    async with await TieredStore.open_async(cfg) as store:  # written down on close, read from nvme
        for name in views:
            assert same_bytes(await store.get(name), expected[name]), name


@pytest.mark.parametrize("compress", [False, True])
async def test_zero_d_and_empty_tensors(cfg, compress):
    shapes = [(), (0,), (0, 3), (3, 0, 2), (1,), (1, 1, 1)]
    values = {f"{tier.value}{shape}": (random_tensor(shape, torch.float64, seed=len(shape)), tier)
              for tier in TIERS for shape in shapes}
    async with await TieredStore.open_async(cfg) as store:
        for key, (value, tier) in values.items():
            await store.put(key, value, tier=tier, compress=compress)
            info = store.info(key)
            assert info.shape == tuple(value.shape) and info.nbytes == value.numel() * 8
            assert same_bytes(await store.get(key), value), key
            out = torch.empty_like(value)
            assert (await store.get(key, out=out)) is out and same_bytes(out, value)
    async with await TieredStore.open_async(cfg) as store:
        for key, (value, _) in values.items():
            assert same_bytes(await store.get(key), value), key
        empty = [k for k, (v, _) in values.items() if v.numel() == 0]
        assert all(store.info(k).stored_nbytes == 0 for k in empty)


async def test_every_dtype_compressed_and_reopened(cfg):
    """test_conformance covers every dtype in every tier; here: the codec and the manifest's dtype names."""
    values = {str(d): random_tensor((7, 129), d, seed=i) for i, d in enumerate(ALL_DTYPES)}
    async with await TieredStore.open_async(cfg) as store:
        for key, value in values.items():
            await store.put(key, value, compress=True)
    async with await TieredStore.open_async(cfg) as store:
        for key, value in values.items():
            got = await store.get(key)
            assert got.dtype == value.dtype and same_bytes(got, value), key
    for required in (torch.complex64, torch.complex128, torch.bool, torch.uint8, torch.float8_e4m3fn,
                     torch.float8_e5m2):
        assert str(required) in values


@pytest.mark.parametrize("tier", TIERS, ids=str)
async def test_tensors_requiring_grad_are_stored_detached(cfg, tier):
    param = torch.nn.Parameter(torch.randn(100))
    nonleaf = param * 3
    async with await TieredStore.open_async(cfg) as store:
        await store.put("param", param, tier=tier)
        await store.put("nonleaf", nonleaf, tier=tier)
        for key, src in (("param", param), ("nonleaf", nonleaf)):
            got = await store.get(key)
            assert not got.requires_grad and got.grad_fn is None
            assert same_bytes(got, src.detach()), key
    assert param.grad is None and param.requires_grad and isinstance(param, torch.nn.Parameter)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's "beta"/"prototype" notes for CSR and nested tensors
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "meta", "nested",
                                  "nested jagged", "quantized"])
async def test_sparse_meta_nested_and_quantized_tensors_are_type_errors(cfg, kind):
    dense = torch.eye(4)
    value = {
        "sparse_coo": lambda: dense.to_sparse(),
        "sparse_csr": lambda: dense.to_sparse_csr(),
        "sparse_csc": lambda: dense.to_sparse_csc(),
        "sparse_bsr": lambda: dense.to_sparse_bsr((2, 2)),
        "meta": lambda: torch.empty(4, 4, device="meta"),
        "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "nested jagged": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        "quantized": lambda: torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8),
    }[kind]()
    advice = {"meta": "meta device", "nested": "unbind", "nested jagged": "unbind", "quantized": "int_repr"}.get(
        kind, "to_dense")
    async with await TieredStore.open_async(cfg) as store:
        for tier in TIERS:
            with pytest.raises(TypeError, match=advice):
                await store.put("k", value, tier=tier)
        assert "k" not in store


# ----------------------------------------------------------------------------------- keys


ODD_KEYS = ["", " ", "x" * 100_000, "../x", "../../etc/passwd", "/abs/path", "a/b\\c", "a\x00b", "\n\t",
            "ключ ✓ 🙂 مفتاح", "e\u0301", "CON", ".", "..", "LOCK", "manifest.sqlite", "swap-00.bin"]


async def test_odd_keys_are_plain_strings(cfg, tmp_path):
    before = files_under(tmp_path)
    async with await TieredStore.open_async(cfg) as store:
        for i, key in enumerate(ODD_KEYS):
            await store.put(key, torch.full((10,), float(i)), tier=TIERS[i % 3])
        for i, key in enumerate(ODD_KEYS):
            assert torch.equal(await store.get(key), torch.full((10,), float(i))), repr(key[:20])
    async with await TieredStore.open_async(cfg) as store:
        assert sorted(store.keys()) == sorted(ODD_KEYS)
        for i, key in enumerate(ODD_KEYS):
            assert torch.equal(await store.get(key), torch.full((10,), float(i))), repr(key[:20])
        await store.delete("../x")
        assert "../x" not in store and "x" * 100_000 in store
    created = files_under(tmp_path) - before
    allowed = {"LOCK", "manifest.sqlite", "manifest.sqlite-wal", "manifest.sqlite-shm", "swap-00.bin", "swap-01.bin",
               "swap-00.id", "swap-01.id"}
    assert {os.path.relpath(p, "store") for p in created} <= allowed, created


@pytest.mark.parametrize("key, error", [(3, TypeError), (b"k", TypeError), (None, TypeError), (("a",), TypeError),
                                        ("\ud800", ValueError), ("ok\udfffok", ValueError)], ids=repr)
async def test_keys_that_are_not_valid_strings_are_refused(cfg, key, error):
    async with await TieredStore.open_async(cfg) as store:
        await store.put("good", torch.ones(3))
        for call in (lambda: store.put(key, torch.ones(3)), lambda: store.get(key), lambda: store.delete(key),
                     lambda: store.evict(key)):
            with pytest.raises(error, match="key"):
                await call()
        with pytest.raises(error):
            store.sync.put(key, torch.ones(3), tier="host")
        await store.flush()  # nothing half-written blocks the commit of the next batch
    async with await TieredStore.open_async(cfg) as store:
        assert store.keys() == ["good"]


async def test_bad_device_tier_and_compress_arguments(cfg):
    async with await TieredStore.open_async(cfg) as store:
        await store.put("k", torch.ones(4))
        with pytest.raises(ValueError, match="'banana'"):
            await store.get("k", device="banana")
        with pytest.raises(ValueError, match="'ssd'"):
            await store.put("k", torch.ones(4), tier="ssd")
        with pytest.raises(ValueError, match="'ssd'"):
            await store.prefetch("k", "ssd")
        with pytest.raises(TypeError, match="'yes'"):
            await store.put("k", torch.ones(4), compress="yes")
        with pytest.raises(ValueError, match="shape"):
            await store.get("k", out=torch.empty(5))
        with pytest.raises(ValueError, match="contiguous"):
            await store.get("k", out=torch.empty(4, 2)[:, 0])
        assert torch.equal(await store.get("k"), torch.ones(4))


# ----------------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("field", ["device_bytes", "host_bytes", "nvme_bytes"])
def test_negative_budgets_are_value_errors(tmp_path, field):
    with pytest.raises(ValueError, match=rf"{field}.*-1"):
        make_config(tmp_path / "s", **{field: -1})


@pytest.mark.parametrize("tier", TIERS, ids=str)
async def test_a_zero_budget_refuses_every_non_empty_tensor(tmp_path, tier):
    field = {Tier.DEVICE: "device_bytes", Tier.HOST: "host_bytes", Tier.NVME: "nvme_bytes"}[tier]
    cfg = make_config(tmp_path / "s", **{field: 0})
    async with await TieredStore.open_async(cfg) as store:
        with pytest.raises(CapacityError, match=rf"{tier.value} tier.*budget is 0 bytes"):
            await store.put("k", torch.ones(1), tier=tier)
        assert "k" not in store
        await store.put("empty", torch.empty(0, 3), tier=tier)  # takes no space
        assert (await store.get("empty")).shape == (0, 3)
        other = Tier.NVME if tier is not Tier.NVME else Tier.HOST
        await store.put("k", torch.ones(1), tier=other)
        if tier is Tier.NVME:
            with pytest.raises(CapacityError, match="nvme"):  # nowhere to write it down
                await store.evict("k")
            assert store.info("k").tiers == (Tier.HOST,)
            await store.delete("k")  # flush_on_close cannot write it either


# ----------------------------------------------------------------------------------- directories


def test_a_missing_directory_is_created_private(tmp_path):
    cfg = make_config(tmp_path / "a" / "b" / "store", nvme_paths=[str(tmp_path / "n" / "swap")])
    with TieredStore.open(cfg) as store:
        store.sync.put("k", torch.ones(3))
    for d in (cfg.path, str(tmp_path / "n" / "swap")):
        assert os.stat(d).st_mode & 0o777 == 0o700, d


def test_a_new_store_is_not_put_among_other_files_unless_asked(tmp_path):
    """A directory holding files but no store is refused, naming them, and left as it was; with
    allow_other_files the store's files go beside them, and a reopen needs no flag."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match=r"is not empty and holds no store \('notes.txt'\).*allow_other_files=True"):
        TieredStore.open(make_config(mine))
    assert os.listdir(mine) == ["notes.txt"]
    with TieredStore.open(make_config(mine, allow_other_files=True)) as store:
        store.sync.put("k", torch.ones(3))
    with TieredStore.open(make_config(mine)) as store:
        assert torch.equal(store.sync.get("k"), torch.ones(3))
    assert (mine / "notes.txt").read_text() == "keep"
    striped = tmp_path / "striped"  # swap directories the user made inside the store's own are the store's
    for name in ("nvme0", "nvme1"):
        (striped / name).mkdir(parents=True)
    with TieredStore.open(make_config(striped, nvme_paths=[str(striped / "nvme0"), str(striped / "nvme1")])) as store:
        store.sync.put("k", torch.ones(3))


@pytest.mark.parametrize("field", ["path", "nvme_paths"])
def test_a_path_that_cannot_be_a_directory_is_a_clear_os_error(tmp_path, field):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = str(blocker / "store")
    cfg = make_config(tmp_path / "s") if field == "nvme_paths" else make_config(bad)
    if field == "nvme_paths":
        cfg = cfg.replace(nvme_paths=[bad])
    with pytest.raises(OSError, match=rf"cannot use .*a-file.*StoreConfig\.{field}.*Not a directory"):
        TieredStore.open(cfg)
    # Nothing stays locked or half-open: the same store directory opens with a good layout.
    with TieredStore.open(make_config(tmp_path / "s")) as store:
        store.sync.put("k", torch.ones(1))


@pytest.fixture
def read_only_dir(tmp_path):
    """A freshly mounted read-only tmpfs (skipped where this process may not mount)."""
    yield from mounted("tmpfs", tmp_path, mib=1, read_only=True)


@pytest.mark.parametrize("inside", [False, True])
def test_an_unwritable_directory_is_a_clear_os_error(tmp_path, read_only_dir, inside):
    path = os.path.join(read_only_dir, "store") if inside else read_only_dir
    with pytest.raises(OSError, match=rf"cannot use '{read_only_dir}.*StoreConfig\.path.*Read-only"):
        TieredStore.open(make_config(path))


# ----------------------------------------------------------------------------------- opened twice


def test_a_store_opened_twice_is_refused_and_the_first_keeps_working(cfg, tmp_path):
    link = tmp_path / "link"
    with TieredStore.open(cfg) as store:
        store.sync.put("k", torch.ones(3))
        for path in (cfg.path, str(link)):
            if path == str(link):
                os.symlink(cfg.path, link)
            with pytest.raises(StoreLockedError, match=rf"already open: it is in use by pid {os.getpid()} "
                                                       rf"\(store {re.escape(cfg.path)}\)"):
                TieredStore.open(make_config(path))
        with open(os.path.join(cfg.path, "LOCK")) as f:
            assert f.read().splitlines() == [str(os.getpid()), cfg.path]
        store.sync.put("k2", torch.zeros(3))
        assert torch.equal(store.sync.get("k"), torch.ones(3))


def test_concurrent_opens_one_wins(cfg):
    barrier = threading.Barrier(4)

    def attempt(_: int) -> object:
        barrier.wait()
        try:
            return TieredStore.open(cfg)
        except StoreLockedError as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(attempt, range(4)))
    stores = [r for r in results if isinstance(r, TieredStore)]
    assert len(stores) == 1 and sum(isinstance(r, StoreLockedError) for r in results) == 3, results
    stores[0].sync.put("k", torch.ones(1))
    stores[0].sync.close()


# ----------------------------------------------------------------------------------- after close


async def test_every_call_after_close_raises_store_closed(cfg):
    store = await TieredStore.open_async(cfg)
    await store.put("k", torch.ones(3), tier="host")
    await store.close()
    await store.close()  # idempotent, async and sync
    store.sync.close()
    calls = {
        "put": lambda: store.put("k", torch.ones(1)), "get": lambda: store.get("k"),
        "evict": lambda: store.evict("k"), "delete": lambda: store.delete("k"), "pin": lambda: store.pin("k"),
        "unpin": lambda: store.unpin("k"), "flush": lambda: store.flush(),
    }
    for call in calls.values():
        with pytest.raises(StoreClosedError, match="closed"):
            await call()
    sync_calls = {
        "put": lambda: store.sync.put("k", torch.ones(1)), "get": lambda: store.sync.get("k"),
        "evict": lambda: store.sync.evict("k"), "delete": lambda: store.sync.delete("k"),
        "pin": lambda: store.sync.pin("k"), "unpin": lambda: store.sync.unpin("k"),
        "flush": lambda: store.sync.flush(), "prefetch": lambda: store.prefetch("k"),
        "sync prefetch": lambda: store.sync.prefetch("k"), "set_access_order": lambda: store.set_access_order(["k"]),
    }
    for call in sync_calls.values():
        with pytest.raises(StoreClosedError, match="closed"):
            call()
    # Introspection shows the state at close: the host entry was flushed and is now clean.
    assert store.keys() == ["k"] and "k" in store and len(store) == 1
    assert not store.info("k").dirty and store.stats().puts == 1
    space = store.nvme_space()
    assert space.allocated_bytes == space.entry_bytes == 4096


def test_calls_racing_close_finish_or_raise_store_closed(cfg):
    store = TieredStore.open(cfg)
    returned: list[str] = []
    barrier = threading.Barrier(9)

    def writer(n: int) -> None:
        barrier.wait()
        for i in range(50):
            key = f"t{n}-{i}"
            try:
                store.sync.put(key, torch.full((1000,), float(i)), tier=TIERS[i % 3])
            except StoreClosedError:
                return
            returned.append(key)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    barrier.wait()
    store.sync.close()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a call racing close hung"
    with TieredStore.open(cfg) as reopened:  # everything that returned was flushed at close
        for key in returned:
            assert torch.equal(reopened.sync.get(key), torch.full((1000,), float(key.split("-")[1]))), key


# ----------------------------------------------------------------------------------- the store's own loop


def test_blocking_calls_on_the_store_loop_raise_instead_of_deadlocking(cfg):
    """test_concurrency covers sync get/put/flush/close there; these are the rest."""
    store = TieredStore.open(cfg)
    try:
        store.sync.put("k", torch.ones(10_000))
        outcome: concurrent.futures.Future = concurrent.futures.Future()

        def on_loop() -> None:
            results = {}
            calls = {
                "evict": lambda: store.sync.evict("k"), "delete": lambda: store.sync.delete("k"),
                "pin": lambda: store.sync.pin("k"), "unpin": lambda: store.sync.unpin("k"),
                "prefetch().result()": lambda: store.prefetch("k", "host").result(timeout=30),
            }
            for name, call in calls.items():
                try:
                    call()
                    results[name] = None
                except BaseException as exc:  # noqa: BLE001 - checked on the test thread
                    results[name] = exc
            outcome.set_result(results)

        store._loop_thread.loop.call_soon_threadsafe(on_loop)
        results = outcome.result(timeout=60)
        assert all(isinstance(e, RuntimeError) and "loop thread" in str(e) for e in results.values()), results
        assert torch.equal(store.sync.get("k"), torch.ones(10_000))
    finally:
        store.sync.close()


async def test_the_sync_facade_works_inside_another_running_loop(cfg):
    """Blocking the caller's own loop is the caller's choice; it must not deadlock the store."""
    async with await TieredStore.open_async(cfg) as store:
        store.sync.put("k", torch.arange(5), tier="host")
        assert torch.equal(store.sync.get("k"), torch.arange(5))
        store.sync.prefetch("k", "device").result(timeout=30)
        assert asyncio.get_running_loop().is_running()
