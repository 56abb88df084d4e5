"""Validation and normalisation of what callers hand the store (keys, tensors, devices, batches).

Runs on the caller's thread where it can, so bad input is refused before any work is queued.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from tiered.store.entry import Entry
from tiered.tier import Tier

QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def check_key(key: object) -> None:
    """Refuse a key that is not a string or not valid Unicode (TypeError/ValueError)."""
    if not isinstance(key, str):
        raise TypeError(f"keys are strings, got {type(key).__name__}: {key!r}")
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates: the manifest stores keys as UTF-8 text
            raise ValueError(f"key {key!r} is not valid Unicode ({exc.reason} at {exc.start}); use a valid string") \
                from None


def check_tensor(tensor: object) -> None:
    """Refuse what put cannot store: non-tensors, nested, sparse, meta and quantized tensors."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"put takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_nested:
        raise TypeError("put does not take nested tensors; store each component with t.unbind() instead")
    if tensor.layout is not torch.strided:
        raise TypeError(f"put takes dense (strided) tensors, got layout {tensor.layout}; convert with .to_dense()")
    if tensor.device.type == "meta":
        raise TypeError("put takes a tensor with data, got one on the meta device")
    if tensor.dtype in QUANTIZED or tensor.is_quantized:
        raise TypeError(
            f"put does not take quantized tensors ({tensor.dtype}); store t.int_repr() and the quantizer's "
            "scale and zero point instead"
        )


def check_compress(compress: object) -> None:
    """Refuse a ``compress`` argument that is not True, False or None."""
    if compress is not None and not isinstance(compress, bool):
        raise TypeError(f"compress must be True, False or None, got {compress!r}")


def parse_device(device: "torch.device | str") -> torch.device:
    """``device`` as a torch.device that can hold a get's result: ValueError naming it when it is not
    a device, is the meta device (a tensor without data), or is a CUDA device this process lacks."""
    if not isinstance(device, torch.device):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from None
    if device.type == "meta":
        raise ValueError("device 'meta' holds no data; get a tensor on 'cpu' or a CUDA device (for a tensor's dtype "
                         "and shape without its bytes, use store.info(key))")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise ValueError(f"device {str(device)!r} is not available: this process sees {count} CUDA device(s) "
                             f"(torch {torch.__version__}); get onto 'cpu' or a device it has")
    return device


def plain(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """``tensor`` without autograd, when its memory already holds its values in order; else None."""
    data = tensor.detach() if tensor.requires_grad else tensor
    if data.is_conj() or data.is_neg() or not data.is_contiguous():
        return None
    return data


def dense_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor holding ``tensor``'s values (lazy conjugate/negative views resolved)."""
    return tensor.detach().resolve_conj().resolve_neg().contiguous()


def check_distinct(keys: Sequence[str], what: str) -> None:
    """Refuse a batch that names a key more than once (ValueError listing the repeated keys)."""
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        repeated = sorted({k for k in keys if k in seen or seen.add(k)})  # type: ignore[func-returns-value]
        raise ValueError(f"{what} got the same key more than once: {repeated!r}; pass each key once")


def batch_items(items: object) -> list[tuple[str, torch.Tensor]]:
    """Validate put_many's items (a mapping or an iterable of (key, tensor) pairs) on the caller's thread."""
    if isinstance(items, Mapping):
        pairs = list(items.items())
    elif isinstance(items, (str, bytes, torch.Tensor)) or not isinstance(items, Iterable):
        raise TypeError(
            f"put_many takes a mapping of keys to tensors or (key, tensor) pairs, got {type(items).__name__}"
        )
    else:
        pairs = []
        for item in items:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(f"put_many takes (key, tensor) pairs, got the item {item!r}")
            pairs.append((item[0], item[1]))
    for key, tensor in pairs:
        check_key(key)
        check_tensor(tensor)
    check_distinct([k for k, _ in pairs], "put_many")
    return pairs


def batch_compress(compress: object, pairs: Sequence[tuple[str, Any]]) -> list[Optional[bool]]:
    """put_many's ``compress`` (True, False, None, or a mapping of keys to those) as one setting per
    item of ``pairs``; TypeError for a bad value, ValueError for a mapping naming a key not in the batch."""
    if isinstance(compress, Mapping):
        keys = {k for k, _ in pairs}
        unknown = sorted(str(k) for k in compress if k not in keys)
        if unknown:
            raise ValueError(f"put_many's compress mapping names keys that are not in the batch: {unknown!r}")
        for value in compress.values():
            check_compress(value)
        return [compress.get(k) for k, _ in pairs]
    check_compress(compress)
    return [compress for _ in pairs]  # type: ignore[misc]


def check_keep(keep: object, tier: object = None) -> Optional[Tier]:
    """``keep`` (None, or a tier faster than ``tier`` when given) as a Tier; ValueError otherwise."""
    if keep is None:
        return None
    parsed = Tier.parse(keep)  # type: ignore[arg-type]
    if parsed is Tier.NVME or (tier is not None and parsed.rank >= Tier.parse(tier).rank):  # type: ignore[arg-type]
        raise ValueError(f"keep must be a tier faster than the one written ({tier!r}), got {keep!r}")
    return parsed


def check_atomic(atomic: object, tier: object) -> None:
    """Refuse an ``atomic`` that is not a bool (TypeError), or True with a tier other than nvme (ValueError)."""
    if not isinstance(atomic, bool):
        raise TypeError(f"atomic must be True or False, got {atomic!r}")
    if atomic and Tier.parse(tier) is not Tier.NVME:  # type: ignore[arg-type]
        raise ValueError(f"put_many(atomic=True) commits to nvme in one transaction; got tier={tier!r}")


def key_list(keys: object, what: str) -> list[str]:
    """``keys`` (a sequence of distinct valid keys, for the call ``what``) as a list; TypeError or
    ValueError naming the problem."""
    if isinstance(keys, (str, bytes, torch.Tensor)) or not isinstance(keys, Iterable):
        raise TypeError(f"{what} takes a sequence of keys, got {type(keys).__name__}: {keys!r}")
    keys = list(keys)
    for key in keys:
        check_key(key)
    check_distinct(keys, what)
    return keys


def batch_keys(
    keys: object, out: Optional[Sequence[Optional[torch.Tensor]]]
) -> tuple[list[str], Optional[list[Optional[torch.Tensor]]]]:
    """Validate get_many's keys and ``out`` on the caller's thread."""
    keys = key_list(keys, "get_many")
    if out is None:
        return keys, None
    outs = list(out)
    if len(outs) != len(keys):
        raise ValueError(f"out must hold one tensor (or None) per key: {len(keys)} keys, {len(outs)} in out")
    return keys, outs


def check_out(out: torch.Tensor, entry: Entry) -> None:
    """Refuse an ``out`` tensor that cannot take ``entry``'s bytes as they are."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != entry.dtype or tuple(out.shape) != entry.shape or not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous with dtype {entry.dtype} and shape {entry.shape}, got dtype {out.dtype}, "
            f"shape {tuple(out.shape)}, contiguous={out.is_contiguous()}"
        )


def ready_event(tensor: object) -> Any:
    """A CUDA event on the caller's current stream (captured on the caller's thread), or None: rule 1
    of [Note: CUDA stream order] in tiered.backends.device."""
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event
    return None
