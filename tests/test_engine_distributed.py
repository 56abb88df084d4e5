"""Multi-process sharding: world size 2 on gloo, in real processes started like torchrun starts them
(environment variables, ``init_process_group("gloo")``, ``process_group=None``).

The oracle is one process running the plain model on each rank's half of the batch and averaging
the two gradients, which is what data parallelism computes: with two ranks the sum of two values
does not depend on the order, and halving is exact, so the results must match bit for bit. A run
on the combined batch (one forward over both halves) agrees up to rounding, and FSDP2
(``fully_shard`` on gloo) trains to the same losses.
"""

from __future__ import annotations

import copy
import datetime
import os
import pathlib
import socket
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import ranks_started_here
from engine_models import TinyGPT, engine_config, gpt_tokens
from torch import nn

import engine
import engine.checkpoint.sharded
from engine.paging.layout import ShardLayout

WORLD = 2
#: Odd widths so that most parameters' numel is not a multiple of the world size (padded shards).
GPT_SIZES = dict(vocab=61, d=33, heads=3, layers=1, ctx=16)
STEPS = 3


# ---------------------------------------------------------------------------- process harness


def free_port() -> int:
    """A TCP port nobody listens on right now (for this test's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple, join: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # same kernels and reduction order as the oracle, which runs with one thread too
    if join:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], *args: Any, world: int = WORLD, join: bool = True) -> None:
    """Run ``fn(rank, *args)`` in ``world`` fresh processes with torchrun's environment variables,
    joined into one gloo group (env init); with ``join=False`` ``fn`` joins it itself, as a
    DeepSpeed script leaves it to ``deepspeed.initialize``."""
    with ranks_started_here(world):
        mp.start_processes(_entry, args=(world, free_port(), fn, args, join), nprocs=world, start_method="spawn")


class one_thread:
    """Run the oracle with one intra-op thread, like the ranks."""

    def __enter__(self) -> None:
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self._threads)


def batch(step: int) -> torch.Tensor:
    """The combined batch of ``step``: 4 sequences, ranks take 2 each."""
    return gpt_tokens(batch=4, t=12, vocab=GPT_SIZES["vocab"], seed=step)


def half(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x.chunk(WORLD)[rank]


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def new_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(**GPT_SIZES)


# ---------------------------------------------------------------------------- plain torch optimizer


LOST = "blocks.0.fc.weight"


def _lost_shard_rank(rank: int, root: str) -> dict[str, str]:
    """Rank 1's store loses its shard of ``LOST``; each call that gathers whole parameters is tried
    on both ranks, and what it raised recorded (a hang would fail the test by the group's timeout)."""
    model = new_model()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=WD), config=_adamw_config(root, "lost"))
    _train(model, eng, rank, range(1))
    if rank == 1:
        eng.store.sync.delete("param/" + LOST)
    outcome = {}
    calls = {"save_weights": lambda: eng.save_weights(os.path.join(root, "lost-weights"), max_shard_bytes=4000),
             "state_dict": eng.state_dict}
    for what, call in calls.items():
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome[what] = f"{type(exc).__name__}: {exc}"
        else:
            outcome[what] = "returned"
    eng.close()
    return outcome


