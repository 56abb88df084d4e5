"""EngineConfig: every knob of the engine, validated on construction."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Union

from engine.config.loss_scaling import LossScaling
from tiered import StoreConfig

MiB = 1024 * 1024

#: Tiers a parameter shard may live in between uses.
PARAM_TIERS = ("device", "host", "nvme")
#: Tiers gradient shards, fp32 master weights and Adam moments may live in.
STATE_TIERS = ("host", "nvme")
#: Values of EngineConfig.host_budget: what StoreConfig.host_bytes bounds.
HOST_BUDGETS = ("total", "host_tier")
#: Values of EngineConfig.train_dtype (torch dtype names).
TRAIN_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Configuration of :func:`engine.wrap`: every field below, validated when it is made.

    ``store`` configures the :class:`tiered.TieredStore` the engine opens (one per rank, in a
    ``rank{N}`` subdirectory of ``store.path`` when the world size is above 1). Byte figures are
    per rank. :meth:`from_deepspeed` builds one from a DeepSpeed JSON config.

    Raises:
        ValueError: a field has a value it cannot take (the message names the field and the value).
        TypeError: ``store`` is not a ``tiered.StoreConfig``.
    """

    store: StoreConfig
    #: What ``store.host_bytes`` bounds. "total": every byte of host memory the engine and its store
    #: hold (the host tier gets what staging, the buffer pool of parameters and the step's groups,
    #: gradients in flight and the codec leave; wrap refuses a budget below the model's minimum, and
    #: shrinks ``prefetch_bytes``, ``optimizer_group_bytes``, ``optimizer_prefetch_groups`` and
    #: staging to fit where needed: docs/training.md, "Memory model"). "host_tier": the host tier
    #: alone, the rest on top at the sizes their own fields set.
    host_budget: str = "total"
    #: Where parameter shards (in the training dtype) live between uses.
    param_tier: str = "nvme"
    #: Most bytes of parameters fetched ahead of use along the recorded order; 0 fetches on demand.
    prefetch_bytes: int = 256 * MiB
    #: Where fp32 master weights and Adam moments live (engine.AdamW).
    optimizer_tier: str = "nvme"
    #: Update master weights and moments where they lie in host memory (``store.modify``) instead of
    #: writing each step's new values to a second slot: no copies, but a step that fails part way
    #: leaves some shards updated (as torch's optimizers do). None (default) does so exactly when
    #: ``optimizer_tier`` is "host", whose state a crash loses anyway; True needs "host".
    optimizer_in_place: Optional[bool] = None
    #: Where fp32 gradient shards wait between backward and step().
    grad_tier: str = "host"
    #: Store master weights and moments compressed (lossless byte-plane zstd, docs/compression.md).
    compress_optimizer: bool = False
    #: Clip the global gradient norm to this before each step; None does not clip.
    max_grad_norm: Optional[float] = None
    #: fp32 shard bytes the optimizer step streams through AdamW per group (read i+1 while updating
    #: i and writing i-1, so about three groups of master + moments + gradient are in memory).
    optimizer_group_bytes: int = 64 * MiB
    #: Groups of the step whose master + moments are read while backward runs (12 bytes per element
    #: each, held until the step; docs/training.md); 0 reads all state in the step.
    optimizer_prefetch_groups: int = 1
    #: Where parameters are materialized for compute; None uses the device the model is on. On an
    #: accelerator the model's forward inputs are moved there too.
    compute_device: Optional[str] = None
    #: Dtype floating parameters are trained in ("float32", "bfloat16", "float16"), for wrap to cast
    #: them to before they go to the store (fp32 master weights are kept either way); None keeps the
    #: model's own dtypes. DeepSpeed's ``bf16.enabled`` maps here.
    train_dtype: Optional[str] = None
    #: Scale the loss against fp16 gradient underflow and skip steps whose gradients overflow
    #: (``engine.LossScaling()``: dynamic, DeepSpeed's defaults). Needs ``eng.backward(loss)``
    #: in place of ``loss.backward()``. DeepSpeed's ``fp16`` section maps here.
    loss_scaling: Optional[LossScaling] = None
    #: Where tensors saved for backward (activations) go during forward: None keeps them in memory
    #: as plain PyTorch does; "host" or "nvme" puts each saved storage of at least
    #: ``activation_min_bytes`` in that tier of the store and reads it back, ahead of need, in
    #: backward (docs/training.md, "Activations in the store"). DeepSpeed's
    #: ``activation_checkpointing.cpu_checkpointing`` maps to "host".
    activation_tier: Optional[str] = None
    #: Saved storages smaller than this stay in memory (each offload costs a put, a get and a delete).
    activation_min_bytes: int = 1 * MiB
    #: Most bytes of saved tensors held in memory for puts not yet finished (forward waits beyond it),
    #: and most bytes read back ahead of their use (backward).
    activation_window_bytes: int = 64 * MiB
    #: Micro-batches per optimizer step, counted by the engine as DeepSpeed counts them:
    #: ``eng.backward(loss)`` divides the loss by it and ``eng.step()``, called after every
    #: micro-batch, steps the optimizer (then zeroes the gradients) on every N-th call. 1 steps on
    #: every call. DeepSpeed's ``gradient_accumulation_steps`` maps here.
    gradient_accumulation_steps: int = 1
    #: Draw a progress bar on stderr for wrap, checkpoints and ``save_weights`` when they move at
    #: least 256 MiB (rank 0, and only when stderr is a terminal).
    progress: bool = True
    #: Cast floating tensors among the model's forward inputs to ``train_dtype`` before each forward
    #: (FSDP2's ``cast_forward_inputs``; DeepSpeed's ``fp16.auto_cast`` maps here). Needs ``train_dtype``.
    cast_forward_inputs: bool = False
    #: Apply each parameter's AdamW update inside backward, the moment its gradient is final (after
    #: the accumulation window's last micro-batch); ``eng.step()`` then validates it against the global
    #: gradient norm (clipping), an overflow (loss scaling) and the hyperparameters, and commits it, or
    #: rolls it back and redoes it (docs/training.md, "Updates inside backward"). Results equal the
    #: step after backward's bit for bit. None (default): wherever that is possible (``engine.AdamW``,
    #: parameters and optimizer state on nvme), from the second step on, once the first has shown the
    #: loop; True: from the first step (needs those too); False: never.
    step_in_backward: Optional[bool] = None
    #: Resume from the store's own state at ``store.path`` (after a crash, or a clean close):
    #: parameters, fp32 master weights, Adam moments and step counts of the last completed
    #: ``engine.AdamW`` step. False starts afresh, discarding any training state the store holds.
    resume: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.store, StoreConfig):
            raise TypeError(f"EngineConfig.store must be a tiered.StoreConfig, got {type(self.store).__name__}")
        _check_choice("host_budget", self.host_budget, HOST_BUDGETS)
        _check_choice("param_tier", self.param_tier, PARAM_TIERS)
        _check_choice("optimizer_tier", self.optimizer_tier, STATE_TIERS)
        _check_choice("grad_tier", self.grad_tier, STATE_TIERS)
        _check_int("prefetch_bytes", self.prefetch_bytes, minimum=0)
        _check_int("optimizer_group_bytes", self.optimizer_group_bytes, minimum=1)
        _check_int("optimizer_prefetch_groups", self.optimizer_prefetch_groups, minimum=0)
        _check_choice("activation_tier", self.activation_tier, (*STATE_TIERS, None))
        _check_int("activation_min_bytes", self.activation_min_bytes, minimum=1)
        _check_int("activation_window_bytes", self.activation_window_bytes, minimum=1)
        _check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, minimum=1)
        if self.optimizer_in_place is not None and not isinstance(self.optimizer_in_place, bool):
            raise ValueError(
                f"EngineConfig.optimizer_in_place must be True, False or None, got {self.optimizer_in_place!r}"
            )
        if self.optimizer_in_place and self.optimizer_tier != "host":
            raise ValueError(
                f"EngineConfig.optimizer_in_place=True updates state in host memory, but optimizer_tier is "
                f"{self.optimizer_tier!r}: set optimizer_tier='host', or leave optimizer_in_place None (a state on "
                "nvme is written to a second slot, so a crash mid-step leaves the previous one whole)"
            )
        if not isinstance(self.compress_optimizer, bool):
            raise ValueError(f"EngineConfig.compress_optimizer must be True or False, got {self.compress_optimizer!r}")
        if self.max_grad_norm is not None:
            if isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, (int, float)):
                raise ValueError(f"EngineConfig.max_grad_norm must be a number or None, got {self.max_grad_norm!r}")
            if not self.max_grad_norm > 0:
                raise ValueError(f"EngineConfig.max_grad_norm must be > 0, got {self.max_grad_norm!r}")
        if self.compute_device is not None and not isinstance(self.compute_device, str):
            raise ValueError(f"EngineConfig.compute_device must be a device string, got {self.compute_device!r}")
        if self.train_dtype is not None:
            _check_choice("train_dtype", self.train_dtype, TRAIN_DTYPES)
        if self.loss_scaling is not None and not isinstance(self.loss_scaling, LossScaling):
            raise TypeError(
                "EngineConfig.loss_scaling must be an engine.LossScaling or None, "
                f"got {type(self.loss_scaling).__name__}"
            )
        if not isinstance(self.cast_forward_inputs, bool):
            raise ValueError(
                f"EngineConfig.cast_forward_inputs must be True or False, got {self.cast_forward_inputs!r}"
            )
        if self.cast_forward_inputs and self.train_dtype is None:
            raise ValueError(
                "EngineConfig.cast_forward_inputs casts inputs to train_dtype, which is None: set "
                "train_dtype='float16' or 'bfloat16' too"
            )
        if not isinstance(self.progress, bool):
            raise ValueError(f"EngineConfig.progress must be True or False, got {self.progress!r}")
        if not isinstance(self.resume, bool):
            raise ValueError(f"EngineConfig.resume must be True or False, got {self.resume!r}")
        if self.step_in_backward is not None and not isinstance(self.step_in_backward, bool):
            raise ValueError(
                f"EngineConfig.step_in_backward must be None, True or False, got {self.step_in_backward!r}"
            )
        if self.step_in_backward and updates_in_backward_ruled_out(self) is not None:
            raise ValueError(f"EngineConfig.step_in_backward=True: {updates_in_backward_ruled_out(self)}")

    @property
    def cache_tier(self) -> Optional[str]:
        """Where the store may keep parameter shards on nvme across steps: "host" when the host tier
        has a budget and the parameters live on nvme, else None (docs/training.md, "Memory
        model": the host tier as a cache)."""
        return "host" if self.param_tier == "nvme" and self.store.host_bytes != 0 else None

    @property
    def stores_gradients(self) -> bool:
        """Whether gradient shards go to the store's ``grad_tier``: always, except with
        ``step_in_backward=True`` and no accumulation, where each update takes its gradient (or keeps
        it on nvme for a redo)."""
        return self.step_in_backward is not True or self.gradient_accumulation_steps > 1

    @property
    def updates_in_place(self) -> bool:
        """Whether the optimizer step updates state in place (``optimizer_in_place`` resolved)."""
        return self.optimizer_tier == "host" if self.optimizer_in_place is None else self.optimizer_in_place

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_deepspeed(
        cls, ds_config: Union[Mapping[str, Any], str, "os.PathLike[str]"], *, store: StoreConfig, **overrides: Any
    ) -> "EngineConfig":
        """An EngineConfig from a DeepSpeed JSON config (a dict or a path to the JSON file).

        Maps the ``zero_optimization`` section (offload_param, offload_optimizer, stage3_* keys),
        ``aio`` and ``gradient_clipping``; unknown or unsupported keys raise ``ValueError`` naming
        them. ``overrides`` set EngineConfig fields directly. docs/training.md has the mapping.
        """
        # Imported here: the key tables are large, and `import engine` needs none of them.
        from engine.config.deepspeed import config_from_deepspeed

        return config_from_deepspeed(cls, ds_config, store=store, **overrides)


def updates_in_backward_ruled_out(config: EngineConfig) -> Optional[str]:
    """Why ``config`` rules updates inside backward out (``step_in_backward``), or None: they keep the
    values from before the step aside on nvme until it commits, so the parameters and the optimizer
    state must live there."""
    if config.param_tier != "nvme" or config.optimizer_tier != "nvme":
        return (f"updates inside backward keep the values from before the step on nvme, and need param_tier='nvme' "
                f"and optimizer_tier='nvme' (got {config.param_tier!r} and {config.optimizer_tier!r})")
    return None


def _check_choice(name: str, value: object, choices: tuple[Optional[str], ...]) -> None:
    if value not in choices:
        raise ValueError(f"EngineConfig.{name} must be one of {choices}, got {value!r}")


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"EngineConfig.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"EngineConfig.{name} must be >= {minimum}, got {value}")
