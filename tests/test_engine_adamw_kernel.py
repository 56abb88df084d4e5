"""The one-pass AdamW kernel ([Note: One-pass AdamW]): torch's single-tensor bits on every input, a
build that is checked before it is used, and torch's function wherever the kernel cannot be trusted."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.optim.adamw import adamw as torch_adamw

import tiered
from engine import AdamW, EngineConfig, wrap
from engine.optim.adamw_kernel import AdamWKernel, load_adamw_kernel, probe_difference
from engine.optim.types import AdamHyper

@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> AdamWKernel:
    """The kernel, built in a cache of the module's own; the tests that need it skip, saying why, only
    where it cannot be built or trusted here (no C compiler, a torch without MKL's square root)."""
    built, how = load_adamw_kernel(str(tmp_path_factory.mktemp("cache")))
    if built is None:
        pytest.skip(how)
    return built


def _inputs(n: int, gen: torch.Generator, special: bool) -> list[torch.Tensor]:
    param, grad, exp_avg = (torch.randn(n, generator=gen) * s for s in (1.0, 1e-2, 1e-3))
    exp_avg_sq = torch.rand(n, generator=gen) * 1e-5
    if special:
        values = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3e-39, 3e38, 1e-30])
        for t in (param, grad, exp_avg, exp_avg_sq):
            at = torch.randint(0, n, (min(n, len(values)),), generator=gen)
            t[at] = values[: len(at)]
    return [param, grad, exp_avg, exp_avg_sq]


@pytest.mark.parametrize("seed", range(6))
def test_the_kernel_gives_torchs_single_tensor_bits(kernel: AdamWKernel, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(8):
        n = int(torch.randint(1, 70000, (1,), generator=gen))
        beta1 = float(torch.tensor([0.0, 0.3, 0.5, 0.6, 0.9, 0.99])[torch.randint(0, 6, (1,), generator=gen)])
        hyper = AdamHyper(lr=float(torch.rand(1, generator=gen)) * 1e-2, beta1=beta1,
                          beta2=float(torch.tensor([0.95, 0.999])[seed % 2]), eps=[1e-8, 1e-6, 0.0][seed % 3],
                          weight_decay=[0.0, 0.01, 0.1][seed % 3])
        count = float(torch.randint(0, 5000, (1,), generator=gen))
        ours = _inputs(n, gen, special=seed % 2 == 1)
        theirs = [t.clone() for t in ours]
        ours_step, theirs_step = torch.tensor(count), torch.tensor(count)
        kernel.step(*ours, ours_step, hyper)
        torch_adamw(*([t] for t in theirs), [], [theirs_step], foreach=False, fused=None, amsgrad=False,
                    beta1=hyper.beta1, beta2=hyper.beta2, lr=hyper.lr, weight_decay=hyper.weight_decay,
                    eps=hyper.eps, maximize=False)
        for a, b in zip(ours + [ours_step], theirs + [theirs_step]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (n, hyper, count)


def test_the_kernel_refuses_what_it_does_not_compute_as_torch_does(kernel: AdamWKernel) -> None:
    tensors = [torch.zeros(8) for _ in range(4)]
    assert not kernel.applies(AdamHyper(fused=True), tensors)
    assert not kernel.applies(AdamHyper(foreach=True), tensors)
    assert not kernel.applies(AdamHyper(lr=torch.tensor(1e-3)), tensors)
    assert not kernel.applies(AdamHyper(), [*tensors[:3], torch.zeros(8, dtype=torch.float64)])
    assert not kernel.applies(AdamHyper(), [*tensors[:3], torch.zeros(16)[::2]])
    step = torch.tensor(0.0)
    with pytest.raises(ValueError, match="float32"):
        kernel.step(*tensors[:3], torch.zeros(8, dtype=torch.float64), step, AdamHyper())
    with pytest.raises(ValueError, match="differ"):
        kernel.step(*tensors[:3], torch.zeros(9), step, AdamHyper())
    assert step.item() == 0.0  # a call that raised changed nothing


class _OneUlpOff(AdamWKernel):
    """A kernel that rounds its parameters one step up: what the probe must catch."""

    def step(self, param, grad, exp_avg, exp_avg_sq, step, hyper):  # type: ignore[no-untyped-def]
        super().step(param, grad, exp_avg, exp_avg_sq, step, hyper)
        if param.numel() > 200:
            param.copy_(torch.nextafter(param, torch.full_like(param, float("inf"))))


def test_the_probe_finds_a_kernel_that_differs_from_torch(kernel: AdamWKernel) -> None:
    assert probe_difference(kernel) is None
    off = _OneUlpOff(kernel._function, kernel._root)
    assert "param of" in (probe_difference(off) or "")


def test_without_a_compiler_torchs_function_runs_and_the_reason_is_given(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    built, how = load_adamw_kernel(str(tmp_path / "cache"))
    assert built is None
    assert how.startswith("torch's AdamW (the one-pass kernel did not build") and "no-such-cc" in how


def test_a_compiler_that_fails_leaves_torchs_function(tmp_path, monkeypatch) -> None:
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\n"
                       "[ \"$1\" = --version ] && { echo 'a cc 1.0'; exit 0; }\n"  # the build key asks its version
                       "echo 'cc: error: no' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    built, how = load_adamw_kernel(str(tmp_path / "cache"))
    assert built is None and "did not build" in how and "cc: error: no" in how
    assert list((tmp_path / "cache").iterdir()) == []  # no partial library left behind


def test_a_cached_library_that_is_a_link_or_writable_by_others_is_not_loaded(kernel: AdamWKernel, tmp_path) -> None:
    cache = tmp_path / "cache"
    assert load_adamw_kernel(str(cache))[0] is not None
    (library,) = cache.iterdir()
    planted = tmp_path / "planted.so"
    planted.write_bytes(b"not a library")
    library.unlink()
    library.symlink_to(planted)  # a link in the cache is never followed: the kernel is built apart
    built, _ = load_adamw_kernel(str(cache))
    assert built is not None and library.is_symlink() and planted.read_bytes() == b"not a library"
    library.unlink()
    assert load_adamw_kernel(str(cache))[0] is not None  # built into the cache again
    library.chmod(0o777)
    assert load_adamw_kernel(str(cache))[0] is not None  # refused, built apart
    assert library.stat().st_mode & 0o777 == 0o777


def _wrap_linear(path) -> tuple[object, AdamW]:
    store = tiered.StoreConfig(path=str(path), host_bytes=1 << 20, block_size=64 << 10, swap_grow_bytes=1 << 20,
                               prefault_host=False, result_pool_bytes=0)
    optimizer = AdamW(lr=1e-3)
    return wrap(torch.nn.Linear(8, 8), config=EngineConfig(store=store), optimizer=optimizer), optimizer


def test_wrap_says_which_adamw_math_runs(kernel: AdamWKernel, tmp_path, caplog, monkeypatch) -> None:
    with caplog.at_level(logging.INFO, logger="engine"):
        eng, optimizer = _wrap_linear(tmp_path / "kernel")
        eng.close()
    assert optimizer.math_path == "one pass, bit for bit torch's AdamW"
    assert any("AdamW math: one pass, bit for bit torch's AdamW" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.INFO, logger="engine"):
        eng, optimizer = _wrap_linear(tmp_path / "torch")
        eng.close()
    assert optimizer.adamw_kernel() is None
    assert any("AdamW math: torch's AdamW (the one-pass kernel did not build: no C compiler" in r.getMessage()
               for r in caplog.records)
