"""Released parameters touched outside the wrapped forward: each access works or raises
``ReleasedParameterError`` (naming ``eng.gathered``), never reads a 0-byte storage. Each scenario
runs in a subprocess (tests/released_probe.py), so a regression shows as a crash of that process
rather than of the test run; the probe also checks results against plain torch."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

PROBE = pathlib.Path(__file__).with_name("released_probe.py")
ROOT = PROBE.parent.parent

#: Between steps (and between a forward and its backward) a released parameter answers metadata and
#: refuses value reads with the engine's error.
RELEASED = {
    "metadata": "ok", "repr": "ok", "print_model": "ok", "hash": "ok", "to_same_device": "ok", "state_dict": "ok",
    "add": "released", "clone": "released", "detach_numpy": "released", "item": "released", "matmul": "released",
    "data_copy": "released", "inplace": "released", "torch_save": "released", "half": "released",
    "to_meta": "released",
}
#: After close the parameters are meta tensors: values raise torch's meta errors, nothing crashes.
CLOSED = {
    "metadata": "ok", "repr": "ok", "print_model": "ok", "hash": "ok", "add": "meta", "clone": "meta",
    "detach_numpy": "error:TypeError", "item": "error:RuntimeError", "to_same_device": "error:NotImplementedError",
}


SCENARIOS = [
    "between_steps", "engine_adamw", "forward_only", "between_forward_and_backward", "after_close", "after_unwrap",
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict[str, str]]:
    """scenario -> case -> outcome, from one probe process running every scenario."""
    tmp_path = tmp_path_factory.mktemp("released")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(tmp_path), *SCENARIOS],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT),
    )
    assert proc.returncode == 0, f"the probe exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    shutil.rmtree(tmp_path)  # seven stores' swap files; the outcomes are all in stdout
    out: dict[str, dict[str, str]] = {}
    for line in proc.stdout.splitlines():
        d = json.loads(line)
        out.setdefault(d["scenario"], {})[d["case"]] = d["outcome"]
    for name in SCENARIOS:
        assert out[name].pop("done") == "ok", name  # the scenario ran to its end (and matched plain torch)
    return out


@pytest.mark.parametrize("scenario", ["between_steps", "engine_adamw", "forward_only", "between_forward_and_backward"])
def test_released_parameters_answer_metadata_and_refuse_values(scenario, outcomes):
    got = dict(outcomes[scenario])
    if scenario == "between_steps":
        assert got.pop("clip_grad_norm") == "ok"
    assert got == RELEASED


def test_after_close_parameters_are_meta_and_the_same_model_wraps_again(outcomes):
    got = outcomes["after_close"]
    assert {k: got[k] for k in CLOSED} == CLOSED


def test_after_unwrap_parameters_are_plain_tensors_again(outcomes):
    got = outcomes["after_unwrap"]
    assert all(v == "ok" for k, v in got.items() if k not in ("inplace", "state_dict")), got
    assert got["inplace"] == "error:RuntimeError"  # torch's leaf-requires-grad error: a plain Parameter
