"""Which processes ``tiered launch`` starts on this node: DeepSpeed's launcher options (hostfile,
``--include``/``--exclude``, ``--num_nodes``, ``--num_gpus``, ``--no_ssh --node_rank``) resolved
into a :class:`LaunchPlan`, and the plan written as torchrun's arguments.

DeepSpeed's meanings are kept: a hostfile line is ``<host> slots=<n>``, a slot is one GPU and one
process; ``--include``/``--exclude`` take ``host[:slot,slot][@host...]``; ``--num_nodes`` keeps the
first hosts and ``--num_gpus`` the first slots of each. Without GPUs a slot is one CPU process.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Optional, Sequence

from torch.distributed.elastic.utils.api import macros

#: DeepSpeed's default port for a launch across nodes (one node gets a free port of its own).
DEFAULT_MASTER_PORT = 29500

_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    """The launcher options that choose processes, as DeepSpeed's ``deepspeed`` command names them."""

    hostfile_lines: Optional[Sequence[str]] = None
    include: str = ""
    exclude: str = ""
    num_nodes: int = -1
    num_gpus: int = -1
    node_rank: int = -1
    no_ssh: bool = False
    master_addr: str = ""
    master_port: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """This node's share of the job: what torchrun is told."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    #: None on one node: torchrun's ``--standalone`` rendezvous picks a free port itself.
    master_addr: Optional[str]
    master_port: Optional[int]
    #: ``CUDA_VISIBLE_DEVICES`` for this node's processes (None: leave the environment's).
    visible_devices: Optional[str]


def parse_hostfile(lines: Sequence[str]) -> dict[str, int]:
    """DeepSpeed's hostfile: ``<host> slots=<n>`` per line, ``#`` comments and blank lines skipped."""
    pool: dict[str, int] = collections.OrderedDict()
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOSTFILE_LINE.match(line)
        if match is None:
            raise ValueError(f"hostfile line {line!r} is not '<host> slots=<n>'")
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise ValueError(f"hostfile names {host!r} twice")
        pool[host] = slots
    if not pool:
        raise ValueError("the hostfile lists no hosts ('<host> slots=<n>' per line)")
    return pool


def plan_launch(request: LaunchRequest, *, cuda_devices: int, visible_env: Optional[str]) -> LaunchPlan:
    """Resolve ``request`` for a node with ``cuda_devices`` GPUs (torch's count) whose
    ``CUDA_VISIBLE_DEVICES`` is ``visible_env``. Raises ValueError naming what cannot be launched."""
    if (request.include or request.exclude) and (request.num_nodes > 0 or request.num_gpus > 0):
        raise ValueError("--num_nodes/--num_gpus cannot be combined with --include/--exclude (as in DeepSpeed)")
    if request.hostfile_lines is None:
        return _plan_without_hostfile(request, cuda_devices, visible_env)
    pool = {host: [str(i) for i in range(n)] for host, n in parse_hostfile(request.hostfile_lines).items()}
    pool = _filtered(pool, request)
    hosts = list(pool)
    if request.num_nodes > 0:
        hosts = hosts[: request.num_nodes]
    if request.num_gpus > 0:
        pool = {host: slots[: request.num_gpus] for host, slots in pool.items()}
    if len(hosts) == 1 and not request.no_ssh:
        return _one_node(pool[hosts[0]], request, cuda_devices)
    if not request.no_ssh:
        raise ValueError(
            f"the hostfile lists {len(hosts)} hosts ({', '.join(hosts)}): tiered launch starts the processes of the "
            "node it runs on and does not ssh to the others. Run the same command on every node with --no_ssh "
            "--node_rank=<its index in the hostfile> (DeepSpeed's --no_ssh mode), or torchrun on each node")
    if not 0 <= request.node_rank < len(hosts):
        raise ValueError(f"--no_ssh needs --node_rank in [0, {len(hosts)}) for the hostfile's hosts "
                         f"{hosts}, got {request.node_rank}")
    slots = pool[hosts[request.node_rank]]
    return _node_of_several(request, len(hosts), len(slots), request.master_addr or hosts[0],
                            ",".join(slots) if cuda_devices else None)


