"""The engine as the beyond-memory benchmark's contender, in a process of its own
(``contender_process.run_contender``): everything on nvme, ``engine.AdamW``, trained on one fixed
batch; each step measured, with which way its optimizer step ran and whether the clip norm bound.

Run by ``beyond_memory.py``; ``python benchmarks/beyond_memory_engine.py --spec FILE --out FILE``."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional

import torch
from bench_output import synchronize
from contender_process import child_main
from process_stats import Sampler, StepMeter, rss_bytes

from engine.demo.llama import Llama, LlamaConfig, init_weights

GiB = 1 << 30
#: How an optimizer step ran: its updates inside backward, committed by eng.step(); inside backward,
#: then rolled back and redone after backward (the clip norm bound, ...); or after backward.
INSIDE, REDONE, AFTER = "inside backward", "inside, redone after backward", "after backward"
#: --step-in-backward's words for EngineConfig.step_in_backward.
STEP_IN_BACKWARD = {"auto": None, "true": True, "false": False}


def engine_config(spec: dict[str, Any], workdir: str) -> Any:
    """The run's EngineConfig: everything on nvme under ``workdir``, ``host_gib`` of host budget, and
    the spec's dtype, clip norm and step mode."""
    import engine
    import tiered

    return engine.EngineConfig(
        store=tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=int(spec["host_gib"] * GiB)),
        param_tier="nvme", optimizer_tier="nvme", compress_optimizer=spec["compress_optimizer"],
        step_in_backward=STEP_IN_BACKWARD[spec["step_in_backward"]], compute_device=spec["device"],
        train_dtype=None if spec["dtype"] == "float32" else spec["dtype"], max_grad_norm=spec["max_grad_norm"])


def estimate(cfg: LlamaConfig, spec: dict[str, Any], workdir: str) -> Any:
    """``engine.estimate_memory`` of the run: what the store needs on disk during a step
    (``.during_step.nvme``), the least host budget the model takes (``.minimum_host_bytes``)."""
    import engine

    with torch.device("meta"):
        model = Llama(cfg)
    return engine.estimate_memory(model, engine_config(spec, workdir))


