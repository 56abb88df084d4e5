"""engine.estimate_memory and `tiered estimate`: bytes per tier from the model's shapes, held against
hand-computed figures and against what a real run's store holds; wrap refusing a shard larger than
its tier's whole budget before anything is written."""

from __future__ import annotations

import dataclasses
import io
import json
import os

import pytest
import torch
from torch import nn

import engine
import tiered
from engine.cli.estimate import main as estimate_main
from engine.paging.memory_estimate import COMPRESSED_STATE_RATIO
from engine.paging.memory_plan import MATH_CHUNK_BYTES
from engine_models import store_config

KiB, MiB = 1024, 1024 * 1024


def page(n: int) -> int:
    return -(-n // 4096) * 4096


def two_linears() -> nn.Module:
    """A 1000 -> 300 -> 7 MLP and a frozen LayerNorm: parameter sizes that are easy to count by hand."""
    model = nn.Sequential(nn.Linear(1000, 300), nn.Linear(300, 7), nn.LayerNorm(7))
    model[2].requires_grad_(False)
    return model


def config(tmp_path, **kw) -> engine.EngineConfig:
    store_kw = {k: kw.pop(k) for k in ("host_bytes", "device_bytes", "nvme_bytes") if k in kw}
    store_kw.setdefault("host_bytes", 64 * MiB)
    return engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path, **store_kw),
                               prefetch_bytes=1 * MiB, **kw)


def test_each_kind_of_entry_is_counted_in_its_tier(tmp_path):
    est = engine.estimate_memory(two_linears(), config(tmp_path, step_in_backward=False))
    sizes = [300_000, 300, 2100, 7]  # trainable elements, per parameter
    frozen = [7, 7]
    assert est.parameters == sum(sizes) + sum(frozen) and est.trainable == sum(sizes)
    params, grads, state = est.parts
    assert (params.tier, grads.tier, state.tier) == ("nvme", "host", "nvme")  # the defaults
    assert params.nbytes == sum(page(4 * n) for n in sizes + frozen)
    assert grads.nbytes == sum(page(4 * n) for n in sizes)  # frozen parameters have no gradient ...
    # ... and no moments; the fp32 parameters in the optimizer's tier are their own masters
    assert state.nbytes == 2 * grads.nbytes and "their own masters" in state.what
    assert params.largest == page(4 * 300_000) and params.largest_name == "0.weight"
    assert est.at_rest == engine.paging.memory_estimate.TierBytes(host=grads.nbytes, nvme=params.nbytes + state.nbytes)
    # During the step the gradients are made durable on nvme and one group's new state (here all of
    # it: the model is smaller than a group) is written before the old one is freed.
    assert est.during_step.nvme == est.at_rest.nvme + grads.nbytes + 3 * grads.nbytes
    assert est.during_step.host == est.at_rest.host
    # By default a step may also run its updates inside backward, which keep what they replace: the larger
    default = engine.estimate_memory(two_linears(), config(tmp_path))
    inside = engine.estimate_memory(two_linears(), config(tmp_path, step_in_backward=True))
    assert default.during_step.nvme == max(est.during_step.nvme, inside.during_step.nvme)
    separate = engine.estimate_memory(two_linears(), config(tmp_path, param_tier="host"))
    assert separate.parts[2].nbytes == 3 * grads.nbytes and "own masters" not in separate.parts[2].what
    assert est.fits and not est.warnings


