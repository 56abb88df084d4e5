"""DeepSpeed ZeRO-3 with ZeRO-Infinity's nvme offload as the beyond-memory benchmark's contender, in
a process of its own (``contender_process.run_contender``): the same Llama model, batch, learning
rate, dtype and clip norm as the engine's run, the parameters and the optimizer state on nvme in the
same directory's disk, one process (world size 1) on DeepSpeed's CPU accelerator with gloo (on a
GPU with ``--device cuda``).

Configured as DeepSpeed's docs advise for nvme offload (see :func:`deepspeed_config`): parameter
swap buffers as large as the largest parameter, the optimizer processed in sub-groups, the aio
block size and queue depth tuned on the disk (``--ds-*`` options of beyond_memory.py; their
defaults are the best found, benchmarks/README.md says what was tried). ``max_in_cpu`` keeps up to
that many parameter elements in CPU memory, off nvme (DeepSpeed's default, 1e9, was the faster
setting; 0 puts every parameter on nvme, as the engine's are).
The model is built under ``deepspeed.zero.Init(remote_device="nvme")``, so it never exists whole
in memory, then given the engine's initial values (the same seed, the same modules in the same
order), so the first losses compare.

Run by ``beyond_memory.py``; ``python benchmarks/beyond_memory_deepspeed.py --spec FILE --out FILE``."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from typing import Any, Callable

import torch
from bench_output import synchronize
from contender_process import child_main
from process_stats import Sampler, StepMeter, rss_bytes

from engine.demo.llama import Llama, LlamaConfig, init_weights

GiB = 1 << 30


def deepspeed_config(spec: dict[str, Any], cfg: LlamaConfig, nvme_path: str) -> dict[str, Any]:
    """The DeepSpeed config of the run. ``spec["deepspeed"]`` holds the tuned settings:
    ``sub_group_size`` (elements of optimizer state swapped and updated at a time), ``buffer_count``
    (parameter swap buffers), ``max_in_cpu`` (parameter elements kept in memory), ``block_size`` /
    ``queue_depth`` / ``intra_op_parallelism`` (its aio handle), ``pipeline`` (overlap the
    optimizer's swap reads and writes with its math) and ``optimizer_buffer_count`` (the optimizer's
    swap buffers: at least 4, a master, a gradient and two moments; more to pipeline)."""
    ds = spec["deepspeed"]
    largest = max(cfg.vocab_size * cfg.dim, cfg.dim * cfg.ffn_dim)
    # a parameter swap buffer must hold the largest parameter (the embedding or the head)
    buffer_size = -(-largest // (1 << 20)) * (1 << 20)
    pin = spec["device"].startswith("cuda")  # nothing to pin for a CPU accelerator
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "gradient_clipping": spec["max_grad_norm"] or 0.0,
        "bf16": {"enabled": spec["dtype"] == "bfloat16"},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": ds["sub_group_size"],
            # the bucket sizes Hugging Face's integration derives from the width ("auto"): DeepSpeed's
            # defaults (5e8 elements for reduce_bucket_size) take GBs of buffers
            "reduce_bucket_size": cfg.dim * cfg.dim,
            "stage3_prefetch_bucket_size": int(0.9 * cfg.dim * cfg.dim),
            "stage3_param_persistence_threshold": 10 * cfg.dim,
            # release each parameter after its use: a swap buffer per live parameter, which the
            # default (1e9 elements) would keep past the buffer_count and fail ("Not enough buffers")
            "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": ds["buffer_count"] * buffer_size,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin,
                              "buffer_count": ds["buffer_count"], "buffer_size": buffer_size,
                              "max_in_cpu": ds["max_in_cpu"]},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin,
                                  "buffer_count": ds["optimizer_buffer_count"],
                                  "pipeline_read": ds["pipeline"], "pipeline_write": ds["pipeline"]},
        },
        "aio": {"block_size": ds["block_size"], "queue_depth": ds["queue_depth"],
                "intra_op_parallelism": ds["intra_op_parallelism"], "single_submit": False, "overlap_events": True},
    }


def needed_disk_bytes(cfg: LlamaConfig, dtype: str) -> int:
    """About what DeepSpeed's swap files take: the parameters (2 or 4 bytes), fp32 masters, moments and
    gradients (16), and a tenth more for alignment and sub-group files."""
    return int(cfg.num_params * ((2 if dtype == "bfloat16" else 4) + 16) * 1.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_port() -> int:
    """A port for a DeepSpeed process's rendezvous (the spec's ``port``); :func:`remove_shared_buffers`
    takes it once the process has ended."""
    return _free_port()


def remove_shared_buffers(port: int) -> None:
    """Delete the shared-memory all-reduce buffers DeepSpeed's CPU accelerator left in /dev/shm for the
    process that used ``port`` (it does not remove them itself, even on a clean exit: gigabytes of RAM)."""
    import glob

    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def init_distributed(device: str, port: int) -> None:
    """One process, world size 1: gloo on the CPU accelerator, nccl on a GPU; rendezvous on ``port``."""
    import deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_SIZE="1")
    deepspeed.init_distributed(dist_backend="nccl" if device.startswith("cuda") else "gloo")


def load_ops() -> float:
    """Build (the first time: minutes) or load DeepSpeed's CPU Adam and aio ops; the seconds taken."""
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    started = time.perf_counter()
    CPUAdamBuilder().load()
    AsyncIOBuilder().load()
    return time.perf_counter() - started


