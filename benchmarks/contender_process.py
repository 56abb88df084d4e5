"""Run one contender of a benchmark in a process of its own, so that its memory is its own (peak
RSS from the kernel's accounting of that process alone) and an out-of-memory kill ends that
contender's run, not the benchmark.

The parent writes the run's spec to a JSON file and starts ``python SCRIPT --spec FILE --out FILE``;
the child (:func:`child_main`) rewrites its result file after each step, so a run killed half way
still reports the steps it finished. The child is made the OOM killer's first choice
(``oom_score_adj`` 1000), and the parent can kill it where its RSS passes a limit."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Optional

from process_stats import oom_kills, rss_bytes

GiB = 1 << 30
#: The lines of the child's stderr a failure report keeps.
STDERR_TAIL_LINES = 25


def _make_oom_victim() -> None:
    """In the child before exec: the OOM killer takes it before anything else on the machine."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass  # not allowed here: the kernel's own choice stands


def run_contender(script: str, spec: dict[str, Any], workdir: str, label: str, *,
                  rss_limit: Optional[int] = None, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Run ``script`` on ``spec`` in a new process and return its result, with beside it:
    ``peak_rss`` (the process's largest resident set, bytes: getrusage of that child),
    ``seconds`` (its whole life), and ``failure`` (None, or what stopped it: an exit status, a
    signal, the OOM killer, ``rss_limit`` passed, with the tail of its stderr in
    ``stderr_tail``). Its stdout goes to ours; its stderr to ``workdir/LABEL.stderr``."""
    spec_path = os.path.join(workdir, f"{label}.spec.json")
    out_path = os.path.join(workdir, f"{label}.result.json")
    err_path = os.path.join(workdir, f"{label}.stderr")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    ooms = oom_kills()
    started = time.perf_counter()
    killed_for_rss = None
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, script, "--spec", spec_path, "--out", out_path], stderr=err,
                                env={**os.environ, **(env or {})}, preexec_fn=_make_oom_victim)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if rss_limit is not None and killed_for_rss is None:
                try:
                    rss = rss_bytes(str(proc.pid))
                except OSError:
                    rss = 0  # exiting
                if rss > rss_limit:
                    killed_for_rss = rss
                    os.kill(proc.pid, signal.SIGKILL)
            time.sleep(0.1)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    result: dict[str, Any] = {}
    if os.path.exists(out_path):
        with open(out_path) as f:
            result = json.load(f)
    out = {**result, "peak_rss": usage.ru_maxrss * 1024, "seconds": time.perf_counter() - started,
           "returncode": proc.returncode, "failure": None}
    if proc.returncode != 0:
        out["failure"] = _failure(proc.returncode, killed_for_rss, rss_limit, ooms, result)
        with open(err_path, errors="replace") as f:
            out["stderr_tail"] = f.read().splitlines()[-STDERR_TAIL_LINES:]
    return out


def _failure(code: int, killed_for_rss: Optional[int], rss_limit: Optional[int], ooms_before: Optional[int],
             result: dict[str, Any]) -> str:
    """One line: what stopped a contender that exited with ``code``."""
    if killed_for_rss is not None:
        return (f"killed by the benchmark: RSS reached {killed_for_rss / GiB:.2f} GiB, over the limit of "
                f"{rss_limit / GiB:.2f} GiB (--rss-limit-gib)")
    if code < 0:
        name = signal.Signals(-code).name
        ooms = oom_kills()
        if code == -signal.SIGKILL and ooms is not None and ooms_before is not None and ooms > ooms_before:
            return f"killed by the kernel's OOM killer ({name}; /proc/vmstat oom_kill +{ooms - ooms_before})"
        return f"killed by {name}"
    if "error" in result:
        return result["error"]
    return f"exited with status {code}"


def child_main(run: Callable[[dict[str, Any], Callable[[dict[str, Any]], None]], None],
               argv: Optional[list[str]] = None) -> int:
    """The child's side: read ``--spec``, call ``run(spec, report)``; each ``report(result)`` replaces
    the ``--out`` file (atomically). An exception is reported as ``result["error"]`` (one line) and
    ``result["traceback"]``, exit status 1."""
    p = argparse.ArgumentParser(description="one contender of a benchmark, run by contender_process.run_contender")
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    last: dict[str, Any] = {}

    def report(result: dict[str, Any]) -> None:
        last.clear()
        last.update(result)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.out)

    try:
        run(spec, report)
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which decides)
        report({**last, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
                "traceback": traceback.format_exc()[-8000:]})
        traceback.print_exc()
        return 1
    return 0
