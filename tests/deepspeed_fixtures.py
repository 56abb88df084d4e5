"""What DeepSpeed itself does, recorded for tests that run without it: ZeRO checkpoints it
wrote (the import tests) and the losses of a run it trained (the parity test).

The committed fixtures in ``tests/fixtures/deepspeed/`` were made by running this file with
DeepSpeed installed (``pip install deepspeed``; CPU is enough)::

    python tests/deepspeed_fixtures.py tests/fixtures/deepspeed [NAME ... | training]

Each fixture is a tiny model trained by ``deepspeed.initialize`` for ``STEPS_BEFORE`` steps and
saved with ``model_engine.save_checkpoint`` (ZeRO-3 at world size 1 or 2, ZeRO-1/2 at 2), plus
``expected.safetensors``: DeepSpeed's own view of that state at the save, per parameter
(``safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state``), and ``expected.json``: its
step counts and the losses (under fp16 also the loss scales and skipped steps) DeepSpeed went on
to in ``STEPS_AFTER`` more steps. ``training_losses.json`` holds every loss of a from-scratch run
of ``TRAINING_CONFIG``. DeepSpeed's runs are not bit-reproducible (rank files differ between
runs by the leftovers in their padding), so remake only the fixture you change. The tests need
neither DeepSpeed nor this file's ``main``; they import the model and the batches from here.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, TOKENS, BATCH = 37, 13, 6, 4
STEPS_BEFORE, STEPS_AFTER = 3, 3
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.1

#: name -> (world size, DeepSpeed config changes)
FIXTURES: dict[str, tuple[int, dict[str, Any]]] = {
    # sub_group_size 200: the optimizer's flat groups split into several sub-groups, as a large model's do
    "zero3_fp32_world2": (2, {"zero_optimization": {"stage": 3, "sub_group_size": 200}}),
    "zero3_bf16_world1": (1, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}),
    # ZeRO-Offload: DeepSpeed's own CPU Adam steps the optimizer state (its op builds on the CPU);
    # with an LR schedule, whose state the checkpoint keeps
    "zero3_offload_world2": (2, {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                                 "optimizer": {"type": "AdamW", "params": {
                                     "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}},
                                 "scheduler": {"type": "WarmupDecayLR", "params": {
                                     "warmup_num_steps": 2, "total_num_steps": 8, "warmup_max_lr": LR}}}),
    "zero3_fp16_world2": (2, {"zero_optimization": {"stage": 3},
                              "fp16": {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2,
                                       "hysteresis": 1}}),
}
#: Saved with ``save_checkpoint(exclude_frozen_parameters=True)``, as the Trainer saves a PEFT model:
#: the frozen ``gate`` is not in it. Otherwise as zero3_fp32_world2.
FROZEN_EXCLUDED = "zero3_fp32_frozen_excluded_world2"
#: ZeRO stages 1 and 2: rank 0 writes the whole model's states, each rank its optimizer partition.
ZERO12_FIXTURES: dict[str, tuple[int, dict[str, Any]]] = {
    "zero2_fp32_world2": (2, {"zero_optimization": {"stage": 2}}),
    "zero1_fp32_world2": (2, {"zero_optimization": {"stage": 1}}),
    "zero2_bf16_world2": (2, {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}),
    # bf16 at stage 1 is DeepSpeed's BF16_Optimizer: bf16_ optimizer files, partitioned as ZeRO-1
    "zero1_bf16_world2": (2, {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}),
    # ZeRO-Offload as DeepSpeed's tutorial has it: stage 2, DeepSpeed's CPU Adam
    "zero2_offload_world2": (2, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                 "optimizer": {"type": "AdamW", "params": {
                                     "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}}}),
}
FIXTURES_ALL: dict[str, tuple[int, dict[str, Any]]] = {
    **FIXTURES, FROZEN_EXCLUDED: (2, {"zero_optimization": {"stage": 3, "sub_group_size": 200}}), **ZERO12_FIXTURES,
}


#: A from-scratch run at world size 1 whose every loss the engine must reproduce bit for bit:
#: gradient accumulation, clipping, parameter groups and a scheduler, as DeepSpeed applies them.
TRAINING_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                              "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 8,
                                                      "warmup_max_lr": 0.01}},
    "zero_optimization": {"stage": 3}, "steps_per_print": 1000,
}
TRAINING_MICRO_BATCHES = 12
TRAINING_FILE = "training_losses.json"


class TinyLM(nn.Module):
    """Tied embedding and head, odd sizes (ZeRO-3 pads the last rank's shard), a frozen parameter and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH), requires_grad=False)
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, WIDTH))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.offset.type_as(h)  # under bf16/fp16 DeepSpeed leaves buffers as they are
        h = self.norm(torch.tanh(self.proj(h)) * self.gate)
        return F.cross_entropy(self.head(h).flatten(0, 1).float(), targets.flatten())


