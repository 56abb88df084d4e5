"""Training a model whose state is larger than the machine's memory, against the disk's floor, and
beside DeepSpeed ZeRO-Infinity.

A Llama-style model (``engine.demo.llama``) is sized from the machine's RAM so that its fp32
training state (parameter, gradient and two AdamW moments: 16 bytes a parameter) is ``--ram-multiple``
times the RAM (1.5 by default), built on the meta device, wrapped with everything on nvme and a
small host budget, and trained for ``--steps`` steps on one fixed batch. ``--dtype bfloat16`` trains
the same model in bf16 on fp32 masters (``EngineConfig(train_dtype="bfloat16")``; its training state
is then 18 bytes a parameter: bf16 weights, fp32 masters, gradients and moments). ``--max-grad-norm``
clips (``EngineConfig.max_grad_norm``); ``--step-in-backward`` chooses where the updates run.

Each step reports its wall time and where it went (waits for parameters and for the optimizer's I/O,
AdamW's math, the store's checksums and staging copies, the process's CPU time, the seconds the disk
had a request in flight), how its optimizer step ran (updates inside backward, committed; inside,
then redone after backward; or after backward), the global gradient norm and whether the clip bound,
the bytes the process read and wrote (``/proc/self/io``) and per parameter, the nvme footprint, and
the peak RSS against the host budget; beside them two floors:

- I/O floor: the step's bytes read / fio's best read bandwidth + bytes written / fio's best write
  bandwidth, fio swept over queue depth and block size on the same directory in the same run;
- compute floor: the same model's step in memory (forward + backward + AdamW, in bf16 on fp32
  masters with ``--dtype bfloat16``), from a 1- and a 2-layer copy timed here.

Bytes are judged per kind of step (beyond_memory_verdicts): where the clip norm does not bind, and
where it binds (no more than the step after backward moves). ``--peer deepspeed`` runs DeepSpeed
ZeRO-3 with parameters and optimizer on nvme (beyond_memory_deepspeed) on the same model, batch and
disk, and ``--rounds N`` alternates the contenders N times. Each contender runs in a process of its
own: its peak RSS is its own, and a contender killed for memory is reported, not fatal.

With ``--device cuda`` the model computes on the GPU (the state is still sized from host RAM and
streamed from nvme through host memory), and the compute floor is the GPU's.

The loss must be finite at every step and end below where it began (AdamW on one fixed batch may
overshoot for a step once the loss is small); the run exits 1 if it does not, if the engine fails or
if its losses differ between rounds, 2 when the disk
has no room for the run, fio is missing or ``--device`` names a device this machine lacks. Each
target is judged on the steps after the first (median and range).

    python benchmarks/beyond_memory.py --dir /nvme/scratch --json docs/beyond_memory.json \\
        --plot docs/beyond_memory.png
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
from typing import Any, Optional

import torch
from bench_output import (
    add_fio_arguments,
    disk_limit,
    machine_info,
    pyplot,
    rotated,
    scratch_dir,
    with_machine,
    write_json,
)
from beyond_memory_deepspeed import needed_disk_bytes as deepspeed_disk_bytes
from beyond_memory_deepspeed import new_port, remove_shared_buffers
from beyond_memory_engine import STEP_IN_BACKWARD
from beyond_memory_engine import estimate as engine_estimate
from beyond_memory_verdicts import (
    RSS_ALLOWANCE,
    STATE_BYTES_PER_PARAM,
    after_backward_reference,
    compare_with_deepspeed,
    median_steady,
    moved_target,
    summarize_engine,
)
from compute_floor import compute_floor
from contender_process import run_contender
from process_stats import bf16_support, disk_ticks, ram_bytes  # noqa: F401  (disk_ticks: tests read it here)

from engine.demo.llama import LlamaConfig

MiB, GiB = 1 << 20, 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = {"engine": os.path.join(HERE, "beyond_memory_engine.py"),
              "deepspeed": os.path.join(HERE, "beyond_memory_deepspeed.py")}


class NoRoom(RuntimeError):
    """The disk or the host budget cannot hold the run."""


def model_config(args: argparse.Namespace, ram: int) -> LlamaConfig:
    """The model: the fewest layers whose fp32 training state reaches ``--state-gib`` or
    ``--ram-multiple`` x RAM (in either dtype, so both train the same model)."""
    state = int(args.state_gib * GiB) if args.state_gib else int(args.ram_multiple * ram)
    return LlamaConfig.for_state_bytes(state, dim=args.dim, n_heads=args.dim // 128, vocab_size=args.vocab)


def check_room(args: argparse.Namespace, cfg: LlamaConfig, spec: dict[str, Any], workdir: str) -> int:
    """NoRoom unless ``workdir``'s disk holds what the run writes (the larger contender's files: the
    engine's store during a step, from ``engine.estimate_memory``; DeepSpeed's swap files; and fio's
    file) and the engine takes ``--host-gib`` for this model and mode. Returns the engine's estimate
    of its store during a step."""
    est = engine_estimate(cfg, spec, workdir)
    needed = est.during_step.nvme
    if "deepspeed" in args.peer:
        needed = max(needed, deepspeed_disk_bytes(cfg, args.dtype))
    needed += max(args.fio_size, 0) + GiB
    free = shutil.disk_usage(workdir).free
    if free < needed:
        raise NoRoom(f"{workdir} has {free / 1e9:.1f} GB free; this run needs about {needed / 1e9:.1f} GB "
                     f"({cfg.num_params / 1e9:.2f} B parameters, {args.ram_multiple}x RAM of fp32 training state): "
                     "free some, or give --ram-multiple or --state-gib a smaller value")
    if est.minimum_host_bytes > args.host_gib * GiB:
        raise NoRoom(f"--host-gib {args.host_gib:g} is below what the engine needs for this model in this mode "
                     f"({est.minimum_host_bytes / GiB:.2f} GiB, engine.estimate_memory; {est.step_mode}): give "
                     f"--host-gib {math.ceil(est.minimum_host_bytes / GiB * 10) / 10:g} or more")
    return est.during_step.nvme


def contender_spec(args: argparse.Namespace, cfg: LlamaConfig, workdir: str) -> dict[str, Any]:
    """What each contender's process needs to know (JSON)."""
    return {
        "config": dataclasses.asdict(cfg), "workdir": workdir, "steps": args.steps, "seed": args.seed,
        "tokens": args.tokens, "lr": args.lr, "device": str(args.device), "dtype": args.dtype,
        "max_grad_norm": args.max_grad_norm, "host_gib": args.host_gib, "compress_optimizer": args.compress_optimizer,
        "fused": args.fused, "step_in_backward": args.step_in_backward,
        "deepspeed": {"sub_group_size": args.ds_sub_group_size, "buffer_count": args.ds_buffer_count,
                      "block_size": args.ds_block_size, "queue_depth": args.ds_queue_depth,
                      "intra_op_parallelism": args.ds_intra_op, "pipeline": args.ds_pipeline,
                      "optimizer_buffer_count": args.ds_optimizer_buffer_count,
                      "max_in_cpu": args.ds_max_in_cpu},
    }


