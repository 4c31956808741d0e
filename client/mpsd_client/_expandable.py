# PyTorch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), as its caching allocator's
# source has them (c10/cuda/CUDACachingAllocator.cpp, ExpandableSegment and the blocks around it): instead of a
# new cudaMalloc for each segment, one segment per stream and pool reserves address space for 1 1/8 of the
# device's memory and maps physical pages at its end as it grows: 2 MiB pages for the small pool, 20 MiB for the
# large (its two buffer sizes), one cuMemCreate and cuMemMap per page. The unmapped rest of the range is kept as
# blocks that are not mapped: a free block that reaches an unmapped one can grow into it. Freeing cached memory
# (empty_cache, or before a retry) unmaps the whole pages of every free block, wherever it lies, after
# synchronising the segment's stream, and gives the range back once nothing of it is mapped.
#
# `ExpandableSegment` is the part facing the device (mpsd's driver calls: Context.mem_address_reserve and the
# rest); `ExpandableRules` is the caching allocator's side, mixed into CachingAllocator: finding a segment to grow,
# mapping and unmapping blocks, and the figures: each map adds to reserved_bytes and counts one num_device_alloc,
# each unmap one num_device_free, and, as in PyTorch, the "segment" and "inactive_split" figures leave
# expandable segments out.
"""Expandable segments: one growing segment per stream and pool."""

from __future__ import annotations

import bisect
from typing import Any

from mpsd_protocol import OutOfMemoryError

from ._figures import LARGE_BUFFER, SMALL_BUFFER  # the pools' buffers are its segments' page sizes

__all__ = ["ExpandableSegment", "ExpandableRules"]


