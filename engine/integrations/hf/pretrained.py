"""``engine.from_pretrained``: a Hugging Face model straight into the store, as
``AutoModelForCausalLM.from_pretrained(name, device_map="auto", offload_folder=...)`` gives it
with accelerate, but with its weights in the tiered store (on NVMe by default) and paged in by the
engine's hooks, so the model may be larger than memory::

    eng = engine.from_pretrained("Qwen/Qwen2.5-0.5B", config=engine.EngineConfig(
        store=tiered.StoreConfig(path="/nvme/qwen")))
    eng.model.generate(ids, max_new_tokens=20)

or with accelerate's arguments as a carried-over call has them::

    eng = engine.from_pretrained("Qwen/Qwen2.5-0.5B", device_map="auto", offload_folder="/nvme/qwen",
                                 max_memory={0: "20GiB", "cpu": "60GiB"})

The model is built on the meta device from its ``config.json`` and filled one tensor at a time
from its weights files (safetensors or ``pytorch_model.bin``, sharded or not, converted as
transformers 5 converts them), in the checkpoint's dtype as ``from_pretrained`` keeps it, in
eval mode, with its ``generation_config.json``. A name that is not a directory is fetched from the
Hub with ``huggingface_hub.snapshot_download`` (config, weights, tokenizer files).
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from engine.config import EngineConfig
from engine.engine import Engine, wrap
from engine.extensions.transformers_layout import meta_model
from engine.integrations.hf.device_map import accelerate_config
from engine.io.pretrained_weights import WEIGHT_FILES

if TYPE_CHECKING:
    import transformers

#: What is fetched from the Hub: configs and weights (safetensors first; torch files only without them).
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]


def from_pretrained(
    name_or_path: "str | os.PathLike[str]",
    *,
    config: "EngineConfig | transformers.PretrainedConfig | None" = None,
    model_class: Any = None,
    dtype: "torch.dtype | str | None" = "auto",
    optimizer: Optional[torch.optim.Optimizer] = None,
    revision: Optional[str] = None,
    trust_remote_code: bool = False,
    local_files_only: bool = False,
    torch_dtype: "torch.dtype | str | None" = None,
    attn_implementation: Optional[str] = None,
    cache_dir: "str | os.PathLike[str] | None" = None,
    token: "str | bool | None" = None,
    device_map: Any = None,
    max_memory: Optional[Mapping[Any, Any]] = None,
    offload_folder: "str | os.PathLike[str] | None" = None,
    low_cpu_mem_usage: Optional[bool] = None,
    **config_overrides: Any,
) -> Engine:
    """A Hugging Face model wrapped by the engine, its weights read from ``name_or_path`` (a
    ``save_pretrained`` directory, or a Hub name) into ``config``'s store one tensor at a time.

    ``model_class``: the class whose ``from_config`` builds it (default
    ``transformers.AutoModelForCausalLM``). ``dtype``: the parameters' dtype, ``"auto"`` for the
    checkpoint's (its config's ``dtype``, else fp32), as ``from_pretrained`` keeps it
    (``config.train_dtype``, when set, casts parameters and buffers after); ``torch_dtype`` is its
    older transformers name. ``attn_implementation`` (``"sdpa"``, ``"eager"``, ...), ``revision``,
    ``cache_dir``, ``token``, ``trust_remote_code``, ``local_files_only``: as transformers' own.
    ``optimizer``: as for :func:`engine.wrap` (an ``engine.AdamW`` binds to the model when built
    without parameters). ``config`` may also be transformers' configuration of the model, as
    transformers' ``from_pretrained`` takes it; the store is then ``offload_folder``. The model is
    ``eng.model``, in eval mode.

    accelerate's big-model arguments carry over (``engine.integrations.hf.device_map``): ``offload_folder`` is
    the store's directory when there is no ``config``; ``max_memory`` ({GPU index, ``"cpu"``,
    ``"disk"``: size}) sets the store's budget per tier; ``device_map`` (``"auto"``, or a device)
    picks the compute device, the local GPU under ``"auto"`` when there is one. ``low_cpu_mem_usage``
    is accepted: the weights are always read one tensor at a time.

    Other keyword arguments change the model's configuration, as transformers' ``from_pretrained``
    takes them (``num_labels=3`` for a classification head, ``use_cache=False``); one the
    configuration does not have is a TypeError. Tensors the checkpoint lacks (a new head) are
    initialized as transformers initializes them, and named in a warning."""
    import transformers

    hf_config = None
    if isinstance(config, transformers.PretrainedConfig):  # transformers' own config=: the model's configuration
        if config_overrides:
            raise ValueError(f"from_pretrained: set {sorted(config_overrides)} on the {type(config).__name__} passed "
                             "as config=, or pass them without it")
        if offload_folder is None:
            raise ValueError(f"from_pretrained: config= is the model's configuration here (a "
                             f"{type(config).__name__}), so the store needs offload_folder=DIR")
        hf_config, config = config, None
    elif config is not None and not isinstance(config, EngineConfig):
        raise TypeError(f"from_pretrained: config must be an engine.EngineConfig (or transformers' configuration "
                        f"of the model), got {type(config).__name__}")
    config = accelerate_config(config, device_map=device_map, max_memory=max_memory, offload_folder=offload_folder)
    del low_cpu_mem_usage  # always low: one tensor in memory at a time

    if torch_dtype is not None:
        if dtype != "auto":
            raise ValueError(f"from_pretrained: pass dtype= or its older name torch_dtype=, not both "
                             f"(got dtype={dtype!r}, torch_dtype={torch_dtype!r})")
        dtype = torch_dtype
    hub = {"revision": revision, "local_files_only": local_files_only, "cache_dir": cache_dir, "token": token}
    folder = _resolve(os.fspath(name_or_path), hub)
    model = meta_model(folder, model_class=model_class, dtype=dtype, trust_remote_code=trust_remote_code,
                       attn_implementation=attn_implementation, config_overrides=config_overrides, hf_config=hf_config)
    generation = os.path.join(folder, "generation_config.json")
    if os.path.isfile(generation) and getattr(model, "generation_config", None) is not None:
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    model.eval()
    return wrap(model, config=config, optimizer=optimizer, state_dict=folder)


def _resolve(name: str, hub: dict[str, Any]) -> str:
    """A local directory holding the model's config and weights: ``name`` itself, or a Hub snapshot
    (``hub``: snapshot_download's revision, local_files_only, cache_dir and token)."""
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise ValueError(f"from_pretrained takes a model directory or a Hub name, got the file {name!r}")
    if os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1:  # a path, never a Hub name
        raise FileNotFoundError(errno.ENOENT, f"from_pretrained: the directory {name!r} does not exist (pass a "
                                "save_pretrained directory, or a Hub name such as 'org/model')", name)
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError

    try:
        folder = snapshot_download(name, allow_patterns=HUB_FILES, **hub)
    except HFValidationError as exc:
        raise ValueError(f"from_pretrained: {name!r} is neither a directory nor a Hub name ({exc})") from None
    if not any(os.path.isfile(os.path.join(folder, f)) for f in WEIGHT_FILES):  # an older model: torch files
        folder = snapshot_download(name, allow_patterns=[*HUB_FILES, "*.bin"], **hub)
    return folder


__all__ = ["from_pretrained"]