def test_budgets_write_what_a_tier_cannot_hold_down_to_the_next(tmp_path):
    roomy = engine.estimate_memory(two_linears(), config(tmp_path, optimizer_tier="host"))
    state = roomy.parts[2].nbytes
    assert roomy.at_rest.host == roomy.parts[1].nbytes + state and roomy.during_step.host == roomy.at_rest.host
    two_slots = engine.estimate_memory(two_linears(), config(tmp_path, optimizer_tier="host", optimizer_in_place=False))
    assert two_slots.during_step.host == roomy.at_rest.host + state  # the new slot beside the old one
    assert two_slots.host_rss_bound > roomy.host_rss_bound  # and the step's copies of both
    tight = engine.estimate_memory(two_linears(), config(tmp_path, optimizer_tier="host", host_bytes=4 * MiB,
                                                         optimizer_prefetch_groups=0))
    assert tight.at_rest.host == tight.during_step.host == 4 * MiB  # full, the rest below
    tight_two_slots = engine.estimate_memory(two_linears(), config(
        tmp_path, optimizer_tier="host", host_bytes=4 * MiB, optimizer_in_place=False, optimizer_prefetch_groups=0))
    assert tight.host_rss_bound == tight_two_slots.host_rss_bound  # state on nvme is read into copies either way
    assert tight.at_rest.total == roomy.at_rest.total and tight.during_step.total == roomy.during_step.total
    assert tight.at_rest.nvme == roomy.at_rest.host - 4 * MiB + roomy.at_rest.nvme
    need = engine.estimate_memory(two_linears(), config(tmp_path)).during_step.nvme
    assert not engine.estimate_memory(two_linears(), config(tmp_path, nvme_bytes=need)).warnings
    short = engine.estimate_memory(two_linears(), config(tmp_path, nvme_bytes=need - 4096))
    assert short.fits and "StoreConfig.nvme_bytes" in short.warnings[0]  # from an estimate: a warning


