"""Speculative updates inside backward: each shard's AdamW update runs the moment its gradient is final,
before anything knows the global gradient norm, an overflow, or whether the loop will call something
between backward and ``eng.step()`` that needs the values from before the step; the step validates
what ran and commits it, or rolls it back and redoes it.

[Note: Speculative updates]
An update inside backward (engine/optim/backward_step.py) first renames each of the shard's live
entries (``param/<name>``; its fp32 master when it has one of its own; both moments) to
``optim/<name>/before/<role>`` (no byte moves), then writes the new values under the live keys with
one atomic ``put_many``. So until the step commits, the store holds both sides of the step:

- **commit** (``eng.step()``, the norm does not bind, no overflow, the hyperparameters unchanged):
  the record commits step t+1, then the ``before`` entries go;
- **roll back** (:func:`roll_back`: an overflow under loss scaling, ``zero_grad``, a crash): each
  ``before`` entry is renamed back over its live key, and the state a shard's first step created
  (it had none before) is deleted; the model is the last committed step's again, bit for bit;
- **redo** (the clip coefficient binds, or the hyperparameters changed since the updates ran):
  roll back, then the step after backward updates every shard from its stored gradient with the
  coefficient. Only possible where the gradients were kept: with clipping configured, each final
  gradient is also put to nvme (in its training dtype where that is exact: 2 bytes a parameter in
  bf16 or fp16 at world size 1 without accumulation, else fp32);
- **set aside** (a forward, ``state_dict``, a checkpoint save or a ``full_*`` read between backward
  and step): the new values move to ``optim/<name>/after/<role>`` and the ``before`` entries back to
  the live keys (:func:`set_aside`), so the call sees the model as torch would, with the step not
  taken yet; ``eng.step()`` swaps them back first (:func:`put_back`).

Every transition is a rename or a delete, so it moves no tensor bytes, and each leaves a state the
same recovery handles: after a crash the record's ``in_backward`` section says a step was under
way, and :func:`roll_back` (delete ``after`` entries, rename ``before`` entries back, delete a fresh
shard's new state) restores the last committed step whichever transition the crash cut short. The
loop then runs the step again, as after any crash before a commit.

Within a step the running sum of squared gradient norms only grows: once it alone exceeds the
clip norm, the remaining shards are not updated (only their gradients are kept) and the step
redoes what ran before that point. A binding step therefore costs what the step after backward
costs (the gradients kept inside backward are the ones it would have stored), plus the updates
that ran before the running norm crossed. Usually it crosses at the first large gradient (an
output layer's), and the steps stay inside backward; a step after a binding one reads no state
ahead, so that one binding at once reads nothing for nothing. Where more than
:data:`WASTED_UPDATES_TO_FALL_BACK` of the parameters were updated for nothing, the policy
(:class:`StepModePolicy`) runs the following steps after backward while the norm keeps binding,
and goes back inside backward after the first step whose norm does not bind.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from typing import Optional, Sequence

import torch

from engine.optim.types import AdamHyper, OptimShard
from engine.paging.layout import after_key, before_key, optim_keys, param_key
from engine.paging.shard_io import delete_keys
from tiered import TieredStore

#: The share of the parameters a binding step may have updated inside backward for nothing (rolled
#: back and redone) before the following steps run after backward while the norm keeps binding.
WASTED_UPDATES_TO_FALL_BACK = 0.01

#: A shard's entries an update inside backward replaces: its name, and its live store key by role.
Entries = tuple[str, dict[str, str]]


def entries_of(shard: OptimShard) -> Entries:
    """``shard``'s entries (no "master" role when the parameter is its own master)."""
    keys = {"param": shard.param_key, "master": shard.master_key, "exp_avg": shard.exp_avg_key,
            "exp_avg_sq": shard.exp_avg_sq_key}
    if shard.master_is_param:
        del keys["master"]
    return shard.name, keys