def _plain_rank(rank: int, root: str) -> dict[str, Any]:
    """Wrap (default group), 3 steps of a plain torch AdamW, the consolidated state dict; FSDP2 on
    the same data; wraps with explicit groups."""
    model = new_model()
    fsdp_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = engine_config(pathlib.Path(root) / "plain", tier="nvme", host_bytes=16 * 1024)
    eng = engine.wrap(model, config=config, optimizer=opt)
    outs, losses, grads = [], [], []
    for step in range(STEPS):
        out = model(half(batch(step), rank))
        loss = loss_of(out)
        loss.backward()
        outs.append(out.detach().clone())
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    stats = eng.stats()
    shard = eng.store.info("param/wte.weight")
    want = ShardLayout(tuple(model.wte.weight.shape), torch.float32, (GPT_SIZES["d"], 1), rank, WORLD)
    result = dict(
        outs=outs, losses=losses, grads=grads, state_dict=eng.state_dict(),
        prefetch_hits=stats.prefetch_hits, rerecords=stats.rerecords, shard_shape=shard.shape,
        want_shard_shape=(want.shard_numel,), store_path=eng.store.config.path,
        store_keys=sorted(eng.store.keys()),
    )
    # The torch optimizer's state goes into the checkpoint (rank 0's file, every rank holding the same
    # state): both ranks of a fresh engine read it and continue alike, moments and all.
    eng.save_checkpoint(pathlib.Path(root) / "plain-ckpt")
    result["continued"] = _plain_steps(model, opt, rank)
    eng.close()
    fresh = new_model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)  # the saved lr comes back with the state
    with engine.wrap(fresh, config=engine_config(pathlib.Path(root) / "plain-resumed", tier="nvme"),
                     optimizer=fresh_opt) as resumed:
        resumed.load_checkpoint(pathlib.Path(root) / "plain-ckpt")
        result["resumed"] = _plain_steps(fresh, fresh_opt, rank)

    # FSDP2 on the same data and optimizer: a second oracle for the training losses.
    from torch.distributed.fsdp import fully_shard

    for block in fsdp_model.blocks:
        fully_shard(block)
    fully_shard(fsdp_model)
    fsdp_opt = torch.optim.AdamW(fsdp_model.parameters(), lr=1e-2)
    fsdp_losses = []
    for step in range(STEPS):
        loss = loss_of(fsdp_model(half(batch(step), rank)))
        loss.backward()
        fsdp_losses.append(loss.item())
        fsdp_opt.step()
        fsdp_opt.zero_grad()
    result["fsdp_losses"] = fsdp_losses

    # An explicit group of both ranks shards like the default; a group of one does not shard.
    both = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(WORLD)]
    for name, group in (("both", both), ("single", singles[rank])):
        m = new_model()
        where = pathlib.Path(root) / (name if name == "both" else f"single{rank}")  # unsharded: a store per process
        with engine.wrap(m, config=engine_config(where), process_group=group) as e:
            result[f"{name}_out"] = m(half(batch(0), rank)).detach()
            result[f"{name}_shard_numel"] = e.store.info("param/ln_f.weight").shape[0]
            result[f"{name}_store_path"] = e.store.config.path
            result[f"{name}_writebacks"] = e.stats().writebacks  # the all-gather's writes are not the user's

    # A parameter of one element (rank 1's shard is all padding) and a transposed one (strides kept).
    odd = _odd_model()
    with engine.wrap(odd, config=engine_config(pathlib.Path(root) / "odd")):
        out = odd(_odd_input(rank))
        out.pow(2).mean().backward()
        result["odd_out"] = out.detach()
        result["odd_grads"] = {n: p.grad.clone() for n, p in odd.named_parameters()}

    # Activation checkpointing: the recomputation in backward fetches (all-gathers) again, in the same order
    # on both ranks.
    for mode in ("reentrant", "non_reentrant"):
        torch.manual_seed(0)
        m = TinyGPT(**GPT_SIZES, checkpoint=mode)
        with engine.wrap(m, config=engine_config(pathlib.Path(root) / mode)):
            loss_of(m(half(batch(0), rank))).backward()
            result[f"{mode}_grads"] = {n: p.grad.clone() for n, p in m.named_parameters()}
    return result


def _plain_steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> list[float]:
    """Two more steps of this rank's half of the data with a plain torch optimizer; the losses."""
    losses = []
    for step in range(STEPS, STEPS + 2):
        loss = loss_of(model(half(batch(step), rank)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _odd_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 5, bias=False), nn.Linear(5, 3), nn.Linear(3, 1))
    model[1].weight.data = torch.randn(5, 3).t()  # shape (3, 5), strides (1, 3)
    return model


def _odd_input(rank: int) -> torch.Tensor:
    return torch.randn(2 * WORLD, 1, generator=torch.Generator().manual_seed(3)).chunk(WORLD)[rank]