def test_ranks_training_dtype_compression_and_inference(tmp_path):
    sizes, frozen = [300_000, 300, 2100, 7], [7, 7]
    three = engine.estimate_memory(two_linears(), config(tmp_path), world_size=3)
    assert three.parts[1].nbytes == sum(page(4 * -(-n // 3)) for n in sizes)  # shards padded to a multiple of 3
    bf16 = engine.estimate_memory(two_linears(), config(tmp_path, train_dtype="bfloat16"))
    assert bf16.parts[0].nbytes == sum(page(2 * n) for n in sizes + frozen)
    assert bf16.parts[1].nbytes == sum(page(4 * n) for n in sizes)  # gradients and state stay fp32
    fp32 = engine.estimate_memory(two_linears(), config(tmp_path))
    assert bf16.host_rss_bound > fp32.host_rss_bound - fp32.materialized_bytes + bf16.materialized_bytes  # new shards
    assert bf16.parts[2].nbytes == 3 * bf16.parts[1].nbytes  # a bf16 parameter has an fp32 master of its own
    packed = engine.estimate_memory(two_linears(), config(tmp_path, compress_optimizer=True))
    assert packed.parts[2].nbytes == sum(2 * page(int(4 * n * COMPRESSED_STATE_RATIO)) for n in sizes)
    assert "compressed" in packed.parts[2].what
    inference = engine.estimate_memory(two_linears(), config(tmp_path), training=False)
    assert [p.what for p in inference.parts] == ["parameter shards"] and inference.trainable == 0
    assert inference.at_rest == inference.during_step


def test_meta_models_tied_weights_and_a_large_one_cost_nothing_to_estimate(tmp_path):
    with torch.device("meta"):
        big = nn.Sequential(nn.Embedding(50_000, 4096), nn.Linear(4096, 50_000, bias=False))
    big[1].weight = big[0].weight  # tied: one parameter, counted once
    est = engine.estimate_memory(big, config(tmp_path, host_bytes=1 << 40))
    assert est.parameters == 50_000 * 4096
    assert est.parts[2].nbytes == 2 * page(4 * 50_000 * 4096)
    assert est.materialized_bytes == 4 * 50_000 * 4096 + 1 * MiB  # the largest module + the window


def test_the_plan_divides_host_bytes_as_documented(tmp_path):
    """docs/training.md's memory model, counted by hand for two_linears (fp32, computed on the CPU)."""
    cfg = config(tmp_path, grad_tier="nvme", optimizer_group_bytes=256 * KiB, step_in_backward=False).replace(
        host_budget="total")
    est = engine.estimate_memory(two_linears(), cfg)
    plan = est.plan
    shard = 4 * 300_000  # the largest fp32 shard, a group of its own; the other three make the second group
    staging = 4 * 64 * KiB  # staging_buffers=4 of 64 KiB blocks (a 64 MiB budget allows 32)
    params = 4 * 300_300 + 1 * MiB  # the largest module + the prefetch window
    ahead = 3 * shard  # master and moments of the first group, read during backward
    step = 4 * (shard + 4 * (300 + 2100 + 7))  # three groups (both) of gradient, master and two moments
    grads = shard + shard  # a shard being put + the whole gradient autograd makes (a view at world size 1)
    temps = min(2 * MATH_CHUNK_BYTES, 2 * shard)  # AdamW's two temporaries: two chunks of the largest shard
    assert [(p.what, p.nbytes) for p in plan.pieces] == [
        ("staging", staging), ("buffer pool", max(params + ahead, step)), ("transients", max(grads, temps))]
    assert plan.pool_bytes == plan.step_pool_bytes == params + ahead  # shared: one bound for both phases
    assert plan.host_tier_bytes == 64 * MiB - staging - params - ahead - grads  # the cache gets what is left
    assert est.host_rss_bound == plan.total_bytes == 64 * MiB
    assert plan.settings.prefetch_bytes == 1 * MiB and plan.settings.optimizer_prefetch_groups == 1  # as configured
    # At the floor: no state read ahead, 2 staging blocks, no prefetch window, by phase.
    assert est.minimum_host_bytes == 2 * 64 * KiB + max(4 * 300_300 + grads, step + temps)
    store = plan.store_config(cfg.store)
    assert (store.host_bytes, store.staging_buffers, store.result_pool_bytes) == (plan.host_tier_bytes, 4,
                                                                                  params + ahead)
    on_gpu = engine.estimate_memory(two_linears(), cfg.replace(compute_device="cuda"))
    assert on_gpu.plan.pool_bytes == max(ahead, step)  # parameters and gradients are GPU memory there
    tier = engine.estimate_memory(two_linears(), cfg.replace(host_budget="host_tier"))
    assert tier.plan.host_tier_bytes == 64 * MiB and tier.host_rss_bound == 64 * MiB + staging + max(
        params + ahead, step) + max(grads, temps)  # the pieces come on top; result_pool_bytes=0 waits nothing


def test_a_smaller_budget_shrinks_the_pieces_in_order_down_to_the_minimum(tmp_path):
    model = two_linears()
    base = config(tmp_path, grad_tier="nvme", optimizer_group_bytes=256 * KiB, step_in_backward=False).replace(
        host_budget="total")
    minimum = engine.estimate_memory(model, base).minimum_host_bytes
    chosen = []
    for budget in (64 * MiB, 9 * MiB, 8 * MiB, minimum):
        plan = engine.estimate_memory(model, base.replace(store=base.store.replace(host_bytes=budget))).plan
        assert plan.fits and plan.total_bytes == budget and plan.minimum_bytes == minimum
        chosen.append(dataclasses.astuple(plan.settings)[:4])  # staging, window, group, groups read ahead
    assert chosen[0] == (4, MiB, 256 * KiB, 1)  # the config's own sizes
    assert all(all(a >= b for a, b in zip(bigger, smaller)) for bigger, smaller in zip(chosen, chosen[1:]))
    assert chosen[2][3] == 0 and chosen[2][1] == MiB  # the state read ahead goes before the prefetch window
    assert chosen[3][0] == 2  # staging is down to two blocks at the minimum
    below = engine.estimate_memory(model, base.replace(store=base.store.replace(host_bytes=minimum - 1)))
    assert not below.fits and not below.plan.fits
    assert f"minimum this model needs under this config, {minimum}" in below.problems[0]
    assert "the optimizer step" in below.problems[0] and "'0.weight'" in below.problems[0]


@pytest.mark.parametrize("inside", [False, None])
def test_wrap_refuses_a_budget_below_the_minimum_before_anything_is_written_and_trains_at_it(tmp_path, inside):
    """In bf16 the step's buffers outweigh forward's and backward's gradients outweigh the step's
    temporaries, so at the minimum the working set is bounded phase by phase; with updates inside
    backward (the default's later steps) too."""
    model = two_linears()
    cfg = config(tmp_path, grad_tier="nvme", optimizer_group_bytes=256 * KiB, train_dtype="bfloat16",
                 step_in_backward=inside).replace(host_budget="total")
    minimum = engine.estimate_memory(model, cfg).minimum_host_bytes
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(engine.MemoryBudgetError, match=f"at least {minimum}") as refused:
        engine.wrap(model, config=cfg.replace(store=cfg.store.replace(host_bytes=minimum - 4096)),
                    optimizer=engine.AdamW(lr=1e-3))
    assert isinstance(refused.value, ValueError)
    assert not os.path.exists(cfg.store.path)  # refused before the store was opened
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    # At the minimum it trains, the working set bounded phase by phase.
    eng = engine.wrap(model, config=cfg.replace(store=cfg.store.replace(host_bytes=minimum)),
                      optimizer=engine.AdamW(lr=1e-3))
    assert eng.memory_plan.settings.by_phase or inside is None  # (inside backward: the larger of the two ways)
    assert eng.store.config.host_bytes == eng.memory_plan.host_tier_bytes
    x = torch.randn(4, 1000, dtype=torch.bfloat16)
    losses = []
    for _ in range(3):
        loss = model(x)[:, 0].float().mean()  # LayerNorm's output: its first feature can fall
        loss.backward()
        eng.step()
        eng.zero_grad()
        losses.append(loss.item())
        assert eng.store.stats().pool_lent_bytes + eng.store.stats().pool_waiting_bytes <= eng.memory_plan.pool_bytes
    assert losses[-1] < losses[0]
    eng.close()


def test_a_shard_larger_than_its_tier_is_refused_by_wrap_before_anything_is_written(tmp_path):
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 4))  # a 1 MiB fp32 gradient shard
    cfg = config(tmp_path, host_bytes=512 * KiB)
    # A gradient shard larger than the whole host tier goes to nvme instead: no problem, and it trains.
    assert engine.estimate_memory(model, cfg).fits
    with engine.wrap(model, config=cfg.replace(step_in_backward=False), optimizer=engine.AdamW(lr=1e-3)) as eng:
        model(torch.randn(2, 512)).sum().backward()
        eng._training.grads.flush()  # the puts are in flight until then
        large, small = (eng.store.info(f"grad/{i}.weight").tiers for i in (0, 1))
        assert large == (tiered.Tier.NVME,) and tiered.Tier.HOST in small  # the large one on nvme
        eng.step()
    # The same check covers optimizer state and parameter shards in the host tier.
    for field in ("optimizer_tier", "param_tier"):
        with pytest.raises(ValueError, match=f"{field}='host'"):
            engine.wrap(model, config=cfg.replace(grad_tier="nvme", **{field: "host"}),
                        optimizer=engine.AdamW(lr=1e-3))
    with pytest.raises(ValueError, match="world_size"):
        engine.estimate_memory(model, cfg, world_size=0)
    with pytest.raises(TypeError, match="nn.Module"):
        engine.estimate_memory("model", cfg)  # type: ignore[arg-type]


def test_the_estimate_matches_what_a_training_run_keeps_on_nvme(tmp_path):
    from engine.demo import GPT, GPTConfig

    gpt = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_embd=64, n_head=2)
    for kw in ({}, {"train_dtype": "bfloat16"}):
        path = tmp_path / str(len(kw))
        with torch.device("meta"):
            model = GPT(gpt)
        cfg = engine.EngineConfig(host_budget="host_tier", store=store_config(path, host_bytes=1 * MiB),
                                  grad_tier="nvme", **kw)
        est = engine.estimate_memory(model, cfg)
        eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-3), config=cfg)
        x = torch.randint(0, 128, (2, 16))
        for _ in range(2):
            model(x, x).backward()
            eng.step()
            eng.zero_grad()
        held = eng.store.nvme_space().entry_bytes
        eng.close()
        # After a step the gradients are gone: parameters and one slot of state remain, plus the
        # engine's step record.
        params, grads, state = est.parts
        assert params.nbytes + state.nbytes <= held <= params.nbytes + state.nbytes + 2 * 4096, (held, est)
        assert held <= est.at_rest.nvme <= est.during_step.nvme


