"""The benchmark's phases. Each takes the run's context and adds figures to its result."""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
from typing import Any, Callable, Optional

import torch

from tiered import StoreConfig
from tiered.bench.deepspeed_aio import DeepSpeedAio
from tiered.bench.fio import READ, WRITE, FioFile, FioSetting
from tiered.bench.fio_cache import cached_best, keep_best
from tiered.bench.fio_sweep import best_setting, fio_best
from tiered.bench.options import BenchOptions, fill, format_size
from tiered.util.progress import Progress
from tiered.bench.results import (CACHED_SWEEP, FULL_SWEEP, GBPS, OPS, SECONDS, SHORT_SWEEP, BenchResult, Figure,
                                  Run)
from tiered.bench.store import LargeTensors, StoreUnderTest, prefetch_round, put_all, small_batched_round, small_round
from tiered.bench.system import drop_page_cache
from tiered.bench.targets import ALIGNED, BATCHED_OP, ONE_AT_A_TIME, OWN_FILES
from tiered.bench.tensors import TensorFactory
from tiered.bench.torchsave import TorchSave
from tiered.config import MiB
from tiered.io.host_memory import empty_aligned


@dataclasses.dataclass
class Context:
    """What every phase needs: options, the work directory, the result, and the loaded aio module."""

    options: BenchOptions
    workdir: str
    result: BenchResult
    factory: TensorFactory
    aio: Optional[Any] = None
    fio_present: bool = False

    def store_config(self, name: str, **changes: Any) -> StoreConfig:
        """A StoreConfig in its own subdirectory with the run's I/O settings; no host or device tier
        unless ``changes`` gives one (puts and gets in these phases go straight to and from nvme)."""
        fields: dict[str, Any] = {"block_size": self.options.block_size, "queue_depth": self.options.queue_depth,
                                  "io_threads": self.options.io_threads, "coalesce_bytes": self.options.coalesce_bytes,
                                  "checksum": self.options.checksum, "host_bytes": 0, "device_bytes": 0}
        fields.update(changes)
        return StoreConfig(path=os.path.join(self.workdir, name), **fields)

    def progress(self, label: str, total: int) -> Progress:
        """A progress bar for one phase."""
        return Progress(label, total, enabled=not self.options.quiet)

    def note(self, text: str) -> None:
        """Add a note to the report (once)."""
        if text and text not in self.result.notes:
            self.result.notes.append(text)

    def cold(self) -> None:
        """Drop the page cache before reads when --drop-caches asked for it."""
        if self.options.drop_caches:
            done, why = drop_page_cache()
            if not done:
                self.note(f"--drop-caches: {why}")


Step = Callable[[], Run]


def run_round_robin(ctx: Context, phase: str, writers: dict[str, tuple[str, Step]],
                    readers: dict[str, tuple[str, Step]], label: str, *, warm_up: bool = False) -> None:
    """Repeat: every writer once, then every reader once, so slow drift of a shared disk hits every
    contender alike; the order rotates each time, so no contender always goes first or last.
    ``writers``/``readers`` map figure keys ``tool:op`` to (tool, step). ``warm_up``: every writer
    runs once, untimed, before the first repetition, so every timed write overwrites disk blocks its
    contender has written before (as fio's ``overwrite=1`` lays out its file first)."""
    figures = {key: ctx.result.add(Figure(phase, tool, key.split(":", 1)[1], GBPS))
               for key, (tool, _) in {**writers, **readers}.items()}
    steps = ctx.options.repeats * (len(writers) + len(readers)) + (len(writers) if warm_up else 0)
    with ctx.progress(label, steps) as bar:
        if warm_up:
            for _, step in writers.values():
                step()
                bar.advance()
        for rep in range(ctx.options.repeats):
            for group in (writers, readers):
                if group is readers:
                    ctx.cold()
                items = list(group.items())
                shift = rep % len(items)
                for key, (_, step) in items[shift:] + items[:shift]:
                    figures[key].runs.append(step())
                    bar.advance()


