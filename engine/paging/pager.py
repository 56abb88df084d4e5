"""Pager: brings parameters in when they are needed and out when nothing holds them, prefetching
along the recorded order within a byte budget.

Every parameter is in one of three situations: *held* (a running module or backward needs it),
*prefetched* (materialized, or on its way, ahead of its next recorded need) or released. The
prefetch window is the bytes of prefetched parameters; it never exceeds ``prefetch_bytes``, so
materialized parameter memory is at most what is held plus ``prefetch_bytes``.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Hashable, Iterable, Optional, Sequence

from engine.paging.handle import HandleState, ParamHandle
from engine.paging.param_buffers import ParamBuffers
from engine.paging.schedule import Schedule
from engine.paging.shard_io import ShardIO
from engine.stats import EngineCounters, MemoryMeter
from tiered.util import wait_all


# [Note: Prefetch window]
# After every need and release, ``_top_up`` walks the recorded order from the cursor and starts a
# non-blocking get into the storage of each released parameter while the prefetched bytes fit in
# ``prefetch_bytes``, strictly in order: one that does not fit stops the walk. A released parameter
# may stay materialized as prefetched when the order needs it again within the part of the window
# already scanned and it fits (otherwise a free would be followed by an immediate refetch).
#
# In a step with gradients the window never crosses the end of the recorded step, so nothing is
# fetched before an optimizer step that may change it; the end of the outermost backward drops what
# is still prefetched. Forward-only steps (no_grad, inference_mode) let the window run on into the
# next step's beginning (the order repeated once): the last parameters of one forward and the first
# of the next load while the caller is between calls, and a parameter needed both last and first
# (GPT-2's tied wte / lm_head) stays materialized instead of being read twice per forward. The walk
# also reserves room for a parameter it passes while that parameter is in use or prefetched for an
# earlier need, and a parameter needed again later in the same forward-only step keeps its room
# from its first need on, so the window is not filled with later parameters first. What was
# prefetched for the next step is kept only when that step has the same mode and this one followed
# its whole record; an optimizer step, ``load_state_dict``, a departure, a training forward or
# ``drop_prefetched`` drops it first, so no forward computes on values older than the store's.
#
# [Note: Memory bound]
# Materialized parameter bytes = held + prefetched <= (parameters of the modules running at once)
# + ``prefetch_bytes``. With parameters in leaf modules the first term is the largest module's
# direct parameters, in forward and in backward; a parent that owns parameters adds its own while
# its children run, and a checkpointed region holds its parameters during its backward.
# ``EngineStats.peak_materialized_bytes`` measures it; tests/test_engine_schedule.py asserts it.
# Buffers, gradients, activations and the store's pools are not part of it; parameter buffers waiting
# for reuse are the store's buffer pool's (engine.paging.param_buffers), bounded with it.
#
# [Note: Masters read in backward]
# A parameter trained in bf16 or fp16 has an fp32 master of its own, and an update inside backward
# needs it right after the parameter's last backward need. So while ``master_source`` names a
# master for it, the fetch for that need (the followed order says which one it is,
# ``Schedule.final_backward_need``) reads the master instead of the parameter, into a buffer of the
# store's pool, and casts it into the parameter's storage (the same rounding that wrote the
# parameter, so the same bits); the fp32 copy stays on the handle for the update to take
# (``ParamHandle.take_master_copy``). One read of 4 bytes an element serves backward and the update,
# where reading both would cost 6. A copy not taken goes when the parameter is freed.


class Pager:
    """Holds, needs, releases and the prefetch window. Thread-safe (one lock), called by the hooks."""

    def __init__(
        self,
        shard_io: ShardIO,
        meter: MemoryMeter,
        counters: EngineCounters,
        prefetch_bytes: int,
        publish_order: Callable[[Sequence[str]], None],
    ) -> None:
        self.schedule: Schedule[ParamHandle] = Schedule()
        self.lock = threading.RLock()
        self._io = shard_io
        self._meter = meter
        self._counters = counters
        self._prefetch_bytes = prefetch_bytes
        self._publish_order = publish_order
        self._prefetched: dict[ParamHandle, None] = {}  # insertion-ordered set
        self._reserved: dict[ParamHandle, None] = {}  # held now, needed again within the scanned window
        self._window = 0  # bytes of prefetched + reserved parameters
        self._scan = 0  # next position of the followed order the prefetcher looks at
        self._wrap = False  # the window may run into the next step (forward-only steps)
        self._carried = False  # something was prefetched for the next step and is still valid
        self.buffers = ParamBuffers(shard_io.store.host_buffer)  # page-aligned storage for large CPU parameters
        self._kept_for: dict[ParamHandle, int] = {}  # kept at release for a later need in the step -> its position
        self._ahead: dict[ParamHandle, None] = {}  # prefetched for the next step (insertion-ordered set)
        #: Names the store key of a handle's fp32 master to read at its last backward need, or None
        #: ([Note: Masters read in backward]); None reads parameters only.
        self.master_source: Optional[Callable[[ParamHandle], Optional[str]]] = None

    @property
    def window_bytes(self) -> int:
        """Bytes of parameters prefetched ahead of their need."""
        return self._window

    # ------------------------------------------------------------------ steps

    def begin_step(self, mode: Hashable, *, wrap_around: bool = False) -> None:
        """A new step starts (the root module's forward): follow (or record) ``mode``'s order (see
        [Note: Recorded order] and [Note: Prefetch window]).

        ``wrap_around`` (forward-only steps, where nothing writes parameters between steps) lets the
        prefetch window run past the end of this step into the next one's beginning: a parameter
        needed last in a step and first in the next (a tied embedding / head) stays materialized,
        and the next step's first parameters load while the caller is between steps. What was
        prefetched that way is kept only when the next step has the same mode and this one followed
        its whole record; any write (optimizer step, ``load_state_dict``) drops it first.
        """
        with self.lock:
            order_len = len(self.schedule.order)
            carry = (self._carried and wrap_around and self._wrap and self.schedule.mode == mode
                     and self.schedule.complete)
            self._unreserve_all()
            if not carry:
                self.drop_prefetched()
            if self.schedule.begin(mode) and self.schedule.order:
                self._publish_order([h.key for h in self.schedule.order])
            self._counters.rerecords = self.schedule.rerecords
            self._counters.steps += 1
            self._scan = max(0, self._scan - order_len) if carry else 0
            self._ahead.clear()  # what was prefetched for this step is now this step's
            self._carried = False
            self._wrap = wrap_around
            self._top_up()

    def drop_prefetched(self) -> None:
        """Free every prefetched parameter (waiting for transfers in flight): the step departed from
        its record, backward ended (an optimizer may now change the store), or the engine stops."""
        with self.lock:
            self._carried = False
            self._unreserve_all()
            for handle in list(self._prefetched):
                self._unmark(handle)
                if handle.future is not None:
                    try:
                        handle.future.result()
                        self._io.finish_fetch(handle)
                        handle.fetch_finished()
                    except Exception:  # noqa: BLE001 - the bytes are dropped anyway; a later need refetches
                        pass
                self._free(handle)
                self._counters.prefetch_wasted += 1

    # ------------------------------------------------------------------ holds

    def acquire(self, handle: ParamHandle, *, backward: bool = False) -> None:
        """A running module starts using ``handle`` (materialize it first if nothing holds it);
        ``backward``: the module runs inside a backward pass (a checkpointed region's recompute)."""
        with self.lock:
            if not handle.held:
                self._need(handle, backward=backward)
            handle.users += 1

    def release(self, handle: ParamHandle, *, keep_for_backward: bool = False) -> None:
        """A running module stops using ``handle``. ``keep_for_backward`` turns the use into a
        backward hold (a module re-run during backward: its gradients are still to come)."""
        with self.lock:
            assert handle.users > 0, handle
            handle.users -= 1
            if keep_for_backward:
                handle.bwd_hold = True
            if not handle.held:
                self._unheld(handle)

    def hold_for_backward(self, handle: ParamHandle) -> None:
        """Backward needs ``handle`` (it unpacked a saved view of it) until its gradient is final."""
        with self.lock:
            if not handle.held:
                self._need(handle, backward=True)
            handle.bwd_hold = True

    def end_backward_hold(self, handle: ParamHandle) -> None:
        """Backward is done with ``handle`` (its gradient is final, or its module's backward ended)."""
        with self.lock:
            if handle.bwd_hold:
                handle.bwd_hold = False
                if not handle.held:
                    self._unheld(handle)

    def write_back(self, handles: Iterable[ParamHandle]) -> None:
        """Write the materialized values of ``handles`` to the store (in parallel) and wait."""
        with self.lock:
            handles = list(handles)
            wait_all([self._io.write(h) for h in handles])
            for handle in handles:
                handle.synced = handle.version
            self._counters.writebacks += len(handles)

    def materialize(self, handles: Iterable[ParamHandle]) -> None:
        """Hold all of ``handles`` at once, fetched in parallel and outside the schedule (optimizer
        steps, unwrap). Undo with :meth:`release` per handle."""
        with self.lock:
            handles = list(dict.fromkeys(handles))
            for handle in handles:
                if handle.prefetched:
                    self._unmark(handle)
                if handle.state is HandleState.RELEASED:
                    self._start_fetch(handle, pooled=False)  # unwrap hands these to the user: torch's memory
                handle.users += 1
            error = None
            for handle in handles:
                try:
                    self._wait(handle)
                except BaseException as exc:  # noqa: BLE001 - wait for every transfer, then raise
                    error = error or exc
            if error is not None:
                for handle in handles:
                    self.release(handle)
                raise error

    # ------------------------------------------------------------------ internals (lock held)

    def _need(self, handle: ParamHandle, *, backward: bool) -> None:
        if handle.prefetched:
            self._counters.prefetch_hits += 1
            self._unmark(handle)
        else:
            self._counters.prefetch_misses += 1
        was_following = self.schedule.following
        followed = self.schedule.observe(handle, backward=backward)
        if not followed and was_following:
            self.drop_prefetched()  # departed: on demand for the rest of this step
            self._counters.rerecords = self.schedule.rerecords + 1
        if handle.state is HandleState.RELEASED:
            self._start_fetch(handle, position=self.schedule.cursor - 1 if followed else None)
        self._wait(handle)
        if self._wrap and self.schedule.following and handle not in self._reserved:
            # Needed again later in this forward-only step (a tied embedding / LM head): keep its room
            # in the window while it is in use, so that it can stay materialized until that need
            # (``_unheld``) instead of being read twice in one step.
            again = self.schedule.next_position(handle)
            if again is not None and self._window + handle.nbytes <= self._prefetch_bytes:
                self._reserved[handle] = None
                self._window += handle.nbytes
        self._top_up()

    def _unheld(self, handle: ParamHandle) -> None:
        if handle.state is HandleState.READY and handle.version != handle.synced:
            self.write_back([handle])  # changed in place while held: the store must not lose it
        if handle in self._reserved:
            del self._reserved[handle]
            self._window -= handle.nbytes
        upcoming = self.schedule.next_position(handle, wrap=self._wrap)
        if upcoming is not None and upcoming < self._scan:
            # The prefetcher already passed its next need (it was held then): keep it if it fits
            # (it does when the prefetcher reserved room for it). See [Note: Prefetch window].
            if self._window + handle.nbytes <= self._prefetch_bytes:
                self._mark(handle)
                self._carried |= upcoming >= len(self.schedule.order)
                return
            self._scan = upcoming
        elif (self._wrap and upcoming is not None and upcoming < len(self.schedule.order)
              and self._window + handle.nbytes <= self._prefetch_bytes):
            # Needed again later in this forward-only step, ahead of the prefetcher: keep it (its room
            # was reserved at its need), prefetched for that position.
            self._mark(handle)
            self._kept_for[handle] = upcoming
            return
        self._free(handle)
        self._top_up()

    def _top_up(self) -> None:
        if not self.schedule.following or self._prefetch_bytes == 0:
            return
        order = self.schedule.order
        length = len(order)
        limit = 2 * length if self._wrap else length
        self._scan = max(self._scan, self.schedule.cursor)
        while self._scan < limit:
            handle = order[self._scan % length]
            if handle.state is HandleState.RELEASED:
                if self._window + handle.nbytes > self._prefetch_bytes:
                    return
                if self._scan >= length and self._step_reads_in_flight():
                    return  # the next step's reads wait for this step's: sharing the disk would slow them
                self._start_fetch(handle, position=self._scan if self._scan < length else None)
                self._mark(handle)
                self._counters.prefetch_issued += 1
                if self._scan >= length:
                    self._carried = True
                    self._ahead[handle] = None
            elif self._wrap and handle not in self._reserved and self._kept_for.get(handle) != self._scan:
                # Needed again here while in use or prefetched for an earlier need: keep room to keep
                # it after that use, rather than filling the window with later parameters and reading
                # it twice (a tied embedding / head). One kept for exactly this need has its room.
                if self._window + handle.nbytes > self._prefetch_bytes:
                    return
                self._reserved[handle] = None
                self._window += handle.nbytes
            self._scan += 1

    def _start_fetch(self, handle: ParamHandle, *, pooled: bool = True, position: Optional[int] = None) -> None:
        """Start filling ``handle``'s storage; ``position``: the need in the followed order it is for."""
        master = None
        if position is not None and self.master_source is not None and self.schedule.final_backward_need(position):
            master = self.master_source(handle)
        handle.allocate(self._meter)
        storage = handle.flat.untyped_storage()
        try:
            if pooled and self.buffers.wants(storage, handle.nbytes):
                self.buffers.lend(storage, handle.nbytes)
            handle.state = HandleState.FETCHING
            handle.fetch_started()
            handle.future = self._io.fetch(handle, master=master)
        except BaseException:
            handle.state = HandleState.READY  # so free() releases the storage just allocated
            self._free(handle, force=True)
            raise
        self._counters.fetches += 1

    def _free(self, handle: ParamHandle, *, force: bool = False) -> None:
        """Free ``handle``'s storage, taking back the pooled buffer it holds, if any."""
        storage = handle.flat.untyped_storage()
        if handle.state is not HandleState.RELEASED and self.buffers.holds(storage):
            assert (force or not handle.held) and (handle.future is None or handle.future.done()), handle
            self.buffers.give_back(storage)
        handle.free(self._meter, force=force)

    def _step_reads_in_flight(self) -> bool:
        """Whether a prefetch for this step (not the next) is still being read."""
        return any(h.future is not None and not h.future.done() for h in self._prefetched if h not in self._ahead)

    def _wait(self, handle: ParamHandle) -> None:
        if handle.state is not HandleState.FETCHING:
            return
        assert handle.future is not None
        started = time.perf_counter()
        try:
            handle.future.result()
            self._io.finish_fetch(handle)
        except BaseException:
            # An interrupt (Ctrl-C) can come while the read still fills the storage: let it finish
            # before the storage goes.
            wait_all([handle.future], raise_errors=False)
            handle.state = HandleState.READY
            self._free(handle, force=True)
            raise
        finally:
            self._counters.stall_seconds += time.perf_counter() - started
        handle.state = HandleState.READY
        handle.future = None
        handle.fetch_finished()

    def _unreserve_all(self) -> None:
        for handle in self._reserved:
            self._window -= handle.nbytes
        self._reserved.clear()

    def _mark(self, handle: ParamHandle) -> None:
        handle.prefetched = True
        self._prefetched[handle] = None
        self._window += handle.nbytes

    def _unmark(self, handle: ParamHandle) -> None:
        self._kept_for.pop(handle, None)
        self._ahead.pop(handle, None)
        handle.prefetched = False
        del self._prefetched[handle]
        self._window -= handle.nbytes
