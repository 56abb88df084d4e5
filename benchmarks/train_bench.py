"""One training step three ways, in one run: tiered (params + optimizer on nvme) vs all in memory
with torch.optim.AdamW vs FSDP2 with CPUOffloadPolicy on gloo.

Same model (engine.demo.GPT), same data, same AdamW hyperparameters; every contender's losses must
equal the first contender's (to ``--loss-tolerance``, 0 by default: bit for bit), or the script
exits 1. Then median step times and the ratio tiered / in-memory. Step 1 of each is a warm-up (the
engine records its order there) and is not timed. The contenders take turns, one step each, in an
order rotated from step to step, so the machine's drift over the run slows every contender alike;
"vs in memory" is the median over steps of each step's ratio to the in-memory step of the same
turn, and the verdict (target: tiered / in memory <= 1.3) is judged from those ratios, with their
range, when there are at least five (``--steps`` >= 6). ``--back-to-back`` runs each contender's
steps in a block instead.

    python benchmarks/train_bench.py --dir /nvme/scratch --steps 11 --json train.json --plot train.png

``--fused`` gives every contender's AdamW ``fused=True``. ``--tier host`` keeps the engine's
parameters and optimizer state in host memory instead (give ``--host-mib`` room for them), the
placement FSDP2's CPU offload has; the engine then updates the state in place, and ``--two-slots``
adds a contender that writes each step's state to a second slot instead (``optimizer_in_place=False``).
Besides the whole step, the table gives each contender's optimizer step (``optimizer.step()``).
``--device cuda`` computes on the GPU: the in-memory model and its AdamW live there, FSDP2 runs on
NCCL with its CPU offload (pinned), and the engine gets ``compute_device="cuda"``; GPU kernels are
not bitwise reproducible between contenders that launch different kernels (FSDP2), so a GPU run
states its ``--loss-tolerance``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from typing import Callable, Optional

import torch
from bench_output import (
    compute_device,
    machine_info,
    paired_median,
    pyplot,
    rotated,
    scratch_dir,
    synchronize,
    verdict,
    with_machine,
    write_json,
)

from engine.demo import GPT, BigramStream, GPTConfig

MiB = 1024 * 1024
#: The target: the engine's step, params + optimizer on nvme, at most this many times the in-memory step.
TARGET = 1.3


@dataclasses.dataclass
class Run:
    """Losses and step seconds of one contender."""

    name: str
    losses: list[float] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    optimizer_seconds: list[float] = dataclasses.field(default_factory=list)  # optimizer.step() of each step
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds[1:] or self.seconds)

    @property
    def optimizer_median(self) -> float:
        return statistics.median(self.optimizer_seconds[1:] or self.optimizer_seconds)


#: One training step: (loss, seconds of its optimizer.step()).
StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[float, float]]


def train(contenders: list[tuple[Run, StepFn]], steps: int, data: BigramStream, device: torch.device,
          back_to_back: bool) -> None:
    """``steps`` steps of every contender on the same batches: in turns (one step each, the order
    rotated every step), or with ``back_to_back`` each contender's steps in one block."""
    if back_to_back:
        schedule = [(i, c) for c in contenders for i in range(steps)]
    else:
        schedule = [(i, c) for i in range(steps) for c in rotated(contenders, i)]
    for i, (run, step_fn) in schedule:
        x, y = (t.to(device) for t in data.batch(i))
        start = time.perf_counter()
        loss, optimizer_seconds = step_fn(x, y)
        run.seconds.append(time.perf_counter() - start)
        run.losses.append(loss)
        run.optimizer_seconds.append(optimizer_seconds)
        print(f"  {run.name}: step {i + 1}/{steps} loss {run.losses[-1]:.4f} {run.seconds[-1]:.2f}s "
              f"(optimizer {optimizer_seconds:.2f}s)", file=sys.stderr)


def timed_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> StepFn:
    """forward, backward, ``optimizer.step()`` (timed, kernels waited for), ``zero_grad``."""

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        loss = model(x, y)
        loss.backward()
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        seconds = time.perf_counter() - start
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), seconds

    return step