def _oracle_plain() -> dict:
    """One process: the plain model on each half, gradients averaged, the same AdamW."""
    with one_thread():
        model = new_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outs, losses, grads, combined = [], [[] for _ in range(WORLD)], [], []
        for step in range(STEPS):
            x = batch(step)
            per_rank = []
            for rank in range(WORLD):
                out = model(half(x, rank))
                loss = loss_of(out)
                loss.backward()
                outs.append((step, rank, out.detach().clone()))
                losses[rank].append(loss.item())
                per_rank.append({n: p.grad.clone() for n, p in model.named_parameters()})
                model.zero_grad()
            avg = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in per_rank[0]}
            grads.append(avg)
            if step == 0:  # the same gradient from one forward over the combined batch (rounding differs)
                loss_of(model(x)).backward()
                combined = {n: p.grad.clone() for n, p in model.named_parameters()}
                model.zero_grad()
            for n, p in model.named_parameters():
                p.grad = avg[n].clone()
            opt.step()
            opt.zero_grad()
        return dict(model=model, outs=outs, losses=losses, grads=grads, combined=combined)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Any, list[dict[str, Any]]]:
    """One run of two ranks for the tests below (each process start costs seconds)."""
    root = tmp_path_factory.mktemp("world2")
    run_ranks(_train_rank, str(root))
    return root, [torch.load(root / f"train{r}.pt", weights_only=False) for r in range(WORLD)]


def _train_rank(rank: int, root: str) -> None:
    result = {"plain": _plain_rank(rank, root), "adamw": _adamw_rank(rank, root), "lost": _lost_shard_rank(rank, root)}
    torch.save(result, os.path.join(root, f"train{rank}.pt"))


def test_world2_plain_optimizer_matches_data_parallel_oracle(trained):
    tmp_path, runs = trained
    results = [run["plain"] for run in runs]
    want = _oracle_plain()
    odd = _odd_model()
    assert odd[1].weight.stride() == (1, 3)
    odd_grads = []
    for rank in range(WORLD):
        odd(_odd_input(rank)).pow(2).mean().backward()
        odd_grads.append({n: p.grad.clone() for n, p in odd.named_parameters()})
        odd.zero_grad()
    odd_grads = {n: (odd_grads[0][n] + odd_grads[1][n]) / 2 for n in odd_grads[0]}

    for step, rank, out in want["outs"]:
        assert torch.equal(results[rank]["outs"][step], out), (step, rank)
    for rank, res in enumerate(results):
        assert res["losses"] == want["losses"][rank]
        assert res["resumed"] == res["continued"]  # the optimizer's state came back from the checkpoint
        for step in range(STEPS):  # param.grad at world 2 without the engine's optimizer: the mean (DDP's)
            for name, grad in want["grads"][step].items():
                assert torch.equal(res["grads"][step][name], grad), (rank, step, name)
        for name, grad in want["combined"].items():
            torch.testing.assert_close(res["grads"][0][name], grad, rtol=1e-5, atol=1e-7)
        # each rank keeps its half of every padded, flattened parameter in its own store directory
        assert res["shard_shape"] == res["want_shard_shape"]
        assert res["store_path"] == str(tmp_path / "plain" / "store" / f"rank{rank}")
        assert all(k.startswith("param/") for k in res["store_keys"])
        assert res["prefetch_hits"] > 0 and res["rerecords"] == 0
        # the consolidated state dict (gathered from both ranks) is the oracle's, and loads into a plain model
        sd = res["state_dict"]
        assert list(sd) == list(want["model"].state_dict())
        for name, value in want["model"].state_dict().items():
            assert torch.equal(sd[name], value), name
        plain = TinyGPT(**GPT_SIZES)
        plain.load_state_dict(sd)
        assert torch.equal(plain.wte.weight, want["model"].wte.weight)
        # FSDP2 trains to the same losses
        torch.testing.assert_close(res["fsdp_losses"], res["losses"], rtol=1e-6, atol=0)
        # explicit groups
        assert res["both_shard_numel"] == -(-GPT_SIZES["d"] // WORLD)
        assert res["both_store_path"] == str(tmp_path / "both" / "store" / f"rank{rank}")
        assert res["single_shard_numel"] == GPT_SIZES["d"]
        assert res["single_store_path"] == str(tmp_path / f"single{rank}" / "store")
        assert torch.equal(res["single_out"], res["both_out"])
        assert res["both_writebacks"] == 0 and res["single_writebacks"] == 0
        assert torch.equal(res["odd_out"], odd(_odd_input(rank)))
        for name, grad in odd_grads.items():
            assert torch.equal(res["odd_grads"][name], grad), name
        for mode in ("reentrant", "non_reentrant"):
            for name, grad in want["grads"][0].items():
                assert torch.equal(res[f"{mode}_grads"][name], grad), (mode, name)


# ---------------------------------------------------------------------------- engine.AdamW and checkpoints

LR, WD, CLIP = 1e-2, 0.01, 0.05
#: Just below the first step's global gradient norm (19.84) and above the later steps' (17.6 and less).
CLIP_LATE = 19.8


def _adamw_config(root, name: str, **kw) -> engine.EngineConfig:
    return engine_config(pathlib.Path(root) / name, tier="nvme").replace(optimizer_group_bytes=8 * 1024, **kw)


def _adamw_rank(rank: int, root: str) -> dict[str, Any]:
    """engine.AdamW: 3 steps, save a checkpoint, 3 more; and 3 steps with clipping."""
    model = new_model()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=WD), config=_adamw_config(root, "a"))
    before_training = eng.optimizer.state_dict()  # no state yet: nothing to gather (accelerate's prepare round trip)
    eng.optimizer.load_state_dict(before_training)
    losses = _train(model, eng, rank, range(3))
    eng.save_checkpoint(os.path.join(root, "ckpt"))
    losses += _train(model, eng, rank, range(3, 6))
    try:
        eng.optimizer.state_dict()
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    result = dict(losses=losses, state_dict=eng.state_dict(), optimizer_state=(len(before_training["state"]), refused),
                  grad_keys=[k for k in eng.store.keys() if k.startswith("grad/")],
                  weight_files=eng.save_weights(os.path.join(root, "weights"), max_shard_bytes=4000))
    eng.close()
    clipped = new_model()
    eng = engine.wrap(clipped, optimizer=engine.AdamW(lr=LR, weight_decay=WD),
                      config=_adamw_config(root, "clip", max_grad_norm=CLIP))
    result["clipped_norms"] = []
    result["clipped_losses"] = _train(clipped, eng, rank, range(3), result["clipped_norms"])
    eng.close()
    result["fp16"] = _fp16_run(rank, root)
    result["accumulation"] = _accumulation_run(rank, root)
    result["inside"] = _inside_runs(rank, root)
    model = new_model()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=WD),
                      config=_adamw_config(root, "act", activation_tier="nvme", activation_min_bytes=1024))
    result["activation_losses"] = _train(model, eng, rank, range(3))
    result["activations_offloaded"] = eng.stats().activation_bytes_offloaded
    result["activation_keys_left"] = [k for k in eng.store.keys() if k.startswith("activation/")]
    eng.close()
    return result


