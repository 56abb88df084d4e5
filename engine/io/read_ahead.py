"""Reading the next tensor while the caller handles this one (checkpoint saves, weight exports)."""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")


def read_ahead(readers: Sequence[Callable[[], T]]) -> Iterator[T]:
    """Yield ``reader()`` for each reader in order, running the next one on a worker thread while
    the caller handles the value just yielded: at most two values exist at once. Readers run one
    at a time, in order (collective reads stay in the same order on every rank). A reader's error
    is raised where its value would be yielded; the reads still running are waited for."""
    if not readers:
        return
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-readahead") as pool:
        pending = pool.submit(readers[0])
        for i in range(len(readers)):
            value = pending.result()
            if i + 1 < len(readers):
                pending = pool.submit(readers[i + 1])
            yield value
            del value
