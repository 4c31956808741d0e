# Device and host memory as the daemon holds it. Device memory is made by the backend in segments (memfds on
# the simulated one: mpsd.backends.memfd), each with an fd that IPC can pass over SCM_RIGHTS. A large allocation
# has a segment of its own; small ones (up to 1 MiB) are slices of their 2 MiB chunk's segment, so what a client
# holds in fds grows with its memory, never with how many small allocations it makes. Each client has its own
# device address space (Volta+ semantics), so the same address in two clients names different bytes.
# Segments and slices are reference counted because an IPC import maps one into several address spaces; the
# bytes live until the last mapping goes, and a freed slice that an importer still maps keeps its range of
# the chunk from being handed out again. Whoever is sent a small allocation's fd can map its whole chunk,
# the client's other small allocations included, as CUDA IPC shares a sub-allocation's whole block.
from __future__ import annotations

import fcntl
import functools
import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, Protocol, TypeVar

from mpsd.backends.base import DeviceMemory
from mpsd.backends.memfd import GIVE_BACK, close_map
from mpsd.backends.ops import Extent
from mpsd.runtime.sorted_ints import SortedInts
from mpsd_protocol import InvalidValueError

CHUNK = 2 << 20  # the driver's page: device memory is charged in 2 MiB steps
SMALL_MAX = 1 << 20  # allocations up to 1 MiB are packed into shared 2 MiB chunks at 512-byte granularity
SMALL_ALIGN = 512
# Small and large allocations live in separate address ranges, so the chunks small ones share never
# overlap a large one (real drivers interleave them; addresses are opaque to programs either way).
SMALL_BASE, SMALL_LIMIT = 0x7F00_0000_0000, 0x7F40_0000_0000
LARGE_BASE, LARGE_LIMIT = 0x7F40_0000_0000, 0x7FFF_FFE0_0000
_NOWHERE = 1 << 64  # above every address: "no such gap"
BATCH = 512  # entries of an index let go of in one unit of a teardown's work (emptied)


def emptied(table: dict[Any, Any]) -> Iterator[None]:
    """Empty `table` a batch of entries at a time, yielding after each: a client's teardown lets go of indexes
    of hundreds of thousands of entries, and freeing 300,000 allocations' entries at once took 14 ms
    (mpsd.runtime.teardown says why that matters)."""
    pop = table.popitem
    while table:
        for _ in range(min(len(table), BATCH)):
            pop()
        yield


class Slice:
    """A small allocation's bytes in its chunk's segment, counted as a segment of its own would be (the
    allocation and each IPC import of it); it holds one reference to the chunk's segment until its last."""

    __slots__ = ("chunk", "offset", "size", "refs", "on_release")

    def __init__(self, chunk: DeviceMemory, offset: int, size: int) -> None:
        self.chunk, self.offset, self.size = chunk, offset, size
        chunk.refs += 1
        self.refs = 1
        self.on_release: list = []

    @property
    def fd(self) -> int:
        return self.chunk.fd

    @property
    def map(self) -> mmap.mmap:
        # Read only where the backend has HOST_VIEW, whose memory is mapped in the daemon (a memfd's map);
        # DeviceMemory promises no map, as a real GPU's memory has none.
        return self.chunk.map  # type: ignore[attr-defined]

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            self.chunk.release()
            for callback in self.on_release:
                callback()

    def give_back(self) -> Iterator[None]:
        """Nothing first: a slice is 1 MiB at most, and its chunk 2 MiB (DeviceMemory.give_back)."""
        return iter(())


@dataclass(eq=False, slots=True)
class Allocation:
    """One mapping in a client's address space."""

    addr: int
    size: int  # bytes the user asked for: the bounds that kernels and copies are checked against
    span: int  # bytes of address space it occupies (size rounded up)
    segment: DeviceMemory | Slice
    imported: bool = False  # an IPC import: charged to its exporter, not to this client
    pool: bool = False  # a stream-ordered pool's reservation: the client sub-allocates it (mpsd.runtime.context)

    @property
    def end(self) -> int:
        return self.addr + self.size


