"""The machinery of the DeepSpeed config schema: how one key is handled (:class:`Key`), the value
checkers the key tables use, and :func:`walk_schema`, which checks a config section against a table.

The tables themselves are in :mod:`engine.config.deepspeed` (the whole config) and
:mod:`engine.config.deepspeed_optimizer` (its ``optimizer`` and ``scheduler`` sections).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from typing import Any, Callable, Mapping, Optional, Union

from engine.errors import EngineError

#: What a key does: its value sets a field (MAP); it is checked and has no effect, for a stated
#: reason (ACCEPT); it is a DeepSpeed feature the engine lacks, accepted only at its "off" value
#: (DEFAULT_ONLY).
MAP, ACCEPT, DEFAULT_ONLY = "map", "accept", "default-only"


class InvalidValue(EngineError, ValueError):
    """A value of the wrong type or range (message: what was expected). Raised by a checker and
    collected by :func:`walk_schema` as a problem naming the key; it does not leave this package."""


@dataclasses.dataclass(frozen=True)
class Key:
    """How one DeepSpeed key is handled: ``check`` normalizes its value (raising
    :class:`InvalidValue` on a bad one), ``action`` is MAP, ACCEPT or DEFAULT_ONLY, ``why`` says
    what it maps to or why it has no effect, ``default`` is the one value a DEFAULT_ONLY key takes."""

    check: Callable[[Any], Any]
    action: str
    why: str
    default: Any = None


Schema = Mapping[str, Union[Key, "Schema"]]  # type: ignore[misc]


def check_bool(v: Any) -> bool:
    """``v`` if it is true or false; InvalidValue otherwise."""
    if not isinstance(v, bool):
        raise InvalidValue("must be true or false")
    return v


def check_int(minimum: Optional[int] = 0) -> Callable[[Any], int]:
    """A checker of integers of at least ``minimum`` (None: any); it returns the int."""

    def check(v: Any) -> int:
        # JSON writes 5e7 as a float; DeepSpeed (pydantic) accepts integral floats for int fields.
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidValue("must be an integer")
        if minimum is not None and v < minimum:
            raise InvalidValue(f"must be >= {minimum}")
        return v

    return check


def check_number(low: float = 0.0, high: Optional[float] = None) -> Callable[[Any], float]:
    """A checker of finite numbers in ``[low, high]`` (no upper bound when ``high`` is None); it
    returns the float."""

    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InvalidValue("must be a number")
        if v < low or (high is not None and v > high):
            raise InvalidValue(f"must be in [{low}, {high}]" if high is not None else f"must be >= {low}")
        return float(v)

    return check


def check_choice(*choices: str) -> Callable[[Any], str]:
    """A checker of strings among ``choices`` (any case); it returns the lower-case string."""

    def check(v: Any) -> str:
        if not isinstance(v, str) or v.lower() not in choices:
            raise InvalidValue(f"must be one of {list(choices)}")
        return v.lower()

    return check


def walk_schema(section: Mapping[str, Any], schema: Schema, path: str, found: dict[str, Any],
                problems: list[str]) -> None:
    """Check ``section`` (the part of a config at the dotted ``path``) against ``schema``: each valid
    key's normalized value goes to ``found`` under its dotted path (a nested section's mapping too),
    each unknown key, bad value or DEFAULT_ONLY key set otherwise to ``problems``. ``"auto"`` (the
    Hugging Face integration's placeholder) counts as not set."""
    for key, value in section.items():
        where = f"{path}.{key}" if path else str(key)
        spec = schema.get(key) if isinstance(key, str) else None
        if spec is None:
            close = difflib.get_close_matches(str(key), list(schema), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{where}: unknown key, or a DeepSpeed setting the engine does not support{hint}")
            continue
        if isinstance(value, str) and value == "auto":
            continue
        if not isinstance(spec, Key):
            if value is None:
                continue
            if not isinstance(value, Mapping):
                problems.append(f"{where}: must be an object, got {show_value(value)}")
                continue
            found[where] = value
            walk_schema(value, spec, where, found, problems)
            continue
        try:
            normalized = spec.check(value)
        except InvalidValue as exc:
            problems.append(f"{where}: {exc}, got {show_value(value)}")
            continue
        if spec.action == DEFAULT_ONLY and normalized != spec.default:
            problems.append(
                f"{where}: {spec.why} (only {show_value(spec.default)} is accepted), got {show_value(value)}"
            )
            continue
        found[where] = normalized


def show_value(value: Any) -> str:
    """A value as the JSON the user wrote (repr for what JSON cannot hold)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def raise_problems(problems: list[str]) -> None:
    """ValueError listing every problem of a DeepSpeed config, one per line; nothing when there is none."""
    if problems:
        lines = "\n  ".join(problems)
        raise ValueError(f"the DeepSpeed config has {len(problems)} unsupported or invalid setting(s):\n  {lines}")
