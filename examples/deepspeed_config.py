"""Run the engine from a DeepSpeed JSON config (examples/ds_config.json).

    python examples/deepspeed_config.py

Prints the EngineConfig the DeepSpeed keys map to, then shows that a misspelled key, which
DeepSpeed would silently ignore, is an error naming it.
"""

import json
import os

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


if __name__ == "__main__":
    main()
