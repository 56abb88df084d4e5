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

import functools
from typing import Any

import torch
from torch import nn

from engine.extensions.transformers_conversion import ConversionGroup
from engine.io.safetensors_stream import Reader, TensorSpec


def hub_layout(model: nn.Module, tensors: list[tuple[TensorSpec, Reader]]) -> list[tuple[TensorSpec, Reader]]:
    """``tensors`` (under ``model``'s names) as ``save_pretrained`` would write them; ``tensors``
    themselves when the model has no conversion (not a transformers model, or before 5)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, dot_natural_key
    except ImportError:
        return tensors
    try:
        from transformers.core_model_loading import apply_converters, apply_renamings
    except ImportError:  # transformers 5 releases before these helpers (5.17 among them): the same steps
        apply_converters, apply_renamings = _apply_converters, _apply_renamings
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
    groups: dict[str, ConversionGroup] = {}
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
            group = groups[first] = ConversionGroup(first, by_pattern[pattern], model,
                                                    functools.partial(apply_renamings, weight_renamings=renamings))
            layout.append(group)
        group.add(spec.name, pattern, reader)
    if not groups and not changed:
        return tensors
    spec_of = {spec.name: spec for spec, _ in tensors}
    out: list[tuple[TensorSpec, Reader]] = []
    for entry in layout:
        if not isinstance(entry, ConversionGroup):
            out.append(entry)
            continue
        entry.inputs.sort(key=lambda item: dot_natural_key(item[0]))  # as transformers orders them
        # The names and shapes it makes, from a run on meta tensors (no data read).
        made = entry.run([torch.empty(spec_of[n].shape, dtype=spec_of[n].dtype, device="meta")
                          for n, _, _ in entry.inputs])
        out.extend((TensorSpec(name, t.dtype, tuple(t.shape)), functools.partial(entry.take, name))
                   for name, t in made.items())
    return out


def _apply_renamings(name: str, weight_renamings: list[Any]) -> str:
    """``name`` through every renaming in turn (transformers' ``apply_renamings``)."""
    for renaming in weight_renamings:
        name, _ = renaming.rename_source_key(name)
    return name


def _apply_converters(name: str, weight_converters: list[Any]) -> tuple[str, Any]:
    """``name`` through the first converter that matches it, and the source pattern that matched
    (None: no converter did); transformers' ``apply_converters``."""
    for converter in weight_converters:
        renamed, pattern = converter.rename_source_key(name)
        if pattern is not None:
            return renamed, pattern
    return name, None


__all__ = ["hub_layout"]
