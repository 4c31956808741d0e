# Device and host memory as the daemon holds it. Device memory is one memfd segment per allocation: sparse
# (a 141 GB device costs no RAM until touched), nameless (nothing to leak on SIGKILL), and passable over
# SCM_RIGHTS when IPC needs it. Each client has its own device address space (Volta+ semantics), so the same
# address in two clients names different bytes. Segments are reference counted because later an IPC import
# maps one segment into several address spaces; the bytes live until the last mapping goes.
from __future__ import annotations

import bisect
import mmap
import os
from dataclasses import dataclass

from mpsd_protocol import InvalidValueError  # type: ignore[attr-defined]

VA_BASE = 0x7F00_0000_0000  # where device addresses start, as they do under a real driver
VA_LIMIT = 0x7FFF_FFFF_0000
SMALL_ALIGN = 512  # cudaMalloc returns at least 256-byte aligned pointers; we round sizes to 512 bytes
LARGE_ALIGN = 2 << 20  # and place allocations of 2 MiB or more on 2 MiB boundaries, as the driver does


class Segment:
    """A memfd of `size` bytes mapped in the daemon; freed when the last reference is dropped."""

    __slots__ = ("fd", "size", "map", "refs")

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("mpsd-device", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self.size = size
        self.refs = 1

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            _close_map(self.map)
            os.close(self.fd)


@dataclass(eq=False, slots=True)
class Allocation:
    """One mapping in a client's address space."""

    addr: int
    size: int  # bytes the user asked for: the bounds that kernels and copies are checked against
    span: int  # bytes of address space it occupies (size rounded up)
    segment: Segment
    accounted: int  # bytes charged to the device for it (0 for an imported mapping)

    @property
    def end(self) -> int:
        return self.addr + self.size


class AddressSpace:
    """A client's device address space: allocations by address, with first-fit placement."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._allocs: dict[int, Allocation] = {}

    def __len__(self) -> int:
        return len(self._allocs)

    def __iter__(self):
        return iter(list(self._allocs.values()))

    def place(self, size: int) -> tuple[int, int]:
        """A free (address, span) for `size` bytes: the lowest gap that fits, aligned."""
        align = LARGE_ALIGN if size >= LARGE_ALIGN else SMALL_ALIGN
        span = -(-size // align) * align
        cursor = VA_BASE
        for start in self._starts:
            if start - cursor >= span:
                break
            alloc = self._allocs[start]
            cursor = -(-(alloc.addr + alloc.span) // align) * align
        if cursor + span > VA_LIMIT:
            raise MemoryError("device address space exhausted")
        return cursor, span

    def insert(self, alloc: Allocation) -> None:
        bisect.insort(self._starts, alloc.addr)
        self._allocs[alloc.addr] = alloc

    def remove(self, addr: int) -> Allocation:
        """Take out the allocation whose base is `addr`.

        Raises:
            InvalidValueError: `addr` is not the base of a live allocation.
        """
        alloc = self._allocs.pop(addr, None)
        if alloc is None:
            raise InvalidValueError(f"{addr:#x} is not the base of a live allocation in this context")
        del self._starts[bisect.bisect_left(self._starts, addr)]
        return alloc

    def get(self, addr: int) -> Allocation | None:
        """The allocation whose base is exactly `addr`, if any."""
        return self._allocs.get(addr)

    def find(self, ptr: int) -> Allocation | None:
        """The allocation containing address `ptr`, if any."""
        index = bisect.bisect_right(self._starts, ptr) - 1
        if index < 0:
            return None
        alloc = self._allocs[self._starts[index]]
        return alloc if ptr < alloc.end else None

    def view(self, ptr: int, nbytes: int) -> memoryview | None:
        """The bytes [ptr, ptr + nbytes) if they lie inside one allocation, else None."""
        alloc = self.find(ptr)
        if alloc is None or nbytes < 0 or ptr + nbytes > alloc.end:
            return None
        offset = ptr - alloc.addr
        return memoryview(alloc.segment.map)[offset:offset + nbytes]

    def clear(self) -> list[Allocation]:
        allocs = list(self._allocs.values())
        self._allocs.clear()
        self._starts.clear()
        return allocs


class HostBuffer:
    """A client's pinned host buffer: its memfd, mapped here too, so copies never cross the socket."""

    __slots__ = ("id", "size", "map")

    def __init__(self, buffer_id: int, fd: int, size: int) -> None:
        if os.fstat(fd).st_size < size:
            raise InvalidValueError(f"host buffer file holds fewer than {size} bytes")
        self.id = buffer_id
        self.size = size
        self.map = mmap.mmap(fd, size)

    def view(self, offset: int, nbytes: int) -> memoryview | None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            return None
        return memoryview(self.map)[offset:offset + nbytes]

    def close(self) -> None:
        _close_map(self.map)


def _close_map(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # a view is still alive somewhere; the mapping goes when it does
