"""O_DIRECT's memory alignment as the kernel reports it: caller tensors aligned to it, page-aligned or
not, move in place; the rest, and every short tail, go through staging, and no byte outside a
caller's tensor is read into."""

from __future__ import annotations

import pytest
import torch

import tiered
from tests.conftest import random_tensor, same_bytes
from tiered.config import ALIGNMENT
from tiered.io import open_file
from tiered.io.files import direct_io_memory_alignment
from tiered.io.spans import Span, aligned_views, spans_of_tensor

KiB = 1024
MiB = 1024 * KiB


def test_the_kernel_reports_a_power_of_two_up_to_a_page_and_a_page_without_o_direct(tmp_path):
    direct = open_file(str(tmp_path / "d.bin"), direct=True)
    buffered = open_file(str(tmp_path / "b.bin"), direct=False)
    try:
        align = direct_io_memory_alignment(direct)
        assert 1 <= align <= ALIGNMENT and align & (align - 1) == 0, align
        assert direct_io_memory_alignment(buffered) == ALIGNMENT
    finally:
        direct.close()
        buffered.close()


def _bytes_at(offset: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A page-aligned backing buffer and a uint8 view ``nbytes`` long starting ``offset`` bytes into it."""
    backing = tiered.empty_aligned((offset + nbytes + ALIGNMENT,), torch.uint8)
    return backing, backing[offset:offset + nbytes]


def test_aligned_views_checks_addresses_against_the_memory_alignment():
    _, t = _bytes_at(512, 2 * MiB)
    spans = spans_of_tensor(t)
    assert spans[0].view is not None  # a large CPU tensor always offers its bytes
    assert aligned_views(spans, 0, MiB, ALIGNMENT) is None  # 512 bytes into a page: not for a page
    views = aligned_views(spans, 0, MiB, ALIGNMENT, 512)
    assert views is not None and sum(len(v) for v in views) == MiB
    assert aligned_views(spans, 64, MiB, ALIGNMENT, 512) is None  # 576 bytes in
    assert aligned_views(spans, MiB, 2 * MiB - 100, ALIGNMENT, 512) is not None  # rounds up inside the tensor
    # A tensor ending mid-page: its tail rounds up past the view (exactly the tensor), so it is staged.
    short = spans_of_tensor(t[: 2 * MiB - 100])
    assert aligned_views(short, MiB, 2 * MiB - 100, ALIGNMENT, 512) is None
    assert aligned_views(short, 0, MiB, ALIGNMENT, 512) is not None


def test_aligned_views_needs_whole_pages_between_pieces():
    _, a = _bytes_at(512, 2 * MiB)
    _, b = _bytes_at(512, 2 * MiB)
    two = spans_of_tensor(a) + spans_of_tensor(b)
    assert aligned_views(two, MiB, 3 * MiB, ALIGNMENT, 512) is not None  # 1 MiB of each
    assert aligned_views(two, MiB + 512, 3 * MiB, ALIGNMENT, 512) is None  # a first piece of 1 MiB - 512
    uneven = [Span(a[: MiB + 512], spans_of_tensor(a)[0].view[: MiB + 512])] + spans_of_tensor(b)
    assert aligned_views(uneven, 0, 2 * MiB, ALIGNMENT, 512) is None


@pytest.fixture
def nvme_config(tmp_path) -> tiered.StoreConfig:
    return tiered.StoreConfig(path=str(tmp_path / "store"), host_bytes=0, device_bytes=0, block_size=256 * KiB,
                              queue_depth=4, io_threads=2, staging_buffers=2, swap_grow_bytes=4 * MiB)


async def test_tensors_aligned_as_the_disk_needs_move_in_place_and_nothing_around_them_changes(nvme_config):
    async with await tiered.TieredStore.open_async(nvme_config) as store:
        align = store._nvme.memory_alignment
        counters = store._io.counters
        value = random_tensor((2 * MiB + 100,), torch.uint8, seed=4)  # 8 whole blocks and a short tail
        _, src = _bytes_at(align, value.numel())
        src.copy_(value)
        await store.put("k", src, tier="nvme")
        assert counters.write_requests == 9 and counters.staged_writes == 1  # only the tail is staged

        backing, out = _bytes_at(align, value.numel())
        backing.fill_(0xA5)
        out.zero_()
        assert await store.get("k", out=out) is out
        assert counters.read_requests == 9 and counters.staged_reads == 1
        assert same_bytes(out, value)
        assert bool((backing[:align] == 0xA5).all()) and bool((backing[align + value.numel():] == 0xA5).all())


async def test_tensors_short_of_the_alignment_are_staged_and_round_trip(nvme_config):
    async with await tiered.TieredStore.open_async(nvme_config) as store:
        align = store._nvme.memory_alignment
        # Half the alignment past a page: short of it wherever there is one to fall short of (on a disk
        # whose O_DIRECT takes any address, one byte past, which moves in place).
        offset = ALIGNMENT + max(align // 2, 1)
        staged = 8 if align > 1 else 0
        counters = store._io.counters
        value = random_tensor((2 * MiB,), torch.uint8, seed=5)
        _, src = _bytes_at(offset, value.numel())
        src.copy_(value)
        await store.put("k", src, tier="nvme")
        assert counters.write_requests == 8 and counters.staged_writes == staged
        backing, out = _bytes_at(offset, value.numel())
        backing.fill_(0xA5)
        await store.get("k", out=out)
        assert counters.read_requests == 8 and counters.staged_reads == staged
        assert same_bytes(out, value)
        assert bool((backing[:offset] == 0xA5).all())
