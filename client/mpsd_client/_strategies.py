# The two answers to fragmentation that the seed article (section 2.5) sets beside PyTorch's rules, with
# CachingAllocator's calls and statistics so that one trace can be run through each and their figures compared
# (CachingAllocator(ctx, strategy="buddy" | "slab") builds them). `_SegmentAllocator` is the part facing the
# device, shared by both: segments from ctx.malloc, the empty-the-cache-then-retry on a failed device
# allocation, PyTorch's OutOfMemoryError, the statistics and the snapshot. A strategy decides only how a segment
# is cut: its `_round`, `_segment_size`, `_take` and `_give`. Each segment serves one stream, as PyTorch's do, so
# no block is reused by another stream's work while the first may still use it; record_stream's rule is
# PyTorch's (mpsd_client._stream_uses): a block freed while other streams may use it waits for their events.
"""Buddy and slab allocators, with the caching allocator's calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpsd_protocol import OutOfMemoryError

from ._figures import (MIN_BLOCK, POOLS, SMALL_BUFFER, SMALL_SIZE, STATS, _Figures, _oom_message, _power2_division,
                       _Stat, _stream, fragmentation)
from ._caching_report import summary
from ._stream_uses import PendingFrees

__all__ = ["BuddyAllocator", "SlabAllocator", "STRATEGIES"]

LARGE_ARENA = 64 << 20  # a buddy arena for large requests is at least this, so that several share one
LARGE_SLAB = 20 << 20  # slots of large classes below 10 MiB are packed in slabs of about this (PyTorch's buffer)
MIN_LARGE_SLAB = 10 << 20
SLAB_DIVISIONS = 4  # size classes per power of two: at most 25% of a slot goes unused, 12.5% on average


@dataclass(eq=False)
class _Segment:
    base: int
    size: int
    stream: int
    small: bool
    slot: int = 0  # a slab's size class (0 for a buddy arena)
    free: dict[int, int] = field(default_factory=dict)  # offset -> size of each free block
    live: dict[int, int] = field(default_factory=dict)  # offset -> requested bytes of each allocated block
    sizes: dict[int, int] = field(default_factory=dict)  # offset -> size of each allocated block
    uses: dict[int, dict[int, Any]] = field(default_factory=dict)  # offset -> record_stream's streams, by key
    pending: dict[int, _Held] = field(default_factory=dict)  # offset -> a freed block waiting for streams

    def split_free(self) -> tuple[int, int]:
        """Its free blocks as PyTorch counts "inactive_split": those of a segment that is not wholly free."""
        return (len(self.free), sum(self.free.values())) if self.live or self.pending else (0, 0)


@dataclass(eq=False)
class _Held:
    """A block freed under record_stream: neither allocated nor free until its streams' events complete."""

    segment: _Segment
    offset: int
    size: int
    requested: int
    event_count: int = 0