def run_cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    return estimate_main(list(args), out=out), out.getvalue()


DEMO = ("--demo", "--layers", "2", "--embd", "64", "--heads", "2", "--vocab", "128", "--seq", "16")


def test_cli_prints_the_table_and_says_whether_it_fits(tmp_path):
    code, text = run_cli(*DEMO, "--dir", str(tmp_path / "new" / "dir"))
    assert code == 0, text
    assert "parameter shards" in text and "held in the nvme tier" in text and "host RSS bound" in text
    assert f"disk under {tmp_path}" in text and text.rstrip().endswith("fits: yes")
    code, text = run_cli(*DEMO, "--dir", str(tmp_path), "--host-mib", "0", "--param-tier", "host")
    assert code == 1 and "PROBLEM: EngineConfig.param_tier is 'host'" in text and "fits: no" in text
    code, text = run_cli(*DEMO, "--dir", str(tmp_path), "--json", "--world-size", "2", "--inference")
    got = json.loads(text)
    assert code == 0 and got["fits"] and got["world_size"] == 2 and len(got["parts"]) == 1
    assert got["at_rest"]["nvme"] == got["parts"][0]["nbytes"] and got["disk"]["free"] > 0


def test_cli_prints_the_minimum_host_bytes_wrap_would_ask_for(tmp_path):
    code, text = run_cli(*DEMO, "--dir", str(tmp_path), "--host-mib", "1", "--json")
    got = json.loads(text)
    assert code == 1 and not got["fits"] and got["minimum_host_bytes"] > 1 << 20
    from engine.demo import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_embd=64, n_head=2))
    cfg = engine.EngineConfig(store=cli_store(tmp_path, 1 << 20), compute_device="cpu")
    with pytest.raises(engine.MemoryBudgetError, match=f"at least {got['minimum_host_bytes']}"):
        engine.wrap(model, config=cfg, optimizer=engine.AdamW(lr=1e-3))
    code, text = run_cli(*DEMO, "--dir", str(tmp_path), "--host-mib", "1")
    assert f"minimum {got['minimum_host_bytes'] / (1 << 20):.1f} MiB ({got['minimum_host_bytes']} bytes)" in text
    assert "PROBLEM: StoreConfig.host_bytes=1048576" in text and "fits: no" in text


