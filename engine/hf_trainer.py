"""Hugging Face ``Trainer`` over a wrapped model: a callback that checkpoints the engine with it.

The Trainer runs a wrapped model as it is: pass ``optimizers=(eng.optimizer, None)`` (it builds
its LR schedule on it), clip with ``EngineConfig.max_grad_norm`` and ``max_grad_norm=0.0`` in
``TrainingArguments`` (its ``clip_grad_norm_`` sees no gradients; they are in the store). Its
checkpoints hold the weights (``model.state_dict()`` gathers them) and the optimizer's
hyperparameters, but not the fp32 master weights and moments, which live in the store; this
callback saves the engine's own checkpoint into each, and a resume loads it first::

    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(eng.optimizer, None),
                      callbacks=[EngineCheckpointCallback(eng)])
    ...
    eng.load_checkpoint(engine_checkpoint(ckpt))        # before the Trainer loads optimizer.pt
    trainer.train(resume_from_checkpoint=ckpt)

A resume without that first line is refused by ``engine.AdamW.load_state_dict`` (step counts
without their moments) rather than training on from fresh moments. One process only: with
several ranks the Trainer wraps the model in ``DistributedDataParallel``, which cannot read
released parameters. Needs ``transformers``.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

#: The engine checkpoint's directory inside a Trainer checkpoint.
ENGINE_SUBDIR = "engine"


def engine_checkpoint(trainer_checkpoint: "str | os.PathLike[str]") -> str:
    """The engine checkpoint saved by :class:`EngineCheckpointCallback` inside ``trainer_checkpoint``."""
    return os.path.join(os.fspath(trainer_checkpoint), ENGINE_SUBDIR)


class EngineCheckpointCallback(TrainerCallback):  # type: ignore[misc]
    """Saves ``eng``'s checkpoint (``eng.save_checkpoint``: shards, fp32 masters, moments, step
    counts) into ``checkpoint-<step>/engine`` each time the Trainer saves a checkpoint. Every
    rank runs it (the save is collective). ``exclude_frozen_parameters``: leave the frozen
    parameters out (a PEFT model's base weights, as the Trainer has DeepSpeed do for one)."""

    def __init__(self, eng: Any, *, exclude_frozen_parameters: bool = False) -> None:
        self._eng = eng
        self._exclude_frozen = exclude_frozen_parameters

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Called by the Trainer right after it wrote ``checkpoint-<global_step>``."""
        trainer_dir = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self._eng.save_checkpoint(engine_checkpoint(trainer_dir), overwrite=True,
                                  exclude_frozen_parameters=self._exclude_frozen)


__all__ = ["ENGINE_SUBDIR", "EngineCheckpointCallback", "engine_checkpoint"]