def _accumulation_run(rank: int, root: str) -> dict[str, Any]:
    """The DeepSpeed loop (eng.backward, eng.step per micro-batch) with gradient_accumulation_steps
    derived from a DeepSpeed config at world size 2: train_batch_size 8 = 2 per rank x 2 ranks x 2."""
    base = _adamw_config(root, "accum")
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    derived = engine.EngineConfig.from_deepspeed(ds, store=base.store).gradient_accumulation_steps
    model = new_model()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=WD),
                      config=base.replace(gradient_accumulation_steps=derived))
    losses, stepped = [], []
    for micro in range(4):
        loss = loss_of(model(half(batch(micro), rank)))
        eng.backward(loss)
        stepped.append(eng.step())
        losses.append(loss.item())
    result = dict(derived=derived, losses=losses, stepped=stepped, state_dict=eng.state_dict())
    eng.close()
    return result


def _inside_runs(rank: int, root: str) -> dict[tuple[str, bool], dict[str, Any]]:
    """fp32 and bf16 with clipping, the updates inside backward from the first step or never: the first
    step's norm binds when its last gradients come in (its updates are redone after backward), the
    later ones do not bind (the second runs after backward, as a step after a binding one does; the
    others commit inside backward)."""
    out = {}
    for dtype in (None, "bfloat16"):
        for inside in (True, False):
            model = new_model()
            config = _adamw_config(root, f"inside-{dtype}-{inside}", train_dtype=dtype, max_grad_norm=CLIP_LATE,
                                   step_in_backward=inside)
            eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=WD), config=config)
            norms: list[Optional[float]] = []
            losses = _train(model, eng, rank, range(4), norms)
            counters = eng._training.counters
            out[(dtype or "float32", inside)] = dict(losses=losses, norms=norms, state_dict=eng.state_dict(),
                                                     inside=counters.steps_inside, redone=counters.steps_redone)
            eng.close()
    return out