def cli_store(tmp_path, host_bytes: int):
    """The store ``tiered estimate --dir`` describes: StoreConfig's defaults but the path and budget."""
    import tiered

    return tiered.StoreConfig(path=os.path.abspath(tmp_path), host_bytes=host_bytes)


def test_cli_reads_a_hugging_face_config_and_a_deepspeed_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32)
    hf.save_pretrained(tmp_path / "gpt2")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"},
                                                    "offload_optimizer": {"device": "cpu"}}}))
    for source in (str(tmp_path / "gpt2"), str(tmp_path / "gpt2" / "config.json")):
        code, text = run_cli("--hf-config", source, "--ds-config", str(ds), "--dir", str(tmp_path), "--json")
        got = json.loads(text)
        params = transformers.GPT2LMHeadModel(hf).num_parameters()
        assert code == 0 and got["parameters"] == params
        assert [p["tier"] for p in got["parts"]] == ["nvme", "host", "host"]  # offload_optimizer: cpu


def test_cli_gives_a_deepspeed_config_the_budgets_engine_initialize_gives_it(tmp_path, monkeypatch):
    """With --ds-config and no budget flags, the device and host tiers get what engine.initialize's
    own store gives them: offload_optimizer "cpu" keeps all the optimizer state in host memory, past
    the 1 GiB default, and offload_param "none" keeps the parameters on the device."""
    import engine.integrations.deepspeed.store as deepspeed_store

    monkeypatch.setattr(deepspeed_store, "memory_sizes", lambda: (64 << 30, 32 << 30))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
                                                    "offload_optimizer": {"device": "cpu"}}}))
    big = ("--demo", "--layers", "8", "--embd", "1024", "--heads", "8", "--vocab", "1024", "--seq", "16")
    code, text = run_cli(*big, "--ds-config", str(ds), "--dir", str(tmp_path), "--json")
    got = json.loads(text)
    params, grads, states = got["parts"]
    assert (params["tier"], grads["tier"], states["tier"]) == ("device", "host", "host")
    assert grads["nbytes"] + states["nbytes"] > 1 << 30  # more than the host tier's default budget
    assert got["during_step"] == {"device": params["nbytes"], "host": grads["nbytes"] + states["nbytes"],
                                  "nvme": 0}  # nothing spilled (state in host memory is updated in place)
    code, text = run_cli(*big, "--ds-config", str(ds), "--dir", str(tmp_path), "--json", "--host-mib", "64")
    got = json.loads(text)
    assert got["plan"]["budget"] == 64 << 20  # a flag's budget stands: the whole of it, pieces and host tier
    assert got["during_step"]["host"] == got["plan"]["host_tier_bytes"] < 64 << 20


