"""Hugging Face over the engine: ``engine.from_pretrained`` and accelerate's big-model calls, the
Trainer (:class:`EngineTrainer`), PEFT's LoRA over a base larger than memory, and accelerate's
``save_state`` and DeepSpeed config.

Each name is imported when first asked for, with the library it needs (transformers, accelerate or
PEFT), so ``from engine.integrations.hf import from_pretrained`` does not need accelerate.
"""

from typing import Any

__all__ = [
    "EngineCheckpointCallback", "EngineTrainer", "EngineTrainingArguments", "deepspeed_config_from_accelerate",
    "from_pretrained", "load_checkpoint_and_dispatch", "lora_init", "peft_base_weights", "register_engine_state",
]


def __getattr__(name: str) -> Any:
    """The integration's public names, each imported (with its library) when first asked for."""
    if name in ("EngineTrainer", "EngineCheckpointCallback", "EngineTrainingArguments"):
        from engine.integrations.hf import trainer

        return getattr(trainer, name)
    if name in ("lora_init", "peft_base_weights"):
        from engine.integrations.hf import peft

        return getattr(peft, name)
    if name == "deepspeed_config_from_accelerate":
        from engine.integrations.hf.accelerate_deepspeed import deepspeed_config_from_accelerate

        return deepspeed_config_from_accelerate
    if name == "register_engine_state":
        from engine.integrations.hf.accelerate import register_engine_state

        return register_engine_state
    if name == "from_pretrained":
        from engine.integrations.hf.pretrained import from_pretrained

        return from_pretrained
    if name == "load_checkpoint_and_dispatch":
        from engine.integrations.hf.device_map import load_checkpoint_and_dispatch

        return load_checkpoint_and_dispatch
    raise AttributeError(f"module 'engine.integrations.hf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
