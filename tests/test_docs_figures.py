"""Every figure in the docs' results tables is in the committed JSON file named beside the table.

The convention (docs/results.md, "How to read this page"): a table of measured figures is preceded
by a line ``Source: [name.json](name.json), written by `command```; the command writes that file
(its ``--json`` names it). Every number in the table's cells, except the first column's labels, must
be a number of that file rounded to the digits shown, in the unit its column header names (GB,
GiB, MB, MiB, ms, %, M for millions; otherwise as the file has it). Every table of
docs/results.md that holds a number has a source. No benchmark runs here: the files are read.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PAGES = sorted([os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md")]
               + [os.path.join(ROOT, "README.md")])
SOURCE = re.compile(r"^Source: \[(?P<file>[\w.-]+\.json)\]\((?P=file)\), written by `(?P<command>[^`]+)`")
#: A number standing alone in a cell: not part of a word ("8MiB", "fp32"), a version or a power of ten.
NUMBER = re.compile(r"(?<![\w.])(?<!e-)(?<!e\+)(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?![\w.]*[A-Za-z_])")
UNITS = (("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("GB/s", 1e9), ("GB", 1e9), ("MB", 1e6), ("(M)", 1e6),
         ("M params", 1e6), ("ms", 1e-3), ("%", 0.01))


def tables(path: str) -> Iterator[tuple[int, list[str], dict[str, Any] | None]]:
    """(line number, the table's lines, its source) for every table of a page, code blocks left out."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    source, in_code, i = None, False, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := SOURCE.match(line)):
            source = m.groupdict()
        elif not in_code and line.startswith("#"):
            source = None
        elif not in_code and line.startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            yield start + 1, lines[start:i], source
            source = None
            continue
        i += 1


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def numbers(value: Any) -> Iterator[float]:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        if math.isfinite(value):
            yield float(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from numbers(v)


def scales(header: str) -> list[float]:
    found = [1.0]
    for unit, scale in UNITS:
        if unit in header:
            found.append(scale)
            break
    return found


def in_file(shown: str, decimals: str | None, values: list[float], header: str) -> bool:
    target = float(shown.replace(",", "") + (f".{decimals}" if decimals else ""))
    half = 0.5 * 10.0 ** -(len(decimals) if decimals else 0) + 1e-12
    return any(abs(v / scale - target) <= half * (1 + 1e-9) for scale in scales(header) for v in values)


def sourced_tables() -> list[Any]:
    return [pytest.param(path, line, rows, source, id=f"{os.path.basename(path)}:{line}")
            for path in PAGES for line, rows, source in tables(path) if source]


def test_the_results_page_names_a_source_for_every_table_of_figures():
    unsourced = []
    for line, rows, source in tables(os.path.join(DOCS, "results.md")):
        body = [c for row in rows[2:] for c in cells(row)[1:]]
        if source is None and any(NUMBER.search(c) for c in body):
            unsourced.append(line)
    assert not unsourced, f"docs/results.md: tables of figures without a 'Source:' line at lines {unsourced}"


@pytest.mark.parametrize("path, line, rows, source", sourced_tables())
def test_every_figure_of_a_sourced_table_is_in_its_json(path, line, rows, source):
    name = os.path.relpath(path, ROOT)
    json_path = os.path.join(DOCS, source["file"])
    assert os.path.isfile(json_path), f"{name}:{line}: {source['file']} is not in docs/"
    assert source["file"] in source["command"], f"{name}:{line}: the command does not write {source['file']}"
    with open(json_path, encoding="utf-8") as f:
        values = list(numbers(json.load(f)))
    header = cells(rows[0])
    missing = []
    for row in rows[2:]:
        for column, cell in enumerate(cells(row)[1:], start=1):
            for m in NUMBER.finditer(cell):
                if not in_file(m.group(1), m.group(2), values, header[column] if column < len(header) else ""):
                    missing.append(f"{cells(row)[0]!r} / {header[column]!r}: {m.group(0)}")
    assert not missing, f"{name}:{line}: figures not in {source['file']}: {missing}"


def test_the_checker_finds_a_figure_that_is_not_in_the_file(tmp_path):
    values = [1.234, 2.5e9, 3 * 2.0 ** 30]
    assert in_file("1", "23", values, "median s") and not in_file("1", "24", values, "median s")
    assert in_file("2", "50", values, "read GB/s") and in_file("3", "0", values, "peak, GiB")
    assert not in_file("3", "0", values, "peak s")
    table = ["| contender | step s | peak GiB |", "|---|---|---|", "| a, 8 x 256MiB | 1.23 (2.50) | 3.0 |"]
    found = [m.group(0) for c in cells(table[2])[1:] for m in NUMBER.finditer(c)]
    assert found == ["1.23", "2.50", "3.0"]
