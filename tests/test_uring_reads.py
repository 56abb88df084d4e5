"""benchmarks/uring_reads.py runs end to end on a few MiB and checks every byte it reads (no timing
assertions: the figures are the benchmark's business)."""

from __future__ import annotations

import json
import os

import pytest


@pytest.fixture
def uring_reads(benchmark_script):
    module = benchmark_script("uring_reads")
    try:
        module.UringReader().close()
    except OSError as exc:
        pytest.skip(f"no io_uring here: {exc}")
    return module


def test_every_contender_reads_every_byte(tmp_path, uring_reads, capsys):
    out = tmp_path / "uring.json"
    assert uring_reads.main(["--dir", str(tmp_path), "--size", str(4 << 20), "--tensor-size", str(1 << 20),
                             "--block-size", str(256 << 10), "--rounds", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = [row["contender"] for row in report["rows"]]
    assert names[:2] == ["store, sequential gets", "io_uring, one thread, CRC-32 per block"]
    assert all(len(row["runs"]) == 3 and row["min"] > 0 for row in report["rows"])
    assert "| io_uring, one thread, CRC-32 per block |" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["uring.json"]  # the scratch store is gone


def test_a_read_past_the_end_of_a_file_is_an_error(tmp_path, uring_reads):
    """A short read is reported, not counted as done."""
    path = tmp_path / "short"
    path.write_bytes(b"x" * 4096)
    buffer = uring_reads.tiered.empty_aligned((2 * 4096,), uring_reads.torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    ring = uring_reads.UringReader()
    try:
        with pytest.raises(OSError, match="4096 of 8192 bytes"):
            ring.read_all([(fd, buffer.data_ptr(), 8192, 0)], lambda i: None)
    finally:
        ring.close()
        os.close(fd)


def test_without_io_uring_it_says_so_and_fails(tmp_path, benchmark_script, monkeypatch, capsys):
    module = benchmark_script("uring_reads")

    def refused() -> None:
        raise OSError(1, "io_uring_setup: Operation not permitted")

    monkeypatch.setattr(module, "UringReader", refused)
    assert module.main(["--dir", str(tmp_path)]) == 1
    assert "io_uring is not available here" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # nothing was written
