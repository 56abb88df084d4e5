"""Printing what the offline tools found: keys made safe for a terminal, byte sizes, aligned tables.

Keys are arbitrary strings. Printed raw, a key could carry escape sequences that rewrite the
terminal, bidirectional overrides that reorder what follows, or characters the output encoding
cannot write. :func:`safe_text` escapes all of those (and backslashes, so the escaped form is
unambiguous) and keeps every other character as it is.
"""

from __future__ import annotations

import unicodedata
from typing import Optional, Sequence

ELLIPSIS = "…"
_SHORT_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def safe_text(text: str, encoding: Optional[str] = "utf-8") -> str:
    """``text`` with non-printable characters, backslashes and characters ``encoding`` cannot write
    escaped Python-style (``\\x1b``, ``\\u202e``, ``\\udcff``); a leading combining mark is escaped
    too, so it cannot merge with what is printed before it."""
    out = []
    for i, ch in enumerate(text):
        if ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        elif not ch.isprintable() or (i == 0 and unicodedata.combining(ch)) or not _encodable(ch, encoding):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


def _encodable(ch: str, encoding: Optional[str]) -> bool:
    if encoding is None or ch.isascii():
        return True
    try:
        ch.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def display_width(text: str) -> int:
    """Terminal cells ``text`` takes: wide East Asian characters take two, combining marks none."""
    return sum(_cell_width(ch) for ch in text)


def _cell_width(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def fit(text: str, width: int, ellipsis: str = ELLIPSIS) -> str:
    """``text`` cut to at most ``width`` cells, ending in ``ellipsis`` when it was cut."""
    if display_width(text) <= width:
        return text
    room = width - display_width(ellipsis)
    out, used = [], 0
    for ch in text:
        w = _cell_width(ch)
        if used + w > room:
            break
        out.append(ch)
        used += w
    return "".join(out) + ellipsis


def format_bytes(n: Optional[int]) -> str:
    """``1.5 MiB`` for 1572864; ``-`` for None."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_ratio(logical: int, stored: int) -> str:
    """``2.50x``: logical bytes per stored byte (``-`` when nothing is stored)."""
    return f"{logical / stored:.2f}x" if stored else "-"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    """Lines of a table with a header, columns padded to their widest cell (``right`` aligns numbers)."""
    widths = [display_width(h) for h in headers]
    for row in rows:
        widths = [max(w, display_width(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = []
        for cell, width, r in zip(cells, widths, right, strict=True):
            pad = " " * (width - display_width(cell))
            parts.append(pad + cell if r else cell + pad)
        return "  ".join(parts).rstrip()

    return [line(headers), *(line(row) for row in rows)]
