"""``DeepSpeedEngine``: what ``engine.initialize`` returns, an :class:`~engine.Engine` with
DeepSpeed's ``model_engine`` calls where they differ from the engine's own.

A DeepSpeed script's checkpoint code runs as written::

    _, client_sd = model_engine.load_checkpoint(args.load_dir)    # (None, None): nothing saved yet
    model_engine.save_checkpoint(args.save_dir, client_state=client_sd)   # tag global_step<N>

and so do its bookkeeping calls (``global_steps``, ``global_samples``, ``train_batch_size()``,
``gradient_accumulation_steps()``, ``fp16_enabled()``, ...), ``save_16bit_model``,
``offload_states``/``reload_states`` and ``model_engine.monitor.write_events``; the config's reports
(progress lines, monitors, timings, flops profile, memory lines) come from
:mod:`engine.integrations.deepspeed.reports`. What it does not have goes to the model
(``model_engine.generate(...)``), as DeepSpeed's engine forwards it. Everything else is the
engine's: ``model_engine(batch)``, ``backward``, ``step``, ``device``, ``local_rank``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from engine.checkpoint import sharded as checkpoint
from engine.config.deepspeed import micro_batch_size
from engine.errors import CheckpointError
from engine.integrations.deepspeed.monitor import DeepSpeedMonitor
from engine.integrations.deepspeed.reports import DeepSpeedReports
from engine.integrations.deepspeed.store import ScratchStoreEngine
from engine.io.checkpoint_paths import holds_checkpoint, resolve_checkpoint, tagged_path
from tiered import Tier

#: Where the client state carries :attr:`DeepSpeedEngine.global_steps` for a plain torch optimizer
#: (taken out again on load).
GLOBAL_STEPS = "global_steps"
#: ``save_16bit_model``'s file names written as safetensors by ``save_weights`` rather than torch.save.
SAFETENSORS_NAME = "model.safetensors"
#: A shard size no model reaches: DeepSpeed's ``save_16bit_model`` writes one file.
ONE_FILE = 1 << 62
#: DeepSpeed's ``OffloadStateTypeEnum`` values, the states ``offload_states(include=)`` names.
OFFLOAD_STATES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


class DeepSpeedEngine(ScratchStoreEngine):
    """An :class:`~engine.Engine` whose checkpoint calls take and return what DeepSpeed's do. Made
    by ``engine.initialize``; ``deepspeed_config`` is the DeepSpeed config it was made from,
    ``scratch_dir`` the temporary store directory it removes when it closes (None: it keeps its store)
    and ``monitor`` the config's monitors (:mod:`engine.integrations.deepspeed.monitor`; None: none), which it
    closes with itself."""

    def __init__(self, *args: Any, deepspeed_config: Mapping[str, Any],
                 monitor: Optional[DeepSpeedMonitor] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deepspeed_config = dict(deepspeed_config)
        #: Optimizer steps of a plain torch optimizer (``engine.AdamW`` counts its own in the store).
        self._torch_steps = 0
        #: Store keys ``offload_states`` moved out of the device tier, for ``reload_states``.
        self._offloaded_keys: list[str] = []
        self._reports = DeepSpeedReports(self, self._deepspeed_config,
                                         monitor if monitor is not None else DeepSpeedMonitor())
        #: DeepSpeed's ``model_engine.monitor``: ``monitor.write_events([(name, value, step), ...])``.
        self.monitor = self._reports.monitor

    # ------------------------------------------------------------------ DeepSpeed's counters

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, skipped fp16 steps included (a loaded checkpoint's too), as
        DeepSpeed counts them."""
        if self._training is None:
            return self._torch_steps
        return self.completed_steps + self.skipped_steps

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``model_engine(batch)``: the model's forward, with the config's reports around it."""
        with self._reports.forward():
            return super().__call__(*args, **kwargs)

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """:meth:`Engine.backward`, with the config's reports around it."""
        with self._reports.backward():
            super().backward(loss, **kwargs)

    def step(self) -> bool:
        """:meth:`Engine.step`, counting the optimizer steps of a plain torch optimizer for
        :attr:`global_steps`, then DeepSpeed's reports (:mod:`engine.integrations.deepspeed.reports`): with the
        config's ``steps_per_print`` = N, rank 0 prints DeepSpeed's progress line (``[Rank 0]
        step=N, skipped=0, lr=[...], mom=[...]``) and its throughput line every N optimizer steps;
        with a monitor on, rank 0 writes ``Train/Samples/lr`` (and ``loss_scale`` with fp16) at
        :attr:`global_samples`; ``wall_clock_breakdown``, ``flops_profiler`` and
        ``memory_breakdown`` print theirs."""
        boundary = self.is_gradient_accumulation_boundary()
        with self._reports.step():
            applied = super().step()
            if boundary and self._training is None:
                self._torch_steps += 1
        return applied

    @property
    def global_samples(self) -> int:
        """Samples trained on, all ranks together: ``global_steps x train_batch_size()``."""
        return self.global_steps * self.train_batch_size()

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the config's, or derived from ``train_batch_size``)."""
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on each rank: the config's ``train_micro_batch_size_per_gpu``, or
        ``train_batch_size / (gradient_accumulation_steps x world size)``."""
        micro = micro_batch_size(self._deepspeed_config, self.gradient_accumulation_steps(), self.world_size)
        if micro is None:
            raise ValueError("the DeepSpeed config sets neither train_batch_size nor train_micro_batch_size_per_gpu; "
                             "set one to have batch sizes")
        return micro

    def train_batch_size(self) -> int:
        """Samples per optimizer step, all ranks together: micro-batch x accumulation steps x world size."""
        return self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() * self.world_size

    def get_mom(self) -> list[Any]:
        """Each parameter group's momentum, as DeepSpeed's ``get_mom()`` logs it: Adam's ``betas``,
        or SGD's and RMSprop's ``momentum``."""
        if self.optimizer is None:
            raise RuntimeError("get_mom() needs an optimizer: give engine.initialize one, or an \"optimizer\" section")
        key = "momentum" if isinstance(self.optimizer, (torch.optim.SGD, torch.optim.RMSprop)) else "betas"
        return [group.get(key, 0.0) for group in self.optimizer.param_groups]

    def get_batch_info(self) -> tuple[Callable[[], int], Callable[[], int], Callable[[], int]]:
        """DeepSpeed's: the methods :meth:`train_batch_size`, :meth:`train_micro_batch_size_per_gpu`
        and :meth:`gradient_accumulation_steps` (the methods, not their values, as DeepSpeed returns)."""
        return self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps

    def steps_per_print(self) -> Optional[int]:
        """The config's ``steps_per_print`` (None, DeepSpeed's default, when it has none or ``"auto"``)."""
        every = self._deepspeed_config.get("steps_per_print")
        return every if isinstance(every, int) else None

    def gradient_clipping(self) -> float:
        """The global gradient norm the step clips at (0.0: no clipping), DeepSpeed's ``gradient_clipping``."""
        return float(self.config.max_grad_norm or 0.0)

    def wall_clock_breakdown(self) -> bool:
        """Whether the config's ``wall_clock_breakdown`` is on."""
        return self._reports.wall_clock_breakdown

    def get_wall_clock_timers(self) -> dict[str, float]:
        """With ``wall_clock_breakdown``, milliseconds by DeepSpeed's timer name as of the last
        :meth:`step` call: that call's ``fwd_microstep``, ``bwd_microstep``, ``step_microstep``, and
        the window's ``fwd``, ``bwd``, ``step`` so far (the whole window after an optimizer step).
        Empty before the first call and without ``wall_clock_breakdown``."""
        return self._reports.wall_clock_timers()

    def fp16_enabled(self) -> bool:
        """Whether parameters train in float16 (the config's ``fp16.enabled``)."""
        return self.config.train_dtype == "float16"

    def bfloat16_enabled(self) -> bool:
        """Whether parameters train in bfloat16 (the config's ``bf16.enabled``)."""
        return self.config.train_dtype == "bfloat16"

    def zero_optimization_stage(self) -> int:
        """3: parameters, gradients and optimizer state are all sharded, whatever stage the config
        names (a stage 1 or 2 config runs as ZeRO-3: the same steps)."""
        return 3

    def empty_partition_cache(self) -> None:
        """DeepSpeed's name for :meth:`drop_prefetched`: free the parameters held ahead of their
        next use (after generation or evaluation, before memory-hungry work outside the model)."""
        self.drop_prefetched()

    def offload_states(self, include: Optional[Iterable[Any]] = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's: free the accelerator memory the engine holds while other work needs it (an
        RLHF loop generating with an inference engine between training steps). The parameters
        prefetched ahead are released and every parameter shard in the store's device tier moves
        to the host tier (optimizer state, master weights and gradients never live in the device
        tier); :meth:`reload_states` brings the shards back. ``include`` takes DeepSpeed's state
        names (``lp_params`` is the one held on the device here; the others have nothing to move);
        ``device`` must be the CPU, as in DeepSpeed; the host tier is pinned whenever CUDA is present
        (``pin_memory``), and the moves complete before the call returns (``non_blocking``)."""
        self._check_open()
        names = {getattr(name, "value", name) for name in include} if include is not None else set(OFFLOAD_STATES)
        unknown = sorted(map(str, names - set(OFFLOAD_STATES)))
        if unknown:
            raise ValueError(f"offload_states: unknown state(s) {unknown}; DeepSpeed's are {list(OFFLOAD_STATES)}")
        if str(getattr(device, "value", device)) != "cpu":
            raise ValueError(f"offload_states moves states to the CPU only (as DeepSpeed's), got device={device!r}")
        if "lp_params" not in names:
            return
        self.drop_prefetched()
        store = self.store
        on_device = [key for key in store.keys()
                     if Tier.DEVICE in (info := store.info(key)).tiers and not info.pinned]
        for key in on_device:
            store.sync.evict(key, Tier.HOST)
        self._offloaded_keys = on_device
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, for the other engine

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's: bring back to the device tier what :meth:`offload_states` moved out. With
        ``non_blocking`` the transfers are started and the call returns; the forward waits for any
        shard it needs before they finish. Without a preceding offload, nothing moves."""
        self._check_open()
        keys, self._offloaded_keys = self._offloaded_keys, []
        transfers = [self.store.prefetch(key, Tier.DEVICE) for key in keys if key in self.store]
        if not non_blocking:
            for transfer in transfers:
                transfer.result()

    def destroy(self) -> None:
        """DeepSpeed's name for :meth:`close`."""
        self.close()

    def _shutdown(self) -> None:
        super()._shutdown()
        self._reports.close()

    # ------------------------------------------------------------------ DeepSpeed's checkpoint calls

    def save_checkpoint(  # type: ignore[override]
        self, save_dir: "str | os.PathLike[str]", tag: Any = None, client_state: Optional[Mapping[str, Any]] = None,
        save_latest: bool = True, exclude_frozen_parameters: bool = False, *, overwrite: Optional[bool] = None,
    ) -> bool:
        """DeepSpeed's ``save_checkpoint``: to ``save_dir/tag`` (default tag ``global_step<N>``),
        then, with ``save_latest``, ``save_dir/latest`` names it. ``client_state`` holds JSON
        values and tensors here (never pickled). Every rank calls it. A checkpoint already saved
        under ``tag`` is replaced, as DeepSpeed replaces it, once the new one is complete (a crash
        before then leaves the old one whole); ``overwrite=False`` refuses instead, and a directory
        there that is no checkpoint is never replaced unless ``overwrite=True``. Returns True, as
        DeepSpeed does."""
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        if overwrite is None:  # DeepSpeed's: replace what an earlier save put under the tag
            overwrite = checkpoint.holds_saved_checkpoint(tagged_path(save_dir, tag))
        if self._training is None:  # engine.AdamW's steps are in the checkpoint's step record
            client_state = {**(client_state or {}), GLOBAL_STEPS: self._torch_steps}
        self._save_checkpoint(save_dir, tag, client_state, overwrite=overwrite,
                              exclude_frozen_parameters=exclude_frozen_parameters, save_latest=save_latest)
        return True

    def load_checkpoint(  # type: ignore[override]
        self, load_dir: "str | os.PathLike[str]", tag: Any = None, load_module_strict: bool = True,
        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True, load_module_only: bool = False,
    ) -> tuple[Optional[str], Optional[dict[str, Any]]]:
        """DeepSpeed's ``load_checkpoint``: returns ``(load_path, client_state)``, or ``(None,
        None)`` with a warning when ``tag`` is None and ``load_dir`` holds no checkpoint (no
        ``latest`` file): a script that loads before its first save starts afresh. ``load_dir``
        may also be one of the engine's untagged checkpoints, or an imported DeepSpeed one
        (``tiered import-deepspeed``). Not ``load_optimizer_states``: no master weights, moments
        or per-parameter step counts, but :attr:`global_steps` and the LR schedule load, as
        DeepSpeed's (the schedule unless not ``load_lr_scheduler_states``); ``load_module_only``:
        weights and buffers only. The engine
        checks every name, so ``load_module_strict=False`` is refused."""
        if not load_module_strict:
            raise ValueError("load_checkpoint(load_module_strict=False) is not supported: the engine loads only "
                             "checkpoints of this model, every name checked; export the weights and pass them "
                             "to engine.wrap(state_dict=...) to load a partial set")
        tag = None if tag is None else str(tag)
        if tag is None and not self._everyone_finds_checkpoint(load_dir):
            warnings.warn(f"no checkpoint to load at {os.fspath(load_dir)!r} (no 'latest' file naming a tag): "
                          f"starting without one, as DeepSpeed does; pass a tag to load a particular one",
                          stacklevel=2)
            return None, None
        client_state = self._load_checkpoint(
            load_dir, tag, load_optimizer=load_optimizer_states and not load_module_only,
            load_lr_scheduler=load_lr_scheduler_states and not load_module_only, load_step_count=not load_module_only)
        steps = client_state.pop(GLOBAL_STEPS, None)
        if steps is not None and self._training is None and not load_module_only:
            self._torch_steps = int(steps)
        return resolve_checkpoint(load_dir, tag), client_state

    def _everyone_finds_checkpoint(self, load_dir: "str | os.PathLike[str]") -> bool:
        """Whether ``load_dir`` holds a checkpoint, the same answer on every rank (a rank that went on
        to load alone would wait for the others forever)."""
        self._check_open()
        found = checkpoint.gather_objects(self._io, holds_checkpoint(load_dir))
        if len(set(found)) > 1:
            raise CheckpointError(
                f"ranks {[r for r, f in enumerate(found) if f]} find a checkpoint at {os.fspath(load_dir)!r} and "
                f"ranks {[r for r, f in enumerate(found) if not f]} do not: give every rank a path that reaches it")
        return found[0]

    def save_fp16_model(self, save_dir: "str | os.PathLike[str]", save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name for :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def save_16bit_model(
        self, save_dir: "str | os.PathLike[str]", save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's ``save_16bit_model``: the whole model in its training dtype to
        ``save_dir/save_filename``, a ``torch.save`` file as DeepSpeed writes (gathered in memory:
        :meth:`save_weights` streams one tensor at a time instead). ``model.safetensors`` is
        written by :meth:`save_weights`, as one file. Every rank calls it; rank 0 writes. Returns True."""
        if save_filename == SAFETENSORS_NAME:
            self.save_weights(save_dir, max_shard_bytes=ONE_FILE, exclude_frozen_parameters=exclude_frozen_parameters)
            return True
        if not save_filename or os.sep in save_filename or save_filename.endswith(".safetensors"):
            raise ValueError(f"save_filename must be a file name: {SAFETENSORS_NAME!r} or a torch file name "
                             f"such as 'pytorch_model.bin', got {save_filename!r}")
        state = self.state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if self._io.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(os.fspath(save_dir), save_filename)
            torch.save(state, path + ".partial")
            os.replace(path + ".partial", path)
        return True


__all__ = ["DeepSpeedEngine"]
