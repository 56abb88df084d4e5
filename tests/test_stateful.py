"""Model-based test: random operation sequences on a real store, checked against a plain dict.

A Hypothesis state machine drives a store over real swap files through the blocking facade
(``store.sync``) with budgets so tight that every few steps something is evicted, written down or
promoted, and checks after every step that the store agrees with ``{key: tensor}``: membership,
metadata, bit-exact contents, resident-set and budget bookkeeping, pins, and that a close and
reopen loses nothing.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import tiered
from tiered import CapacityError, KeyNotFoundError, Tier

KiB = 1024

DEVICE_BYTES = 64 * KiB
HOST_BYTES = 96 * KiB
#: Largest tensor the ordinary rules put: two of them overflow the device tier, two the host tier.
MAX_BYTES = 48 * KiB
#: A pinned entry is at most this big, so a put of MAX_BYTES always fits beside it.
MAX_PINNED_BYTES = 16 * KiB
PAGE = 4096

KEYS = ["a", "b", "c", "d", "ключ/ü", "e e"]
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.int64,
    torch.bool,
    torch.uint8,
    torch.float16,
    torch.complex64,
]
TIERS = [Tier.DEVICE, Tier.HOST, Tier.NVME]

keys = st.sampled_from(KEYS)
tiers = st.sampled_from(TIERS)
#: Where puts go: mostly to the memory tiers, which is what fills them.
put_tiers = st.sampled_from([Tier.DEVICE, Tier.HOST, Tier.NVME, Tier.DEVICE, Tier.HOST])
memory_tiers = st.sampled_from([Tier.DEVICE, Tier.HOST])


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int, noncontiguous: bool) -> torch.Tensor:
    """A tensor whose bytes are random (NaN payloads included); bools hold only 0 and 1."""
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    rng = np.random.default_rng(seed)
    if numel == 0:
        flat = torch.empty(0, dtype=dtype)
    elif dtype is torch.bool:
        flat = torch.from_numpy(rng.integers(0, 2, size=numel, dtype=np.uint8)).view(torch.bool)
    else:
        raw = rng.integers(0, 256, size=numel * _itemsize(dtype), dtype=np.uint8)
        flat = torch.from_numpy(raw).view(dtype)
    if noncontiguous and len(shape) >= 2:
        # Same logical shape, transposed memory layout: the store must not copy raw storage.
        swapped = (*shape[:-2], shape[-1], shape[-2])
        t = flat.reshape(swapped).transpose(-1, -2)
        assert tuple(t.shape) == shape
        return t
    return flat.reshape(shape)


@st.composite
def tensors(draw: st.DrawFn, min_bytes: int = 0, max_bytes: int = MAX_BYTES) -> torch.Tensor:
    """Random dtype, rank 0 to 3 (empty shapes included), up to ``max_bytes``, maybe non-contiguous."""
    dtype = draw(st.sampled_from(DTYPES))
    item = _itemsize(dtype)
    lo, hi = -(-min_bytes // item), max_bytes // item
    ndim = draw(st.sampled_from([1, 2, 3, 0] if lo <= 1 else [1, 2, 3]))
    if ndim == 0:
        shape: tuple[int, ...] = ()
    else:
        # Hypothesis favours small integers; draw a size class first so big tensors (the ones
        # that overflow tiers and span several 8 KiB blocks) are common.
        special = [n for n in (0, 1, PAGE // item, 8192 // item + 1, hi) if lo <= n <= hi]
        size_class = draw(st.sampled_from(["large", "large", "any", "special"]))
        if size_class == "large":
            numel = draw(st.integers(max(lo, hi // 3), hi))
        elif size_class == "any":
            numel = draw(st.integers(lo, hi))
        else:
            numel = draw(st.sampled_from(special))
        if numel == 0:
            # Empty tensors keep their rank: (0,), (3, 0), (2, 0, 5)...
            dims = draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim))
            dims[draw(st.integers(0, ndim - 1))] = 0
            shape = tuple(dims)
        else:
            # Factor numel into ndim dims, the leading ones small.
            dims = []
            rest = numel
            for _ in range(ndim - 1):
                d = draw(st.sampled_from([d for d in range(1, min(rest, 16) + 1) if rest % d == 0]))
                dims.append(d)
                rest //= d
            shape = (*dims, rest)
    seed = draw(st.integers(0, 2**32 - 1))
    noncontiguous = draw(st.booleans())
    return _make_tensor(dtype, shape, seed, noncontiguous)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (key, got.shape, want.shape)
    assert got.device.type == "cpu"
    assert torch.equal(raw_bytes(got), raw_bytes(want)), f"bytes of {key!r} differ"


class TieredStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tiered-stateful-")
        self.cfg = tiered.StoreConfig(
            path=self.dir,
            device_bytes=DEVICE_BYTES,
            host_bytes=HOST_BYTES,
            block_size=8192,
            swap_grow_bytes=65536,
            queue_depth=4,
            io_threads=2,
            cpu_threads=2,
            swap_files_per_dir=2,
        )
        self.store: tiered.TieredStore | None = tiered.TieredStore.open(self.cfg)
        self.model: dict[str, torch.Tensor] = {}
        #: The one pinned key (at most one at a time) and the tiers it held when last checked.
        self.pinned: str | None = None
        self.pinned_tiers: set[Tier] = set()
        #: Steps since the store was (re)opened: reopening resets every tier, so not too often.
        self.steps_open = 0

    def teardown(self) -> None:
        try:
            if self.store is not None:
                self.store.sync.close()
                self.store = None
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    def _forget_pin(self, key: str) -> None:
        if self.pinned == key:
            self.pinned, self.pinned_tiers = None, set()

    def _tiers(self, key: str) -> tuple[Tier, ...]:
        return self.store.info(key).tiers

    # ------------------------------------------------------------------ rules

    @initialize(
        items=st.lists(st.tuples(keys, tensors(), put_tiers), min_size=3, max_size=6, unique_by=lambda kt: kt[0])
    )
    def populate(self, items: list[tuple[str, torch.Tensor, Tier]]) -> None:
        for key, tensor, tier in items:
            self.store.sync.put(key, tensor, tier)
            self.model[key] = tensor.contiguous().clone()

    @rule(data=st.data())
    def put(self, data: st.DataObject) -> None:
        """Put one to three tensors (one argument, not three: Hypothesis picks rules with fewer
        arguments more often, and puts are what keep the tiers full)."""
        for _ in range(data.draw(st.integers(1, 3), label="count")):
            key = data.draw(keys, label="key")
            tier = data.draw(put_tiers, label="tier")
            tensor = data.draw(tensors(), label="tensor")
            expected = tensor.contiguous().clone()
            self.store.sync.put(key, tensor, tier)
            # The caller may reuse its tensor as soon as put returns: scribble over it.
            tensor.zero_()
            self.model[key] = expected
            info = self.store.info(key)
            assert info.tiers == (tier,), info
            assert info.dirty == (tier is not Tier.NVME)
            self._after_put(key)

    @rule(data=st.data(), tier=memory_tiers)
    def flood(self, data: st.DataObject, tier: Tier) -> None:
        """Put big tensors into one memory tier until it must have evicted: every unpinned copy
        there may go (written down first when it is the only one), the pinned one must stay."""
        evictions = self.store.stats().tiers[tier].evictions
        budget = DEVICE_BYTES if tier is Tier.DEVICE else HOST_BYTES
        written = 0
        for key in data.draw(st.permutations([k for k in KEYS if k != self.pinned]), label="keys"):
            tensor = data.draw(tensors(min_bytes=MAX_BYTES // 2, max_bytes=MAX_BYTES), label="tensor")
            self.store.sync.put(key, tensor, tier)
            self.model[key] = tensor.contiguous().clone()
            written += tensor.numel() * tensor.element_size()
            if written > budget:
                break
        # Distinct keys, more bytes than the budget: something was evicted.
        assert self.store.stats().tiers[tier].evictions > evictions

    def _after_put(self, key: str) -> None:
        """A put makes a new version; whatever the store decides about its pin, keep tracking it,
        and keep the premise the capacity reasoning rests on: at most one small pinned entry."""
        if self.pinned != key:
            return
        info = self.store.info(key)
        if info.pinned and info.nbytes <= MAX_PINNED_BYTES:
            self.pinned_tiers = set(info.tiers)
            return
        if info.pinned:
            self.store.sync.unpin(key)
        self._forget_pin(key)

    @rule(
        key=keys,
        tier=memory_tiers,
        tensor=st.one_of(
            tensors(min_bytes=DEVICE_BYTES + 1, max_bytes=HOST_BYTES - MAX_PINNED_BYTES),
            tensors(min_bytes=HOST_BYTES + 1, max_bytes=HOST_BYTES + 3 * PAGE),
        ),
    )
    def put_oversize(self, key: str, tensor: torch.Tensor, tier: Tier) -> None:
        """Bigger than the device tier's whole budget (maybe the host's): refused there, and the
        key keeps its old value; a host put of what fits the host budget succeeds."""
        budget = DEVICE_BYTES if tier is Tier.DEVICE else HOST_BYTES
        nbytes = tensor.numel() * tensor.element_size()
        before = self.store.info(key) if key in self.model else None
        if nbytes > budget:
            with pytest.raises(CapacityError):
                self.store.sync.put(key, tensor, tier)
            if before is None:
                assert key not in self.store
            else:
                assert self.store.info(key) == before
            return
        self.store.sync.put(key, tensor, tier)
        self.model[key] = tensor.contiguous().clone()
        self._after_put(key)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), use_out=st.booleans())
    def get(self, data: st.DataObject, use_out: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        want = self.model[key]
        if use_out:
            out = torch.empty_like(want)
            got = self.store.sync.get(key, out=out)
            assert got is out
        else:
            got = self.store.sync.get(key)
        assert_same(got, want, key)

    @precondition(lambda self: len(self.model) < len(KEYS))
    @rule(key=keys)
    def get_missing(self, key: str) -> None:
        if key in self.model:
            return
        with pytest.raises(KeyNotFoundError):
            self.store.sync.get(key)
        with pytest.raises(KeyNotFoundError):
            self.store.sync.prefetch(key)
        with pytest.raises(KeyNotFoundError):
            self.store.sync.evict(key)
        with pytest.raises(KeyNotFoundError):
            self.store.sync.delete(key)
        assert key not in self.store

    @rule(data=st.data(), atomic=st.booleans())
    def put_many(self, data: st.DataObject, atomic: bool) -> None:
        """Put one to three tensors in one call (atomic: to nvme, in one transaction)."""
        items = data.draw(st.dictionaries(keys, tensors(max_bytes=MAX_BYTES // 2), min_size=1, max_size=3),
                          label="items")
        tier = Tier.NVME if atomic else data.draw(put_tiers, label="tier")
        expected = {k: t.contiguous().clone() for k, t in items.items()}
        self.store.sync.put_many(items, tier, atomic=atomic)
        for key, value in expected.items():
            self.model[key] = value
            self._after_put(key)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def get_many(self, data: st.DataObject) -> None:
        wanted = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True))
        for key, got in zip(wanted, self.store.sync.get_many(wanted)):
            assert_same(got, self.model[key], key)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), many=st.booleans())
    def rename(self, data: st.DataObject, many: bool) -> None:
        """Move one or two values to other keys, replacing what those held: the entry keeps its
        tiers, pin and stored bytes, and no byte is read or written."""
        sources = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=2 if many else 1,
                                     unique=True), label="sources")
        targets = data.draw(st.lists(st.sampled_from([k for k in KEYS if k not in sources]), min_size=len(sources),
                                     max_size=len(sources), unique=True), label="targets")
        pairs = list(zip(sources, targets))
        before = {src: self.store.info(src) for src in sources}
        moved_bytes = self.store.stats().bytes_written, self.store.stats().bytes_read
        if many:
            self.store.sync.rename_many(pairs)
        else:
            self.store.sync.rename(*pairs[0])
        assert (self.store.stats().bytes_written, self.store.stats().bytes_read) == moved_bytes
        values = {dst: self.model.pop(src) for src, dst in pairs}
        pinned = self.pinned
        if pinned in targets and pinned not in sources:
            self._forget_pin(pinned)  # its value was replaced
        self.model.update(values)
        for src, dst in pairs:
            assert src not in self.store
            info, old = self.store.info(dst), before[src]
            assert (info.tiers, info.pinned, info.codec, info.stored_nbytes, info.dirty) == (
                old.tiers, old.pinned, old.codec, old.stored_nbytes, old.dirty), (old, info)
            if pinned == src:
                self.pinned = dst

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=tiers)
    def prefetch(self, data: st.DataObject, tier: Tier) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        nbytes = self.model[key].numel() * self.model[key].element_size()
        handle = self.store.sync.prefetch(key, tier)
        if tier is Tier.DEVICE and nbytes > DEVICE_BYTES:
            with pytest.raises(CapacityError):
                handle.result(timeout=60)
            assert tier not in self._tiers(key)
            return
        handle.result(timeout=60)
        assert handle.done()
        assert tier in self._tiers(key), (key, tier, self._tiers(key))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=tiers)
    def evict(self, data: st.DataObject, tier: Tier) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        if key == self.pinned:
            before = self._tiers(key)
            with pytest.raises(ValueError):
                self.store.sync.evict(key, tier)
            assert self._tiers(key) == before
            return
        self.store.sync.evict(key, tier)
        after = self._tiers(key)
        assert after, after
        assert all(t.rank >= tier.rank for t in after), (key, tier, after)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.store.sync.delete(key)
        del self.model[key]
        self._forget_pin(key)
        assert key not in self.store
        with pytest.raises(KeyNotFoundError):
            self.store.info(key)

    @precondition(lambda self: self.pinned is None and self.model)
    @rule(data=st.data(), tier=st.one_of(st.none(), tiers))
    def pin(self, data: st.DataObject, tier: Tier | None) -> None:
        small = sorted(k for k, t in self.model.items() if t.numel() * t.element_size() <= MAX_PINNED_BYTES)
        if not small:
            return
        key = data.draw(st.sampled_from(small))
        self.store.sync.pin(key, tier)
        info = self.store.info(key)
        assert info.pinned
        if tier is not None:
            assert tier in info.tiers, (tier, info)
        self.pinned, self.pinned_tiers = key, set(info.tiers)

    @precondition(lambda self: self.pinned is not None)
    @rule()
    def unpin(self) -> None:
        key = self.pinned
        self.store.sync.unpin(key)
        assert not self.store.info(key).pinned
        self._forget_pin(key)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=st.sampled_from([None, Tier.HOST]), raises=st.booleans())
    def modify(self, data: st.DataObject, tier: Tier | None, raises: bool) -> None:
        """Change a value in place (rotate its bytes: valid for every dtype): a memory copy is lent
        and stays the only copy, an nvme one is read and put to ``tier``; a block that raises keeps
        what it wrote."""
        key = data.draw(st.sampled_from(sorted(self.model)))
        top = self._tiers(key)[0]
        new = raw_bytes(self.model[key]).roll(1).clone()
        block = self.store.sync.modify(key, tier)
        with contextlib.suppress(ZeroDivisionError):
            with block as t:
                assert_same(t, self.model[key], key)
                raw_bytes(t).copy_(new)
                if raises:
                    1 / 0
        self.model[key] = new.view(self.model[key].dtype).reshape(self.model[key].shape)
        if top is Tier.NVME:
            assert self._tiers(key) == (tier or Tier.NVME,)
        else:
            assert self._tiers(key) == (top,)
        self._after_put(key)

    @rule()
    def flush(self) -> None:
        self.store.sync.flush()
        for key in self.model:
            info = self.store.info(key)
            assert not info.dirty and Tier.NVME in info.tiers, info

    @rule(order=st.one_of(st.none(), st.lists(keys, max_size=12)))
    def set_access_order(self, order: list[str] | None) -> None:
        self.store.set_access_order(order)

    @precondition(lambda self: self.model and self.steps_open >= 6)
    @rule()
    def close_and_reopen(self) -> None:
        self.steps_open = 0
        self.store.sync.close()
        with pytest.raises(tiered.StoreClosedError):
            self.store.sync.get("a")
        self.store = None
        self.store = tiered.TieredStore.open(self.cfg)
        self.pinned, self.pinned_tiers = None, set()
        assert sorted(self.store.keys()) == sorted(self.model)
        for key, want in self.model.items():
            info = self.store.info(key)
            assert info.tiers == (Tier.NVME,) and not info.dirty and not info.pinned, info
            assert_same(self.store.sync.get(key), want, key)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def keys_match(self) -> None:
        self.steps_open += 1
        if self.store is None:
            return
        assert sorted(self.store.keys()) == sorted(self.model)
        assert len(self.store) == len(self.model)
        for key in KEYS:
            assert (key in self.store) == (key in self.model)

    @invariant()
    def metadata_matches(self) -> None:
        if self.store is None:
            return
        for key, want in self.model.items():
            info = self.store.info(key)
            assert info.key == key
            assert info.dtype == want.dtype, (key, info)
            assert info.shape == tuple(want.shape), (key, info)
            assert info.nbytes == want.numel() * want.element_size(), (key, info)
            assert info.tiers, (key, info)
            assert info.dirty == (Tier.NVME not in info.tiers)
            assert info.stored_nbytes == (None if info.dirty else info.nbytes), info
            assert info.pinned == (key == self.pinned), (key, info, self.pinned)

    @invariant()
    def pinned_copies_stay(self) -> None:
        if self.store is None or self.pinned is None:
            return
        now = set(self._tiers(self.pinned))
        assert self.pinned_tiers <= now, (self.pinned, self.pinned_tiers, now)
        self.pinned_tiers = now

    @invariant()
    def accounting_is_exact(self) -> None:
        """The store is idle between steps, so every tier's occupancy is exactly the footprint of
        its resident copies: nothing leaked, nothing freed twice, nothing over budget."""
        if self.store is None:
            return
        stats = self.store.stats()
        for tier in TIERS:
            s = stats.tiers[tier]
            resident = [self.store.info(k) for k in self.model if tier in self.store.info(k).tiers]
            assert s.entries == len(resident), (tier, s, resident)
            footprint = self.store._tiers.backends[tier].footprint  # what the tier charges per copy
            expected = sum(footprint(i.stored_nbytes if tier is Tier.NVME else i.nbytes) for i in resident)
            assert s.used_bytes == expected, (tier, s.used_bytes, expected)
            if s.budget_bytes is not None:
                assert s.used_bytes <= s.budget_bytes, (tier, s)
        assert stats.tiers[Tier.DEVICE].budget_bytes == DEVICE_BYTES
        assert stats.tiers[Tier.HOST].budget_bytes == HOST_BYTES
        assert stats.entries == len(self.model)


TieredStoreMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestTieredStore = TieredStoreMachine.TestCase