def _plan_without_hostfile(request: LaunchRequest, cuda_devices: int, visible_env: Optional[str]) -> LaunchPlan:
    if request.num_nodes > 1:
        # DeepSpeed needs a hostfile for several nodes; --no_ssh with an address and a rank says as much.
        if not (request.no_ssh and request.master_addr and request.node_rank >= 0):
            raise ValueError(f"--num_nodes {request.num_nodes} needs a --hostfile (with --no_ssh --node_rank), or "
                             "--no_ssh --node_rank=<i> --master_addr=<node 0's address> on every node")
        if request.node_rank >= request.num_nodes:
            raise ValueError(f"--node_rank {request.node_rank} is not below --num_nodes {request.num_nodes}")
        nproc = request.num_gpus if request.num_gpus > 0 else max(cuda_devices, 1)
        return _node_of_several(request, request.num_nodes, nproc, request.master_addr, None)
    if cuda_devices == 0:
        if request.include or request.exclude:
            raise ValueError("--include/--exclude choose GPUs, and torch sees none here: "
                             "--num_gpus N starts N processes on the CPU")
        return _one_node([str(i) for i in range(max(request.num_gpus, 1))], request, cuda_devices=0)
    ids = [d.strip() for d in visible_env.split(",")] if visible_env else [str(i) for i in range(cuda_devices)]
    pool = _filtered({"localhost": ids}, request)
    slots = pool.get("localhost", [])
    if request.num_gpus > len(slots):
        raise ValueError(f"--num_gpus {request.num_gpus} asks for more GPUs than the {len(slots)} this node has")
    if request.num_gpus > 0:
        slots = slots[: request.num_gpus]
    return _one_node(slots, request, cuda_devices)


def _node_of_several(request: LaunchRequest, nnodes: int, nproc: int, master_addr: str,
                     visible_devices: Optional[str]) -> LaunchPlan:
    return LaunchPlan(nnodes=nnodes, node_rank=request.node_rank, nproc_per_node=nproc, master_addr=master_addr,
                      master_port=request.master_port or DEFAULT_MASTER_PORT, visible_devices=visible_devices)


def _one_node(slots: list[str], request: LaunchRequest, cuda_devices: int) -> LaunchPlan:
    if not slots:
        raise ValueError("--include/--exclude leave no GPU to run on")
    explicit = request.master_port is not None
    return LaunchPlan(nnodes=1, node_rank=0, nproc_per_node=len(slots),
                      master_addr=(request.master_addr or "127.0.0.1") if explicit else None,
                      master_port=request.master_port, visible_devices=",".join(slots) if cuda_devices else None)


def _filtered(pool: dict[str, list[str]], request: LaunchRequest) -> dict[str, list[str]]:
    """DeepSpeed's ``--include`` / ``--exclude``: ``host[:slot,slot][@host[:slots]]``."""
    if request.include and request.exclude:
        raise ValueError("--include and --exclude cannot be given together (as in DeepSpeed)")
    spec = request.include or request.exclude
    if not spec:
        return pool
    named: dict[str, set[str]] = {}
    for part in spec.split("@"):
        host, _, slots = part.partition(":")
        if host not in pool:
            raise ValueError(f"{spec!r} names host {host!r}, which is not one of {list(pool)}")
        chosen = set(slots.split(",")) if slots else set(pool[host])
        unknown = sorted(chosen - set(pool[host]))
        if unknown:
            raise ValueError(f"{spec!r} names slots {unknown} of {host!r}, which has {pool[host]}")
        named.setdefault(host, set()).update(chosen)
    if request.include:
        kept = {host: [s for s in slots if s in named[host]] for host, slots in pool.items() if host in named}
    else:
        kept = {host: [s for s in slots if s not in named.get(host, ())] for host, slots in pool.items()}
    return {host: slots for host, slots in kept.items() if slots}


def torchrun_arguments(plan: LaunchPlan, script: str, script_args: Sequence[str], *, module: bool = False,
                       no_python: bool = False, local_rank_arg: bool = True) -> list[str]:
    """torchrun's command line for ``plan``; each process gets ``--local_rank=<n>`` first unless told not to.

    torchrun substitutes ``${local_rank}`` in every argument with ``string.Template``, so the
    script's own ``$`` signs are doubled here and come out of that substitution as written.
    """
    args = ["--nproc-per-node", str(plan.nproc_per_node)]
    if plan.nnodes > 1:
        args += ["--nnodes", str(plan.nnodes), "--node-rank", str(plan.node_rank)]
    if plan.master_port is None:
        args.append("--standalone")
    else:
        assert plan.master_addr is not None
        args += ["--master-addr", plan.master_addr, "--master-port", str(plan.master_port)]
    if module and no_python:
        raise ValueError("--module and --no_python cannot be given together (as in DeepSpeed)")
    if module:
        args.append("--module")
    if no_python:
        args.append("--no-python")
    args.append(_escaped(script))
    if local_rank_arg:
        args.append(f"--local_rank={macros.local_rank}")
    return args + [_escaped(a) for a in script_args]


def _escaped(arg: str) -> str:
    return arg.replace("$", "$$")


def as_given(arg: str) -> str:
    """One of :func:`torchrun_arguments`' arguments as the user gave it (``$`` signs undoubled)."""
    return arg.replace("$$", "$")
