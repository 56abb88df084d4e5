"""The nvme tier: a few large swap files per directory, extents allocated from a free list.

[Note: swap files]
Entries live in a few large swap files per directory (``swap_files_per_dir``), never a file per
tensor: small tensors pack at 4 KiB, a put creates no file and syncs no directory, the directory
never holds a name per key, and space one tensor frees the next one reuses. Keys never become file
names (they exist only in the manifest), so any string is a key and no key reaches outside the
store's directories. While the store is open the files only grow, by ``posix_fallocate`` on an
I/O thread, so no write ever extends a file (ext4 serializes O_DIRECT writes that do); only a
clean close ([Note: free space at close] in tiered.backends.free_space) and ``tiered fsck
--reclaim``, on a closed store, cut their tails. Which store and place a file belongs to: see
[Note: relocatable swap files] in tiered.backends.swap_ids.

An allocation runs under ``_alloc_lock``, which also covers the budget check and the charge to
``used``, so two allocations cannot both pass the check. With one directory, or for at most
``block_size`` bytes, it goes to one directory, the first one rotating from one allocation to the
next; a larger one is cut into one contiguous piece per directory. Within its directory a piece
takes one contiguous range of a file, starting from the next file in turn; failing that,
scattered ranges of one file; failing that, the smallest file grows by ``swap_grow_bytes``, or by
what the piece needs beyond the file's free tail when that is more, or by just that when the disk
has less room (CapacityError when even that is not free). ``allocate_many`` puts a batch's copies
of at most ``block_size`` back to back in one run of one directory, so that ``nvme_batch`` moves
them with few syscalls. ``_chunks`` lists a copy's chunks interleaved across its extents (the
first chunk of every extent, then the second, ...), so the blocks of one transfer in flight at once
keep every striped directory busy.

[Note: data checksums]
A copy's stored bytes (after any codec) are cut into chunks of ``copy.chunk`` bytes, none crossing
an extent, each one block of I/O with a CRC-32 of its own, kept by chunk index whatever order the
blocks ran in. The chunk size is ``block_size`` when the copy is written and the record keeps it,
so an entry written under another block size reads back (a chunk larger than a staging slot goes
through a temporary buffer). The I/O thread computes the CRC just before the write and checks it
right after the read, before a staged block is copied out; batched transfers (``nvme_batch``)
compute and check each chunk's own CRC as they copy it through the staging slot, so their records
are exactly a lone put's. A read that fails its check raises ChecksumError naming the key, and its
bytes are never served: a get raises (an ``out=`` tensor then holds unspecified bytes) and a
promotion discards its copy. ``StoreConfig(checksum=False)`` writes records without CRCs and skips
the check on reads, even of records that have them. The manifest's rows carry a checksum of their
own: [Note: record checksums] in tiered.manifest.records.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import os
import warnings
from typing import Iterator, Optional, Sequence

from tiered.backends import nvme_batch, swap_ids
from tiered.backends.base import Copy, TierBackend
from tiered.backends.coalesce import Coalescer
from tiered.backends.free_space import UntouchedRanges, give_back
from tiered.config import ALIGNMENT
from tiered.errors import CapacityError
from tiered.io import BlockRead, BlockWrite, FileHandle, IOEngine, open_file, round_up
from tiered.io.files import direct_io_memory_alignment
from tiered.io.spans import Span, aligned_views, copy_in, copy_out
from tiered.manifest.extents import Extent, ExtentAllocator
from tiered.manifest.ownership import OwnedDirectory
from tiered.stats import SwapExtent
from tiered.tier import Tier


@dataclasses.dataclass(frozen=True)
class FileExtent:
    """``length`` bytes at ``offset`` of swap file number ``file``."""

    file: int
    offset: int
    length: int


@dataclasses.dataclass(eq=False)
class NvmeCopy(Copy):
    """A copy held in swap-file extents; ``crcs`` has one CRC-32 per ``chunk`` bytes of each extent."""

    extents: list[FileExtent] = dataclasses.field(default_factory=list)
    chunk: int = 0
    crcs: Optional[list[int]] = None


@dataclasses.dataclass(eq=False)
class SwapFile:
    """One preallocated swap file and the allocator over its bytes."""

    index: int
    path: str
    handle: FileHandle
    alloc: ExtentAllocator
    #: Free at open and not allocated since (noted at the first allocation or free, after the records
    #: are adopted): what a clean close leaves as it is ([Note: free space at close]).
    untouched: Optional[UntouchedRanges] = None


class NvmeBackend(TierBackend):
    """Swap files under one or more directories; an entry's bytes are striped across directories
    (see [Note: swap files]). The store never writes extents a committed record points at (see
    [Note: crash safety] in tiered.store.versions)."""

    tier = Tier.NVME

    def __init__(
        self,
        dirs: Sequence[OwnedDirectory],
        *,
        store_id: str,
        files_per_dir: int,
        budget: Optional[int],
        grow_bytes: int,
        io: IOEngine,
        direct: bool,
        coalesce_bytes: int = 0,
        adopt_unlabelled: bool = False,
    ) -> None:
        """Open (creating what is missing) the swap files of ``dirs``, locked directories held by the
        caller, and check that each belongs to the store ``store_id`` at its place (swap_ids.py).

        ``adopt_unlabelled`` writes ids for swap files that have none (a store of an older format
        being upgraded); otherwise such a file is refused. Raises ManifestError for a swap file of
        another store or place, OSError for one that is a symlink or not the store's own file.
        """
        super().__init__()
        self.budget = budget
        self.dirs = [d.path for d in dirs]
        self._grow_bytes = grow_bytes
        self._io = io
        self._alloc_lock = asyncio.Lock()
        self._next_dir = 0
        self._next_file = [0] * len(self.dirs)
        self.files: list[SwapFile] = []
        self.direct = direct
        # Transfers up to coalesce_bytes arriving together run as one batch (coalesce.py).
        self.coalesce_bytes = coalesce_bytes
        self.writes: Coalescer[NvmeCopy, Sequence[Span]] = Coalescer(self._store_one, self.store_many)
        self.reads: Coalescer[NvmeCopy, Sequence[Span]] = Coalescer(self._load_one, self.load_many)
        try:
            for d, directory in enumerate(dirs):
                for i in range(files_per_dir):
                    swap_ids.claim(directory, i, swap_ids.SwapFileId(store_id, d, i), adopt=adopt_unlabelled)
                    name = swap_ids.swap_file_name(i)
                    handle = open_file(directory.join(name), direct=direct,
                                       opener=functools.partial(directory.open_file, name, create=True))
                    size = os.fstat(handle.fd).st_size
                    size -= size % ALIGNMENT
                    self.files.append(SwapFile(len(self.files), handle.path, handle, ExtentAllocator(size)))
        except BaseException:
            for f in self.files:
                f.handle.close()
            raise
        #: The memory alignment O_DIRECT needs on every swap file (the largest the kernel reports):
        #: a caller's tensor aligned to it moves in place, with no staging copy.
        self.memory_alignment = max(
            (direct_io_memory_alignment(f.handle) for f in self.files), default=ALIGNMENT)
        if direct and not all(f.handle.direct for f in self.files):
            self.direct = False
            warnings.warn(
                f"O_DIRECT is not supported under {', '.join(self.dirs)}; the nvme tier uses buffered I/O "
                "there, so reads may come from the page cache and bandwidth figures are not the disk's",
                RuntimeWarning,
                stacklevel=4,
            )

    @property
    def files_per_dir(self) -> int:
        """Swap files in each directory."""
        return len(self.files) // len(self.dirs)

    def footprint(self, nbytes: int) -> int:
        return round_up(nbytes)

    def mark_used(self, copy: NvmeCopy) -> None:
        """Claim a committed copy's extents when reopening (everything else is free space)."""
        for ext in copy.extents:
            f = self.files[ext.file]
            if ext.offset + ext.length > f.alloc.capacity:
                raise ValueError(f"extent {ext} lies past the end of {f.path} ({f.alloc.capacity} bytes)")
            f.alloc.mark_used(Extent(ext.offset, ext.length))
        self.used += copy.footprint

    async def allocate(self, nbytes: int) -> NvmeCopy:
        self.check_fits_budget(nbytes)
        need = self.footprint(nbytes)
        async with self._alloc_lock:  # the budget check and the charge must not interleave
            if not self.has_room(nbytes):
                raise CapacityError(
                    f"nvme tier: {nbytes} bytes do not fit ({self.used} of {self.budget} bytes in use); "
                    "raise nvme_bytes or delete entries"
                )
            extents: list[FileExtent] = []
            try:
                for d, piece in self._stripes(need):
                    extents.extend(await self._allocate_in_dir(d, piece))
            except BaseException:
                self._free_extents(extents)
                raise
            self.used += need
        return NvmeCopy(nbytes=nbytes, footprint=need, extents=extents, chunk=self._io.block_size)

    async def allocate_many(self, sizes: Sequence[int]) -> list[NvmeCopy]:
        """Space for several copies at once, all or none (CapacityError when together they do not fit).

        Copies of at most ``block_size`` bytes share one run of one directory, in order and back to
        back when a free range is large enough, so :meth:`store_many` and :meth:`load_many` move
        them with few syscalls; larger copies are striped as :meth:`allocate` does.
        """
        for n in sizes:
            self.check_fits_budget(n)
        needs = [self.footprint(n) for n in sizes]
        total = sum(needs)
        block = self._io.block_size
        async with self._alloc_lock:
            if self.budget is not None and self.used + total > self.budget:
                raise CapacityError(
                    f"nvme tier: {len(sizes)} tensors needing {total} bytes together do not fit ({self.used} of "
                    f"{self.budget} bytes in use); raise nvme_bytes, delete entries or put fewer at once"
                )
            placed: list[list[FileExtent]] = [[] for _ in sizes]
            taken: list[FileExtent] = []
            try:
                packed = [i for i, need in enumerate(needs) if 0 < need <= block]
                if packed:
                    d = self._next_dir
                    self._next_dir = (d + 1) % len(self.dirs)
                    run = await self._allocate_in_dir(d, sum(needs[i] for i in packed))
                    taken.extend(run)
                    for i, extents in zip(packed, nvme_batch.carve(run, [needs[i] for i in packed])):
                        placed[i] = extents
                for i, need in enumerate(needs):
                    if need > block:
                        for d, piece in self._stripes(need):
                            got = await self._allocate_in_dir(d, piece)
                            taken.extend(got)
                            placed[i].extend(got)
            except BaseException:
                self._free_extents(taken)
                raise
            self.used += total
        return [NvmeCopy(nbytes=n, footprint=need, extents=extents, chunk=block)
                for n, need, extents in zip(sizes, needs, placed)]

    def _stripes(self, need: int) -> Iterator[tuple[int, int]]:
        """Split ``need`` bytes into one aligned piece per directory, rotating the first directory."""
        n = len(self.dirs)
        first = self._next_dir
        self._next_dir = (self._next_dir + 1) % n
        if n == 1 or need <= self._io.block_size:
            yield first, need
            return
        piece = round_up(-(-need // n), ALIGNMENT)
        left = need
        for k in range(n):
            if left <= 0:
                break
            take = min(piece, left)
            yield (first + k) % n, take
            left -= take

    async def _allocate_in_dir(self, d: int, nbytes: int) -> list[FileExtent]:
        self._note_untouched()
        files = self.files[d * self.files_per_dir : (d + 1) * self.files_per_dir]
        start = self._next_file[d]
        self._next_file[d] = (start + 1) % len(files)
        order = files[start:] + files[:start]
        for contiguous in (True, False):
            for f in order:
                got = f.alloc.allocate(nbytes, contiguous=contiguous)
                if got is not None:
                    return _taken(f, got)
        f = min(order, key=lambda f: f.alloc.capacity)
        await self._grow(f, nbytes - (f.alloc.capacity - f.alloc.high_water()))
        got = f.alloc.allocate(nbytes, contiguous=False)
        assert got is not None
        return _taken(f, got)

    def _note_untouched(self) -> None:
        """Before the first allocation or free after the records were adopted: remember each file's
        free ranges as untouched."""
        for f in self.files:
            if f.untouched is None:
                f.untouched = UntouchedRanges(f.alloc.free_ranges())

    async def _grow(self, f: SwapFile, at_least: int) -> None:
        grow = max(self._grow_bytes, round_up(at_least))
        free_disk = _free_disk_bytes(os.path.dirname(f.path))
        if grow > free_disk:
            grow = round_up(at_least)
            if grow > free_disk:
                raise CapacityError(
                    f"nvme tier: {os.path.dirname(f.path)} has {free_disk} bytes free on disk but "
                    f"{grow} more are needed; free disk space, add nvme_paths or set nvme_bytes"
                )
        new_size = f.alloc.capacity + grow
        try:
            await self._io.run_sync(os.posix_fallocate, f.handle.fd, f.alloc.capacity, grow)
        except OSError as exc:
            raise CapacityError(
                f"nvme tier: growing {f.path} to {new_size} bytes failed: {exc}; free disk space or set nvme_bytes"
            ) from exc
        f.alloc.grow(new_size)

    def _free(self, copy: Copy) -> None:
        assert isinstance(copy, NvmeCopy)
        self._free_extents(copy.extents)
        self.used -= copy.footprint
        copy.extents = []

    def _free_extents(self, extents: Sequence[FileExtent]) -> None:
        self._note_untouched()
        for ext in extents:
            self.files[ext.file].alloc.free([Extent(ext.offset, ext.length)])

    def layout(self, copy: NvmeCopy) -> tuple[SwapExtent, ...]:
        """The copy's stored bytes, in order, as ranges of swap files (its extents, trimmed to ``nbytes``)."""
        pieces = []
        left = copy.nbytes
        for ext in copy.extents:
            take = min(ext.length, left)
            if take > 0:
                pieces.append(SwapExtent(self.files[ext.file].path, ext.offset, take))
            left -= take
        return tuple(pieces)

    def _chunks(self, copy: NvmeCopy) -> list[tuple[int, SwapFile, int, int, int]]:
        """``(index, file, file_offset, logical_start, length)`` per checksummed chunk.

        ``index`` is the chunk's place in the entry (its CRC's index). The list is interleaved
        across extents, so the blocks in flight at once spread over every striped directory (see
        [Note: swap files], [Note: data checksums]).
        """
        if len(copy.extents) == 1 and 0 < copy.nbytes <= copy.chunk:  # one small extent: one chunk
            ext = copy.extents[0]
            return [(0, self.files[ext.file], ext.offset, 0, copy.nbytes)]
        per_extent: list[list[tuple[int, SwapFile, int, int, int]]] = []
        pos = 0
        index = 0
        left = copy.nbytes
        for ext in copy.extents:
            in_ext = min(ext.length, left)
            chunks = []
            off = 0
            while off < in_ext:
                n = min(copy.chunk, in_ext - off)
                chunks.append((index, self.files[ext.file], ext.offset + off, pos, n))
                index += 1
                off += n
                pos += n
            per_extent.append(chunks)
            left -= in_ext
        return [c for group in itertools.zip_longest(*per_extent) for c in group if c is not None]

    async def store(self, copy: Copy, src: Sequence[Span]) -> None:
        assert isinstance(copy, NvmeCopy)
        if self._coalesces(copy):
            await self.writes.submit(copy, src)
        else:
            await self._store_one(copy, src)

    async def load(self, copy: Copy, dst: Sequence[Span]) -> None:
        assert isinstance(copy, NvmeCopy)
        if self._coalesces(copy):
            await self.reads.submit(copy, dst)
        else:
            await self.reads.go_first()  # small reads that came first go first: see [Note: coalescing]
            await self._load_one(copy, dst)

    def _in_place_alignment(self) -> Optional[int]:
        """What O_DIRECT needs of a buffer's address here; None when the files are not open for O_DIRECT."""
        return self.memory_alignment if self.direct else None

    def _in_place_views(self, spans: Sequence[Span], pos: int, n: int) -> Optional[list[memoryview]]:
        """iovecs moving logical bytes ``[pos, pos + n)`` of ``spans`` in place, or None to stage them."""
        alignment = self._in_place_alignment()
        return aligned_views(spans, pos, pos + n, ALIGNMENT, alignment) if alignment else None

    def _coalesces(self, copy: NvmeCopy) -> bool:
        return 0 < self.coalesce_bytes and copy.nbytes <= self.coalesce_bytes

    async def _store_one(self, copy: NvmeCopy, src: Sequence[Span]) -> None:
        blocks = []
        chunks = self._chunks(copy)
        for _, f, offset, pos, n in chunks:
            views = self._in_place_views(src, pos, n)
            if views is not None:
                blocks.append(BlockWrite(f.handle, offset, n, source=views))
            else:
                blocks.append(BlockWrite(f.handle, offset, n, fill=functools.partial(copy_out, src, pos)))
        results = await self._io.write(blocks)
        if self._io.checksum:
            crcs = [0] * len(chunks)
            for (index, *_), crc in zip(chunks, results):
                crcs[index] = crc  # type: ignore[assignment]
            copy.crcs = crcs
        else:
            copy.crcs = None

    async def _load_one(self, copy: NvmeCopy, dst: Sequence[Span]) -> None:
        blocks = []
        verify = copy.crcs is not None and self._io.checksum
        for index, f, offset, pos, n in self._chunks(copy):
            expected = copy.crcs[index] if verify else None  # type: ignore[index]
            views = self._in_place_views(dst, pos, n)
            if views is not None:
                blocks.append(BlockRead(f.handle, offset, n, dest=views, expected_crc=expected))
            else:
                drain = functools.partial(copy_in, dst, pos)
                blocks.append(BlockRead(f.handle, offset, n, drain=drain, expected_crc=expected))
        await self._io.read(blocks)

    async def store_many(
        self, copies: Sequence[NvmeCopy], srcs: Sequence[Sequence[Span]]
    ) -> list[Optional[BaseException]]:
        """:meth:`store` for several copies, coalescing chunks that lie back to back into one syscall.

        Sets each written copy's ``crcs``; returns each copy's error (None when it was written).
        """
        plans = [self._chunks(c) for c in copies]
        crcs, errors = await nvme_batch.store_many(self._io, self._in_place_alignment(), plans, srcs)
        for copy, c, error in zip(copies, crcs, errors):
            if error is None:
                copy.crcs = c
        return errors

    async def load_many(
        self, copies: Sequence[NvmeCopy], dsts: Sequence[Sequence[Span]]
    ) -> list[Optional[BaseException]]:
        """:meth:`load` for several copies, coalescing chunks that lie back to back into one syscall.

        Returns each copy's error (None when its bytes arrived intact).
        """
        plans = [self._chunks(c) for c in copies]
        expected = [c.crcs if c.crcs is not None and self._io.checksum else None for c in copies]
        return await nvme_batch.load_many(self._io, self._in_place_alignment(), plans, dsts, expected)

    def files_to_sync(self, copies: Sequence[NvmeCopy]) -> list[FileHandle]:
        """The swap files the copies' bytes lie in, each once: what must be flushed to make them durable."""
        return [self.files[i].handle for i in sorted({ext.file for c in copies for ext in c.extents})]

    def sync_file(self, handle: FileHandle) -> None:
        """Flush one swap file's data to stable storage, on the calling worker thread."""
        self._io.fdatasync_now(handle)

    async def sync_files(self, handles: Sequence[FileHandle]) -> None:
        """Flush several swap files' data to stable storage, in parallel on I/O threads."""
        await self._io.fdatasync(handles)

    async def give_back_free_space(self) -> None:
        """At a clean close: cut each swap file after its last byte in use and drop the stale bytes of
        the free ranges it has used (see [Note: free space at close] in tiered.backends.free_space).
        Only for a store with no transfer in flight and every record committed."""
        self._note_untouched()
        await asyncio.gather(*(self._io.run_sync(give_back, f.handle.fd, f.alloc.free_ranges(),
                                                 f.untouched.ranges(), f.alloc.capacity)  # type: ignore[union-attr]
                               for f in self.files))

    async def close(self) -> None:
        for f in self.files:
            f.handle.close()


def _taken(f: SwapFile, got: Sequence[Extent]) -> list[FileExtent]:
    """``got``, just allocated in ``f``, as file extents (and no longer untouched)."""
    for e in got:
        f.untouched.allocated(e.offset, e.length)  # type: ignore[union-attr]
    return [FileExtent(f.index, e.offset, e.length) for e in got]


def _free_disk_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
