"""Host memory while training against the budget: peak RSS growth over a training run at several
``StoreConfig.host_bytes``, with the default allocator and no environment variable set.

A Llama-style model (``engine.demo.llama``, sized by ``--state-gib`` of fp32 training state: 16
bytes a parameter) is built on the meta device and trained on nvme (parameters, gradients past the
host tier and optimizer state) for ``--steps`` steps on one fixed batch, once per budget, each in a
process of its own. RSS is sampled every 0.05 s from wrap to the end of the last step, and the
kernel's own peak (VmHWM) is taken at the end; growth is measured over the process's RSS just before
``engine.wrap`` (after torch's kernels and thread pools have been warmed up by a tiny plain step).
Each budget is judged against ``1.1 x host_bytes + 256 MiB``; a budget below what the model needs
is reported as refused, with ``engine.wrap``'s message.

    python benchmarks/memory_budget.py --dir /nvme/scratch --budgets 0.5 1 2 --state-gib 8 \\
        --json docs/memory_budget.json --plot docs/memory_budget.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional

from bench_output import machine_info, pyplot, scratch_dir, with_machine, write_json

MiB, GiB = 1 << 20, 1 << 30
#: Peak RSS growth allowed: 1.1 x host_bytes + this (torch's and Python's own growth).
RSS_ALLOWANCE = 256 * MiB


def bound(host_bytes: int) -> float:
    """The most peak RSS growth a budget allows."""
    return 1.1 * host_bytes + RSS_ALLOWANCE


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One budget's run, in this process: wrap, train, and the RSS it took."""
    import torch

    import engine
    import tiered
    from engine.demo.llama import Llama, LlamaConfig, init_weights

    torch.manual_seed(args.seed)
    cfg = LlamaConfig.for_state_bytes(int(args.state_gib * GiB), dim=args.dim, vocab_size=args.vocab,
                                      n_heads=args.heads)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.tokens + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    warm = Llama(LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4))
    warm_opt = torch.optim.AdamW(warm.parameters())
    for _ in range(2):  # torch's kernels and thread pools in the baseline
        warm(x % 64, y % 64).backward()
        warm_opt.step()
        warm_opt.zero_grad()
    del warm, warm_opt
    with torch.device("meta"):
        model = Llama(cfg)
    host_bytes = int(args.child * GiB)
    config = engine.EngineConfig(store=tiered.StoreConfig(path=os.path.join(args.dir, "store"), host_bytes=host_bytes),
                                 param_tier="nvme", optimizer_tier="nvme")
    series: list[tuple[float, int]] = []
    stop = threading.Event()
    base = proc_status()["VmRSS"]
    t0 = time.perf_counter()

    def sample() -> None:
        while not stop.wait(0.05):
            series.append((round(time.perf_counter() - t0, 2), rss_bytes() - base))

    sampler = threading.Thread(target=sample, name="memory-budget-sampler", daemon=True)
    sampler.start()
    out: dict[str, Any] = {"host_bytes": host_bytes, "params": cfg.num_params, "state_bytes": cfg.num_params * 16}
    try:
        try:
            eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-4, weight_decay=0.0), config=config,
                              init_fn=init_weights)
        except ValueError as exc:  # below the minimum this model needs under this config
            return {**out, "refused": str(exc)}
        out["wrap_s"] = time.perf_counter() - t0
        steps = []
        try:
            for _ in range(args.steps):
                started = time.perf_counter()
                loss = model(x, y)
                loss.backward()
                eng.step()
                eng.zero_grad()
                steps.append({"loss": loss.item(), "seconds": time.perf_counter() - started,
                              "peak_growth_so_far": proc_status()["VmHWM"] - base})
        finally:
            eng.close()
    finally:
        stop.set()
        sampler.join()
    return {**out, "rss_before_wrap": base, "peak_rss_growth": proc_status()["VmHWM"] - base, "steps": steps,
            "rss_series": series}