def warm_up(device: torch.device) -> None:
    """A tiny plain training step, so torch's kernels and thread pools are in the RSS before wrap
    (as they were when the benchmark ran in one process)."""
    warm = Llama(LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4)).to(device)
    opt = torch.optim.AdamW(warm.parameters())
    tokens = torch.randint(0, 64, (1, 9), device=device)
    for _ in range(2):
        warm(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()


def run(spec: dict[str, Any], report: Callable[[dict[str, Any]], None]) -> None:
    """Wrap the model on nvme and train ``spec["steps"]`` steps on one batch, reporting after each."""
    import engine

    device = torch.device(spec["device"])
    cfg = LlamaConfig(**spec["config"])
    warm_up(device)
    torch.manual_seed(spec["seed"])
    tokens = torch.randint(0, cfg.vocab_size, (1, spec["tokens"] + 1)).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.device("meta"):
        model = Llama(cfg)
    workdir = spec["workdir"]
    config = engine_config(spec, workdir)
    out: dict[str, Any] = {"rss_before_wrap": rss_bytes(), "steps": [], "phase": "engine.wrap"}
    report(out)
    with Sampler(workdir) as sampler:
        started = time.perf_counter()
        eng = engine.wrap(model, optimizer=engine.AdamW(lr=spec["lr"], weight_decay=0.0,
                                                        fused=spec["fused"] or None),
                          config=config, init_fn=init_weights)
        out["wrap_seconds"] = time.perf_counter() - started
        out["step_mode_at_wrap"] = eng.step_mode
        sampler.mark()
        meter = StepMeter(sampler)
        try:
            for step in range(spec["steps"]):
                out["phase"] = f"step {step}"
                report(out)
                r = one_step(eng, model, x, y, meter, spec["max_grad_norm"])
                r["peak_rss_growth"] = r["peak_rss"] - out["rss_before_wrap"]
                out["steps"].append(r)
                print_step(step, r, cfg.num_params)
                out["rss_series"] = [(round(t, 2), b) for t, b in sampler.series]
                report(out)
        finally:
            eng.close()
    out["phase"] = "done"
    report(out)


def one_step(eng: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, meter: StepMeter,
             max_grad_norm: Optional[float]) -> dict[str, Any]:
    """Forward, backward, eng.step(), zero_grad, timed and measured; how the optimizer step ran."""
    device = x.device
    training = eng._training  # the step counters by mode; the engine's public stats have no such split
    planned = eng.step_mode
    inside0, redone0 = training.counters.steps_inside, training.counters.steps_redone
    synchronize(device)
    before = eng.stats()
    meter.start()
    t0 = time.perf_counter()
    loss = model(x, y)
    synchronize(device)
    t1 = time.perf_counter()
    loss.backward()
    synchronize(device)
    t2 = time.perf_counter()
    eng.step()
    eng.zero_grad()
    synchronize(device)
    t3 = time.perf_counter()
    measured = meter.stop()
    stats = eng.stats()
    mode = (INSIDE if training.counters.steps_inside > inside0 else
            REDONE if training.counters.steps_redone > redone0 else AFTER)
    norm = eng.get_global_grad_norm()
    return {
        "loss": loss.item(), **measured, "forward_s": t1 - t0, "backward_s": t2 - t1, "step_s": t3 - t2,
        "mode": mode, "planned": planned, "grad_norm": norm,
        "clip_bound": None if max_grad_norm is None or norm is None else norm > max_grad_norm,
        "param_stall_s": stats.stall_seconds - before.stall_seconds,
        "optimizer_stall_s": stats.optimizer_stall_seconds - before.optimizer_stall_seconds,
        # where the CPU went: AdamW's math, and the store's checksums and staging copies (summed over
        # its I/O threads)
        "adamw_s": stats.optimizer_update_seconds - before.optimizer_update_seconds,
        "store_checksums_s": stats.store.checksum_seconds - before.store.checksum_seconds,
        "store_staging_s": stats.store.staging_seconds - before.store.staging_seconds,
        # the optimizer's own account of its bytes (logical tensor bytes through the store)
        "optimizer_bytes_read": stats.optimizer_bytes_read - before.optimizer_bytes_read,
        "optimizer_bytes_written": stats.optimizer_bytes_written - before.optimizer_bytes_written,
        "grad_bytes_offloaded": stats.grad_bytes_offloaded - before.grad_bytes_offloaded,
    }


def print_step(step: int, r: dict[str, Any], params: int) -> None:
    """Two lines: the step's figures, then where its time went."""
    norm = r["grad_norm"]
    clip = "" if r["clip_bound"] is None else ", clip bound" if r["clip_bound"] else ", clip not bound"
    print(f"engine step {step}: loss {r['loss']:.4f}, {r['seconds']:.1f} s (forward {r['forward_s']:.1f}, "
          f"backward {r['backward_s']:.1f}, step {r['step_s']:.1f}), {r['mode']}, grad norm "
          f"{'-' if norm is None else f'{norm:.4g}'}{clip}; read {r['bytes_read'] / 1e9:.2f} GB, written "
          f"{r['bytes_written'] / 1e9:.2f} GB ({(r['bytes_read'] + r['bytes_written']) / params:.1f} B/param, "
          f"{r['bytes_written'] / params:.1f} written), RSS +{r['peak_rss_growth'] / GiB:.2f} GiB, disk "
          f"{r['peak_disk_bytes'] / 1e9:.1f} GB", flush=True)
    print(f"  where: waiting for parameters {r['param_stall_s']:.1f} s and for the optimizer's I/O "
          f"{r['optimizer_stall_s']:.1f} s; AdamW {r['adamw_s']:.1f} s; the store's checksums "
          f"{r['store_checksums_s']:.1f} s and staging copies {r['store_staging_s']:.1f} s; CPU "
          f"{r['cpu_user_s']:.1f} s user + {r['cpu_system_s']:.1f} s system"
          + (f"; the disk busy {r['disk_busy_s']:.1f} s, {r['disk_queue']:.1f} requests in flight on average"
             if "disk_busy_s" in r else ""), flush=True)


if __name__ == "__main__":
    sys.exit(child_main(run))
