"""A weights file in a Hugging Face checkpoint's layout, read under a transformers 5 model's names.

transformers 5 renamed and fused some models' weights (GPT-NeoX's ``embed_out`` is ``lm_head``,
Mixtral's per-expert ``w1``/``w3`` matrices are one ``experts.gate_up_proj`` tensor, ...); its
``from_pretrained`` converts checkpoints written in the old layout, which is the layout of the
models on the Hub and of what ``save_pretrained`` writes. :func:`converted` gives
``engine.wrap(state_dict=...)`` the same conversion: it plans, from the tensor names alone, which
checkpoint tensors make each of the model's (with transformers' own rules,
``get_model_conversion_mapping`` and ``rename_source_key``), and builds a converted tensor when
placement asks for it, reading its checkpoint tensors then (all experts of one layer for a fused
expert tensor; one tensor for a renamed one). A model without conversions, or a transformers
without them (before 5), reads the source as it is.
"""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from engine.io.weight_source import WeightSource


class ConversionGroup:
    """One transformers conversion (a ``WeightConverter``, loading or its reverse for saving) over a
    group of tensors: run once, when the first of the tensors it makes is asked for, reading its
    inputs then, and handed out one name at a time (the group is forgotten when all are taken)."""

    def __init__(self, first: str, template: Any, model: nn.Module,
                 rename: Callable[[str], str] = lambda name: name) -> None:
        self.first = first  # the first made name, which transformers' convert expands from
        self._template = template
        self._model = model
        self._rename = rename
        #: Name, the converter's source pattern it matched, and a reader of the tensor.
        self.inputs: list[tuple[str, str, Callable[[], torch.Tensor]]] = []
        self._made: Optional[dict[str, torch.Tensor]] = None
        self._lock = threading.Lock()  # exports read on read_ahead's worker thread

    def targets(self) -> list[str]:
        """The names it makes, from its target patterns (a one-to-many split makes several)."""
        patterns = self._template.target_patterns
        return [self.first.replace(patterns[0], p, 1) for p in patterns]

    def add(self, name: str, pattern: str, read: Callable[[], torch.Tensor]) -> None:
        """One more input of the conversion."""
        self.inputs.append((name, pattern, read))

    def run(self, values: list[Any]) -> dict[str, torch.Tensor]:
        """The conversion of ``values`` (one per input, in order: tensors, or callables that read them)."""
        converter = copy.deepcopy(self._template)
        for (name, pattern, _), value in zip(self.inputs, values):
            converter.add_tensor(self.first, name, pattern, value)
        made = converter.convert(self.first, model=self._model, config=self._model.config)
        return {self._rename(name): v[0] if isinstance(v, list) else v for name, v in made.items()}

    def take(self, name: str) -> torch.Tensor:
        """The made tensor ``name``, converting (and reading the inputs) on the first call."""
        with self._lock:
            if self._made is None:
                self._made = self.run([read for _, _, read in self.inputs])  # transformers calls each
            value = self._made.pop(name)
            if not self._made:
                self._made = None
            return value.contiguous()  # a split's pieces may be views; files take them whole


def converted(model: nn.Module, source: WeightSource,
              shapes: Optional[Mapping[str, tuple[int, ...]]] = None) -> WeightSource:
    """``source`` under ``model``'s names through transformers' checkpoint conversions for it; the
    source itself when none applies (not a transformers model, no conversion, or a transformers
    before 5). ``shapes``: the tensor names to convert to, with their shapes (default: the
    model's own; a PEFT model's base gives its names before PEFT's renaming)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
    except ImportError:
        return source
    if not isinstance(model, PreTrainedModel):
        return source
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    if shapes is None:
        shapes = {n: tuple(t.shape) for n, t in (*model.named_parameters(remove_duplicate=False),
                                                 *model.named_buffers())}
    present = dict.fromkeys(shapes, True)  # rename_source_key asks `.get(name) is not None`

    renamed: dict[str, str] = {}  # model name -> checkpoint name
    groups: dict[str, ConversionGroup] = {}  # first model name of a conversion -> it
    consumed: set[str] = set()
    for key in sorted(source.names(), key=dot_natural_key):  # experts in numeric order, as transformers stacks them
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, present)
        if target not in shapes and key in shapes:
            target, pattern = key, None
        if target not in shapes:
            continue  # matches nothing: left under its own name, so placement reports it
        if pattern is None:
            renamed.setdefault(target, key)
        else:
            group = groups.get(target)
            if group is None:
                group = groups[target] = ConversionGroup(target, by_pattern[pattern], model)
            group.add(key, pattern, functools.partial(source.read, key))
        consumed.add(key)
    if not groups and all(model_name == key for model_name, key in renamed.items()):
        return source

    made_by = {name: group for group in groups.values() for name in group.targets()}
    untouched = [key for key in source.names() if key not in consumed]

    def get(name: str) -> torch.Tensor:
        group = made_by.get(name)
        if group is not None:
            return group.take(name)
        return source.read(renamed.get(name, name))

    def shape(name: str) -> tuple[int, ...]:
        if name in made_by:
            return shapes[name]  # known once converted; placement checks the copy then
        return source.shape(renamed.get(name, name))

    return WeightSource({**dict.fromkeys(renamed), **dict.fromkeys(made_by), **dict.fromkeys(untouched)}, get,
                        shape, lambda *_exc: source.close(), origin=source.origin)


__all__ = ["ConversionGroup", "converted"]
