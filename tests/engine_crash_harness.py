"""Engine crash harness: a training process is SIGKILLed at a chosen or random moment, a new process
resumes, and every loss it computes must equal an uninterrupted plain-torch run's, bit for bit.

Used by tests/test_reliability_engine_crash.py (CI: a dozen kills) and ``benchmarks/crash_bench.py
--engine`` (``--kills 200``). No pytest here: failures are ``EngineCrashError`` with the evidence.

How it works
- Children are forked from a multiprocessing forkserver that has imported torch, engine and this
  module, so a child starts in milliseconds. Every child runs with one torch thread, like the
  reference, so the math is the same in every process.
- The reference: plain torch (``torch.optim.AdamW``, ``clip_grad_norm_``, the same micro-batches)
  trains the same :class:`~engine_models.TinyGPT` for ``steps`` steps, in a child; it gives the loss
  of every micro-batch and a CRC-32 of the parameters after each step.
- A chain is one store directory and one checkpoint directory trained through by a sequence of
  children. Each child wraps the model (a different random init: every value must come from the
  store or the checkpoint) and takes up the training: afresh (the first), from the store's own
  state (``EngineConfig(resume=True)``) or from the latest checkpoint (a fresh wrap and
  ``load_checkpoint``). It trains with ``engine.AdamW`` (parameters, gradients and optimizer state
  on nvme; compressed in some variants; gradient accumulation and clipping in some), saves a
  checkpoint every few steps, and is killed by its *kill plan*: in forward (a forward pre-hook), in
  backward right after a gradient offload started (a post-accumulate-grad hook), at an event of the
  optimizer step's pipeline (read/update/write of a group), at a random delay into ``step()`` or into
  a checkpoint save, at the n-th filesystem call of a save (an audit hook: between the two renames
  of an overwrite, say), between steps, or while it is itself resuming.
- Every child journals (one O_APPEND ``write`` per line) the losses it computed, each step it
  began and each that returned, each checkpoint save begun and returned, and the step it resumed
  at with a CRC-32 of the parameters it resumed with. The parent replays the journals: every loss
  must equal the reference's; a resume from the store must be at the last step whose ``step()``
  returned, or one later when a step was in flight; a resume from the checkpoint at the last save
  that returned, or the one in flight; and the parameters it resumed with must be the reference's
  after that step. After a kill during a save the next child resumes from the checkpoint, so a
  half-done save must have left one that loads.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
import zlib
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from crash_harness import Journal, read_journal
from engine_models import TinyGPT, gpt_tokens

import engine
import tiered

KiB = 1024
LR = 1e-2
WEIGHT_DECAY = 0.1
#: How long the parent waits for a child that should finish in about a second.
PATIENCE_S = 120.0
#: Where a child may be killed.
PHASES = ("forward", "backward", "step_event", "step_timer", "save_event", "save_timer", "between", "resume")


class EngineCrashError(AssertionError):
    """A resumed training run disagreed with the uninterrupted reference or with the journal."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a chain trains."""

    name: str
    compress: bool = False  # EngineConfig.compress_optimizer
    accum: int = 1  # micro-batches per step
    max_grad_norm: Optional[float] = None
    grad_tier: str = "nvme"
    ckpt_every: int = 2  # save after every this many steps
    ckpt_overwrite: bool = False  # one directory saved over with overwrite=True; else one per save
    steps: int = 10  # steps of a whole chain
    step_in_backward: bool = False  # EngineConfig.step_in_backward (the updates run inside backward)


VARIANTS = (
    Variant("plain", ckpt_every=2, ckpt_overwrite=False, grad_tier="nvme"),
    Variant("compressed-accum-clip", compress=True, accum=2, max_grad_norm=0.5, grad_tier="host", ckpt_every=3,
            ckpt_overwrite=True),
)
#: The updates inside backward: a kill in backward lands among them (tests/test_reliability_engine_crash.py).
STEP_IN_BACKWARD = Variant("step-in-backward", compress=True, ckpt_every=3, step_in_backward=True)


# ----------------------------------------------------------------------------------- training


