"""Training a model whose state is larger than the machine's memory, against the disk's floor.

A Llama-style model (``engine.demo.llama``) is sized from the machine's RAM so that its fp32
training state (parameter, gradient and two AdamW moments: 16 bytes a parameter) is ``--ram-multiple``
times the RAM (1.5 by default), built on the meta device, wrapped with everything on nvme and a
small host budget, and trained for ``--steps`` steps on one fixed batch. Each step reports its wall
time and where it went (waits for parameters and for the optimizer's I/O, AdamW's math, the store's
checksums and staging copies, the process's CPU time, the seconds the disk had a request in
flight), the bytes the process read and wrote (``/proc/self/io``) and per parameter, the nvme
footprint, and the peak RSS against the host budget; beside them two floors:

- I/O floor: the step's bytes read / fio's best read bandwidth + bytes written / fio's best write
  bandwidth, fio swept over queue depth and block size on the same directory in the same run;
- compute floor: the same model's forward + backward + AdamW step in memory, from a 1- and a
  2-layer copy timed here (the layers beyond the first cost what the second costs).

With ``--device cuda`` the model computes on the GPU (the state is still sized from host RAM and
streamed from nvme through host memory), and the compute floor is the GPU's.

The loss must fall every step; the run exits 1 if it does not, 2 when the disk has no room for the
run, fio is missing or ``--device`` names a device this machine lacks. Each target is judged on the
steps after the first (median and range).

    python benchmarks/beyond_memory.py --dir /nvme/scratch --json docs/beyond_memory.json \\
        --plot docs/beyond_memory.png
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import threading
import time
from typing import Any, Optional

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

from engine.demo.llama import STATE_BYTES_PER_PARAM, Llama, LlamaConfig, init_weights

MiB, GiB = 1 << 20, 1 << 30
#: Targets for the steps after the first (fp32, everything on nvme).
TARGET_BYTES_PER_PARAM = 32
TARGET_WRITTEN_PER_PARAM = 12
TARGET_FOOTPRINT = 1.1
TARGET_FLOOR_RATIO = 1.15
#: Peak RSS growth allowed over the budget: 1.1 x host_bytes + this (torch's and Python's own growth).
RSS_ALLOWANCE = 256 * MiB


def ram_bytes() -> int:
    """The machine's memory (MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal line")


def process_io() -> tuple[int, int]:
    """Bytes this process has read from and written to storage (``/proc/self/io``)."""
    fields = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            fields[key] = int(value)
    return fields["read_bytes"], fields["write_bytes"]


def disk_ticks(directory: str) -> Optional[tuple[float, float]]:
    """Seconds the disk holding ``directory`` has had I/O in flight, and the same weighted by the
    requests in flight, since boot (``/proc/diskstats``); None where the filesystem is not on a
    block device listed there (tmpfs, overlay)."""
    dev = os.stat(directory).st_dev
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if (int(fields[0]), int(fields[1])) == (os.major(dev), os.minor(dev)):
                return int(fields[12]) / 1000, int(fields[13]) / 1000
    return None


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def allocated_bytes(directory: str) -> int:
    """Bytes allocated on disk to the files under ``directory`` (st_blocks, links not followed)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass  # deleted while we walked
    return total


class Sampler:
    """A thread that samples RSS (every ``interval`` s) and the store's disk footprint (every
    ``disk_every``-th sample), keeping the series and the peaks since :meth:`mark`."""

    def __init__(self, directory: str, interval: float = 0.1, disk_every: int = 10) -> None:
        self.directory, self.interval, self.disk_every = directory, interval, disk_every
        self.t0 = time.perf_counter()
        self.series: list[tuple[float, int]] = []
        self.peak_rss = 0
        self.peak_disk = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="beyond-memory-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self) -> tuple[int, int]:
        """The peaks (RSS, disk) since the last mark; starts new ones."""
        peaks = (max(self.peak_rss, rss_bytes()), max(self.peak_disk, allocated_bytes(self.directory)))
        self.peak_rss = self.peak_disk = 0
        return peaks

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.interval):
            rss = rss_bytes()
            self.peak_rss = max(self.peak_rss, rss)
            self.series.append((time.perf_counter() - self.t0, rss))
            if n % self.disk_every == 0:
                self.peak_disk = max(self.peak_disk, allocated_bytes(self.directory))
            n += 1


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU's kernels run after the call that queued them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def in_memory_step_seconds(cfg: LlamaConfig, tokens: torch.Tensor, targets: torch.Tensor, reps: int,
                           device: torch.device, fused: bool = False) -> float:
    """Fewest seconds of forward + backward + torch AdamW step (``fused``: its fused kernel) of
    ``cfg``'s model in ``device``'s memory over ``reps`` steps (a floor: noise only adds to it)."""
    torch.manual_seed(0)
    model = Llama(cfg).to(device)
    tokens, targets = tokens.to(device), targets.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=fused or None)
    times = []
    for _ in range(reps + 1):  # the first builds the optimizer state: not counted
        synchronize(device)
        start = time.perf_counter()
        model(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def compute_floor(cfg: LlamaConfig, tokens: torch.Tensor, targets: torch.Tensor, reps: int,
                  device: torch.device, fused: bool = False) -> dict[str, float]:
    """The in-memory step of ``cfg``'s model, extrapolated from a 1- and a 2-layer copy."""
    one = in_memory_step_seconds(dataclasses.replace(cfg, n_layers=1), tokens, targets, reps, device, fused)
    two = in_memory_step_seconds(dataclasses.replace(cfg, n_layers=2), tokens, targets, reps, device, fused)
    return {"one_layer_s": one, "two_layers_s": two, "seconds": one + (cfg.n_layers - 1) * max(two - one, 0.0)}


