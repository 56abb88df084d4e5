"""``tiered launch``: DeepSpeed's ``deepspeed`` launcher command, started through torchrun.

``deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json`` becomes
``tiered launch --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json``: DeepSpeed's options,
and every process gets ``--local_rank=<n>`` before the script's own arguments, as DeepSpeed's
launcher passes it (DeepSpeed scripts declare it with argparse; torchrun alone does not pass it).
The command prints the torchrun command line it maps to and runs it (torchrun's own ``main``, in
this process), so signals and per-rank failures are handled as torchrun handles them; the exit
status is the first failed rank's, as from DeepSpeed's launcher (torchrun alone exits 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from typing import Optional, Sequence

from engine.integrations.deepspeed.launch_plan import (
    LaunchPlan,
    LaunchRequest,
    as_given,
    plan_launch,
    torchrun_arguments,
)

#: DeepSpeed's default hostfile, read when it exists and no --hostfile is given (as DeepSpeed does).
DEFAULT_HOSTFILE = "/job/hostfile"

#: DeepSpeed launcher options with no counterpart here, and what to do instead.
UNSUPPORTED = {
    "--launcher": (1, "the processes are started by torchrun: there is no pdsh/MPI/Slurm backend to choose; under "
                      "Slurm, srun `tiered launch --no_ssh --node_rank=$SLURM_NODEID ...` once per node"),
    "--launcher_args": (1, "there is no launcher backend to pass arguments to (torchrun starts the processes)"),
    "--force_multi": (0, "remote nodes are not reached over ssh: run the command on each node with --no_ssh"),
    "--no_ssh_check": (0, "nothing is checked over ssh: run the command on each node with --no_ssh"),
    "--ssh_port": (1, "nodes are not reached over ssh: run the command on each node with --no_ssh"),
    "--venv_script": (1, "nodes are not reached over ssh: activate the environment on each node before the command"),
    "--autotuning": (1, "DeepSpeed's autotuner is not here; `tiered bench --sweep` tunes the store's I/O settings"),
    "--elastic_training": (0, "elastic membership is not supported; the engine's checkpoints load at any world size"),
    "--min_elastic_nodes": (1, "elastic membership is not supported"),
    "--max_elastic_nodes": (1, "elastic membership is not supported"),
    "--bind_cores_to_rank": (0, "core binding is not done here: run `numactl` inside the script's command, or set "
                                "OMP_NUM_THREADS (torchrun sets it to 1 when it starts several processes)"),
    "--bind_core_list": (1, "core binding is not done here (see --bind_cores_to_rank)"),
    "--save_pid": (0, "no pid file is written; torchrun runs in the command's own process"),
}


class _Unsupported(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001 - argparse's signature
        parser.error(f"{option_string} is a DeepSpeed launcher option tiered launch does not have: "
                     f"{UNSUPPORTED[option_string][1]}")


def build_parser() -> argparse.ArgumentParser:
    """DeepSpeed's ``deepspeed`` options that choose processes, then the script and its arguments."""
    p = argparse.ArgumentParser(
        prog="tiered launch", allow_abbrev=False,
        description="Start a training script on this node's GPUs (or N CPU processes) with DeepSpeed's launcher "
        "options, through torchrun; each process gets --local_rank=<n> as DeepSpeed's launcher passes it. The "
        "exit status is the first failed rank's own, as DeepSpeed's launcher returns it.",
    )
    p.add_argument("-H", "--hostfile", default=None, help=f"'<host> slots=<n>' lines (default: {DEFAULT_HOSTFILE} "
                   "when it exists); with several hosts, run the command on each node with --no_ssh --node_rank")
    p.add_argument("-i", "--include", default="", help="GPUs to use: host[:slot,slot][@host...], e.g. localhost:1,3")
    p.add_argument("-e", "--exclude", default="", help="GPUs to leave out, in --include's form")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the hostfile's first N hosts")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1,
                   help="processes per node: the first N GPUs (default: all), or N CPU processes without GPUs "
                   "(default 1)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index, with --no_ssh")
    p.add_argument("--no_ssh", action="store_true", help="this node's processes only; run the command on every node")
    p.add_argument("--master_addr", default="", help="node 0's address (default: the hostfile's first host; one "
                   "node: 127.0.0.1)")
    p.add_argument("--master_port", type=int, default=None, help="rendezvous port (default: 29500 across nodes; "
                   "on one node a free port)")
    p.add_argument("--module", action="store_true", help="the script is a module name (python -m)")
    p.add_argument("--no_python", action="store_true", help="run the script as an executable, not with python")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank to the script")
    p.add_argument("--enable_each_rank_log", default=None, metavar="DIR",
                   help="each rank's stdout and stderr to files under DIR (torchrun's layout: "
                   "DIR/<run id>/attempt_0/<local rank>/stdout.log), not the console")
    p.add_argument("--log_level", default="info", choices=("debug", "info", "warning", "error", "critical"),
                   help="error or critical: do not print the torchrun command")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the torchrun command")
    for option, (nargs, _) in UNSUPPORTED.items():
        p.add_argument(option, nargs=nargs, action=_Unsupported, help=argparse.SUPPRESS)
    p.add_argument("user_script", help="the training script (or module, or executable)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


@dataclasses.dataclass(frozen=True)
class Launch:
    """What ``tiered launch`` runs: torchrun's arguments and the environment its processes get."""

    torchrun: list[str]
    env: dict[str, str]
    plan: LaunchPlan
    quiet: bool

    def shown(self) -> str:
        """The command as a shell line (the script's ``$`` signs as given, not as escaped for torchrun)."""
        prefix = f"CUDA_VISIBLE_DEVICES={self.plan.visible_devices} " if self.plan.visible_devices is not None else ""
        return prefix + shlex.join(["torchrun", *(as_given(a) for a in self.torchrun)])


def command(argv: Sequence[str], *, cuda_devices: Optional[int] = None,
            environ: Optional[dict[str, str]] = None) -> Launch:
    """What ``tiered launch argv`` runs.

    ``cuda_devices``/``environ`` default to this machine's (torch's GPU count, ``os.environ``).
    Exits with status 2 and a message for options that cannot be launched.
    """
    parser = build_parser()
    args = parser.parse_args(list(argv))
    env = dict(os.environ if environ is None else environ)
    if cuda_devices is None:
        import torch

        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    hostfile = args.hostfile if args.hostfile is not None else (
        DEFAULT_HOSTFILE if os.path.isfile(DEFAULT_HOSTFILE) else None)
    try:
        lines = None
        if hostfile is not None:
            with open(hostfile) as f:
                lines = f.readlines()
        request = LaunchRequest(hostfile_lines=lines, include=args.include, exclude=args.exclude,
                                num_nodes=args.num_nodes, num_gpus=args.num_gpus, node_rank=args.node_rank,
                                no_ssh=args.no_ssh, master_addr=args.master_addr, master_port=args.master_port)
        plan = plan_launch(request, cuda_devices=cuda_devices, visible_env=env.get("CUDA_VISIBLE_DEVICES"))
        torchrun = torchrun_arguments(plan, args.user_script, args.user_args, module=args.module,
                                      no_python=args.no_python, local_rank_arg=not args.no_local_rank)
        if args.enable_each_rank_log is not None:
            if os.path.isfile(args.enable_each_rank_log):
                raise ValueError(f"--enable_each_rank_log {args.enable_each_rank_log!r} is a file; give a directory")
            torchrun = ["--log-dir", args.enable_each_rank_log, "--redirects", "3", *torchrun]
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if plan.visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = plan.visible_devices
    return Launch(torchrun, env, plan, quiet=args.quiet or args.log_level in ("error", "critical"))


def main(argv: Sequence[str]) -> int:
    """Print the torchrun command for ``argv`` and run it in this process. The exit status is 0
    when every process succeeded, else the first failed rank's own (128 + N for one killed by
    signal N), as DeepSpeed's launcher returns it; 2 for refused options."""
    launch = command(argv)
    if not launch.quiet:
        print(f"tiered launch: {launch.shown()}", file=sys.stderr, flush=True)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ.clear()
    os.environ.update(launch.env)
    try:
        torchrun(launch.torchrun)
    except ChildFailedError as failed:
        print(failed, file=sys.stderr)  # torchrun's table: each failed rank, its exit code and error file
        return rank_exit_status(failed.get_first_failure()[1].exitcode)
    return 0


def rank_exit_status(exitcode: int) -> int:
    """A failed process's exit status as a shell reports it: its own code, or 128 + N when signal N
    ended it (torch reports that as -N); never 0, since it failed."""
    if exitcode > 0:
        return exitcode
    return 128 - exitcode if exitcode < 0 else 1
