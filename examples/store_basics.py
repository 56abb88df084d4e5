"""The store on its own: put tensors into tiers, prefetch, get, evict, reopen.

    python examples/store_basics.py /tmp/tiered-example
"""

import argparse
import asyncio

import torch

import tiered

MiB = 1 << 20


async def main(path: str) -> None:
    config = tiered.StoreConfig(path=path, host_bytes=64 * MiB)
    async with await tiered.TieredStore.open_async(config) as store:
        weight = torch.randn(1024, 1024)
        await store.put("layer0.weight", weight, tier="nvme")           # durable when it returns
        await store.put("adam.exp_avg", torch.zeros(1 << 20), tier="nvme", compress=True)
        await store.prefetch("layer0.weight", tier="host")              # a handle: await it, or not
        back = await store.get("layer0.weight")                         # a new tensor, bit-exact
        assert torch.equal(back, weight)
        await store.evict("layer0.weight", tier="nvme")                  # clean copy: dropped, no I/O
        info = store.info("adam.exp_avg")
        print(f"exp_avg: {info.nbytes} bytes stored as {info.stored_nbytes} ({info.codec})")

    # Everything committed survives the process: reopen and read it back (sync facade, no event loop).
    with tiered.TieredStore.open(config) as store:
        print("after reopen:", sorted(store.keys()), torch.equal(store.sync.get("layer0.weight"), weight))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default="tiered-example", help="the store's directory (default: "
                        "./tiered-example)")
    asyncio.run(main(parser.parse_args().path))
