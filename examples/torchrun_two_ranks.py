"""Train a GPT sharded over the ranks of a torchrun job (gloo on CPU, NCCL on GPU).

    torchrun --nproc_per_node 2 examples/torchrun_two_ranks.py --dir /nvme/run2

Each rank keeps 1/world of every parameter (and of its optimizer state) in its own store under
<dir>/rank<N>; fetches all-gather, gradients reduce-scatter. Each rank trains on its own half of
the batch, so the run equals one process on the whole batch.
"""

import argparse
import os

import torch
import torch.distributed as dist

import engine
import tiered
from engine.demo import GPT, BigramStream, GPTConfig

MiB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="torchrun-run")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    cfg = GPTConfig(vocab_size=512, seq_len=64, n_layer=2, n_embd=128, n_head=4)
    torch.manual_seed(0)                     # every rank must start from the same values
    model = GPT(cfg)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=3e-3, weight_decay=0.0), config=engine.EngineConfig(
        store=tiered.StoreConfig(path=os.path.abspath(args.dir), host_bytes=32 * MiB),
        param_tier="nvme", optimizer_tier="nvme"))
    data = BigramStream(cfg.vocab_size, cfg.seq_len, batch_size=8 * world)
    try:
        for step in range(args.steps):
            x, y = data.batch(step)
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            loss = model(x, y)
            loss.backward()
            eng.step()
            eng.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step}: loss {mean.item() / world:.4f}")
    finally:
        eng.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
