"""Hugging Face's Trainer over a wrapped model (plain, and as EngineTrainer). The oracle is the same
Trainer over a plain copy with torch.optim.AdamW: the same losses and weights, bit for bit, with its
gradient accumulation, its LR schedule, clipping (the engine's) and bf16 autocast, the same logged
grad_norm, and a resume from a Trainer checkpoint; at two ranks, plain torch averaging the
gradients over the ranks in the engine's order, bit for bit (the Trainer's DistributedDataParallel
sums them in another order)."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import Dataset
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, get_scheduler

import engine
from engine.io.checkpoint_files import CheckpointFiles
from engine.integrations.hf.trainer import EngineCheckpointCallback, EngineTrainer, engine_checkpoint
from engine.integrations.hf.trainer_deepspeed import filled_config
from engine_models import store_config

CONFIG = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
#: Dropout off, for loops whose random masks would differ from their oracle's.
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LR, CLIP = 1e-3, 0.5


class Tokens(Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(out, **kw) -> TrainingArguments:
    settings = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                    learning_rate=LR, weight_decay=0.0, logging_steps=1, save_strategy="no", report_to=[],
                    use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    return TrainingArguments(**{**settings, **kw})


def losses_of(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def wrapped(model: GPT2LMHeadModel, path, max_grad_norm: float | None = CLIP) -> engine.Engine:
    config = engine.EngineConfig(host_budget="host_tier", store=store_config(path), param_tier="nvme",
                                 optimizer_tier="nvme",
                                 max_grad_norm=max_grad_norm)
    return engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.0), config=config)


def model_and_plain_run(out, **args) -> tuple[GPT2LMHeadModel, GPT2LMHeadModel, Trainer]:
    """A new model (seed 0), and the Trainer trained over a copy of it with torch.optim.AdamW (the
    oracle), clipping at CLIP; ``args`` change the TrainingArguments."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    ref = copy.deepcopy(model)
    plain = Trainer(model=ref, args=arguments(out, max_grad_norm=CLIP, **args), train_dataset=Tokens(),
                    optimizers=(torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0), None))
    plain.train()
    return model, ref, plain


