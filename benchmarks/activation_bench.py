"""Activations in the store: one training step's time and the process's peak memory, four ways in
one run, each contender in a fresh process (so each peak is its own):

- plain PyTorch, everything in memory (torch.optim.AdamW);
- tiered, parameters and optimizer state on nvme, activations in memory;
- tiered, the same, and activation checkpointing of every block (torch.utils.checkpoint): the
  usual answer to activation memory, paid for in recomputation;
- tiered, the same as the second, with the activations on nvme too (``activation_tier="nvme"``).

Same model (engine.demo.GPT), data and AdamW hyperparameters; the losses must be equal to the last
bit. Step 1 is a warm-up and not timed. Prints a table, writes JSON, optionally a PNG.

    python benchmarks/activation_bench.py --dir /nvme/scratch --json activations.json --plot activations.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

import torch
from bench_output import machine_info, print_table, pyplot, scratch_dir, with_machine, write_json
from torch import nn

from engine.demo import GPT, BigramStream, GPTConfig

MiB = 1024 * 1024
CONTENDERS = ("memory", "tiered", "tiered+checkpoint", "tiered+activations")
LABELS = {
    "memory": "plain PyTorch, all in memory",
    "tiered": "tiered, activations in memory",
    "tiered+checkpoint": "tiered, activation checkpointing",
    "tiered+activations": "tiered, activations on nvme",
}


class Checkpointed(nn.Module):
    """A block run under non-reentrant activation checkpointing (its forward again in backward)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _reset_peak() -> bool:
    """Start a new peak RSS (VmHWM) from the current RSS: Linux's clear_refs "5"; False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    """The peak RSS since the last :func:`_reset_peak` (since the start where it was refused)."""
    return _status_bytes("VmHWM")


def child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one contender in this process; its losses, step seconds and memory."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_embd=args.embd,
                    n_head=args.heads)
    model = GPT(cfg)
    if name == "tiered+checkpoint":
        model.blocks = nn.ModuleList(Checkpointed(b) for b in model.blocks)
    data = BigramStream(cfg.vocab_size, cfg.seq_len, args.batch, seed=0)
    eng = None
    path = scratch_dir(args.dir, "activation-bench-")
    try:
        if name == "memory":
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

            def step_fn() -> None:
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            import engine
            import tiered

            store = tiered.StoreConfig(path=path, host_bytes=args.host_mib * MiB, prefault_host=False)
            config = engine.EngineConfig(
                store=store, host_budget="host_tier", prefetch_bytes=args.prefetch_mib * MiB,
                activation_tier="nvme" if name == "tiered+activations" else None,
                activation_window_bytes=args.window_mib * MiB, activation_min_bytes=args.min_kib * 1024,
            )
            eng = engine.wrap(model, optimizer=engine.AdamW(lr=args.lr), config=config)

            def step_fn() -> None:
                eng.step()
                eng.zero_grad()
        rss_start = _status_bytes("VmRSS")
        losses, seconds, backward_peaks, step_peaks = [], [], [], []
        phase_peaks = True
        for i in range(args.steps):
            x, y = data.batch(i)
            phase_peaks &= _reset_peak()
            start = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            backward_peaks.append(_peak_bytes() - rss_start)
            phase_peaks &= _reset_peak()
            step_fn()
            seconds.append(time.perf_counter() - start)
            step_peaks.append(_peak_bytes() - rss_start)
            losses.append(loss.item())
            print(f"  {name}: step {i + 1}/{args.steps} loss {losses[-1]:.4f} {seconds[-1]:.2f}s", file=sys.stderr)
        out: dict[str, Any] = {
            "name": name, "losses": losses, "seconds": seconds,
            "rss_before_training_bytes": rss_start,
            # Peaks above rss_before_training, per step: forward + backward, then the optimizer step
            # (None where the kernel refused to reset the peak between them).
            "forward_backward_peak_bytes": backward_peaks if phase_peaks else None,
            "optimizer_step_peak_bytes": step_peaks if phase_peaks else None,
        }
        if eng is not None:
            stats = eng.stats()
            out["activation_bytes_offloaded"] = stats.activation_bytes_offloaded
            out["activation_bytes_read"] = stats.activation_bytes_read
            out["activation_stall_seconds"] = stats.activation_stall_seconds
            out["stall_seconds"] = stats.stall_seconds
        return out
    finally:
        if eng is not None:
            eng.close()
        shutil.rmtree(path, ignore_errors=True)


def run_child(name: str, argv: list[str]) -> dict[str, Any]:
    """One contender in a fresh interpreter (its own peak RSS); its JSON result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, *argv]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"contender {name!r} failed (exit {done.returncode}); its output is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embd", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="steps per contender; the first is not timed")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--host-mib", type=int, default=64,
                   help="the store's host tier (the engine's working set comes on top)")
    p.add_argument("--prefetch-mib", type=int, default=128)
    p.add_argument("--window-mib", type=int, default=64, help="EngineConfig.activation_window_bytes")
    p.add_argument("--min-kib", type=int, default=1024, help="EngineConfig.activation_min_bytes")
    p.add_argument("--skip", default="", help=f"comma list of contenders to skip: {','.join(CONTENDERS)}")
    p.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the first is a warm-up), got {args.steps}")
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(CONTENDERS):
        p.error(f"--skip takes {', '.join(CONTENDERS)}, got {args.skip!r}")
    machine = machine_info(args.dir)
    forwarded = list(argv if argv is not None else sys.argv[1:])
    runs = [run_child(name, forwarded) for name in CONTENDERS if name not in skip]
    ref = next((r for r in runs if r["name"] == "tiered"), runs[0])
    for r in runs:
        fb, st = r["forward_backward_peak_bytes"], r["optimizer_step_peak_bytes"]
        r["label"] = LABELS[r["name"]]
        r["median_seconds"] = statistics.median(r["seconds"][1:])
        r["min_seconds"], r["max_seconds"] = min(r["seconds"][1:]), max(r["seconds"][1:])
        r["losses_equal"] = r["losses"] == runs[0]["losses"]
        r["forward_backward_peak_gib"] = max(fb) / 2**30 if fb else None
        r["optimizer_step_peak_gib"] = max(st) / 2**30 if st else None
        r["activation_mb_per_step"] = r.get("activation_bytes_offloaded", 0) / args.steps / 1e6
    for r in runs:
        r["vs_reference"] = r["median_seconds"] / ref["median_seconds"]
    rows = [[r["label"], r["median_seconds"], r["vs_reference"], r["forward_backward_peak_gib"],
             r["optimizer_step_peak_gib"], f"{r['activation_mb_per_step']:.0f}" if r["activation_mb_per_step"] else "-",
             "yes" if r["losses_equal"] else "NO"] for r in runs]
    print(f"GPT {args.layers} x {args.embd}, vocab {args.vocab}, batch {args.batch} x {args.seq} tokens, "
          f"{args.steps} steps (first untimed); memory: peak RSS above the start of training, GiB")
    print_table(["contender", "median step s", f"vs {LABELS[ref['name']]}", "forward + backward",
                 "optimizer step", "activations to nvme per step, MB", "losses equal"], rows)
    result = with_machine({"args": vars(args), "reference": LABELS[ref["name"]], "runs": runs}, machine)
    write_json(result, args.json)
    if args.plot:
        _plot(runs, args.plot)
    if not all(r["losses_equal"] for r in runs):
        print("ERROR: the contenders' losses differ (the table's last column)", file=sys.stderr)
        return 1
    return 0


def _plot(runs: list[dict[str, Any]], path: str) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [LABELS[r["name"]].replace(", ", ",\n") for r in runs]
    left.barh(names, [r["median_seconds"] for r in runs], color="#4c72b0")
    left.set_xlabel("median step time, s")
    left.invert_yaxis()
    peaks = [max(r["forward_backward_peak_bytes"] or [0]) / 2**30 for r in runs]
    right.barh(names, peaks, color="#dd8452")
    right.set_xlabel("peak RSS in forward + backward, above the start of training, GiB")
    right.invert_yaxis()
    right.set_yticklabels([])
    fig.suptitle("Activations: in memory, recomputed, or in the store (one training step)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
