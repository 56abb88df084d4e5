"""Waiting for a batch of concurrent futures without leaving any of them unobserved."""

from __future__ import annotations

import concurrent.futures
from typing import Any, Iterable, Optional


def wait_all(futures: "Iterable[concurrent.futures.Future[Any]]", *, raise_errors: bool = True) -> None:
    """Wait for every future, then raise the first error (after all have finished, so none is left
    running); ``raise_errors=False`` only waits."""
    first: Optional[BaseException] = None
    for future in list(futures):
        try:
            future.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised below after the others finished
            first = first or exc
    if first is not None and raise_errors:
        raise first