def in_memory(model: torch.nn.Module, args: argparse.Namespace) -> StepFn:
    """An unsharded model (already where it computes) and torch's AdamW over its parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=args.fused)
    return timed_step(model, opt, torch.device(args.device))


def fsdp2(model: GPT, args: argparse.Namespace) -> StepFn:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    pin = torch.device(args.device).type == "cuda"  # FSDP2 pins its CPU shards by default; pinning needs CUDA
    for block in model.blocks:
        fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=pin))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=pin))
    return in_memory(model, args)


def tiered_engine(model: GPT, args: argparse.Namespace, path: str, *, in_place: Optional[bool] = None):
    import engine
    import tiered

    chosen = {"io_threads": args.io_threads, "cpu_threads": args.cpu_threads, "queue_depth": args.queue_depth}
    store = tiered.StoreConfig(path=path, host_bytes=args.host_mib * MiB, prefault_host=False,
                               **{name: value for name, value in chosen.items() if value})  # 0: the default
    eng = engine.wrap(
        model,
        optimizer=engine.AdamW(lr=args.lr, weight_decay=args.weight_decay, fused=args.fused),
        config=engine.EngineConfig(store=store, host_budget="host_tier", param_tier=args.tier, optimizer_tier=args.tier,
                                   optimizer_in_place=in_place, prefetch_bytes=args.prefetch_mib * MiB,
                                   optimizer_group_bytes=args.group_mib * MiB, compute_device=args.device),
    )

    return eng, timed_step(model, eng.optimizer, torch.device(args.device))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embd", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="steps per contender; the first is not timed")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--host-mib", type=int, default=64,
                   help="the store's host tier (the engine's working set comes on top)")
    p.add_argument("--prefetch-mib", type=int, default=128)
    p.add_argument("--io-threads", type=int, default=0, help="the store's io_threads (0: StoreConfig's default)")
    p.add_argument("--cpu-threads", type=int, default=0, help="the store's cpu_threads (0: StoreConfig's default)")
    p.add_argument("--queue-depth", type=int, default=0, help="the store's queue_depth (0: StoreConfig's default)")
    p.add_argument("--group-mib", type=int, default=64, help="the optimizer step's group size (optimizer_group_bytes)")
    p.add_argument("--skip", default="", help="comma list of contenders to skip: memory,fsdp2")
    p.add_argument("--device", default="cpu", help="where every contender computes: cpu, or cuda")
    p.add_argument("--fused", action="store_true", default=None,
                   help="every contender's AdamW with fused=True (torch's fused kernel; DeepSpeed configs get it "
                        "unless they set torch_adam)")
    p.add_argument("--two-slots", action="store_true",
                   help="with --tier host: also run the engine writing each step's state to a second slot "
                        "(optimizer_in_place=False) beside the in-place one")
    p.add_argument("--tier", default="nvme", choices=("nvme", "host"),
                   help="where the engine keeps parameters and optimizer state (host: raise --host-mib to hold them)")
    p.add_argument("--back-to-back", action="store_true",
                   help="run each contender's steps in one block (default: the contenders take turns, one step each)")
    p.add_argument("--loss-tolerance", type=float, default=0.0,
                   help="largest loss difference from the first contender allowed (default 0: bit for bit); a "
                        "larger one exits 1")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if args.loss_tolerance < 0:
        p.error(f"--loss-tolerance must be >= 0, got {args.loss_tolerance}")
    if args.two_slots and args.tier != "host":
        p.error("--two-slots compares the host tier's two ways of stepping: add --tier host")
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the first is a warm-up), got {args.steps}")
    device = compute_device(p, args.device)
    skip = {s for s in args.skip.split(",") if s}

    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_embd=args.embd,
                    n_head=max(1, args.embd // 64))
    torch.manual_seed(0)
    base = GPT(cfg)
    data = BigramStream(cfg.vocab_size, cfg.seq_len, args.batch)
    n = cfg.num_params
    print(f"model: {n / 1e6:.1f} M params; params + grads + AdamW states {16 * n / 1e9:.2f} GB in fp32; "
          f"{args.batch} x {args.seq} tokens per step; torch threads {torch.get_num_threads()}; computing on {device}")

    contenders: list[tuple[Run, StepFn]] = []
    engines = []  # (its run, the engine)
    machine = machine_info(args.dir)
    workdir = scratch_dir(args.dir, "tiered-train-")
    try:
        if "memory" not in skip:
            contenders.append((Run("in memory, torch.optim.AdamW"), in_memory(copy.deepcopy(base).to(device), args)))
        if "fsdp2" not in skip:
            import torch.distributed as dist

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29517")
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend, rank=0, world_size=1)
            contenders.append((Run(f"FSDP2 + CPUOffloadPolicy, {backend}"), fsdp2(copy.deepcopy(base), args)))
        wrapped = [(f"tiered, params + optimizer on {args.tier}", None)]
        if args.two_slots:
            wrapped.append(("tiered, params + optimizer on host, two slots", False))
        for name, in_place in wrapped:
            eng, step = tiered_engine(copy.deepcopy(base), args, os.path.join(workdir, f"store{len(contenders)}"),
                                      in_place=in_place)
            run = Run(name)
            engines.append((run, eng))
            contenders.append((run, step))
        train(contenders, args.steps, data, device, args.back_to_back)
        for run, eng in engines:
            run.note = json.dumps({k: v for k, v in dataclasses.asdict(eng.stats()).items()
                                   if isinstance(v, (int, float))})
    finally:
        for _, eng in engines:
            eng.unwrap()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        shutil.rmtree(workdir, ignore_errors=True)

    runs = [run for run, _ in contenders]
    reference = runs[0]
    # Step i of every contender ran in the same turn: the ratio within a turn cancels the drift between turns.
    ratios = [paired_median(r.seconds[1:], reference.seconds[1:]) for r in runs]
    diffs = [max(abs(a - b) for a, b in zip(r.losses, reference.losses)) for r in runs]
    print(f"\n| contender | median step s | min | max | vs {reference.name.split(',')[0]} (median of per-step "
          "ratios) | optimizer step s (median) | max loss diff vs first |")
    print("|---|---|---|---|---|---|---|")
    for r, ratio, diff in zip(runs, ratios, diffs):
        timed = r.seconds[1:]
        print(f"| {r.name} | {r.median:.3f} | {min(timed):.3f} | {max(timed):.3f} | "
              f"{ratio:.2f} | {r.optimizer_median:.3f} | {diff:.2e} |")
    judged = None
    if "memory" not in skip:  # the target is the engine against the same model in memory
        engine_run = engines[0][0]
        judged = verdict("tiered / in memory, per step", [a / b for a, b in zip(engine_run.seconds[1:],
                                                                              reference.seconds[1:])],
                         TARGET, at_most=True)
    result = {
        "params": n, "tokens_per_step": args.batch * args.seq, "steps": args.steps, "device": str(device),
        "schedule": "back to back" if args.back_to_back else "turns, order rotated every step",
        "runs": [dataclasses.asdict(r) | {"median": r.median, "min": min(r.seconds[1:]), "max": max(r.seconds[1:]),
                                          "optimizer_median": r.optimizer_median, "vs_first": ratio,
                                          "max_loss_diff": diff}
                 for r, ratio, diff in zip(runs, ratios, diffs)],
        "target": f"tiered / in memory <= {TARGET}", "verdict": judged, "loss_tolerance": args.loss_tolerance,
        "losses_match": max(diffs) <= args.loss_tolerance,
    }
    result = with_machine(result, machine)
    write_json(result, args.json)
    if args.plot:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 2.8))
        colors = ["#999999", "#d08c60", "#4c72b0", "#8fa8d0"][:len(runs)]
        ax.barh([r.name for r in runs], [r.median for r in runs], color=colors)
        ax.set_xlabel("seconds per training step (median)")
        ax.set_title(f"{n / 1e6:.0f} M-parameter GPT, {args.batch}x{args.seq} tokens")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    if not result["losses_match"]:
        worst = max(zip(diffs, runs), key=lambda d: d[0])
        print(f"ERROR: {worst[1].name}'s losses differ from {reference.name}'s by {worst[0]:.3e}, more than "
              f"--loss-tolerance {args.loss_tolerance}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