def run_rounds(args: argparse.Namespace, cfg: LlamaConfig, workdir: str, floors: dict[str, float]
               ) -> dict[str, list[dict[str, Any]]]:
    """Every contender ``--rounds`` times, the order rotated round by round; each in a process and a
    directory of its own, deleted after it."""
    names = ["engine", *args.peer]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    env = {"PYTHONPATH": os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)}
    rss_limit = int(args.rss_limit_gib * GiB) if args.rss_limit_gib else None
    for k in range(args.rounds):
        for name in rotated(names, k):
            label = f"{name}-{k}"
            print(f"round {k}: {name}", flush=True)
            rundir = os.path.join(workdir, label)
            os.makedirs(rundir)
            spec = {**contender_spec(args, cfg, rundir), "port": new_port()}
            try:
                run = run_contender(CONTENDERS[name], spec, workdir, label, rss_limit=rss_limit, env=env)
            finally:
                shutil.rmtree(rundir, ignore_errors=True)
                if name == "deepspeed":
                    remove_shared_buffers(spec["port"])
            for i, s in enumerate(run.get("steps", [])):
                s.update(round=k, step=i, bytes_per_param=(s["bytes_read"] + s["bytes_written"]) / cfg.num_params,
                         written_per_param=s["bytes_written"] / cfg.num_params,
                         io_floor_s=s["bytes_read"] / floors["fio_read_bps"]
                         + s["bytes_written"] / floors["fio_write_bps"])
            if run["failure"] is not None:
                print(f"round {k}: {name} stopped in {run.get('phase', 'its start')}, after "
                      f"{len(run.get('steps', []))} steps: {run['failure']}", flush=True)
                for line in run.get("stderr_tail", [])[-8:]:
                    print(f"  | {line}", flush=True)
            else:
                print(f"round {k}: {name}: median step {median_steady(run, 'seconds') or 0:.1f} s, "
                      f"{median_steady(run, 'bytes_per_param') or 0:.1f} B/param, peak RSS "
                      f"{run['peak_rss'] / GiB:.2f} GiB", flush=True)
            runs[name].append(run)
    return runs


