"""An export's tensors in the layout ``save_pretrained`` writes under transformers 5.

transformers 5 fuses or renames some models' weights in memory (Mixtral's experts are one
``gate_up_proj`` tensor per layer; GPT-NeoX's ``embed_out`` is ``lm_head``) and its
``save_pretrained`` converts them back, so files keep the layout the Hub and other readers (vLLM,
transformers 4, conversion scripts) know. :func:`hub_layout` does the same for
``eng.save_weights``: it plans the reverse conversion with transformers' own rules from the
names, learns each converted tensor's name and shape by running the conversion on meta tensors,
and reads a group's tensors (one layer's fused experts) only when the first of its outputs is
written, keeping them until the last is.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Optional

import torch
from torch import nn

from engine.safetensors_stream import TensorSpec

Reader = Callable[[], torch.Tensor]


class _Reverted:
    """One reverse conversion: the model tensors it takes (with their readers), the file tensors it
    makes, made once and handed out one name at a time."""

    def __init__(self, first: str, converter: Any, renamings: list[Any], model: nn.Module) -> None:
        self.first = first
        self._template = converter
        self._renamings = renamings
        self._model = model
        self.inputs: list[tuple[TensorSpec, Reader, str]] = []
        self._made: Optional[dict[str, torch.Tensor]] = None
        self._lock = threading.Lock()  # read_ahead may call a reader on its worker thread

    def _convert(self, value: Callable[[TensorSpec, Reader], Any]) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import apply_renamings

        converter = copy.deepcopy(self._template)
        for spec, reader, pattern in self.inputs:
            converter.add_tensor(self.first, spec.name, pattern, value(spec, reader))
        made = converter.convert(self.first, model=self._model, config=self._model.config)
        return {apply_renamings(name, self._renamings): v[0] if isinstance(v, list) else v
                for name, v in made.items()}

    def specs(self) -> list[TensorSpec]:
        """The file tensors this conversion makes, from a run on meta tensors (no data read)."""
        made = self._convert(lambda spec, _: torch.empty(spec.shape, dtype=spec.dtype, device="meta"))
        return [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in made.items()]

    def reader(self, name: str) -> Reader:
        def read() -> torch.Tensor:
            with self._lock:
                if self._made is None:
                    # Callables: transformers calls each to materialize it (its "sync loading").
                    self._made = self._convert(lambda _, reader: reader)
                value = self._made.pop(name)
                if not self._made:
                    self._made = None
                return value.contiguous()

        return read


def hub_layout(model: nn.Module, tensors: list[tuple[TensorSpec, Reader]]) -> list[tuple[TensorSpec, Reader]]:
    """``tensors`` (under ``model``'s names) as ``save_pretrained`` would write them; ``tensors``
    themselves when the model has no conversion (not a transformers model, or before 5)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange, WeightConverter, apply_converters, apply_renamings, dot_natural_key,
        )
    except ImportError:
        return tensors
    if not isinstance(model, PreTrainedModel):
        return tensors
    # As transformers' revert_weight_conversion: the model's own conversions, without the legacy
    # renamings and prefix changes (a model built from its config, not loaded by from_pretrained).
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    if not conversions:
        return tensors
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    converters = [c for c in reverse if isinstance(c, WeightConverter)]
    renamings = [c for c in reverse if not isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}

    layout: list[Any] = []  # (spec, reader) pairs, and each conversion where its first input was
    groups: dict[str, _Reverted] = {}
    changed = False
    for spec, reader in tensors:
        first, pattern = apply_converters(spec.name, converters)
        if pattern is None:
            name = apply_renamings(spec.name, renamings)
            changed |= name != spec.name
            layout.append((TensorSpec(name, spec.dtype, spec.shape), reader))
            continue
        group = groups.get(first)
        if group is None:
            group = groups[first] = _Reverted(first, by_pattern[pattern], renamings, model)
            layout.append(group)
        group.inputs.append((spec, reader, pattern))
    if not groups and not changed:
        return tensors
    out: list[tuple[TensorSpec, Reader]] = []
    for entry in layout:
        if isinstance(entry, _Reverted):
            entry.inputs.sort(key=lambda item: dot_natural_key(item[0].name))  # as transformers orders them
            out.extend((spec, entry.reader(spec.name)) for spec in entry.specs())
        else:
            out.append(entry)
    return out


__all__ = ["hub_layout"]
