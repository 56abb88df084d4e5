"""``tiered estimate``: how much device memory, host memory and disk a model needs under a config,
before anything is allocated (DeepSpeed's ``estimate_zero3_model_states_mem_needs_all_live``,
accelerate's ``estimate-memory``). The model is built on the meta device, so any size is instant."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from typing import Any, Optional, Sequence, TextIO

import torch
from torch import nn

from engine.cli.train import DEMO_SIZE_OPTIONS, add_demo_size_arguments, demo_config
from engine.config import EngineConfig
from tiered import StoreConfig
from tiered.util import nearest_existing_directory

MiB = 1024 * 1024
GiB = 1024 * MiB


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``tiered estimate``."""
    p = argparse.ArgumentParser(
        prog="tiered estimate",
        description="Bytes per tier (device, host, nvme) one rank needs to train or run a model with the engine, "
        "the host RSS bound, and whether the disk under --dir has room. Budgets default to StoreConfig's and "
        "EngineConfig's defaults.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--demo", action="store_true", help="the GPT of `tiered train --demo` (sizes below)")
    source.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json, or a directory holding "
                        "one (needs transformers; the model is built from it on the meta device)")
    add_demo_size_arguments(p)
    p.add_argument("--ds-config", metavar="PATH", help="take tiers and settings from a DeepSpeed JSON config "
                   "(EngineConfig.from_deepspeed), and the device and host budgets engine.initialize's own store "
                   "gives it unless the flags below set them")
    p.add_argument("--dir", default=".", help="where the swap files would go: its free space is checked "
                   "(default: the current directory)")
    p.add_argument("--host-mib", type=int, default=None, help="host memory budget (MiB; default 1024, or "
                   "--ds-config's)")
    p.add_argument("--device-mib", type=int, default=None, help="device memory budget (MiB; default 0, or "
                   "--ds-config's)")
    p.add_argument("--nvme-gib", type=float, default=None, help="nvme budget (GiB; default: the free disk space)")
    p.add_argument("--prefetch-mib", type=int, default=None, help="prefetch window (MiB; default 256)")
    p.add_argument("--param-tier", choices=("device", "host", "nvme"), default=None, help="where the parameters "
                   "rest between uses (default nvme, or --ds-config's)")
    p.add_argument("--grad-tier", choices=("host", "nvme"), default=None, help="where gradient shards wait for the "
                   "step (default host, or --ds-config's)")
    p.add_argument("--optimizer-tier", choices=("host", "nvme"), default=None, help="where master weights and "
                   "moments rest between steps (default nvme, or --ds-config's)")
    p.add_argument("--compress-optimizer", action="store_true", help="master weights and moments stored compressed")
    p.add_argument("--train-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="dtype parameters are trained in (default: the model's own)")
    p.add_argument("--world-size", type=int, default=1, help="ranks sharing the model (each holds 1/world)")
    p.add_argument("--device", default=None, help="compute device: with 'cpu' materialized parameters count in "
                   "host memory, with 'cuda' in GPU memory (default: cuda when available, else cpu)")
    p.add_argument("--inference", action="store_true", help="no optimizer: parameters only")
    p.add_argument("--measure-codec", action="store_true", help="also measure the codec on this machine's cores and "
                   "the disk under --dir (a few seconds, a 256 MiB scratch file) and say whether compress_optimizer "
                   "pays for this model")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON instead of a table")
    return p


def main(argv: Optional[Sequence[str]] = None, *, out: TextIO = sys.stdout) -> int:
    """Run ``tiered estimate``; return 0 when the model fits, 1 when it does not, 2 on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in (*DEMO_SIZE_OPTIONS, "world_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("host_mib", "device_mib", "prefetch_mib", "nvme_gib"):
        value = getattr(args, name)
        if value is not None and value < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    try:
        model = _model(args)
        config = _config(args)
    except (ValueError, OSError, ImportError) as exc:
        parser.error(str(exc))
    if args.ds_config is not None:
        config = _initialize_budgets(config, model, args)
    from engine.paging.memory_estimate import estimate_memory
    from tiered.util import format_bytes

    est = estimate_memory(model, config, world_size=args.world_size, training=not args.inference)
    disk = _disk_check(est.during_step.nvme, config.store, args.dir)
    fits = est.fits and disk.room
    verdict = None
    if args.measure_codec:
        from engine.cli.codec_verdict import measure_codec_verdict, moment_bytes

        try:
            verdict = measure_codec_verdict(args.dir, moment_bytes(model, args.world_size) if not args.inference
                                            else 0, config.store)
        except OSError as exc:
            print(f"tiered estimate: --measure-codec could not measure the disk under {args.dir}: {exc}",
                  file=sys.stderr)
            return 2
    if args.json:
        codec = None if verdict is None else {**dataclasses.asdict(verdict), "raw_seconds": verdict.raw_seconds,
                                              "compressed_seconds": verdict.compressed_seconds,
                                              "pays": verdict.pays}
        print(json.dumps({**dataclasses.asdict(est), "disk": dataclasses.asdict(disk), "fits": fits,
                          **({"codec": codec} if codec else {})}, indent=2), file=out)
    else:
        print(est.render(), file=out)
        print(f"disk under {disk.directory}: {format_bytes(disk.free)} free; the nvme tier needs about "
              f"{format_bytes(est.during_step.nvme)} during a step, plus up to {format_bytes(disk.growth_slack)} of "
              "swap-file growth" + ("" if disk.room else " -- NOT ENOUGH"), file=out)
        if verdict is not None:
            print(verdict.render(), file=out)
        print(f"fits: {'yes' if fits else 'no'}", file=out)
    return 0 if fits else 1


@dataclasses.dataclass(frozen=True)
class DiskCheck:
    """Free space under the swap-file directory against what the nvme tier needs."""

    directory: str
    free: int
    #: Swap files grow in ``swap_grow_bytes`` steps, so each may hold up to one step unused.
    growth_slack: int
    room: bool


def _disk_check(need: int, store: StoreConfig, directory: str) -> DiskCheck:
    existing = nearest_existing_directory(directory)
    free = shutil.disk_usage(existing).free
    files = store.swap_files_per_dir * len(store.nvme_paths or (store.path,))
    slack = files * store.swap_grow_bytes
    return DiskCheck(existing, free, slack, need + slack <= free)


def _model(args: argparse.Namespace) -> nn.Module:
    if args.demo:
        from engine.demo import GPT

        with torch.device("meta"):
            return GPT(demo_config(args))
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"--hf-config needs transformers (pip install transformers): {exc}") from exc
    path = args.hf_config
    if not os.path.exists(path):
        raise ValueError(f"--hf-config {path!r} does not exist")
    config = transformers.AutoConfig.from_pretrained(path)  # a directory or the json file itself
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM: its base model
            return transformers.AutoModel.from_config(config)


def _initialize_budgets(config: EngineConfig, model: nn.Module, args: argparse.Namespace) -> EngineConfig:
    """``config`` with the budgets engine.initialize's own store would give it, where no flag sets them."""
    from engine.integrations.deepspeed.store import deepspeed_budgets

    budgets = deepspeed_budgets(config, model, args.world_size, training=not args.inference)
    return config.replace(store=config.store.replace(
        device_bytes=budgets.device_bytes if args.device_mib is None else config.store.device_bytes,
        host_bytes=budgets.host_bytes if args.host_mib is None else config.store.host_bytes))


def _config(args: argparse.Namespace) -> EngineConfig:
    device = args.device if args.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"--device {device!r} is not a device: {exc}") from exc
    store_fields: dict[str, Any] = {"path": os.path.abspath(args.dir), "device_bytes": (args.device_mib or 0) * MiB}
    if args.host_mib is not None:
        store_fields["host_bytes"] = args.host_mib * MiB
    if args.nvme_gib is not None:
        store_fields["nvme_bytes"] = int(args.nvme_gib * GiB)
    store = StoreConfig(**store_fields)
    overrides: dict[str, Any] = {"compute_device": device}
    for name in ("param_tier", "grad_tier", "optimizer_tier", "train_dtype"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.prefetch_mib is not None:
        overrides["prefetch_bytes"] = args.prefetch_mib * MiB
    if args.compress_optimizer:
        overrides["compress_optimizer"] = True
    if args.ds_config is not None:
        return EngineConfig.from_deepspeed(args.ds_config, store=store, **overrides)
    return EngineConfig(store=store, **overrides)