def run_budget(args: argparse.Namespace, budget_gib: float, workdir: str) -> dict[str, Any]:
    """Run one budget in a new process (no environment variable added) and return its result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(budget_gib), "--dir", workdir,
           "--state-gib", str(args.state_gib), "--dim", str(args.dim), "--vocab", str(args.vocab),
           "--heads", str(args.heads), "--steps", str(args.steps), "--tokens", str(args.tokens),
           "--seed", str(args.seed)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the run at {budget_gib} GiB failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Peak growth against the bound, and the steady steps' median time."""
    if "refused" in run:
        return {"host_gib": run["host_bytes"] / GiB, "refused": run["refused"]}
    steady = [s["seconds"] for s in run["steps"][1:]] or [s["seconds"] for s in run["steps"]]
    return {
        "host_gib": run["host_bytes"] / GiB,
        "peak_growth_gib": run["peak_rss_growth"] / GiB,
        "bound_gib": bound(run["host_bytes"]) / GiB,
        "growth_over_bound": run["peak_rss_growth"] / bound(run["host_bytes"]),
        "step_s": statistics.median(steady),
        "within": run["peak_rss_growth"] <= bound(run["host_bytes"]),
    }


def plot(result: dict[str, Any], path: str) -> None:
    """RSS growth over each run against its budget and bound."""
    plt = pyplot()
    runs = [r for r in result["runs"] if "refused" not in r]
    fig, axes = plt.subplots(1, max(1, len(runs)), figsize=(4.2 * max(1, len(runs)), 3.4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        series = run["rss_series"]
        ax.plot([t for t, _ in series], [r / GiB for _, r in series], lw=1, label="RSS growth")
        ax.axhline(run["host_bytes"] / GiB, color="tab:green", ls="--", label="host_bytes")
        ax.axhline(bound(run["host_bytes"]) / GiB, color="tab:red", ls=":", label="1.1 x host_bytes + 256 MiB")
        ax.set_title(f"host_bytes {run['host_bytes'] / GiB:g} GiB", fontsize=10)
        ax.set_xlabel("seconds since wrap")
        ax.set_ylabel("GiB over the process before wrap")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['params'] / 1e6:.0f} M parameters, {result['state_bytes'] / GiB:.1f} GiB of fp32 training "
                 "state, everything on nvme, default allocator", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="host_bytes to run, GiB")
    p.add_argument("--state-gib", type=float, default=8.0, help="fp32 training state of the model (GiB)")
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--steps", type=int, default=4, help="steps per budget (the first is not counted in step_s)")
    p.add_argument("--tokens", type=int, default=32, help="tokens in the fixed batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--child", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args)))
        return 0
    workdir = scratch_dir(args.dir, "tiered-memory-budget-")
    machine = machine_info(workdir)
    runs = []
    try:
        for budget in args.budgets:
            run = run_budget(args, budget, workdir)
            shutil.rmtree(os.path.join(workdir, "store"), ignore_errors=True)
            runs.append(run)
            s = summarize(run)
            if "refused" in s:
                print(f"host_bytes {budget:g} GiB: refused: {s['refused']}", flush=True)
            else:
                print(f"host_bytes {budget:g} GiB: peak RSS growth {s['peak_growth_gib']:.2f} GiB, bound "
                      f"{s['bound_gib']:.2f} GiB ({s['growth_over_bound']:.2f} of it), step {s['step_s']:.1f} s, "
                      f"losses {[round(x['loss'], 3) for x in run['steps']]}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    first = runs[0]
    result = with_machine({"params": first["params"], "state_bytes": first["state_bytes"],
                           "model": {"dim": args.dim, "vocab": args.vocab, "heads": args.heads},
                           "tokens": args.tokens, "summary": [summarize(r) for r in runs], "runs": runs}, machine)
    write_json(result, args.json)
    if args.plot:
        plot(result, args.plot)
    trained = [r for r in runs if "refused" not in r]
    if not all(all(b["loss"] < a["loss"] for a, b in zip(r["steps"], r["steps"][1:])) for r in trained):
        print("error: the loss did not fall every step", file=sys.stderr)
        return 1
    return 0 if all(summarize(r)["within"] for r in trained) else 1


if __name__ == "__main__":
    sys.exit(main())
