"""The ``tiered`` command: ``tiered bench``, ``tiered inspect DIR``, ``tiered fsck DIR`` and ``tiered env``.

A public module: :data:`COMMANDS`, :data:`USAGE` and :func:`main`'s ``commands`` and ``usage`` let a
package built on the store add its own commands (the engine's ``tiered train`` and the rest);
:func:`make_work_directory` and :func:`remove_made_directories` give a command's ``--dir`` the
same checks and the same tidy end everywhere. It imports no torch, so ``tiered --help`` is quick.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Callable, Mapping, Optional, Sequence

USAGE = """usage: tiered <command> [options]   (tiered <command> --help for its options; tiered --version)

commands:
  bench         measure the store on this machine, next to fio, torch.save and DeepSpeed's aio
  inspect DIR   show a store directory's entries, codec ratios and swap-file space
  fsck DIR      verify every checksum of a closed store; --reclaim orphaned space, --delete-damaged
  env           what this machine and --dir give the store: O_DIRECT, fallocate, huge pages, locked memory, CUDA"""


#: Exit statuses of a command ended by Ctrl-C (SIGINT) and by a closed output pipe (SIGPIPE): 128 + signal.
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141


def _bench(argv: Sequence[str]) -> int:
    from tiered.bench.cli import main

    return main(list(argv))


def _inspect(argv: Sequence[str]) -> int:
    from tiered.offline.commands import inspect_main

    return inspect_main(argv)


def _fsck(argv: Sequence[str]) -> int:
    from tiered.offline.commands import fsck_main

    return fsck_main(argv)


def _env(argv: Sequence[str]) -> int:
    from tiered.env_report import main

    return main(argv)


#: Subcommands; each imports its module only when run, so ``tiered --help`` stays fast.
COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "bench": _bench,
    "inspect": _inspect,
    "fsck": _fsck,
    "env": _env,
}


def main(
    argv: Optional[Sequence[str]] = None,
    *,
    commands: Mapping[str, Callable[[Sequence[str]], int]] = COMMANDS,
    usage: str = USAGE,
) -> int:
    """Dispatch ``tiered <command> ...``; return the exit status (2 for an unknown command).

    ``commands`` and ``usage`` let a package built on the store add commands (the engine adds
    ``train``; the store never imports the engine). Whatever the command, Ctrl-C ends it with one
    ``interrupted`` line and status 130, and a reader that stops reading its output (``| head``)
    ends it quietly with status 141, as a shell reports a process ended by SIGPIPE.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from tiered import __version__

        print(f"tiered {__version__}")
        return 0
    command = commands.get(args[0])
    if command is None:
        print(f"tiered: unknown command {args[0]!r}\n{usage}", file=sys.stderr)
        return 2
    try:
        status = command(args[1:])
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at the interpreter's exit
        return status
    except KeyboardInterrupt:
        print(f"tiered {args[0]}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE


def make_work_directory(path: str, option: str = "--dir") -> list[str]:
    """Make the directory a command works in (with missing parents) and check that this user may
    write there; return the directories made, outermost first, for :func:`remove_made_directories`.

    Raises:
        ValueError: one line naming ``option`` and ``path``: a file is there, or the directory cannot
            be made or written. The directories made by this call are removed again first.
    """
    directory = os.path.abspath(path)
    missing = []
    at = directory
    while not os.path.lexists(at):
        missing.append(at)
        at = os.path.dirname(at)
    if os.path.islink(at):
        what = "is a symbolic link" if at == directory else f"cannot be made: {at} is a symbolic link"
        raise ValueError(f"{option} {directory} {what}, which the store does not follow; pass the directory it "
                         "points to, or another one")
    if not os.path.isdir(at):
        what = "is not a directory" if at == directory else f"cannot be made: {at} is not a directory"
        raise ValueError(f"{option} {directory} {what}; pass a new or existing directory")
    made: list[str] = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue  # made meanwhile by someone else: not ours to remove
        except OSError as exc:
            remove_made_directories(made)
            raise ValueError(f"{option} {directory} cannot be made: {exc.strerror or exc} ({d})") from None
        made.append(d)
    if not os.access(directory, os.W_OK | os.X_OK):
        remove_made_directories(made)
        raise ValueError(f"{option} {directory} is not writable by this user; pass a directory you can write in")
    return made


def remove_made_directories(made: Sequence[str]) -> list[str]:
    """Remove the directories :func:`make_work_directory` made (outermost first), innermost first,
    stopping at one that is not empty; return those removed, outermost first."""
    removed = []
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                break  # not empty (or not ours to remove): it and its parents stay
        removed.append(d)
    return removed[::-1]


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is still buffered
    does not fail again on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (a test's StringIO): nothing will be flushed there
        pass


__all__ = ["COMMANDS", "USAGE", "main", "make_work_directory", "remove_made_directories"]

if __name__ == "__main__":
    raise SystemExit(main())