class _Ranged(Protocol):
    """What an arena holds: a range of address space from `addr`, `span` bytes of it taken, `end` the first
    address past what may be addressed in it."""

    @property
    def addr(self) -> int: ...
    @property
    def span(self) -> int: ...
    @property
    def end(self) -> int: ...


_Entry = TypeVar("_Entry", bound=_Ranged)


class _Arena(Generic[_Entry]):
    """Allocations in one address range, by address, and the free gaps between them, for first-fit placement
    in O(log n): a malloc must not cost time linear in how many allocations its client has.

    The free space is kept as gaps: maximal free ranges, except that with `within` (the small arena's 2 MiB
    chunks) a gap never crosses a chunk boundary, so that a gap fits an allocation at its start whenever it
    is large enough. The one exception is the tail, the free range from above the highest allocation to the
    limit, which is kept apart: every other gap lies below it, so the lowest fit is the lowest gap that is
    large enough, or else the tail. To find that gap, gaps are bucketed by exact size (in `unit`s, which
    every address and span here is a multiple of), each bucket a sorted set of starts, and a segment tree
    over the sizes holds, for each range of sizes, the lowest start among its buckets: the lowest gap of at
    least a size is one walk from a leaf to the root. The tree is a dict, so only sizes that occur cost memory.
    """

    def __init__(self, base: int, limit: int, unit: int, within: int = 0) -> None:
        self.base, self.limit, self.unit, self.within = base, limit, unit, within
        self.starts = SortedInts()
        self.allocs: dict[int, _Entry] = {}
        self._gaps: dict[int, int] = {}  # start -> end of every gap but the tail
        self._gap_ends: dict[int, int] = {}  # end -> start, to merge a freed range with the gap below it
        self._tail = base  # [_tail, limit) is free, and nothing is allocated above it
        self._by_size: dict[int, SortedInts] = {}  # gap size in units -> the starts of the gaps of that size
        # Leaves are sizes 0 .. _leaves - 1 (node _leaves + size); a node holds the lowest start among the
        # gaps whose size lies under it, and is absent where there is none.
        self._leaves = 1 << ((within or limit - base) // unit).bit_length()
        self._tree: dict[int, int] = {}

    def fresh(self) -> _Arena[_Entry]:
        """An empty arena over the same range."""
        return _Arena(self.base, self.limit, self.unit, self.within)

    def emptied(self) -> Iterator[None]:
        """Let go of every entry of the indexes, a batch at a time (see `emptied`), for an arena no longer used."""
        yield from emptied(self.allocs)
        yield from self.starts.emptied()
        for table in (self._gaps, self._gap_ends, self._tree):
            yield from emptied(table)
        by_size = self._by_size
        while by_size:
            for _ in range(min(len(by_size), BATCH)):
                yield from by_size.popitem()[1].emptied()
            yield

    def place(self, span: int) -> int:
        """The lowest free address for `span` bytes (a multiple of the unit); with `within`, never
        straddling a `within`-byte boundary.

        Raises:
            MemoryError: nothing below the limit fits.
        """
        units = span // self.unit
        addr = _NOWHERE
        if units < self._leaves:
            node = units + self._leaves
            tree = self._tree
            addr = tree.get(node, _NOWHERE)
            while node > 1:
                if not node & 1:  # a left child: its right sibling holds larger sizes, which all fit
                    addr = min(addr, tree.get(node + 1, _NOWHERE))
                node >>= 1
        if addr != _NOWHERE:
            return addr
        addr = self._tail
        if self.within and addr // self.within != (addr + span - 1) // self.within:
            addr = -(-addr // self.within) * self.within
        if addr + span > self.limit:
            raise MemoryError("device address space exhausted")
        return addr

    def find(self, ptr: int) -> _Entry | None:
        start = self.starts.floor(ptr)
        if start is None:
            return None
        alloc = self.allocs[start]
        return alloc if ptr < alloc.end else None

    def insert(self, alloc: _Entry) -> None:
        """Map `alloc` at the address `place` gave for its span."""
        start, end = alloc.addr, alloc.addr + alloc.span
        if start >= self._tail:
            if start > self._tail:  # the tail's first chunk was too short: the rest of it becomes a gap
                self._add_gap(self._tail, start)
            self._tail = end
        else:
            gap_end = self._drop_gap(start)
            if end < gap_end:
                self._add_gap(end, gap_end)
        self.starts.add(alloc.addr)
        self.allocs[alloc.addr] = alloc

    def remove(self, addr: int) -> _Entry | None:
        alloc = self.allocs.pop(addr, None)
        if alloc is None:
            return None
        self.starts.remove(addr)
        start, end = addr, addr + alloc.span
        if not self._boundary(start) and start in self._gap_ends:
            start = self._gap_ends[start]
            self._drop_gap(start)
        if end == self._tail and not self._boundary(end):
            self._tail = start
            return alloc
        if not self._boundary(end) and end in self._gaps:
            end = self._drop_gap(end)
        self._add_gap(start, end)
        return alloc

    def _boundary(self, addr: int) -> bool:
        """Whether gaps must not be merged across `addr` (a chunk boundary of the small arena)."""
        return bool(self.within) and addr % self.within == 0

    def _add_gap(self, start: int, end: int) -> None:
        self._gaps[start] = end
        self._gap_ends[end] = start
        units = (end - start) // self.unit
        bucket = self._by_size.get(units)
        if bucket is None:
            bucket = self._by_size[units] = SortedInts()
        bucket.add(start)
        if bucket.first() == start:
            self._lowest_changed(units, start)

    def _drop_gap(self, start: int) -> int:
        end = self._gaps.pop(start)
        del self._gap_ends[end]
        units = (end - start) // self.unit
        bucket = self._by_size[units]
        bucket.remove(start)
        lowest = bucket.first()
        if lowest is None:
            del self._by_size[units]
            self._lowest_changed(units, _NOWHERE)
        elif lowest > start:
            self._lowest_changed(units, lowest)
        return end

    def _lowest_changed(self, units: int, lowest: int) -> None:
        """The lowest gap of `units` units now starts at `lowest` (_NOWHERE: there is none): update the path
        from its leaf to the root, as far as it changes anything."""
        tree = self._tree
        node = units + self._leaves
        while node and tree.get(node, _NOWHERE) != lowest:
            if lowest == _NOWHERE:
                del tree[node]
            else:
                tree[node] = lowest
            lowest = min(lowest, tree.get(node ^ 1, _NOWHERE))
            node >>= 1


@dataclass(eq=False, slots=True)
class _Chunk:
    """A 2 MiB chunk of small allocations: its segment, how many allocations live in it, and the freed ones
    an importer still maps (so that the chunk's going need not look through every client's held ranges)."""

    segment: DeviceMemory
    live: int = 0
    held: set[int] = field(default_factory=set)


class AddressSpace:
    """A client's device address space, and what its allocations are charged.

    As measured on an H200: allocations up to 1 MiB are packed at 512-byte granularity into 2 MiB chunks,
    and a chunk is charged while any allocation lives in it; larger ones are 2 MiB aligned and charged
    rounded up to 2 MiB. Freed memory is charged no more.
    """

    def __init__(self, allocate: Callable[[int], DeviceMemory], reserved: Any = None) -> None:
        self._allocate = allocate  # the backend's: device memory of a given size
        self._reserved = reserved  # the context's reserved ranges (mpsd.runtime.vmm), above LARGE_LIMIT
        self._small: _Arena[Allocation] = _Arena(SMALL_BASE, SMALL_LIMIT, SMALL_ALIGN, within=CHUNK)
        self._large: _Arena[Allocation] = _Arena(LARGE_BASE, LARGE_LIMIT, CHUNK)
        self._chunks: dict[int, _Chunk] = {}  # chunk index -> its segment and how many live in it
        # Freed small allocations an importer still maps: in _small, so their ranges stay taken, but not live.
        self._held: dict[int, Allocation] = {}

    def __len__(self) -> int:
        return len(self._small.allocs) - len(self._held) + len(self._large.allocs)

    def __iter__(self) -> Iterator[Allocation]:
        return iter([a for a in self._small.allocs.values() if a.addr not in self._held]
                    + list(self._large.allocs.values()))

    def plan(self, size: int) -> tuple[int, int, int]:
        """Where `size` bytes would go: (address, span, bytes newly charged).

        Raises:
            MemoryError: the address range is exhausted.
        """
        if size <= SMALL_MAX:
            span = -(-size // SMALL_ALIGN) * SMALL_ALIGN
            addr = self._small.place(span)
            return addr, span, 0 if addr // CHUNK in self._chunks else CHUNK
        span = -(-size // CHUNK) * CHUNK
        return self._large.place(span), span, span

    def map_import(self, segment: DeviceMemory | Slice, size: int) -> Allocation:
        """Map an IPC import (2 MiB aligned, as imports are): charged to nobody here."""
        span = -(-max(size, 1) // CHUNK) * CHUNK
        alloc = Allocation(self._large.place(span), size, span, segment, imported=True)
        self._large.insert(alloc)
        return alloc

    def allocate(self, addr: int, size: int, span: int, pool: bool = False) -> Allocation:
        """Back and map `size` bytes at the address `plan` gave: a slice of its chunk's segment (made with
        the chunk's first allocation) when small, a segment of its own when large.

        Raises:
            OSError: the memfd cannot be made or mapped (out of fds or of memory).
        """
        if span <= SMALL_MAX and addr < SMALL_LIMIT:
            index = addr // CHUNK
            chunk = self._chunks.get(index)
            if chunk is None:
                segment = self._allocate(CHUNK)
                segment.refs = 0  # held by the slices cut from it, one reference each
                chunk = self._chunks[index] = _Chunk(segment)
            alloc = Allocation(addr, size, span, Slice(chunk.segment, addr - index * CHUNK, size))
            self._small.insert(alloc)
            chunk.live += 1
        else:
            alloc = Allocation(addr, size, span, self._allocate(size), pool=pool)
            self._large.insert(alloc)
        return alloc

    def remove(self, addr: int) -> tuple[Allocation, int]:
        """Take out the allocation whose base is `addr`; returns it and the bytes no longer charged.

        A small one that an IPC importer still maps keeps its range of the chunk from being handed out
        again until the importer lets go (or the chunk itself goes), so the importer never sees bytes of a
        later allocation.

        Raises:
            InvalidValueError: `addr` is not the base of a live allocation.
        """
        if addr < SMALL_LIMIT:
            alloc = self.get(addr)
            if alloc is None:
                raise InvalidValueError(f"{addr:#x} is not the base of a live allocation in this context")
            index = addr // CHUNK
            chunk = self._chunks[index]
            chunk.live -= 1
            if chunk.live:
                if alloc.segment.refs > 1:
                    self._held[addr] = alloc
                    chunk.held.add(addr)
                    alloc.segment.on_release.append(functools.partial(self._let_go, chunk, alloc))
                else:
                    self._small.remove(addr)
                return alloc, 0
            # The chunk goes, and the ranges it held with it: a new chunk here gets a segment of its own.
            for held in chunk.held:
                del self._held[held]
                self._small.remove(held)
            self._small.remove(addr)
            del self._chunks[index]
            return alloc, CHUNK
        alloc = self._large.remove(addr)
        if alloc is None:
            raise InvalidValueError(f"{addr:#x} is not the base of a live allocation in this context")
        return alloc, 0 if alloc.imported else alloc.span

    def drain(self, drop: Callable[[Allocation, int], None]) -> Iterator[None]:
        """The client is gone: each live allocation goes, in the order `remove` would take them in a loop over
        the address space (small ones, then large, each oldest first), told to `drop` with the bytes no longer
        charged, as `remove` gives them; a unit of work per allocation and per batch of index entries let go,
        yielded between (mpsd.runtime.teardown paces them).

        The address space is empty from the first: nothing will be placed in it again, so its placement
        indexes are not kept up as allocations go (that upkeep cost more than the frees: 300,000 small
        allocations took 5 s to tear down, 3.9 s of it in the indexes), and an importer letting go of a freed
        small allocation meanwhile finds no chunk of it to give the range back to.
        """
        small, large, chunks, held = self._small, self._large, self._chunks, self._held
        self._small, self._large, self._chunks, self._held = small.fresh(), large.fresh(), {}, {}
        for arena in (small, large):
            allocs = arena.allocs
            for addr, alloc in allocs.items():
                if addr in held:
                    continue
                # It is freed now, not with the index; a new value is no change of size, which would stop the loop.
                allocs[addr] = None  # type: ignore[assignment]
                if arena is small:
                    chunk = chunks[addr // CHUNK]
                    chunk.live -= 1
                    drop(alloc, 0 if chunk.live else CHUNK)
                else:
                    yield from alloc.segment.give_back()  # (the last reference: a large one's pages take time)
                    drop(alloc, 0 if alloc.imported else alloc.span)
                yield
        yield from small.emptied()
        yield from large.emptied()
        yield from emptied(chunks)
        yield from emptied(held)

    def _let_go(self, chunk: _Chunk, alloc: Allocation) -> None:
        """The last importer of a freed small allocation let go: its range may be handed out again."""
        if self._chunks.get(alloc.addr // CHUNK) is chunk and self._held.get(alloc.addr) is alloc:
            del self._held[alloc.addr]
            chunk.held.discard(alloc.addr)
            self._small.remove(alloc.addr)

    def get(self, addr: int) -> Allocation | None:
        """The allocation whose base is exactly `addr`, if any."""
        if addr < SMALL_LIMIT:
            return self._small.allocs.get(addr) if addr not in self._held else None
        return self._large.allocs.get(addr)

    def find(self, ptr: int) -> Allocation | None:
        """The allocation containing address `ptr`, if any."""
        if ptr < SMALL_LIMIT:
            alloc = self._small.find(ptr)
            return self.get(alloc.addr) if alloc is not None else None
        return self._large.find(ptr)

    def extent(self, ptr: int, nbytes: int) -> Extent | None:
        """Where the bytes [ptr, ptr + nbytes) are, if they lie inside one allocation: the device memory that
        holds them (a small allocation's chunk) and their offset in it. None otherwise."""
        if not (isinstance(ptr, int) and isinstance(nbytes, int)):
            return None
        if ptr >= LARGE_LIMIT:
            return self._reserved.extent(ptr, nbytes) if self._reserved is not None else None
        alloc = self.find(ptr)
        if alloc is None or nbytes < 0 or ptr + nbytes > alloc.end:
            return None
        segment = alloc.segment
        memory = segment.chunk if isinstance(segment, Slice) else segment
        return Extent(memory, segment.offset + ptr - alloc.addr, nbytes)


class HostBuffer:
    """A client's pinned host buffer: its memfd, mapped here too, so copies never cross the socket; `pinned`
    is what the daemon's host RAM budget counts for it."""

    __slots__ = ("id", "size", "map", "pinned")

    def __init__(self, buffer_id: int, fd: int, size: int, pinned: int) -> None:
        # A client could shrink its file under our mapping and make us fault (SIGBUS): only memfds sealed
        # against shrinking are mapped.
        try:
            sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        except OSError:
            sealed = 0
        if not sealed:
            raise InvalidValueError("a host buffer must be a memfd sealed with F_SEAL_SHRINK")
        if os.fstat(fd).st_size < size:
            raise InvalidValueError(f"host buffer file holds fewer than {size} bytes")
        self.id = buffer_id
        self.size = size
        self.pinned = pinned
        self.map = mmap.mmap(fd, size)

    def give_back(self) -> Iterator[None]:
        """Drop the daemon's page table entries for the buffer GIVE_BACK bytes a step (the pages stay the
        client's), so that unmapping it, which takes about 25 ms a GiB of them, is one short step after."""
        for offset in range(0, self.size, GIVE_BACK):
            self.map.madvise(mmap.MADV_DONTNEED, offset, min(GIVE_BACK, self.size - offset))
            yield

    def view(self, offset: int, nbytes: int) -> memoryview | None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            return None
        return memoryview(self.map)[offset:offset + nbytes]

    def close(self) -> None:
        close_map(self.map)