def _fp16_run(rank: int, root: str) -> dict[str, Any]:
    """fp16 with loss scaling; rank 1's first loss is 1e4 times larger, so its gradients overflow."""
    model = new_model()
    scaling = engine.LossScaling(initial_scale=2.0**10, growth_interval=2, hysteresis=1)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=WD),
                      config=_adamw_config(root, "fp16", train_dtype="float16", loss_scaling=scaling))
    scales, losses = [], []
    for step in range(5):
        loss = loss_of(model(half(batch(step), rank))) * (1e4 if rank == 1 and step == 0 else 1.0)
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
        scales.append(eng.loss_scale)
        losses.append(loss.item())
    result = dict(scales=scales, losses=losses, skipped=eng.stats().skipped_steps, steps=eng.completed_steps,
                  state_dict=eng.state_dict(),
                  master_files=eng.save_weights(os.path.join(root, "fp16-masters"), master_weights=True))
    eng.close()
    return result


def _resume_rank(rank: int, root: str, checkpoint: str = "ckpt", name: str = "resume") -> None:
    """A fresh model (other values on each rank) loads the checkpoint saved after step 3 and trains
    the last 3 steps; the losses go to ``<name><rank>.pt``."""
    torch.manual_seed(1 + rank)
    model = TinyGPT(**GPT_SIZES)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=0.5), config=_adamw_config(root, name))
    eng.load_checkpoint(os.path.join(root, checkpoint))
    losses = _train(model, eng, rank, range(3, 6))
    eng.close()
    torch.save(losses, os.path.join(root, f"{name}{rank}.pt"))


def _train(model: nn.Module, eng: engine.Engine, rank: int, steps: range,
           norms: list[float | None] | None = None) -> list[float]:
    losses = []
    for step in steps:
        loss = loss_of(model(half(batch(step), rank)))
        loss.backward()
        eng.step()
        if norms is not None:
            norms.append(eng.get_global_grad_norm())
        eng.zero_grad()
        losses.append(loss.item())
    return losses


def _oracle_adamw(steps: int, clip: float | None = None,
                  norms: list[float] | None = None) -> tuple[list[list[float]], nn.Module]:
    """Plain torch.optim.AdamW on the averaged gradients (clipped with clip_grad_norm_ if asked;
    ``norms`` gets each step's total gradient norm)."""
    with one_thread():
        model = new_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        losses: list[list[float]] = [[] for _ in range(WORLD)]
        for step in range(steps):
            grads = []
            for rank in range(WORLD):
                loss = loss_of(model(half(batch(step), rank)))
                loss.backward()
                losses[rank].append(loss.item())
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                model.zero_grad()
            for n, p in model.named_parameters():
                p.grad = (grads[0][n] + grads[1][n]) / 2
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))
            if norms is not None:
                norms.append(norm.item())
            opt.step()
            opt.zero_grad()
        return losses, model


def _oracle_accumulation() -> tuple[list[list[float]], nn.Module]:
    """Two windows of two micro-batches: each micro-batch's gradients of loss / 2 averaged over
    the ranks, summed over the window, then one torch.optim.AdamW step."""
    with one_thread():
        model = new_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        losses: list[list[float]] = [[] for _ in range(WORLD)]
        for window in range(2):
            summed: dict[str, torch.Tensor] = {}
            for micro in (2 * window, 2 * window + 1):
                grads = []
                for rank in range(WORLD):
                    loss = loss_of(model(half(batch(micro), rank)))
                    (loss / 2).backward()
                    losses[rank].append(loss.item())
                    grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                    model.zero_grad()
                for n in grads[0]:
                    mean = (grads[0][n] + grads[1][n]) / 2
                    summed[n] = summed[n] + mean if n in summed else mean
            for n, p in model.named_parameters():
                p.grad = summed[n]
            opt.step()
            opt.zero_grad()
        return losses, model


def test_world2_activations_in_each_ranks_store_change_no_loss(trained):
    _, runs = trained
    for run in runs:
        res = run["adamw"]
        assert res["activations_offloaded"] > 0 and res["activation_keys_left"] == []
        assert res["activation_losses"] == res["losses"][:3]  # the same run with activations in memory


def test_world2_gradient_accumulation_matches_one_process(trained):
    _, runs = trained
    want, model = _oracle_accumulation()
    for rank, run in enumerate(runs):
        res = run["adamw"]["accumulation"]
        assert res["derived"] == 2 and res["stepped"] == [False, True, False, True]
        assert res["losses"] == want[rank]
        for name, value in model.state_dict().items():
            assert torch.equal(res["state_dict"][name], value), name


