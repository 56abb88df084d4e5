"""The host budget is a ceiling: the host tier takes memory slab by slab as it fills, so opening a
store costs the same at any budget ([Note: host slabs] in tiered/backends/host_arena.py)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest
import torch

from tiered.backends.host import HostBackend
from tiered.backends.host_arena import SLAB_BYTES
from tiered.errors import CapacityError
from tiered.io.spans import spans_of_tensor

from conftest import MiB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Opens a store with each budget given in turn (the first only to warm up), puts one 1 MiB tensor in
#: its host tier and gets it back; prints each open's seconds and the resident set's growth over it all.
OPEN_AND_PUT = """
import json, os, sys, time, torch, tiered
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
tensor = torch.randn(256, 1024)
out = []
for i, budget in enumerate(sys.argv[2:]):
    before = rss()
    start = time.perf_counter()
    store = tiered.TieredStore.open(tiered.StoreConfig(path=os.path.join(sys.argv[1], str(i)), host_bytes=int(budget),
                                    staging_buffers=1, block_size=1 << 20, swap_grow_bytes=1 << 20))
    opened = time.perf_counter() - start
    store.sync.put("w", tensor, tier="host")
    assert torch.equal(store.sync.get("w"), tensor)
    out.append({"open_s": opened, "rss_grown": rss() - before})
    store.sync.close()
print(json.dumps(out))
"""


def test_a_large_host_budget_costs_nothing_until_used(tmp_path):
    """8 GiB of budget and one 1 MiB tensor: the resident set grows by a slab at most (plus the store's
    own buffers)."""
    proc = subprocess.run([sys.executable, "-c", OPEN_AND_PUT, str(tmp_path), str(64 * MiB), str(8 << 30),
                           str(64 * MiB)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    _, large, small = json.loads(proc.stdout)
    assert large["rss_grown"] < SLAB_BYTES + 64 * MiB, (small, large)


def _backend(budget: int, **kw) -> HostBackend:
    return HostBackend(budget, concurrent.futures.ThreadPoolExecutor(1), **kw)


@pytest.mark.parametrize("prefault", [True, False])
async def test_slabs_are_taken_on_demand_and_kept(prefault):
    host = _backend(2 * SLAB_BYTES + 64 * 1024, prefault=prefault)
    try:
        assert host.resident_bytes == 0
        first = await host.allocate(SLAB_BYTES - 4096)
        assert host.resident_bytes == SLAB_BYTES
        data = torch.arange(4096, dtype=torch.int32)  # 16 KiB: 4 KiB in the first slab, 12 KiB in the second
        across = await host.allocate(data.numel() * 4)
        assert host.resident_bytes == 2 * SLAB_BYTES
        assert [(e.offset, e.length) for e in across.extents] == [(SLAB_BYTES - 4096, 4096), (SLAB_BYTES, 12288)]
        await host.store(across, spans_of_tensor(data))
        back = torch.empty_like(data)
        await host.load(across, spans_of_tensor(back))
        assert torch.equal(back, data)
        host.release(first)
        host.release(across)
        again = await host.allocate(SLAB_BYTES)
        assert host.resident_bytes == 2 * SLAB_BYTES  # freed space is reused before a slab is taken
        host.release(again)
        last = await host.allocate(2 * SLAB_BYTES + 64 * 1024)  # the whole budget: a short last slab
        assert host.resident_bytes == host.budget == 2 * SLAB_BYTES + 64 * 1024
        with pytest.raises(CapacityError):
            await host.allocate(4096)
        host.release(last)
    finally:
        await host.close()