def grad_norms_of(trainer: Trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


@pytest.mark.parametrize("bf16", [False, True])  # bf16=True: the Trainer's autocast mixed precision
def test_trainer_trains_a_wrapped_model_as_the_plain_one(tmp_path, bf16):
    model, ref, plain = model_and_plain_run(tmp_path / "ref", bf16=bf16)

    eng = wrapped(model, tmp_path / "store")
    try:
        # max_grad_norm=0.0: the Trainer's own clip_grad_norm_ would see no gradients; the engine clips.
        trainer = Trainer(model=model, args=arguments(tmp_path / "eng", max_grad_norm=0.0, bf16=bf16),
                          train_dataset=Tokens(), optimizers=(eng.optimizer, None))
        trainer.train()
        assert losses_of(trainer) == losses_of(plain) and len(losses_of(trainer)) == 4
        assert eng.get_global_grad_norm() > CLIP  # the clip was active
        got, want = eng.state_dict(), ref.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        eng.close()


@pytest.mark.parametrize("engine_clip", [CLIP, None])
def test_engine_trainer_clips_and_logs_the_gradient_norm_as_the_trainer_does(tmp_path, engine_clip):
    """EngineTrainer clipping at TrainingArguments.max_grad_norm, the engine's config at the same
    norm or without one: the same losses, weights and logged grad_norm as the Trainer over a plain
    copy, bit for bit. Two different norms in the arguments and the config are refused."""
    model, ref, plain = model_and_plain_run(tmp_path / "ref")
    eng = wrapped(model, tmp_path / "store", max_grad_norm=engine_clip)
    try:
        if engine_clip is not None:
            with pytest.raises(ValueError, match=r"max_grad_norm=1.0\).*max_grad_norm=0.5\) ask for two different"):
                EngineTrainer(eng, model=model, args=arguments(tmp_path / "eng", max_grad_norm=1.0))
        trainer = EngineTrainer(eng, model=model, args=arguments(tmp_path / "eng", max_grad_norm=CLIP),
                                train_dataset=Tokens())
        trainer.train()
        assert losses_of(trainer) == losses_of(plain) and len(losses_of(trainer)) == 4
        assert grad_norms_of(trainer) == grad_norms_of(plain) and min(grad_norms_of(plain)) > CLIP
        assert trainer.evaluate(Tokens())["eval_loss"] == plain.evaluate(Tokens())["eval_loss"]  # the eval loop
        got, want = eng.state_dict(), ref.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        eng.close()


@pytest.mark.parametrize("reentrant", [True, False])
def test_engine_trainer_with_activation_checkpointing(tmp_path, reentrant):
    """TrainingArguments(activation_checkpointing=True), the model's own activation checkpointing
    (torch.utils.checkpoint, re-running each block's forward in backward, where the engine fetches
    its parameters again): the same losses and weights as the plain Trainer's, bit for bit."""
    name = "activation_checkpointing"  # transformers 5's name; gradient_checkpointing before
    if name not in TrainingArguments.__dataclass_fields__:
        name = "gradient_checkpointing"
    kw = {name: True, f"{name}_kwargs": {"use_reentrant": reentrant}}
    model, ref, plain = model_and_plain_run(tmp_path / "ref", **kw)
    eng = wrapped(model, tmp_path / "store")
    try:
        trainer = EngineTrainer(eng, model=model, args=arguments(tmp_path / "eng", max_grad_norm=CLIP, **kw),
                                train_dataset=Tokens())
        trainer.train()
        assert getattr(model, f"is_{name}")  # is_activation_checkpointing, or the older name
        assert losses_of(trainer) == losses_of(plain) and len(losses_of(trainer)) == 4
        got, want = eng.state_dict(), ref.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        eng.close()


def test_trainer_checkpoints_resume_with_the_engine_checkpoint(tmp_path):
    out = tmp_path / "run"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    eng = wrapped(model, tmp_path / "a")
    try:
        # EngineTrainer: the Trainer with eng.optimizer and EngineCheckpointCallback(eng) added
        trainer = EngineTrainer(eng, model=model, train_dataset=Tokens(),
                                args=arguments(out, save_strategy="steps", save_steps=2, max_grad_norm=CLIP))
        assert trainer.optimizer is eng.optimizer
        trainer.train()
        whole = losses_of(trainer)
        with pytest.raises(ValueError, match=r"model must be the model eng wraps"):
            EngineTrainer(eng, model=GPT2LMHeadModel(CONFIG), args=arguments(out))
    finally:
        eng.close()
    ckpt = out / "checkpoint-2"
    assert os.path.isfile(os.path.join(engine_checkpoint(ckpt), "metadata.json"))

    for load_engine in (False, True, "EngineTrainer"):
        torch.manual_seed(1)  # other initial values: everything must come from the checkpoints
        model = GPT2LMHeadModel(CONFIG)
        eng = wrapped(model, tmp_path / f"b{load_engine}")
        try:
            if load_engine == "EngineTrainer":  # its train() loads the engine checkpoint itself
                resumed = EngineTrainer(eng, model=model, args=arguments(out, save_strategy="no", max_grad_norm=CLIP),
                                        train_dataset=Tokens())
                resumed.train(resume_from_checkpoint=str(ckpt))
                assert losses_of(resumed) == whole
                continue
            # a plain Trainer: max_grad_norm=0.0, its own clipping would find no gradients (refused); the engine clips
            trainer = Trainer(model=model, args=arguments(out, save_strategy="no", max_grad_norm=0.0),
                              train_dataset=Tokens(), optimizers=(eng.optimizer, None))
            if not load_engine:  # the moments are not in the Trainer's checkpoint: refused, not trained wrong
                with pytest.raises(ValueError, match=r"eng\.load_checkpoint"):
                    trainer.train(resume_from_checkpoint=str(ckpt))
                continue
            eng.load_checkpoint(engine_checkpoint(ckpt))
            trainer.train(resume_from_checkpoint=str(ckpt))
            assert losses_of(trainer) == whole  # steps 1-2 from the checkpoint's log, 3-4 trained again
        finally:
            eng.close()


def test_an_engine_computing_elsewhere_than_the_trainer_is_refused():
    """On a GPU the Trainer moves the model to args.device, which released parameters cannot follow,
    and sends the batches there: an engine computing elsewhere is refused before that, saying how."""
    from engine.integrations.hf.trainer import _check_device

    _check_device(torch.device("cpu"), torch.device("cpu"))
    _check_device(torch.device("cuda", 1), torch.device("cuda"))  # "cuda": the current one, whichever it is
    with pytest.raises(ValueError, match=r"computes on cpu but the Trainer runs on cuda:1.*compute_device='cuda:1'"):
        _check_device(torch.device("cpu"), torch.device("cuda", 1))


def test_the_callback_can_leave_frozen_parameters_out(tmp_path):
    """For a PEFT model, as the Trainer has DeepSpeed save one: the frozen weights stay out."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    model.transformer.wpe.weight.requires_grad_(False)
    eng = wrapped(model, tmp_path / "store")
    try:
        (tmp_path / "checkpoint-3").mkdir()  # the Trainer's own checkpoint, written before on_save
        callback = EngineCheckpointCallback(eng, exclude_frozen_parameters=True)
        callback.on_save(SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=3), None)
    finally:
        eng.close()
    with CheckpointFiles(engine_checkpoint(tmp_path / "checkpoint-3")) as files:
        assert files.frozen_excluded
        assert "transformer.wpe.weight" not in files.params and "transformer.wte.weight" in files.params


def lora_model(seed: int = 0):
    """A PEFT LoRA model over a GPT-2 base made with ``seed`` (the "pretrained" base)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(GPT2LMHeadModel(CONFIG), LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True))


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's own call
def test_engine_trainer_saves_a_peft_model_as_the_trainer_does(tmp_path):
    """A LoRA fine-tune: the same losses and weights as the plain Trainer's, bit for bit; each
    checkpoint holds the adapter (not the whole model), equal to the plain Trainer's, and an engine
    checkpoint without the frozen base; a resume from it trains the last steps again bit for bit."""
    from peft import PeftModel
    from peft.utils import SAFETENSORS_WEIGHTS_NAME

    model = lora_model()
    ref = copy.deepcopy(model)
    saving = dict(max_grad_norm=CLIP, save_strategy="steps", save_steps=2)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    plain = Trainer(model=ref, args=arguments(tmp_path / "ref", **saving), train_dataset=Tokens(),
                    optimizers=(torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0), None))
    plain.train()
    eng = wrapped(model, tmp_path / "a")
    try:
        trainer = EngineTrainer(eng, model=model, args=arguments(tmp_path / "eng", **saving), train_dataset=Tokens())
        trainer.train()
        assert losses_of(trainer) == losses_of(plain) and len(losses_of(trainer)) == 4
        got, want = eng.state_dict(), ref.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        eng.close()
    for step in (2, 4):
        ckpt, ref_ckpt = tmp_path / "eng" / f"checkpoint-{step}", tmp_path / "ref" / f"checkpoint-{step}"
        assert sorted(os.listdir(ckpt)) == sorted(os.listdir(ref_ckpt) + ["engine"])  # no model.safetensors
        adapter, ref_adapter = (load_file(str(c / SAFETENSORS_WEIGHTS_NAME)) for c in (ckpt, ref_ckpt))
        assert adapter.keys() == ref_adapter.keys() and len(adapter) == 4  # lora_A and lora_B of 2 blocks
        assert all(torch.equal(adapter[k], v) for k, v in ref_adapter.items())
        with CheckpointFiles(engine_checkpoint(ckpt)) as files:
            assert files.frozen_excluded and all("lora_" in name for name in files.params)
    loaded = PeftModel.from_pretrained(GPT2LMHeadModel(CONFIG), str(tmp_path / "eng" / "checkpoint-4"))
    assert all(torch.equal(p, want[k]) for k, p in loaded.state_dict().items() if "lora_" in k)

    model = lora_model()  # the same base, as a resumed fine-tune loads it; the adapter comes from the checkpoint
    ckpt = str(tmp_path / "eng" / "checkpoint-2")
    eng = wrapped(model, tmp_path / "b")
    try:
        trainer = EngineTrainer(eng, model=model, args=arguments(tmp_path / "eng", max_grad_norm=CLIP),
                                train_dataset=Tokens())
        eng.load_checkpoint(engine_checkpoint(ckpt))
        trainer.train(resume_from_checkpoint=ckpt)
        assert losses_of(trainer) == losses_of(plain)
    finally:
        eng.close()