@pytest.mark.parametrize("args, message", [
    (("--demo", "--world-size", "0"), "--world-size must be >= 1"),
    (("--demo", "--device", "banana"), "is not a device"),
    (("--hf-config", "/nonexistent/config.json"), "does not exist"),
    (("--demo", "--hf-config", "x"), "not allowed with"),
    ((), "one of the arguments"),
])
def test_cli_refuses_bad_input_with_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        estimate_main(list(args))
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_tiered_command_lists_estimate(capsys):
    from engine.cli import main

    from tiered.cli import COMMANDS

    assert main(["--help"]) == 0 and "estimate" in capsys.readouterr().out
    assert "estimate" not in COMMANDS  # the engine adds it: the store never imports the engine


def test_updates_inside_backward_keep_the_old_parameters_during_a_step(tmp_path):
    after = engine.estimate_memory(two_linears(), config(tmp_path, step_in_backward=False))
    inside = engine.estimate_memory(two_linears(), config(tmp_path, step_in_backward=True))
    clipped = engine.estimate_memory(two_linears(), config(tmp_path, step_in_backward=True, max_grad_norm=1.0))
    grads = after.parts[1].nbytes
    assert [p.what for p in inside.parts] == [after.parts[0].what, after.parts[2].what]  # no gradient is stored
    assert inside.at_rest.nvme == after.at_rest.nvme and inside.at_rest.host == 0 < after.at_rest.host
    # after backward: the gradients made durable and one group in flight; inside: every entry an update
    # replaces kept until the step commits (as many bytes again) and one batch in flight; with clipping
    # the gradients kept for a redo too
    assert after.during_step.nvme == after.at_rest.nvme + grads + 3 * grads
    assert inside.during_step.nvme == 2 * inside.at_rest.nvme + 3 * grads
    assert clipped.during_step.nvme == inside.during_step.nvme + grads
    assert "updates inside backward from the first step" in inside.render()
    assert "the step after backward (EngineConfig.step_in_backward=False)" in after.render()
    # backward holds the step's working set: the batches being updated and the moments read ahead
    assert any("the updates' moments and parameters" in p.why for p in inside.plan.pieces)
    assert not any("the updates' moments" in p.why for p in after.plan.pieces)


