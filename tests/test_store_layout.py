"""TieredStore.nvme_layout: the swap-file ranges it reports hold exactly the entry's stored bytes."""

from __future__ import annotations

import os

import pytest
import torch

import tiered
from tiered import Tier

from conftest import KiB, MiB, random_tensor


def read_ranges(layout: tuple[tiered.SwapExtent, ...]) -> bytes:
    """The bytes at every range, in order, read with plain (buffered) reads."""
    out = bytearray()
    for piece in layout:
        with open(piece.path, "rb") as f:
            f.seek(piece.offset)
            data = f.read(piece.length)
        assert len(data) == piece.length, f"short read of {piece}"
        out += data
    return bytes(out)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


async def test_ranges_hold_the_tensor_bytes_across_directories(tmp_path):
    # Two directories stripe a large entry: its layout has a range in each, in the order of its bytes.
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    cfg = tiered.StoreConfig(path=str(tmp_path / "s"), nvme_paths=dirs, host_bytes=0, device_bytes=0,
                             block_size=64 * KiB, swap_grow_bytes=1 * MiB, result_pool_bytes=0)
    async with await tiered.TieredStore.open_async(cfg) as store:
        t = random_tensor((300_001,), torch.float32, seed=3)
        await store.put("big", t, tier=Tier.NVME)
        layout = store.nvme_layout("big")
        assert len({os.path.dirname(p.path) for p in layout}) == 2
        assert sum(p.length for p in layout) == t.numel() * t.element_size()
        assert read_ranges(layout) == raw_bytes(t)


async def test_compressed_entries_report_their_stored_bytes(tmp_path):
    cfg = tiered.StoreConfig(path=str(tmp_path / "s"), host_bytes=0, device_bytes=0, block_size=64 * KiB,
                             result_pool_bytes=0)
    async with await tiered.TieredStore.open_async(cfg) as store:
        t = torch.zeros(200_000, dtype=torch.bfloat16)
        await store.put("z", t, tier=Tier.NVME, compress=True)
        layout = store.nvme_layout("z")
        assert sum(p.length for p in layout) == store.info("z").stored_nbytes < t.numel() * t.element_size()


async def test_a_new_version_moves_and_memory_only_entries_have_no_ranges(tmp_path):
    cfg = tiered.StoreConfig(path=str(tmp_path / "s"), host_bytes=4 * MiB, device_bytes=0, block_size=64 * KiB,
                             result_pool_bytes=0)
    async with await tiered.TieredStore.open_async(cfg) as store:
        first, second = random_tensor((4096,), torch.int32, seed=1), random_tensor((4096,), torch.int32, seed=2)
        await store.put("k", first, tier=Tier.NVME)
        before = store.nvme_layout("k")
        await store.put("k", second, tier=Tier.NVME)
        after = store.nvme_layout("k")
        assert read_ranges(after) == raw_bytes(second)
        assert before != after  # committed extents are never written again
        await store.put("host-only", first, tier=Tier.HOST)
        assert store.nvme_layout("host-only") == ()
        with pytest.raises(tiered.KeyNotFoundError, match="'missing'"):
            store.nvme_layout("missing")
