"""Forward-only inference with the weights on disk: tiered's engine vs accelerate's ``disk_offload``.

Both page a GPT-2-style model's fp32 weights from files in the same directory for every forward;
the in-memory model gives the reference outputs and the compute-only time. Reads are cold: the
engine's store reads with O_DIRECT and its host budget is far below the model, so a forward from
nothing prefetched reads every weight from the disk; accelerate's memory-mapped weight files have their pages dropped
before each run (``/proc/sys/vm/drop_caches`` when permitted, else ``posix_fadvise(DONTNEED)`` on
each file, which works without root for files whose pages are clean). Which of the two was used is
printed.

    python benchmarks/inference_bench.py --dir /nvme/scratch --repeats 5 --json inf.json --plot inf.png

The target: one cold forward of the engine at most 0.3 of accelerate's, judged from the ratios
taken within each repetition (their median, with the range, from >= 5 repetitions). A cold forward
cannot beat reading every weight once, so fio's best read on the same disk, swept at the start of
the run, gives the floor: the weights' bytes / fio's best read, and each cold forward over it.
The outputs of every contender must equal the in-memory model's bit for bit, or the script exits 1.

``--device cuda`` computes on the GPU for every contender (accelerate's ``execution_device``, the
engine's ``compute_device``, the reference model moved there); the weights still come from the disk.

The engine is timed two ways: one forward with nothing prefetched (``eng.drop_prefetched()`` first),
and per forward over ``--loop`` forwards back to back (a forward-only loop prefetches the next
forward's first weights while the current one ends, and a weight needed first and last, the tied
``wte``/``lm_head``, stays in the prefetch window; the bytes read per forward are printed).
Everything runs with the defaults a user gets: no allocator settings, no environment variables (the
engine reads large parameters into its own page-aligned, pre-faulted buffers, reused from forward to
forward: ``engine/paging/param_buffers.py``). The steady-state figures at the end include
the engine's minor page faults and CPU seconds per forward.

Needs ``transformers`` and ``accelerate`` (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import resource
import shutil
import statistics
import sys
import time
from typing import Callable, Optional

import torch
from bench_output import (
    add_fio_arguments,
    compute_device,
    disk_limit,
    machine_info,
    pyplot,
    scratch_dir,
    synchronize,
    verdict,
    with_machine,
    write_json,
)

MiB = 1024 * 1024
#: The target: one cold forward of the engine at most this fraction of accelerate's.
TARGET = 0.3


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


class ReadFloor:
    """Times one read of ``keys`` of a store from the disk, nothing else running: in that order (the
    order they were written in and a forward reads them), with up to ``window`` bytes in flight (the
    engine's prefetch window), into page-aligned buffers (O_DIRECT in place, no copies). The I/O a
    forward from nothing prefetched must wait for, without its compute: the floor for such a forward."""

    def __init__(self, store, keys: list[str], window: int) -> None:
        from tiered.io import AlignedBuffer

        self._store = store
        self._keys = keys
        self._window = window
        self._buffers = []
        self._outs = []
        for key in self._keys:
            info = store.info(key)
            self._buffers.append(AlignedBuffer(max(info.nbytes, 1), prefault=True))
            self._outs.append(self._buffers[-1].tensor[: info.nbytes].view(info.dtype).view(info.shape))

    def seconds(self) -> float:
        """One timed read of everything."""
        start = time.perf_counter()
        pending: list = []
        in_flight = 0
        for key, out in zip(self._keys, self._outs):
            nbytes = out.numel() * out.element_size()
            while pending and in_flight + nbytes > self._window:
                future, done_bytes = pending.pop(0)
                future.result()
                in_flight -= done_bytes
            pending.append((self._store.sync.get_future(key, "cpu", out=out), nbytes))
            in_flight += nbytes
        for future, _ in pending:
            future.result()
        return time.perf_counter() - start

    def close(self) -> None:
        """Unmap the buffers."""
        self._outs.clear()
        for buffer in self._buffers:
            buffer.close()


def timed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    """Seconds ``fn`` takes, its kernels on ``device`` included."""
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def loop_forwards(model: torch.nn.Module, ids: torch.Tensor, expected: torch.Tensor, count: int,
                  contender: Contender) -> torch.Tensor:
    """``count`` forwards back to back, each output compared with ``expected``; returns the last."""
    for _ in range(count):
        out = model(ids).logits
        contender.equal &= bool(torch.equal(out, expected))
    return out


def run(args: argparse.Namespace, device: torch.device) -> dict:
    import accelerate

    import engine
    import tiered
    from engine.paging.layout import param_key

    torch.set_num_threads(args.threads or torch.get_num_threads())
    reference = build_model(args.layers, args.embd, args.seed)
    nbytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    ids = torch.randint(0, reference.config.vocab_size, (args.batch, args.tokens),
                        generator=torch.Generator().manual_seed(1)).to(device)
    print(f"model: GPT-2 style, {args.layers} layers x {args.embd}, {nbytes / 1e9:.2f} GB fp32; "
          f"input {tuple(ids.shape)}; computing on {device}")

    machine = machine_info(args.dir)
    workdir = scratch_dir(args.dir, "tiered-inference-")
    try:
        limit = disk_limit(args, os.path.join(workdir, "fio"))  # alone, before anything else runs
        offloaded = copy.deepcopy(reference)
        wrapped_model = copy.deepcopy(reference)
        reference.to(device)
        with torch.inference_mode():
            expected = reference(ids).logits

        memory = Contender("in memory (compute only)")

        acc_dir = os.path.join(workdir, "accelerate")
        accelerate.disk_offload(offloaded, acc_dir, execution_device=device)
        acc = Contender("accelerate disk_offload, cold")

        chosen = {"io_threads": args.io_threads, "queue_depth": args.queue_depth}
        store_cfg = tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=args.host_mib * MiB,
                                       **{name: value for name, value in chosen.items() if value})  # 0: the default
        eng = engine.wrap(
            wrapped_model,
            config=engine.EngineConfig(store=store_cfg, host_budget="host_tier", param_tier="nvme",
                                       prefetch_bytes=args.prefetch_mib * MiB, compute_device=str(device)),
        )
        ours = Contender("tiered engine, nvme, one forward from nothing prefetched")
        ours.note = (f"host budget {args.host_mib} MiB, prefetch {args.prefetch_mib} MiB, "
                     f"{store_cfg.io_threads} io threads, queue depth {store_cfg.queue_depth}, O_DIRECT reads")
        loop = Contender(f"tiered engine, nvme, per forward in a loop of {args.loop}")

        cold_reads: list[int] = []  # store bytes read while a cold forward ran
        floor = ReadFloor(eng.store, [param_key(name) for name, _ in wrapped_model.named_parameters()],
                          args.prefetch_mib * MiB)
        floor_seconds: list[float] = []
        with torch.inference_mode():
            wrapped_model(ids)  # records the order: later forwards prefetch along it
        for rep in range(args.repeats):
            # Rotate the order so drift in the disk's speed hits every contender alike.
            steps = [("memory", memory), ("accelerate", acc), ("tiered", ours), ("loop", loop), ("floor", None)]
            steps = steps[rep % 5:] + steps[:rep % 5]
            for what, contender in steps:
                if contender is None:
                    floor_seconds.append(floor.seconds())
                    continue
                with torch.inference_mode():
                    if what == "memory":
                        seconds, out = timed(lambda: reference(ids).logits, device)
                    elif what == "accelerate":
                        acc.note = drop_page_cache(files_under(acc_dir))
                        seconds, out = timed(lambda: offloaded(ids).logits, device)
                    elif what == "tiered":
                        eng.drop_prefetched()
                        read_before = eng.stats().store.bytes_read
                        seconds, out = timed(lambda: wrapped_model(ids).logits, device)
                        cold_reads.append(eng.stats().store.bytes_read - read_before)
                    else:
                        eng.drop_prefetched()
                        # Each output is checked as it comes (a large batch's logits, ten times over, would not
                        # fit a GPU), as a user's loop consumes each forward's result before the next.
                        seconds, out = timed(lambda: loop_forwards(wrapped_model, ids, expected, args.loop, contender),
                                             device)
                        seconds /= args.loop
                    if what in ("tiered", "loop"):
                        eng.drop_prefetched()  # waits for the next forward's prefetch: nothing runs into the others
                contender.seconds.append(seconds)
                contender.equal &= bool(torch.equal(out, expected))
            last = ", ".join(f"{c.name.split(',')[0]} {c.seconds[-1]:.2f}s" for c in (memory, acc, ours, loop))
            print(f"  run {rep + 1}/{args.repeats}: {last}, reading every weight once {floor_seconds[-1]:.2f}s",
                  file=sys.stderr)
        floor.close()
        with torch.inference_mode():
            wrapped_model(ids)  # steady state: what one forward prefetches for the next, it is given by the last
            before, usage_before = eng.stats(), resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            for _ in range(2):
                wrapped_model(ids)
            synchronize(device)
            steady_seconds = (time.perf_counter() - start) / 2
            after, usage_after = eng.stats(), resource.getrusage(resource.RUSAGE_SELF)
        read_per_forward = (after.store.bytes_read - before.store.bytes_read) / 2
        loop.note = f"reads {read_per_forward / 1e9:.2f} GB per forward from the disk"
        ours.note += f"; {statistics.median(cold_reads) / 1e9:.2f} GB read while it ran"
        steady = {
            "seconds_per_forward": steady_seconds,
            "minor_faults_per_forward": (usage_after.ru_minflt - usage_before.ru_minflt) / 2,
            "cpu_seconds_per_forward": (usage_after.ru_utime + usage_after.ru_stime
                                        - usage_before.ru_utime - usage_before.ru_stime) / 2,
            "stall_seconds_per_forward": (after.stall_seconds - before.stall_seconds) / 2,
        }
        stats = {k: v for k, v in after.as_dict().items() if isinstance(v, (int, float, dict))}
        eng.unwrap()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    contenders = [memory, acc, ours, loop]
    read_floor = statistics.median(floor_seconds)
    read_gbps = nbytes / read_floor / 1e9
    judged = verdict("tiered one cold forward / accelerate", [a / b for a, b in zip(ours.seconds, acc.seconds)],
                     TARGET, at_most=True)
    fio_floor = None if limit is None else nbytes / limit["read_bytes_per_s"]
    over_floor = None if fio_floor is None else [s / fio_floor for s in ours.seconds]
    if over_floor:
        print(f"the weights' bytes at fio's best read take {fio_floor:.3f} s: a cold forward took "
              f"{statistics.median(over_floor):.2f} times that (range {min(over_floor):.2f}-{max(over_floor):.2f})")
    result = {
        "model_bytes": nbytes,
        "input_shape": list(ids.shape),
        "device": str(device),
        "repeats": args.repeats,
        "loop": args.loop,
        "store_read_gbps": read_gbps,
        "read_floor_s": read_floor,
        "read_floor_seconds": floor_seconds,
        "engine_bytes_read_per_forward": read_per_forward,
        "engine_bytes_read_during_cold_forward": cold_reads,
        "engine_steady_state": steady,
        "fio": limit,
        "fio_read_floor_s": fio_floor,
        "cold_forward_over_fio_floor": over_floor,
        "cold_forward_over_fio_floor_median": None if not over_floor else statistics.median(over_floor),
        "verdict": judged,
        "loop_over_accelerate": [a / b for a, b in zip(loop.seconds, acc.seconds)],
        "contenders": [
            {"name": c.name, "seconds": c.seconds, "median": c.median, "min": min(c.seconds), "max": max(c.seconds),
             "equal_outputs": c.equal, "note": c.note}
            for c in contenders
        ],
        "ratio_tiered_to_accelerate": judged["median"],
        "ratio_tiered_loop_to_accelerate": statistics.median(a / b for a, b in zip(loop.seconds, acc.seconds)),
        "ratio_read_floor_to_accelerate": read_floor / acc.median,
        "target_ratio": TARGET,
        "engine_stats": stats,
    }
    result = with_machine(result, machine)
    print()
    print("| contender | median s | min | max | outputs equal | note |")
    print("|---|---|---|---|---|---|")
    for c in contenders:
        print(f"| {c.name} | {c.median:.3f} | {min(c.seconds):.3f} | {max(c.seconds):.3f} | {c.equal} | {c.note} |")
    print(f"\ntiered / accelerate (median of the ratios within each repetition): "
          f"{result['ratio_tiered_to_accelerate']:.3f} one forward (target <= {TARGET}), "
          f"{result['ratio_tiered_loop_to_accelerate']:.3f} per forward in a loop")
    print(f"reading every weight of the {nbytes / 1e9:.2f} GB model once in forward order, {args.prefetch_mib} MiB in "
          f"flight, nothing else running: "
          f"{read_floor:.3f} s ({read_gbps:.2f} GB/s), {read_floor / acc.median:.3f} of accelerate's time; "
          f"the engine reads {read_per_forward / 1e9:.2f} GB per forward in a loop")
    print(f"engine in steady state, per forward: {steady['seconds_per_forward']:.3f} s, "
          f"{steady['minor_faults_per_forward']:.0f} minor page faults, "
          f"{steady['cpu_seconds_per_forward']:.2f} CPU s (all threads), {steady['stall_seconds_per_forward']:.3f} s "
          f"waiting for weights")
    return result


def plot(result: dict, path: str) -> None:
    plt = pyplot()

    names = [c["name"] for c in result["contenders"]]
    med = [c["median"] for c in result["contenders"]]
    lo = [c["median"] - c["min"] for c in result["contenders"]]
    hi = [c["max"] - c["median"] for c in result["contenders"]]
    fig, ax = plt.subplots(figsize=(9.5, 3.2))
    ax.barh(names, med, xerr=[lo, hi], color=["#999999", "#d08c60", "#4c72b0", "#55a868"][: len(names)])
    ax.axvline(result["read_floor_s"], color="k", ls="--", lw=1, label="reading every weight once, no compute")
    ax.legend(loc="lower right", fontsize=8)
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
    p.add_argument("--repeats", type=int, default=5, help="repetitions (>= 5 for a verdict)")
    p.add_argument("--host-mib", type=int, default=64,
                   help="the store's host tier (keep it far below the model; the engine's working set comes on top)")
    p.add_argument("--prefetch-mib", type=int, default=320,
                   help="the engine's prefetch window. The tied wte/lm_head (196 MiB) stays in it for the whole "
                        "forward; the rest must hold the next two layers (48 MiB each) for them to be read ahead "
                        "of the compute (docs/tuning.md section 3); 256 MiB leaves room for one")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--io-threads", type=int, default=0, help="the store's io_threads (0: StoreConfig's default)")
    p.add_argument("--queue-depth", type=int, default=0, help="the store's queue_depth (0: StoreConfig's default)")
    p.add_argument("--device", default="cpu",
                   help="where every contender computes: cpu, or cuda (the weights still come from the disk)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loop", type=int, default=10,
                   help="forwards back to back for the engine's loop timing (the first starts from nothing "
                        "prefetched, so a short loop mostly measures that cold start)")
    add_fio_arguments(p)
    p.add_argument("--json", help="write every run here")
    p.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.loop < 1:
        p.error(f"--repeats and --loop must be >= 1, got {args.repeats} and {args.loop}")
    result = run(args, compute_device(p, args.device))
    write_json(result, args.json)
    if args.plot:
        plot(result, args.plot)
    unequal = [c["name"] for c in result["contenders"] if not c["equal_outputs"]]
    if unequal:
        print(f"ERROR: outputs differ from the in-memory model's: {', '.join(unequal)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
