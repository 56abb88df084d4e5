"""The handle TieredStore.prefetch returns."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Callable, Optional


class Prefetch:
    """Handle of a prefetch: awaitable from any event loop, or waited on with :meth:`result`.

    Cancelling the handle stops waiting; the transfer itself completes in the background.
    """

    def __init__(
        self, future: "concurrent.futures.Future[None]", on_store_thread: Optional[Callable[[], bool]] = None
    ) -> None:
        self._future = future
        self._on_store_thread = on_store_thread

    def __await__(self):  # noqa: ANN204 - generator protocol
        return asyncio.wrap_future(self._future).__await__()

    def done(self) -> bool:
        """True once the transfer finished (or failed)."""
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> None:
        """Block until the transfer finished; re-raise its error. Not on the store's own loop thread
        (RuntimeError there: the transfer needs that thread), where the handle can be awaited."""
        if self._on_store_thread is not None and not self._future.done() and self._on_store_thread():
            raise RuntimeError("Prefetch.result() cannot block on the store's own loop thread; await the handle")
        self._future.result(timeout)

    def cancel(self) -> bool:
        """Stop waiting for the transfer."""
        return self._future.cancel()

