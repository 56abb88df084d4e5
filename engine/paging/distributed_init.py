"""Joining the process group a launcher describes: :func:`init_distributed`, DeepSpeed's
``deepspeed.init_distributed()``.

``torchrun`` (and DeepSpeed's ``deepspeed`` launcher) start each process with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; the script still has to
call ``torch.distributed.init_process_group``. DeepSpeed scripts never do: ``deepspeed.initialize``
does it for them, and so does ``engine.initialize``.
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

#: What a launcher sets in each process's environment (env:// rendezvous).
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_world_size() -> Optional[int]:
    """``WORLD_SIZE`` as the launcher set it for this process; None when no launcher set it."""
    value = os.environ.get("WORLD_SIZE")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable WORLD_SIZE must be an integer, got {value!r}") from None


def local_rank() -> int:
    """This process's index on its machine (``LOCAL_RANK``, set by the launcher); 0 without one."""
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable LOCAL_RANK must be an integer, got {value!r}") from None


def default_backend() -> str:
    """NCCL where CUDA is available, gloo otherwise (as torchrun scripts and DeepSpeed choose)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    dist_backend: Optional[str] = None, *, timeout: Optional[datetime.timedelta] = None
) -> bool:
    """Join the default process group the launcher's environment describes (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), as ``deepspeed.init_distributed()`` does.

    ``dist_backend``: ``"gloo"``, ``"nccl"``, ...; default NCCL with CUDA, gloo without. Returns
    True when this call initialized the group; False when it already was, or when no launcher
    started this process (one process: the engine then needs no group).

    Raises:
        ValueError: ``WORLD_SIZE`` or ``LOCAL_RANK`` is not an integer, or the environment lacks
            what the process group needs (named in the message).
        RuntimeError: a launcher started this process but torch has no ``torch.distributed``.
    """
    present = [name for name in LAUNCHER_VARIABLES if name in os.environ]
    if not present:
        return False
    if not dist.is_available():
        raise RuntimeError("a launcher started this process, but this torch build has no torch.distributed; "
                           "install one that has it to run several ranks")
    if dist.is_initialized():
        return False
    if len(present) < len(LAUNCHER_VARIABLES):
        missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
        raise ValueError(
            f"the environment sets {present} but not {missing}: start the processes with torchrun "
            f"(it sets all of {list(LAUNCHER_VARIABLES)}), or set the missing ones"
        )
    backend = dist_backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, **kwargs)
    return True


__all__ = ["init_distributed", "launched_world_size", "local_rank"]
