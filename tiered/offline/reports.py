"""The human-readable text of ``tiered inspect`` and ``tiered fsck``."""

from __future__ import annotations

import os
from typing import Optional

from tiered.offline.fsck import FsckReport
from tiered.offline.inspection import InspectReport
from tiered.offline.render import fit, format_bytes, format_ratio, format_table, safe_text

#: Widest key shown in the table (terminal cells); longer keys are cut with an ellipsis.
KEY_WIDTH = 48


def inspect_lines(report: InspectReport, *, encoding: Optional[str], summary_only: bool = False) -> list[str]:
    """The inspect table (unless ``summary_only``) and summary, safe to write in ``encoding``."""

    def text(s: str) -> str:
        return safe_text(s, encoding)

    ellipsis = "…" if _can_write("…", encoding) else "..."
    lines = []
    dirs = len(report.nvme_paths)
    lines.append(
        f"store {text(report.path)} ({dirs} swap director{'y' if dirs == 1 else 'ies'}, "
        f"{report.files_per_dir} swap file{'s' if report.files_per_dir != 1 else ''} each)"
    )
    if report.in_use_by is not None:
        lines.append(
            f"note: the store is open in process {text(report.in_use_by)}; these are its committed entries, and "
            "orphaned space is not computed while it runs (its writes in flight would look orphaned)"
        )
    damaged = set(report.damaged)
    if not summary_only and report.entries:
        rows = [
            [
                fit(text(e.key), KEY_WIDTH, ellipsis),
                text(e.dtype),
                "[" + ", ".join(map(str, e.shape)) + "]" if e.shape is not None else "?",
                format_bytes(e.nbytes),
                format_bytes(e.stored_nbytes),
                text(e.codec) + (f" {format_ratio(e.nbytes, e.stored_nbytes)}" if e.codec != "raw" else ""),
                "DAMAGED" if e.key in damaged else ",".join(report.tiers),
                str(e.generation),
            ]
            for e in report.entries
        ]
        headers = ["key", "dtype", "shape", "bytes", "stored", "codec", "tiers", "generation"]
        right = [False, False, False, True, True, False, False, True]
        lines.append("")
        lines.extend(format_table(headers, rows, right))
        lines.append("")
    n = len(report.entries)
    lines.append(
        f"{n} entr{'y' if n == 1 else 'ies'}: {format_bytes(report.logical_bytes)} logical, "
        f"{format_bytes(report.stored_bytes)} stored ({format_ratio(report.logical_bytes, report.stored_bytes)} "
        "overall)"
    )
    lines.append("swap files:")
    for s in report.spaces:
        if s.unavailable is not None:
            lines.append(f"  {text(s.path)}: not this store's: {text(s.unavailable)}")
            continue
        if not s.exists:
            lines.append(f"  {text(s.path)}: missing")
            continue
        lines.append(
            f"  {text(s.path)}: {format_bytes(s.size)}, {format_bytes(s.disk_bytes)} on disk; "
            f"{format_bytes(s.allocated_bytes)} allocated, {format_bytes(s.free_bytes)} free, "
            f"{format_bytes(s.orphaned_bytes)} orphaned"
        )
    swap = sum(s.size for s in report.spaces)
    disk = sum(s.disk_bytes for s in report.spaces)
    lines.append(
        f"space: {format_bytes(report.allocated_bytes)} allocated, {format_bytes(report.free_bytes)} free, "
        f"{format_bytes(report.orphaned_bytes)} orphaned, of {format_bytes(swap)} in swap files "
        f"({format_bytes(disk)} on disk)"
    )
    if report.free_bytes:
        lines.append("  (free: room in the swap files that no record uses, kept for the store's next writes)")
    if report.orphaned_bytes:
        lines.append("  (orphaned: data no record references, left by a store that did not close cleanly; "
                     "`tiered fsck --reclaim` gives it back)")
    if report.damaged:
        n = len(report.damaged)
        lines.append(f"{n} record{' is' if n == 1 else 's are'} damaged and not served (`tiered fsck` says why): "
                     + ", ".join(f"'{fit(text(k), KEY_WIDTH, ellipsis)}'" for k in report.damaged))
    return lines


