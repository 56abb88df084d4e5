"""Checkpoints and weight exports against torch.save / torch.load and the disk (fio), in one run.

    python benchmarks/checkpoint_bench.py --dir /nvme/scratch --rounds 3 --json checkpoint.json

A model of ``--layers`` x Linear(``--width``, ``--width``) in fp32 (1.07 GB at the defaults) is
wrapped with its parameters on nvme. Each round, in rotating order: ``eng.save_checkpoint`` (the
rank file, fsynced), ``eng.load_checkpoint`` (its file read back and put into the store),
``eng.save_weights`` (Hugging Face's safetensors, gathered one parameter at a time), and what
DeepSpeed's checkpoints use: ``torch.save`` of the same state dict (already consolidated in
memory, which favours it) plus an fsync, and ``torch.load`` of that file with its pages evicted
from the page cache first (fsync + ``POSIX_FADV_DONTNEED``; tiered reads with O_DIRECT anyway).
fio's sequential O_DIRECT write of a new file of the same size (allocated as written, as a
checkpoint is) and its read are the disk's own figures. Every file read is evicted from the page
cache first.
GB/s of tensor bytes; medians of the rounds, and each contender's ratio within its round to what
the disk allows it: fio's write for torch.save, fio's read for torch.load, and for the engine,
which reads from its swap files what it writes (or writes into them what it reads), the same
bytes read and written, 1 / (1/read + 1/write). fio runs at its best setting of each direction,
swept on the same disk at the start (``tiered.bench.fio_best``).
Every tensor is read back and compared after the last round; the script exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from typing import Callable, Optional

import torch

import engine
import tiered
from bench_output import (
    add_fio_arguments,
    disk_limit,
    machine_info,
    paired_median,
    print_table,
    rotated,
    scratch_dir,
    with_machine,
    write_json,
)
from tiered.bench.fio import READ, WRITE, FioFile
from tiered.bench.fio_sweep import best_setting
from tiered.bench.system import evict_file_pages

MiB = 1 << 20
CONTENDERS = ("tiered save_checkpoint", "tiered load_checkpoint", "tiered save_weights", "torch.save + fsync",
              "torch.load")
FIO = ("fio write", "fio read")


def torch_save(state: dict, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _round_trips(eng: engine.Engine, state: dict, exported: list[str], pt: str) -> bool:
    """The engine after its last load, the last export's files and the torch file all hold ``state``."""
    from safetensors.torch import load_file

    saved = {k: v for f in exported if f.endswith(".safetensors") for k, v in load_file(f).items()}
    loaded = torch.load(pt, weights_only=True)
    now = eng.state_dict()
    return all(torch.equal(now[k], v) and torch.equal(saved[k], v) and torch.equal(loaded[k], v)
               for k, v in state.items())


def run(args: argparse.Namespace) -> dict:
    machine = machine_info(args.dir)
    workdir = scratch_dir(args.dir, "tiered-checkpoint-")
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    store = tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=0, prefault_host=False)
    config = engine.EngineConfig(store=store, host_budget="host_tier", progress=False)  # no host tier at all
    eng = engine.wrap(model, config=config, init_fn=lambda m: torch.nn.init.normal_(m.weight, std=0.02))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state = eng.state_dict()
    # fio's best setting of each direction, swept on this disk; its rounds below use them
    limit = disk_limit(args, os.path.join(workdir, "fio-sweep"), nbytes=min(nbytes, args.fio_size), repeats=1)
    fio_sweep = None if limit is None else limit["sweep"]
    fio = None if limit is None else FioFile(os.path.join(workdir, "fio"), nbytes)
    if fio_sweep is not None:
        fio_write, fio_read = best_setting(fio_sweep, WRITE), best_setting(fio_sweep, READ)
    ckpt, weights, pt = (os.path.join(workdir, n) for n in ("ckpt", "weights", "model.pt"))
    torch_save(state, pt)
    eng.save_checkpoint(ckpt)

    def load_cold() -> None:
        evict_file_pages(pt)
        torch.load(pt, weights_only=True)

    def load_checkpoint() -> None:
        for name in os.listdir(ckpt):
            evict_file_pages(os.path.join(ckpt, name))
        eng.load_checkpoint(ckpt)

    exported: list[str] = []  # the files of the last export

    def export() -> None:
        exported[:] = eng.save_weights(weights)

    steps: dict[str, Callable[[], None]] = {
        "tiered save_checkpoint": lambda: eng.save_checkpoint(ckpt, overwrite=True),
        "tiered load_checkpoint": load_checkpoint,
        "tiered save_weights": export,
        "torch.save + fsync": lambda: torch_save(state, pt),
        "torch.load": load_cold,
    }
    runs: dict[str, list[float]] = {name: [] for name in (*CONTENDERS, *(FIO if fio else ()))}
    try:
        for r in range(args.rounds):
            for name in rotated(list(runs), r):
                if name in FIO:
                    assert fio is not None
                    run = fio.write(fio_write, fresh=True) if name == "fio write" else fio.read(fio_read)
                    runs[name].append(run.value)
                    continue
                start = time.perf_counter()
                steps[name]()
                runs[name].append(nbytes / (time.perf_counter() - start) / 1e9)
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in runs.items()),
                  file=sys.stderr)
        verified = _round_trips(eng, state, exported, pt)
    finally:
        eng.close()
        if fio is not None:
            fio.close()
        shutil.rmtree(workdir, ignore_errors=True)
    # What the disk allows each contender: torch.save only writes and torch.load only reads, while
    # the engine reads what it writes from its swap files (save, export) or writes what it reads
    # into them (load), so its limit is the same bytes read and written: 1 / (1/read + 1/write).
    reference: dict[str, Optional[list[float]]] = {"write": None, "read": None, "both": None}
    if fio:
        reference = {"write": runs["fio write"], "read": runs["fio read"],
                     "both": [1 / (1 / w + 1 / r) for w, r in zip(runs["fio write"], runs["fio read"])]}
        runs["disk limit, read + write"] = reference["both"]
    limit_of = {"torch.save + fsync": "write", "torch.load": "read", "fio write": "write", "fio read": "read"}
    rows = []
    for name, values in runs.items():
        ref = reference[limit_of.get(name, "both")]
        rows.append({"contender": name, "runs": values, "median": statistics.median(values), "min": min(values),
                     "max": max(values), "vs_disk": paired_median(values, ref)})
    print(f"every tensor read back equal: {verified}")
    print(f"\n{args.layers} x Linear({args.width}, {args.width}) fp32, {nbytes / 1e9:.2f} GB; {args.rounds} rounds; "
          "GB/s of tensor bytes; torch.load from a file evicted from the page cache"
          + ("" if fio else "; fio is not installed, so there is no disk reference"))
    print_table(["contender", "median GB/s", "min", "max", "vs its disk limit (paired)"],
                [(r["contender"], r["median"], r["min"], r["max"], r["vs_disk"]) for r in rows])
    return with_machine({"layers": args.layers, "width": args.width, "bytes": nbytes, "rounds": args.rounds,
                         "verified": verified, "rows": rows, "fio_sweep": fio_sweep}, machine)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="scratch directory on the disk under test")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    add_fio_arguments(p)
    p.add_argument("--json", help="write every run here")
    args = p.parse_args(argv)
    if min(args.layers, args.width, args.rounds) < 1:
        p.error(f"--layers, --width and --rounds must be >= 1, got {args.layers}, {args.width}, {args.rounds}")
    result = run(args)
    write_json(result, args.json)
    if not result["verified"]:
        print("ERROR: a tensor read back differs from the one saved", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