class _SegmentAllocator(_Figures):
    """What both strategies share: segments of device memory, the cache's statistics and its snapshot.

    Args:
        ctx: a blocking `Context` (its malloc, free, synchronize and mem_get_info are the device's).
    """

    strategy = ""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.allowed: int | None = None  # set_per_process_memory_fraction's bytes, if set
        self._segments: dict[int, _Segment] = {}  # base address -> segment
        self._owner: dict[int, tuple[_Segment, int]] = {}  # address of each allocated block -> its segment, offset
        self._stats = {name: {pool: _Stat() for pool in POOLS} for name in STATS}
        self._oversize = {"oversize_allocations": _Stat(), "oversize_segments": _Stat()}  # none: no max_split
        self._counts = {"num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0, "num_device_alloc": 0,
                        "num_device_free": 0}
        self._pending = PendingFrees(ctx)

    # -- what a strategy decides ---------------------------------------------------------------------------
    def _round(self, nbytes: int) -> int:
        raise NotImplementedError

    def _segment_size(self, size: int) -> tuple[int, int]:
        """The bytes of a new segment for a block of `size`, and its slot size (0 if it has none)."""
        raise NotImplementedError

    def _take(self, segment: _Segment, size: int) -> int | None:
        """Take a free block of `size` from `segment` (splitting as the strategy splits); its offset."""
        raise NotImplementedError

    def _give(self, segment: _Segment, offset: int, size: int) -> None:
        """Return the block at `offset` to `segment`'s free blocks (merging as the strategy merges)."""
        raise NotImplementedError

    def _fits(self, segment: _Segment, size: int) -> bool:
        raise NotImplementedError

    # -- the allocator -------------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: Any = None) -> int:
        """An allocation of `nbytes` for use on `stream` (None: the default stream); its address.

        Raises:
            OutOfMemoryError: the device has no room even after the cache was emptied, with PyTorch's message.
        """
        self._pending.process(self._returned)
        size = self._round(nbytes)
        key = _stream(stream)
        segment = self._cached(key, size)
        if segment is None:
            segment = self._new_segment(key, size, retry=False)
        if segment is None:
            self._release_cached()
            segment = self._new_segment(key, size, retry=True)
        if segment is None:
            self._counts["num_ooms"] += 1
            raise OutOfMemoryError(_oom_message(self.ctx, size, self.memory_allocated(), self.memory_reserved(),
                                                self.allowed))
        before = segment.split_free()
        offset = self._take(segment, size)
        assert offset is not None
        segment.live[offset], segment.sizes[offset] = nbytes, size
        self._owner[segment.base + offset] = (segment, offset)
        self._moved(segment, before)
        for name, amount in (("allocation", 1), ("allocated_bytes", size), ("active", 1), ("active_bytes", size),
                             ("requested_bytes", nbytes)):
            self._up(name, segment.small, amount)
        return segment.base + offset

    def free(self, ptr: int) -> None:
        """Give an allocation back to the cache (its memory stays reserved until empty_cache()).

        Raises:
            ValueError: `ptr` is not a live allocation of this allocator.
        """
        owner = self._owner.pop(int(ptr), None)
        if owner is None:
            raise ValueError(f"{int(ptr):#x} was not allocated by this allocator, or was freed already")
        segment, offset = owner
        nbytes, size = segment.live.pop(offset), segment.sizes.pop(offset)
        for name, amount in (("allocation", 1), ("allocated_bytes", size)):
            self._down(name, segment.small, amount)
        held = segment.pending[offset] = _Held(segment, offset, size, nbytes)  # active, no longer allocated
        streams = segment.uses.pop(offset, None)
        if streams:
            self._pending.hold(held, streams)
        else:
            self._returned(held)

    def record_stream(self, ptr: int, stream: Any) -> None:
        """Mark the allocation at `ptr` as used by work on `stream` too (torch.Tensor.record_stream): when it is
        freed, its block is not reused before the work queued on `stream` until then has completed.

        Raises:
            ValueError: `ptr` is not a live allocation of this allocator.
        """
        owner = self._owner.get(int(ptr))
        if owner is None:
            raise ValueError(f"{int(ptr):#x} is not a live allocation of this allocator")
        segment, offset = owner
        key = _stream(stream)
        if key != segment.stream:  # its own stream orders its reuse already
            segment.uses.setdefault(offset, {})[key] = stream

    def _returned(self, held: _Held) -> None:
        """A freed block no stream uses any more goes back to its segment's free blocks."""
        segment = held.segment
        before = segment.split_free()
        del segment.pending[held.offset]
        self._give(segment, held.offset, held.size)
        self._moved(segment, before)
        for name, amount in (("active", 1), ("active_bytes", held.size), ("requested_bytes", held.requested)):
            self._down(name, segment.small, amount)

    def empty_cache(self) -> None:
        """Give every wholly free segment back to the device (after waiting for the device's work)."""
        self._release_cached()

    def set_per_process_memory_fraction(self, fraction: float) -> None:
        """Cap what this allocator may reserve at `fraction` of the device's memory.

        Raises:
            ValueError: `fraction` is not between 0 and 1.
        """
        if not 0 <= fraction <= 1:
            raise ValueError(f"invalid fraction {fraction}: it must be between 0 and 1")
        self.allowed = int(fraction * self.ctx.mem_get_info()[1])

    # -- statistics ----------------------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, float]:
        """torch.cuda.memory_stats()'s keys (inactive_split: the free blocks of segments in use; no oversize
        blocks, as there is no max_split_size) and mpsd's ``fragmentation.*`` figures."""
        out = self._torch_figures()
        out["max_split_size"] = -1
        free = [size for segment in self._segments.values() for size in segment.free.values()]
        out.update(fragmentation(free, int(out["requested_bytes.all.current"]),
                                 int(out["allocated_bytes.all.current"])))
        return dict(sorted(out.items()))

    def memory_summary(self, device: int = 0, abbreviated: bool = False) -> str:
        """torch.cuda.memory_summary()'s table of memory_stats()."""
        return summary(self.memory_stats(), device, abbreviated)

    def memory_snapshot(self) -> list[dict[str, Any]]:
        """The segments and their blocks, in address order, in torch.cuda.memory_snapshot()'s shape."""
        out = []
        for base in sorted(self._segments):
            segment = self._segments[base]
            blocks: list[dict[str, Any]]
            blocks = sorted([{"address": base + offset, "size": segment.sizes[offset], "requested_size": asked,
                              "state": "active_allocated", "frames": []} for offset, asked in segment.live.items()]
                            + [{"address": base + offset, "size": held.size, "requested_size": held.requested,
                                "state": "active_pending_free", "frames": []}
                               for offset, held in segment.pending.items()]
                            + [{"address": base + offset, "size": size, "requested_size": 0, "state": "inactive",
                                "frames": []} for offset, size in segment.free.items()],
                            key=lambda b: b["address"])
            allocated = sum(segment.sizes.values())
            waiting = sum(held.size for held in segment.pending.values())
            out.append({"device": 0, "address": base, "total_size": segment.size, "allocated_size": allocated,
                        "active_size": allocated + waiting,
                        "requested_size": (sum(segment.live.values())
                                           + sum(h.requested for h in segment.pending.values())),
                        "stream": segment.stream, "segment_type": "small" if segment.small else "large",
                        "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks})
        return out

    # -- inside --------------------------------------------------------------------------------------------
    def _cached(self, stream: int, size: int) -> _Segment | None:
        """The stream's segment to cut `size` from: the one whose fitting free block is smallest (best fit),
        the lowest address among equals."""
        best: tuple[int, int] | None = None
        found = None
        for base, segment in self._segments.items():
            if segment.stream == stream and self._fits(segment, size):
                fit = min(s for s in segment.free.values() if s >= size)
                if best is None or (fit, base) < best:
                    best, found = (fit, base), segment
        return found

    def _new_segment(self, stream: int, size: int, retry: bool) -> _Segment | None:
        nbytes, slot = self._segment_size(size)
        if retry:
            self._counts["num_alloc_retries"] += 1
        if self.allowed is not None and self.memory_reserved() + nbytes > self.allowed:
            return None  # past the process's fraction: as if the device had no room
        try:
            base = int(self.ctx.malloc(nbytes))
        except OutOfMemoryError:
            return None
        segment = _Segment(base, nbytes, stream, size <= SMALL_SIZE, slot)
        segment.free = {offset: slot for offset in range(0, nbytes, slot)} if slot else {0: nbytes}
        self._segments[base] = segment
        self._counts["num_device_alloc"] += 1
        self._up("segment", segment.small, 1)
        self._up("reserved_bytes", segment.small, nbytes)
        return segment

    def _release_cached(self) -> None:
        self._pending.synchronize(self._returned)
        self.ctx.synchronize()
        self._counts["num_sync_all_streams"] += 1
        for base, segment in list(self._segments.items()):
            if not segment.live:
                del self._segments[base]
                self.ctx.free(base)
                self._counts["num_device_free"] += 1
                self._down("segment", segment.small, 1)
                self._down("reserved_bytes", segment.small, segment.size)

    def _moved(self, segment: _Segment, before: tuple[int, int]) -> None:
        """inactive_split's figures follow the segment's change from `before`."""
        after = segment.split_free()
        for name, old, new in (("inactive_split", before[0], after[0]),
                               ("inactive_split_bytes", before[1], after[1])):
            if new > old:
                self._up(name, segment.small, new - old)
            elif new < old:
                self._down(name, segment.small, old - new)

    def _up(self, name: str, small: bool, amount: int) -> None:
        self._stats[name]["all"].up(amount)
        self._stats[name]["small_pool" if small else "large_pool"].up(amount)

    def _down(self, name: str, small: bool, amount: int) -> None:
        self._stats[name]["all"].down(amount)
        self._stats[name]["small_pool" if small else "large_pool"].down(amount)


class BuddyAllocator(_SegmentAllocator):
    """A binary buddy allocator: every block is a power of two, at an offset in its arena that is a multiple of
    its size, so a block's buddy is found by flipping one bit of its offset and merging needs no search.

    Splitting: a request rounds up to the next power of two (at least 512 bytes); the smallest free block that
    holds it is halved, again and again, each upper half staying free, until a half is the request's size.
    Merging: a freed block whose buddy is free, and the same size, joins it into the block they were halved
    from, repeatedly up to the whole arena. So free memory never stays cut into pieces that could be whole
    again (external fragmentation is bounded), at the price of rounding: a request just over a power of two
    takes nearly twice its size (internal fragmentation up to one half).

    Args:
        ctx: a blocking `Context`.
        arena: the bytes of each arena (a power of two); by default 2 MiB for requests up to 1 MiB and
            64 MiB or the request's power of two, whichever is larger, for others. A request larger than
            `arena` gets an arena of its own size.

    Raises:
        ValueError: `arena` is not a power of two of at least 512 bytes.
    """

    strategy = "buddy"

    def __init__(self, ctx: Any, arena: int | None = None) -> None:
        if arena is not None and (arena < MIN_BLOCK or arena & (arena - 1)):
            raise ValueError(f"arena {arena}: a buddy arena is a power of two of at least {MIN_BLOCK} bytes")
        super().__init__(ctx)
        self.arena = arena

    def _round(self, nbytes: int) -> int:
        return max(MIN_BLOCK, 1 << (max(nbytes, 1) - 1).bit_length())

    def _segment_size(self, size: int) -> tuple[int, int]:
        if self.arena is not None:
            return max(self.arena, size), 0
        return (SMALL_BUFFER if size <= SMALL_SIZE else max(LARGE_ARENA, size)), 0

    def _fits(self, segment: _Segment, size: int) -> bool:
        return any(s >= size for s in segment.free.values())

    def _take(self, segment: _Segment, size: int) -> int | None:
        fitting = [(s, offset) for offset, s in segment.free.items() if s >= size]
        if not fitting:
            return None
        block, offset = min(fitting)
        del segment.free[offset]
        while block > size:  # halve it, the upper half staying free
            block >>= 1
            segment.free[offset + block] = block
        return offset

    def _give(self, segment: _Segment, offset: int, size: int) -> None:
        while size < segment.size and segment.free.get(offset ^ size) == size:
            del segment.free[offset ^ size]  # its buddy is free and whole: the two become the block they were
            offset &= ~size
            size <<= 1
        segment.free[offset] = size


class SlabAllocator(_SegmentAllocator):
    """A slab allocator: requests round up to a fixed size class, and each segment (a slab) is cut once, when
    it is made, into equal slots of one class; a slot serves only requests of its class.

    Splitting: none after the slab is made; classes are 512-byte steps up to 2 KiB, then four per power of two
    (2.5, 3, 3.5, 4 KiB, ...), so a slot is at most a quarter larger than its request. Merging: none; a freed
    slot goes back to its slab's free slots, and a slab whose slots are all free goes back to the device on
    empty_cache (or before a retry). So same-sized allocations, the common case in a training loop, reuse
    slots at no search cost and never leave holes between classes, while memory cached in one class cannot
    serve another until its slab is wholly free. Small classes (up to 1 MiB) fill slabs of about 2 MiB, large
    ones below 10 MiB slabs of about 20 MiB (PyTorch's two buffers), larger ones a slab each.
    """

    strategy = "slab"

    def _round(self, nbytes: int) -> int:
        size = -(-max(nbytes, 1) // MIN_BLOCK) * MIN_BLOCK
        return _power2_division(size, SLAB_DIVISIONS) if size > MIN_BLOCK * SLAB_DIVISIONS else size

    def _segment_size(self, size: int) -> tuple[int, int]:
        if size <= SMALL_SIZE:
            target = SMALL_BUFFER
        elif size < MIN_LARGE_SLAB:
            target = LARGE_SLAB
        else:
            target = size
        return max(1, target // size) * size, size  # whole slots only: no tail that no class could use

    def _fits(self, segment: _Segment, size: int) -> bool:
        return segment.slot == size and bool(segment.free)

    def _take(self, segment: _Segment, size: int) -> int | None:
        if not self._fits(segment, size):
            return None
        offset = min(segment.free)  # the lowest slot, so that the slab's top stays free longest
        del segment.free[offset]
        return offset

    def _give(self, segment: _Segment, offset: int, size: int) -> None:
        segment.free[offset] = size


STRATEGIES: dict[str, type[_SegmentAllocator]] = {"buddy": BuddyAllocator, "slab": SlabAllocator}