def fsck_lines(report: FsckReport, *, encoding: Optional[str]) -> list[str]:
    """What fsck found and did, ending in a one-line verdict."""

    def text(s: str) -> str:
        return safe_text(s, encoding)

    lines = [
        f"fsck {text(report.path)}: {report.entries} entr{'y' if report.entries == 1 else 'ies'}, "
        f"{report.verified_entries} verified by checksum ({format_bytes(report.verified_bytes)} read)"
    ]
    if report.unverified:
        lines.append(
            f"{len(report.unverified)} entr{'y has' if len(report.unverified) == 1 else 'ies have'} no checksums "
            "(written with checksum=False) and were not verified"
        )
    if report.integrity_ok:
        lines.append("manifest: SQLite's integrity check: ok"
                     + ("" if report.legacy else "; every record's own checksum was checked"))
    if report.legacy:
        lines.append("the manifest is of the earlier format: its records carry no checksums of their own (opening "
                     "the store with this version of tiered upgrades it)")
    if not report.integrity_ok:
        shown = report.integrity[:5]
        more = f" (and {len(report.integrity) - len(shown)} more)" if len(report.integrity) > len(shown) else ""
        lines.append(f"SQLite's integrity check of the manifest FAILED{more}:")
        lines.extend(f"  - {text(line)}" for line in shown)
    for damage in report.damaged:
        lines.append(f"DAMAGED '{text(damage.key)}' (row {damage.row.rowid}, generation "
                     f"{damage.row.record.generation}):")
        lines.extend(f"  - {text(reason)}" for reason in damage.reasons)
    for missing in report.unavailable:
        lines.append(f"NOT CHECKED '{text(missing.key)}':")
        lines.extend(f"  - {text(reason)}" for reason in missing.reasons)
    for s in report.spaces:
        if s.orphaned:
            lines.append(
                f"orphaned: {format_bytes(s.orphaned_bytes)} in {len(s.orphaned)} range"
                f"{'s' if len(s.orphaned) != 1 else ''} of {text(os.path.basename(s.path))} ({text(s.path)})"
            )
    if report.deleted:
        lines.append(f"deleted {len(report.deleted)} damaged record{'s' if len(report.deleted) != 1 else ''}: "
                     + ", ".join(f"'{text(k)}'" for k in report.deleted))
    if report.reclaimed is not None:
        r = report.reclaimed
        lines.append(
            f"reclaimed {format_bytes(r.orphaned_bytes)} of orphaned space "
            f"(disk usage of the affected swap files {format_bytes(r.disk_bytes_before)} -> "
            f"{format_bytes(r.disk_bytes_after)}; {format_bytes(r.truncated_bytes)} cut from file tails)"
        )
    if report.clean:
        lines.append("clean")
        return lines
    problems = []
    if not report.integrity_ok:
        problems.append("the manifest's database file fails SQLite's integrity check")
    if report.damaged:
        n = len(report.damaged)
        state = "deleted" if report.deleted else "left as they are"
        problems.append(f"{n} damaged entr{'y' if n == 1 else 'ies'} ({state})")
    if report.unavailable:
        n = len(report.unavailable)
        problems.append(f"{n} entr{'y' if n == 1 else 'ies'} not checked: {'its' if n == 1 else 'their'} swap files "
                        "are not here (never deleted)")
    if report.orphaned_bytes:
        n = report.orphaned_ranges
        problems.append(f"{format_bytes(report.orphaned_bytes)} orphaned in {n} range{'s' if n != 1 else ''}")
    lines.append(("problems found: " if not report.healthy else "no damage; ") + "; ".join(problems))
    if report.damaged and not report.deleted:
        lines.append("  --delete-damaged removes the damaged records, so the store opens and reads the rest")
    if report.unavailable:
        lines.append("  give the store's swap directories with --nvme-path DIR (one per directory, in their original "
                     "order) to check those entries")
    if not report.integrity_ok:
        lines.append("  records SQLite can still read were checked above; restore the store directory from a backup "
                     "to get back any it cannot")
    if report.orphaned_bytes:
        lines.append(
            "  orphaned space holds bytes no record references, left by a store that did not close cleanly (versions "
            "it replaced or deleted, or writes a crash left uncommitted); the store reuses it, and --reclaim gives it "
            "back to the filesystem"
        )
    return lines


def _can_write(s: str, encoding: Optional[str]) -> bool:
    try:
        s.encode(encoding or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True
