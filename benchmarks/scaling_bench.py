"""Model size vs training step time and bytes moved per step, params + optimizer on nvme.

For each size it trains a few steps with tiered (everything on nvme, a small host budget) and
the same model in memory, and records the step time, the bytes the store read and wrote per step,
and what that traffic would take at the disk's bandwidth (measured in the same run by the store
itself: one large put and get). Once the disk is the bottleneck, the step time tracks
bytes moved / disk bandwidth; while compute dominates, it tracks the in-memory step.

    python benchmarks/scaling_bench.py --dir /nvme/scratch --json scaling.json --plot scaling.png
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch
from bench_output import pyplot, scratch_dir, with_load, write_json

from engine.demo import GPT, BigramStream, GPTConfig

MiB = 1024 * 1024


def disk_bandwidth(directory: str, nbytes: int) -> tuple[float, float]:
    """(write, read) GB/s of the store itself on ``directory``: puts and cold gets of 64 MiB tensors."""
    import tiered

    path = tempfile.mkdtemp(prefix="bw-", dir=directory)
    try:
        with tiered.TieredStore.open(tiered.StoreConfig(path=path, host_bytes=64 * MiB, prefault_host=False)) as st:
            chunks = [torch.randn(16 * MiB) for _ in range(max(1, nbytes // (64 * MiB)))]
            start = time.perf_counter()
            for i, c in enumerate(chunks):
                st.sync.put(f"c{i}", c, tier="nvme")
            write = len(chunks) * 64 * MiB / (time.perf_counter() - start) / 1e9
            out = torch.empty(16 * MiB)
            start = time.perf_counter()
            for i in range(len(chunks)):
                st.sync.get(f"c{i}", out=out)
            read = len(chunks) * 64 * MiB / (time.perf_counter() - start) / 1e9
        return write, read
    finally:
        shutil.rmtree(path, ignore_errors=True)


def measure(cfg: GPTConfig, args: argparse.Namespace, workdir: str) -> dict:
    import engine
    import tiered

    torch.manual_seed(0)
    base = GPT(cfg)
    data = BigramStream(cfg.vocab_size, cfg.seq_len, args.batch)

    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    memory = []
    for i in range(args.steps):
        x, y = data.batch(i)
        start = time.perf_counter()
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        memory.append(time.perf_counter() - start)
    del model, opt

    model = copy.deepcopy(base)
    path = os.path.join(workdir, f"store-{cfg.n_embd}")
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-3, weight_decay=0.0), config=engine.EngineConfig(
        store=tiered.StoreConfig(path=path, host_bytes=args.host_mib * MiB, prefault_host=False),
        param_tier="nvme", optimizer_tier="nvme", prefetch_bytes=args.prefetch_mib * MiB))
    ours, moved, read = [], [], []
    try:
        for i in range(args.steps):
            x, y = data.batch(i)
            before = eng.stats().store
            start = time.perf_counter()
            model(x, y).backward()
            eng.step()
            eng.zero_grad()
            ours.append(time.perf_counter() - start)
            after = eng.stats().store
            moved.append((after.bytes_read - before.bytes_read) + (after.bytes_written - before.bytes_written))
            read.append(after.bytes_read - before.bytes_read)
    finally:
        eng.unwrap()
        shutil.rmtree(path, ignore_errors=True)
    return {
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "params": cfg.num_params,
        "memory_step_s": statistics.median(memory[1:]), "tiered_step_s": statistics.median(ours[1:]),
        "bytes_moved_per_step": statistics.median(moved[1:]), "bytes_read_per_step": statistics.median(read[1:]),
        "tiered_steps": ours, "memory_steps": memory,
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".")
    p.add_argument("--embd", default="256,384,512,768", help="comma list of model widths")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="steps per size; the first is not counted")
    p.add_argument("--host-mib", type=int, default=32)
    p.add_argument("--prefetch-mib", type=int, default=64)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be >= 2, got {args.steps}")
    widths = [int(w) for w in args.embd.split(",") if w]
    load_before = os.getloadavg()
    workdir = scratch_dir(args.dir, "tiered-scaling-")
    try:
        write_bw, read_bw = disk_bandwidth(workdir, 512 * MiB)
        print(f"store on this disk: write {write_bw:.2f} GB/s, read {read_bw:.2f} GB/s")
        rows = []
        for width in widths:
            cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_embd=width,
                            n_head=max(1, width // 64))
            row = measure(cfg, args, workdir)
            written = row["bytes_moved_per_step"] - row["bytes_read_per_step"]
            row["io_floor_s"] = row["bytes_read_per_step"] / (1e9 * read_bw) + written / (1e9 * write_bw)
            rows.append(row)
            print(f"  {row['params'] / 1e6:6.1f} M params: tiered {row['tiered_step_s']:.2f} s, in memory "
                  f"{row['memory_step_s']:.2f} s, moved {row['bytes_moved_per_step'] / 1e9:.2f} GB", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print("\n| params (M) | in-memory step s | tiered step s | ratio | GB moved/step | I/O at disk speed s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['params'] / 1e6:.1f} | {r['memory_step_s']:.2f} | {r['tiered_step_s']:.2f} | "
              f"{r['tiered_step_s'] / r['memory_step_s']:.2f} | {r['bytes_moved_per_step'] / 1e9:.2f} | "
              f"{r['io_floor_s']:.2f} |")
    result = with_load({"disk_write_gbps": write_bw, "disk_read_gbps": read_bw, "rows": rows}, load_before)
    write_json(result, args.json)
    if args.plot:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        params = [r["params"] / 1e6 for r in rows]
        ax.plot(params, [r["tiered_step_s"] for r in rows], "o-", label="tiered, nvme")
        ax.plot(params, [r["memory_step_s"] for r in rows], "s-", label="in memory")
        ax.plot(params, [r["io_floor_s"] for r in rows], "--", label="bytes read / read speed + written / write speed")
        ax.set_title(f"{args.batch} x {args.seq} tokens per step, {args.layers} layers")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel("seconds per step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