def test_updates_inside_backward_count_the_two_largest_shards_at_the_two_ends_once(tmp_path):
    from engine.paging.memory_plan import plan_memory

    def model(head_out: int) -> nn.Module:  # an embedding, 3 MiB of small layers, a head
        return nn.Sequential(nn.Embedding(4096, 256), *[nn.Linear(256, 256) for _ in range(12)],
                             nn.Linear(256, head_out, bias=False))

    largest = 4096 * 256 * 4  # 4 MiB: the embedding, and the head of the first model
    cfg = engine.EngineConfig(store=store_config(tmp_path, host_bytes=64 * MiB), param_tier="nvme",
                              optimizer_tier="nvme", step_in_backward=True)
    both, one = plan_memory(model(4096), cfg), plan_memory(model(64), cfg)
    # the head is updated at backward's start and the embedding at its end: at most one of them is in
    # flight (parameter, gradient, two moments) beside the small layers' batches and the module in use
    assert both.minimum_bytes == one.minimum_bytes
    # the module in use and one large shard in flight (4 x: parameter, gradient, two moments), beside
    # batches of 1 MiB and the gradient autograd makes: under 8 x
    (work,) = [p.nbytes for p in both.minimum_pieces if p.what == "working set"]
    assert work < 8 * largest


def test_gradients_that_overflow_the_host_tier_point_to_updates_inside_backward(tmp_path):
    model = two_linears()  # about 1.2 MiB of fp32 gradients
    small = config(tmp_path, host_bytes=256 * KiB, param_tier="nvme", optimizer_tier="nvme", step_in_backward=False)
    (hint,) = [w for w in engine.estimate_memory(model, small).warnings if "step_in_backward" in w]
    assert "do not fit in the host tier (256.0 KiB)" in hint and "left at None (the default)" in hint
    for quiet in (small.replace(step_in_backward=None), small.replace(step_in_backward=True),
                  small.replace(max_grad_norm=1.0),
                  config(tmp_path, param_tier="nvme", optimizer_tier="nvme", step_in_backward=False)):  # 64 MiB: fit
        assert not any("step_in_backward" in w for w in engine.estimate_memory(model, quiet).warnings)


def test_the_codec_verdict_weighs_the_codec_against_the_disk(tmp_path):
    from engine.cli.codec_verdict import CodecVerdict, measure_codec_verdict

    gb = 1e9
    slow_disk = CodecVerdict(encode_bps=4 * gb, decode_bps=8 * gb, ratio=0.5, write_bps=0.2 * gb, read_bps=0.4 * gb,
                             threads=2, moment_bytes=8 * 10**9)
    fast_disk = dataclasses.replace(slow_disk, write_bps=4 * gb, read_bps=4 * gb)
    assert slow_disk.pays and "pays here" in slow_disk.render()
    assert not fast_disk.pays and "leave it off" in fast_disk.render()
    assert slow_disk.raw_seconds == pytest.approx(8 * (1 / 0.2 + 1 / 0.4))
    assert slow_disk.compressed_seconds == pytest.approx(8 / 4 + 8 / 8 + 0.5 * slow_disk.raw_seconds)

    store = tiered.StoreConfig(path=str(tmp_path))
    measured = measure_codec_verdict(str(tmp_path), 1 << 30, store, sample_bytes=1 << 20, disk_bytes=1 << 20,
                                     repeats=1)
    assert 0 < measured.ratio < 1 and measured.encode_bps > 0 and measured.read_bps > 0  # moments compress
    assert list(tmp_path.iterdir()) == []  # the scratch directory is gone
    with pytest.raises(ValueError, match="repeats"):
        measure_codec_verdict(str(tmp_path), 1, store, repeats=0)