def batch(step: int, micro: int, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of a micro-batch (the same in every process)."""
    tokens = gpt_tokens(batch=2, t=13, seed=step * accum + micro)
    return tokens[:, :-1], tokens[:, 1:]


def micro_loss(model: torch.nn.Module, step: int, micro: int, accum: int) -> torch.Tensor:
    """Cross-entropy of one micro-batch, scaled by 1 / micro-batches."""
    x, y = batch(step, micro, accum)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / accum


def params_crc(state: dict[str, torch.Tensor]) -> int:
    """CRC-32 over every parameter's bytes in name order."""
    crc = 0
    for name in sorted(state):
        t = state[name].detach().contiguous().reshape(-1)
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(memoryview(t.view(torch.uint8).numpy()), crc)
    return crc


def engine_config(store_path: str, variant: Variant, resume: bool) -> engine.EngineConfig:
    """Everything durable on nvme; groups small enough that a step has several."""
    store = tiered.StoreConfig(
        path=store_path, host_bytes=64 * KiB, device_bytes=0, device="cpu", prefault_host=False, durable=False,
        block_size=64 * KiB, swap_grow_bytes=1024 * KiB, io_threads=2, queue_depth=8, staging_buffers=4,
        result_pool_bytes=0, cpu_threads=1,
    )
    return engine.EngineConfig(
        store=store, host_budget="host_tier", param_tier="nvme", optimizer_tier="nvme", grad_tier=variant.grad_tier,
        compress_optimizer=variant.compress, max_grad_norm=variant.max_grad_norm, optimizer_group_bytes=8 * KiB,
        prefetch_bytes=16 * KiB, resume=resume, step_in_backward=variant.step_in_backward,
    )


def reference_main(variant: Variant, out_path: str) -> None:
    """Child: the uninterrupted plain-torch run; writes {"losses": [[...]], "crcs": [...]} to ``out_path``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, crcs = [], [params_crc(model.state_dict())]
    for step in range(variant.steps):
        row = []
        for micro in range(variant.accum):
            loss = micro_loss(model, step, micro, variant.accum)
            row.append(loss.item())
            loss.backward()
        if variant.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), variant.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(row)
        crcs.append(params_crc(model.state_dict()))
    with open(out_path, "w") as f:
        json.dump({"losses": losses, "crcs": crcs}, f)


@dataclasses.dataclass(frozen=True)
class KillPlan:
    """Where a child kills itself: ``phase`` at its ``at_step``-th step (counted from where it
    resumed), the ``n``-th hook call or event there, or after ``delay_s`` for the timed phases."""

    phase: str
    at_step: int = 0
    n: int = 0
    delay_s: float = 0.0


def latest_checkpoint(ckpt_dir: str, variant: Variant) -> Optional[str]:
    """The checkpoint a resume loads: the one directory (overwrite mode) or the newest ``step*``."""
    if variant.ckpt_overwrite:
        return os.path.join(ckpt_dir, "last")
    steps = sorted(int(n[4:]) for n in os.listdir(ckpt_dir) if n.startswith("step") and n[4:].isdigit()
                   and os.path.isfile(os.path.join(ckpt_dir, n, "metadata.json")))
    return os.path.join(ckpt_dir, f"step{steps[-1]}") if steps else None


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _timer(delay: float) -> None:
    threading.Timer(delay, _die).start()


def child_main(store_path: str, ckpt_dir: str, variant: Variant, source: str, plan: Optional[KillPlan],
               journal_path: str, init_seed: int) -> None:
    """A training process of a chain (see the module docstring). ``source``: "fresh", "store" or
    "checkpoint"."""
    torch.set_num_threads(1)
    journal = Journal(journal_path)
    try:
        _train(store_path, ckpt_dir, variant, source, plan, journal, init_seed)
    except BaseException as exc:  # noqa: BLE001 - the parent must hear of anything unexpected
        journal.log(fatal=f"{type(exc).__name__}: {exc}")
        os._exit(3)


def _train(store_path: str, ckpt_dir: str, variant: Variant, source: str, plan: Optional[KillPlan],
           journal: Journal, init_seed: int) -> None:
    saving = {"armed": False, "count": 0}
    ckpt_root = os.path.abspath(ckpt_dir)

    def audit(event: str, args: tuple) -> None:
        # Counts filesystem calls under the checkpoint directory while a save is armed to die.
        if not saving["armed"] or event not in ("open", "os.mkdir", "os.rename", "shutil.rmtree", "os.remove"):
            return
        if args and isinstance(args[0], (str, bytes, os.PathLike)) and os.fsdecode(args[0]).startswith(ckpt_root):
            if saving["count"] == plan.n:  # type: ignore[union-attr]
                _die()
            saving["count"] += 1

    if plan is not None and plan.phase == "save_event":
        sys.addaudithook(audit)
    if plan is not None and plan.phase == "resume":
        _timer(plan.delay_s)

    torch.manual_seed(0 if source == "fresh" else init_seed)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=WEIGHT_DECAY),
                      config=engine_config(store_path, variant, resume=source == "store"))
    if source == "checkpoint":
        path = latest_checkpoint(ckpt_dir, variant)
        assert path is not None, "no checkpoint to resume from"
        eng.load_checkpoint(path)
    start = eng.completed_steps
    stale = [k for k in eng.store.keys() if k.startswith("grad/")]
    journal.log(resumed=start, source=source, crc=params_crc(eng.state_dict()), stale=stale)
    if plan is not None and plan.phase == "resume":
        _die()  # the timer did not fire during the resume: die now, still before any step

    hooks: list[Any] = []
    saves = 0
    for step in range(start, variant.steps):
        armed = plan is not None and step - start == plan.at_step and not plan.phase.startswith("save")
        phase = plan.phase if armed else None
        if phase == "forward":  # as the chosen module starts (the engine's pre-hook has fetched its parameters)
            modules = list(model.modules())
            module = modules[plan.n % len(modules)]  # type: ignore[union-attr]
            hooks = [module.register_forward_pre_hook(lambda *_: _die())]
        elif phase == "backward":
            params = list(dict.fromkeys(model.parameters()))
            target = params[plan.n % len(params)]  # type: ignore[union-attr]
            hooks = [target.register_post_accumulate_grad_hook(lambda _p: _die())]  # after the engine's offload
        journal.log(b="step", s=step)
        for micro in range(variant.accum):
            loss = micro_loss(model, step, micro, variant.accum)
            journal.log(loss=loss.item(), s=step, m=micro)
            loss.backward()
        for h in hooks:
            h.remove()
        hooks = []
        if phase == "between":
            if plan.n % 2:  # type: ignore[union-attr]
                eng._training.grads.flush()  # the gradients are in the store, no step has started
            _die()
        if phase == "step_event":
            events = {"n": 0}

            def on_event(_event: str, _group: int, events: dict[str, int] = events) -> None:
                if events["n"] == plan.n:  # type: ignore[union-attr]
                    _die()
                events["n"] += 1

            eng._training.on_event = on_event
        elif phase == "step_timer":
            _timer(plan.delay_s)  # type: ignore[union-attr]
        journal.log(b="opt", s=step)
        eng.step()
        journal.log(stepped=step + 1)
        eng._training.on_event = None
        if phase in ("step_event", "step_timer"):
            _die()  # the kill point lay past the step's end: die between steps
        eng.zero_grad()
        if (step + 1) % variant.ckpt_every == 0:
            save_phase = plan.phase if plan is not None and saves == plan.at_step else None
            if save_phase == "save_event":
                saving["armed"] = True
            elif save_phase == "save_timer":
                _timer(plan.delay_s)  # type: ignore[union-attr]
            journal.log(b="save", s=step + 1)
            name = "last" if variant.ckpt_overwrite else f"step{step + 1}"
            eng.save_checkpoint(os.path.join(ckpt_dir, name), overwrite=variant.ckpt_overwrite)
            journal.log(saved=step + 1)
            saves += 1
            if save_phase in ("save_event", "save_timer"):
                _die()  # the kill point lay past the save's end
            # (a .partial of another path, left by a save that was killed, stays: only a save to its path removes it)
            leftovers = [n for n in os.listdir(ckpt_dir) if n in (name + ".partial", name + ".old")]
            if leftovers:
                journal.log(fatal=f"a save returned but left {leftovers}")
                os._exit(3)
    crc = params_crc(eng.state_dict())
    eng.close()
    journal.log(done=variant.steps, crc=crc)
    os._exit(0)


# ----------------------------------------------------------------------------------- parent


@dataclasses.dataclass
class ChainState:
    """What the journals so far allow the next resume to find."""

    store_steps: set[int]  # completed steps a resume from the store may find
    ckpt_steps: set[int]  # steps the latest checkpoint may hold
    ckpt_exists: bool = False  # a save has returned in this chain
    save_in_flight: bool = False  # the last child was killed while saving
    last_source: str = "fresh"
    resumed: bool = True  # the last child got as far as its "resumed" line


@dataclasses.dataclass
class KillRecord:
    """One child of a chain and what its journal showed."""

    variant: str
    chain: int
    index: int
    source: str
    phase: str  # the kill plan's phase ("none": it ran to the end)
    killed: bool
    resumed_at: Optional[int]
    losses_checked: int
    steps_returned: int
    saves_returned: int
    in_flight: str  # what was in flight at the kill: "step", "save", "resume" or ""
    seconds: float


def forkserver_context() -> multiprocessing.context.BaseContext:
    """A forkserver whose server has imported torch, engine and this harness."""
    ctx = multiprocessing.get_context("forkserver")
    # torch._dynamo: torch.optim.Optimizer.__init__ imports it (2 s) on first use
    ctx.set_forkserver_preload(
        ["torch", "torch._dynamo", "tiered", "engine", "engine.optim.adamw", "engine.optim.training", __name__]
    )
    return ctx


def reference(variant: Variant, workdir: str, ctx: Any) -> dict[str, Any]:
    """The uninterrupted plain-torch run of ``variant`` (computed in a child, like the others)."""
    out = os.path.join(workdir, f"reference-{variant.name}.json")
    proc = ctx.Process(target=reference_main, args=(variant, out))
    proc.start()
    proc.join(PATIENCE_S)
    if proc.exitcode != 0:
        raise EngineCrashError(f"the reference run of {variant.name} failed (exit {proc.exitcode})")
    with open(out) as f:
        return json.load(f)


def plan_kill(rng: random.Random, variant: Variant, phases: tuple[str, ...] = PHASES) -> KillPlan:
    """A random kill plan, in one of ``phases``."""
    phase = rng.choice(phases)
    at = rng.randint(0, 1) if phase.startswith("save") else rng.randint(0, 2)  # save phases: the at-th save
    return KillPlan(
        phase, at_step=at, n=rng.randint(0, {"step_event": 45, "save_event": 11}.get(phase, 40)),
        delay_s=rng.uniform(0.0, {"resume": 0.4, "step_timer": 0.06, "save_timer": 0.03}.get(phase, 0.0)),
    )


def run_engine_chains(workdir: str, kills: int, seed: int, *, variants: tuple[Variant, ...] = VARIANTS,
                      ctx: Any = None, on_kill: Optional[Callable[[KillRecord], None]] = None,
                      phases: tuple[str, ...] = PHASES) -> list[KillRecord]:
    """Kill ``kills`` training children, split over ``variants``, each in one of ``phases``; check
    every resume (see module doc)."""
    ctx = ctx or forkserver_context()
    rng = random.Random(seed)
    records: list[KillRecord] = []
    for v, variant in enumerate(variants):
        ref = reference(variant, workdir, ctx)
        share = kills // len(variants) + (v < kills % len(variants))
        killed, chain = 0, 0
        while killed < share:
            killed += _run_chain(workdir, variant, ref, chain, share - killed, rng, ctx, records, on_kill, phases)
            chain += 1
    return records


def _run_chain(workdir: str, variant: Variant, ref: dict[str, Any], chain: int, kills_left: int,
               rng: random.Random, ctx: Any, records: list[KillRecord],
               on_kill: Optional[Callable[[KillRecord], None]], phases: tuple[str, ...] = PHASES) -> int:
    """Children on one fresh store until one runs to the end; returns how many were killed."""
    base = os.path.join(workdir, f"{variant.name}-{chain}")
    store_path, ckpt_dir = os.path.join(base, "store"), os.path.join(base, "ckpt")
    os.makedirs(ckpt_dir)
    state = ChainState(store_steps={0}, ckpt_steps=set())
    killed = 0
    for index in range(10_000):
        source = _choose_source(rng, state, index)
        plan = plan_kill(rng, variant, phases) if killed < kills_left else None
        journal_path = os.path.join(base, f"journal-{index:04d}.jsonl")
        started = time.monotonic()
        proc = ctx.Process(target=child_main, args=(store_path, ckpt_dir, variant, source, plan, journal_path,
                                                    1000 + index))
        proc.start()
        proc.join(PATIENCE_S)
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
            raise EngineCrashError(f"child {index} of {variant.name} chain {chain} hung for {PATIENCE_S} s")
        lines = read_journal(journal_path) if os.path.exists(journal_path) else []
        where = f"{variant.name} chain {chain} child {index} (source {source}, plan {plan})"
        record = _check(lines, proc.exitcode, state, ref, variant, source, where)
        record = dataclasses.replace(record, variant=variant.name, chain=chain, index=index,
                                     phase=plan.phase if plan else "none", seconds=time.monotonic() - started)
        records.append(record)
        if on_kill is not None:
            on_kill(record)
        os.unlink(journal_path)
        if not record.killed:
            return killed
        killed += 1
    raise EngineCrashError(f"{variant.name} chain {chain} never finished")


def _choose_source(rng: random.Random, state: ChainState, index: int) -> str:
    if index == 0:
        return "fresh"
    if not state.resumed:
        return state.last_source  # killed while taking up the training: the same way again
    if state.ckpt_exists and (state.save_in_flight or rng.random() < 0.35):
        return "checkpoint"  # after a kill in a save, always: the previous checkpoint must load
    return "store"


def _check(lines: list[dict], exitcode: Optional[int], state: ChainState, ref: dict[str, Any], variant: Variant,
           source: str, where: str) -> KillRecord:
    """Replay one child's journal against the reference and the chain state; update the state."""
    fatal = next((line["fatal"] for line in lines if "fatal" in line), None)
    if fatal is not None or exitcode not in (0, -signal.SIGKILL):
        raise EngineCrashError(f"{where} failed on its own (exit {exitcode}): {fatal}")
    killed = exitcode == -signal.SIGKILL
    losses = 0
    resumed_at: Optional[int] = None
    step_open: Optional[int] = None
    save_open: Optional[int] = None
    steps_returned = saves_returned = 0
    for line in lines:
        if "resumed" in line:
            resumed_at = line["resumed"]
            allowed = state.ckpt_steps if source == "checkpoint" else (state.store_steps if source == "store" else {0})
            if resumed_at not in allowed:
                raise EngineCrashError(f"{where} resumed at step {resumed_at}; the journals allow {sorted(allowed)}")
            if line["crc"] != ref["crcs"][resumed_at]:
                raise EngineCrashError(
                    f"{where} resumed at step {resumed_at} with parameters that are not the reference's after that step"
                )
            if line["stale"]:
                raise EngineCrashError(f"{where}: gradient shards of the interrupted run survived the resume: "
                                       f"{line['stale'][:3]}")
            state.store_steps = {resumed_at}
        elif "loss" in line:
            want = ref["losses"][line["s"]][line["m"]]
            if line["loss"] != want:
                raise EngineCrashError(
                    f"{where}: the loss of step {line['s']} micro-batch {line['m']} is {line['loss']!r}, the "
                    f"uninterrupted run's is {want!r}"
                )
            losses += 1
        elif line.get("b") == "opt":
            step_open = line["s"]
        elif "stepped" in line:
            step_open = None
            steps_returned += 1
            state.store_steps = {line["stepped"]}
        elif line.get("b") == "save":
            save_open = line["s"]
        elif "saved" in line:
            save_open = None
            saves_returned += 1
            state.ckpt_steps = {line["saved"]}
            state.ckpt_exists = True
        elif "done" in line:
            if line["crc"] != ref["crcs"][line["done"]]:
                raise EngineCrashError(f"{where}: the parameters after the last step are not the reference's")
    if not killed and not any("done" in line for line in lines):
        raise EngineCrashError(f"{where} exited without finishing its run")
    in_flight = ""
    if step_open is not None:
        state.store_steps = state.store_steps | {step_open + 1}  # the record may have committed
        in_flight = "step"
    if save_open is not None:
        state.ckpt_steps = state.ckpt_steps | {save_open}
        in_flight = "save"
    state.save_in_flight = save_open is not None
    state.resumed = resumed_at is not None
    if not state.resumed:
        in_flight = "resume"
        if source != "store":
            # A fresh wrap discards the store's training state before the checkpoint is loaded; the next
            # child takes up the training the same way (from the checkpoint), not from the store.
            state.store_steps = set()
    state.last_source = source
    return KillRecord(
        variant="", chain=0, index=0, source=source, phase="", killed=killed, resumed_at=resumed_at,
        losses_checked=losses, steps_returned=steps_returned, saves_returned=saves_returned, in_flight=in_flight,
        seconds=0.0,
    )


def overwrite_and_die(store_path: str, ckpt_path: str, event: str, index: int) -> None:
    """Child: train two steps, saving ``ckpt_path`` after each (the second with overwrite=True), and
    die at the ``index``-th audit ``event`` (e.g. "os.rename") of the second save under ``ckpt_path``."""
    torch.set_num_threads(1)
    variant = VARIANTS[0]
    seen = {"armed": False, "n": 0}
    root = os.path.dirname(os.path.abspath(ckpt_path))

    def audit(name: str, args: tuple) -> None:
        if seen["armed"] and name == event and args and os.fsdecode(args[0]).startswith(root):
            if seen["n"] == index:
                _die()
            seen["n"] += 1

    sys.addaudithook(audit)
    torch.manual_seed(0)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR, weight_decay=WEIGHT_DECAY),
                      config=engine_config(store_path, variant, resume=False))
    for step in range(2):
        micro_loss(model, step, 0, 1).backward()
        eng.step()
        eng.zero_grad()
        seen["armed"] = step == 1
        eng.save_checkpoint(ckpt_path, overwrite=True)
    os._exit(0)
