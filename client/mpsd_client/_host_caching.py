# PyTorch's caching host allocator (the pinned memory behind tensor.pin_memory() and non_blocking copies), over a
# context's pinned host buffers: a request is rounded up to a power of two, served from the cache of freed buffers
# of that size where one is free, else from a new buffer (cudaHostAlloc's part, host_alloc here); a freed buffer
# used by streams' work (record_stream) waits for their events before it is handed out again; empty_cache gives
# the cached buffers back. host_memory_stats reports it under PyTorch's keys: the buffers the allocator owns
# (allocations, allocated_bytes), those handed out (active_requests, active_bytes), how many buffers were made and
# given back, and the time those calls took (microseconds, as the client's own clock read them).
"""PyTorch's caching host allocator, over pinned host buffers."""

from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ._figures import _Stat
from ._objects import HostBuffer
from ._stream_uses import PendingFrees

__all__ = ["HostCachingAllocator", "host_caching_allocator"]

_STATS = ("allocations", "allocated_bytes", "active_requests", "active_bytes")


@dataclass(slots=True)
class _Duration:
    """A duration statistic in microseconds, as PyTorch's host allocator keeps its alloc and free times."""

    total: float = 0.0
    max: float = 0.0
    min: float = 0.0
    count: int = 0

    def add(self, micros: float) -> None:
        self.min = micros if self.count == 0 else min(self.min, micros)
        self.max = max(self.max, micros)
        self.total += micros
        self.count += 1

    def figures(self) -> dict[str, Any]:
        return {"total": self.total, "max": self.max, "min": self.min, "count": self.count,
                "avg": self.total / self.count if self.count else 0.0}


@dataclass(eq=False, slots=True)
class _Block:
    buffer: HostBuffer
    size: int  # the rounded size it was made with
    streams: dict[int, Any] = field(default_factory=dict)  # record_stream's uses since it was handed out
    event_count: int = 0  # events of those streams it still waits for after its free (PendingFrees)


def _rounded(nbytes: int) -> int:
    return 1 << (nbytes - 1).bit_length()


class HostCachingAllocator:
    """The caching host allocator of one context.

    Args:
        ctx: a blocking Context (its host_alloc, free_host and events).
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self._free: dict[int, deque[_Block]] = {}  # rounded size -> cached blocks, oldest first
        self._active: dict[int, _Block] = {}  # id(buffer) -> a handed-out block
        self._pending = PendingFrees(ctx)
        self._stats = {name: _Stat() for name in _STATS}
        self._alloc_time, self._free_time = _Duration(), _Duration()
        self._counts = {"num_host_alloc": 0, "num_host_free": 0}

    def allocate(self, nbytes: int) -> HostBuffer | None:
        """A pinned buffer of at least `nbytes` (exactly the power of two above it), or None for 0 bytes, as
        PyTorch hands out a null pointer for an empty request.

        Raises:
            ValueError: `nbytes` is negative.
            OutOfMemoryError: the daemon refused a new buffer (its host-memory budget).
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        if nbytes == 0:
            return None
        self._pending.process(self._reusable)
        size = _rounded(nbytes)
        cached = self._free.get(size)
        if cached:
            block = cached.popleft()
        else:
            started = time.perf_counter()
            buffer = self.ctx.host_alloc(size)
            self._alloc_time.add((time.perf_counter() - started) * 1e6)
            block = _Block(buffer, size)
            self._counts["num_host_alloc"] += 1
            self._stats["allocations"].up(1)
            self._stats["allocated_bytes"].up(size)
        self._active[id(block.buffer)] = block
        self._stats["active_requests"].up(1)
        self._stats["active_bytes"].up(size)
        return block.buffer

    def record_stream(self, buffer: HostBuffer, stream: Any) -> None:
        """Mark `buffer` as used by work on `stream`: freed, it is not handed out again before that work is done.

        Raises:
            ValueError: `buffer` is not one this allocator handed out and has not taken back.
        """
        self._block(buffer).streams[id(stream)] = stream

    def free(self, buffer: HostBuffer) -> None:
        """Take `buffer` back: cached at once, or once the work of the streams it was recorded on is done.

        Raises:
            ValueError: as record_stream.
        """
        block = self._block(buffer)
        del self._active[id(buffer)]
        if block.streams:
            self._pending.hold(block, block.streams)
        else:
            self._reusable(block)

    def empty_cache(self) -> None:
        """Give every cached buffer back (free_host), after waiting for the events freed buffers wait for."""
        self._pending.synchronize(self._reusable)
        for blocks in self._free.values():
            for block in blocks:
                started = time.perf_counter()
                self.ctx.free_host(block.buffer)
                self._free_time.add((time.perf_counter() - started) * 1e6)
                self._counts["num_host_free"] += 1
                self._stats["allocations"].down(1)
                self._stats["allocated_bytes"].down(block.size)
        self._free.clear()

    def stats(self) -> dict[str, Any]:
        """host_memory_stats(): {"allocations.current": ..., "allocations.peak": ..., ..., "num_host_alloc": n,
        "host_alloc_time.total": ..., ...}, flat under dotted keys and sorted, as the device allocator's are."""
        out: dict[str, Any] = {f"{name}.{kind}": getattr(s, kind) for name, s in self._stats.items()
                               for kind in ("current", "peak", "allocated", "freed")}
        out.update(self._counts)
        for name, duration in (("host_alloc_time", self._alloc_time), ("host_free_time", self._free_time)):
            out.update({f"{name}.{kind}": value for kind, value in duration.figures().items()})
        return dict(sorted(out.items()))

    def reset_accumulated_stats(self) -> None:
        """Each statistic's "allocated" and "freed", the counts and the times back to 0; current and peak stay."""
        for stat in self._stats.values():
            stat.allocated = stat.freed = 0
        self._counts = dict.fromkeys(self._counts, 0)
        self._alloc_time, self._free_time = _Duration(), _Duration()

    def reset_peak_stats(self) -> None:
        """Each statistic's peak becomes its current figure."""
        for stat in self._stats.values():
            stat.peak = stat.current

    def _block(self, buffer: HostBuffer) -> _Block:
        block = self._active.get(id(buffer))
        if block is None or block.buffer is not buffer:
            raise ValueError(f"{buffer!r} was not handed out by this allocator, or was freed already")
        return block

    def _reusable(self, block: _Block) -> None:
        """A freed block whose streams are done: no longer active, and cached for its size."""
        block.streams.clear()
        self._stats["active_requests"].down(1)
        self._stats["active_bytes"].down(block.size)
        self._free.setdefault(block.size, deque()).append(block)


_DEFAULTS: weakref.WeakKeyDictionary[Any, HostCachingAllocator] = weakref.WeakKeyDictionary()


def host_caching_allocator(ctx: Any) -> HostCachingAllocator:
    """The context's caching host allocator, made on first use (PyTorch has one per process)."""
    allocator = _DEFAULTS.get(ctx)
    if allocator is None:
        allocator = _DEFAULTS[ctx] = HostCachingAllocator(ctx)
    return allocator