def needed_disk_bytes(model: torch.nn.Module, config: Any) -> int:
    """What the store needs on disk during a step, from ``engine.estimate_memory``."""
    import engine

    return engine.estimate_memory(model, config).during_step.nvme


def train(args: argparse.Namespace, cfg: LlamaConfig, workdir: str, floors: dict[str, float]) -> dict[str, Any]:
    """Wrap the model on nvme and train ``args.steps`` steps on one batch; one dict per step."""
    import engine

    torch.manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.tokens + 1)).to(args.device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.device("meta"):
        model = Llama(cfg)
    config = engine_config(args, workdir)
    rss_before = rss_bytes()
    results: list[dict[str, Any]] = []
    with Sampler(workdir) as sampler:
        started = time.perf_counter()
        eng = engine.wrap(model, optimizer=engine.AdamW(lr=args.lr, weight_decay=0.0, fused=args.fused or None),
                          config=config, init_fn=init_weights)
        wrap_seconds = time.perf_counter() - started
        sampler.mark()
        try:
            for step in range(args.steps):
                results.append(one_step(eng, model, x, y, sampler, rss_before))
                r = results[-1]
                r["bytes_per_param"] = (r["bytes_read"] + r["bytes_written"]) / cfg.num_params
                r["written_per_param"] = r["bytes_written"] / cfg.num_params
                r["io_floor_s"] = (r["bytes_read"] / floors["fio_read_bps"]
                                   + r["bytes_written"] / floors["fio_write_bps"])
                print(f"step {step}: loss {r['loss']:.4f}, {r['seconds']:.1f} s (forward {r['forward_s']:.1f}, "
                      f"backward {r['backward_s']:.1f}, step {r['step_s']:.1f}), read {r['bytes_read'] / 1e9:.1f} GB, "
                      f"written {r['bytes_written'] / 1e9:.1f} GB ({r['bytes_per_param']:.1f} B/param), I/O floor "
                      f"{r['io_floor_s']:.1f} s, RSS +{r['peak_rss_growth'] / GiB:.2f} GiB, disk "
                      f"{r['peak_disk_bytes'] / 1e9:.1f} GB", flush=True)
                print(f"  where: waiting for parameters {r['param_stall_s']:.1f} s and for the optimizer's I/O "
                      f"{r['optimizer_stall_s']:.1f} s; AdamW {r['adamw_s']:.1f} s; the store's checksums "
                      f"{r['store_checksums_s']:.1f} s and staging copies {r['store_staging_s']:.1f} s; CPU "
                      f"{r['cpu_user_s']:.1f} s user + {r['cpu_system_s']:.1f} s system"
                      + (f"; the disk busy {r['disk_busy_s']:.1f} s, {r['disk_queue']:.1f} requests in flight "
                         "on average" if "disk_busy_s" in r else ""), flush=True)
        finally:
            eng.close()
    return {"steps": results, "wrap_seconds": wrap_seconds, "rss_before_wrap": rss_before,
            "rss_series": [(round(t, 2), b) for t, b in sampler.series]}


def engine_config(args: argparse.Namespace, workdir: str) -> Any:
    """The run's EngineConfig: everything on nvme under ``workdir``, ``--host-gib`` of host budget."""
    import engine
    import tiered

    return engine.EngineConfig(
        store=tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=int(args.host_gib * GiB)),
        param_tier="nvme", optimizer_tier="nvme", compress_optimizer=args.compress_optimizer,
        step_in_backward=args.step_in_backward, compute_device=str(args.device))


