"""BackwardUpdates: AdamW applied to each shard inside backward, the moment its gradient is final, on a
worker thread ([Note: Speculative updates] in engine/optim/speculation.py says how the step validates it).

[Note: Updates inside backward]
The engine hands each shard whose gradient is final (after the accumulation window's last
micro-batch) to a worker thread, with the gradient shard (fp32) and the fp32 master backward has just
read: for an fp32 parameter that is its own master, a copy of the parameter; for a bf16 or fp16 one,
the master backward's fetch read in place of the parameter ([Note: Masters read in backward] in
engine/paging/pager.py). Per batch of shards (up to ``optimizer_group_bytes``) the worker renames
each shard's live entries (parameter, its master when it has its own, both moments) to their
``before`` keys (no I/O), runs torch's AdamW math with the hyperparameters and loss scale the step
started with, and writes the new parameter (cast to its training dtype), master and moments with one
``put_many(atomic=True)``: per parameter and step 12 bytes are written in fp32 (14 in bf16) and only
the moments (8) are read beside backward's reads, which the worker starts ahead along the order in
which gradients became final in the previous step (after backward as inside it). A shard whose
master backward did not read (no backward need: an embedding, a bias; a first step, when the master
is the parameter upcast) has it read by the worker. ``eng.step()`` waits for the worker, then
commits, rolls back or redoes.

The write of one batch overlaps the update of the next: the worker starts the ``put_many`` and goes
on to the next batch, waiting for the write only before it starts another (or, where the plan's
bound leaves room, the one after: [Note: Keeping the disk busy]), when nothing is queued, or when
either batch is larger than ``batch_bytes`` (a shard larger than a batch is a batch of its own and
pairs only where the memory plan leaves room: [Note: Using the room the plan leaves]). A crash can
then find up to ``WRITES_IN_FLIGHT`` + 1 batches part way, each atomic on its own.

Memory: the moments read ahead (at most ``window_bytes``, or one shard's into an empty window), the
gradient and master copies of shards waiting for the worker (at most ``inflight_bytes``, or one
shard's; backward waits beyond it), one batch being updated (its moments and new values) and,
beside a batch of at most ``batch_bytes`` or where the plan's bound leaves room, the previous one
being written. Master copies and moments are buffers of the store's pool; the memory plan
(engine/paging/memory_plan.py) counts these bounds in [Note: Updates inside backward, in memory].
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from engine.optim.adamw_kernel import AdamWKernel
from engine.optim.step import update_in_memory
from engine.optim.types import AdamHyper, OptimShard
from engine.optim.speculation import entries_of, keep_before
from tiered import TieredStore

#: Batches being written at once at most, where the plan's bound leaves room ([Note: Keeping the disk busy]).
WRITES_IN_FLIGHT = 2

# [Note: Using the room the plan leaves]
# The memory plan counts the worker's buffers at the worst point of backward, usually where a model's
# largest shard (an embedding, a head) is updated alone: three times its bytes beside its neighbours'
# reads. Elsewhere most of that room is free, and a shard larger than ``batch_bytes`` updated only
# after the previous write is done leaves the disk idle during its AdamW math. So a batch of any size
# is updated while the previous one is written when the reads ahead, both batches (parameter and two
# moments each) and the parameter copies backward may queue (the larger of ``inflight_bytes`` and
# what waits) stay within the plan's bound (``MemoryPlan.updates_buffer_bytes``). Reads ahead started
# while a batch is in hand are checked against the same bound with the pair counted; while one is in
# hand, backward queues a shard larger than ``inflight_bytes`` only once the pair is done.


# [Note: Keeping the disk busy]
# Backward hands the worker one shard at a time, so the worker's own waits are backward's: each
# batch it spent waiting left the disk idle (at 2.38 B parameters in fp32, 200 batches a step, the
# disk had nothing in flight a third of backward). Three waits are taken off its path:
# - The renames that keep the old values aside commit without a flush of their own
#   (``rename_many(durable=False)``): the durable ``put_many`` of the new values flushes them with it.
#   A crash before it finds the entries renamed (a killed process) or live (a power loss may drop the
#   renames), and a resume puts either back as it was before the step. A flushed commit waits behind
#   the disk's queue (tens of milliseconds when it is busy), once per batch.
# - The renames commit while the AdamW math runs: every read the update needs is started before
#   them (a read started before a rename reads the value it keeps aside), so nothing the math uses
#   depends on them; the write of the new values starts once they have committed.
# - The moments of the next shards are read while a batch is updated and written, not after, where
#   the plan's bound holds them beside the batch (``_top_up(beside=...)``), and a batch's write may
#   start before the previous one has committed, up to ``WRITES_IN_FLIGHT`` at once within the same
#   bound: a put's commit flushes its swap file, so one write at a time left the disk idle between
#   them.


@dataclasses.dataclass
class _Job:
    shard: OptimShard
    grad: torch.Tensor
    master: Optional[torch.Tensor]  # the fp32 master backward read; None: read it from the store
    steps: int
    hypers: tuple[AdamHyper, ...]
    grad_scale: float = 1.0  # 1 / loss scale
    grad_shared: bool = False  # the gradient is also being stored: read it, never change it
    nbytes: int = 0  # what it holds while it waits: the gradient and the master copy

    def __post_init__(self) -> None:
        self.nbytes = self.grad.numel() * 4 * (2 if self.master is not None else 1)


@dataclasses.dataclass
class BackwardCounters:
    """What the updates of one step did and cost."""

    batches: int = 0
    shards: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    update_seconds: float = 0.0
    stall_seconds: float = 0.0
    first_update: Optional[float] = None


class BackwardUpdates:
    """The worker that applies the updates inside backward (see [Note: Updates inside backward])."""

    def __init__(self, store: TieredStore, *, compress: bool, batch_bytes: int, inflight_bytes: int,
                 window_bytes: int, keep: Optional[str] = None, hold_bytes: int = 0,
                 kernel: Optional[AdamWKernel] = None) -> None:
        """``hold_bytes``: what the memory plan lets the worker's buffers take at most; where what it
        holds leaves room, batches larger than ``batch_bytes`` are updated while the one before them
        is written ([Note: Using the room the plan leaves]). 0: only small batches pair. ``kernel``:
        the one-pass AdamW ([Note: One-pass AdamW]); None: torch's function."""
        self._store = store
        self._kernel = kernel
        self._keep = keep  # where the store may keep the new parameters for the next forward
        self._compress = compress
        self._batch_bytes = batch_bytes
        self._inflight_limit = inflight_bytes
        self._window_limit = window_bytes
        self._hold_limit = hold_bytes
        self._large_pair = False  # a pair only the plan's bound allows is in hand
        self._cond = threading.Condition()
        self._queue: "collections.deque[_Job]" = collections.deque()
        self._inflight = 0
        self._busy = False  # a batch is being updated or written
        self._writes: "collections.deque[_Writing]" = collections.deque()  # batches being written, oldest first
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        # Reads ahead along ``_order`` from ``_cursor``: name -> the shard's moments (and its parameter,
        # for a shard backward did not materialize last time).
        self._ahead: dict[str, _Ahead] = {}
        self._ahead_bytes = 0
        self._order: list[tuple[OptimShard, bool, bool]] = []  # (shard, read moments, read parameter)
        self._cursor = 0
        self._read_masters: set[str] = set()  # shards whose update read its master this step
        self.counters = BackwardCounters()
        #: Tracing hook, called on the worker as ``on_event(event, batch)`` with "renamed" (old values
        #: kept aside) and "written" (the batch committed); tests stop a process there.
        self.on_event: Optional[Callable[[str, int], None]] = None

    # ------------------------------------------------------------------ the caller's side

    def read_ahead(self, order: Sequence[OptimShard], has_moments: Callable[[str], bool]) -> None:
        """Start reading the moments of the shards of ``order`` (the order in which the last step's
        gradients became final) that have some, and the masters of those whose update had to read its
        master, within the window; topped up as updates use them."""
        with self._cond:
            dropped = self._drop_ahead()
        _wait_dropped(dropped)
        with self._cond:
            read_master = self._read_masters
            self._read_masters = set()
            self._order = [(s, has_moments(s.name), s.name in read_master) for s in order]
            self._order = [entry for entry in self._order if entry[1] or entry[2]]
            self._cursor = 0
            self._top_up()

    def submit(self, shard: OptimShard, grad: torch.Tensor, master: Optional[torch.Tensor], steps: int,
               hypers: tuple[AdamHyper, ...], *, grad_scale: float = 1.0, grad_shared: bool = False) -> None:
        """Queue the update of ``shard``: its fp32 gradient shard (multiplied by ``grad_scale`` first; not
        changed when ``grad_shared``), its fp32 master as backward read it (None: read it from the store),
        ``steps`` it has taken. Blocks while too many bytes wait; raises the first error an earlier
        update had (RuntimeError, the error as its cause)."""
        job = _Job(shard, grad, master, steps, hypers, grad_scale, grad_shared)
        with self._cond:
            self._raise_error()
            while ((self._inflight or self._large_pair) and self._inflight + job.nbytes > self._inflight_limit
                   and self._error is None):
                self._cond.wait()
            self._raise_error()
            if self.counters.first_update is None:
                self.counters.first_update = time.perf_counter()
            self._queue.append(job)
            self._inflight += job.nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="engine-backward-updates", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self) -> None:
        """Wait until every queued update has committed; raise the first error one had (RuntimeError,
        the error as its cause), once."""
        with self._cond:
            started = time.perf_counter()
            while self._queue or self._busy:  # after an error the worker drops what is queued
                self._cond.wait()
            self.counters.stall_seconds += time.perf_counter() - started
            self._raise_error(clear=True)

    def take_counters(self) -> BackwardCounters:
        """The counters since the last call, and fresh ones."""
        with self._cond:
            counters, self.counters = self.counters, BackwardCounters()
            return counters

    def close(self) -> None:
        """Stop the worker once the queue is empty and drop what was read ahead. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cond:
            dropped = self._drop_ahead()
        _wait_dropped(dropped)

    # ------------------------------------------------------------------ internals

    def _raise_error(self, clear: bool = False) -> None:
        error = self._error
        if error is None:
            return
        if clear:
            self._error = None
            self._queue.clear()
            self._inflight = 0
        raise RuntimeError(f"an optimizer update inside backward failed: {error}") from error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed and not (self._writes and self._writes[0].future.done()):
                    self._cond.wait()
                if not self._queue and not self._writes:
                    return
                batch: list[_Job] = []
                if self._error is not None:  # the step will be run again: drop what waits
                    self._queue.clear()
                    self._inflight = 0
                    self._cond.notify_all()
                elif self._queue:
                    batch = self._take_batch()
                moments = [self._take_ahead(job.shard) for job in batch]
                # How many of the batches being written may the batch be updated beside?
                beside = self._writes_beside(batch) if batch else 0
                self._large_pair = beside > 0 and not self._small(batch)
                self._busy = True
                if batch:
                    self._top_up(beside=self._held_by(batch))
            try:
                self._finish_writes(keep=beside)
                if batch:
                    self._update_and_write(batch, moments)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by submit / wait
                with self._cond:
                    self._error = self._error or exc
                self._release(batch)
                try:
                    self._finish_writes(keep=0)
                except BaseException:  # noqa: BLE001 - the first error is the one reported
                    pass
            finally:
                # Hold nothing of this batch while waiting for the next: after a step's last batch the
                # wait lasts until the next backward, and its moments would sit beside all of forward.
                batch, moments = [], []
                with self._cond:
                    self._large_pair = False
                    self._busy = bool(self._writes)
                    self._top_up()
                    self._cond.notify_all()

    def _update_and_write(self, batch: list[_Job], moments: list[Optional["_Ahead"]]) -> None:
        """Update ``batch`` and start its write, beside the writes before it the plan's bound leaves
        room for ([Note: Keeping the disk busy])."""
        nbytes = self._batch_nbytes(batch)
        items, codecs = self._update(batch, moments)
        self._release(batch)
        with self._cond:
            keep = self._writes_beside_write(nbytes)
        self._finish_writes(keep=keep)
        self._start_write(items, codecs, nbytes)

    def _take_batch(self) -> list[_Job]:
        """The next batch: queued jobs of the same hyperparameters up to ``batch_bytes`` of gradient,
        at least one (lock held)."""
        batch = [self._queue.popleft()]
        size = self._batch_nbytes(batch)
        while (self._queue and size + self._queue[0].grad.numel() * 4 <= self._batch_bytes
               and self._queue[0].hypers == batch[0].hypers and self._queue[0].grad_scale == batch[0].grad_scale):
            size += self._queue[0].grad.numel() * 4
            batch.append(self._queue.popleft())
        return batch

    @staticmethod
    def _batch_nbytes(batch: list[_Job]) -> int:
        return sum(job.grad.numel() * 4 for job in batch)

    def _writes_beside(self, batch: list[_Job]) -> int:
        """How many of the newest batches being written ``batch`` may be updated beside (lock held):
        the one before it where both are within ``batch_bytes`` (the plan counts that pair), else as
        many as the plan's bound holds with the reads ahead and what backward may queue."""
        for keep in range(len(self._writes), 0, -1):
            if keep == 1 and self._small(batch):
                return 1
            if self._ahead_bytes + self._held(self._batch_nbytes(batch), keep) <= self._hold_limit:
                return keep
        return 0

    def _writes_beside_write(self, nbytes: int) -> int:
        """How many of the newest batches being written may still be in flight when the write of a batch
        of ``nbytes`` starts (lock held): fewer than ``WRITES_IN_FLIGHT``, within the plan's bound."""
        for keep in range(min(len(self._writes), WRITES_IN_FLIGHT - 1), 0, -1):
            if self._ahead_bytes + self._held(nbytes, keep) <= self._hold_limit:
                return keep
        return 0

    def _held_by(self, batch: list[_Job]) -> int:
        """What ``batch`` in hand, every batch being written and what backward may queue hold (lock held)."""
        return self._held(self._batch_nbytes(batch), len(self._writes))

    def _held(self, nbytes: int, writes: int) -> int:
        """What a batch of ``nbytes`` in hand, the newest ``writes`` batches being written and what backward
        may queue hold (lock held): each batch's parameter and two moments, old and new, counted as the
        plan counts them."""
        written = sum(w.nbytes for w in list(self._writes)[len(self._writes) - writes:])
        return 3 * (written + nbytes) + max(self._inflight, self._inflight_limit)

    def _small(self, batch: list[_Job]) -> bool:
        """Whether ``batch`` and the newest batch being written are both within ``batch_bytes``."""
        newest = self._writes[-1].nbytes if self._writes else 0
        return max(newest, self._batch_nbytes(batch)) <= self._batch_bytes

    def _release(self, batch: list[_Job]) -> None:
        """The jobs of ``batch`` no longer hold their gradients: let backward queue more."""
        if not batch:
            return
        with self._cond:
            self._inflight = max(0, self._inflight - sum(job.nbytes for job in batch))
            for job in batch:
                job.grad = job.master = None  # type: ignore[assignment]
                job.nbytes = 0
            self._cond.notify_all()

    def _update(self, batch: list[_Job], ahead: list[Optional["_Ahead"]]
                ) -> tuple[dict[str, torch.Tensor], dict[str, Optional[bool]]]:
        """Keep each shard's entries aside under their ``before`` keys and update: the new parameters,
        masters and moments to write ([Note: Speculative updates]). The renames commit while the math
        runs ([Note: Keeping the disk busy])."""
        reads = [self._reads(job, a) for job, a in zip(batch, ahead)]  # started before the renames
        renaming = keep_before(self._store, [job.shard for job in batch])
        try:
            masters, pairs = self._loaded(batch, reads)
            started = time.perf_counter()
            updated = update_in_memory([j.shard for j in batch], [j.grad for j in batch], masters, pairs,
                                       [j.steps for j in batch], batch[0].hypers, grad_scale=batch[0].grad_scale,
                                       grads_shared=[j.grad_shared for j in batch], kernel=self._kernel)
            self.counters.update_seconds += time.perf_counter() - started
        except BaseException:
            _renamed(renaming, quiet=True)  # the store's state is settled before the error is reported
            raise
        _renamed(renaming)
        if self.on_event is not None:
            self.on_event("renamed", self.counters.batches)
        items: dict[str, torch.Tensor] = {}
        codecs: dict[str, Optional[bool]] = {}
        moment = True if self._compress else None
        for job, master, (exp_avg, exp_avg_sq) in zip(batch, masters, updated):
            s = job.shard
            items.update({s.exp_avg_key: exp_avg, s.exp_avg_sq_key: exp_avg_sq})
            codecs.update({s.exp_avg_key: moment, s.exp_avg_sq_key: moment})
            if s.master_is_param:
                items[s.param_key], codecs[s.param_key] = master, None
            else:
                items[s.master_key], codecs[s.master_key] = master, moment
                items[s.param_key], codecs[s.param_key] = master.to(s.train_dtype), None  # as torch's copy_
        self.counters.shards += len(batch)
        return items, codecs

    def _reads(self, job: _Job, ahead: Optional["_Ahead"]) -> "_Ahead":
        """The reads ``job``'s update needs: those started ahead, and the others started now under the
        live keys (a read started before the renames reads the values they keep aside)."""
        shard, get = job.shard, self._store.sync.get_future
        master = ahead.master if ahead is not None else None
        if job.master is None and master is None:  # backward did not read it (an embedding, a bias, a first step)
            master = get(entries_of(shard)[1][_master_source(shard, job.steps > 0)])
        exp_avg = exp_avg_sq = None
        if job.steps:
            exp_avg, exp_avg_sq = ((ahead.exp_avg, ahead.exp_avg_sq) if ahead is not None and ahead.exp_avg is not None
                                   else (get(shard.exp_avg_key), get(shard.exp_avg_sq_key)))
        return _Ahead(exp_avg, exp_avg_sq, master, 0)

    def _loaded(self, batch: list[_Job], reads: list["_Ahead"]
                ) -> tuple[list[torch.Tensor], list[Optional[tuple[torch.Tensor, torch.Tensor]]]]:
        """Each job's fp32 master and its moments (None: a first step, whose moments start at zero)."""
        masters: list[torch.Tensor] = []
        pairs: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = []
        for job, read in zip(batch, reads):
            if job.master is None:
                assert read.master is not None
                value = read.master.result().view(-1)
                self.counters.bytes_read += value.numel() * value.element_size()
                job.master = value if value.dtype == torch.float32 else value.float()
                self._read_masters.add(job.shard.name)
            masters.append(job.master)
            if read.exp_avg is None or read.exp_avg_sq is None:
                pairs.append(None)
                continue
            pairs.append((read.exp_avg.result().view(-1), read.exp_avg_sq.result().view(-1)))
            self.counters.bytes_read += 2 * job.shard.numel * 4
        return masters, pairs

    def _start_write(self, items: dict[str, torch.Tensor], codecs: dict[str, Optional[bool]], nbytes: int) -> None:
        """Start writing a batch's new values atomically (``nbytes``: its fp32 shards' bytes);
        :meth:`_finish_write` waits for it."""
        future = self._store.sync.put_many_future(items, "nvme", codecs, atomic=True, keep=self._keep)
        writing = _Writing(future, items, nbytes)
        with self._cond:
            self._writes.append(writing)
        future.add_done_callback(lambda _: self._notify())

    def _finish_writes(self, keep: int) -> None:
        """Wait for the oldest batches being written until ``keep`` are left; raises what a write raised
        once every other one has been waited for."""
        first: Optional[BaseException] = None
        while True:
            with self._cond:
                if len(self._writes) <= keep:
                    break
                oldest = self._writes[0]
            try:
                self._finish_write(oldest)
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others
                first = first or exc
                keep = 0
        if first is not None:
            raise first

    def _finish_write(self, writing: "_Writing") -> None:
        """Wait for the oldest batch being written and count it; raises what the write raised."""
        try:
            writing.future.result()
        finally:
            with self._cond:
                self._writes.popleft()
        counters = self.counters
        if self.on_event is not None:
            self.on_event("written", counters.batches)
        counters.bytes_written += sum(t.numel() * t.element_size() for t in writing.items.values())
        counters.batches += 1

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _take_ahead(self, shard: OptimShard) -> Optional["_Ahead"]:
        """What was read ahead for ``shard`` (lock held), or None."""
        ahead = self._ahead.pop(shard.name, None)
        if ahead is not None:
            self._ahead_bytes -= ahead.nbytes
        return ahead

    def _top_up(self, beside: int = 0) -> None:
        """Read ahead along the order while the window has room, at least one shard (lock held).
        ``beside``: what a batch in hand holds (:meth:`_held_by`); the reads started then also stay
        within the plan's bound with it ([Note: Keeping the disk busy])."""
        get = self._store.sync.get_future
        while self._cursor < len(self._order) and not self._closed:
            shard, moments, master = self._order[self._cursor]
            nbytes = (2 * moments + master) * shard.numel * 4
            if self._ahead and self._ahead_bytes + nbytes > self._window_limit:
                return
            if beside and beside + self._ahead_bytes + nbytes > self._hold_limit:
                return
            self._cursor += 1
            if shard.name in self._ahead:
                continue
            self._ahead[shard.name] = _Ahead(
                get(shard.exp_avg_key) if moments else None, get(shard.exp_avg_sq_key) if moments else None,
                get(entries_of(shard)[1][_master_source(shard, bool(moments))]) if master else None, nbytes)
            self._ahead_bytes += nbytes

    def _drop_ahead(self) -> list["concurrent.futures.Future[torch.Tensor]"]:
        """Forget the reads ahead (lock held); returns their futures, for the caller to wait for once it
        has let go of the lock (a write's completion takes the lock on the store's thread)."""
        ahead, self._ahead = self._ahead, {}
        self._ahead_bytes = 0
        self._order, self._cursor = [], 0
        return [f for a in ahead.values() for f in (a.exp_avg, a.exp_avg_sq, a.master) if f is not None]