def test_world2_adamw_training_matches_one_process(trained):
    _, runs = trained
    want, model = _oracle_adamw(6)
    want_norms: list[float] = []
    want_clipped, _ = _oracle_adamw(3, clip=CLIP, norms=want_norms)
    for rank, run in enumerate(runs):
        res = run["adamw"]
        # engine.AdamW on reduce-scattered gradient shards == torch AdamW on the averaged gradients
        assert res["losses"] == want[rank]
        assert res["grad_keys"] == []  # zero_grad dropped the gradient shards
        for name, value in model.state_dict().items():
            assert torch.equal(res["state_dict"][name], value), name
        # clipping: the global norm sums per-shard squares over ranks (rounding differs from torch's order)
        torch.testing.assert_close(res["clipped_losses"], want_clipped[rank], rtol=1e-6, atol=0)
        torch.testing.assert_close(res["clipped_norms"], want_norms, rtol=1e-6, atol=0)  # before clipping
        assert res["clipped_norms"] == runs[0]["adamw"]["clipped_norms"]  # every rank the same all-reduced norm
    assert runs[0]["adamw"]["clipped_losses"] != runs[0]["adamw"]["losses"][:3]  # the clip was active


def test_world2_updates_inside_backward_equal_the_step_after_it_bit_for_bit(trained):
    """At two ranks, in fp32 and bf16 with clipping: a step whose clip binds only once its last
    gradients come in is redone after backward, the next runs after backward, the later ones commit
    inside backward, and every loss,
    norm and value equals the step after backward's bit for bit (on every rank)."""
    _, runs = trained
    for run in runs:
        for dtype in ("float32", "bfloat16"):
            inside, after = run["adamw"]["inside"][(dtype, True)], run["adamw"]["inside"][(dtype, False)]
            assert inside["norms"][0] > CLIP_LATE > max(inside["norms"][1:]), inside["norms"]
            assert inside["redone"] == 1 and inside["inside"] == 2, (dtype, inside["redone"], inside["inside"])
            assert after["inside"] == after["redone"] == 0
            assert inside["losses"] == after["losses"] and inside["norms"] == after["norms"], dtype
            for name, value in after["state_dict"].items():
                assert torch.equal(inside["state_dict"][name], value), (dtype, name)


def test_world2_the_optimizer_state_dict_is_refused_rather_than_a_rank_s_part(trained):
    """At two ranks each holds a shard of the optimizer state: opt.state_dict() raises naming
    eng.save_checkpoint (the Hugging Face Trainer calls it on rank 0 alone, so it cannot gather),
    never one rank's part or an empty state; before the first step there is none to gather."""
    _, runs = trained
    for run in runs:
        empty, refused = run["adamw"]["optimizer_state"]
        assert empty == 0
        assert "sharded over 2 ranks" in refused and "eng.save_checkpoint(dir)" in refused, refused


def test_world2_save_weights_gathers_every_parameter_and_rank0_writes(trained):
    from safetensors.torch import load_file

    root, runs = trained
    files = runs[0]["adamw"]["weight_files"]
    assert files == runs[1]["adamw"]["weight_files"] and len(files) > 2 and files[-1].endswith(".index.json")
    assert sorted(os.listdir(root / "weights")) == sorted(os.path.basename(f) for f in files)
    saved = {k: v for f in files[:-1] for k, v in load_file(f).items()}
    whole = runs[0]["adamw"]["state_dict"]
    assert set(whole) - set(saved) == {"lm_head.weight"}  # tied to wte.weight, written once
    assert all(torch.equal(v, whole[k]) for k, v in saved.items())


def test_world2_a_rank_that_cannot_read_a_shard_stops_every_rank(trained):
    """A whole parameter needs every rank's shard: when one rank's read fails, that rank raises its
    own error and the others say which rank and parameter, instead of waiting for it in the
    all-gather (until the group's timeout) or returning the parameter with a part missing; an
    export publishes nothing."""
    root, runs = trained
    for what in ("save_weights", "state_dict"):
        mine, theirs = runs[1]["lost"][what], runs[0]["lost"][what]
        assert mine.startswith("KeyNotFoundError") and f"param/{LOST}" in mine, mine
        assert theirs.startswith("TransferError") and f"reading parameter {LOST!r} failed on rank 1" in theirs, theirs
    assert not os.path.exists(root / "lost-weights") or os.listdir(root / "lost-weights") == []


