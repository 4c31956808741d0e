# Stream-ordered allocation (cudaMallocAsync) and its memory pools, in the client, without I/O.
#
# Where the pool lives decides how the calls behave. CUDA keeps a pool in the driver, inside the process: a
# cudaMallocAsync picks an address from memory the pool has already reserved and returns it at once, and only
# growing the pool (mapping more physical memory) is a call into the kernel's driver. Its errors are the host
# call's own: a bad pool, stream or pointer is cudaErrorInvalidValue (or an invalid handle) at once, and a pool
# that cannot grow is cudaErrorMemoryAllocation at once, never a sticky error later. mpsd does the same: the
# pool is here, the daemon only reserves and releases its memory (a round trip, as growing is on a GPU, and
# charged to the client's pinned limit there as reserved), and the allocations this pool hands out and takes
# back go to the daemon as notifications that wait in the core until its next message (so a pair costs no
# system call at all). A notification the daemon refuses could only come from a client that bypassed this
# module; it becomes the context's asynchronous error, as any notification's does.
#
# Reuse follows CUDA's rules, stream by stream, as the H200 showed them (bench/fidelity/h200_pools.json): a range
# freed on stream A is handed out again on A at once (the stream orders it); on another stream B if the free is
# known to have completed (A or the device was synchronised since: then whatever the flags), or B is known to
# follow the free (an event recorded on A after the free that B waited for: reuse_follow_event_dependencies), or
# else, where no other free range fits, by making B wait for A's work so far (reuse_allow_internal_dependencies,
# which the daemon does as a stream wait). Otherwise the pool grows. reuse_allow_opportunistic lets a GPU reuse
# a free it sees complete without being told; the client knows only what synchronisations tell it, so here the
# flag changes nothing (the H200 reused a free on an idle stream that mpsd keeps apart until a synchronisation).
# Memory goes back at the next synchronisation, down to the release threshold, or with trim_to.
"""Memory pools for stream-ordered allocation."""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mpsd_protocol import Call, Calls, InvalidValueError

if TYPE_CHECKING:
    from ._api import ContextBase

__all__ = ["MemPool", "PoolStatistics"]

RESERVE_STEP = 32 << 20  # measured on the H200: the default pool reserved in 32 MiB steps
ALIGN = 512  # allocations are packed back to back in these steps (assumed: cudaMalloc's small step on the H200)
UINT64_MAX = (1 << 64) - 1
FLAGS = ("reuse_follow_event_dependencies", "reuse_allow_opportunistic", "reuse_allow_internal_dependencies")
ATTRIBUTES = FLAGS + ("release_threshold", "reserved_mem_current", "reserved_mem_high", "used_mem_current",
                      "used_mem_high")
SYNCHRONISING = (Calls.synchronize, Calls.stream_synchronize, Calls.event_synchronize)
_ADDR = operator.attrgetter("addr")


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A pool's memory: reserved from the device, and in use by allocations, now and at most since reset."""

    reserved_mem_current: int
    reserved_mem_high: int
    used_mem_current: int
    used_mem_high: int


@dataclass(eq=False, slots=True)
class _Range:
    """Free bytes of a segment, and the latest free on each stream that gave any of them back."""

    addr: int
    size: int
    frees: dict[int, int] = field(default_factory=dict)  # stream -> that stream's free count at the free


@dataclass(eq=False, slots=True)
class _Segment:
    """One reservation of the pool, its free ranges in address order, and how many allocations live in it."""

    base: int
    size: int
    free: list[_Range]
    live: int = 0


