"""Extensions: what the engine's core asks of the model libraries it serves, without importing them.

The core (paging, optimizer, checkpoints) knows nothing about any model library. Where a library's
models need something of it, the core asks the :class:`Extensions` value the engine was given
(``engine.wrap(..., extensions=...)``; :attr:`engine.Engine.extensions`). Today that is one thing,
a library's *weight layout*: the names and fused tensors its checkpoints use on disk are not always
those of its modules in memory (transformers 5 fuses an MoE's per-expert matrices into one tensor,
renames GPT-NeoX's ``embed_out``), so a load converts a checkpoint to the model's names and an
export converts back.

An extension is a plain object with the methods of a protocol below; an :class:`Extensions` value
holds them in the order they apply. Nothing registers itself anywhere: whoever wraps a model passes
the value (:data:`DEFAULT_EXTENSIONS`, with the transformers layout, unless told otherwise).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Protocol

from torch import nn

from engine.extensions.transformers_layout import TransformersLayout
from engine.io.safetensors_stream import Reader, TensorSpec
from engine.io.weight_source import WeightSource

#: Tensors to write, each with the reader that produces it, in file order.
Tensors = list[tuple[TensorSpec, Reader]]


class WeightLayout(Protocol):
    """How one model library lays its models' weights out on disk.

    Both methods return their input unchanged for a model that is not the library's, or that needs
    no conversion; neither reads a tensor until the returned source or reader is asked for it.
    """

    def loading(self, model: nn.Module, source: WeightSource,
                shapes: Optional[Mapping[str, tuple[int, ...]]] = None) -> WeightSource:
        """``source`` (a checkpoint in the library's on-disk layout) under ``model``'s own names.

        Args:
            model: the model being filled (its class says which conversions apply).
            source: the checkpoint's tensors, under the names on disk.
            shapes: the names to convert to, with their shapes (default: ``model``'s own).

        Returns:
            A source under the model's names (``source`` itself when nothing is converted); it
            closes ``source`` when it is closed.
        """
        ...

    def saving(self, model: nn.Module, tensors: Tensors) -> Tensors:
        """``tensors`` (under ``model``'s names) as the library writes them to disk.

        Args:
            model: the model whose weights these are.
            tensors: (spec, reader) pairs in ``model.state_dict()`` order.

        Returns:
            The pairs to write (``tensors`` itself when nothing is converted).
        """
        ...


@dataclasses.dataclass(frozen=True)
class Extensions:
    """The extensions an engine consults, in the order they apply.

    Args:
        weight_layouts: each library's :class:`WeightLayout`; a load applies them in order, an
            export too (a layout leaves other libraries' models alone).

    Raises:
        TypeError: an entry of ``weight_layouts`` lacks ``loading`` or ``saving``.
    """

    weight_layouts: tuple[WeightLayout, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.weight_layouts, tuple):
            raise TypeError(f"Extensions.weight_layouts must be a tuple, got {type(self.weight_layouts).__name__}")
        for layout in self.weight_layouts:
            if not all(callable(getattr(layout, name, None)) for name in ("loading", "saving")):
                raise TypeError(f"a weight layout needs loading() and saving() methods, got {type(layout).__name__}")

    def loading(self, model: nn.Module, source: WeightSource,
                shapes: Optional[Mapping[str, tuple[int, ...]]] = None) -> WeightSource:
        """``source`` through every layout's :meth:`WeightLayout.loading`, in order."""
        for layout in self.weight_layouts:
            source = layout.loading(model, source, shapes)
        return source

    def saving(self, model: nn.Module, tensors: Tensors) -> Tensors:
        """``tensors`` through every layout's :meth:`WeightLayout.saving`, in order."""
        for layout in self.weight_layouts:
            tensors = layout.saving(model, tensors)
        return tensors


#: What ``engine.wrap`` uses unless given other extensions: the transformers layout (a no-op for
#: any other model, and without transformers installed).
DEFAULT_EXTENSIONS = Extensions(weight_layouts=(TransformersLayout(),))
