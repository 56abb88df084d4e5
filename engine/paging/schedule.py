"""Schedule: the recorded order of parameter needs in one step, replayed and checked in later steps.

A *need* is the moment a parameter must be materialized while no one holds it: a module's forward
pre-hook, backward unpacking a saved parameter, code reading it outside its module. The hooks
release deterministically, so the same control flow produces the same sequence of needs.

One order is kept per mode (grad enabled or not, so inference forwards do not disturb the training
record). A step that needs something other than the next recorded item *departs*: it is followed
on demand for the rest of the step and its own sequence replaces the record when the step ends.
A step that ends early (a prefix of the record) keeps the record.
"""

from __future__ import annotations

import bisect
from typing import Generic, Hashable, Optional, Sequence, TypeVar

T = TypeVar("T", bound=Hashable)


# [Note: Recorded order]
# A step starts at the root module's forward pre-hook (outside backward). The first step in a grad
# mode records the order of needs, forward and backward; later steps follow it and prefetch along
# it (see [Note: Prefetch window]). One record per grad mode, so evaluation forwards between
# training steps do not force re-recording. A need that is not the next recorded one departs: the
# prefetched parameters are dropped (``EngineStats.prefetch_wasted``), the rest of the step fetches
# on demand, and when the step ends its own sequence replaces the record (``rerecords``). Results
# never depend on the schedule: a departure only costs waiting. The same order (keys, with repeats)
# goes to the store's ``set_access_order``, so its Belady policy evicts the entry used furthest in
# the future when a budget is full. Each need also records whether backward made it, so a follower
# knows which need is an item's last of the step and comes from backward (its gradient becomes final
# right after: the engine then reads the fp32 master there, [Note: Masters read in backward]).


class Schedule(Generic[T]):
    """Record and replay of need orders; pure bookkeeping, no I/O."""

    def __init__(self) -> None:
        self._orders: dict[Hashable, list[T]] = {}
        self._in_backward: dict[Hashable, list[bool]] = {}  # per mode: was each need backward's
        self._final_backward: set[int] = set()  # positions of needs that are their item's last, in backward
        self._mode: Optional[Hashable] = None
        self._order: Optional[list[T]] = None
        self._positions: dict[T, list[int]] = {}
        self._current: list[T] = []
        self._current_backward: list[bool] = []
        self.cursor = 0
        self.departed = False
        self.rerecords = 0

    @property
    def order(self) -> Sequence[T]:
        """The order this step follows (empty while recording a mode's first step)."""
        return self._order if self._order is not None else ()

    @property
    def following(self) -> bool:
        """True while this step matches its recorded order (so far), i.e. prefetch may run ahead."""
        return self._order is not None and not self.departed

    @property
    def mode(self) -> Optional[Hashable]:
        """The running step's mode (None between steps)."""
        return self._mode

    @property
    def complete(self) -> bool:
        """True when the running step followed its whole recorded order (every need, in order)."""
        return self.following and self.cursor == len(self.order)

    def begin(self, mode: Hashable) -> bool:
        """End the running step (keeping its record if needed) and start one in ``mode``.

        Returns True when the order to follow differs from the previous step's (a new record, or
        another mode), so the caller can publish it.
        """
        previous = self._order
        self._finish()
        self._mode = mode
        self._order = self._orders.get(mode)
        self._positions = {}
        self._final_backward = set()
        if self._order is not None:
            for i, item in enumerate(self._order):
                self._positions.setdefault(item, []).append(i)
            backward = self._in_backward[mode]
            self._final_backward = {p[-1] for p in self._positions.values() if backward[p[-1]]}
        self._current = []
        self._current_backward = []
        self.cursor = 0
        self.departed = False
        return self._order is not previous

    def observe(self, item: T, *, backward: bool = False) -> bool:
        """Record a need of ``item`` (``backward``: made by a backward pass); True when it is the next
        item of the recorded order."""
        self._current.append(item)
        self._current_backward.append(backward)
        if not self.following:
            return False
        assert self._order is not None
        if self.cursor < len(self._order) and self._order[self.cursor] == item:
            self.cursor += 1
            return True
        self.departed = True
        return False

    def next_position(self, item: T, *, wrap: bool = False) -> Optional[int]:
        """Index of ``item``'s next need at or after the cursor in the followed order, or None.
        With ``wrap`` the order repeats once: a need in the next step (same order) is
        ``len(order) + index``."""
        if not self.following:
            return None
        positions = self._positions.get(item)
        if not positions:
            return None
        i = bisect.bisect_left(positions, self.cursor)
        if i < len(positions):
            return positions[i]
        return len(self.order) + positions[0] if wrap else None

    def final_backward_need(self, position: int) -> bool:
        """Whether the followed order's need at ``position`` is its item's last in the step and was made
        by backward."""
        return position in self._final_backward

    def finish(self) -> None:
        """End the running step without starting another (e.g. before the engine closes)."""
        self._finish()
        self._mode = None
        self._order = None

    def _finish(self) -> None:
        if self._mode is None:
            return
        if self._order is None or self.departed:
            if self._order is not None:
                self.rerecords += 1
            if self._current:
                self._orders[self._mode] = self._current
                self._in_backward[self._mode] = self._current_backward
            else:
                self._orders.pop(self._mode, None)
        self._current = []
        self._current_backward = []
