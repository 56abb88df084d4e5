"""LoRA fine-tune of a base model that need not fit in memory, with Hugging Face's Trainer.

    python examples/lora_finetune.py --dir /nvme/lora-run --steps 4 --out /nvme/lora-adapter

The base (here a small GPT-2 written by ``save_pretrained`` first, standing in for a pretrained
checkpoint) is built on the meta device; PEFT adds the LoRA adapters there too, and ``engine.wrap``
fills every tensor straight into the store, one at a time: the base's from its files, under the
names PEFT gives them, and the adapters as PEFT initializes them. ``EngineTrainer`` trains the
adapters (only they get fp32 master weights and Adam moments) and saves them as the Trainer does,
so ``PeftModel.from_pretrained`` over the plain base computes the fine-tuned model's loss.
"""

import argparse
import os
from typing import Optional

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import engine
import tiered
from engine.integrations.hf import EngineTrainer, lora_init, peft_base_weights

MiB = 1 << 20


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="lora-run", help="the store's directory and the Trainer's output")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default="lora-adapter", help="where the adapter goes (PEFT's save_pretrained layout)")
    args = p.parse_args(argv)

    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=128, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base_dir = os.path.join(args.dir, "base")
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(base_dir)   # stands in for a downloaded checkpoint

    with torch.device("meta"):                       # no tensor of the base is ever whole in memory
        model = get_peft_model(GPT2LMHeadModel(cfg), LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True))
    eng = engine.wrap(
        model,
        optimizer=engine.AdamW(lr=1e-3, weight_decay=0.0),
        config=engine.EngineConfig(
            store=tiered.StoreConfig(path=os.path.join(args.dir, "store"), host_bytes=64 * MiB),
            param_tier="nvme", optimizer_tier="nvme", prefetch_bytes=16 * MiB,
        ),
        state_dict=peft_base_weights(model, base_dir),  # the base's files under PEFT's names
        init_fn=lora_init(model),                       # lora_A random, lora_B zero: the model starts as its base
    )
    ids = torch.randint(0, cfg.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    try:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        print(f"training {trainable:,} of {total:,} parameters")
        trainer = EngineTrainer(eng, model=model, train_dataset=data, args=TrainingArguments(
            output_dir=os.path.join(args.dir, "trainer"), per_device_train_batch_size=4, max_steps=args.steps,
            learning_rate=1e-3, weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
            report_to=[], use_cpu=True, disable_tqdm=True))
        trainer.train()
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']}: loss {entry['loss']:.4f}")
        model.eval()
        with torch.no_grad():
            tuned_loss = model(input_ids=ids[:4], labels=ids[:4]).loss.item()
        trainer.save_model(args.out)                    # adapter_model.safetensors + adapter_config.json
    finally:
        eng.close()
    reloaded = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base_dir), args.out).eval()
    with torch.no_grad():
        reloaded_loss = reloaded(input_ids=ids[:4], labels=ids[:4]).loss.item()
    print(f"adapter saved to {args.out}; PeftModel.from_pretrained computes loss {reloaded_loss:.4f} "
          f"(engine: {tuned_loss:.4f})")


if __name__ == "__main__":
    main()