def build_model(cfg: LlamaConfig, config: dict[str, Any]) -> torch.nn.Module:
    """The model under ``zero.Init`` (each module's parameters go to nvme as it is built, in the
    config's dtype), then given the values engine.wrap gives it: ``init_weights`` on each module in
    pre-order, from the random state the engine starts from."""
    import deepspeed

    state = torch.get_rng_state()
    # no dtype= here: zero.Init 0.19.8 turns an explicit torch.float32 into bfloat16 on an accelerator
    # without fp16 (an operator-precedence slip in Init._set_dtype); the config's dtype is taken as given
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device="nvme"):
        model = Llama(cfg)
    torch.set_rng_state(state)  # construction drew numbers the engine's placement does not
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own:
            with deepspeed.zero.GatheredParameters(own, modifier_rank=0), torch.no_grad():
                init_weights(module)
    return model


def run(spec: dict[str, Any], report: Callable[[dict[str, Any]], None]) -> None:
    """Build, initialize and train ``spec["steps"]`` steps on one batch, reporting after each."""
    if not spec["device"].startswith("cuda"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    cfg = LlamaConfig(**spec["config"])
    nvme = os.path.join(spec["workdir"], "nvme")
    os.makedirs(nvme, exist_ok=True)
    config = deepspeed_config(spec, cfg, nvme)
    out: dict[str, Any] = {"deepspeed_version": deepspeed.__version__, "config": config, "steps": [],
                           "phase": "loading its ops"}
    report(out)
    out["ops_load_seconds"] = load_ops()
    init_distributed(spec["device"], spec["port"])
    torch.manual_seed(spec["seed"])
    tokens = torch.randint(0, cfg.vocab_size, (1, spec["tokens"] + 1))
    out["rss_before_wrap"] = rss_bytes()
    with Sampler(spec["workdir"]) as sampler:
        started = time.perf_counter()
        report({**out, "phase": "building the model under zero.Init"})
        model = build_model(cfg, config)
        report({**out, "phase": "deepspeed.initialize"})
        ds, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        out["wrap_seconds"] = time.perf_counter() - started
        x, y = (t.to(ds.device) for t in (tokens[:, :-1], tokens[:, 1:]))
        sampler.mark()
        meter = StepMeter(sampler)
        for step in range(spec["steps"]):
            out["phase"] = f"step {step}"
            report(out)
            synchronize(x.device)
            meter.start()
            t0 = time.perf_counter()
            loss = ds(x, y)
            synchronize(x.device)
            t1 = time.perf_counter()
            ds.backward(loss)
            synchronize(x.device)
            t2 = time.perf_counter()
            ds.step()
            synchronize(x.device)
            t3 = time.perf_counter()
            r = {"loss": loss.item(), **meter.stop(), "forward_s": t1 - t0, "backward_s": t2 - t1, "step_s": t3 - t2}
            norm = ds.get_global_grad_norm()
            r["grad_norm"] = None if norm is None else float(norm)
            r["peak_rss_growth"] = r["peak_rss"] - out["rss_before_wrap"]
            out["steps"].append(r)
            print_step(step, r, cfg.num_params)
            out["rss_series"] = [(round(t, 2), b) for t, b in sampler.series]
        out["phase"] = "done"
        report(out)
        ds.destroy()


def print_step(step: int, r: dict[str, Any], params: int) -> None:
    norm = r["grad_norm"]
    moved = (r["bytes_read"] + r["bytes_written"]) / params
    print(f"deepspeed step {step}: loss {r['loss']:.4f}, {r['seconds']:.1f} s (forward {r['forward_s']:.1f}, "
          f"backward {r['backward_s']:.1f}, step {r['step_s']:.1f}), grad norm "
          f"{'-' if norm is None else f'{norm:.4g}'}; read {r['bytes_read'] / 1e9:.2f} GB, written "
          f"{r['bytes_written'] / 1e9:.2f} GB ({moved:.1f} B/param, {r['bytes_written'] / params:.1f} written), "
          f"RSS {r['peak_rss'] / GiB:.2f} GiB, disk {r['peak_disk_bytes'] / 1e9:.1f} GB; CPU {r['cpu_user_s']:.1f} s "
          f"user + {r['cpu_system_s']:.1f} s system", flush=True)


if __name__ == "__main__":
    sys.exit(child_main(run))
