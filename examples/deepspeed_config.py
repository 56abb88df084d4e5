"""Run the engine from a DeepSpeed JSON config (examples/ds_config.json).

    python examples/deepspeed_config.py          # again: resumes from the checkpoint it saved
    tiered launch --num_gpus 2 examples/deepspeed_config.py     # was: deepspeed --num_gpus 2 ...; two ranks

Prints the EngineConfig the DeepSpeed keys map to, shows that a misspelled key, which DeepSpeed
would silently ignore, is an error naming it, then trains with DeepSpeed's script as written
(``deepspeed.add_config_arguments``, its loop, ``load_checkpoint`` before it and
``save_checkpoint`` after), only ``deepspeed`` replaced by ``engine``. Under ``tiered launch`` (or
torchrun) the ranks join their process group in ``engine.initialize``, as in ``deepspeed.initialize``,
and resume the checkpoint whatever world size saved it.
"""

import argparse
import json
import os
from typing import Optional

import torch
from torch.utils.data import TensorDataset

import engine
import tiered

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: Optional[list[str]] = None) -> None:
    # was: deepspeed.add_config_arguments; adds --deepspeed and --deepspeed_config, which initialize reads
    parser = engine.add_config_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher (tiered launch, deepspeed)")
    parser.add_argument("--save_dir", default="ds-ckpt", help="where checkpoints go (and are resumed from)")
    args = parser.parse_args(argv)
    path = args.deepspeed_config = args.deepspeed_config or os.path.join(HERE, "ds_config.json")
    config = engine.EngineConfig.from_deepspeed(path, store=tiered.StoreConfig(path="ds-run"))
    print(config)

    with open(path) as f:
        ds = json.load(f)
    ds["zero_optimization"]["stage3_prefetch_bucket_sise"] = 1   # a typo DeepSpeed would ignore
    try:
        engine.EngineConfig.from_deepspeed(ds, store=tiered.StoreConfig(path="ds-run"))
    except ValueError as exc:
        print(f"\nrefused, as it should be:\n{exc}")

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    model_engine, optimizer, trainloader, lr_scheduler = engine.initialize(  # was: deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=data)  # store: ds-nvme/tiered
    _, client_sd = model_engine.load_checkpoint(args.save_dir)  # (None, None) and a warning on the first run
    epoch = client_sd["epoch"] + 1 if client_sd else 0
    for x, y in trainloader:
        x, y = x.to(model_engine.device), y.to(model_engine.device)
        loss = torch.nn.functional.mse_loss(model_engine(x), y)
        model_engine.backward(loss)
        model_engine.step()  # AdamW on the shards in the store, then the WarmupLR step
    model_engine.save_checkpoint(args.save_dir, client_state={"epoch": epoch})  # <save_dir>/global_step<N>
    print(f"\nDeepSpeed's loop, epoch {epoch}: {model_engine.global_steps} steps, last loss {loss.item():.4f}, "
          f"lr {model_engine.get_lr()[0]:.2e} ({type(lr_scheduler).__name__})")
    model_engine.close()


if __name__ == "__main__":
    main()
