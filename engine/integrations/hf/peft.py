"""A PEFT (LoRA) model over a base on the meta device: the base's weights read from its files.

A LoRA fine-tune of a model larger than memory builds the base on the meta device, adds the
adapters with ``peft.get_peft_model`` (which leaves them on meta too) and wraps the result, so
that no tensor is ever materialized whole. Two things differ from wrapping the base itself: PEFT
renames the base's weights (``transformer.h.0.attn.c_attn.weight`` becomes
``base_model.model.transformer.h.0.attn.c_attn.base_layer.weight``), and the adapters need PEFT's
initialization, not ``nn.Linear``'s (``lora_B`` starts at zero, so the model starts as the base)::

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=1e-4), config=config,
                      state_dict=peft_base_weights(model, path), init_fn=lora_init(model))
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from torch import nn

from engine.extensions import TransformersLayout
from engine.io.weight_source import WeightSource
from engine.io.weights import StateDictLike, open_weights

#: The prefix a PEFT model puts before its base model's names.
_PEFT_PREFIX = "base_model.model."


def base_name(name: str) -> str:
    """The base model's name for a PEFT model's tensor ``name`` (its LoRA tensors keep theirs)."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    parts = name.split(".")
    out: list[str] = []
    i = 0
    while i < len(parts):
        if parts[i] in ("base_layer", "original_module"):
            i += 1
        elif parts[i] == "modules_to_save" and i + 1 < len(parts):
            i += 2  # modules_to_save.<adapter>: a trainable copy of the base module, which starts from it
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out)


def peft_base_weights(model: nn.Module, weights: StateDictLike) -> WeightSource:
    """``weights`` (what ``engine.wrap(state_dict=...)`` takes: a ``save_pretrained`` directory, a
    file, a mapping) of ``model``'s base model, under the names ``model`` (a PEFT model) gives
    them, for ``engine.wrap(model, state_dict=...)``. The adapters' tensors are not in it: wrap
    initializes them (pass ``init_fn=lora_init(model)``). A checkpoint in the layout transformers 5
    converts on load (an MoE's per-expert matrices, ...) is converted for the base model first.

    Returns:
        An open source (``engine.wrap`` closes it), read one tensor at a time.

    Raises:
        TypeError, ValueError: ``weights`` is not something ``engine.wrap(state_dict=...)`` reads
            (see :func:`engine.io.weights.open_weights`).
    """
    source = open_weights(weights)
    assert source is not None
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    base = _base_model(model)
    if base is not None:
        source = TransformersLayout().loading(base, source, {base_name(n): tuple(t.shape) for n, t in tensors})
    return source.renamed({name: base_name(name) for name, _ in tensors})


def _base_model(model: nn.Module) -> Optional[nn.Module]:
    """A PEFT model's base (the transformers model, its LoRA layers inside); None for another module."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else None


def lora_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """An ``init_fn`` for ``engine.wrap`` that initializes ``model``'s LoRA adapters on the meta
    device as PEFT does by default (``init_lora_weights=True``): ``lora_A`` Kaiming-uniform,
    ``lora_B`` zero, so the wrapped model starts equal to its base. Any other module it is called
    for is reset with its ``reset_parameters()`` and the base model's ``_init_weights`` (a Hugging
    Face model's: a rotary embedding's buffers come from there). ValueError for adapters it
    cannot initialize (other ``init_lora_weights`` settings, embedding LoRA, DoRA): initialize
    those with an ``init_fn`` of your own."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        raise TypeError(f"lora_init takes a PEFT model (peft.PeftModel), got {type(model).__name__}")
    for adapter, cfg in configs.items():
        if getattr(cfg, "lora_bias", False):
            raise ValueError(f"adapter {adapter!r}: lora_bias=True is not initialized by lora_init; "
                             "pass an init_fn of your own")
        if getattr(cfg, "init_lora_weights", True) is not True:
            raise ValueError(
                f"adapter {adapter!r}: init_lora_weights={cfg.init_lora_weights!r}; lora_init reproduces PEFT's "
                "default (True) only: pass an init_fn of your own for this adapter"
            )
    zero: set[int] = set()
    kaiming: set[int] = set()
    for name, module in model.named_modules():
        if any(len(getattr(module, attr, ())) for attr in ("lora_embedding_A", "lora_magnitude_vector")):
            raise ValueError(f"{name}: embedding LoRA and DoRA adapters are not initialized by lora_init; "
                             "pass an init_fn of your own")
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if isinstance(lora_a, nn.ModuleDict) and isinstance(lora_b, nn.ModuleDict):
            kaiming.update(id(m) for m in lora_a.values())
            zero.update(id(m) for m in lora_b.values())

    base_init = getattr(_base_model(model), "_init_weights", None)

    def init(module: nn.Module) -> None:
        if id(module) in kaiming:  # PEFT's reset_lora_parameters for init_lora_weights=True
            nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
            return
        if id(module) in zero:
            nn.init.zeros_(module.weight)
            return
        # The base model's modules as wrap initializes them without an init_fn (a rotary embedding's
        # buffers come from the base's own _init_weights); wrap reports anything left unset.
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset) and not callable(base_init):
            raise ValueError(f"lora_init: {type(module).__name__} has tensors no weights file set and no "
                             "reset_parameters(); pass an init_fn of your own")
        if callable(reset):
            reset()
        if callable(base_init):
            base_init(module)

    return init


__all__ = ["base_name", "lora_init", "peft_base_weights"]
