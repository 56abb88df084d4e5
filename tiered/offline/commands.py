"""``tiered inspect DIR`` and ``tiered fsck DIR``: argument parsing, output and exit status."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Optional, Sequence, TextIO

from tiered.errors import ManifestError, StoreLockedError
from tiered.offline.fsck import FsckReport, check_store, repair_store
from tiered.offline.inspection import InspectReport, inspect_store
from tiered.offline.progress import ByteProgress
from tiered.offline.reports import fsck_lines, inspect_lines
from tiered.offline.storedir import StoreDirectory, stores_in
from tiered.util import CommandErrors

#: Exit statuses of ``tiered fsck`` (``tiered inspect`` uses OK, PROBLEMS for an unreadable store, USAGE).
EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
#: fsck draws a progress bar (on a terminal) when it has at least this many bytes to verify.
PROGRESS_MIN_BYTES = 256 * 1024 * 1024


def build_inspect_parser(prog: str = "tiered inspect") -> argparse.ArgumentParser:
    """The command line of ``tiered inspect``."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Show what a store directory holds: every committed entry (key, dtype, shape, bytes, stored "
        "bytes and codec ratio, tiers at rest, generation), then totals and how the swap files' space divides into "
        "allocated, free and orphaned bytes. Changes nothing; a store running on the directory keeps running.",
    )
    p.add_argument("dir", help="the store directory (StoreConfig.path), or a directory of stores (an engine "
                   "run's rank0, rank1, ...)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table "
                   "({\"stores\": [...]} for several)")
    _add_nvme_path(p)
    p.add_argument("--summary", action="store_true", help="leave out the per-entry table")
    return p


def build_fsck_parser(prog: str = "tiered fsck") -> argparse.ArgumentParser:
    """The command line of ``tiered fsck``."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Verify a closed store directory: check every committed record's checksum and fields, read "
        "its extents and check their CRC-32s, and run SQLite's integrity check of the manifest; report damaged "
        "keys, entries whose swap files are not there, and orphaned space (bytes in swap files no record "
        "references, e.g. after a crash). Without options it changes nothing.",
        epilog="exit status: 0 no damaged entry (orphaned space alone is harmless: the store reuses it); 1 damaged "
        "entries found (deleted or not), entries whose swap files are not there, a manifest SQLite finds unsound, "
        "or the manifest unreadable; 2 usage error, not a store directory, or the store is open in another process.",
    )
    p.add_argument("dir", help="the store directory (StoreConfig.path), or a directory of stores (an engine "
                   "run's rank0, rank1, ...)")
    p.add_argument("--reclaim", action="store_true", help="give orphaned space back to the filesystem (punch "
                   "holes; cut unused file tails)")
    p.add_argument("--delete-damaged", action="store_true", help="remove the records of damaged entries (those "
                   "whose own record or bytes failed their check; never one whose swap files are merely not there) "
                   "from the manifest, so the store serves the rest; says which it removed (their data is lost)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_nvme_path(p)
    p.add_argument("--threads", type=int, default=8, help="reader threads (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")
    return p


def _add_nvme_path(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nvme-path", action="append", metavar="DIR", dest="nvme_paths",
                   help="where a swap directory of the store is now (repeat it for each, in their original order): "
                   "for a store moved or copied since it was last opened whose swap directories lie outside its "
                   "own; by default they are where the manifest recorded them, relative to the store's directory "
                   "when inside it")


def inspect_main(argv: Sequence[str], *, stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None) -> int:
    """Run ``tiered inspect``; return its exit status. A directory holding several stores (an engine
    run's ``rank0``, ``rank1``, ...) shows each."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    args = _parse(build_inspect_parser(), argv)
    if isinstance(args, int):
        return args
    results = [_inspect_one(path, args.nvme_paths, err, quiet=args.json) for path in stores_in(args.dir)]
    return _report(results, args.json, out,
                   lambda report: inspect_lines(report, encoding=_encoding(out), summary_only=args.summary))


def _inspect_one(path: str, nvme_paths: Optional[list[str]], err: TextIO, *, quiet: bool
                 ) -> "tuple[int, Optional[InspectReport]]":
    with CommandErrors("tiered inspect", {ValueError: EXIT_USAGE, (ManifestError, OSError): EXIT_PROBLEMS},
                       err) as failed:
        with StoreDirectory.open(path, allow_in_use=True, nvme_paths=nvme_paths) as directory:
            report = inspect_store(directory)
    if failed.status is not None:
        return failed.status, None
    if report.in_use_by is not None and not quiet:
        print(f"tiered inspect: the store {path} is open in process {report.in_use_by}; showing what it has "
              f"committed", file=err)
    return EXIT_OK, report


def fsck_main(argv: Sequence[str], *, stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None) -> int:
    """Run ``tiered fsck``; return its exit status (0 no damage, 1 damage found, 2 usage error). A
    directory holding several stores (an engine run's ``rank0``, ``rank1``, ...) checks each; the
    status is the worst of theirs."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    args = _parse(build_fsck_parser(), argv)
    if isinstance(args, int):
        return args
    if args.threads < 1:
        print(f"tiered fsck: --threads must be at least 1, got {args.threads}", file=err)
        return EXIT_USAGE
    results = [_fsck_one(path, args, err) for path in stores_in(args.dir)]
    return _report(results, args.json, out, lambda report: fsck_lines(report, encoding=_encoding(out)))


def _report(results: "list[tuple[int, Any]]", as_json: bool, out: TextIO, lines: Callable[[Any], list[str]]) -> int:
    """Print the reports of the stores a command went through (one JSON object, ``{"stores": [...]}``
    for several, or each report's text); return the worst exit status."""
    reports = [report for _, report in results if report is not None]
    if as_json and reports:
        dicts = [report.as_dict() for report in reports]
        print(json.dumps(dicts[0] if len(results) == 1 else {"stores": dicts}, indent=2), file=out)
    elif reports:
        print("\n\n".join("\n".join(lines(report)) for report in reports), file=out)
    return max(code for code, _ in results)


def _fsck_one(path: str, args: argparse.Namespace, err: TextIO) -> "tuple[int, Optional[FsckReport]]":
    repair = args.reclaim or args.delete_damaged

    def progress(total: int) -> ByteProgress:
        return ByteProgress("verifying", total, enabled=not args.no_progress and total >= PROGRESS_MIN_BYTES,
                            stream=err)

    statuses = {(ValueError, StoreLockedError): EXIT_USAGE, (ManifestError, OSError): EXIT_PROBLEMS}
    with CommandErrors("tiered fsck", statuses, err) as failed:
        with StoreDirectory.open(path, exclusive=repair, nvme_paths=args.nvme_paths) as directory:
            report = check_store(directory, threads=args.threads, progress=progress)
            if repair:
                report = repair_store(
                    directory, report, delete_damaged=args.delete_damaged, reclaim_space=args.reclaim
                )
    if failed.status is not None:
        return failed.status, None
    return (EXIT_OK if report.healthy else EXIT_PROBLEMS), report


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> "argparse.Namespace | int":
    """Parsed arguments, or the exit status argparse chose (0 after --help, 2 on a usage error)."""
    try:
        return parser.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE


def _encoding(stream: TextIO) -> Optional[str]:
    return getattr(stream, "encoding", None)
