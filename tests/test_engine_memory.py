"""Peak host RSS while training a model whose parameters + gradients + AdamW states are more than
4x the store's host budget, everything on nvme, the model built on the meta device.

Measured in a subprocess from /proc/self/status: VmHWM (peak resident set) at the end minus VmRSS
just before wrap (after importing torch and running a tiny warm-up step of plain torch, so torch's
own kernels and thread pools are in the baseline; with CUDA present, after creating CUDA's context,
over 100 MiB of host memory that pinning the store's host buffers would create). The bound is
docs/training.md's: the host budget plus the engine's fixed overhead (store staging buffers, the
optimizer step's three groups, gradient puts in flight, materialized parameters, and a runtime
allowance), which is also what ``engine.estimate_memory`` reports as ``host_rss_bound``.

glibc's malloc raises its mmap threshold dynamically and then keeps freed chunks of paged
parameters and step buffers in its heaps; the subprocess pins the threshold
(MALLOC_MMAP_THRESHOLD_), as docs/training.md recommends for a hard RSS bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

MiB = 1024 * 1024

CHILD = textwrap.dedent("""
    import json, sys
    import torch, engine, tiered
    from engine.demo import GPT, GPTConfig

    MiB = 1024 * 1024

    def status():
        out = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
        return out

    if torch.cuda.is_available():
        torch.cuda.init()
        torch.empty(1).pin_memory()
    torch.manual_seed(0)
    x, y = torch.randint(0, 512, (1, 16)), torch.randint(0, 512, (1, 16))
    warm = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_embd=256, n_head=4))
    warm_opt = torch.optim.AdamW(warm.parameters())
    for _ in range(2):
        warm(x % 64, y % 64).backward()
        warm_opt.step()
        warm_opt.zero_grad()
    del warm, warm_opt

    cfg = GPTConfig(vocab_size=512, seq_len=16, n_layer=10, n_embd=256, n_head=4)
    with torch.device("meta"):
        model = GPT(cfg)
    store = tiered.StoreConfig(path=sys.argv[1], host_bytes=32 * MiB, device_bytes=0, prefault_host=False,
                               block_size=1 * MiB, staging_buffers=4, result_pool_bytes=0, io_threads=4,
                               queue_depth=8, swap_grow_bytes=64 * MiB, durable=False)
    config = engine.EngineConfig(store=store, param_tier="nvme", grad_tier="nvme", optimizer_tier="nvme",
                                 prefetch_bytes=4 * MiB, optimizer_group_bytes=2 * MiB)
    largest_shard = max(p.numel() for p in model.parameters()) * 4
    largest_module = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    bound = engine.estimate_memory(model, config).host_rss_bound
    base = status()["VmRSS"]
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-3), config=config)
    losses = []
    for step in range(3):
        loss = model(x, y)
        loss.backward()
        eng.step()
        eng.zero_grad()
        losses.append(loss.item())
    stats = eng.stats()
    eng.close()
    print(json.dumps(dict(
        base=base, peak=status()["VmHWM"], bound=bound, params=cfg.num_params, losses=losses,
        largest_shard=largest_shard, largest_module=largest_module,
        steps=stats.optimizer_steps, written=stats.optimizer_bytes_written,
        peak_materialized=stats.peak_materialized_bytes,
    )))
""")


def fixed_overhead(*, block_size: int, staging_buffers: int, group_bytes: int, largest_shard: int,
                   largest_module: int, prefetch_bytes: int) -> int:
    """docs/training.md, "Memory model": what the engine adds to the host budget (fp32 training)."""
    staging = block_size * staging_buffers
    step_groups = 3 * 4 * max(group_bytes, largest_shard)  # gradient, master, two moments; three groups
    grads_in_flight = group_bytes + 2 * largest_shard  # bounded puts + the gradient being offloaded
    materialized = largest_module + prefetch_bytes + largest_shard  # + the idle parameter buffers' slack
    runtime = 16 * MiB  # manifest cache, autograd graph and activations of a tiny batch, thread stacks
    return staging + step_groups + grads_in_flight + materialized + runtime


def test_peak_rss_stays_within_the_host_budget_plus_the_fixed_overhead(tmp_path):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "store")], capture_output=True, text=True,
                           timeout=120, env=env)
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout.strip().splitlines()[-1])
    host = 32 * MiB
    states = got["params"] * (4 + 4 + 12)  # fp32 parameter, fp32 gradient, master + two moments
    assert states >= 4 * host  # the premise: the training state does not fit 4 times over
    # The whole state went through: the parameter (its own master) and two moments, written once
    # per step (and a small progress entry per group).
    assert got["steps"] == 3 and 0 <= got["written"] - 3 * 12 * got["params"] < 3 * 64 * 4096
    assert got["losses"][-1] < got["losses"][0]
    overhead = fixed_overhead(block_size=MiB, staging_buffers=4, group_bytes=2 * MiB,
                              largest_shard=got["largest_shard"], largest_module=got["largest_module"],
                              prefetch_bytes=4 * MiB)
    peak = got["peak"] - got["base"]
    assert host + overhead < states  # the bound says something
    assert got["bound"] == host + overhead  # engine.estimate_memory states the same bound
    assert peak <= host + overhead, f"peak RSS +{peak / MiB:.1f} MiB > {(host + overhead) / MiB:.1f} MiB"
