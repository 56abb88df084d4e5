"""``tiered export CKPT OUT``: a checkpoint's weights as Hugging Face safetensors files, without
the model's code or a process group (DeepSpeed's ``zero_to_fp32.py CKPT OUT``)."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

from engine.checkpoint.export import DEFAULT_MAX_SHARD_BYTES
from engine.checkpoint.offline_export import export_checkpoint
from engine.errors import CheckpointError
from engine.io.checkpoint_files import summarize
from engine.io.checkpoint_paths import resolve_checkpoint
from tiered.util import CommandErrors, parse_size

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``tiered export``."""
    p = argparse.ArgumentParser(
        prog="tiered export",
        description="Write the weights of a checkpoint saved by eng.save_checkpoint (any world size) to OUT in "
        "Hugging Face's layout: model.safetensors, or shards and model.safetensors.index.json. Parameters the "
        "optimizer stepped come out as their fp32 master weights. Add the model's config.json to OUT (or pass "
        "--hf-config) and from_pretrained(OUT) loads it.",
    )
    p.add_argument("checkpoint", help="the checkpoint directory (it holds metadata.json and rank*.safetensors), "
                   "or the directory of tagged checkpoints whose 'latest' file names the one to export")
    p.add_argument("--tag", default=None, help="export CHECKPOINT/TAG instead of the latest")
    p.add_argument("out", help="the directory to write (created if missing)")
    p.add_argument("--training-weights", action="store_true",
                   help="export the training-dtype parameters instead of the fp32 master weights")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="cast every floating tensor to this dtype (default: as described above)")
    p.add_argument("--hf-config", default=None, metavar="DIR",
                   help="the model's Hugging Face config (a directory with config.json): written to OUT as well, "
                   "and the weights transformers 5 fuses in memory (an MoE's experts) are written as its "
                   "save_pretrained writes them")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="largest file before the weights are split into shards, e.g. 2GiB (default: 5 GB, as "
                   "save_pretrained)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``tiered export``; return the exit status."""
    args = build_parser().parse_args(argv)
    with CommandErrors("tiered export", {(CheckpointError, ValueError, OSError): 1}) as failed:
        max_shard = DEFAULT_MAX_SHARD_BYTES if args.max_shard_size is None else parse_size(args.max_shard_size)
        source = resolve_checkpoint(args.checkpoint, args.tag)
        summary = summarize(source)
        written = export_checkpoint(source, args.out, master_weights=not args.training_weights,
                                    dtype=_DTYPES.get(args.dtype), max_shard_bytes=max_shard,
                                    hf_config=args.hf_config)
    if failed.status is not None:
        return failed.status
    weights = "training-dtype weights" if args.training_weights or not summary.stepped else (
        f"fp32 master weights of {summary.stepped} of {summary.params} parameters")
    print(f"{source} (saved by {summary.world_size} rank(s)): {summary.params} parameters, {weights}")
    if summary.frozen_excluded:
        print("  the checkpoint left out the frozen parameters (exclude_frozen_parameters): the export holds the "
              "trained ones only")
    for file in written:
        print(f"  wrote {file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
