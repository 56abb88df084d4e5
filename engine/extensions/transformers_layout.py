"""The weight layout of transformers models, and their construction on the meta device.

:class:`TransformersLayout` is the :class:`~engine.extensions.registry.WeightLayout` of transformers
5 models: loading converts a checkpoint in the layout ``save_pretrained`` writes (and the Hub holds)
to the model's names and fused tensors (:mod:`engine.extensions.transformers_conversion`); saving
converts back (:mod:`engine.extensions.transformers_export`). Both leave any other model, and every
model under a transformers without conversions (before 5), as it is. transformers is imported only
inside these functions, when a model is handed to them.

:func:`meta_model` builds a model from its ``config.json`` on the meta device, as
``from_pretrained`` builds it: for ``engine.from_pretrained`` and for ``tiered export --hf-config``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch
from torch import nn

from engine.extensions.transformers_conversion import converted
from engine.extensions.transformers_export import hub_layout
from engine.io.safetensors_stream import Reader, TensorSpec
from engine.io.weight_source import WeightSource


class TransformersLayout:
    """transformers 5's checkpoint conversions, as a weight layout (stateless; one instance serves all)."""

    def loading(self, model: nn.Module, source: WeightSource,
                shapes: Optional[Mapping[str, tuple[int, ...]]] = None) -> WeightSource:
        """``source`` under ``model``'s names through transformers' conversions for it; ``source``
        itself when none applies. ``shapes``: the names to convert to, with their shapes (default:
        the model's own; a PEFT model's base gives its names before PEFT's renaming)."""
        return converted(model, source, shapes)

    def saving(self, model: nn.Module, tensors: list[tuple[TensorSpec, Reader]]) -> list[tuple[TensorSpec, Reader]]:
        """``tensors`` (under ``model``'s names) as ``save_pretrained`` writes them."""
        return hub_layout(model, tensors)

    def __repr__(self) -> str:
        return "TransformersLayout()"


def meta_model(folder: "str | os.PathLike[str]", *, model_class: Any = None, dtype: "torch.dtype | str | None" = "auto",
               trust_remote_code: bool = False, attn_implementation: Optional[str] = None,
               config_overrides: Optional[Mapping[str, Any]] = None, hf_config: Any = None) -> Any:
    """The model ``folder``'s ``config.json`` (or ``hf_config``) describes (with ``config_overrides``
    set on it), on the meta device, built as ``from_pretrained`` builds it: parameters in ``dtype`` (see
    :func:`engine.from_pretrained`), buffers as the model's code makes them (a rotary embedding's
    ``inv_freq`` stays fp32)."""
    import transformers

    unused: dict[str, Any] = {}
    if hf_config is None:
        hf_config, unused = transformers.AutoConfig.from_pretrained(
            os.fspath(folder), trust_remote_code=trust_remote_code, return_unused_kwargs=True,
            **(config_overrides or {}))
    if unused:
        raise TypeError(f"from_pretrained got keyword arguments that are neither its own nor settings of "
                        f"{type(hf_config).__name__}: {sorted(unused)}")
    cls = model_class if model_class is not None else transformers.AutoModelForCausalLM
    kwargs: dict[str, Any] = {_dtype_name(): _dtype(dtype, hf_config)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        if callable(getattr(cls, "from_config", None)):  # the Auto classes
            return cls.from_config(hf_config, trust_remote_code=trust_remote_code, **kwargs)
        return cls._from_config(hf_config, **kwargs)


def _dtype_name() -> str:
    """What this transformers calls a model's dtype: ``dtype`` from version 5 (``torch_dtype`` is
    deprecated there), ``torch_dtype`` before."""
    import transformers

    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def _dtype(dtype: "torch.dtype | str | None", hf_config: Any) -> torch.dtype:
    """The parameters' dtype: the checkpoint's for "auto" (its config's, else fp32), else ``dtype``."""
    if dtype == "auto":
        saved = getattr(hf_config, _dtype_name(), None)  # the other name warns that it is deprecated
        dtype = saved if saved is not None else torch.float32
    if dtype is None:
        dtype = torch.get_default_dtype()
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(f"from_pretrained: dtype must be 'auto', None or a floating torch dtype, got {dtype!r}")
    return found


__all__ = ["TransformersLayout", "meta_model"]
