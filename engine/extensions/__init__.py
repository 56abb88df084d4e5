"""Extension points of the engine's core, and the extensions it ships with.

The core consults an :class:`Extensions` value for what depends on the model's library (today: the
weight layout of its checkpoints) instead of importing that library's code: see
:mod:`engine.extensions.registry`. The transformers layout (:mod:`engine.extensions.transformers_layout`)
is in :data:`DEFAULT_EXTENSIONS`; it imports transformers only when handed a transformers model.
"""

from engine.extensions.registry import DEFAULT_EXTENSIONS, Extensions, WeightLayout
from engine.extensions.transformers_layout import TransformersLayout

__all__ = ["DEFAULT_EXTENSIONS", "Extensions", "TransformersLayout", "WeightLayout"]
