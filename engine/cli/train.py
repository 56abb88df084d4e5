"""``tiered train``: train a model whose parameters, gradients and optimizer states do not fit the
configured device + host budgets, with the rest in NVMe swap files.

``--demo`` trains a small GPT on a synthetic bigram language in seconds. ``--beyond-memory`` trains
the model of ``benchmarks/beyond_memory.py``: a Llama-style decoder sized from the machine's RAM so
that its fp32 training state is 1.5x the RAM (``--state-gib`` to choose), with a 2 GiB host budget,
after checking that the disk under ``--dir`` has room for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING, NoReturn, Optional, Sequence, TextIO

import torch

from engine.cli.demo_budgets import DEMO_HOST_MIB, size_budgets

if TYPE_CHECKING:
    from engine import EngineConfig
    from engine.cli.demo_directory import DemoDirectory
    from engine.demo import GPTConfig
    from engine.demo.llama import LlamaConfig

MiB = 1024 * 1024
GiB = 1024 * MiB
#: Training state / RAM that ``--beyond-memory`` sizes its model for, unless ``--state-gib`` is given.
BEYOND_MEMORY_RAM_MULTIPLE = 1.5
#: ``--beyond-memory``'s defaults where the option is not given: few steps of a large model, a real budget.
BEYOND_MEMORY_DEFAULTS = {"steps": 3, "batch": 1, "seq": 32, "lr": 1e-4}
BEYOND_MEMORY_HOST_MIB = 2048
#: ``--demo``'s defaults where the option is not given (its host budget: engine/cli/demo_budgets.py).
DEMO_DEFAULTS = {"steps": 30, "batch": 8, "seq": 128, "lr": 1e-3}


@dataclasses.dataclass(frozen=True)
class StepLine:
    """What the progress line shows after a step."""

    step: int
    steps: int
    loss: float
    tokens_per_s: float
    bytes_moved: int
    stall_fraction: float

    def render(self) -> str:
        """The line as the demo prints it."""
        width = 24
        filled = width * self.step // self.steps
        return (f"step {self.step:>4}/{self.steps} [{'#' * filled}{'.' * (width - filled)}] loss {self.loss:7.4f} "
                f"| {self.tokens_per_s:8,.0f} tok/s | moved {_gb(self.bytes_moved)} "
                f"| stall {100 * self.stall_fraction:4.1f}%")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``tiered train``."""
    p = argparse.ArgumentParser(
        prog="tiered train",
        description="Train a GPT-style model with its parameters, gradients and AdamW states paged through a "
        "tiered store: budgets for device and host memory, everything else in swap files under --dir.",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--demo", action="store_true", help="the built-in demo: a GPT on a synthetic bigram language "
                       "(the model sizes below default to the demo's)")
    which.add_argument("--beyond-memory", action="store_true", help="a Llama-style model whose fp32 training state "
                       f"is {BEYOND_MEMORY_RAM_MULTIPLE}x this machine's RAM (--state-gib to choose), everything on "
                       "nvme with a 2 GiB host budget, 3 steps of 32 tokens unless given; needs about 1.1x the "
                       "state free under --dir (checked first)")
    p.add_argument("--state-gib", type=float, default=None, help="--beyond-memory: size the model for this much "
                   "fp32 training state (parameters, gradients, two AdamW moments) instead")
    p.add_argument("--dir", default="tiered-demo", help="directory for the swap files and manifest (default: "
                   "./tiered-demo); use a directory on your NVMe disk")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 30; 3 with --beyond-memory)")
    add_demo_size_arguments(p, seq_help="sequence length (default 128; 32 with --beyond-memory)")
    p.add_argument("--batch", type=int, default=None, help="sequences per micro-batch (default 8; 1 with "
                   "--beyond-memory)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (gradient "
                   "accumulation, counted by the engine as DeepSpeed counts it; default 1)")
    p.add_argument("--lr", type=float, default=None, help="AdamW's learning rate (default 1e-3; 1e-4 with "
                   "--beyond-memory)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's decoupled weight decay (default "
                   "%(default)s)")
    p.add_argument("--host-mib", type=int, default=None, help="host memory budget of the engine and its store "
                   f"(MiB; default {DEMO_HOST_MIB}, {BEYOND_MEMORY_HOST_MIB} with --beyond-memory, or more where the "
                   "options chosen need it)")
    p.add_argument("--device-mib", type=int, default=None, help="device memory budget of the store (MiB; default 0, "
                   "or, with --param-tier device, what the parameters take)")
    p.add_argument("--prefetch-mib", type=int, default=32, help="parameter bytes fetched ahead of use (MiB; "
                   "default %(default)s)")
    p.add_argument("--param-tier", choices=("device", "host", "nvme"), default="nvme", help="where the parameters "
                   "rest between uses: the device tier (memory of --device), the host tier, or nvme swap files "
                   "(default %(default)s)")
    p.add_argument("--optimizer-tier", choices=("host", "nvme"), default="nvme", help="where AdamW's moments "
                   "(and master weights) rest between steps (default %(default)s)")
    p.add_argument("--compress-optimizer", action="store_true", help="store master weights and Adam moments "
                   "with lossless byte-plane zstd")
    p.add_argument("--step-in-backward", action="store_true", help="apply each AdamW update inside backward from "
                   "the first step (by default from the second, where --param-tier and --optimizer-tier are nvme; "
                   "docs/training.md, 'Updates inside backward')")
    p.add_argument("--activation-tier", choices=("host", "nvme"), default=None,
                   help="move the tensors saved for backward to this tier of the store during forward "
                        "(default: keep them in memory; docs/training.md, 'Activations in the store')")
    p.add_argument("--device", default=None, help="where forward and backward run: 'cpu', 'cuda', 'cuda:1' "
                   "(default: cuda when available, else cpu); the store's device tier lives there too")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initialization and of the data "
                   "(default %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the store directory afterwards (see `tiered inspect`)")
    return p