class ExpandableSegment:
    """A reserved range whose pages of `page` bytes are mapped on demand, for one stream's blocks of one pool."""

    def __init__(self, ctx: Any, stream: Any, page: int, total_memory: int) -> None:
        self.ctx, self.stream, self.page = ctx, stream, page
        self.size = -(-(total_memory + total_memory // 8) // page) * page  # PyTorch's 1 1/8 of the device
        self.ptr = int(ctx.mem_address_reserve(self.size))
        self.handles: dict[int, int] = {}  # page index -> its physical memory's handle
        self.head: Any = None  # the first of its blocks, mapped or not

    def map(self, ptr: int, size: int) -> int:
        """Map the pages that cover [ptr, ptr + size) (`ptr` starts a page); the bytes mapped, 0 if the device
        has no room for them (then nothing is)."""
        begin, end = (ptr - self.ptr) // self.page, -(-(ptr + size - self.ptr) // self.page)
        made: list[int] = []
        try:
            for _ in range(begin, end):
                made.append(int(self.ctx.mem_create(self.page)))
        except OutOfMemoryError:
            for handle in made:
                self.ctx.mem_release(handle)
            return 0
        for index, handle in zip(range(begin, end), made):
            self.ctx.mem_map(self.ptr + index * self.page, self.page, 0, handle)
            self.handles[index] = handle
        return (end - begin) * self.page

    def unmap(self, ptr: int, size: int) -> tuple[int, int]:
        """Unmap the whole pages inside [ptr, ptr + size), once the stream's work is done (cuMemUnmap does
        not wait for it); (first address, bytes) unmapped."""
        begin, end = -(-(ptr - self.ptr) // self.page), (ptr + size - self.ptr) // self.page
        if begin >= end:
            return self.ptr + begin * self.page, 0
        # PyTorch synchronises the segment's stream (the device, for the default stream or a bare handle)
        synchronize = getattr(self.stream, "synchronize", None) or self.ctx.synchronize
        synchronize()
        for index in range(begin, end):
            self.ctx.mem_unmap(self.ptr + index * self.page, self.page)
            self.ctx.mem_release(self.handles.pop(index))
        return self.ptr + begin * self.page, (end - begin) * self.page

    def close(self) -> None:
        self.ctx.mem_address_free(self.ptr, self.size)


class Unmapped:
    """A pool's blocks that are not mapped, in (stream, address) order, as PyTorch's `unmapped` set."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], Any] = {}

    def add(self, block: Any) -> None:
        bisect.insort(self.keys, (block.stream, block.ptr))
        self.blocks[block.stream, block.ptr] = block

    def remove(self, block: Any) -> None:
        del self.keys[bisect.bisect_left(self.keys, (block.stream, block.ptr))]
        del self.blocks[block.stream, block.ptr]

    def of_stream(self, stream: int) -> list[Any]:
        index = bisect.bisect_left(self.keys, (stream, 0))
        out = []
        while index < len(self.keys) and self.keys[index][0] == stream:
            out.append(self.blocks[self.keys[index]])
            index += 1
        return out


def _allocatable(block: Any) -> bool:
    return block is not None and not block.allocated and not block.event_count


def expandable_size(block: Any) -> int:
    """What a free block could hold for best fit: its size and the unmapped block after it (PyTorch counts a
    segment's growing end as that large, so best fit prefers blocks that cannot grow)."""
    following = block.next
    size: int = block.size + (following.size if following is not None and not following.mapped else 0)
    return size


class ExpandableRules:
    """The caching allocator's side of expandable segments (mixed into CachingAllocator, whose blocks, pools
    and figures it uses)."""

    # The allocator's: its context, segments, pools, block class and search counts, and its _merge (of free
    # neighbours) and _mapped (the figures and history of a map or unmap).
    ctx: Any
    _expandables: list[ExpandableSegment]
    _pools: dict[bool, Any]
    _block: Any
    _gc_calls: dict[bool, int]
    _merge: Any
    _mapped: Any

    def _grow(self, small: bool, stream_key: int, stream: Any, size: int) -> Any:
        """A mapped free block of at least `size` at the end of the stream's segment, mapping pages for it
        (a new segment if none can grow); None when the device has no room."""
        candidate = self._expandable_block(small, stream_key, stream, size)
        if candidate is None:
            return None
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # a free block, then unmapped ones: map what is missing, merging
            following = candidate.next
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        self._pools[small].remove(candidate)
        return candidate

    def _expandable_block(self, small: bool, stream_key: int, stream: Any, size: int) -> Any:
        """The lowest unmapped block of the stream's segments (or the free block before it) with room for
        `size` behind it; else the whole range of a new segment."""
        pool = self._pools[small]
        for block in pool.unmapped.of_stream(stream_key):
            if _allocatable(block.prev):
                block = block.prev
            room, walk = 0, block
            while room < size and _allocatable(walk):
                room += walk.size
                walk = walk.next
            if room >= size:
                return block
        try:
            segment = ExpandableSegment(self.ctx, stream, SMALL_BUFFER if small else LARGE_BUFFER,
                                        self.ctx.mem_get_info()[1])
        except OutOfMemoryError:
            return None  # no address space left
        block = self._block(stream_key, segment.size, segment.ptr, small, mapped=False, segment=segment)
        segment.head = block
        self._expandables.append(segment)
        pool.unmapped.add(block)
        return block

    def _map_block(self, block: Any, size: int) -> bool:
        """Map the pages for the first `size` bytes of the unmapped `block`; it becomes a free mapped block
        (the rest stays unmapped), merged with a free neighbour."""
        segment = block.segment
        mapped = segment.map(block.ptr, size)
        if not mapped:
            return False
        pool = self._pools[block.small]
        pool.unmapped.remove(block)
        block.mapped = True
        if mapped < block.size:
            rest = self._block(block.stream, block.size - mapped, block.ptr + mapped, block.small, mapped=False,
                               segment=segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.unmapped.add(rest)
            block.size = mapped
        ptr = block.ptr
        self._merge(block, block.prev)
        self._merge(block, block.next)
        pool.insert(block, self._gc_calls[block.small])
        self._mapped(block.small, block.stream, ptr, mapped, up=True)
        return True

    def _unmap_block(self, block: Any) -> None:
        """Unmap the whole pages of the free mapped `block`; what is left of it at either end stays free."""
        segment = block.segment
        start, unmapped = segment.unmap(block.ptr, block.size)
        if not unmapped:
            return
        pool = self._pools[block.small]
        pool.remove(block)
        before = start - block.ptr
        if before > 0:
            front = self._block(block.stream, before, block.ptr, block.small, segment=segment, prev=block.prev,
                                next=block)
            if block.prev is not None:
                block.prev.next = front
            else:
                segment.head = front
            block.prev = front
            pool.insert(front, self._gc_calls[block.small])
        after = block.size - before - unmapped
        if after > 0:
            back = self._block(block.stream, after, start + unmapped, block.small, segment=segment, prev=block,
                               next=block.next)
            if block.next is not None:
                block.next.prev = back
            block.next = back
            pool.insert(back, self._gc_calls[block.small])
        block.ptr, block.size, block.mapped = start, unmapped, False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        pool.unmapped.add(block)
        self._mapped(block.small, block.stream, start, unmapped, up=False)
        if block.prev is None and block.next is None:  # nothing of the segment is mapped: its range goes
            pool.unmapped.remove(block)
            self._expandables.remove(segment)
            segment.close()

    def _expandable_runs(self) -> list[list[Any]]:
        """Each segment's runs of mapped blocks: what memory_snapshot shows as one segment each."""
        runs: list[list[Any]] = []
        run: list[Any] | None
        for segment in self._expandables:
            block, run = segment.head, None  # (run: the run being built, or None between runs)
            while block is not None:
                if block.mapped:
                    if run is None:
                        run = []
                        runs.append(run)
                    run.append(block)
                else:
                    run = None
                block = block.next
        return runs