def large_phase(ctx: Context) -> None:
    """Large tensors (``total_bytes`` in all): store put/get vs fio, torch.save/load and DeepSpeed aio."""
    opts = ctx.options
    sizes = opts.large_sizes()
    phase = f"large ({format_size(opts.total_bytes)} as {len(sizes)} tensors)"
    tensors = ctx.factory.make_all(sizes)
    closers: list[Callable[[], None]] = []
    writers: dict[str, tuple[str, Step]] = {}
    readers: dict[str, tuple[str, Step]] = {}
    try:
        sut = StoreUnderTest(ctx.store_config("store-large"))
        closers.append(sut.close)
        store = LargeTensors(sut, tensors)
        outs = [torch.zeros_like(t) for t in tensors]
        writers["store:write"] = ("store", store.write)
        writers["store:write, puts in flight"] = ("store", store.write_concurrently)
        readers["store:read"] = ("store", store.read)
        readers["store:read into out="] = ("store", lambda: store.read(into=outs))
        readers["store:read into out=, gets in flight"] = ("store", lambda: _zeroed(outs, store.read_concurrently))
        ds = None
        if ctx.aio is not None:
            ds = DeepSpeedAio(ctx.aio, os.path.join(ctx.workdir, "ds-locked"), tensors, block_size=opts.block_size,
                              queue_depth=opts.queue_depth, threads=min(opts.io_threads, 4), locked=True)
            closers.append(ds.close)
        # The same tensors in page-aligned memory, which the store writes from and reads into in place: when
        # DeepSpeed runs, its own page-locked buffers, so both move the same bytes from and to the same
        # memory (on a VM, identical buffers allocated at different times moved the same reads by 10% and
        # more); otherwise empty_aligned copies.
        shared = ds.buffer_tensors() if ds is not None else None
        aligned = shared if shared is not None else _aligned_copies(tensors)
        if shared is not None:
            ctx.note("store rows on aligned tensors: DeepSpeed's page-locked buffers, the very memory it moves")
        store_aligned = LargeTensors(sut, aligned)
        writers[f"store:write, {ALIGNED}"] = ("store", store_aligned.write)
        writers[f"store:write, {ALIGNED}, puts in flight"] = ("store", store_aligned.write_concurrently)
        readers[f"store:read into out=, {ALIGNED}"] = ("store", lambda: _zeroed(aligned, lambda o: store.read(into=o)))
        readers[f"store:read into out=, {ALIGNED}, gets in flight"] = (
            "store", lambda: _zeroed(aligned, store.read_concurrently))
        if not sut.direct:
            ctx.note("the store fell back to buffered I/O here (no O_DIRECT), so its reads may come from the page "
                     "cache" + ("" if opts.drop_caches else "; use --drop-caches for cold reads"))
        if ctx.fio_present and opts.uses("fio"):
            fio, fio_write, fio_read = fio_at_its_best(ctx)
            closers.append(fio.close)
            writers["fio:write"] = ("fio", lambda: fio.write(fio_write))
            readers["fio:read"] = ("fio", lambda: fio.read(fio_read))
        if opts.uses("torch"):
            ts = TorchSave(os.path.join(ctx.workdir, "torch"), tensors)
            closers.append(ts.close)
            writers["torch.save:write"] = ("torch.save", ts.write)
            readers["torch.save:read"] = ("torch.save", ts.read)
        # DeepSpeed writes and reads the store's own swap file, at the ranges the store holds the same
        # tensors in: the same disk blocks, so file placement (worth +-15% between files on a virtual
        # disk) cannot favour either side. Its own files, one per tensor, are measured too.
        in_store = functools.partial(sut.placements, store.keys)
        if ds is not None:
            writers["deepspeed:write"] = ("deepspeed", lambda: ds.write(in_store()))
            readers["deepspeed:read"] = ("deepspeed", lambda: ds.read(in_store()))
            writers[f"deepspeed:write, {ONE_AT_A_TIME}"] = (
                "deepspeed", lambda: ds.write(in_store(), one_at_a_time=True))
            readers[f"deepspeed:read, {ONE_AT_A_TIME}"] = ("deepspeed", lambda: ds.read(in_store(), one_at_a_time=True))
            own = f"deepspeed ({OWN_FILES})"
            writers[f"{own}:write"] = (own, lambda: ds.write(ds.own_files()))
            readers[f"{own}:read"] = (own, lambda: ds.read(ds.own_files()))
            ctx.note(f"deepspeed: {ds.describe()}; on the store's swap file at the ranges holding the same tensors "
                     f"(TieredStore.nvme_layout), and, as {own}, on one file per tensor")
        # A virtual disk may write blocks it never held before at half speed (thin provisioning: the host
        # allocates them on first touch), which fio's layout pass and
        # DeepSpeed on the store's blocks never pay: every writer first writes its files once, untimed.
        run_round_robin(ctx, phase, writers, readers, "large tensors", warm_up=True)
        ctx.note("large tensors: every writer wrote its files once, untimed, before the timed runs (each timed "
                 "write overwrites blocks its contender wrote before, as fio's overwrite=1 does)")
        if ctx.aio is not None:
            # After the others, not among them: its page-locked bounce copies slowed the other
            # contenders' reads in the same process (store 1.9 -> 1.1 GB/s, fio 1.8 -> 1.0 here).
            tool = "deepspeed (plain tensors)"
            plain = DeepSpeedAio(ctx.aio, os.path.join(ctx.workdir, "ds-plain"), tensors, block_size=opts.block_size,
                                 queue_depth=opts.queue_depth, threads=min(opts.io_threads, 4), locked=False)
            closers.append(plain.close)
            run_round_robin(ctx, phase, {f"{tool}:write": (tool, lambda: plain.write(in_store()))},
                            {f"{tool}:read": (tool, lambda: plain.read(in_store()))}, "deepspeed, plain tensors")
            ctx.note(f"{tool}: {plain.describe()}; on the store's swap file; measured after the other contenders")
        if ctx.fio_present and opts.uses("fio"):
            ctx.note(fio.note)
        cold = "O_DIRECT (page cache bypassed)" if sut.direct else "buffered (may be cached)"
        for f in ctx.result.figures:
            if f.phase == phase and f.tool == "store":
                f.note = {"write": "sequential puts to nvme, each durable on return",
                          "write, puts in flight": "all puts awaited together (asyncio.gather)",
                          "read": f"sequential cold gets, new tensors; {cold}",
                          "read into out=": f"sequential cold gets into caller tensors; {cold}",
                          "read into out=, gets in flight": f"cold gets into caller tensors awaited together; {cold}",
                          f"write, {ALIGNED}": "sequential puts of page-aligned tensors (no staging copy)",
                          f"write, {ALIGNED}, puts in flight": "puts of page-aligned tensors awaited together",
                          f"read into out=, {ALIGNED}": f"sequential cold gets into page-aligned tensors (in place); "
                                                        f"{cold}",
                          f"read into out=, {ALIGNED}, gets in flight": "cold gets into page-aligned tensors awaited "
                                                                        f"together; {cold}"}.get(f.op, "")
    finally:
        for close in reversed(closers):
            close()
    _set_fio_ratios(ctx.result, phase)