class RecordingTrainer(EngineTrainer):
    """EngineTrainer that records what each training forward saw (the micro-batch and the
    ``num_items_in_batch`` the Trainer passed, and the random state its dropout drew from), the loss it
    returned, and the LR after each step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[dict[str, torch.Tensor], object]] = []
        self.losses: list[float] = []
        #: The CPU generator's state before each training forward (its dropout masks).
        self.rng_states: list[torch.Tensor] = []
        self.lrs: list[float] = []
        self.add_callback(LearningRates(self.lrs))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rng = torch.get_rng_state()
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            self.seen.append(({k: v.clone() for k, v in inputs.items()}, num_items_in_batch))
            self.losses.append(loss.item())
            self.rng_states.append(rng)
        return loss


class LearningRates(TrainerCallback):
    def __init__(self, lrs: list[float]) -> None:
        self.lrs = lrs

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs) -> None:
        self.lrs.append(lr_scheduler.get_last_lr()[0])


def fp16_wrapped(model: GPT2LMHeadModel, path) -> engine.Engine:
    """fp16 parameters, fp32 masters and a dynamic loss scale that overflows the first steps
    (DeepSpeed's fp16 section with initial_scale_power 18, hysteresis 1)."""
    config = engine.EngineConfig(host_budget="host_tier", store=store_config(path), param_tier="nvme",
                                 optimizer_tier="nvme",
                                 train_dtype="float16", max_grad_norm=CLIP,
                                 loss_scaling=engine.LossScaling(2.0**18, hysteresis=1, growth_interval=2))
    return engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=0.0), config=config)


