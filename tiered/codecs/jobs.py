"""Running a codec's per-frame jobs on a worker pool."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, Iterable, TypeVar

T = TypeVar("T")


async def run_all(pool: concurrent.futures.Executor, fn: Callable[..., T], calls: Iterable[tuple[Any, ...]]) -> list[T]:
    """Run ``fn(*args)`` for every ``args`` on ``pool``; return the results in order.

    Returns, or raises the first error, only once every job has finished: jobs write into buffers
    the caller frees right after, so none may still be running then, even when the caller is
    cancelled.
    """
    loop = asyncio.get_running_loop()
    futures = [loop.run_in_executor(pool, fn, *args) for args in calls]
    if not futures:
        return []
    everything = asyncio.gather(*futures, return_exceptions=True)
    try:
        results = await asyncio.shield(everything)
    except asyncio.CancelledError:
        await asyncio.wait([everything])
        raise
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
