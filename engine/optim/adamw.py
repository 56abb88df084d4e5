"""engine.AdamW: the optimizer users hand to ``engine.wrap``; its state lives in the store."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence

import torch

from engine.config import EngineConfig
from engine.optim import step as optimizer_step
from engine.optim.adamw_kernel import AdamWKernel, load_adamw_kernel
from engine.optim.clip import AllReduceSum
from engine.optim.step_io import AsyncTensorStore
from engine.optim.types import AdamHyper, OptimShard, OptimStepStats


#: The keys of a parameter group the update reads.
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")

class WholeState(Protocol):
    """What the engine gives a bound ``engine.AdamW`` to read and load its whole state
    (``engine.checkpoint.optimizer_state``)."""

    def read(self, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole state in torch's format, with these ``param_groups``."""

    def load(self, state_dict: Mapping[str, Any]) -> None:
        """Commit ``state_dict``'s moments, masters and step counts to the store."""


class AdamW(torch.optim.Optimizer):
    """AdamW whose fp32 master weights and moments live in the engine's store, updated by a
    streamed, pipelined CPU step (``engine.optim.step``) with torch's own AdamW math.

    Usually built without parameters: ``engine.wrap(model, optimizer=AdamW(lr=...))`` binds it to
    all of the model's parameters, in one group. Or given parameter groups as torch's optimizers
    are (``AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay":
    0.0}], lr=...)``, the model's own Parameter objects): each group keeps its hyperparameters, and
    wrap checks that every trainable parameter is in exactly one group. It is a real
    ``torch.optim.Optimizer``, so torch LR schedulers drive each group's ``lr``; they may be created
    before or after wrap, since the groups exist from the start. ``step()`` runs the engine's step;
    calling it before the optimizer is bound raises RuntimeError. ``foreach``/``fused`` choose
    torch's math path as for ``torch.optim.AdamW`` (default: torch's CPU default, the single-tensor
    path, computed in one pass where the engine's kernel of it builds and matches torch bit for bit:
    ``math_path``; [Note: One-pass AdamW]).
    """

    def __init__(
        self,
        params: Optional[Iterable[Any]] = None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
    ) -> None:
        if isinstance(params, (int, float)):
            raise TypeError(
                f"engine.AdamW takes the parameters or parameter groups first, as torch.optim.AdamW does (or "
                f"nothing: wrap binds the model's); got {params!r}: pass the learning rate as lr={params!r}"
            )
        defaults = dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps, weight_decay=weight_decay,
            amsgrad=False, maximize=False,
            foreach=foreach, fused=fused, capturable=False, differentiable=False, decoupled_weight_decay=True,
        )
        #: True when the caller gave the parameter groups (else wrap puts every parameter in one).
        self.grouped = params is not None
        super().__init__([{"params": []}] if params is None else params, defaults)  # torch's checks
        for group in self.param_groups:  # the defaults and every group's own settings, with the value shown
            betas = group["betas"]
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise ValueError(f"AdamW betas must be a pair (beta1, beta2), got {betas!r}")
            group["betas"] = tuple(betas)
            AdamHyper(group["lr"], betas[0], betas[1], group["eps"], group["weight_decay"], foreach, fused)
        self._step_fn: Optional[Callable[[], Any]] = None
        self._zero_grad_fn: Optional[Callable[[bool], None]] = None
        self._shard_steps: dict[str, int] = {}
        self._state_in_store = False
        #: The engine's reader and loader of the whole state ([Note: The optimizer's state dict]).
        self._whole_state: Optional[WholeState] = None
        self._state_in_checkpoints = False
        self._math: Optional[tuple[Optional[AdamWKernel], str]] = None  # loaded at the first need

    # ------------------------------------------------------------------ binding (engine side)

    @property
    def bound(self) -> bool:
        """True once ``engine.wrap`` has bound the optimizer to a model."""
        return self._step_fn is not None

    def _bind(self, params: Iterable[torch.nn.Parameter], step_fn: Callable[[], Any],
              zero_grad_fn: Optional[Callable[[bool], None]] = None, *, state_in_store: bool = False) -> None:
        """Give the optimizer its parameters (one group) and the engine's step; called by wrap.

        ``step_fn()`` runs when ``step()`` is called (``eng.step()`` should call ``optimizer.step()``
        so LR schedulers and step hooks see it); ``zero_grad_fn(set_to_none)`` after ``zero_grad()``.
        ``state_in_store``: the caller keeps the moments and their step counts (the engine's step
        record), so :meth:`load_state_dict` may not change the counts.
        """
        if self.bound:
            raise RuntimeError("this engine.AdamW is already bound to a model; create one optimizer per wrap")
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable, got {step_fn!r}")
        if not self.grouped:  # else the caller's groups stay: the engine checked they cover the model (group_of)
            group = self.param_groups[0]
            self.param_groups.clear()
            try:
                self.add_param_group(dict(group, params=list(params)))  # torch's checks: tensors, leaves, no duplicates
                checked = self.param_groups[0]["params"]
            finally:
                self.param_groups[:] = [group]  # the same dict: whoever holds it (a scheduler) sees the params
            group["params"] = checked
        self._step_fn = step_fn
        self._zero_grad_fn = zero_grad_fn
        self._state_in_store = state_in_store

    def _bind_whole_state(self, whole_state: "WholeState") -> None:
        """Give :meth:`state_dict` / :meth:`load_state_dict` the engine's reader and loader of the
        whole state in the store (``engine.checkpoint.optimizer_state``); called by the engine."""
        self._whole_state = whole_state

    def group_of(self, named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, int]:
        """Name -> index of the parameter group holding it, for the trainable ones of
        ``named_params`` (all in group 0 unless the groups were given). ValueError for a trainable
        parameter in no group, or a group holding a tensor that is not among them."""
        named = list(named_params)
        if not self.grouped:
            return {name: 0 for name, p in named if p.requires_grad}
        index = {id(p): i for i, group in enumerate(self.param_groups) for p in group["params"]}
        ours = {id(p) for _, p in named}
        foreign = sum(1 for group in self.param_groups for p in group["params"] if id(p) not in ours)
        if foreign:
            raise ValueError(
                f"engine.AdamW's parameter groups hold {foreign} tensor(s) that are not the wrapped model's "
                "parameters: build the groups from this model's parameters (model.named_parameters())"
            )
        missing = [name for name, p in named if p.requires_grad and id(p) not in index]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameter(s) are in none of engine.AdamW's parameter groups, so nothing "
                f"would update them: {missing[:5]}; add them to a group, or set requires_grad=False to freeze them"
            )
        return {name: index[id(p)] for name, p in named if p.requires_grad}

    # ------------------------------------------------------------------ torch.optim.Optimizer API

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Run the engine's optimizer step (after ``closure()``, if given, under grad mode)."""
        if self._step_fn is None:
            raise RuntimeError(
                "engine.AdamW.step() was called before the optimizer was bound to a model: pass it to "
                "engine.wrap(model, optimizer=...) and step with eng.step()"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_fn()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad on the bound parameters, then the engine's (gradient shards in the store)."""
        super().zero_grad(set_to_none)
        if self._zero_grad_fn is not None:
            self._zero_grad_fn(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's whole state in torch's AdamW format, once bound to an engine: per parameter
        its ``step``, ``exp_avg``, ``exp_avg_sq`` and fp32 ``master`` weight, whole, on the CPU, read
        from the store; ``param_groups`` as torch's; the engine's completed steps and loss scale.
        ``load_state_dict`` of it into a fresh engine resumes bit for bit (and sets the parameters
        from the masters, as loading DeepSpeed's optimizer state does). It costs the whole state in
        memory at once (12 bytes a trainable parameter): larger than half the memory available, or
        sharded over several ranks, it raises RuntimeError naming ``eng.save_checkpoint``, which
        streams it (docs/training.md, "Checkpoints"); after the engine closed, EngineClosedError.
        Before ``engine.wrap`` there is no state (torch's format, empty), and after
        :meth:`leave_state_to_checkpoints` the dict holds the hyperparameters and step counts alone
        (:meth:`hyperparameter_state_dict`)."""
        if self._whole_state is None or self._state_in_checkpoints:
            return self.hyperparameter_state_dict()
        return self._whole_state.read(super().state_dict()["param_groups"])

    def hyperparameter_state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict without the per-parameter state (its ``param_groups``), plus
        ``shard_steps`` (updates taken per shard name): what goes beside the engine's checkpoint, which
        holds the master weights and moments."""
        sd = super().state_dict()
        sd["shard_steps"] = dict(self._shard_steps)
        return sd

    def leave_state_to_checkpoints(self, leave: bool = True) -> None:
        """Have :meth:`state_dict` return :meth:`hyperparameter_state_dict` (``leave=False``: the
        whole state again). For a caller that saves ``eng.save_checkpoint`` beside each optimizer
        state dict, as ``EngineCheckpointCallback`` (so ``EngineTrainer``) and
        ``register_engine_state`` do: the state is in that checkpoint, which a resume loads before
        this dict (whose step counts :meth:`load_state_dict` then checks)."""
        if not isinstance(leave, bool):
            raise TypeError(f"leave must be a bool, got {type(leave).__name__}")
        self._state_in_checkpoints = leave

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of :meth:`state_dict` (or of a torch ``AdamW``: masters then start from
        the parameters' values), moments, masters and step counts committed to the store at once and
        the parameters set from the masters, or of :meth:`hyperparameter_state_dict` (hyperparameters
        and step counts).

        The whole state loads once the optimizer is bound (``engine.wrap``): ValueError before, and
        RuntimeError at world size > 1 (use ``eng.load_checkpoint``). Hyperparameters and step counts
        alone: once bound, the step counts belong to the master weights and moments in the store,
        which such a dict does not carry, so one whose counts differ from the engine's (a Hugging Face
        Trainer resuming its ``optimizer.pt`` before ``eng.load_checkpoint``, say) is refused, since
        taking its counts over other moments would train silently wrong. A dict that does not fit
        raises before anything changes."""
        sd = dict(state_dict)
        if sd.get("state") or "engine" in sd:
            self._load_whole_state(sd)
            return
        steps = sd.pop("shard_steps", {})
        if not isinstance(steps, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in steps.items()
        ):
            raise ValueError(f"state_dict['shard_steps'] must map shard names to step counts >= 0, got {steps!r}")
        if self._state_in_store and {k: v for k, v in steps.items() if v} != {
                k: v for k, v in self._shard_steps.items() if v}:
            differ = sorted(k for k in set(steps) | set(self._shard_steps)
                            if steps.get(k, 0) != self._shard_steps.get(k, 0))
            raise ValueError(
                f"this state dict's step counts ({differ[0]!r}: {steps.get(differ[0], 0)}) differ from the engine's "
                f"({self._shard_steps.get(differ[0], 0)}), and the moments they belong to are not in it (they live in "
                "the engine's store): restore them with eng.load_checkpoint(dir) before loading this state dict"
            )
        super().load_state_dict(sd)
        self._shard_steps = dict(steps)

    def _load_whole_state(self, sd: dict[str, Any]) -> None:
        if self._whole_state is None:
            raise ValueError(
                "this state dict holds engine.AdamW's whole state (moments and masters), which lives in the "
                "engine's store: load it after engine.wrap(model, optimizer=this optimizer)"
            )
        groups = sd.get("param_groups")
        ours = [len(g["params"]) for g in self.param_groups]
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple))
                                                   for g in groups) or [len(g["params"]) for g in groups] != ours:
            raise ValueError(
                f"the state dict's parameter groups do not match this optimizer's ({len(self.param_groups)} group(s) "
                f"of {ours} parameters): build the optimizer as the run that saved it did"
            )
        missing = sorted({key for g in groups for key in _HYPERPARAMETERS if key not in g})
        if missing:
            raise ValueError(f"the state dict's parameter groups lack {missing}: it is not an AdamW state dict")
        self._whole_state.load(sd)
        super().load_state_dict({"state": {}, "param_groups": groups})

    # ------------------------------------------------------------------ the offloaded step

    def adamw_kernel(self) -> Optional[AdamWKernel]:
        """The one-pass kernel the steps use for groups on torch's single-tensor path, built and
        compared with torch at the first call ([Note: One-pass AdamW]); None where torch's function
        runs instead (``math_path`` says why)."""
        if self._math is None:
            self._math = load_adamw_kernel()
        return self._math[0]

    @property
    def math_path(self) -> str:
        """One line: which AdamW arithmetic the steps run (the one-pass kernel, or torch's function and
        why); ``engine.wrap`` logs it. Groups with ``foreach``/``fused`` set run torch's in any case."""
        self.adamw_kernel()
        assert self._math is not None
        return self._math[1]

    def hyperparameters(self) -> list[AdamHyper]:
        """Each parameter group's current hyperparameters (an LR scheduler's lr included)."""
        return [
            AdamHyper(g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"], g["foreach"], g["fused"])
            for g in self.param_groups
        ]

    @property
    def shard_steps(self) -> dict[str, int]:
        """Updates taken so far by each shard, by shard name (a copy)."""
        return dict(self._shard_steps)

    def _set_shard_steps(self, steps: Mapping[str, int]) -> None:
        """Replace the per-shard step counts (the engine, resuming from its step record)."""
        self._shard_steps = {str(k): int(v) for k, v in steps.items()}

    def run_step(
        self,
        store: AsyncTensorStore,
        shards: Sequence[OptimShard],
        *,
        config: EngineConfig,
        grad_norms: Optional[Mapping[str, torch.Tensor]] = None,
        all_reduce: Optional[AllReduceSum] = None,
        on_event: Optional[optimizer_step.EventHook] = None,
        grad_scale: float = 1.0,
        grad_norm: Optional[torch.Tensor] = None,
        clip_to: Optional[float] = None,
        hypers: Optional[Sequence[AdamHyper]] = None,
        clip_coef: Optional[torch.Tensor] = None,
        atomic: bool = False,
        progress: Optional[optimizer_step.ProgressHook] = None,
    ) -> OptimStepStats:
        """One offloaded AdamW step over ``shards`` with this optimizer's hyperparameters and step
        counts and ``config``'s tiers, compression, group size and clipping (the engine's
        ``step_fn`` calls this); ``grad_scale``/``grad_norm`` as for ``optimizer_step.step_async``.
        ``clip_to``: clip to at most this norm for this step (``eng.clip_grad_norm_``), the smaller
        of it and ``config.max_grad_norm``. ``hypers`` / ``clip_coef``: recorded values to use instead
        of the groups' current ones and the clipping (a step finished after it stopped part way);
        ``atomic`` / ``progress`` as for ``optimizer_step.step_async``. Blocks; counts are updated
        only when the step succeeds."""
        max_grad_norm = config.max_grad_norm
        if clip_to is not None:
            max_grad_norm = clip_to if max_grad_norm is None else min(clip_to, max_grad_norm)
        stats = optimizer_step.step(
            store,
            shards,
            list(hypers) if hypers is not None else self.hyperparameters(),
            self._shard_steps,
            state_tier=config.optimizer_tier,
            param_tier=config.param_tier,
            compress=config.compress_optimizer,
            group_bytes=config.optimizer_group_bytes,
            max_grad_norm=max_grad_norm,
            grad_norms=grad_norms,
            all_reduce=all_reduce,
            on_event=on_event,
            grad_scale=grad_scale,
            grad_norm=grad_norm,
            in_place=config.updates_in_place,
            clip_coef=clip_coef,
            atomic=atomic,
            progress=progress,
            keep=config.cache_tier,
            kernel=self.adamw_kernel(),
        )
        self._shard_steps.update(stats.step_counts)
        return stats
