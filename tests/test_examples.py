"""The README's examples and `tiered train --demo` run, on tiny sizes."""

from __future__ import annotations

import gc
import io
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ranks_env

from engine.cli.train import main as train_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str, *args: str, cwd: str) -> str:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _train_small_demo(tmp_path, *args: str) -> str:
    """``tiered train --demo`` on a 2-layer, 64-wide GPT with a 32 MiB host budget (staging, the working set and
    a host tier of a few MiB) and a 1 MiB window; its output (exit 0 asserted)."""
    out = io.StringIO()
    code = train_main(["--demo", "--dir", str(tmp_path / "demo"), "--layers", "2", "--embd", "64", "--heads", "2",
                       "--host-mib", "32", "--prefetch-mib", "1", *args], out=out)
    text = out.getvalue()
    assert code == 0, text
    return text


def test_train_demo_learns_and_reports_where_the_data_went(tmp_path):
    frozen = gc.get_freeze_count()
    text = _train_small_demo(tmp_path, "--steps", "8", "--vocab", "128", "--seq", "32", "--batch", "4", "--lr", "1e-2")
    losses = [float(line.split("loss")[1].split()[0]) for line in text.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert "where the data went" in text and "nvme" in text and "disk I/O" in text
    assert not (tmp_path / "demo").exists()  # removed unless --keep
    assert gc.get_freeze_count() == frozen  # the demo's gc.freeze() is undone when it returns


def test_train_beyond_memory_checks_the_disk_before_it_builds_anything(tmp_path, capsys):
    """``tiered train --beyond-memory`` sizes a model from RAM or --state-gib and refuses, naming the free and
    the needed bytes, when the disk under --dir cannot hold it; its options are checked first."""
    too_big = 2 * shutil.disk_usage(tmp_path).free / 2**30  # GiB of state: twice what the disk could hold
    with pytest.raises(SystemExit, match=r"has .* free, and this model needs about .* on disk during a step"):
        train_main(["--beyond-memory", "--state-gib", f"{too_big:.0f}", "--dir", str(tmp_path / "big")],
                   out=io.StringIO())
    assert not any((tmp_path / "big").glob("store*"))  # nothing written: the store was never opened
    with pytest.raises(SystemExit):
        train_main(["--demo", "--state-gib", "4", "--dir", str(tmp_path / "d")], out=io.StringIO())
    assert "--state-gib sizes --beyond-memory's model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--demo", "--beyond-memory", "--dir", str(tmp_path / "d")], out=io.StringIO())
    assert "not allowed with argument" in capsys.readouterr().err


def test_train_demo_with_activations_in_the_store(tmp_path):
    text = _train_small_demo(tmp_path, "--steps", "3", "--vocab", "512", "--seq", "128", "--batch", "16",
                             "--activation-tier", "nvme")
    assert "activations:" in text and "to the store during forward" in text  # the logits alone are 4 MiB


def test_train_demo_with_gradient_accumulation(tmp_path):
    text = _train_small_demo(tmp_path, "--steps", "6", "--vocab", "128", "--seq", "32", "--batch", "2",
                             "--grad-accum", "3", "--lr", "1e-2")
    steps = [line for line in text.splitlines() if line.startswith("step")]
    assert steps[-1].split()[1] == "6/6"  # six optimizer steps of three micro-batches each
    losses = [float(line.split("loss")[1].split()[0]) for line in steps]
    assert losses[-1] < losses[0]


def test_train_demo_with_updates_inside_backward(tmp_path, capsys):
    text = _train_small_demo(tmp_path, "--steps", "6", "--vocab", "128", "--seq", "32", "--batch", "2",
                             "--grad-accum", "2", "--lr", "1e-2", "--step-in-backward")
    losses = [float(line.split("loss")[1].split()[0]) for line in text.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0]
    with pytest.raises(SystemExit):
        train_main(["--demo", "--dir", str(tmp_path / "d"), "--step-in-backward", "--optimizer-tier", "host"])
    assert "--step-in-backward keeps each parameter's old value on nvme" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_train_demo_computes_on_the_gpu(tmp_path):
    text = _train_small_demo(tmp_path, "--steps", "8", "--vocab", "128", "--seq", "32", "--batch", "4",
                             "--device-mib", "1", "--lr", "1e-2", "--device", "cuda")
    assert "computing on cuda" in text
    losses = [float(line.split("loss")[1].split()[0]) for line in text.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0]


@pytest.mark.parametrize("device, says", [
    ("banana", "is not a device"),
    ("meta", "runs on 'cpu' or 'cuda"),
    ("cuda:99", "CUDA device"),  # no CUDA at all, or not that many devices
])
def test_train_demo_refuses_a_device_it_cannot_use(tmp_path, capsys, device, says):
    with pytest.raises(SystemExit) as exc:
        train_main(["--demo", "--dir", str(tmp_path / "demo"), "--device", device])
    assert exc.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