#: The demo GPT's size options, shared with ``tiered estimate --demo`` so both mean the same model.
DEMO_SIZE_OPTIONS = ("layers", "embd", "heads", "vocab", "seq")


def add_demo_size_arguments(p: argparse.ArgumentParser, *, seq_help: str = "sequence length (default 128)") -> None:
    """``--layers``, ``--embd``, ``--heads``, ``--vocab`` and ``--seq``, defaulting to the demo's GPT
    (``seq_help`` says what ``--seq`` defaults to in this command)."""
    p.add_argument("--layers", type=int, default=6, help="demo GPT: transformer blocks (default %(default)s)")
    p.add_argument("--embd", type=int, default=384, help="demo GPT: width (default %(default)s)")
    p.add_argument("--heads", type=int, default=6, help="demo GPT: attention heads (default %(default)s)")
    p.add_argument("--vocab", type=int, default=512, help="demo GPT: vocabulary (default %(default)s)")
    p.add_argument("--seq", type=int, default=None, help=seq_help)


def demo_config(args: argparse.Namespace) -> GPTConfig:
    """The demo GPT's configuration from the options :func:`add_demo_size_arguments` added."""
    from engine.demo import GPTConfig

    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq if args.seq is not None else 128, n_layer=args.layers,
                     n_embd=args.embd, n_head=args.heads)


def beyond_memory_config(args: argparse.Namespace) -> LlamaConfig:
    """``--beyond-memory``'s model: a Llama-style decoder whose fp32 training state is ``--state-gib``,
    or 1.5x this machine's RAM."""
    from engine.demo.llama import LlamaConfig

    state = args.state_gib * GiB if args.state_gib is not None else BEYOND_MEMORY_RAM_MULTIPLE * _ram_bytes()
    return LlamaConfig.for_state_bytes(int(state))


