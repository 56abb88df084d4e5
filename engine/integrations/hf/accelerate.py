"""accelerate's ``save_state`` / ``load_state`` over a wrapped model: :func:`register_engine_state`.

``accelerator.save_state(dir)`` saves what accelerate prepared: the optimizer's ``state_dict``
(``engine.AdamW``'s whole state in one process; with :func:`register_engine_state`, its
hyperparameters and step counts alone, the fp32 master weights and moments going to the engine's
checkpoint),
LR schedulers, data loader positions, RNG states. The model, kept out of ``prepare`` (see
docs/migrating.md), is not in it. :func:`register_engine_state` adds accelerate's own state hooks
so each ``save_state`` also writes ``eng.save_checkpoint`` into ``dir/engine`` (every rank takes
part, as every rank calls ``save_state``), and each ``load_state`` loads it first, before
accelerate restores the optimizer (which refuses step counts without their moments)::

    register_engine_state(accelerator, eng)
    ...
    accelerator.save_state("/ckpt/step100")      # accelerate's files + /ckpt/step100/engine
    accelerator.load_state("/ckpt/step100")      # the engine's checkpoint first, then accelerate's

:func:`deepspeed_config_from_accelerate` (from :mod:`engine.integrations.hf.accelerate_deepspeed`) gives the
DeepSpeed config of an ``accelerate config`` file that trains with DeepSpeed, for
``engine.initialize``.

Needs ``accelerate``.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from torch.utils.hooks import RemovableHandle

from engine.integrations.hf.accelerate_deepspeed import (
    ALONE_WITHOUT_GPU,
    check_engine_accelerator,
    deepspeed_config_from_accelerate,
)
from engine.io.checkpoint_paths import engine_checkpoint


def register_engine_state(
    accelerator: Accelerator, eng: Any, *, exclude_frozen_parameters: bool = False
) -> tuple[RemovableHandle, RemovableHandle]:
    """Make ``accelerator.save_state`` / ``load_state`` save and load ``eng``'s checkpoint (shards,
    fp32 masters, moments, step counts, loss scale) in ``<dir>/engine``, and ``engine.AdamW``'s
    ``state_dict()`` (which accelerate saves beside it) leave those to it
    (``AdamW.leave_state_to_checkpoints``; ``leave_state_to_checkpoints(False)`` undoes it).
    ``exclude_frozen_parameters``: leave frozen parameters out of it (a PEFT model's base weights).
    Returns the two hooks' handles (``handle.remove()`` unregisters). ``ValueError`` when the
    accelerator runs another number of processes than ``eng`` is sharded over (one of them was
    made outside the launcher's process group), saying which."""
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"register_engine_state takes an accelerate.Accelerator, got {type(accelerator).__name__}")
    check_engine_accelerator(accelerator)
    if accelerator.num_processes != eng.world_size:
        why = (ALONE_WITHOUT_GPU if accelerator.num_processes < eng.world_size else
               "the model was wrapped before the Accelerator joined the launcher's processes: make the "
               "Accelerator first, then engine.wrap, so that each rank keeps its shard and the gradients are averaged")
        raise ValueError(f"the Accelerator runs {accelerator.num_processes} process(es) but the engine is sharded "
                         f"over {eng.world_size}: {why}")

    # engine.AdamW: its moments and masters go into the engine checkpoint below
    leave = getattr(getattr(eng, "optimizer", None), "leave_state_to_checkpoints", None)
    if leave is not None:
        leave()

    def save(models: list, weights: list, output_dir: str) -> None:
        eng.save_checkpoint(engine_checkpoint(output_dir), overwrite=True,
                            exclude_frozen_parameters=exclude_frozen_parameters)

    def load(models: list, input_dir: str) -> None:
        eng.load_checkpoint(engine_checkpoint(input_dir))

    return accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)


__all__ = ["deepspeed_config_from_accelerate", "register_engine_state"]
