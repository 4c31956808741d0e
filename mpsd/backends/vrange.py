# The host side of a reserved device address range on the simulated backend: one host mapping of the whole
# range, inaccessible (PROT_NONE, no memory committed) until physical memory is mapped into it, where each piece
# of physical memory (a memfd segment, mpsd.backends.memfd) is mapped over its place with MAP_FIXED. So the bytes
# of consecutive pieces are consecutive here, and a kernel or copy sees one buffer across them, as a GPU's
# virtual memory shows one range; the same memfd can be mapped at two places and show the same bytes, and its
# bytes outlive an unmapping, as cuMemCreate's do. Python's mmap cannot map at a fixed address, so this calls
# libc's mmap. The range knows which pages are mapped, so that it never hands out a view of an unmapped one:
# touching one would be a fault of the daemon, where on a GPU it is the kernel's illegal address.
"""A reserved address range whose pages memfds are mapped into."""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

__all__ = ["VirtualRange"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED, _MAP_NORESERVE = 0x10, getattr(mmap, "MAP_NORESERVE", 0x4000)
_NONE = (mmap.PROT_NONE if hasattr(mmap, "PROT_NONE") else 0,
         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
PAGE = 2 << 20  # the device's mapping granularity, which every offset and size here is a multiple of


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int, offset: int) -> int:
    result = _libc.mmap(addr, size, prot, flags, fd, offset)
    if result is None or result == _MAP_FAILED:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return int(result)


class VirtualRange:
    """`size` bytes of host address space standing for a device reservation."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.base = _mmap(None, size, _NONE[0], _NONE[1], -1, 0)
        self.mapped: dict[int, tuple[Any, int]] = {}  # index of each page that shows memory -> (memory, offset)
        self.closed = False

    def map(self, offset: int, memory: Any, memory_offset: int, nbytes: int) -> None:
        """Show `nbytes` of `memory` (a memfd segment) from `memory_offset` at `offset`."""
        _mmap(self.base + offset, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED,
              memory.fd, memory.offset + memory_offset)
        for page in range(offset // PAGE, (offset + nbytes) // PAGE):
            self.mapped[page] = (memory, memory_offset + page * PAGE - offset)

    def unmap(self, offset: int, nbytes: int) -> None:
        """Make [offset, offset + nbytes) inaccessible again (the memfds keep their bytes)."""
        _mmap(self.base + offset, nbytes, _NONE[0], _NONE[1] | _MAP_FIXED, -1, 0)
        for page in range(offset // PAGE, (offset + nbytes) // PAGE):
            self.mapped.pop(page, None)

    def view(self, offset: int, nbytes: int) -> memoryview | None:
        """The bytes [offset, offset + nbytes), or None if a page of them is not mapped (or the range is gone)."""
        if self.closed or offset < 0 or offset + nbytes > self.size:
            return None
        if nbytes and any(page not in self.mapped for page in range(offset // PAGE, (offset + nbytes - 1) // PAGE + 1)):
            return None
        if not nbytes:
            return memoryview(b"")
        return memoryview((ctypes.c_char * nbytes).from_address(self.base + offset)).cast("B")

    def pieces(self, offset: int, nbytes: int) -> list[tuple[Any, int, int]]:
        """The memory behind [offset, offset + nbytes), as (memory, its offset, bytes) runs: what the host RAM
        budget counts (mpsd.backends.hostmem). Unmapped pages are left out."""
        out: list[tuple[Any, int, int]] = []
        end = offset + nbytes
        pos = offset
        while pos < end:
            page = pos // PAGE
            stop = min(end, (page + 1) * PAGE)
            found = self.mapped.get(page)
            if found is not None:
                memory, start = found[0], found[1] + pos - page * PAGE
                if out and out[-1][0] is memory and out[-1][1] + out[-1][2] == start:
                    out[-1] = (memory, out[-1][1], out[-1][2] + stop - pos)
                else:
                    out.append((memory, start, stop - pos))
            pos = stop
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.mapped.clear()
            _libc.munmap(self.base, self.size)