class MemPool:
    """A memory pool (``cudaMemPool_t``) of one context: the device's default pool or one from
    `mem_pool_create`. Attributes are read and set here with no call to the daemon.

    Attribute names are CUDA's ``cudaMemPoolAttr*`` in snake_case: ``release_threshold`` (bytes kept reserved at
    a synchronisation; 0 by default), the three ``reuse_*`` flags (all on by default), and the read-only
    ``reserved_mem_current``, ``used_mem_current`` and their ``_high`` marks (set a mark to 0 to reset it).
    """

    def __init__(self, ctx: ContextBase, default: bool = False, max_size: int = 0) -> None:
        self.ctx = ctx
        self.default = default
        self.max_size = max_size  # 0: as much as the device gives
        self.release_threshold = 0
        self.flags = dict.fromkeys(FLAGS, True)
        self.reserved = self.reserved_high = self.used = self.used_high = 0
        self.segments: list[_Segment] = []  # in address order
        self.destroyed = False

    # -- attributes (cudaMemPoolGetAttribute / cudaMemPoolSetAttribute) --------------------------------
    def get_attribute(self, name: str) -> int | bool:
        """Raises: InvalidValueError: no such attribute, or the pool was destroyed."""
        self._check(name)
        if name in FLAGS:
            return self.flags[name]
        return {"release_threshold": self.release_threshold, "reserved_mem_current": self.reserved,
                "reserved_mem_high": self.reserved_high, "used_mem_current": self.used,
                "used_mem_high": self.used_high}[name]

    def set_attribute(self, name: str, value: int | bool) -> None:
        """Raises: InvalidValueError: no such attribute, a read-only one, a high mark set to anything but 0,
        a value of the wrong kind, or the pool was destroyed."""
        self._check(name)
        if name in FLAGS and isinstance(value, (bool, int)):
            self.flags[name] = bool(value)
        elif name == "release_threshold" and _count(value):
            self.release_threshold = int(value)
        elif name in ("reserved_mem_high", "used_mem_high") and value == 0 and not isinstance(value, bool):
            if name == "reserved_mem_high":
                self.reserved_high = self.reserved
            else:
                self.used_high = self.used
        else:
            raise InvalidValueError(f"cannot set the memory pool attribute {name} to {value!r}")

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(self.reserved, self.reserved_high, self.used, self.used_high)

    def _check(self, name: str) -> None:
        if self.destroyed:
            raise InvalidValueError("the memory pool was destroyed")
        if name not in ATTRIBUTES:
            raise InvalidValueError(f"no memory pool attribute {name!r} (there are {', '.join(ATTRIBUTES)})")

    # -- calls that may reach the daemon ---------------------------------------------------------------
    def trim_to(self, min_bytes_to_keep: int) -> Any:
        """``cudaMemPoolTrimTo``: give back reservations no allocation lives in, keeping at least
        `min_bytes_to_keep` reserved. Their memory goes once the work queued so far has run.

        Raises:
            InvalidValueError: not a byte count, or the pool was destroyed.
        """
        return self.ctx._drive(self.ctx._core.mem_pool_trim_to(self, min_bytes_to_keep))

    def destroy(self) -> Any:
        """``cudaMemPoolDestroy``: unused reservations go now; those with live allocations when their last is
        freed. The device's current pool becomes its default one again, if this was it.

        Raises:
            InvalidValueError: the default pool, or one destroyed already.
        """
        return self.ctx._drive(self.ctx._core.mem_pool_destroy(self))

    def __repr__(self) -> str:
        kind = "default" if self.default else "destroyed" if self.destroyed else "created"
        return f"<MemPool {kind} reserved={self.reserved} used={self.used}>"

    # -- inside: placement ---------------------------------------------------------------------------
    def take(self, size: int, nbytes: int, stream: int, order: Ordering) -> tuple[int, _Segment, list[int]] | None:
        """The lowest free range of `size` bytes that `stream` may use: its address, segment, and the streams
        whose work it must wait for first; None if none. A range that needs no new dependency wins over one
        that does, wherever it lies: the H200 handed out fresh memory rather than make a stream wait, with
        internal dependencies allowed. `nbytes` (what was asked for) is what the pool counts as used, as the
        H200's used_mem_current does."""
        found = self._fit(size, stream, order, internal=False)
        if found is None and self.flags["reuse_allow_internal_dependencies"]:
            found = self._fit(size, stream, order, internal=True)
        if found is None:
            return None
        segment, index, after = found
        free = segment.free[index]
        addr = free.addr
        if free.size == size:
            del segment.free[index]
        else:
            free.addr += size
            free.size -= size
        segment.live += 1
        self.used += nbytes
        self.used_high = max(self.used_high, self.used)
        return addr, segment, after

    def _fit(self, size: int, stream: int, order: Ordering, internal: bool) -> tuple[_Segment, int, list[int]] | None:
        for segment in self.segments:
            for index, free in enumerate(segment.free):
                if free.size < size:
                    continue
                frees = free.frees
                after = [] if not frees or (len(frees) == 1 and stream in frees) else \
                    order.dependencies(self, frees, stream, internal)
                if after is None:
                    continue
                return segment, index, after
        return None

    def give_back(self, segment: _Segment, addr: int, size: int, nbytes: int, stream: int, count: int) -> None:
        """Bytes freed on `stream` as its free number `count`: a free range again, merged with its free
        neighbours (the merged range carries their frees too)."""
        segment.live -= 1
        self.used -= nbytes
        ranges = segment.free
        index = bisect.bisect_left(ranges, addr, key=_ADDR)
        low = ranges[index - 1] if index and ranges[index - 1].addr + ranges[index - 1].size == addr else None
        high = ranges[index] if index < len(ranges) and ranges[index].addr == addr + size else None
        if low is not None:
            low.size += size
            low.frees[stream] = count  # counts only grow, stream by stream
            if high is not None:
                low.size += high.size
                _join(low.frees, high.frees)
                del ranges[index]
        elif high is not None:
            high.addr, high.size = addr, high.size + size
            high.frees[stream] = count
        else:
            ranges.insert(index, _Range(addr, size, {stream: count}))

    def add(self, base: int, size: int) -> None:
        index = bisect.bisect_left(self.segments, base, key=lambda s: s.base)
        self.segments.insert(index, _Segment(base, size, [_Range(base, size)]))
        self.reserved += size
        self.reserved_high = max(self.reserved_high, self.reserved)

    def unused(self, keep: int, threshold: bool = False) -> list[int]:
        """Take out the segments no allocation lives in, highest first; their bases. For trim_to, while at
        least `keep` bytes stay reserved; at a synchronisation (`threshold`), while more than `keep` are. The
        H200 did each: 96 MiB unused trimmed to 40 MiB kept 64, and released at a 40 MiB threshold kept 32."""
        gone = []
        for segment in reversed(list(self.segments)):
            room = self.reserved > keep if threshold else self.reserved - segment.size >= keep
            if segment.live == 0 and room:
                self.segments.remove(segment)
                self.reserved -= segment.size
                gone.append(segment.base)
        return gone


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= UINT64_MAX


