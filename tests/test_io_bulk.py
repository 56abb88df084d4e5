"""tiered.io.bulk: SequentialWriter and RangeReader on real files, with O_DIRECT (this disk) and
without (tmpfs refuses it), short transfers and a full disk."""

from __future__ import annotations

import os
import random

import pytest
from small_filesystems import fill

from tiered.errors import TransferError
from tiered.io.bulk import RangeReader, SequentialWriter
from tiered.io.files import Syscalls

KiB = 1024


def pieces(seed: int, total: int) -> list[bytes]:
    """Random bytes cut at random lengths (1 byte to 40 KiB), so writes straddle every chunk boundary."""
    rng = random.Random(seed)
    out, left = [], total
    while left:
        n = min(left, rng.choice([1, 7, 4096, 5000, 40 * KiB, rng.randrange(1, 40 * KiB)]))
        out.append(rng.randbytes(n))
        left -= n
    return out


def write_file(path: str, parts: list[bytes], **kw) -> SequentialWriter:
    writer = SequentialWriter(path, chunk_bytes=16 * KiB, in_flight=2, **kw)
    for part in parts:
        writer.write(part)
    writer.close()
    return writer


@pytest.mark.parametrize("size_hint", [0, 1])
def test_sequential_writer_writes_exactly_the_bytes_given(tmp_path, size_hint):
    parts = pieces(1, 300 * KiB + 13)
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"old and longer" * 100_000)  # replaced, not overwritten in place
    writer = write_file(path, parts, size_hint=size_hint * sum(map(len, parts)))
    assert writer.direct  # this disk takes O_DIRECT
    with open(path, "rb") as f:
        assert f.read() == b"".join(parts)


def test_short_writes_are_continued(tmp_path):
    def one_block(fd, views, offset):  # the kernel may write less than asked: 4 KiB at a time here
        return os.pwritev(fd, [views[0][: 4 * KiB]], offset)

    parts = pieces(2, 100 * KiB + 1)
    write_file(str(tmp_path / "f"), parts, syscalls=Syscalls(pwritev=one_block))
    assert (tmp_path / "f").read_bytes() == b"".join(parts)


def test_range_reader_returns_any_range(tmp_path):
    data = random.Random(3).randbytes(200 * KiB + 77)  # the last block is partial
    (tmp_path / "f").write_bytes(data)
    with RangeReader(str(tmp_path / "f"), chunk_bytes=16 * KiB, threads=3) as reader:
        rng = random.Random(4)
        ranges = [(0, len(data)), (len(data) - 5, 5), (4095, 2), (0, 0), (len(data), 0)]
        ranges += [(a, rng.randrange(0, len(data) - a + 1)) for a in (rng.randrange(len(data)) for _ in range(30))]
        for offset, length in ranges:
            assert bytes(reader.read(offset, length).numpy()) == data[offset : offset + length], (offset, length)
        with pytest.raises(ValueError, match="outside the file"):
            reader.read(len(data) - 1, 2)



def test_buffered_the_same_bytes(tmp_path):
    parts = pieces(5, 100 * KiB + 3)
    path = str(tmp_path / "f")
    writer = write_file(path, parts, direct=False)  # the path a filesystem refusing O_DIRECT takes
    assert not writer.direct
    data = b"".join(parts)
    with open(path, "rb") as f:
        assert f.read() == data
    with RangeReader(path, chunk_bytes=16 * KiB, direct=False) as reader:
        assert bytes(reader.read(5, len(data) - 9).numpy()) == data[5:-4]


def test_a_full_disk_raises_transfer_error(small_tmpfs):
    filler = fill(small_tmpfs)
    os.truncate(filler, os.path.getsize(filler) - 64 * KiB)  # room for some chunks, not all
    writer = SequentialWriter(os.path.join(small_tmpfs, "f"), chunk_bytes=16 * KiB, in_flight=2)
    with pytest.raises(TransferError, match="is the disk full|No space left"):
        for part in pieces(6, 512 * KiB):
            writer.write(part)
        writer.close()
    writer.abort()  # after a failure: closes what is left, raises nothing
