"""Runs the phases of one benchmark in a scratch directory and always removes it."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time

from tiered.bench.deepspeed_aio import load_aio
from tiered.bench.fio import fio_status
from tiered.bench.options import BenchOptions
from tiered.bench.phases import Context, compress_phase, device_phase, large_phase, prefetch_phase, small_phase
from tiered.bench.results import BenchResult, ToolStatus
from tiered.bench.sweep import sweep_phase
from tiered.bench.system import drop_page_cache, machine_info
from tiered.bench.targets import check_targets
from tiered.bench.tensors import TensorFactory
from tiered.io.crc import CRC32_IMPL


def run_bench(options: BenchOptions) -> BenchResult:
    """Every phase the options ask for; the scratch directory under ``options.directory`` is removed
    afterwards, whatever happens."""
    os.makedirs(options.directory, exist_ok=True)
    started = time.perf_counter()
    result = BenchResult(options=_options_dict(options), machine=machine_info(options.directory))
    workdir = tempfile.mkdtemp(prefix="tiered-bench-", dir=options.directory)
    try:
        ctx = Context(options, workdir, result, TensorFactory(seed=options.seed))
        _tools(ctx)
        ctx.note(f"checksums: CRC-32 by {CRC32_IMPL}" if options.checksum else
                 "checksums: off (--no-checksum): the store neither computes nor verifies a CRC-32, unlike its "
                 "default; compare with a run without the option to price the check")
        if options.drop_caches:
            done, why = drop_page_cache()
            ctx.note("--drop-caches: the page cache is dropped before every read" if done else f"--drop-caches: {why}")
        for name, phase in (("large", large_phase), ("compress", compress_phase), ("small", small_phase),
                            ("prefetch", prefetch_phase), ("device", device_phase), ("sweep", sweep_phase)):
            if options.runs(name):
                phase_started = time.perf_counter()
                phase(ctx)
                result.phase_seconds[name] = time.perf_counter() - phase_started
        result.targets = check_targets(result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        result.seconds = time.perf_counter() - started
        result.machine["loadavg_after"] = list(os.getloadavg())
    return result


def _tools(ctx: Context) -> None:
    opts = ctx.options
    fio = fio_status() if opts.uses("fio") else ToolStatus("fio", False, skipped=True, note="left out with --skip")
    ctx.fio_present = fio.present and not fio.skipped
    ctx.result.tools["fio"] = fio
    ctx.result.tools["torch.save"] = ToolStatus("torch.save", True, skipped=not opts.uses("torch"),
                                                note="" if opts.uses("torch") else "left out with --skip")
    if opts.uses("deepspeed"):
        ctx.aio, status = load_aio(None if opts.quiet else lambda line: print(line, file=sys.stderr))
    else:
        status = ToolStatus("deepspeed", False, skipped=True, note="left out with --skip")
    ctx.result.tools["deepspeed"] = status


def _options_dict(options: BenchOptions) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(options).items()}