def fio_at_its_best(ctx: Context) -> tuple[FioFile, FioSetting, FioSetting]:
    """fio's best write and read setting on this disk, and a file of the large phase's size to time
    them on: the limit the store is held against is what fio does at its best here, not at one
    setting of ours.

    The options' grid is swept (on ``fio_sweep_bytes``, at most the large phase's size); a full sweep
    keeps its best settings for the disk (tiered.bench.fio_cache). A ``--quick`` run uses the settings
    a full sweep kept for this disk instead of its short grid; without them it sweeps the short grid
    and says that the figure is not the disk's limit (``BenchResult.fio_reference``)."""
    opts = ctx.options
    directory = opts.directory
    cached = cached_best(opts.fio_cache, directory) if opts.quick else None
    if cached is not None:
        write, read = (FioSetting(**cached[f"best_{rw}"]["setting"]) for rw in (WRITE, READ))
        ctx.result.fio_sweep = {"cached": cached, "cache": opts.fio_cache}
        ctx.result.fio_reference = CACHED_SWEEP
        ctx.note(f"fio: not swept (--quick); its timed runs use the best settings of the full sweep of "
                 f"{cached['date']} on this disk ({cached['settings']} settings on {format_size(cached['nbytes'])}, "
                 f"kept in {opts.fio_cache}): writes {write.describe()} (then "
                 f"{cached['best_write']['median'] / 1e9:.2f} GB/s), reads {read.describe()} (then "
                 f"{cached['best_read']['median'] / 1e9:.2f} GB/s)")
        return FioFile(os.path.join(ctx.workdir, "fio"), opts.total_bytes), write, read
    nbytes = min(opts.fio_sweep_bytes, opts.total_bytes)
    with ctx.progress("fio sweep", 1) as bar:
        _, _, details = fio_best(os.path.join(ctx.workdir, "fio-sweep"), nbytes=nbytes,
                                 block_sizes=opts.fio_block_sizes, queue_depths=opts.fio_queue_depths,
                                 jobs=opts.fio_jobs, repeats=1)
        bar.advance()
    ctx.result.fio_sweep = details
    write, read = best_setting(details, WRITE), best_setting(details, READ)
    ctx.note(f"fio: swept {len(details['grid'])} settings (block sizes x queue depths x jobs) on "
             f"{format_size(details['nbytes'])}; its timed runs use the best of each direction: writes "
             f"{write.describe()} ({details['best_write']['median'] / 1e9:.2f} GB/s in the sweep), reads "
             f"{read.describe()} ({details['best_read']['median'] / 1e9:.2f} GB/s); libaio, "
             f"{'O_DIRECT' if details['direct'] else 'buffered'}, writes with end_fsync=1 over a laid-out file, "
             "reads with zero_buffers=1")
    if opts.full_fio_sweep():
        ctx.result.fio_reference = FULL_SWEEP
        why_not = keep_best(opts.fio_cache, directory, details)
        ctx.note(f"fio: its best settings are kept in {opts.fio_cache} for --quick runs on this disk" if why_not is None
                 else f"fio: its best settings are not kept for --quick runs ({why_not})")
    else:
        ctx.result.fio_reference = SHORT_SWEEP
        ctx.note(f"fio: {'--quick' if opts.quick else 'this run'} swept a short grid on a small file, which does "
                 "not find the disk's best: its figures are NOT the disk's limit, so the store's ratios to fio are "
                 "not verdicts. A run without --quick sweeps fio's full grid and keeps its best settings for later "
                 "--quick runs on this disk")
    return FioFile(os.path.join(ctx.workdir, "fio"), opts.total_bytes), write, read