def test_world2_loss_scaling_skips_and_scales_on_every_rank_alike(trained):
    _, runs = trained
    first, second = (run["adamw"]["fp16"] for run in runs)
    assert first["scales"] == second["scales"] and first["scales"][0] == 2.0**9  # step 0 skipped on both ranks
    assert first["skipped"] == second["skipped"] >= 1 and first["steps"] == second["steps"] == 5 - first["skipped"]
    assert max(first["scales"]) > 2.0**9  # and grew back after good steps
    for name, value in first["state_dict"].items():
        assert value.dtype == torch.float16 and torch.equal(value, second["state_dict"][name]), name
    assert first["losses"][-1] < first["losses"][1]
    # the fp32 masters gathered across both ranks: the fp16 weights are them rounded
    from safetensors.torch import load_file

    masters = {k: v for f in first["master_files"] for k, v in load_file(f).items()}
    assert masters.keys() == first["state_dict"].keys() - {"lm_head.weight"}
    assert all(v.dtype == torch.float32 and torch.equal(v.half(), first["state_dict"][k]) for k, v in masters.items())
    assert any(not torch.equal(v, first["state_dict"][k].float()) for k, v in masters.items())


def test_world2_checkpoint_resumes_in_new_processes(trained):
    root, runs = trained
    assert sorted(os.listdir(root / "ckpt")) == ["metadata.json", "rank0.safetensors", "rank1.safetensors"]
    run_ranks(_resume_rank, str(root))
    for rank, run in enumerate(runs):
        resumed = torch.load(root / f"resume{rank}.pt", weights_only=False)
        assert resumed == run["adamw"]["losses"][3:]  # the same curve, bit for bit


def _train_as_two_ranks(model: nn.Module, eng: engine.Engine, steps: range) -> list[float]:
    """What the two ranks compute, in one process: each step's two halves are the micro-batches of
    gradient_accumulation_steps=2, so the gradient is g0 / 2 + g1 / 2, the ranks' mean bit for bit."""
    losses = []
    for step in steps:
        for rank in range(WORLD):
            loss = loss_of(model(half(batch(step), rank)))
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
    return losses


def test_world2_checkpoint_loads_in_one_process_and_back(trained):
    """Checkpoints reshard on load: the two-rank checkpoint resumes in one process, and a one-process
    checkpoint in two ranks, each continuing the two-rank run's curve bit for bit (weights,
    optimizer moments and step counts all moved to the other layout)."""
    root, runs = trained
    want = [[run["adamw"]["losses"][s] for run in runs] for s in range(6)]  # per step, per rank
    one = _adamw_config(root, "one", gradient_accumulation_steps=WORLD)
    with one_thread():
        torch.manual_seed(7)
        model = TinyGPT(**GPT_SIZES)  # other values: everything must come from the checkpoint
        eng = engine.wrap(model, optimizer=engine.AdamW(lr=0.5), config=one)
        eng.load_checkpoint(root / "ckpt")
        assert eng.completed_steps == 3
        loaded = eng.state_dict()
        losses = _train_as_two_ranks(model, eng, range(3, 6))
        final = eng.state_dict()
        eng.close()
    assert losses == [x for step in want[3:] for x in step]
    for name, value in runs[0]["adamw"]["state_dict"].items():
        assert torch.equal(final[name], value), name
    offline = engine.checkpoint_state_dict(root / "ckpt")  # no engine, no process group: zero_to_fp32
    assert offline.keys() == loaded.keys() and all(torch.equal(offline[k], v) for k, v in loaded.items())

    with one_thread():
        model = new_model()
        eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=WD),
                          config=_adamw_config(root, "one-saving", gradient_accumulation_steps=WORLD))
        losses = _train_as_two_ranks(model, eng, range(3))
        eng.save_checkpoint(root / "ckpt-one")
        eng.close()
    assert losses == [x for step in want[:3] for x in step]
    run_ranks(_resume_rank, str(root), "ckpt-one", "grown")  # two ranks resume what one process saved
    for rank, run in enumerate(runs):
        assert torch.load(root / f"grown{rank}.pt", weights_only=False) == run["adamw"]["losses"][3:]


