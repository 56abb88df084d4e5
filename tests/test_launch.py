"""``tiered launch``: DeepSpeed's launcher options mapped onto torchrun, and one real launch.

The oracle for the options is DeepSpeed's launcher (``deepspeed/launcher/runner.py`` and
``launch.py``): the same hostfile and ``--include``/``--exclude`` forms, ``--local_rank=<n>`` before
the script's arguments. Several GPUs are simulated by passing ``cuda_devices``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ranks_env
from torch.distributed.elastic.utils.api import macros

from engine.cli.launch import command
from engine.integrations.deepspeed.launch_plan import (
    LaunchPlan,
    LaunchRequest,
    parse_hostfile,
    plan_launch,
    torchrun_arguments,
)

HOSTS = ["# two nodes", "worker-0 slots=4", "", "worker-1 slots=2"]


def plan(cuda_devices: int = 0, visible_env=None, **request) -> LaunchPlan:
    return plan_launch(LaunchRequest(**request), cuda_devices=cuda_devices, visible_env=visible_env)


def test_one_node_without_gpus_runs_num_gpus_cpu_processes_on_a_free_port():
    assert plan() == LaunchPlan(nnodes=1, node_rank=0, nproc_per_node=1, master_addr=None, master_port=None,
                                visible_devices=None)
    assert plan(num_gpus=3).nproc_per_node == 3
    fixed = plan(num_gpus=2, master_port=29600)
    assert (fixed.master_addr, fixed.master_port) == ("127.0.0.1", 29600)
    with pytest.raises(ValueError, match="torch sees none"):
        plan(include="localhost:0")


def test_gpus_are_chosen_as_deepspeed_chooses_them():
    assert plan(4).visible_devices == "0,1,2,3" and plan(4).nproc_per_node == 4
    assert plan(4, include="localhost:1,3").visible_devices == "1,3"
    assert plan(4, exclude="localhost:0").visible_devices == "1,2,3"
    assert plan(4, num_gpus=2).visible_devices == "0,1"
    assert plan(2, visible_env="5,7").visible_devices == "5,7"        # the environment's devices, by their ids
    assert plan(2, visible_env="5,7", include="localhost:7").visible_devices == "7"
    with pytest.raises(ValueError, match="more GPUs than the 4"):
        plan(4, num_gpus=5)
    with pytest.raises(ValueError, match="cannot be combined"):
        plan(4, num_gpus=2, include="localhost:0")
    with pytest.raises(ValueError, match=r"slots \['9'\]"):
        plan(4, include="localhost:9")
    with pytest.raises(ValueError, match="no GPU to run on"):
        plan(2, exclude="localhost")


def test_hostfile_nodes_run_one_command_each_with_no_ssh():
    assert parse_hostfile(HOSTS) == {"worker-0": 4, "worker-1": 2}
    with pytest.raises(ValueError, match="does not ssh.*--no_ssh --node_rank"):
        plan(2, hostfile_lines=HOSTS)
    second = plan(2, hostfile_lines=HOSTS, no_ssh=True, node_rank=1)
    assert second == LaunchPlan(nnodes=2, node_rank=1, nproc_per_node=2, master_addr="worker-0", master_port=29500,
                                visible_devices="0,1")
    assert plan(4, hostfile_lines=HOSTS, no_ssh=True, node_rank=0, num_gpus=1).nproc_per_node == 1
    assert plan(4, hostfile_lines=HOSTS, num_nodes=1).nnodes == 1                  # the first host alone: local
    assert plan(4, hostfile_lines=HOSTS, include="worker-1:1").visible_devices == "1"
    assert plan(0, hostfile_lines=HOSTS, include="worker-1").nproc_per_node == 2   # CPU slots are processes
    with pytest.raises(ValueError, match=r"--node_rank in \[0, 2\)"):
        plan(2, hostfile_lines=HOSTS, no_ssh=True)
    with pytest.raises(ValueError, match="not '<host> slots=<n>'"):
        parse_hostfile(["worker-0 gpus=4"])
    with pytest.raises(ValueError, match="twice"):
        parse_hostfile(["a slots=1", "a slots=2"])
    with pytest.raises(ValueError, match="not one of"):
        plan(2, hostfile_lines=HOSTS, include="worker-9")


def test_nodes_without_a_hostfile_need_an_address_and_a_rank():
    with pytest.raises(ValueError, match="needs a --hostfile"):
        plan(num_nodes=2)
    node = plan(num_nodes=2, no_ssh=True, node_rank=1, master_addr="10.0.0.1", num_gpus=2)
    assert (node.nnodes, node.node_rank, node.nproc_per_node, node.master_addr, node.master_port) == (
        2, 1, 2, "10.0.0.1", 29500)


def test_each_process_gets_its_local_rank_and_the_scripts_arguments_as_given():
    args = torchrun_arguments(plan(num_gpus=2), "train.py", ["--tag", "a$b ${local_rank} $$", "--x=$HOME"])
    assert args[:3] == ["--nproc-per-node", "2", "--standalone"]
    # torch's own substitution, as its agent applies it to each worker's arguments
    assert macros.substitute(args[3:], "1") == ["train.py", "--local_rank=1", "--tag", "a$b ${local_rank} $$",
                                                "--x=$HOME"]
    bare = torchrun_arguments(plan(), "pkg.train", [], module=True, local_rank_arg=False)
    assert bare[-2:] == ["--module", "pkg.train"]
    with pytest.raises(ValueError, match="together"):
        torchrun_arguments(plan(), "s", [], module=True, no_python=True)


def test_command_line_options_before_the_script_are_the_launchers_after_it_the_scripts():
    launch = command(["--num_gpus", "2", "--master_port", "29700", "train.py", "--num_gpus", "5"], cuda_devices=0,
                     environ={"PATH": "/bin"})
    assert launch.torchrun[-3:] == ["--local_rank=${local_rank}", "--num_gpus", "5"]
    assert launch.plan.nproc_per_node == 2 and "CUDA_VISIBLE_DEVICES" not in launch.env
    assert launch.shown().startswith("torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29700 train.py")
    logged = command(["--enable_each_rank_log", "logs", "train.py"], cuda_devices=0, environ={})
    assert logged.torchrun[:4] == ["--log-dir", "logs", "--redirects", "3"]
    gpu = command(["-i", "localhost:2", "train.py"], cuda_devices=4, environ={})
    assert gpu.env["CUDA_VISIBLE_DEVICES"] == "2" and gpu.shown().startswith("CUDA_VISIBLE_DEVICES=2 torchrun")


@pytest.mark.parametrize("option, reason", [(["--autotuning", "run"], "autotuner"),
                                            (["--bind_cores_to_rank"], "numactl"),
                                            (["--launcher", "slurm"], "srun")])
def test_deepspeed_options_without_a_counterpart_are_refused_with_what_to_do(option, reason, capsys):
    with pytest.raises(SystemExit) as exit_:
        command([*option, "train.py"], cuda_devices=0, environ={})
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert option[0] in err and reason in err


def test_a_failed_rank_s_exit_status_is_the_launch_s():
    from engine.cli.launch import rank_exit_status

    assert [rank_exit_status(code) for code in (3, 1, -9, -15, 0)] == [3, 1, 137, 143, 1]


def test_refused_plans_exit_with_the_reason(capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("\n".join(HOSTS))
    with pytest.raises(SystemExit):
        command(["--hostfile", str(hostfile), "train.py"], cuda_devices=0, environ={})
    assert "--no_ssh" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        command(["--hostfile", str(tmp_path / "missing"), "train.py"], cuda_devices=0, environ={})
    assert "missing" in capsys.readouterr().err


RECORDER = textwrap.dedent("""
    import argparse, json, os, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, required=True)   # as DeepSpeed scripts declare it
    parser.add_argument("--tag")
    args = parser.parse_args()
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    with open(f"rank{env['RANK']}.json", "w") as f:
        json.dump({"local_rank": args.local_rank, "tag": args.tag, "env": env}, f)
    sys.exit(3 if env["RANK"] == "1" else 0)
""")


def test_a_launch_starts_the_ranks_with_their_local_rank_and_fails_when_one_fails(tmp_path):
    (tmp_path / "recorder.py").write_text(RECORDER)
    done = subprocess.run([sys.executable, "-m", "engine.cli", "launch", "--num_gpus", "2", "recorder.py",
                           "--tag", "$x ${local_rank}"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=ranks_env(2, {**os.environ, "TMPDIR": str(tmp_path)}))
    assert done.returncode == 3, done.stdout + done.stderr      # rank 1's own exit status, as DeepSpeed's launcher
    assert "tiered launch: torchrun --nproc-per-node 2 --standalone recorder.py" in done.stderr
    assert "exitcode  : 3" in done.stderr
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            record = json.load(f)
        assert record == {"local_rank": rank, "tag": "$x ${local_rank}",
                          "env": {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}}