def summarize_deepspeed(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """DeepSpeed's figures over its rounds (no targets of its own)."""
    done = [r for r in runs if len(r.get("steps", [])) > 1]
    out: dict[str, Any] = {"failures": [r["failure"] for r in runs if r["failure"] is not None]}
    if done:
        out.update(step_s=[median_steady(r, "seconds") for r in done],
                   bytes_per_param=[median_steady(r, "bytes_per_param") for r in done],
                   written_per_param=[median_steady(r, "written_per_param") for r in done],
                   peak_rss=[r["peak_rss"] for r in done])
        print(f"DeepSpeed: step {', '.join(f'{v:.1f}' for v in out['step_s'])} s; "
              f"{', '.join(f'{v:.1f}' for v in out['bytes_per_param'])} B/param; peak RSS "
              f"{', '.join(f'{v / GiB:.2f}' for v in out['peak_rss'])} GiB")
    return out


def same_losses(runs: list[dict[str, Any]]) -> bool:
    """Whether every finished run of a contender has the first's losses, bit for bit (the same model,
    batch and math each round)."""
    done = [[s["loss"] for s in r["steps"]] for r in runs if r["failure"] is None]
    return all(losses == done[0] for losses in done[1:])


def first_losses(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Optional[float]]:
    """Each contender's loss at the first step (before any update: the same model and batch give the
    same value, bit for bit in fp32 where the forward's math is the same)."""
    found = {name: next((r["steps"][0]["loss"] for r in rs if r.get("steps")), None) for name, rs in runs.items()}
    return {name: loss for name, loss in found.items() if loss is not None}


def falling(run: dict[str, Any]) -> bool:
    """Whether the loss of ``run`` stayed finite and ended below where it began."""
    losses = [s["loss"] for s in run.get("steps", [])]
    return len(losses) > 1 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def plot(result: dict[str, Any], path: str) -> None:
    """Step time against the floors, bytes per parameter, and RSS over the run against the budget
    (the engine's first run)."""
    plt = pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = result["steps"]
    idx = list(range(len(steps)))
    a.bar(idx, [s["seconds"] for s in steps], color="tab:blue", label="step")
    a.plot(idx, [s["io_floor_s"] for s in steps], "k_", markersize=22, mew=2, label="I/O floor")
    a.axhline(result["floors"]["compute_s"], color="tab:red", ls="--", label="compute floor")
    a.set_xlabel("step")
    a.set_ylabel("seconds")
    a.legend(fontsize=8)
    b.bar([i - 0.2 for i in idx], [s["bytes_read"] / result["params"] for s in steps], 0.4, label="read")
    b.bar([i + 0.2 for i in idx], [s["bytes_written"] / result["params"] for s in steps], 0.4, label="written")
    target = moved_target(result["dtype"], result["max_grad_norm"] is not None)
    b.axhline(target, color="grey", ls=":", label=f"{target} B moved")
    b.set_xlabel("step")
    b.set_ylabel("bytes per parameter")
    b.legend(fontsize=8)
    series = result["rss_series"]
    c.plot([t for t, _ in series], [(r - result["rss_before_wrap"]) / GiB for _, r in series], lw=1,
           label="RSS growth")
    c.axhline(result["host_bytes"] / GiB, color="tab:green", ls="--", label="host_bytes")
    c.axhline((1.1 * result["host_bytes"] + RSS_ALLOWANCE) / GiB, color="tab:red", ls=":", label="bound")
    c.set_xlabel("seconds since wrap")
    c.set_ylabel("GiB")
    c.legend(fontsize=8)
    fig.suptitle(f"{result['params'] / 1e9:.2f} B parameters, {result['state_bytes'] / GiB:.1f} GiB of "
                 f"{result['dtype']} training state, {result['ram_bytes'] / GiB:.1f} GiB of RAM")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--ram-multiple", type=float, default=1.5, help="fp32 training state / RAM (default 1.5)")
    p.add_argument("--state-gib", type=float, help="size the model for this much fp32 training state instead")
    p.add_argument("--dim", type=int, default=2560, help="model width (default 2560; heads of 128)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--host-gib", type=float, default=2.0, help="StoreConfig.host_bytes in GiB (default 2)")
    p.add_argument("--steps", type=int, default=6, help="steps to train (>= 3; the first is not counted, and a "
                   "verdict needs five more)")
    p.add_argument("--tokens", type=int, default=32, help="tokens in the fixed batch")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="float32 (default), or bfloat16 weights on fp32 masters (EngineConfig.train_dtype)")
    p.add_argument("--max-grad-norm", type=float, help="EngineConfig.max_grad_norm: clip the gradients' global "
                   "2-norm (default: no clipping)")
    p.add_argument("--step-in-backward", nargs="?", choices=tuple(STEP_IN_BACKWARD), const="true", default="auto",
                   help="EngineConfig.step_in_backward: auto (None, the default: inside backward where it gives "
                   "torch's results), true (alone: the same) or false (the step after backward)")
    p.add_argument("--after-backward-json", help="the JSON of a --step-in-backward false run of the same model and "
                   "dtype: its bytes per parameter are the target of the steps where the clip norm binds "
                   "(default: the design's figure, 40 in fp32, 38 in bf16)")
    p.add_argument("--compress-optimizer", action="store_true", help="EngineConfig.compress_optimizer=True")
    p.add_argument("--fused", action="store_true", help="engine.AdamW(fused=True), and torch's fused AdamW "
                   "in the compute floor")
    p.add_argument("--floor-reps", type=int, default=3, help="in-memory steps timed per layer count (the "
                   "fastest counts)")
    p.add_argument("--device", default="cpu", help="compute device: cpu (default) or cuda[:N]; the state is sized "
                   "from host RAM either way")
    p.add_argument("--peer", action="append", choices=("deepspeed",), default=[],
                   help="run this contender beside the engine: deepspeed (ZeRO-3, parameters and optimizer on nvme)")
    p.add_argument("--rounds", type=int, default=1, help="times each contender runs, alternating (default 1; a "
                   "verdict beside a peer needs 5)")
    p.add_argument("--rss-limit-gib", type=float, help="kill a contender whose RSS passes this (reported as what "
                   "stopped it); default: no limit but the machine's")
    ds = p.add_argument_group("DeepSpeed's settings (--peer deepspeed)")
    ds.add_argument("--ds-sub-group-size", type=int, default=20_000_000, help="zero_optimization.sub_group_size "
                    "(default 2e7: as fast as 1e8 here, 1.4 GiB less RSS)")
    ds.add_argument("--ds-buffer-count", type=int, default=5, help="offload_param.buffer_count (default 5)")
    ds.add_argument("--ds-max-in-cpu", type=int, default=1_000_000_000, help="offload_param.max_in_cpu: parameter "
                    "elements kept in CPU memory (default 1e9, DeepSpeed's; 0 puts every parameter on nvme)")
    ds.add_argument("--ds-block-size", type=int, default=1 << 20, help="aio.block_size (default 1 MiB)")
    ds.add_argument("--ds-queue-depth", type=int, default=8, help="aio.queue_depth (default 8)")
    ds.add_argument("--ds-intra-op", type=int, default=1, help="aio.intra_op_parallelism (default 1)")
    ds.add_argument("--ds-pipeline", action="store_true", help="offload_optimizer.pipeline_read and pipeline_write "
                    "(needs --ds-optimizer-buffer-count 8 or so)")
    ds.add_argument("--ds-optimizer-buffer-count", type=int, default=4, help="offload_optimizer.buffer_count "
                    "(default 4)")
    add_fio_arguments(p)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error(f"--steps must be >= 3, got {args.steps}")
    if args.floor_reps < 1:
        p.error(f"--floor-reps must be >= 1, got {args.floor_reps}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.dim < 256 or args.dim % 256:
        p.error(f"--dim must be a multiple of 256, got {args.dim}")
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        p.error(f"--max-grad-norm must be > 0, got {args.max_grad_norm}")
    args.peer = sorted(set(args.peer))
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        args.device = torch.device(args.device)
    except RuntimeError as exc:
        print(f"error: --device {args.device!r} is not a device: {exc}", file=sys.stderr)
        return 2
    if args.device.type not in ("cpu", "cuda"):
        print(f"error: --device must be cpu or cuda, got {str(args.device)!r}", file=sys.stderr)
        return 2
    if args.device.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {args.device} but torch sees no CUDA device here", file=sys.stderr)
        return 2
    try:
        reference = after_backward_reference(args.dtype, args.after_backward_json)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: --after-backward-json: {exc}", file=sys.stderr)
        return 2
    ram = ram_bytes()
    cfg = model_config(args, ram)
    state_per_param = STATE_BYTES_PER_PARAM[args.dtype]
    state_bytes = cfg.num_params * state_per_param
    print(f"model: {cfg.n_layers} layers x {cfg.dim}, {cfg.num_params / 1e9:.2f} B parameters, "
          f"{state_bytes / GiB:.1f} GiB of {args.dtype} training state ({state_per_param} bytes a parameter"
          + (": bf16 weights 2, fp32 masters 4, gradients 4 and moments 8" if args.dtype == "bfloat16" else "")
          + f") on {ram / GiB:.1f} GiB of RAM", flush=True)
    workdir = scratch_dir(args.dir, "tiered-beyond-memory-")
    machine = {**machine_info(workdir), **bf16_support()}
    try:
        try:
            estimated_disk = check_room(args, cfg, contender_spec(args, cfg, workdir), workdir)
        except NoRoom as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        fio = disk_limit(args, workdir)
        if fio is None:
            print("error: the I/O floor needs fio's best bandwidth on this disk (install fio, and leave --fio-size "
                  "above 0)", file=sys.stderr)
            return 2
        torch.manual_seed(args.seed)
        sample = torch.randint(0, cfg.vocab_size, (1, args.tokens + 1))
        compute = compute_floor(cfg, sample[:, :-1], sample[:, 1:], args.floor_reps, args.device,
                                getattr(torch, args.dtype), args.fused, args.max_grad_norm)
        print(f"compute floor: {compute['seconds']:.1f} s a step in {args.device} memory, {args.dtype}"
              + (f" (AVX512-BF16: {'yes' if machine['avx512_bf16'] else 'no'})" if args.dtype == "bfloat16" else ""),
              flush=True)
        floors = {"fio_read_bps": fio["read_bytes_per_s"], "fio_write_bps": fio["write_bytes_per_s"],
                  "compute_s": compute["seconds"]}
        runs = run_rounds(args, cfg, workdir, floors)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    host_bytes = int(args.host_gib * GiB)
    engine_runs = runs["engine"]
    summary = summarize_engine(engine_runs, floors, state_bytes, host_bytes, args.dtype, args.max_grad_norm, reference,
                               estimated_disk)
    peers = {}
    if "deepspeed" in runs:
        peers["deepspeed"] = {"runs": runs["deepspeed"], "summary": summarize_deepspeed(runs["deepspeed"]),
                              "vs_engine": compare_with_deepspeed(engine_runs, runs["deepspeed"])}
    first = engine_runs[0]
    firsts = first_losses(runs)
    if len(firsts) > 1:
        print("first step's loss (no update yet): " + ", ".join(f"{n} {v!r}" for n, v in firsts.items())
              + (" (equal)" if len(set(firsts.values())) == 1 else " (differ)"))
    result = with_machine({
        "params": cfg.num_params, "config": dataclasses.asdict(cfg), "dtype": args.dtype,
        "state_bytes_per_param": state_per_param, "state_bytes": state_bytes,
        "ram_bytes": ram, "host_bytes": host_bytes, "tokens": args.tokens,
        "max_grad_norm": args.max_grad_norm, "step_in_backward": args.step_in_backward,
        "compress_optimizer": args.compress_optimizer, "fused": args.fused, "rounds": args.rounds, "fio": fio,
        "device": str(args.device), **({"gpu": torch.cuda.get_device_name(args.device)}
                                       if args.device.type == "cuda" else {}),
        "compute": compute, "floors": floors, "summary": summary,
        "engine": {"runs": engine_runs, "same_losses_every_round": same_losses(engine_runs)}, "peers": peers,
        "first_step_losses": firsts,
        # the engine's first run where one run is read (plot, earlier readers)
        "steps": first.get("steps", []), "wrap_seconds": first.get("wrap_seconds"),
        "rss_before_wrap": first.get("rss_before_wrap"), "rss_series": first.get("rss_series", []),
    }, machine)
    write_json(result, args.json)
    if args.plot and result["steps"]:
        plot(result, args.plot)
    code = 0
    for run in engine_runs:
        if run["failure"] is not None:
            print(f"error: the engine's run failed: {run['failure']}", file=sys.stderr)
            code = 1
    if not same_losses(engine_runs):
        losses = [[s["loss"] for s in r["steps"]] for r in engine_runs]
        print(f"error: the engine's losses differ between rounds: {losses}", file=sys.stderr)
        code = 1
    for name, rs in runs.items():
        for k, run in enumerate(rs):
            if not falling(run):
                print(f"error: {name}'s loss did not fall (or was not finite) in round {k}: "
                      f"{[s['loss'] for s in run['steps']]}", file=sys.stderr)
                code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