def entries_named(name: str, slot: int) -> Entries:
    """The entries of the parameter called ``name`` whose live optimizer state is in key set ``slot``
    (a checkpoint load writes the other set), every role: what a resume rolls back before it knows
    the shards' layout (a role a shard does not have has no entries to move)."""
    master, exp_avg, exp_avg_sq = optim_keys(name, slot)
    return name, {"param": param_key(name), "master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def keep_before(store: TieredStore, shards: Sequence[OptimShard]) -> "Optional[concurrent.futures.Future[None]]":
    """Start renaming the live entries of ``shards`` that exist to their ``before`` keys, in one atomic
    call (the first half of an update inside backward); returns the rename's future (None: nothing to
    rename). The values already read stay valid: a rename moves no byte. The renames need no flush of
    their own: the write of the new values that follows them is durable, and flushes them with it; a
    crash before it finds the entries renamed or (a power loss) live, and the resume's roll-back
    handles both."""
    pairs = [(key, before_key(name, role)) for name, keys in map(entries_of, shards) for role, key in keys.items()
             if key in store]
    return store.sync.rename_many_future(pairs, durable=False) if pairs else None


def roll_back(store: TieredStore, entries: Sequence[Entries], fresh: set[str]) -> None:
    """Put the shards of ``entries`` back as they were before the step: their set-aside new values
    deleted, their ``before`` entries renamed over the live keys, and, for a shard in ``fresh`` (it
    had no optimizer state before the step), the state its update created deleted. Idempotent: a
    crash part way is finished by calling it again."""
    delete_keys(store, [after_key(name, role) for name, keys in entries for role in keys])
    pairs = [(before_key(name, role), key) for name, keys in entries for role, key in keys.items()
             if before_key(name, role) in store]
    if pairs:
        store.sync.rename_many(pairs)
    created = [key for name, keys in entries if name in fresh for role, key in keys.items() if role != "param"]
    delete_keys(store, created)


def set_aside(store: TieredStore, entries: Sequence[Entries]) -> None:
    """Move the new values of the shards of ``entries`` (updated inside backward) to their ``after``
    keys, and the ``before`` entries back to the live keys: the store shows the last committed step
    while the step's updates wait."""
    aside = [(key, after_key(name, role)) for name, keys in entries for role, key in keys.items() if key in store]
    if aside:
        store.sync.rename_many(aside)
    back = [(before_key(name, role), key) for name, keys in entries for role, key in keys.items()
            if before_key(name, role) in store]
    if back:
        store.sync.rename_many(back)


def put_back(store: TieredStore, entries: Sequence[Entries]) -> None:
    """Undo :func:`set_aside`: the values from before the step to the ``before`` keys, the new values
    to the live keys."""
    waiting = [(name, role, key) for name, keys in entries for role, key in keys.items()
               if after_key(name, role) in store]
    before = [(key, before_key(name, role)) for name, role, key in waiting if key in store]
    if before:
        store.sync.rename_many(before)
    if waiting:
        store.sync.rename_many([(after_key(name, role), key) for name, role, key in waiting])


def discard_kept(store: TieredStore, entries: Sequence[Entries]) -> None:
    """Delete the ``before`` and ``after`` entries of ``entries`` (once the step committed, or leftovers
    a crash after a commit left)."""
    delete_keys(store, [k for name, keys in entries for role in keys
                        for k in (before_key(name, role), after_key(name, role))])


@dataclasses.dataclass
class StepInBackward:
    """What one step's updates inside backward did so far (the engine's side of it; the worker is
    engine/optim/backward_step.py). Norms are those of the stored (loss-scaled) gradients."""

    #: The step being taken (the record's step + 1).
    step: int
    #: Each final gradient is also stored, so the step can be redone ([Note: Speculative updates]).
    keeps_grads: bool
    #: The clip norm that makes the running norm stop the updates, or None.
    max_norm: Optional[float]
    #: Multiplies the stored gradients before clipping and AdamW (1 / loss scale).
    grad_scale: float
    #: The hyperparameters the updates ran with.
    hypers: tuple[AdamHyper, ...]
    #: Loss scaling is on: a non-finite gradient is an overflow, and the step is skipped.
    scaled: bool = False
    #: Shards updated inside backward, in the order their gradients became final, with their norms.
    updated: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: Shards with a final gradient whose update waits for the step (its gradient is stored).
    waiting: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    sum_squares: float = 0.0
    #: A gradient was inf or NaN (loss scaling skips the step).
    overflow: bool = False
    #: The running norm already exceeds ``max_norm``: the step will clip.
    binds: bool = False
    #: The new values wait under the ``after`` keys ([Note: Speculative updates], set aside).
    set_aside: bool = False

    def admit(self, name: str, norm: torch.Tensor) -> bool:
        """Count ``name``'s gradient norm in; True when its update should run now, False when the step
        will clip (its update waits) or skip (an overflow)."""
        value = float(norm)
        if not math.isfinite(value) and self.scaled:
            self.overflow = True
        elif not math.isfinite(value):
            # Unscaled, torch applies it: AdamW spreads the inf or NaN, and clip_grad_norm_'s coefficient
            # is NaN for every gradient, which the step after backward applies as torch does.
            self.binds = self.binds or self.max_norm is not None
        else:
            self.sum_squares += value * value
            if self.max_norm is not None and math.sqrt(self.sum_squares) * self.grad_scale > self.max_norm:
                self.binds = True
        if self.overflow or self.binds or self.set_aside:
            self.waiting[name] = norm
            return False
        self.updated[name] = norm
        return True

    def seen(self, name: str) -> bool:
        """Whether ``name`` has had its final gradient in this step."""
        return name in self.updated or name in self.waiting

    def norms(self) -> dict[str, torch.Tensor]:
        """Every final gradient's norm in this step, by shard name."""
        return {**self.updated, **self.waiting}


class StepModePolicy:
    """Which way each optimizer step runs: its updates inside backward, or the step after backward.

    ``setting`` is ``EngineConfig.step_in_backward``: True (inside backward from the first step),
    False (never), or None (the default: inside backward wherever that gives torch's results). With
    None the first step runs after backward while the engine watches the loop; later steps run inside
    backward unless the loop showed something that cannot be served there (two backwards into one
    step without the engine counting them), and a step after one whose clip norm bound runs after
    backward ([Note: Speculative updates]). Gradients are kept for a redo once clipping is
    configured or asked for (``clip_grad_norm_``), a gradient was read or set between backward and
    step, or the hyperparameters changed between a backward and its step.
    """

    def __init__(self, setting: Optional[bool], ineligible: Optional[str], *, clipping: bool) -> None:
        """``ineligible``: why the configuration rules updates inside backward out, or None."""
        self.setting = setting
        self.ineligible = ineligible
        self.keeps_grads = clipping
        self.loop_fits = True  # no second backward into one step seen
        self.watched = setting is True  # a step after backward has shown the loop (not needed when asked for)
        self.falling_back = False  # the norm binds late: steps run after backward while it binds
        #: The last step's clip norm bound (the next step reads nothing ahead: it may bind at once too).
        self.last_bound = False
        self._wasted = False  # this step updated more than WASTED_UPDATES_TO_FALL_BACK for nothing
        self.reason = ""
        self.decide()

    @property
    def inside(self) -> bool:
        """Whether updates inside backward are possible at all in this run."""
        return self.ineligible is None and self.setting is not False

    def decide(self) -> bool:
        """Whether the next step's updates run inside backward (and :attr:`reason` says why, or why not)."""
        if self.setting is False:
            self.reason = "the step after backward (EngineConfig.step_in_backward=False)"
            return False
        if self.ineligible is not None:
            self.reason = f"the step after backward ({self.ineligible})"
            return False
        if not self.loop_fits:
            self.reason = ("the step after backward (a step took two backwards without the engine counting them: "
                           "use EngineConfig.gradient_accumulation_steps and eng.backward)")
            return False
        if not self.watched:
            self.reason = "the step after backward for the first step, then updates inside backward"
            return False
        if self.falling_back:
            self.reason = "the step after backward while the clip norm binds after updates ran inside backward"
            return False
        self.reason = "updates inside backward" + (", gradients kept for a redo" if self.keeps_grads else "")
        return True

    def redone_for_clipping(self, updated_share: float) -> None:
        """The clip norm bound after updates inside backward of ``updated_share`` of the parameters
        ran (they are rolled back and redone)."""
        self._wasted = updated_share > WASTED_UPDATES_TO_FALL_BACK

    def after_step(self, *, bound: bool) -> None:
        """A step completed, either way (``bound``: its clip norm bound)."""
        self.watched = True
        self.last_bound = bound
        self.falling_back = bound and (self._wasted or self.falling_back)
        self._wasted = False

    def second_backward(self) -> None:
        """A shard had two final gradients in one micro-batch: the loop accumulates by itself."""
        self.loop_fits = False

    def keep_grads(self) -> None:
        """The loop clips, reads or sets gradients, or changes hyperparameters between backward and step."""
        self.keeps_grads = True