def make_model() -> TinyLM:
    """The fixtures' model, initialised as when they were made."""
    torch.manual_seed(0)
    return TinyLM()


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices only, as nanoGPT and the Trainer group them."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in trainable if p.dim() >= 2]},
            {"params": [p for n, p in trainable if p.dim() < 2], "weight_decay": 0.0}]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch (``BATCH`` sequences); rank r of w takes rows r::w."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def continue_run(forward: Any, eng: Any) -> list[float]:
    """The losses of the ``STEPS_AFTER`` steps after a fixture's save, in one process: each step's
    whole batch through ``forward`` (the model, or a DeepSpeed-style engine), ``eng.backward``
    and ``eng.step``."""
    losses = []
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        loss = forward(*batch(step))
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def ds_config(world: int, changes: dict[str, Any]) -> dict[str, Any]:
    """The whole DeepSpeed config of a fixture."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "steps_per_print": 1000,
    }
    config.update(changes)
    return config


def _join(rank: int, world: int, port: int) -> Any:
    """This process as rank ``rank`` of ``world`` in a gloo group DeepSpeed set up; the deepspeed module."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _run(rank: int, world: int, name: str, out: str, port: int) -> None:
    deepspeed = _join(rank, world, port)
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    model = make_model()
    config = ds_config(world, FIXTURES_ALL[name][1])
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else (
        torch.float16 if config.get("fp16", {}).get("enabled") else torch.float32)

    scales: list[float] = []  # fp16: the loss scale after each step of the continuation...
    skipped: list[bool] = []  # ...and whether the step overflowed (DeepSpeed skipped it)

    def train(step: int) -> float:
        ids, targets = batch(step)
        loss = eng(ids[rank::world], targets[rank::world])
        eng.backward(loss)
        eng.step()
        if dtype == torch.float16:
            scales.append(float(eng.optimizer.loss_scale))
            skipped.append(not eng.was_step_applied())
        value = loss.detach().float().clone()
        torch.distributed.all_reduce(value)
        return value.item() / world

    before = [train(s) for s in range(STEPS_BEFORE)]
    eng.save_checkpoint(os.path.join(out, name), exclude_frozen_parameters=name == FROZEN_EXCLUDED)
    if config["zero_optimization"]["stage"] < 3:
        # DeepSpeed 0.19's ZeRO-1/2 links each parameter to its optimizer state once, after the first
        # group's first step, when later groups have none yet, and never again: so its
        # safe_get_full_optimizer_state finds no moments for them. Linking again reads them as they are.
        eng.optimizer._hp_optimizer_states_linked = False
        eng.optimizer._lazy_init_hp_params_optimizer_state()
    expected: dict[str, torch.Tensor] = {}
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            continue
        expected[f"{pname}/master"] = safe_get_full_fp32_param(p).clone()
        for state in ("exp_avg", "exp_avg_sq"):
            expected[f"{pname}/{state}"] = safe_get_full_optimizer_state(p, state).clone()
    scale = float(eng.optimizer.loss_scale) if dtype == torch.float16 else None
    saved_steps, saved_skipped = eng.global_steps, eng.skipped_steps
    scales.clear()
    skipped.clear()
    after = [train(s) for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
    if rank == 0:
        folder = os.path.join(out, name)
        save_file({k: v.contiguous() for k, v in expected.items()}, os.path.join(folder, "expected.safetensors"))
        with open(os.path.join(folder, "expected.json"), "w", encoding="utf-8") as f:
            json.dump({"world_size": world, "dtype": str(dtype).removeprefix("torch."),
                       "global_steps": saved_steps, "skipped_steps": saved_skipped, "loss_scale": scale,
                       "loss_scales_after": scales, "skipped_after": skipped,
                       "losses_before": before, "losses_after": after,
                       "deepspeed": deepspeed.__version__}, f, indent=1)
        os.remove(os.path.join(folder, "zero_to_fp32.py"))  # DeepSpeed's script, copied into every checkpoint
        for extra in ("zero_to_torch.py",):
            if os.path.exists(os.path.join(folder, extra)):
                os.remove(os.path.join(folder, extra))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _train_from_scratch(rank: int, out: str, port: int) -> None:
    deepspeed = _join(rank, 1, port)
    model = make_model()
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=TRAINING_CONFIG)
    losses = []
    for micro in range(TRAINING_MICRO_BATCHES):
        ids, targets = batch(micro)
        loss = eng(ids[:2], targets[:2])
        eng.backward(loss)
        eng.step()  # steps the optimizer and the scheduler on every second micro-batch
        losses.append(loss.item())
    with open(os.path.join(out, TRAINING_FILE), "w", encoding="utf-8") as f:
        json.dump({"config": TRAINING_CONFIG, "losses": losses, "deepspeed": deepspeed.__version__}, f, indent=1)
    torch.distributed.destroy_process_group()


def main(out: str, names: list[str]) -> None:
    """Write the fixtures ``names`` (every one when empty) under ``out`` (DeepSpeed must be installed)."""
    import torch.multiprocessing as mp

    for index, (name, (world, _)) in enumerate(FIXTURES_ALL.items()):
        if name in names or not names:
            mp.start_processes(_run, args=(world, name, out, 29600 + index), nprocs=world, start_method="spawn")
    if "training" in names or not names:
        mp.start_processes(_train_from_scratch, args=(out, 29690), nprocs=1, start_method="spawn")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