def _ram_bytes() -> int:
    """This machine's memory (MemTotal), or the physical pages sysconf reports."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main(argv: Optional[Sequence[str]] = None, *, out: TextIO = sys.stdout) -> int:
    """Run ``tiered train``; return the exit status. A usage error is one line on stderr and
    SystemExit(2), before anything is written."""
    from engine.cli.demo_directory import DemoDirectory

    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.demo or args.beyond_memory):
        _usage("choose the model: `tiered train --demo` (a small GPT, seconds) or `tiered train --beyond-memory` "
               "(a model larger than this machine's memory)")
    defaults = BEYOND_MEMORY_DEFAULTS if args.beyond_memory else DEMO_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.state_gib is not None and not (args.beyond_memory and args.state_gib > 0):
        _usage(f"--state-gib sizes --beyond-memory's model and must be > 0, got {args.state_gib}")
    for name in ("steps", *DEMO_SIZE_OPTIONS, "batch", "grad_accum"):
        if getattr(args, name) < 1:
            _usage(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("host_mib", "device_mib", "prefetch_mib"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            _usage(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.step_in_backward and (args.param_tier, args.optimizer_tier) != ("nvme", "nvme"):
        _usage(f"--step-in-backward keeps each parameter's old value on nvme until the step commits: it needs "
               f"--param-tier nvme and --optimizer-tier nvme (got {args.param_tier} and {args.optimizer_tier})")
    try:
        args.device = _compute_device(args.device)
    except ValueError as exc:
        _usage(str(exc))
    try:
        built = _model(args)
    except ValueError as exc:
        _usage(str(exc))
    store_path = os.path.join(os.path.abspath(args.dir), "store")
    try:
        args.host_mib, args.device_mib = size_budgets(
            built[0], lambda host, device: _config(args, store_path, host, device), host_mib=args.host_mib,
            device_mib=args.device_mib, default_host_mib=BEYOND_MEMORY_HOST_MIB if args.beyond_memory else DEMO_HOST_MIB,
            param_tier=args.param_tier)
    except ValueError as exc:
        _usage(str(exc))
    try:
        directory = DemoDirectory.claim(args.dir, out)
    except ValueError as exc:
        _usage(str(exc))
    try:
        return _train(args, built, directory, out)
    finally:
        directory.release(keep=args.keep, out=out)


def _usage(message: str) -> NoReturn:
    """A usage error: one line on stderr, exit status 2."""
    print(f"tiered train: {message}", file=sys.stderr)
    raise SystemExit(2)


def _config(args: argparse.Namespace, store_path: str, host_bytes: int, device_bytes: int) -> "EngineConfig":
    """The engine's configuration for the options, with these budgets."""
    import engine
    import tiered

    store = tiered.StoreConfig(path=store_path, host_bytes=host_bytes, device_bytes=device_bytes, device=args.device)
    return engine.EngineConfig(store=store, compute_device=args.device, param_tier=args.param_tier,
                               optimizer_tier=args.optimizer_tier, prefetch_bytes=args.prefetch_mib * MiB,
                               compress_optimizer=args.compress_optimizer, activation_tier=args.activation_tier,
                               gradient_accumulation_steps=args.grad_accum,
                               step_in_backward=True if args.step_in_backward else None)


def _compute_device(name: Optional[str]) -> str:
    """The device named by ``--device`` (checked to exist), or cuda when available, else cpu."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device {name!r} is not a device: {exc}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name!r}: this machine has no CUDA device; pass --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif device.type != "cpu":
        raise ValueError(f"--device {name!r}: the demo runs on 'cpu' or 'cuda[:N]'")
    return str(device)


def _train(args: argparse.Namespace, built: tuple, run_dir: DemoDirectory, out: TextIO) -> int:
    import engine
    from engine.demo import BigramStream

    directory = run_dir.path
    model, name, vocab, init_fn = built
    n = sum(p.numel() for p in model.parameters())
    state_bytes = n * 16  # fp32 parameter, gradient and two moments (the master is the parameter)
    budget = (args.host_mib + args.device_mib) * MiB
    print(f"model: {name}, {n / 1e6:,.1f} M parameters, computing on {_device_name(args.device)}", file=out)
    print(f"parameters + gradients + AdamW states: {_gb(state_bytes)}; device + host budget: {_gb(budget)}"
          f" ({state_ratio(state_bytes, budget)}); the rest goes to {directory}", file=out)
    config = _config(args, run_dir.store_path, args.host_mib * MiB, args.device_mib * MiB)
    if args.beyond_memory:
        _check_room(model, config, directory)
    optimizer = engine.AdamW(lr=args.lr, weight_decay=args.weight_decay)
    eng = engine.wrap(model, optimizer=optimizer, config=config, init_fn=init_fn)
    print(f"optimizer steps: {eng.step_mode}; AdamW math: {optimizer.math_path}", file=out)
    data = BigramStream(vocab, args.seq, args.batch, seed=args.seed)
    tty = out.isatty() if hasattr(out, "isatty") else False
    losses: list[float] = []
    # What docs/tuning.md suggests to applications (the library cannot: it is process-wide): leave
    # everything made so far, torch's objects and the model's, out of later collections. The
    # transfers in flight would otherwise set off a full collection every couple of steps.
    froze = not gc.get_freeze_count()
    if froze:
        gc.collect()
        gc.freeze()
    start = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            loss_sum = 0.0
            for micro in range(args.grad_accum):  # eng.step() steps AdamW on the last of them
                x, y = (t.to(args.device) for t in data.batch((step - 1) * args.grad_accum + micro))
                loss = model(x, y)
                eng.backward(loss)
                assert eng.is_gradient_accumulation_boundary() == (micro == args.grad_accum - 1)
                eng.step()
                loss_sum += loss.item()
            if args.grad_accum == 1:  # with accumulation the engine zeroes the gradients itself
                eng.zero_grad()
            losses.append(loss_sum / args.grad_accum)
            elapsed = time.perf_counter() - start
            stats = eng.stats()
            line = StepLine(step, args.steps, losses[-1], step * args.grad_accum * x.numel() / elapsed,
                            stats.store.bytes_read + stats.store.bytes_written, min(1.0, _stalled(stats) / elapsed))
            if tty:
                out.write("\r" + line.render())
                out.flush()
            elif step == 1 or step == args.steps or step % max(1, args.steps // 10) == 0:
                print(line.render(), file=out)
        if tty:
            out.write("\n")
        _report(eng.stats(), losses, data.loss_floor, time.perf_counter() - start, run_dir, args.keep, out)
    finally:
        eng.close() if hasattr(eng, "close") else eng.unwrap()
        if froze:
            gc.unfreeze()
    return 0


def _model(args: argparse.Namespace) -> "tuple[torch.nn.Module, str, int, object]":
    """The model on the meta device, its description, its vocabulary and its initializer."""
    torch.manual_seed(args.seed)
    if args.beyond_memory:
        from engine.demo.llama import Llama, init_weights

        llama = beyond_memory_config(args)
        with torch.device("meta"):
            model = Llama(llama)
        return model, f"Llama-style, {llama.n_layers} layers x {llama.dim}", llama.vocab_size, init_weights
    from engine.demo import GPT

    cfg = demo_config(args)
    with torch.device("meta"):
        model = GPT(cfg)
    return model, f"GPT, {args.layers} layers x {args.embd}", cfg.vocab_size, _init_module(cfg)


def _check_room(model: torch.nn.Module, config: object, directory: str) -> None:
    """Raise SystemExit naming the free and the needed bytes when the disk under ``directory`` cannot
    hold what the store needs during a step (``engine.estimate_memory``)."""
    import engine

    needed = engine.estimate_memory(model, config).during_step.nvme  # type: ignore[arg-type]
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise SystemExit(f"tiered train: {directory} has {_gb(free)} free, and this model needs about {_gb(needed)} "
                         "on disk during a step: free some space, point --dir at a larger disk, or pass a smaller "
                         "--state-gib")


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def _init_module(cfg: "object"):
    """GPT's own initialization, applied to one module at a time as wrap materializes it."""
    import math

    from torch import nn

    def init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if isinstance(module, nn.Linear) and module.out_features == cfg.n_embd:
                std = 0.02 / math.sqrt(2 * cfg.n_layer)
            nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    return init