def check_room(args: argparse.Namespace, cfg: LlamaConfig, workdir: str) -> None:
    """NoRoom unless ``workdir``'s disk holds what the run writes: the store during a step (from
    ``engine.estimate_memory``) and fio's file."""
    with torch.device("meta"):
        model = Llama(cfg)
    needed = needed_disk_bytes(model, engine_config(args, workdir)) + max(args.fio_size, 0) + GiB
    free = shutil.disk_usage(workdir).free
    if free < needed:
        raise NoRoom(f"{workdir} has {free / 1e9:.1f} GB free; this run needs about {needed / 1e9:.1f} GB "
                     f"({cfg.num_params / 1e9:.2f} B parameters, {args.ram_multiple}x RAM of fp32 training state): "
                     "free some, or give --ram-multiple or --state-gib a smaller value")


class NoRoom(RuntimeError):
    """The disk cannot hold the run."""


def one_step(eng: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, sampler: Sampler,
             rss_before: int) -> dict[str, Any]:
    """Forward, backward, eng.step(), zero_grad, timed and measured."""
    device = x.device
    synchronize(device)
    stats_before = eng.stats()
    read0, written0 = process_io()
    disk0 = disk_ticks(sampler.directory)
    cpu0 = os.times()
    t0 = time.perf_counter()
    loss = model(x, y)
    synchronize(device)
    t1 = time.perf_counter()
    loss.backward()
    synchronize(device)
    t2 = time.perf_counter()
    eng.step()
    eng.zero_grad()
    synchronize(device)
    t3 = time.perf_counter()
    cpu1 = os.times()
    read1, written1 = process_io()
    disk1 = disk_ticks(sampler.directory)
    stats = eng.stats()
    peak_rss, peak_disk = sampler.mark()
    return {
        "loss": loss.item(), "seconds": t3 - t0, "forward_s": t1 - t0, "backward_s": t2 - t1, "step_s": t3 - t2,
        "bytes_read": read1 - read0, "bytes_written": written1 - written0,
        "param_stall_s": stats.stall_seconds - stats_before.stall_seconds,
        "optimizer_stall_s": stats.optimizer_stall_seconds - stats_before.optimizer_stall_seconds,
        # where the CPU went: AdamW's math, and the store's checksums and staging copies (summed over
        # its I/O threads)
        "adamw_s": stats.optimizer_update_seconds - stats_before.optimizer_update_seconds,
        "store_checksums_s": stats.store.checksum_seconds - stats_before.store.checksum_seconds,
        "store_staging_s": stats.store.staging_seconds - stats_before.store.staging_seconds,
        "cpu_user_s": cpu1.user - cpu0.user, "cpu_system_s": cpu1.system - cpu0.system,
        "peak_rss_growth": peak_rss - rss_before, "peak_disk_bytes": peak_disk,
        # the disk's view: seconds with a request in flight, and the mean requests in flight then
        **({"disk_busy_s": disk1[0] - disk0[0],
            "disk_queue": (disk1[1] - disk0[1]) / max(disk1[0] - disk0[0], 1e-3)} if disk0 and disk1 else {}),
    }


def summarize(steps: list[dict[str, Any]], floors: dict[str, float], cfg: LlamaConfig,
              host_bytes: int) -> dict[str, Any]:
    """Each target judged from the steps after the first: median, range and whether it is met."""
    steady = steps[1:]
    state_bytes = cfg.num_params * STATE_BYTES_PER_PARAM
    floor = [max(s["io_floor_s"], floors["compute_s"]) for s in steady]
    return {
        "state_bytes": state_bytes,
        "verdicts": [
            verdict("bytes moved per parameter", [s["bytes_per_param"] for s in steady], TARGET_BYTES_PER_PARAM,
                    at_most=True),
            verdict("bytes written per parameter", [s["written_per_param"] for s in steady],
                    TARGET_WRITTEN_PER_PARAM, at_most=True),
            verdict("nvme footprint / training state", [s["peak_disk_bytes"] / state_bytes for s in steady],
                    TARGET_FOOTPRINT, at_most=True),
            verdict("step / max(I/O floor, compute floor)", [s["seconds"] / f for s, f in zip(steady, floor)],
                    TARGET_FLOOR_RATIO, at_most=True),
            verdict("peak RSS growth / (1.1 x host_bytes + 256 MiB)",
                    [s["peak_rss_growth"] / (1.1 * host_bytes + RSS_ALLOWANCE) for s in steady], 1.0, at_most=True),
        ],
    }


