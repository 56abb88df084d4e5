"""Shared fixtures: real stores on real files under pytest's tmp_path."""

from __future__ import annotations

import contextlib
import importlib
import os
import types
from typing import Callable, Iterator, Mapping

import pytest
import torch

import tiered
from small_filesystems import mounted

KiB = 1024
MiB = 1024 * KiB

#: Every dtype a tensor can be stored with (quantized dtypes need their quantizer and are refused).
ALL_DTYPES = sorted(
    {
        d
        for d in (getattr(torch, name) for name in dir(torch))
        if isinstance(d, torch.dtype)
        and d not in {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
    },
    key=str,
)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (NaN payloads, subnormals and all)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of dtype, shape and bytes (NaN == NaN when the bits agree)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def ranks_env(world: int, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``env`` for a job of ``world`` ranks: CUDA hidden where this machine has fewer GPUs than ranks,
    since NCCL wants a GPU per rank; the ranks then run on the CPU over gloo, as in CI."""
    if torch.cuda.device_count() >= world:
        return dict(env)
    return {**env, "CUDA_VISIBLE_DEVICES": ""}


@contextlib.contextmanager
def ranks_started_here(world: int) -> Iterator[None]:
    """Processes started inside (``torch.multiprocessing`` spawns copy ``os.environ``) get
    :func:`ranks_env`; this process's own CUDA is untouched."""
    hidden = ranks_env(world, {})
    saved = {key: os.environ.get(key) for key in hidden}
    os.environ.update(hidden)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def config(tmp_path) -> tiered.StoreConfig:
    """Small budgets and blocks so multi-block and eviction paths run on small tensors."""
    return tiered.StoreConfig(
        path=str(tmp_path / "store"),
        device_bytes=1 * MiB,
        host_bytes=2 * MiB,
        block_size=64 * KiB,
        queue_depth=4,
        io_threads=4,
        swap_grow_bytes=1 * MiB,
    )


@pytest.fixture
async def store(config):
    s = await tiered.TieredStore.open_async(config)
    yield s
    await s.close()


@pytest.fixture
def benchmark_script(monkeypatch) -> Callable[[str], types.ModuleType]:
    """Imports a script of benchmarks/ by name (the scripts import their sibling bench_output, so
    the folder goes on sys.path for the test)."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    return importlib.import_module


@pytest.fixture
def small_tmpfs(tmp_path):
    """A freshly mounted 2 MiB tmpfs (skipped where this process may not mount)."""
    yield from mounted("tmpfs", tmp_path, mib=2)
