"""Run the engine from a DeepSpeed JSON config (examples/ds_config.json).

    python examples/deepspeed_config.py

Prints the EngineConfig the DeepSpeed keys map to, shows that a misspelled key, which DeepSpeed
would silently ignore, is an error naming it, then trains with DeepSpeed's loop as written, only
``deepspeed.initialize`` replaced by ``engine.initialize``.
"""

import json
import os

import torch
from torch.utils.data import TensorDataset

import engine
import tiered

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    path = os.path.join(HERE, "ds_config.json")
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
        model=net, model_parameters=net.parameters(), training_data=data, config=path, store="ds-run")
    for x, y in trainloader:
        loss = torch.nn.functional.mse_loss(model_engine(x), y)
        model_engine.backward(loss)
        model_engine.step()  # AdamW on the shards in the store, then the WarmupLR step
    print(f"\nDeepSpeed's loop: {model_engine.completed_steps} steps, last loss {loss.item():.4f}, "
          f"lr {model_engine.get_lr()[0]:.2e} ({type(lr_scheduler).__name__})")
    model_engine.close()


if __name__ == "__main__":
    main()
