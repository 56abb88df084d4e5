"""``tiered import-deepspeed DS_CKPT OUT``: a DeepSpeed ZeRO checkpoint as an engine checkpoint,
which ``eng.load_checkpoint(OUT)`` resumes at any world size."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from engine.errors import CheckpointError
from engine.integrations.deepspeed.checkpoint_import import import_deepspeed_checkpoint
from engine.io.checkpoint_files import summarize
from tiered.util import CommandErrors


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``tiered import-deepspeed``."""
    p = argparse.ArgumentParser(
        prog="tiered import-deepspeed",
        description="Convert a checkpoint written by DeepSpeed's model_engine.save_checkpoint under ZeRO stage 1, "
        "2 or 3 (fp32 master weights, Adam moments, step counts, fp16 loss scale, buffers, client_state) into an "
        "engine checkpoint at OUT. Then eng.load_checkpoint(OUT) resumes training at any world size, tiered export OUT "
        "writes its weights, and engine.wrap(model, state_dict=OUT) reads them. DeepSpeed need not be installed.",
    )
    p.add_argument("checkpoint", help="DeepSpeed's checkpoint directory (with its 'latest' file), or one tag "
                   "directory of it (with *_mp_rank_00_*_states.pt)")
    p.add_argument("out", help="the engine checkpoint directory to create")
    p.add_argument("--tag", default=None, help="import CHECKPOINT/TAG instead of the one 'latest' names")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--trust-pickle", action="store_true",
                   help="read files that hold arbitrary Python objects (a client_state) with torch.load("
                   "weights_only=False); only for files you trust, since unpickling can run code")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``tiered import-deepspeed``; return the exit status."""
    args = build_parser().parse_args(argv)
    with CommandErrors("tiered import-deepspeed", {(CheckpointError, ValueError, OSError): 1}) as failed:
        out = import_deepspeed_checkpoint(args.checkpoint, args.out, tag=args.tag, overwrite=args.overwrite,
                                          trust_pickle=args.trust_pickle)
        summary = summarize(out)
    if failed.status is not None:
        return failed.status
    source = summary.imported_from
    assert source is not None
    skipped = f", {source['skipped_steps']} of them skipped (fp16 overflow)" if source["skipped_steps"] else ""
    stage = source["format"].removeprefix("deepspeed-")
    print(f"{out}: {summary.params} parameters ({summary.stepped} with optimizer state) from "
          f"{source['dp_world_size']} DeepSpeed rank(s) ({stage}) at step {source['global_steps']}{skipped}")
    if summary.frozen_excluded:
        print("  saved with exclude_frozen_parameters: no frozen parameter is in it; the load keeps the model's own "
              "values for them (load the base model's weights first)")
    print(f"  resume with eng.load_checkpoint({out!r}); export weights with: tiered export {out} OUT")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
