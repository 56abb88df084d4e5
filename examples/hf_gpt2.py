"""Fine-tune a Hugging Face GPT2LMHeadModel with its weights and AdamW states on NVMe.

    python examples/hf_gpt2.py --dir /nvme/hf-run --steps 5 --export /nvme/hf-gpt2-tuned

The model is built on the meta device and materialized module by module straight into the store
(its parameters never all sit in memory at once); a real fine-tune would pass the checkpoint's
``model.safetensors`` as ``state_dict=`` instead of initializing. At the end the tuned weights
are exported one tensor at a time in Hugging Face's layout, and ``from_pretrained`` loads them
into a plain model that computes the same loss.
"""

import argparse
from typing import Optional

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import engine
import tiered

MiB = 1 << 20


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="hf-gpt2-run")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--export", default="hf-gpt2-tuned", help="where the tuned model goes (save_pretrained layout)")
    args = p.parse_args(argv)

    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=128)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    eng = engine.wrap(
        model,
        optimizer=engine.AdamW(lr=1e-3, weight_decay=0.0),
        config=engine.EngineConfig(
            store=tiered.StoreConfig(path=args.dir, host_bytes=64 * MiB),
            param_tier="nvme", optimizer_tier="nvme", prefetch_bytes=16 * MiB, max_grad_norm=1.0,
        ),
    )  # no init_fn: each module is initialized as transformers initializes it, one at a time
    ids = torch.randint(0, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    try:
        for step in range(args.steps):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            eng.step()
            eng.zero_grad()
            print(f"step {step}: loss {loss.item():.4f}")
        s = eng.stats()
        print(f"stalled {s.stall_seconds:.2f} s; read {s.store.bytes_read / 1e6:.0f} MB, "
              f"wrote {s.store.bytes_written / 1e6:.0f} MB")
        model.eval()                                 # no dropout, as from_pretrained's model
        with torch.no_grad():
            tuned_loss = model(input_ids=ids, labels=ids).loss.item()
        eng.save_weights(args.export)                # model.safetensors, one tensor in memory at a time
        cfg.save_pretrained(args.export)             # config.json beside it
    finally:
        eng.close()
    plain = GPT2LMHeadModel.from_pretrained(args.export)
    with torch.no_grad():
        plain_loss = plain(input_ids=ids, labels=ids).loss.item()
    print(f"exported to {args.export}; from_pretrained computes loss {plain_loss:.4f} (engine: {tuned_loss:.4f})")


if __name__ == "__main__":
    main()