def test_engine_trainer_trains_fp16_with_the_engines_loss_scaling(tmp_path):
    """fp16 as DeepSpeed trains it under the Trainer: the oracle is the engine's own loop
    (eng.backward scaling the loss, an LR schedule stepped when eng.step() applied the step) over
    the micro-batches the Trainer trained on: the same losses, learning rates, skipped steps and
    weights, bit for bit. A plain Trainer would refuse the unscaled backward, and step its LR
    schedule on skipped steps."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**{**CONFIG.to_dict(), **NO_DROPOUT}))
    ref_model = copy.deepcopy(model)
    steps = 6
    eng = fp16_wrapped(model, tmp_path / "a")
    try:
        with pytest.raises(ValueError, match=r"fp16=True.*engine's loss scaling"):
            EngineTrainer(eng, model=model, args=arguments(tmp_path / "out", max_grad_norm=CLIP, fp16=True))
        # The Trainer's own sharding would take the model from the engine (a namespace stands in for
        # arguments naming a DeepSpeed config, which need deepspeed installed to be made).
        with pytest.raises(ValueError, match=r"deepspeed='ds.json'.*args=args, deepspeed_config=\.\.\.\) builds it"):
            EngineTrainer(eng, model=model, args=SimpleNamespace(deepspeed="ds.json", fsdp=None))
        with pytest.raises(ValueError, match=r"fsdp=True.*leave fsdp unset"):
            EngineTrainer(eng, model=model, args=arguments(tmp_path / "out", max_grad_norm=CLIP, fsdp="full_shard"))
        trainer = RecordingTrainer(eng, model=model, train_dataset=Tokens(),
                                   args=arguments(tmp_path / "out", max_grad_norm=CLIP, max_steps=steps))
        trainer.train()
        assert isinstance(trainer.lr_scheduler, engine.OverflowAwareScheduler)
        assert 0 < eng.skipped_steps < steps and len(trainer.lrs) == steps
        got, got_masters = eng.state_dict(), load_file(eng.save_weights(tmp_path / "a-masters", master_weights=True)[0])
    finally:
        eng.close()

    ref = fp16_wrapped(ref_model, tmp_path / "b")
    try:
        schedule = get_scheduler("linear", ref.optimizer, num_warmup_steps=0, num_training_steps=steps)
        losses, lrs, applied = [], [], []
        for i, (batch, num_items) in enumerate(trainer.seen):  # two micro-batches a step
            loss = ref_model(**batch, num_items_in_batch=num_items).loss
            ref.backward(loss)
            losses.append(loss.item())
            if i % 2 == 1:
                applied.append(ref.step())
                if applied[-1]:
                    schedule.step()
                ref.zero_grad()
                lrs.append(schedule.get_last_lr()[0])
        assert losses == trainer.losses and len(losses) == 2 * steps
        assert lrs == trainer.lrs and ref.skipped_steps == eng.skipped_steps == applied.count(False)
        held = [i for i, a in enumerate(applied) if not a]  # skipped steps: the LR stays where it was
        assert held and all(lrs[i] == ([LR] + lrs)[i] for i in held), (applied, lrs)
        want = ref.state_dict()
        want_masters = load_file(ref.save_weights(tmp_path / "b-masters", master_weights=True)[0])
        assert all(torch.equal(got[k], v) and v.dtype == torch.float16 for k, v in want.items())
        assert all(torch.equal(got_masters[k], v) for k, v in want_masters.items())
    finally:
        ref.close()


def _fp16_two_ranks(rank: int, root: str) -> None:
    """EngineTrainer over an fp16 engine at two ranks, then the engine's own loop over the
    micro-batches this rank trained on (the Trainer scales each rank's loss by the world size, as
    its loss is normalized by the tokens of every rank); what each saw, to the parent."""
    import json

    os.environ["LOCAL_RANK"] = str(rank)
    root_path = Path(root)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**{**CONFIG.to_dict(), **NO_DROPOUT}))
    ref_model = copy.deepcopy(model)
    steps = 4
    with fp16_wrapped(model, root_path / f"a{rank}") as eng:
        trainer = RecordingTrainer(eng, model=model, train_dataset=Tokens(),
                                   args=arguments(root_path / "out", max_grad_norm=CLIP, max_steps=steps))
        trainer.train()
        result = {"losses": trainer.losses, "lrs": trainer.lrs, "skipped": eng.skipped_steps,
                  "world": eng.world_size}
    with fp16_wrapped(ref_model, root_path / f"b{rank}") as ref:
        schedule = get_scheduler("linear", ref.optimizer, num_warmup_steps=0, num_training_steps=steps)
        losses, lrs = [], []
        for i, (batch, num_items) in enumerate(trainer.seen):
            loss = ref_model(**batch, num_items_in_batch=num_items).loss * ref.world_size
            ref.backward(loss)
            losses.append(loss.item())
            if i % 2 == 1:
                if ref.step():
                    schedule.step()
                ref.zero_grad()
                lrs.append(schedule.get_last_lr()[0])
        result |= {"ref_losses": losses, "ref_lrs": lrs, "ref_skipped": ref.skipped_steps}
    (root_path / f"rank{rank}.json").write_text(json.dumps(result))


def test_engine_trainer_trains_fp16_at_two_ranks(tmp_path):
    """The fp16 Trainer run at two ranks: every rank skips the same steps (the overflow test is
    on the all-reduced norm) and holds its LR schedule on them, matching the engine's own loop
    over the same micro-batches bit for bit."""
    import json

    from test_engine_distributed import run_ranks

    run_ranks(_fp16_two_ranks, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["world"] == 2 and len(res["losses"]) == 8 and len(res["lrs"]) == 4
        assert res["losses"] == res["ref_losses"] and res["lrs"] == res["ref_lrs"]
        assert res["skipped"] == res["ref_skipped"] > 0
    assert results[0]["lrs"] == results[1]["lrs"] and results[0]["losses"] != results[1]["losses"]


def trained_in_the_engines_order(model: GPT2LMHeadModel, trainer: RecordingTrainer, *, bf16: bool,
                                 accumulation: int = 2) -> tuple[list[float], list[float]]:
    """The oracle of the two-rank runs: plain torch over the micro-batches this rank's Trainer fed
    the engine (with the same dropout masks), averaging gradients over the ranks in the engine's
    order (each micro-batch's gradient summed over ranks and divided by the world size, then summed
    over the window, where DistributedDataParallel sums the window first), clipping at the global
    norm the engine computes (each rank's shards' norms, their sum of squares summed over ranks),
    then torch.optim.AdamW on the Trainer's linear schedule.
    Trains ``model`` in place; returns the losses of the micro-batches and the global gradient norms."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    params = list(model.parameters())  # tied weights once, in the order the engine keeps its shards
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    schedule = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=len(trainer.seen) // accumulation)
    losses, norms = [], []
    micro_batches = [(batch, num_items, rng) for (batch, num_items), rng in zip(trainer.seen, trainer.rng_states)]
    for start in range(0, len(micro_batches), accumulation):
        window: dict[int, torch.Tensor] = {}
        for batch, num_items, rng in micro_batches[start : start + accumulation]:
            torch.set_rng_state(rng)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # accelerate's autocast
                loss = model(**batch, num_items_in_batch=num_items).loss * world  # as the Trainer scales it
            losses.append(loss.item())
            loss.backward()  # the loss is normalized by the window's tokens (num_items_in_batch) already
            for i, p in enumerate(params):
                grad = p.grad.float()
                dist.all_reduce(grad)
                grad.div_(world)
                window[i] = grad if i not in window else window[i] + grad
                p.grad = None
        local = []
        for i, p in enumerate(params):
            shard = -(-p.numel() // world)
            padded = torch.zeros(shard * world)
            padded[: p.numel()] = window[i].flatten()
            local.append(padded[rank * shard : (rank + 1) * shard])
        mine = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local, 2.0)), 2.0)
        summed = mine * mine
        dist.all_reduce(summed)
        norms.append(summed.sqrt().item())
        coef = torch.clamp(CLIP / (summed.sqrt() + 1e-6), max=1.0)
        for i, p in enumerate(params):
            p.grad = window[i].mul_(coef)
        opt.step()
        schedule.step()
        opt.zero_grad()
    return losses, norms