def _mixed_resume_rank(rank: int, root: str) -> None:
    """Resume from stores whose ranks completed different steps: every rank must refuse, none hang."""
    try:
        engine.wrap(new_model(), optimizer=engine.AdamW(lr=LR, weight_decay=WD),
                    config=_adamw_config(root, "a" if rank == 0 else "clip", resume=True))
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = "resumed"
    pathlib.Path(root, f"mixed{rank}.txt").write_text(message)


def test_world2_resume_refuses_ranks_that_completed_different_steps(trained):
    """Each rank commits its own step record, so a crash between two ranks' commits leaves their
    stores a step apart; resuming them would mix two steps. Here rank 0 resumes the store of the run
    above that finished step 6 and rank 1 that of the run that finished step 3."""
    root, _ = trained
    run_ranks(_mixed_resume_rank, str(root))
    for rank in range(WORLD):
        message = (root / f"mixed{rank}.txt").read_text()
        assert message.startswith("StepRecordError") and "completed different steps {0: 6, 1: 3}" in message, message


def _differing_ranks(rank: int, root: str) -> None:
    """Each rank seeds differently (or, for "same", alike) and wraps its own copy; what it warned
    and the state the engine then holds are saved for the test."""
    out = {}
    for case in ("different", "same"):
        torch.manual_seed(rank if case == "different" else 0)
        model = TinyGPT(**GPT_SIZES)
        model.register_buffer("counter", torch.full((3,), float(rank if case == "different" else 0)))  # a buffer
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng = engine.wrap(model, config=engine_config(pathlib.Path(root) / f"{case}-store"))
        out[case] = {"warnings": [str(w.message) for w in caught if "differed between the ranks" in str(w.message)],
                     "before": before, "after": eng.state_dict(), "counter": model.counter.clone()}
        eng.close()
    # On the meta device, seeded apart (accelerate's set_seed(device_specific=True)): each rank draws
    # every whole parameter and keeps its shard, so both must draw what rank 0's seed gives.
    torch.manual_seed(100 + rank)
    with torch.device("meta"):
        model = TinyGPT(**GPT_SIZES)
    eng = engine.wrap(model, config=engine_config(pathlib.Path(root) / "meta-store"))
    out["meta"] = {"after": eng.state_dict(), "next_draw": torch.rand(3)}  # its own generator afterwards
    eng.close()
    torch.save(out, os.path.join(root, f"rank{rank}.pt"))


def test_world2_ranks_whose_models_differ_all_start_from_rank0s(tmp_path):
    """DDP broadcasts rank 0's state at construction, so DDP scripts may seed ranks differently or
    load weights on rank 0 alone; sharded, each rank's part would come from its own model. The
    engine takes rank 0's values on every rank and names what differed."""
    run_ranks(_differing_ranks, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    rank0 = ranks[0]["different"]["before"]
    for rank, record in enumerate(ranks):
        different, same = record["different"], record["same"]
        differing = {k for k, v in rank0.items() if not torch.equal(v, ranks[1]["different"]["before"][k])}
        differing.discard("lm_head.weight")  # tied to wte.weight: one tensor (norms' ones and zeros agree)
        assert len(different["warnings"]) == 1, different["warnings"]
        assert different["warnings"][0].startswith(f"{len(differing)} parameters and buffers differed between")
        assert all(torch.equal(different["after"][k], v) for k, v in rank0.items()), rank
        assert torch.equal(different["counter"], torch.zeros(3))  # the buffer the rank keeps, rank 0's
        assert same["warnings"] == [] and all(torch.equal(same["after"][k], v) for k, v in same["before"].items())
    assert not torch.equal(ranks[1]["different"]["before"]["wte.weight"], rank0["wte.weight"])  # they did differ
    torch.manual_seed(100)  # one process seeded as rank 0, on the meta device
    with torch.device("meta"):
        model = TinyGPT(**GPT_SIZES)
    with engine.wrap(model, config=engine_config(tmp_path / "one")) as eng:
        want = eng.state_dict()
    for rank, record in enumerate(ranks):
        assert all(torch.equal(record["meta"]["after"][k], v) for k, v in want.items()), rank
        torch.manual_seed(100 + rank)
        assert torch.equal(record["meta"]["next_draw"], torch.rand(3))  # the rank's own stream, back