def test_train_demo_refuses_a_foreign_directory(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exc:
        train_main(["--demo", "--dir", str(tmp_path)])
    assert exc.value.code == 2 and "not empty" in capsys.readouterr().err
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def _default_sigint() -> None:
    """In the child before it runs: SIGINT's default action, as a terminal gives it. A suite started in
    the background of a non-interactive shell ignores SIGINT, and a child inherits that (Python then
    installs no KeyboardInterrupt handler: the Ctrl-C under test would never arrive)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


TINY_DEMO = ("--layers", "1", "--embd", "32", "--heads", "2", "--vocab", "64", "--seq", "16", "--batch", "2")


def test_the_demo_removes_what_it_made_and_only_that(tmp_path):
    """A directory the user made stays (emptied of the demo's store); directories the demo made, parents
    included, go; a kept directory is cleared by the next run; each removal is said."""
    mine = tmp_path / "mine"
    mine.mkdir()
    out = io.StringIO()
    assert train_main(["--demo", *TINY_DEMO, "--steps", "1", "--dir", str(mine)], out=out) == 0
    assert mine.is_dir() and not os.listdir(mine)
    assert f"removed the store from {mine}, which was there before the run and stays" in out.getvalue()
    deep = tmp_path / "no" / "such" / "deep"
    out = io.StringIO()
    assert train_main(["--demo", *TINY_DEMO, "--steps", "1", "--dir", str(deep), "--keep"], out=out) == 0
    assert (deep / "store").is_dir() and f"store kept in {deep}" in out.getvalue()
    out = io.StringIO()
    assert train_main(["--demo", *TINY_DEMO, "--steps", "1", "--dir", str(deep)], out=out) == 0
    assert f"removed the store an earlier run left in {deep}" in out.getvalue()
    assert f"removed {tmp_path / 'no'} " in out.getvalue()  # the kept run made no/such/deep: all of it goes
    assert sorted(os.listdir(tmp_path)) == ["mine"]


def test_two_demos_on_one_directory(tmp_path, capsys):
    """The second is refused while the first runs, its store untouched; Ctrl-C ends the first with one line
    and status 130, and it still removes what it made."""
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "engine.cli", "train", "--demo", *TINY_DEMO, "--steps", "1000000",
                              "--dir", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"},
                             preexec_fn=_default_sigint)
    try:
        printed = []
        while not printed or not printed[-1].startswith("step"):  # the first is training
            printed.append(first.stdout.readline())
            assert printed[-1], first.communicate()
        with pytest.raises(SystemExit) as exc:
            train_main(["--demo", *TINY_DEMO, "--steps", "1", "--dir", str(run)], out=io.StringIO())
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"tiered train: --dir {run} is in use by another `tiered train` (pid {first.pid}): wait for it "
                       "to finish, or pass another --dir")
        assert (run / "store" / "manifest.sqlite").exists()
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 130 and err.strip().splitlines() == ["tiered train: interrupted"], err
    assert f"removed {run} " in "".join(printed) + out and not run.exists()


def test_store_example(tmp_path):
    out = run_example("store_basics.py", str(tmp_path / "store"), cwd=str(tmp_path))
    assert "after reopen: ['adam.exp_avg', 'layer0.weight'] True" in out
    assert "usage:" in run_example("store_basics.py", "--help", cwd=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["store"]  # --help made no store


def test_deepspeed_example_maps_and_refuses_a_typo_then_resumes_at_two_ranks(tmp_path):
    out = run_example("deepspeed_config.py", cwd=str(tmp_path))
    assert "param_tier='nvme'" in out and "did you mean 'stage3_prefetch_bucket_size'" in out
    assert "DeepSpeed's loop, epoch 0: 64 steps" in out and "(WarmupLR)" in out  # 256 examples, micro-batches of 4
    assert (tmp_path / "ds-nvme" / "tiered" / "manifest.sqlite").is_file()  # the store under the config's nvme_path
    # The docstring's second command: `deepspeed --num_gpus 2` as `tiered launch`, resuming the one-rank checkpoint.
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "launch", "--num_gpus", "2",
                           os.path.join(ROOT, "examples", "deepspeed_config.py")], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=240,
                          env=ranks_env(2, {**os.environ, "TMPDIR": str(tmp_path)}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("DeepSpeed's loop, epoch 1: 96 steps") == 2  # each rank 32 steps of its half
    assert (tmp_path / "ds-nvme" / "tiered" / "rank1" / "manifest.sqlite").is_file()  # one store per rank


def test_hugging_face_example_trains_exports_and_reloads(tmp_path):
    out = run_example("hf_gpt2.py", "--dir", str(tmp_path / "run"), "--steps", "2", "--export",
                      str(tmp_path / "tuned"), cwd=str(tmp_path))
    assert "step 1: loss" in out
    exported = out.rsplit("from_pretrained computes loss ", 1)[1]
    plain, engine_loss = exported.split(" (engine: ")
    assert plain == engine_loss.split(")")[0]  # the reloaded plain model computes the engine's loss
    assert sorted(os.listdir(tmp_path / "tuned")) == ["config.json", "model.safetensors"]


def test_lora_example_trains_saves_the_adapter_and_peft_reloads_it(tmp_path):
    out = run_example("lora_finetune.py", "--dir", str(tmp_path / "run"), "--steps", "2", "--out",
                      str(tmp_path / "adapter"), cwd=str(tmp_path))
    assert "step 2: loss" in out and "training 32,768 of" in out  # the adapters only
    reloaded = out.rsplit("PeftModel.from_pretrained computes loss ", 1)[1]
    plain, engine_loss = reloaded.split(" (engine: ")
    assert plain == engine_loss.split(")")[0]  # the saved adapter over the plain base is the tuned model
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))
    assert "model.safetensors" not in os.listdir(tmp_path / "adapter")  # not the whole base


def test_torchrun_example_trains_on_two_ranks(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.join(ROOT, "examples", "torchrun_two_ranks.py"), "--dir", str(tmp_path / "run"), "--steps", "2"],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=240,
        env=ranks_env(2, {**os.environ, "TMPDIR": str(tmp_path)}),  # torchrun's own temporary directories go here
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 1: loss" in proc.stdout
    assert sorted(os.listdir(tmp_path / "run")) == ["rank0", "rank1"]  # one store per rank
