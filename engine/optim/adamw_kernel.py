"""torch's single-tensor AdamW arithmetic on float32 in one pass over memory: a small C kernel,
compiled on first use and compared with torch bit for bit before any step uses it.

[Note: One-pass AdamW]
torch.optim.AdamW's single-tensor path (torch's CPU default, and what the engine's parity is
measured against) makes eight passes over a shard: ``mul_``, ``lerp_``, ``mul_``, ``addcmul_``,
``sqrt``, a division, ``add_`` and ``addcdiv_``, each a sweep of memory of its own. Inside backward
the updates share the two cores and the memory bus with backward's matmuls, and that math was the
updates' critical path at 2.38 B parameters: with torch's fused kernel in its place (not bit-equal
to the default path, so not an option) the step took a fifth less. ``adamw_kernel.c`` makes one
pass: per element the same IEEE operations in the same order, with the one fused multiply-add each
of torch's ``lerp`` and ``addcmul`` kernels uses, and the square root from the routine torch's own
``sqrt`` calls (MKL's vector square root: not the correctly rounded one, so it cannot be
recomputed), 256 elements at a time.

Equality is checked, not assumed: :func:`load_adamw_kernel` compiles the kernel (``cc``; the library
is kept under ``$XDG_CACHE_HOME/tiered/``), then runs it beside torch's function on probe data --
both branches of ``lerp``, weight decay on and off, signed zeros, infinities, NaNs, subnormals,
lengths of every remainder of the vector width and of a block -- and compares every bit of the
parameters, moments and step counts. Without a compiler, without torch's MKL routine, or on any
difference, the engine keeps torch's function, and ``AdamW.math_path`` (logged by ``engine.wrap``)
says which runs and why.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch.optim.adamw import adamw as _torch_adamw

from engine.optim.types import AdamHyper

_SOURCE = Path(__file__).with_name("adamw_kernel.c")
_FUNCTION = "tiered_adamw_f32"
#: -ffp-contract=off: no multiply and add fused but the ones written; the rest only lets loops vectorize.
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
          "-shared", "-fPIC")
#: torch's MKL vector square root (``vmsSqrt``, Fortran symbol), called in high-accuracy mode with
#: denormals kept and errors ignored (VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE); the probe
#: holds its results against ``torch.sqrt``'s.
_ROOT_SYMBOL = "VMSSQRT_"
_ROOT_MODE = 0x2 | 0x140000 | 0x100
_BLOCK = 256  # adamw_kernel.c's BLOCK

_c_float, _c_int, _c_ptr, _c_i64 = ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_c_ptr] * 4 + [_c_i64, _c_int, _c_float, _c_float, _c_int, _c_float, _c_float, _c_float,
                            _c_float, _c_float, _c_ptr, _c_i64]


class AdamWKernel:
    """One AdamW update of float32 tensors in one pass, bit for bit torch's single-tensor path
    ([Note: One-pass AdamW]). Made by :func:`load_adamw_kernel`; safe to call from any thread (it
    releases the GIL while it runs)."""

    def __init__(self, function: ctypes._CFuncPtr, root_routine: int) -> None:  # type: ignore[name-defined]
        self._function = function
        self._root = root_routine

    @staticmethod
    def applies(hyper: AdamHyper, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether torch runs its single-tensor path for ``hyper`` (neither ``foreach`` nor ``fused``,
        a number for ``lr``) and ``tensors`` are what the kernel takes: float32, contiguous, on the CPU."""
        if hyper.foreach or hyper.fused or isinstance(hyper.lr, torch.Tensor):
            return False
        return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)

    def step(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
             step: torch.Tensor, hyper: AdamHyper) -> None:
        """One AdamW update of ``param``, ``exp_avg`` and ``exp_avg_sq`` in place, as
        ``torch.optim.adamw.adamw([param], [grad], [exp_avg], [exp_avg_sq], [], [step], foreach=False, ...)``
        computes it: ``step`` (the count tensor) goes up by one first, and its new value gives the
        bias corrections.

        Raises:
            ValueError: the tensors differ in size, or :meth:`applies` is False for them.
        """
        tensors = (param, grad, exp_avg, exp_avg_sq)
        n = param.numel()
        if any(t.numel() != n for t in tensors):
            raise ValueError(f"AdamWKernel.step: sizes {[t.numel() for t in tensors]} differ")
        if not self.applies(hyper, tensors):
            raise ValueError(f"AdamWKernel.step takes contiguous float32 CPU tensors and the single-tensor path, got "
                             f"{[(t.dtype, t.device.type, t.is_contiguous()) for t in tensors]} with {hyper}")
        step += 1
        count = step.item()
        lr, beta1, beta2 = hyper.lr, hyper.beta1, hyper.beta2
        weight = torch.tensor(1 - beta1, dtype=torch.float32)  # lerp's weight, as its kernel rounds it
        small = bool(weight.abs() < 0.5)
        coeff = float(weight if small else weight - 1)
        self._function(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n,
                       int(hyper.weight_decay != 0), 1 - lr * hyper.weight_decay, coeff, int(small), beta2,
                       1 - beta2, (1 - beta2 ** count) ** 0.5, hyper.eps, -(lr / (1 - beta1 ** count)),
                       self._root, _ROOT_MODE)


