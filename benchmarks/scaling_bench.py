"""Model size vs training step time and bytes moved per step, params + optimizer on nvme.

For each size it trains a few steps with tiered (everything on nvme, a small host budget) and the
same model in memory, on the same batches, and records the step time, the bytes the store read and
wrote per step (and per parameter), and the I/O floor: those bytes at fio's best read and write
bandwidth, swept on the same disk at the start of the run (``tiered.bench.fio_best``), read time
plus write time. The in-memory step is the compute floor. The target: the engine's step at most
1.15 x max(I/O floor, compute floor), judged per size from the steps after the first (the median
of >= 5 per-step ratios, with their range). The engine's losses must equal the in-memory model's
bit for bit, or the script exits 1.

    python benchmarks/scaling_bench.py --dir /nvme/scratch --json scaling.json --plot scaling.png
    python benchmarks/scaling_bench.py --dir /nvme/scratch --batch 1 --seq 32 --json scaling_io.json  # I/O-bound
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import time
from typing import Optional

import torch
from bench_output import (
    add_fio_arguments,
    disk_limit,
    machine_info,
    pyplot,
    scratch_dir,
    verdict,
    with_machine,
    write_json,
)

from engine.demo import GPT, BigramStream, GPTConfig

MiB = 1024 * 1024
#: The target: the step at most this many times the larger of its I/O floor and its compute floor.
TARGET = 1.15


def measure(cfg: GPTConfig, args: argparse.Namespace, workdir: str) -> dict:
    """``args.steps`` steps in memory, then with the engine (everything on nvme): times, losses, bytes."""
    import engine
    import tiered

    torch.manual_seed(0)
    base = GPT(cfg)
    data = BigramStream(cfg.vocab_size, cfg.seq_len, args.batch)

    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    memory, memory_losses = [], []
    for i in range(args.steps):
        x, y = data.batch(i)
        start = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        memory.append(time.perf_counter() - start)
        memory_losses.append(loss.item())
    del model, opt

    model = copy.deepcopy(base)
    path = os.path.join(workdir, f"store-{cfg.n_embd}")
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-3, weight_decay=0.0), config=engine.EngineConfig(
        store=tiered.StoreConfig(path=path, host_bytes=args.host_mib * MiB, prefault_host=False),
        host_budget="host_tier", param_tier="nvme", optimizer_tier="nvme", prefetch_bytes=args.prefetch_mib * MiB))
    ours, losses, read, written = [], [], [], []
    try:
        for i in range(args.steps):
            x, y = data.batch(i)
            before = eng.stats().store
            start = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            eng.step()
            eng.zero_grad()
            ours.append(time.perf_counter() - start)
            after = eng.stats().store
            losses.append(loss.item())
            read.append(after.bytes_read - before.bytes_read)
            written.append(after.bytes_written - before.bytes_written)
    finally:
        eng.unwrap()
        shutil.rmtree(path, ignore_errors=True)
    return {
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "params": cfg.num_params,
        "memory_step_s": statistics.median(memory[1:]), "tiered_step_s": statistics.median(ours[1:]),
        "tiered_step_min_s": min(ours[1:]), "tiered_step_max_s": max(ours[1:]),
        "bytes_read_per_step": statistics.median(read[1:]), "bytes_written_per_step": statistics.median(written[1:]),
        "tiered_steps": ours, "memory_steps": memory, "bytes_read": read, "bytes_written": written,
        "losses": losses, "memory_losses": memory_losses, "losses_match": losses == memory_losses,
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".")
    p.add_argument("--embd", default="256,384,512,768", help="comma list of model widths")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="steps per size; the first is not counted (>= 6 for a "
                   "verdict)")
    p.add_argument("--host-mib", type=int, default=32, help="the store's host tier (the engine's working set "
                   "comes on top)")
    p.add_argument("--prefetch-mib", type=int, default=64)
    add_fio_arguments(p)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be >= 2, got {args.steps}")
    widths = [int(w) for w in args.embd.split(",") if w]
    machine = machine_info(args.dir)
    workdir = scratch_dir(args.dir, "tiered-scaling-")
    try:
        limit = disk_limit(args, os.path.join(workdir, "fio"))
        rows = []
        for width in widths:
            cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_embd=width,
                            n_head=max(1, width // 64))
            row = measure(cfg, args, workdir)
            row["bytes_moved_per_step"] = row["bytes_read_per_step"] + row["bytes_written_per_step"]
            row["bytes_per_param"] = row["bytes_moved_per_step"] / row["params"]
            if limit is not None:
                floors = [r / limit["read_bytes_per_s"] + w / limit["write_bytes_per_s"]
                          for r, w in zip(row["bytes_read"][1:], row["bytes_written"][1:])]
                row["io_floor_s"] = statistics.median(floors)
                row["verdict"] = verdict(f"{row['params'] / 1e6:.1f} M params: step / max(I/O floor, in memory)",
                                         [t / max(f, row["memory_step_s"]) for t, f in zip(row["tiered_steps"][1:],
                                                                                           floors)],
                                         TARGET, at_most=True)
            rows.append(row)
            print(f"  {row['params'] / 1e6:6.1f} M params: tiered {row['tiered_step_s']:.2f} s, in memory "
                  f"{row['memory_step_s']:.2f} s, moved {row['bytes_moved_per_step'] / 1e9:.2f} GB", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print("\n| params (M) | in-memory step s | tiered step s | GB moved/step | bytes/param | I/O floor s | "
          "step / max(floors) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        floor = f"{r['io_floor_s']:.2f}" if "io_floor_s" in r else "-"
        ratio = f"{r['verdict']['median']:.2f}" if "verdict" in r else "-"
        print(f"| {r['params'] / 1e6:.1f} | {r['memory_step_s']:.2f} | {r['tiered_step_s']:.2f} | "
              f"{r['bytes_moved_per_step'] / 1e9:.2f} | {r['bytes_per_param']:.1f} | {floor} | {ratio} |")
    result = with_machine({"fio": limit, "batch": args.batch, "seq": args.seq, "target": TARGET, "rows": rows},
                          machine)
    write_json(result, args.json)
    if args.plot:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        params = [r["params"] / 1e6 for r in rows]
        ax.plot(params, [r["tiered_step_s"] for r in rows], "o-", label="tiered, nvme")
        ax.plot(params, [r["memory_step_s"] for r in rows], "s-", label="in memory")
        if limit is not None:
            ax.plot(params, [r["io_floor_s"] for r in rows], "--", label="bytes moved at fio's best (I/O floor)")
        ax.set_title(f"{args.batch} x {args.seq} tokens per step, {args.layers} layers")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel("seconds per step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    mismatched = [r["params"] for r in rows if not r["losses_match"]]
    if mismatched:
        print(f"ERROR: the engine's losses differ from the in-memory model's at {mismatched} parameters",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