def device_phase(ctx: Context) -> None:
    """Large tensors put from and got into ``--device`` memory, beside the same tensors from and into
    host memory, alternated: what the copies between device memory and the store's staging cost
    against the disk's own speed (on a CPU-only machine, ``--device cpu`` checks the phase)."""
    opts = ctx.options
    device = torch.device(opts.device)
    sizes = opts.large_sizes()
    host = ctx.factory.make_all(sizes)
    on_device = [t.to(device) for t in host]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    phase = f"device ({format_size(opts.total_bytes)} as {len(sizes)} tensors, {device})"
    sut = StoreUnderTest(ctx.store_config("store-device", device=str(device)))
    try:
        sides = {"host": LargeTensors(sut, host, prefix="host"), str(device): LargeTensors(sut, on_device,
                                                                                         prefix="device")}
        writers = {f"store:put from {name}": ("store", side.write) for name, side in sides.items()}
        readers = {f"store:get into {name}": ("store", side.read) for name, side in sides.items()}
        run_round_robin(ctx, phase, writers, readers, "device memory", warm_up=True)
    finally:
        sut.close()
    for op in ("put from", "get into"):
        mine, host_fig = ctx.result.figure(phase, "store", f"{op} {device}"), ctx.result.figure(phase, "store",
                                                                                                   f"{op} host")
        paired = [a.value / b.value for a, b in zip(mine.runs, host_fig.runs)]
        mine.note = (f"{statistics.median(paired):.2f} of host memory's speed (median of runs paired within a "
                     f"repetition; {min(paired):.2f}-{max(paired):.2f})")
    ctx.note(f"device: puts to nvme and cold gets of the same tensors from and into {device} memory and host "
             "memory, alternated; gets into new tensors on that side")