def _two_ranks(rank: int, root: str, bf16: bool) -> None:
    """The Trainer over a plain copy (in DistributedDataParallel, as the Trainer puts it),
    EngineTrainer over the wrapped model, clipping, and the oracle over another copy; losses, norms
    and weights to the parent."""
    import json

    from safetensors.torch import load_file

    os.environ["LOCAL_RANK"] = str(rank)
    root_path = Path(root)
    model, ref, plain = model_and_plain_run(root_path / "ref", bf16=bf16)
    oracle = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with wrapped(model, root_path / f"store{rank}") as eng:
        try:  # accelerate would compile a wrapper and put the model itself in DDP
            EngineTrainer(eng, model=model, args=arguments(root_path / "eng", max_grad_norm=CLIP, torch_compile=True))
            result = {"compile_refused": ""}
        except ValueError as exc:
            result = {"compile_refused": str(exc)}
        trainer = RecordingTrainer(eng, model=model, train_dataset=Tokens(),
                                   args=arguments(root_path / "eng", max_grad_norm=CLIP, save_strategy="steps",
                                                  save_steps=2, bf16=bf16))
        trainer.train()
        trainer.save_model(str(root_path / "final"))  # every rank, as the Trainer calls it
        result |= {"plain": losses_of(plain), "engine": losses_of(trainer), "world": eng.world_size,
                   "micro_losses": trainer.losses, "engine_norms": grad_norms_of(trainer),
                   "plain_wrapped": type(plain.model_wrapped).__name__,
                   "engine_wrapped": type(trainer.model_wrapped).__name__,
                   "engine_eval": trainer.evaluate(Tokens())["eval_loss"]}  # each rank its share of the batches
        trained = eng.state_dict()
    result["oracle_losses"], result["oracle_norms"] = trained_in_the_engines_order(oracle, trainer, bf16=bf16)
    result["oracle_equal"] = [k for k, v in oracle.state_dict().items() if not torch.equal(v, trained[k])]
    evaluator = Trainer(model=oracle, args=arguments(root_path / "oracle", bf16=bf16))
    result["oracle_eval"] = evaluator.evaluate(Tokens())["eval_loss"]
    result["untrained"] = [n for n, p in ref.named_parameters() if torch.equal(trained[n], initial[n])]
    torch.manual_seed(1)  # other initial values: a resume takes everything from checkpoint-2
    model = GPT2LMHeadModel(CONFIG)
    ckpt = str(root_path / "eng" / "checkpoint-2")
    with wrapped(model, root_path / f"resumed{rank}") as eng:
        trainer = EngineTrainer(eng, model=model, train_dataset=Tokens(),
                                args=arguments(root_path / "eng", max_grad_norm=CLIP, save_strategy="no", bf16=bf16))
        eng.load_checkpoint(engine_checkpoint(ckpt))
        trainer.train(resume_from_checkpoint=ckpt)
        result["resumed"] = losses_of(trainer)
    if rank == 0:
        saved = load_file(str(root_path / "final" / "model.safetensors"))
        result["saved"] = sorted(saved)
        result["saved_as_trained"] = all(torch.equal(v, trained[k]) for k, v in saved.items())
        loaded = GPT2LMHeadModel.from_pretrained(str(root_path / "final")).state_dict()  # config.json and weights
        result["loads_as_trained"] = all(torch.equal(loaded[k], v) for k, v in trained.items())
    (root_path / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize("bf16", [False, True])  # bf16=True: accelerate's autocast, as the Trainer prepares it
def test_engine_trainer_at_two_ranks_trains_as_distributed_data_parallel(tmp_path, bf16):
    """torchrun with the Trainer: the plain Trainer puts a model in DistributedDataParallel, which
    cannot read the engine's released parameters; EngineTrainer keeps it out (the engine averages
    the gradients itself), saves its checkpoints from every rank (the weights are gathered), and
    trains to the losses and weights of plain torch summing the gradients in the engine's order,
    bit for bit (DDP sums them in another order: the same to rounding, and the first loss, before
    any step, bit for bit); a resume from one of its checkpoints trains the same last steps again,
    bit for bit."""
    import json

    from test_engine_distributed import run_ranks

    run_ranks(_two_ranks, str(tmp_path), bf16)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["world"] == 2 and res["plain_wrapped"] == "DistributedDataParallel"
        assert res["engine_wrapped"] == "GPT2LMHeadModel"
        assert "torch_compile=True) is not supported" in res["compile_refused"], res["compile_refused"]
        assert res["engine"][0] == res["plain"][0] and len(res["engine"]) == 4  # before the first step
        assert res["micro_losses"] == res["oracle_losses"] and len(res["micro_losses"]) == 8
        assert res["oracle_equal"] == [] and res["untrained"] == []  # every weight trained, as the oracle's
        assert res["engine_norms"] == res["oracle_norms"] and min(res["engine_norms"]) > CLIP  # the clip acts
        assert res["engine_eval"] == res["oracle_eval"]
        assert res["resumed"] == res["engine"]  # steps 1-2 from checkpoint-2's log, 3-4 trained again
    assert results[0]["saved_as_trained"] and "transformer.wte.weight" in results[0]["saved"]
    assert results[0]["loads_as_trained"]
    for step in (2, 4):
        ckpt = tmp_path / "eng" / f"checkpoint-{step}"
        for name in ("model.safetensors", "config.json", "training_args.bin", "optimizer.pt"):
            assert (ckpt / name).is_file(), name
        with CheckpointFiles(engine_checkpoint(ckpt)) as files:
            assert files.world_size == 2


def _one_launched_process(rank: int, root: str) -> None:
    """One process as torchrun or `tiered launch --num_gpus 1` starts it (LOCAL_RANK set, a gloo
    group of one): the plain Trainer, whose accelerate puts the model in DDP even then, and
    EngineTrainer over a wrapped copy; what each did, to the parent."""
    import json

    root_path = Path(root)
    model, ref, plain = model_and_plain_run(root_path / "ref")
    with wrapped(model, root_path / "store") as eng:
        try:
            EngineTrainer(eng, model=model, args=arguments(root_path / "eng", max_grad_norm=CLIP, torch_compile=True))
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        trainer = EngineTrainer(eng, model=model, args=arguments(root_path / "eng", max_grad_norm=CLIP),
                                train_dataset=Tokens())
        trainer.train()
        trained = eng.state_dict()
        result = {"world": eng.world_size, "plain": losses_of(plain), "engine": losses_of(trainer),
                  "plain_norms": grad_norms_of(plain), "engine_norms": grad_norms_of(trainer),
                  "plain_wrapped": type(plain.model_wrapped).__name__,
                  "engine_wrapped": type(trainer.model_wrapped).__name__, "compile_refused": refused,
                  "weights_equal": all(torch.equal(trained[k], v) for k, v in ref.state_dict().items())}
    (root_path / "rank0.json").write_text(json.dumps(result))


def test_engine_trainer_under_a_launcher_with_one_process(tmp_path):
    """torchrun (or `tiered launch --num_gpus 1`) with one CPU process: accelerate's multi-CPU state
    puts even one process's model in DistributedDataParallel, which cannot read released parameters;
    EngineTrainer keeps it out and trains to the losses, gradient norms and weights of the plain
    Trainer in DDP at world size 1, bit for bit. torch_compile, which would have accelerate wrap it
    anyway, is refused there as with several processes."""
    import json

    from test_engine_distributed import run_ranks

    run_ranks(_one_launched_process, str(tmp_path), world=1)
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert res["world"] == 1 and res["plain_wrapped"] == "DistributedDataParallel"
    assert res["engine_wrapped"] == "GPT2LMHeadModel"
    assert res["engine"] == res["plain"] and len(res["engine"]) == 4
    assert res["engine_norms"] == res["plain_norms"] and res["weights_equal"]
    assert "under a launcher" in res["compile_refused"], res["compile_refused"]


def hf_deepspeed_config(nvme: str, **sections) -> dict:
    """A config as Hugging Face's DeepSpeed docs write them: every value the Trainer knows "auto"."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                                  "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
            **sections}


DS_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
DS_SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                    "warmup_num_steps": "auto", "total_num_steps": "auto"}}


def learning_rates_of(trainer: Trainer) -> list[float]:
    return [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]


def test_engine_trainer_from_a_deepspeed_config_fills_auto_as_the_trainer_does(tmp_path):
    """EngineTrainer(model=..., args=...) with a DeepSpeed config (deepspeed_config=, as
    TrainingArguments(deepspeed=...) gives it): its "auto" values filled from the arguments, its
    optimizer section (one group, weight decay on every parameter) and WarmupDecayLR over the
    Trainer's step count, clipping at the arguments' norm, the store under its nvme_path. Oracle: the
    Trainer over a plain copy with what DeepSpeed would have been given, spelled out."""
    lr = 2e-3  # not DeepSpeed's default warmup_max_lr (1e-3), which an unfilled "auto" would take
    args = dict(max_grad_norm=CLIP, weight_decay=0.01, warmup_steps=2, learning_rate=lr, adam_beta2=0.99)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG)
    ref = copy.deepcopy(model)
    # fused: the optimizer section without torch_adam is DeepSpeed's fused Adam, whose counterpart the engine
    # steps with; torch's fused and for-loop AdamW differ in the last bit on some CPUs (AVX-512 ones).
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, fused=True)
    schedule = engine.integrations.deepspeed.schedules.WarmupDecayLR(opt, total_num_steps=4, warmup_min_lr=0,
                                                                     warmup_max_lr=lr, warmup_num_steps=2)
    plain = Trainer(model=ref, args=arguments(tmp_path / "ref", **args), train_dataset=Tokens(),
                    optimizers=(opt, schedule))
    plain.train()

    nvme = str(tmp_path / "nvme")
    ds = hf_deepspeed_config(nvme, optimizer=DS_OPTIMIZER, scheduler=DS_SCHEDULER)
    trainer = EngineTrainer(model=model, args=arguments(tmp_path / "eng", **args), train_dataset=Tokens(),
                            deepspeed_config=ds)
    try:
        assert trainer.engine.model is model and trainer.engine.config.param_tier == "nvme"
        trainer.train()
        assert losses_of(trainer) == losses_of(plain) and len(losses_of(trainer)) == 4
        assert learning_rates_of(trainer) == learning_rates_of(plain)
        assert grad_norms_of(trainer) == grad_norms_of(plain) and min(grad_norms_of(plain)) > CLIP
        assert os.path.isfile(os.path.join(nvme, "tiered", "manifest.sqlite"))
    finally:
        trainer.engine.close()

    with pytest.raises(ValueError, match="fsdp"):  # refused after the engine was made: it is closed again,
        EngineTrainer(model=GPT2LMHeadModel(CONFIG), args=arguments(tmp_path / "x", **args, fsdp="full_shard"),
                      deepspeed_config=ds)
    EngineTrainer(model=GPT2LMHeadModel(CONFIG), args=arguments(tmp_path / "x", **args),
                  deepspeed_config=ds).engine.close()  # so its store under the same nvme_path opens
    mismatched = dict(ds, gradient_clipping=1.0)  # set, and not the arguments' 0.5: the Trainer refuses it too
    with pytest.raises(ValueError, match=r"ds gradient_clipping=1.0 vs hf max_grad_norm=0.5"):
        EngineTrainer(model=GPT2LMHeadModel(CONFIG), args=arguments(tmp_path / "x", **args),
                      deepspeed_config=mismatched)
    with pytest.raises(ValueError, match="optim='adafactor'.*adamw_torch"):  # no optimizer section: the Trainer's
        EngineTrainer(GPT2LMHeadModel(CONFIG), arguments(tmp_path / "x", optim="adafactor"),
                      deepspeed_config=hf_deepspeed_config(nvme))
    with pytest.raises(ValueError, match="needs an engine"):
        EngineTrainer(model=GPT2LMHeadModel(CONFIG), args=arguments(tmp_path / "x"))


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])  # the Trainer's default, and the for-loop
def test_engine_trainer_from_a_config_without_optimizer_uses_the_trainers_adamw_and_schedule(tmp_path, optim):
    """No optimizer or scheduler section: the Trainer's own AdamW (no weight decay on biases and
    norms, its fused or for-loop kernel: they round differently in the last bit on some CPUs) and its
    linear schedule with warmup, as with DeepSpeed; the same losses and weights as the plain Trainer
    given the same arguments, bit for bit. The model is built on the meta device and filled
    from its save_pretrained directory (state_dict=), where DeepSpeed loads it under zero.Init. bf16
    in the arguments: the engine trains bf16 weights with fp32 masters (DeepSpeed's bf16), not under
    the Trainer's autocast."""
    args = dict(max_grad_norm=CLIP, weight_decay=0.1, warmup_steps=1, optim=optim)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(CONFIG)
    ref.save_pretrained(tmp_path / "hf")
    plain = Trainer(model=ref, args=arguments(tmp_path / "ref", **args), train_dataset=Tokens())
    plain.train()
    with torch.device("meta"):
        model = GPT2LMHeadModel(CONFIG)
    trainer = EngineTrainer(model, arguments(tmp_path / "eng", **args), train_dataset=Tokens(),
                            deepspeed_config=hf_deepspeed_config(str(tmp_path / "nvme")),
                            store=store_config(tmp_path, host_bytes=8 << 20), state_dict=tmp_path / "hf")
    try:
        groups = trainer.engine.optimizer.param_groups
        no_decay = [p for n, p in ref.named_parameters() if n not in plain.get_decay_parameter_names(ref)]
        assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and len(groups[1]["params"]) == len(no_decay) == 18
        assert [bool(g["fused"]) for g in groups] == [optim == "adamw_torch_fused"] * 2
        trainer.train()
        assert losses_of(trainer) == losses_of(plain) and learning_rates_of(trainer) == learning_rates_of(plain)
        got, want = trainer.engine.state_dict(), ref.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        trainer.engine.close()
    bf16 = EngineTrainer(model=GPT2LMHeadModel(CONFIG), args=arguments(tmp_path / "b", bf16=True),
                         deepspeed_config=hf_deepspeed_config(str(tmp_path / "b" / "nvme"), bf16={"enabled": "auto"}),
                         store=store_config(tmp_path / "b", host_bytes=8 << 20))
    try:
        assert bf16.engine.config.train_dtype == "bfloat16" and not bf16.args.bf16
    finally:
        bf16.engine.close()


class StopAt(TrainerCallback):
    """Stops training once the Trainer has finished (and saved) step ``step``, as a run stopped there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_engine_trainer_resumes_bf16_and_fp16_bit_for_bit(tmp_path, precision):
    """A DeepSpeed-style config in bf16 or fp16 (nvme offload, accumulation 2), stopped after its
    checkpoint at step 2 and resumed by a new EngineTrainer's train(resume_from_checkpoint=True):
    the losses and the fp32 masters equal the uninterrupted run's bit for bit. The Trainer loads the
    checkpoint's bf16/fp16 weights through load_state_dict after the engine's checkpoint: values equal
    to the parameters' keep the masters that checkpoint restored."""
    sections = ({"bf16": {"enabled": "auto"}} if precision == "bf16" else
                {"fp16": {"enabled": "auto", "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 2}})
    args = dict(max_grad_norm=CLIP, max_steps=4, save_strategy="steps", save_steps=2, **{precision: True})

    def run(name: str, out, seed: int, resume: bool = False, stop: int | None = None):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(GPT2Config(**{**CONFIG.to_dict(), **NO_DROPOUT}))
        trainer = EngineTrainer(model=model, args=arguments(out, **args), train_dataset=Tokens(),
                                deepspeed_config=hf_deepspeed_config(str(tmp_path / name / "nvme"), **sections),
                                store=store_config(tmp_path / name, host_bytes=8 << 20),
                                callbacks=[StopAt(stop)] if stop else None)
        eng = trainer.engine
        try:
            trainer.train(resume_from_checkpoint=True if resume else None)
            masters = {n: eng.full_fp32_param(p) for n, p in model.named_parameters()}
            return losses_of(trainer), masters, eng.completed_steps
        finally:
            eng.close()

    whole, whole_masters, steps = run("whole", tmp_path / "whole", seed=0)
    assert len(whole) == 4 and steps == 4
    _, stopped_masters, _ = run("stopped", tmp_path / "out", seed=0, stop=2)
    assert any(not torch.equal(whole_masters[n], m) for n, m in stopped_masters.items())
    resumed, resumed_masters, _ = run("resumed", tmp_path / "out", seed=1, resume=True)  # other initial values
    assert resumed == whole
    assert all(torch.equal(whole_masters[n], m) for n, m in resumed_masters.items())


def test_engine_trainer_beside_a_reference_engine_from_the_same_nvme_path(tmp_path):
    """TRL's DPO under DeepSpeed: the Trainer's policy, and a reference model given to
    deepspeed.initialize with the Trainer's (filled) config. Each engine gets its own store under
    the one nvme_path: the first made <nvme_path>/tiered, the next tiered-2."""
    nvme = tmp_path / "nvme"
    args = arguments(tmp_path / "a", max_steps=1)
    trainer = EngineTrainer(model=GPT2LMHeadModel(CONFIG), args=args, train_dataset=Tokens(),
                            deepspeed_config=hf_deepspeed_config(str(nvme)))
    try:
        filled = filled_config(hf_deepspeed_config(str(nvme)), args)  # as accelerate hands it to TRL
        reference, _, _, _ = engine.initialize(model=GPT2LMHeadModel(CONFIG).eval(), config=filled)
        try:
            assert trainer.engine.config.store.path == str(nvme / "tiered")
            assert reference.config.store.path == str(nvme / "tiered-2")
            trainer.train()
            with torch.no_grad():
                assert torch.isfinite(reference(input_ids=Tokens()[0]["input_ids"][None]).logits).all()
        finally:
            reference.close()
    finally:
        trainer.engine.close()


def test_engine_trainer_removes_the_temporary_store_it_made(tmp_path, monkeypatch):
    """A config that offloads nothing to NVMe: the store in a temporary directory, removed when the
    engine closes, or when the set-up is refused before or after the engine was made."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where mkdtemp puts the store
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "gradient_clipping": "auto"}
    trainer = EngineTrainer(model=GPT2LMHeadModel(CONFIG), args=arguments(tmp_path / "a", max_steps=1),
                            train_dataset=Tokens(), deepspeed_config=ds)
    try:
        store = trainer.engine.config.store.path
        assert os.path.dirname(store) == str(scratch)
        trainer.train()
        assert os.path.isfile(os.path.join(store, "manifest.sqlite"))
    finally:
        trainer.engine.close()
    assert os.listdir(scratch) == []
    with pytest.raises(ValueError, match="fsdp"):  # refused after the engine was made
        EngineTrainer(model=GPT2LMHeadModel(CONFIG), args=arguments(tmp_path / "b", fsdp="full_shard"),
                      deepspeed_config=ds)
    with pytest.raises(ValueError, match="optim='adafactor'"):  # before it was made
        EngineTrainer(model=GPT2LMHeadModel(CONFIG), args=arguments(tmp_path / "c", optim="adafactor"),
                      deepspeed_config=ds)
    assert os.listdir(scratch) == []


def command_line(out, ds_path, *extra: str) -> list[str]:
    """The command line of a Trainer script run with `--deepspeed ds_config.json`: arguments()'s values."""
    return ["--output_dir", str(out), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--max_steps", "4", "--learning_rate", str(LR), "--weight_decay", "0.0", "--max_grad_norm", str(CLIP),
            "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--use_cpu", "--seed", "0",
            "--dataloader_num_workers", "0", "--disable_tqdm", "true", "--deepspeed", str(ds_path), *extra]


def test_engine_trainer_takes_deepspeed_from_the_command_line(tmp_path):
    """`--deepspeed ds_config.json` parsed by HfArgumentParser into EngineTrainingArguments (no
    deepspeed package here): the config goes to the engine, not to transformers (no global ZeRO-3
    config, so from_config builds the model as it is, not under zero.Init), and the run is the one
    deepspeed_config= gives. Plain TrainingArguments(deepspeed=...) is refused, naming both forms."""
    import json

    from transformers import AutoModelForCausalLM, HfArgumentParser
    from transformers.integrations import is_deepspeed_zero3_enabled

    from engine.integrations.hf import EngineTrainingArguments

    runs = []
    for name in ("command_line", "deepspeed_config"):
        ds = hf_deepspeed_config(str(tmp_path / name / "nvme"), optimizer=DS_OPTIMIZER)
        ds_path = tmp_path / f"{name}.json"
        ds_path.write_text(json.dumps(ds))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(CONFIG)
        if name == "command_line":
            (args,) = HfArgumentParser((EngineTrainingArguments,)).parse_args_into_dataclasses(
                args=command_line(tmp_path / name, ds_path))
            assert args.deepspeed is None and args.engine_deepspeed_config == str(ds_path)
            assert not is_deepspeed_zero3_enabled()
            trainer = EngineTrainer(model=model, args=args, train_dataset=Tokens())
        else:
            trainer = EngineTrainer(model=model, args=arguments(tmp_path / name, max_grad_norm=CLIP),
                                    train_dataset=Tokens(), deepspeed_config=str(ds_path))
        try:
            assert trainer.args.deepspeed is None and not trainer.is_deepspeed_enabled
            assert trainer.engine.config.param_tier == "nvme"
            trainer.train()
            runs.append(losses_of(trainer))
        finally:
            trainer.engine.close()
    assert runs[0] == runs[1] and len(runs[0]) == 4
    with pytest.raises(ValueError, match=r"deepspeed_config=.*EngineTrainingArguments"):  # a namespace: see below
        EngineTrainer(model=GPT2LMHeadModel(CONFIG), args=SimpleNamespace(deepspeed="ds.json", fsdp=None))


#: A stand-in `deepspeed` distribution (a module and its metadata), enough for transformers'
#: TrainingArguments to accept `--deepspeed`, as it does where DeepSpeed is installed. It has no
#: `deepspeed.zero`: building a model under zero.Init fails on it.
STUB_SCRIPT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, GPT2Config, HfArgumentParser, TrainingArguments
from transformers.integrations import is_deepspeed_zero3_enabled
sys.path.insert(0, {tests!r})
from test_engine_hf_trainer import CONFIG, Tokens, command_line, losses_of
from engine.integrations.hf import EngineTrainer, EngineTrainingArguments

ds_path, out = sys.argv[1], sys.argv[2]
(args,) = HfArgumentParser((EngineTrainingArguments,)).parse_args_into_dataclasses(
    args=command_line(out + "/engine", ds_path, "--max_steps", "2"))
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(CONFIG)  # under zero.Init with a global ZeRO-3 config
trainer = EngineTrainer(model=model, args=args, train_dataset=Tokens())
trainer.train()
trainer.engine.close()
print("engine", is_deepspeed_zero3_enabled(), json.dumps(losses_of(trainer)))

(args,) = HfArgumentParser((TrainingArguments,)).parse_args_into_dataclasses(args=command_line(out + "/plain", ds_path))
print("plain", is_deepspeed_zero3_enabled())
try:
    EngineTrainer(model=torch.nn.Linear(1, 1), args=args)
except ValueError as exc:
    print("refused", exc)
"""


def test_deepspeed_on_the_command_line_where_deepspeed_is_installed(tmp_path):
    """Where the deepspeed package is importable (a stand-in here, in a fresh process): with
    EngineTrainingArguments `--deepspeed` reaches the engine and no ZeRO-3 state is set, so
    from_config builds the model as it is (under zero.Init it would fail on the stand-in); with
    plain TrainingArguments transformers takes the ZeRO-3 config, and EngineTrainer refuses the
    arguments with a message naming the supported forms, rather than train a model DeepSpeed
    partitioned."""
    import json
    import subprocess
    import sys

    stub = tmp_path / "site"
    (stub / "deepspeed").mkdir(parents=True)
    # accelerate's unwrap_model imports DeepSpeedEngine wherever deepspeed is installed
    (stub / "deepspeed" / "__init__.py").write_text('__version__ = "0.18.0"\n\n\nclass DeepSpeedEngine:\n    pass\n')
    (stub / "deepspeed-0.18.0.dist-info").mkdir()
    (stub / "deepspeed-0.18.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\n"
                                                                  "Version: 0.18.0\n")
    ds_path = tmp_path / "ds_config.json"
    ds_path.write_text(json.dumps(hf_deepspeed_config(str(tmp_path / "nvme"), optimizer=DS_OPTIMIZER)))
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub), str(root), os.environ.get("PYTHONPATH", "")]))
    script = STUB_SCRIPT.format(tests=str(root / "tests"))
    done = subprocess.run([sys.executable, "-c", script, str(ds_path), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines() if " " in line}
    zero3, losses = lines["engine"].split(" ", 1)
    assert zero3 == "False" and len(json.loads(losses)) == 2
    assert lines["plain"] == "True"  # transformers took the config: the stand-in passed its package check
    assert "EngineTrainer(model=model, args=args, deepspeed_config=...)" in lines["refused"], lines["refused"]
    assert "EngineTrainingArguments" in lines["refused"]
