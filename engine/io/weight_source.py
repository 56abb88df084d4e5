"""WeightSource: named tensors read one at a time, whatever holds them (a state dict, a file, a
directory of files, a checkpoint): what ``engine.wrap(state_dict=...)`` fills a model from.

Files are never read whole: safetensors through ``safe_open`` (each ``get_tensor`` reads one
tensor), torch files through ``torch.load(mmap=True, weights_only=True)`` (pages come in as a
tensor is copied out). :func:`engine.io.weights.open_weights` picks the right opener.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch


class WeightSource:
    """A read-only view of named tensors; ``used`` records which names were read.

    Args:
        tensors: the names it has (only the keys are used).
        getter: ``getter(name)`` reads the tensor called ``name``.
        shape: ``shape(name)`` gives its shape without reading it.
        closer: called as ``closer(None, None, None)`` by :meth:`close` (a context manager's ``__exit__``).
        origin: where the tensors come from, for messages.
    """

    def __init__(
        self, tensors: Mapping[str, Any], getter: Any, shape: Any, closer: Any = None, origin: str = "state dict"
    ) -> None:
        self._names = set(tensors)
        self._get = getter
        self._shape = shape
        self._close = closer
        self.origin = origin
        self.used: set[str] = set()

    @classmethod
    def from_mapping(cls, state_dict: Mapping[str, Any]) -> "WeightSource":
        """A source over a mapping of name -> tensor (a ``state_dict``).

        Raises:
            TypeError: a key is not a string or a value not a tensor (the first few are named).
        """
        _check_tensors(state_dict, "state_dict")
        return cls(state_dict, state_dict.__getitem__, lambda name: tuple(state_dict[name].shape))

    @classmethod
    def from_file(cls, path: str) -> "WeightSource":
        """A source over one ``.safetensors`` file or one ``torch.save`` file of a state dict.

        Raises:
            ValueError: the file does not exist, or holds something else than a state dict.
            TypeError: the torch file's state dict has a value that is not a tensor.
            ImportError: a ``.safetensors`` file without the safetensors package.
        """
        if not os.path.isfile(path):
            raise ValueError(f"state_dict file {path!r} does not exist")
        if path.endswith(".safetensors"):
            try:
                from safetensors import safe_open
            except ImportError as exc:  # pragma: no cover - safetensors ships with the test extras
                raise ImportError("reading a .safetensors file needs the safetensors package") from exc
            handle = safe_open(path, framework="pt", device="cpu")
            names = {name: None for name in handle.keys()}
            shape = lambda name: tuple(handle.get_slice(name).get_shape())  # noqa: E731 - reads the header only
            return cls(names, handle.get_tensor, shape, getattr(handle, "__exit__", None), origin=path)
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(loaded, Mapping):
            raise ValueError(f"{path!r} holds a {type(loaded).__name__}, not a state dict (mapping of name -> tensor)")
        _check_tensors(loaded, path)
        return cls(loaded, loaded.__getitem__, lambda name: tuple(loaded[name].shape), origin=path)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def names(self) -> list[str]:
        """Every tensor name the source has (in no particular order)."""
        return list(self._names)

    def find(self, names: tuple[str, ...]) -> Optional[str]:
        """The first of ``names`` (a tensor's aliases) the source has, or None."""
        for name in names:
            if name in self._names:
                return name
        return None

    def read(self, name: str) -> torch.Tensor:
        """The tensor called ``name`` (read now, one at a time)."""
        self.used.add(name)
        return self._get(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of the tensor called ``name``, without reading its data."""
        return self._shape(name)

    def unused(self) -> list[str]:
        """Names never read, sorted."""
        return sorted(self._names - self.used)

    def renamed(self, names: Mapping[str, str]) -> "WeightSource":
        """This source under other names: ``names`` maps a new name to the name here it reads (several
        new names may read one tensor). Names here that no new name reads stay visible to
        :meth:`unused` (as entries that match nothing), so a file with tensors the model lacks is
        still reported."""
        targeted = {old for old in names.values() if old in self._names}
        mapped = {new: old for new, old in names.items() if old in self._names}
        untouched = self._names - targeted

        def get(name: str) -> Any:
            return self.read(mapped[name]) if name in mapped else self.read(name)

        def shape(name: str) -> tuple[int, ...]:
            return self._shape(mapped.get(name, name))

        view = WeightSource({**dict.fromkeys(mapped), **dict.fromkeys(untouched)}, get, shape, self._close,
                            origin=self.origin)
        self._close = None  # the view closes the file now
        return view

    def close(self) -> None:
        """Release the file (safetensors)."""
        if self._close is not None:
            self._close(None, None, None)
            self._close = None


def _check_tensors(mapping: Mapping[str, Any], origin: str) -> None:
    bad = [k for k, v in mapping.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"{origin} must map names to tensors; these entries do not: {bad[:5]}")
