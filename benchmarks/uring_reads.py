"""Sequential cold reads through a minimal io_uring reader, beside the store's gets and DeepSpeed's aio.

    python benchmarks/uring_reads.py --dir /nvme/scratch --rounds 8 --json uring.json

The question it answers: would native submission close the store's read gap to DeepSpeed? The
store's io threads each block in one ``preadv``; DeepSpeed's threads keep libaio requests in
flight. Here one Python thread keeps a tensor's blocks in flight through io_uring (``ctypes``
system calls on the kernel's rings: no library, x86-64 only, where stores are ordered as the
rings need), verifying each block's CRC-32 as it completes, as the store does, and once without.

Every contender reads the same 8 x 256 MiB from the same ranges of one store's swap files
(``TieredStore.nvme_layout``), one tensor after another, with the page cache dropped before each
pass when permitted (O_DIRECT either way); order rotated round by round, ratios paired within a
round. Needs Linux >= 5.6 with io_uring allowed; DeepSpeed's row needs its aio op.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import shutil
import statistics
import struct
import sys
import time
from typing import Callable, Optional

import torch
from bench_output import (
    add_alternation_arguments, paired_median, print_table, rotated, scratch_dir, with_load, write_json,
)

import tiered
from tiered.bench.deepspeed_aio import load_aio
from tiered.bench.system import drop_page_cache
from tiered.io.crc import crc32

MiB = 1 << 20
_U32, _U64 = ctypes.c_uint32, ctypes.c_uint64
_SYS_IO_URING_SETUP, _SYS_IO_URING_ENTER = 425, 426
_IORING_OP_READ, _IORING_ENTER_GETEVENTS = 22, 1
_CQ_RING_OFFSET, _SQES_OFFSET = 0x8000000, 0x10000000
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # struct io_uring_sqe, 64 bytes
_CQE = struct.Struct("<QiI")  # struct io_uring_cqe, 16 bytes
_U32_AT = struct.Struct("<I")


class _SqOffsets(ctypes.Structure):
    _fields_ = [("head", _U32), ("tail", _U32), ("ring_mask", _U32), ("ring_entries", _U32), ("flags", _U32),
                ("dropped", _U32), ("array", _U32), ("resv1", _U32), ("user_addr", _U64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [("head", _U32), ("tail", _U32), ("ring_mask", _U32), ("ring_entries", _U32), ("overflow", _U32),
                ("cqes", _U32), ("flags", _U32), ("resv1", _U32), ("user_addr", _U64)]


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", _U32), ("cq_entries", _U32), ("flags", _U32), ("sq_thread_cpu", _U32),
                ("sq_thread_idle", _U32), ("features", _U32), ("wq_fd", _U32), ("resv", _U32 * 3),
                ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


class UringReader:
    """One io_uring instance read from one thread: :meth:`read_all` submits reads and reaps them."""

    def __init__(self, entries: int = 128) -> None:
        if platform.machine() not in ("x86_64", "AMD64"):
            raise OSError(f"this prototype writes the rings with plain stores: x86-64 only, not {platform.machine()}")
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        p = self._params = _Params()
        fd = self._libc.syscall(_SYS_IO_URING_SETUP, entries, ctypes.byref(p))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)} (io_uring disabled or kernel < 5.1?)")
        self.fd = fd
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        self._sq = mmap.mmap(fd, p.sq_off.array + p.sq_entries * 4, mmap.MAP_SHARED, rw, offset=0)
        self._cq = mmap.mmap(fd, p.cq_off.cqes + p.cq_entries * _CQE.size, mmap.MAP_SHARED, rw,
                             offset=_CQ_RING_OFFSET)
        self._sqes = mmap.mmap(fd, p.sq_entries * _SQE.size, mmap.MAP_SHARED, rw, offset=_SQES_OFFSET)
        self.entries = p.sq_entries
        self._sq_mask = _U32_AT.unpack_from(self._sq, p.sq_off.ring_mask)[0]
        self._cq_mask = _U32_AT.unpack_from(self._cq, p.cq_off.ring_mask)[0]

    def read_all(self, requests: list[tuple[int, int, int, int]], on_done: Callable[[int], None]) -> None:
        """Read every ``(fd, address, length, offset)`` (at most ``entries`` of them), calling
        ``on_done(i)`` as request ``i`` completes; a short read or an error raises."""
        assert len(requests) <= self.entries
        p = self._params
        tail = _U32_AT.unpack_from(self._sq, p.sq_off.tail)[0]
        for i, (fd, address, length, offset) in enumerate(requests):
            slot = (tail + i) & self._sq_mask
            _SQE.pack_into(self._sqes, slot * _SQE.size, _IORING_OP_READ, 0, 0, fd, offset, address, length, 0, i,
                           0, 0, 0, 0, 0)
            _U32_AT.pack_into(self._sq, p.sq_off.array + slot * 4, slot)
        _U32_AT.pack_into(self._sq, p.sq_off.tail, (tail + len(requests)) & 0xFFFFFFFF)
        to_submit, done = len(requests), 0
        while done < len(requests):
            if self._libc.syscall(_SYS_IO_URING_ENTER, self.fd, to_submit, 1, _IORING_ENTER_GETEVENTS, None, 0) < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")
            to_submit = 0
            head = _U32_AT.unpack_from(self._cq, p.cq_off.head)[0]
            tail_cq = _U32_AT.unpack_from(self._cq, p.cq_off.tail)[0]
            while head != tail_cq:
                index, result, _ = _CQE.unpack_from(self._cq, p.cq_off.cqes + (head & self._cq_mask) * _CQE.size)
                head = (head + 1) & 0xFFFFFFFF
                _U32_AT.pack_into(self._cq, p.cq_off.head, head)
                if result != requests[index][2]:
                    detail = os.strerror(-result) if result < 0 else f"{result} of {requests[index][2]} bytes"
                    raise OSError(f"io_uring read {index} at offset {requests[index][3]}: {detail}")
                on_done(index)
                done += 1

    def close(self) -> None:
        """Unmap the rings and close the instance."""
        for m in (self._sq, self._cq, self._sqes):
            m.close()
        os.close(self.fd)


def run(args: argparse.Namespace, ring: UringReader) -> dict:
    load_before = os.getloadavg()
    n = max(1, args.size // args.tensor_size)
    tensors = [tiered.empty_aligned((args.tensor_size // 4,), torch.float32) for _ in range(n)]
    for i, t in enumerate(tensors):
        t.normal_(generator=torch.Generator().manual_seed(i))
    outs = [tiered.empty_aligned(t.shape, t.dtype) for t in tensors]
    workdir = scratch_dir(args.dir, "tiered-uring-")
    store = tiered.TieredStore.open(tiered.StoreConfig(path=os.path.join(workdir, "store"), host_bytes=0,
                                                       block_size=args.block_size))
    fds: dict[str, int] = {}
    closers: list[Callable[[], None]] = [store.sync.close]
    try:
        for i, t in enumerate(tensors):
            store.sync.put(f"t{i}", t, tier="nvme")
        layouts = [store.nvme_layout(f"t{i}") for i in range(n)]
        for extent in (e for layout in layouts for e in layout):
            fds.setdefault(extent.path, os.open(extent.path, os.O_RDONLY | os.O_DIRECT))

        def uring_requests(i: int, into: list[torch.Tensor]) -> list[tuple[int, int, int, int]]:
            out, base, pos = [], into[i].data_ptr(), 0
            for e in layouts[i]:
                for o in range(0, e.length, args.block_size):
                    out.append((fds[e.path], base + pos + o, min(args.block_size, e.length - o), e.offset + o))
                pos += e.length
            return out

        def uring_pass(checksum: bool, into: list[torch.Tensor]) -> None:
            for i in range(n):
                requests = uring_requests(i, into)
                for first in range(0, len(requests), ring.entries):
                    batch = requests[first:first + ring.entries]

                    def verify(index: int, batch=batch) -> None:
                        if checksum:
                            _, address, length, _ = batch[index]
                            crc32([memoryview((ctypes.c_char * length).from_address(address)).cast("B")], length)

                    ring.read_all(batch, verify)

        def store_pass() -> None:
            for i in range(n):
                store.sync.get(f"t{i}", out=outs[i])

        # name -> (one timed pass, the tensors it read into: zeroed before and compared after, untimed)
        contenders: dict[str, tuple[Callable[[], None], list[torch.Tensor]]] = {
            "store, sequential gets": (store_pass, outs),
            "io_uring, one thread, CRC-32 per block": (lambda: uring_pass(True, outs), outs),
            "io_uring, one thread, no checksum": (lambda: uring_pass(False, outs), outs),
        }
        module, status = load_aio()
        if module is not None:
            handle = module.aio_handle(args.block_size, 64, False, True, 4)
            locked = [handle.new_cpu_locked_tensor(args.tensor_size, torch.empty(0, dtype=torch.uint8))
                      for _ in range(n)]
            closers.append(lambda: [handle.free_cpu_locked_tensor(b) for b in locked])

            def deepspeed_pass() -> None:
                for i in range(n):
                    pos = 0
                    for e in layouts[i]:
                        handle.async_pread(locked[i][pos:pos + e.length], e.path, e.offset)
                        pos += e.length
                    if handle.wait() != len(layouts[i]):
                        raise RuntimeError("DeepSpeed aio wait() did not complete every read")

            theirs = [b.view(torch.float32) for b in locked]
            contenders["deepspeed, one tensor at a time"] = (deepspeed_pass, theirs)
            # The same io_uring reads into DeepSpeed's buffers: what is memory and what is the I/O path.
            contenders["io_uring, no checksum, into deepspeed's buffers"] = (lambda: uring_pass(False, theirs), theirs)
            later = [tiered.empty_aligned(t.shape, t.dtype) for t in tensors]
            contenders["io_uring, no checksum, into buffers allocated after deepspeed's"] = (
                lambda: uring_pass(False, later), later)
        else:
            print(f"deepspeed: {status.note}", file=sys.stderr)
        runs: dict[str, list[float]] = {name: [] for name in contenders}
        for r in range(args.rounds):
            for name in rotated(list(contenders), r):
                one_pass, into = contenders[name]
                for o in into:
                    o.zero_()
                drop_page_cache()  # when permitted: every read here is O_DIRECT either way
                start = time.perf_counter()
                one_pass()
                runs[name].append(n * args.tensor_size / (time.perf_counter() - start) / 1e9)
                if not all(torch.equal(a, b) for a, b in zip(into, tensors)):
                    raise RuntimeError(f"{name} read other bytes than were written")
            print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        for fd in fds.values():
            os.close(fd)
        for close in reversed(closers):
            close()
        shutil.rmtree(workdir, ignore_errors=True)
    ref = runs.get("deepspeed, one tensor at a time") or runs["store, sequential gets"]
    rows = [{"contender": name, "runs": v, "median": statistics.median(v), "min": min(v), "max": max(v),
             "paired_to_reference": paired_median(v, ref)} for name, v in runs.items()]
    reference = "deepspeed, one tensor at a time" if "deepspeed, one tensor at a time" in runs else "store"
    print(f"\n{n} x {args.tensor_size // MiB} MiB read one after another, {args.block_size // MiB} MiB blocks, "
          f"{args.rounds} rounds; GB/s")
    print_table(["contender", "median GB/s", "min", "max", f"paired / {reference}"],
                [(r["contender"], r["median"], r["min"], r["max"], r["paired_to_reference"]) for r in rows])
    return with_load({"size": n * args.tensor_size, "tensor_size": args.tensor_size, "block_size": args.block_size,
                      "rounds": args.rounds, "reference": reference, "rows": rows}, load_before)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_alternation_arguments(p, size_help="bytes read per contender per round", rounds=8)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.tensor_size <= 0 or args.tensor_size % args.block_size or args.block_size % 4096:
        p.error(f"--rounds must be >= 1, --block-size a multiple of 4096 and --tensor-size a positive multiple of "
                f"it; got {args.rounds}, {args.block_size} and {args.tensor_size}")
    try:
        ring = UringReader()
    except OSError as exc:
        print(f"io_uring is not available here: {exc}", file=sys.stderr)
        return 1
    try:
        write_json(run(args, ring), args.json)
    finally:
        ring.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
