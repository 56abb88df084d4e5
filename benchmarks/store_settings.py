"""Store I/O settings alternated on the same disk blocks, each against DeepSpeed's aio on those blocks.

    python benchmarks/store_settings.py --dir /nvme/scratch --rounds 7 --settings 16:32:crc,32:32:crc,16:32:nocrc

Every setting (``io_threads:queue_depth:crc|nocrc``) reopens one store directory, so each writes
into the same, already allocated extents: puts of ``--size`` bytes of page-aligned tensors (each
durable on return), then gets into page-aligned tensors with every get in flight, checked bit for
bit. DeepSpeed's aio handle on its page-locked tensors writes and reads the very ranges the store
holds the same tensors in (``TieredStore.nvme_layout``), every tensor then ``wait()``.
``--sequential`` makes it the bench's sequential rows instead: gets one after another, against
DeepSpeed one tensor at a time (each tensor's requests, ``wait()``, then the next; writes too).
Settings and DeepSpeed run in an order rotated round by round, and each setting's ratio to
DeepSpeed is paired within a round, so neither file placement nor the disk's drift favours one of
them. Without DeepSpeed the settings are compared with each other alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
from typing import Optional

from bench_output import add_alternation_arguments, paired_median, print_table, rotated, scratch_dir, write_json

import tiered
from tiered.bench.deepspeed_aio import DeepSpeedAio, load_aio
from tiered.bench.store import LargeTensors, StoreUnderTest
from tiered.bench.tensors import TensorFactory

MiB = 1024 * 1024
DEEPSPEED = "deepspeed, store's file"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One store configuration under test."""

    io_threads: int
    queue_depth: int
    checksum: bool

    @classmethod
    def parse(cls, text: str) -> "Setting":
        """``threads:depth:crc`` or ``threads:depth:nocrc``."""
        parts = text.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in ("crc", "nocrc"):
            raise argparse.ArgumentTypeError(f"a setting is threads:depth:crc|nocrc, got {text!r}")
        return cls(int(parts[0]), int(parts[1]), parts[2] == "crc")

    @property
    def name(self) -> str:
        return f"store, {self.io_threads} threads, depth {self.queue_depth}{'' if self.checksum else ', no crc'}"


def run(args: argparse.Namespace) -> dict:
    workdir = scratch_dir(args.dir, "tiered-settings-")
    factory = TensorFactory()
    tensors = [factory.make(args.tensor_size) for _ in range(max(1, args.size // args.tensor_size))]
    aligned, outs = [], []
    for t in tensors:
        a = tiered.empty_aligned(t.shape, t.dtype)
        a.copy_(t)
        aligned.append(a)
        outs.append(tiered.empty_aligned(t.shape, t.dtype))
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    module, status = load_aio()
    ds = None
    if module is not None:
        ds = DeepSpeedAio(module, os.path.join(workdir, "ds"), tensors, block_size=args.block_size,
                          queue_depth=32, threads=4, locked=True)
    else:
        print(f"deepspeed: {status.note}; comparing the settings with each other only", file=sys.stderr)
    # DeepSpeed's turn opens the store with the first setting: its puts place the tensors it then moves.
    setting_of = {s.name: s for s in args.settings} | ({DEEPSPEED: args.settings[0]} if ds is not None else {})
    names = list(setting_of)
    runs: dict[str, dict[str, list[float]]] = {op: {n: [] for n in names} for op in ("write", "read")}

    def one(name: str, setting: Setting) -> None:
        config = tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=0, device_bytes=0,
                                    block_size=args.block_size, io_threads=setting.io_threads,
                                    queue_depth=setting.queue_depth, checksum=setting.checksum)
        sut = StoreUnderTest(config, keep=True)  # closing keeps the files: the next setting reuses the extents
        try:
            store = LargeTensors(sut, aligned)
            write = store.write()
            if name == DEEPSPEED:
                assert ds is not None
                where = sut.placements(store.keys)
                write = ds.write(where, one_at_a_time=args.sequential)
                read = ds.read(where, one_at_a_time=args.sequential)
            else:
                for out in outs:
                    out.zero_()
                read = store.read(into=outs) if args.sequential else store.read_concurrently(outs)
            if not read.verified:
                raise RuntimeError(f"{name}: a read returned other bytes than were written")
            runs["write"][name].append(write.value)
            runs["read"][name].append(read.value)
        finally:
            sut.close()

    try:
        for r in range(args.rounds):
            for name in rotated(names, r):
                one(name, setting_of[name])
            print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        if ds is not None:
            ds.close()
        shutil.rmtree(workdir, ignore_errors=True)

    ref_name = DEEPSPEED if ds is not None else names[0]
    print(f"\n{nbytes / 2**30:.2f} GiB as {len(tensors)} x {args.tensor_size // MiB} MiB, "
          f"{args.block_size // MiB} MiB blocks, O_DIRECT, {args.rounds} rounds, "
          f"{'one tensor at a time' if args.sequential else 'gets (and DeepSpeed) in flight'}; "
          f"paired ratios to {ref_name}")
    rows = [{"op": op, "contender": name, "runs": values, "median": statistics.median(values), "min": min(values),
             "max": max(values), "paired_ratio": paired_median(values, group[ref_name])}
            for op, group in runs.items() for name, values in group.items()]
    print_table(["op", "contender", "median GB/s", "min", "max", f"paired / {ref_name}"],
                [[r["op"], r["contender"], r["median"], r["min"], r["max"], r["paired_ratio"]] for r in rows])
    return {"bytes": nbytes, "block_size": args.block_size, "rounds": args.rounds, "reference": ref_name,
            "sequential": args.sequential,
            "settings": [dataclasses.asdict(s) for s in args.settings], "loadavg": os.getloadavg(), "rows": rows}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_alternation_arguments(p, size_help="bytes per contender per round", rounds=7)
    p.add_argument("--settings", type=lambda s: [Setting.parse(x) for x in s.split(",")],
                   default=[Setting(16, 32, True), Setting(64, 64, True)],
                   help="io_threads:queue_depth:crc|nocrc, comma-separated "
                        "(default 16:32:crc,64:64:crc: the old and the current defaults)")
    p.add_argument("--sequential", action="store_true",
                   help="gets one after another, and DeepSpeed one tensor at a time (default: all in flight)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.tensor_size % 4096 or args.block_size % 4096:
        p.error(f"--tensor-size and --block-size must be multiples of 4096, got {args.tensor_size}, {args.block_size}")
    write_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
