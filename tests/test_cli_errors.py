"""The ``tiered`` command's answer to ordinary mistakes and interruptions: one line and exit status 2
for a usage error (naming the option and what works), 130 and one ``interrupted`` line for Ctrl-C, a
quiet 141 for a closed output pipe, never a traceback; and every option ``tiered train`` offers
works at the demo's defaults."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

import tiered
from engine.cli.demo_budgets import DEMO_HOST_MIB, size_budgets
from engine.cli.main import main as tiered_main
from engine.cli.train import _config, _model, build_parser
from small_filesystems import mounted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--layers", "1", "--embd", "32", "--heads", "2", "--vocab", "64", "--seq", "16", "--steps", "1")


def tiered_command(*argv: str, cwd: str, stdout=subprocess.PIPE, timeout: int = 120) -> subprocess.CompletedProcess:
    """``tiered ARGV...`` in a new process (``python -m engine.cli``, as the console script runs it)."""
    return subprocess.run([sys.executable, "-m", "engine.cli", *argv], cwd=cwd, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})


def one_line(stderr: str, command: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tiered {command}: "), stderr
    return lines[0]


@pytest.mark.parametrize("argv, says", [
    (("train", "--demo", *TINY, "--dir", "a-file"), "--dir {tmp}/a-file is not a directory"),
    (("train", "--demo", *TINY, "--host-mib", "1", "--dir", "d"), "pass --host-mib 17 or more"),
    (("bench", "--quick", "--dir", "a-file/sub"), "cannot be made: {tmp}/a-file is not a directory"),
    (("env", "--dir", "a-file"), "--dir {tmp}/a-file is not a directory"),
])
def test_a_usage_error_is_one_line_and_status_2(tmp_path, argv, says):
    (tmp_path / "a-file").write_text("mine")
    proc = tiered_command(*argv, cwd=str(tmp_path))
    assert proc.returncode == 2
    assert says.format(tmp=tmp_path) in one_line(proc.stderr, argv[0])
    assert sorted(os.listdir(tmp_path)) == ["a-file"] and (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.parametrize("argv, says", [
    (("--host-mib", "1"), "--host-mib 1 is below the host memory this model needs with these options"),
    (("--optimizer-tier", "host", "--host-mib", "48"), "pass --host-mib 49 or more"),
    (("--param-tier", "device", "--device-mib", "1"), "pass --device-mib 3 or more (42 holds every parameter)"),
    (("--dir", "{tmp}/a-file/sub"), "cannot be made: {tmp}/a-file is not a directory"),
])
def test_train_names_the_option_and_the_value_that_works(tmp_path, capsys, argv, says):
    """At the demo's model size; refused before anything is written."""
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(SystemExit) as exc:
        tiered_main(["train", "--demo", "--dir", str(tmp_path / "d"), *(a.format(tmp=tmp_path) for a in argv)])
    assert exc.value.code == 2
    assert says.format(tmp=tmp_path) in one_line(capsys.readouterr().err, "train")
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


@pytest.mark.parametrize("command", [("train", "--demo", *TINY), ("bench", "--quick")])
def test_a_read_only_directory_is_a_usage_error(tmp_path, capsys, command):
    """On a read-only filesystem (root may write into any directory of a writable one)."""
    for ro in mounted("tmpfs", tmp_path, mib=1, read_only=True):
        for where, says in ((ro, "is not writable by this user"), (os.path.join(ro, "sub"), "cannot be made")):
            with pytest.raises(SystemExit) as exc:  # train's usage errors exit; bench returns its status
                raise SystemExit(tiered_main([*command, "--dir", where]))
            assert exc.value.code == 2
            assert says in one_line(capsys.readouterr().err, command[0])


def test_a_closed_output_pipe_ends_the_command_quietly(tmp_path):
    """``tiered estimate --json | head``: the reader is gone before the output is written."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = tiered_command("estimate", "--demo", "--json", cwd=str(tmp_path), stdout=write)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == ""


def test_version_and_help(tmp_path):
    version = tiered_command("--version", cwd=str(tmp_path))
    assert version.returncode == 0 and version.stdout.strip() == f"tiered {tiered.__version__}"
    helped = tiered_command("--help", cwd=str(tmp_path))
    assert helped.returncode == 0 and "train" in helped.stdout and "--version" in helped.stdout


def test_every_option_of_train_and_estimate_says_what_it_does():
    from engine.cli.estimate import build_parser as estimate_parser

    for parser in (build_parser(), estimate_parser()):
        for action in parser._actions:
            assert action.help, f"{parser.prog} {action.option_strings} has no help"
            if parser.prog == "tiered estimate":
                assert "--beyond-memory" not in action.help, action.option_strings  # estimate has no such option
    actions = {a.option_strings[-1]: a for a in build_parser()._actions}
    for option, default in (("--layers", "6"), ("--embd", "384"), ("--heads", "6"), ("--vocab", "512"),
                            ("--device-mib", "0"), ("--seed", "0"), ("--weight-decay", "0.0")):
        action = actions[option]
        assert f"default {default}" in action.help % {"default": action.default}, option


def _demo_args(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["--demo", *argv])
    args.seq, args.device = 128, "cpu"
    return args


@pytest.mark.parametrize("options", [
    (), ("--compress-optimizer",), ("--optimizer-tier", "host"), ("--param-tier", "device"), ("--param-tier", "host"),
    ("--activation-tier", "host"), ("--activation-tier", "nvme"), ("--step-in-backward",),
    ("--compress-optimizer", "--optimizer-tier", "host", "--param-tier", "host"),
])
def test_every_option_fits_at_the_demos_default_budgets(tmp_path, options):
    """Budgets not given are sized from the memory plan for the options chosen: at least the demo's 48 MiB
    of host memory, more where the options need it, and the parameters' bytes for --param-tier device."""
    args = _demo_args(*options)
    model = _model(args)[0]
    config_for = lambda host, device: _config(args, str(tmp_path / "store"), host, device)  # noqa: E731
    host_mib, device_mib = size_budgets(model, config_for, host_mib=None, device_mib=None,
                                        default_host_mib=DEMO_HOST_MIB, param_tier=args.param_tier)
    assert host_mib >= DEMO_HOST_MIB
    import engine

    est = engine.estimate_memory(model, config_for(host_mib << 20, device_mib << 20))
    assert est.fits, est.problems
    params = sum(p.numel() * 4 for p in model.parameters())
    assert (device_mib << 20 >= params) == (args.param_tier == "device")
    if not options:
        assert host_mib == DEMO_HOST_MIB  # the default demo keeps its budget


def test_the_docs_quote_the_demos_ratio():
    """The README and the quickstart say how many times its budgets the demo's state is, as the demo prints it."""
    from engine.cli.train import state_ratio

    args = _demo_args()
    model = _model(args)[0]
    ratio = state_ratio(sum(p.numel() for p in model.parameters()) * 16, DEMO_HOST_MIB << 20)
    for doc in ("README.md", os.path.join("docs", "quickstart.md")):
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            assert f"about {ratio} its memory budget" in f.read(), doc