def plot(result: dict[str, Any], path: str) -> None:
    """Step time against the floors, bytes per parameter, and RSS over the run against the budget."""
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
    b.axhline(TARGET_BYTES_PER_PARAM, color="grey", ls=":", label=f"{TARGET_BYTES_PER_PARAM} B moved")
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
    fig.suptitle(f"{result['params'] / 1e9:.2f} B parameters, {result['state_bytes'] / GiB:.1f} GiB of fp32 "
                 f"training state, {result['ram_bytes'] / GiB:.1f} GiB of RAM")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--ram-multiple", type=float, default=1.5, help="fp32 training state / RAM (default 1.5)")
    p.add_argument("--state-gib", type=float, help="size the model for this much training state instead")
    p.add_argument("--host-gib", type=float, default=2.0, help="StoreConfig.host_bytes in GiB (default 2)")
    p.add_argument("--steps", type=int, default=6, help="steps to train (>= 3; the first is not counted, and a "
                   "verdict needs five more)")
    p.add_argument("--tokens", type=int, default=32, help="tokens in the fixed batch")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compress-optimizer", action="store_true", help="EngineConfig.compress_optimizer=True")
    p.add_argument("--step-in-backward", action="store_true",
                   help="EngineConfig.step_in_backward=True: the updates run inside backward, no gradient is stored")
    p.add_argument("--fused", action="store_true", help="engine.AdamW(fused=True), and torch's fused AdamW "
                   "in the compute floor")
    p.add_argument("--floor-reps", type=int, default=3, help="in-memory steps timed per layer count (the "
                   "fastest counts)")
    p.add_argument("--device", default="cpu", help="compute device: cpu (default) or cuda[:N]; the state is sized "
                   "from host RAM either way")
    add_fio_arguments(p)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error(f"--steps must be >= 3, got {args.steps}")
    if args.floor_reps < 1:
        p.error(f"--floor-reps must be >= 1, got {args.floor_reps}")
    try:
        args.device = torch.device(args.device)
    except RuntimeError as exc:
        p.error(f"--device {args.device!r} is not a device: {exc}")
    if args.device.type not in ("cpu", "cuda"):
        p.error(f"--device must be cpu or cuda, got {str(args.device)!r}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {args.device} but torch sees no CUDA device here", file=sys.stderr)
        return 2
    ram = ram_bytes()
    state = int(args.state_gib * GiB) if args.state_gib else int(args.ram_multiple * ram)
    cfg = LlamaConfig.for_state_bytes(state)
    print(f"model: {cfg.n_layers} layers x {cfg.dim}, {cfg.num_params / 1e9:.2f} B parameters, "
          f"{cfg.num_params * STATE_BYTES_PER_PARAM / GiB:.1f} GiB of fp32 training state on "
          f"{ram / GiB:.1f} GiB of RAM", flush=True)
    workdir = scratch_dir(args.dir, "tiered-beyond-memory-")
    machine = machine_info(workdir)
    try:
        try:
            check_room(args, cfg, workdir)
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
        compute = compute_floor(cfg, sample[:, :-1], sample[:, 1:], args.floor_reps, args.device, args.fused)
        print(f"compute floor: {compute['seconds']:.1f} s a step in {args.device} memory", flush=True)
        floors = {"fio_read_bps": fio["read_bytes_per_s"], "fio_write_bps": fio["write_bytes_per_s"],
                  "compute_s": compute["seconds"]}
        run = train(args, cfg, workdir, floors)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    host_bytes = int(args.host_gib * GiB)
    summary = summarize(run["steps"], floors, cfg, host_bytes)
    result = with_machine({
        "params": cfg.num_params, "config": dataclasses.asdict(cfg), "state_bytes": summary["state_bytes"],
        "ram_bytes": ram, "host_bytes": host_bytes, "tokens": args.tokens,
        "compress_optimizer": args.compress_optimizer, "step_in_backward": args.step_in_backward,
        "fused": args.fused, "fio": fio,
        "device": str(args.device), **({"gpu": torch.cuda.get_device_name(args.device)}
                                       if args.device.type == "cuda" else {}),
        "compute": compute, "floors": floors,
        "summary": summary, **run,
    }, machine)
    write_json(result, args.json)
    if args.plot:
        plot(result, args.plot)
    losses = [s["loss"] for s in run["steps"]]
    if not all(later < earlier for earlier, later in zip(losses, losses[1:])):
        print(f"error: the loss did not fall every step: {losses}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