def _stalled(stats: "object") -> float:
    """Seconds spent waiting on the store: parameter fetches, the optimizer step's I/O stalls and
    saved activations (with --activation-tier)."""
    return (stats.stall_seconds + stats.optimizer_stall_seconds  # type: ignore[attr-defined]
            + stats.activation_stall_seconds)  # type: ignore[attr-defined]


def _report(stats: object, losses: list[float], floor: float, seconds: float, run_dir: DemoDirectory, keep: bool,
            out: TextIO) -> None:
    store = stats.store
    print(f"\nloss {losses[0]:.4f} -> {losses[-1]:.4f} (the data's floor is {floor:.4f}) in {seconds:.1f} s", file=out)
    print("where the data went (store tiers at the end):", file=out)
    for tier, t in store.tiers.items():
        if not (t.used_bytes or t.bytes_in or t.bytes_out):
            continue
        print(f"  {tier.value:<6} {_gb(t.used_bytes):>9} in {t.entries:>4} entries; read {_gb(t.bytes_out)},"
              f" written {_gb(t.bytes_in)}", file=out)
    print(f"  disk I/O: {_gb(store.bytes_read)} read, {_gb(store.bytes_written)} written", file=out)
    if store.bytes_after_codec < store.bytes_before_codec:
        print(f"  compression: {_gb(store.bytes_before_codec)} -> {_gb(store.bytes_after_codec)}"
              f" ({store.bytes_after_codec / store.bytes_before_codec:.3f})", file=out)
    print(f"  parameter stalls: {getattr(stats, 'stall_seconds', 0.0):.2f} s; prefetch hits "
          f"{getattr(stats, 'prefetch_hits', 0)}, misses {getattr(stats, 'prefetch_misses', 0)}", file=out)
    offloaded = getattr(stats, "activation_bytes_offloaded", 0)
    if offloaded:
        print(f"  activations: {_gb(offloaded)} to the store during forward, {_gb(stats.activation_bytes_read)} "  # type: ignore[attr-defined]
              f"read back in backward; {stats.activation_stall_seconds:.2f} s waiting", file=out)  # type: ignore[attr-defined]
    if keep:
        print(f"store kept in {run_dir.path}: `tiered inspect {run_dir.store_path}` lists it", file=out)


def state_ratio(state_bytes: int, budget_bytes: int) -> str:
    """``3.5x``: the training state over the memory budgets, as the demo prints it (and the README
    and quickstart quote it for the defaults)."""
    return f"{state_bytes / max(budget_bytes, 1):.1f}x"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
