"""Forward-only inference with the weights on disk: tiered's engine vs accelerate's ``disk_offload``.

Both page a GPT-2-style model's fp32 weights from files in the same directory for every forward;
the in-memory model gives the reference outputs and the compute-only time. Reads are cold: the
engine's store reads with O_DIRECT and its host budget is far below the model, so every forward
reads every weight from the disk; accelerate's memory-mapped weight files have their pages dropped
before each run (``/proc/sys/vm/drop_caches`` when permitted, else ``posix_fadvise(DONTNEED)`` on
each file, which works without root for files whose pages are clean). Which of the two was used is
printed.

    python benchmarks/inference_bench.py --dir /nvme/scratch --repeats 5 --json inf.json --plot inf.png

Needs ``transformers`` and ``accelerate`` (``pip install -e ".[bench]"``).
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
import tempfile
import time
from typing import Callable, Optional

import torch

MiB = 1024 * 1024


@dataclasses.dataclass
class Contender:
    """Seconds per forward of one contender over every repetition."""

    name: str
    seconds: list[float] = dataclasses.field(default_factory=list)
    equal: bool = True
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def build_model(n_layer: int, n_embd: int, seed: int) -> torch.nn.Module:
    """A GPT-2-style transformers model in fp32, eval mode, deterministic weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64), n_positions=1024)
    return GPT2LMHeadModel(cfg).eval()


def drop_page_cache(paths: list[str]) -> str:
    """Drop the page cache for ``paths``; returns how it was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "posix_fadvise(DONTNEED) per file (no permission for drop_caches)"


def files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run(args: argparse.Namespace) -> dict:
    import accelerate

    import engine
    import tiered

    torch.set_num_threads(args.threads or torch.get_num_threads())
    reference = build_model(args.layers, args.embd, args.seed)
    nbytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    ids = torch.randint(0, reference.config.vocab_size, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))
    print(f"model: GPT-2 style, {args.layers} layers x {args.embd}, {nbytes / 1e9:.2f} GB fp32; input {tuple(ids.shape)}")

    workdir = tempfile.mkdtemp(prefix="tiered-inference-", dir=args.dir)
    try:
        with torch.inference_mode():
            expected = reference(ids).logits

        memory = Contender("in memory (compute only)")

        offloaded = copy.deepcopy(reference)
        acc_dir = os.path.join(workdir, "accelerate")
        accelerate.disk_offload(offloaded, acc_dir, execution_device=torch.device("cpu"))
        acc = Contender("accelerate disk_offload, cold")

        wrapped_model = copy.deepcopy(reference)
        store_cfg = tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=args.host_mib * MiB)
        eng = engine.wrap(
            wrapped_model,
            config=engine.EngineConfig(store=store_cfg, param_tier="nvme", prefetch_bytes=args.prefetch_mib * MiB),
        )
        ours = Contender("tiered engine, nvme, cold")
        ours.note = f"host budget {args.host_mib} MiB, prefetch {args.prefetch_mib} MiB, O_DIRECT reads"

        with torch.inference_mode():
            wrapped_model(ids)  # records the order: later forwards prefetch along it
        for rep in range(args.repeats):
            # Rotate the order so drift in the disk's speed hits every contender alike.
            steps = [("memory", memory), ("accelerate", acc), ("tiered", ours)]
            steps = steps[rep % 3:] + steps[:rep % 3]
            for what, contender in steps:
                with torch.inference_mode():
                    if what == "memory":
                        seconds, out = timed(lambda: reference(ids).logits)
                    elif what == "accelerate":
                        acc.note = drop_page_cache(files_under(acc_dir))
                        seconds, out = timed(lambda: offloaded(ids).logits)
                    else:
                        seconds, out = timed(lambda: wrapped_model(ids).logits)
                contender.seconds.append(seconds)
                contender.equal &= bool(torch.equal(out, expected))
            print(f"  run {rep + 1}/{args.repeats}: " + ", ".join(f"{c.name.split(',')[0]} {c.seconds[-1]:.2f}s" for c in (memory, acc, ours)), file=sys.stderr)
        stats = {k: v for k, v in eng.stats().as_dict().items() if isinstance(v, (int, float, dict))}
        eng.unwrap()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    contenders = [memory, acc, ours]
    read_floor = nbytes / (args.disk_gbps * 1e9) if args.disk_gbps else None
    result = {
        "model_bytes": nbytes,
        "input_shape": list(ids.shape),
        "repeats": args.repeats,
        "contenders": [
            {"name": c.name, "seconds": c.seconds, "median": c.median, "min": min(c.seconds), "max": max(c.seconds),
             "equal_outputs": c.equal, "note": c.note}
            for c in contenders
        ],
        "ratio_tiered_to_accelerate": ours.median / acc.median,
        "target_ratio": 0.3,
        "engine_stats": stats,
    }
    print()
    print(f"| contender | median s | min | max | outputs equal | note |")
    print("|---|---|---|---|---|---|")
    for c in contenders:
        print(f"| {c.name} | {c.median:.3f} | {min(c.seconds):.3f} | {max(c.seconds):.3f} | {c.equal} | {c.note} |")
    print(f"\ntiered / accelerate: {result['ratio_tiered_to_accelerate']:.3f} (target <= 0.3)")
    if read_floor:
        print(f"reading {nbytes / 1e9:.2f} GB at {args.disk_gbps} GB/s: {read_floor:.2f} s")
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c["name"] for c in result["contenders"]]
    med = [c["median"] for c in result["contenders"]]
    lo = [c["median"] - c["min"] for c in result["contenders"]]
    hi = [c["max"] - c["median"] for c in result["contenders"]]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(names, med, xerr=[lo, hi], color=["#999999", "#d08c60", "#4c72b0"])
    ax.set_xlabel("seconds per forward (median, min-max)")
    ax.set_title(f"Forward with {result['model_bytes'] / 1e9:.2f} GB of fp32 weights on disk")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--embd", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--host-mib", type=int, default=64, help="the store's host budget (keep it far below the model)")
    p.add_argument("--prefetch-mib", type=int, default=256)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disk-gbps", type=float, default=0.0, help="print the read floor at this disk speed")
    p.add_argument("--json", help="write every run here")
    p.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(result, args.plot)
    return 0 if all(c["equal_outputs"] for c in result["contenders"]) else 1


if __name__ == "__main__":
    sys.exit(main())