def load_adamw_kernel(cache_dir: Optional[str] = None) -> tuple[Optional[AdamWKernel], str]:
    """Build (or reuse) the one-pass kernel and compare it with torch's AdamW ([Note: One-pass AdamW]).

    Args:
        cache_dir: where the compiled library is kept; default ``$XDG_CACHE_HOME/tiered``
            (``~/.cache/tiered``). Where it cannot be written, the library is built in a temporary
            directory for this process.

    Returns:
        ``(kernel, how)``: the kernel and a line saying it runs; or None and why torch's function runs
        instead. Never raises for a missing compiler, a failed build or a difference.
    """
    root = _torch_root_routine()
    if root is None:
        return None, f"torch's AdamW (this torch build exports no {_ROOT_SYMBOL}, the square root its sqrt uses)"
    try:
        kernel = AdamWKernel(_library_function(cache_dir or default_cache_dir()), root)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"torch's AdamW (the one-pass kernel did not build: {e})"
    difference = probe_difference(kernel)
    if difference is not None:
        return None, f"torch's AdamW (the one-pass kernel differs from it: {difference})"
    return kernel, "one pass, bit for bit torch's AdamW"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/tiered`` (``~/.cache/tiered`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tiered")


def probe_difference(kernel: AdamWKernel) -> Optional[str]:
    """Where ``kernel`` and torch's single-tensor AdamW disagree on the probe data, or None where every
    bit of every result agrees ([Note: One-pass AdamW])."""
    gen = torch.Generator().manual_seed(0)
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([0.0, -0.0, inf, -inf, nan, 1e-45, -1e-40, 1e-38, 3e38, -3e38, 1.0, -1.0, 1e-20])
    lengths = (*range(1, 40), _BLOCK - 1, _BLOCK, _BLOCK + 1, 2 * _BLOCK + 17, 4099)
    for beta1, weight_decay in ((0.9, 0.01), (0.3, 0.0), (0.5, 0.1)):  # lerp's weight small and not; decay off
        hyper = AdamHyper(lr=1e-3, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=weight_decay)
        for n in lengths:
            values = [torch.randn(n, generator=gen) * scale for scale in (1.0, 1e-3, 1e-3, 1e-6)]
            values[3] = values[3].abs()
            for t in values:  # special values at random places, a different draw per tensor
                at = torch.randint(0, n, (min(n, len(special)),), generator=gen)
                t[at] = special[: len(at)]
            ours = [t.clone() for t in values] + [torch.tensor(3.0)]
            theirs = [t.clone() for t in values] + [torch.tensor(3.0)]
            kernel.step(*ours[:4], ours[4], hyper)
            _torch_adamw([theirs[0]], [theirs[1]], [theirs[2]], [theirs[3]], [], [theirs[4]], foreach=False,
                         fused=None, amsgrad=False, beta1=beta1, beta2=hyper.beta2, lr=hyper.lr,
                         weight_decay=weight_decay, eps=hyper.eps, maximize=False)
            for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq", "step"), ours, theirs):
                if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                    return f"{name} of {n} elements with beta1={beta1}, weight_decay={weight_decay}"
    return None


def _torch_root_routine() -> Optional[int]:
    """The address of the MKL square root in torch's CPU library, or None."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.cast(getattr(ctypes.CDLL(path), _ROOT_SYMBOL), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _library_function(cache_dir: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """The kernel's C function, from the cached library or a new build of it."""
    compiler = shlex.split(os.environ.get("CC") or "cc")
    if not compiler or shutil.which(compiler[0]) is None:
        raise FileNotFoundError(f"no C compiler {compiler[0] if compiler else '(CC is empty)'!r} on PATH")
    name = f"adamw-{_build_key(compiler)}.so"
    try:
        os.makedirs(cache_dir, mode=0o700, exist_ok=True)
        path = os.path.join(cache_dir, name)
        if not os.path.lexists(path):
            _build(compiler, path)
        return _load(path)
    except PermissionError:  # a cache that cannot be written or trusted: a build of this process's own
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, name)
            _build(compiler, path)
            return _load(path)  # the mapping outlives the file


def _build_key(compiler: list[str]) -> str:
    """What the library depends on: the source, the flags, the compiler's version and this CPU's
    features (``-march=native`` builds for them; a cache shared with another machine must not match)."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, timeout=60, check=True).stdout
    try:
        with open("/proc/cpuinfo", "rb") as f:
            features = next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        features = b""
    digest = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), version, features):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:20]


def _build(compiler: list[str], path: str) -> None:
    """Compile the kernel to ``path`` (through a temporary name: a reader never sees half a library)."""
    partial = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
    try:
        done = subprocess.run([*compiler, *_FLAGS, "-o", partial, str(_SOURCE)], capture_output=True,
                              check=False, timeout=300)
        if done.returncode != 0:
            message = done.stderr.decode(errors="replace").strip().splitlines()
            raise OSError(f"{compiler[0]} exited with {done.returncode}: {message[-1] if message else ''}")
        os.chmod(partial, 0o700)  # whatever the umask: _load refuses a library others may write
        os.replace(partial, path)
    finally:
        if os.path.lexists(partial):
            os.unlink(partial)


def _load(path: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """Load the library at ``path``: a regular file of this user's that no one else may write, opened
    without following a symlink (and loaded through that descriptor, so what was checked is what loads)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(f"{path} is a symbolic link") from e
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise PermissionError(f"{path} is not a regular file of this user's that only it may write")
        function = getattr(ctypes.CDLL(f"/proc/self/fd/{fd}"), _FUNCTION)
    finally:
        os.close(fd)
    function.argtypes = _ARGTYPES
    function.restype = None
    return function