def _join(into: dict[int, int], other: dict[int, int]) -> None:
    for stream, count in other.items():
        if into.get(stream, 0) < count:
            into[stream] = count


class Ordering:
    """What this client knows of the order between frees and later work, from its own calls: each stream's
    count of frees, what each stream's later work is known to follow (through event waits), which frees are
    known to have completed (through synchronisations), and what each event's latest record follows."""

    def __init__(self) -> None:
        self.frees: dict[int, int] = {}  # stream -> frees on it so far
        self.follows: dict[int, dict[int, int]] = {}  # stream -> {stream: frees its later work comes after}
        self.completed: dict[int, int] = {}  # stream -> frees on it known to have completed
        self.recorded: dict[int, dict[int, int]] = {}  # event -> what its latest record comes after

    def freed(self, stream: int) -> int:
        """A free on `stream`: its number there."""
        count = self.frees[stream] = self.frees.get(stream, 0) + 1
        return count

    def dependencies(self, pool: MemPool, frees: dict[int, int], stream: int,
                     internal: bool = True) -> list[int] | None:
        """The streams `stream` must wait for to reuse bytes freed by `frees` (none: it may at once), or None if
        the pool's flags (or `internal` False) allow no reuse. A free a synchronisation has seen complete is
        anyone's, whatever the flags: the H200 reused it on another stream with all three off."""
        after: list[int] = []
        follows = self.follows.get(stream, {})
        for other, count in frees.items():
            if other == stream or self.completed.get(other, 0) >= count:
                continue
            if pool.flags["reuse_follow_event_dependencies"] and follows.get(other, 0) >= count:
                continue
            if not (internal and pool.flags["reuse_allow_internal_dependencies"]):
                return None
            after.append(other)
        return after

    def observe(self, call: Call, args: dict[str, Any]) -> None:
        """A call of the table went through: what it teaches about order."""
        stream = args.get("stream") or 0
        if call is Calls.event_record:
            known = dict(self.follows.get(stream, {}))
            known[stream] = self.frees.get(stream, 0)
            self.recorded[args["event"]] = known
        elif call is Calls.stream_wait_event:
            _join(self.follows.setdefault(stream, {}), self.recorded.get(args["event"], {}))
        elif call is Calls.synchronize:
            _join(self.completed, self.frees)
        elif call is Calls.stream_synchronize:
            _join(self.completed, {stream: self.frees.get(stream, 0)})
            _join(self.completed, self.follows.get(stream, {}))
        elif call is Calls.event_synchronize:
            _join(self.completed, self.recorded.get(args["event"], {}))