def _renamed(renaming: "Optional[concurrent.futures.Future[None]]", *, quiet: bool = False) -> None:
    """Wait for a batch's renames (None: there were none); with ``quiet``, an error of theirs is not
    raised (another error is on its way and is the one reported)."""
    if renaming is None:
        return
    try:
        renaming.result()
    except BaseException:
        if not quiet:
            raise


def _master_source(shard: OptimShard, has_state: bool) -> str:
    """The role of the entry that holds ``shard``'s fp32 master before its update: the parameter when it
    is its own master, or when the shard has no state yet (its master is the parameter upcast)."""
    return "master" if has_state and not shard.master_is_param else "param"


def _wait_dropped(futures: Sequence["concurrent.futures.Future[torch.Tensor]"]) -> None:
    """Wait for reads no one will use; their outcome does not matter."""
    for future in futures:
        try:
            future.result()
        except Exception:  # noqa: BLE001 - unused reads
            pass


@dataclasses.dataclass
class _Ahead:
    """Reads started ahead for one shard: its moments and, when its update needs it, its master (or
    the parameter it is made from)."""

    exp_avg: "Optional[concurrent.futures.Future[torch.Tensor]]"
    exp_avg_sq: "Optional[concurrent.futures.Future[torch.Tensor]]"
    master: "Optional[concurrent.futures.Future[torch.Tensor]]"
    nbytes: int


@dataclasses.dataclass
class _Writing:
    """A batch whose new values are being written: the write, what it writes (held until it is done),
    and its fp32 shards' bytes."""

    future: "concurrent.futures.Future[None]"
    items: dict[str, torch.Tensor]
    nbytes: int