def compress_phase(ctx: Context) -> None:
    """Large bf16 N(0, 0.02) tensors put with compress=True: effective GB/s and stored/original ratio."""
    opts = ctx.options
    total = min(opts.total_bytes, 128 * MiB) if opts.quick else opts.total_bytes
    tensors = ctx.factory.make_all(fill(opts.tensor_sizes, total))
    phase = f"large, zstd ({format_size(total)} bf16)"
    sut = StoreUnderTest(ctx.store_config("store-zstd"))
    try:
        store = LargeTensors(sut, tensors, compress=True)
        run_round_robin(ctx, phase, {"store:write": ("store", store.write)}, {"store:read": ("store", store.read)},
                        "large tensors, compressed")
    finally:
        sut.close()
    for f in ctx.result.figures:
        if f.phase == phase and f.op == "write":
            ratio = sorted(r.detail["stored_ratio"] for r in f.runs)[len(f.runs) // 2]
            f.note = f"stored/original {ratio:.3f}; GB/s of logical bytes"


def small_phase(ctx: Context) -> None:
    """Many small tensors: put+get ops/s at 64 KiB and for a 4 KiB-1 MiB mix, sequential, concurrent and batched."""
    opts = ctx.options
    sets = [("small 64KiB", [64 * 1024] * opts.small_count, False),
            (f"small mix {format_size(min(opts.small_sizes))}-{format_size(max(opts.small_sizes))}",
             opts.small_mix(), False)]
    if opts.compress:
        sets.append((sets[1][0] + ", zstd", opts.small_mix(), True))
    n = opts.small_concurrency
    # (op, calls in flight, batch): one put/get per call, or put_many/get_many of ``batch`` keys per call.
    modes = [("put+get, sequential", 1, 0), (f"put+get, {n} in flight", n, 0),
             (f"{BATCHED_OP}, batches of {n}", 1, n)]
    sut = StoreUnderTest(ctx.store_config("store-small"))
    try:
        with ctx.progress("small tensors", len(sets) * len(modes) * opts.repeats) as bar:
            for phase, sizes, compress in sets:
                tensors = ctx.factory.make_all(sizes)
                for op, concurrency, batch in modes:
                    if compress and concurrency == 1 and not batch:
                        continue
                    fig = ctx.result.add(Figure(phase, "store", op, OPS))
                    for _ in range(opts.repeats):
                        ctx.cold()
                        if batch:
                            run = small_batched_round(sut, tensors, batch=batch, compress=compress)
                        else:
                            run = small_round(sut, tensors, concurrency=concurrency, compress=compress)
                        fig.runs.append(run)
                        bar.advance()
                    d = sorted(fig.runs, key=lambda r: r.value)[len(fig.runs) // 2].detail
                    fig.note = (f"put {d['put_ops_per_s']:.0f} ops/s {d['put_gbps']:.2f} GB/s, "
                                f"get {d['get_ops_per_s']:.0f} ops/s {d['get_gbps']:.2f} GB/s")
                sut.clear()
    finally:
        sut.close()


def prefetch_phase(ctx: Context) -> None:
    """N gets with a fixed compute delay between them, with and without prefetching ahead."""
    opts = ctx.options
    tensors = ctx.factory.make_all([opts.prefetch_bytes] * opts.prefetch_count)
    keys = [f"prefetch/{i:04d}" for i in range(len(tensors))]
    phase = (f"prefetch ({opts.prefetch_count} x {format_size(opts.prefetch_bytes)}, "
             f"{opts.compute_seconds * 1000:.0f} ms compute per get)")
    host = (opts.prefetch_ahead + 2) * opts.prefetch_bytes
    sut = StoreUnderTest(ctx.store_config("store-prefetch", host_bytes=host))
    try:
        put_all(sut, keys, tensors)
        plain = ctx.result.add(Figure(phase, "store", "gets, no prefetch", SECONDS))
        ahead = ctx.result.add(Figure(phase, "store", f"gets, prefetch {opts.prefetch_ahead} ahead", SECONDS))
        with ctx.progress("prefetch overlap", 2 * opts.repeats) as bar:
            for _ in range(opts.repeats):
                for fig, n in ((plain, 0), (ahead, opts.prefetch_ahead)):
                    fig.runs.append(prefetch_round(sut, keys, tensors, ahead=n, compute_seconds=opts.compute_seconds))
                    bar.advance()
    finally:
        sut.close()
    compute = opts.compute_seconds * opts.prefetch_count
    io = max(plain.median - compute, 0.0)
    ideal = max(io, compute)  # full overlap of I/O with compute
    plain.note = f"get into a reused tensor, then {opts.compute_seconds * 1000:.0f} ms of compute; I/O alone {io:.2f} s"
    ahead.note = (f"{plain.median / ahead.median:.2f}x faster than no prefetch; full overlap would take "
                  f"max(I/O, compute) = {ideal:.2f} s")


def _aligned_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` in page-aligned memory (untimed setup)."""
    out = []
    for t in tensors:
        a = empty_aligned(t.shape, t.dtype, pin=False)
        a.copy_(t)
        out.append(a)
    return out


def _zeroed(outs: list[torch.Tensor], read: Callable[[list[torch.Tensor]], Run]) -> Run:
    """Zero ``outs`` (untimed, so a read that moves nothing fails verification), then ``read(outs)``,
    which gets every key into them and checks them against the original tensors."""
    for out in outs:
        out.zero_()
    return read(outs)


def _set_fio_ratios(result: BenchResult, phase: str) -> None:
    for f in result.figures:
        if f.phase != phase or f.tool == "fio":
            continue
        ref = result.figure(phase, "fio", "write" if f.op.startswith("write") else "read")
        if ref is not None and ref.runs and ref.median > 0:
            f.ratio_to_fio = f.median / ref.median
