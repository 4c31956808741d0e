# A caching allocator in the client that behaves as PyTorch's CUDA caching allocator does, so that a program
# written for torch.cuda's memory statistics and snapshots reads the same figures here, for the same trace of
# allocations: the same segments, the same splits, the same statistics (tests/test_caching_allocator.py replays
# traces recorded from PyTorch 2.11 on an H200, bench/fidelity/record_torch_allocator.py).
#
# The rules, as PyTorch states them: sizes round up to 512 bytes (or to power-of-two divisions); requests up to
# 1 MiB come from the small pool, packed in 2 MiB segments; larger ones from the large pool, in 20 MiB segments
# below 10 MiB and otherwise their size rounded to 2 MiB. A free block is found by best fit among the same
# stream's, and split when what is left is worth keeping (512 bytes in the small pool; more than 1 MiB in the
# large, for requests under max_split_size); freed blocks merge with free neighbours of their segment. A segment
# goes back to the device (cudaFree, here ctx.free) only when it is whole and free: on empty_cache(), or when a
# device allocation fails, before a retry. With expandable_segments, new memory comes instead from one segment per
# stream and pool that grows in place (mpsd_client._expandable); sizes and figures every strategy shares are in
# mpsd_client._figures, record_stream's waiting blocks in mpsd_client._stream_uses.
"""PyTorch's caching allocator, on mpsd."""

from __future__ import annotations

import bisect
import os
import pickle
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

from mpsd_protocol import OutOfMemoryError

from ._caching_report import History, summary
from ._figures import (LARGE_BUFFER, MIN_BLOCK, POOLS, SMALL_BUFFER, SMALL_SIZE, STATS, UNLIMITED, _allocation_size,
                       _Figures, _oom_message, _power2_division, _Stat, _stream, fragmentation)
from ._expandable import ExpandableRules, ExpandableSegment, Unmapped, expandable_size
from ._graph_pools import SHARED, GraphPools
from ._stream_uses import PendingFrees

__all__ = ["CachingAllocator", "caching_allocator"]

OPTIONS = ("max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold", "expandable_segments")


@dataclass(eq=False)
class _Block:
    stream: int
    size: int
    ptr: int
    small: bool
    requested: int = 0
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None
    gc_base: int = 0
    stream_uses: dict[int, Any] = field(default_factory=dict)  # record_stream's streams, by key: their objects
    event_count: int = 0  # events recorded on those streams at its free that have not completed
    frames: list[dict[str, Any]] = field(default_factory=list)  # its allocation's stack, when history is on
    mapped: bool = True  # False: a range of an expandable segment with no memory behind it yet
    segment: ExpandableSegment | None = None  # the expandable segment it is part of, if any
    pool_id: tuple[int, int] = SHARED  # the graphs' private pool its segment belongs to, if any (_graph_pools)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.ptr)  # PyTorch's order of free blocks: stream, size, address

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """Free blocks of one pool, in (stream, size, address) order, for best fit."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], _Block] = {}
        self.unmapped = Unmapped()  # expandable segments' ranges not mapped yet

    def insert(self, block: _Block, now: int = 0) -> None:
        bisect.insort(self.keys, block.key)
        self.blocks[block.key] = block
        block.gc_base = now  # the pool's search count when it was cached: its age starts here

    def remove(self, block: _Block) -> None:
        del self.keys[bisect.bisect_left(self.keys, block.key)]
        del self.blocks[block.key]

    def best_fit(self, stream: int, size: int) -> _Block | None:
        index = bisect.bisect_left(self.keys, (stream, size, 0))
        if index == len(self.keys) or self.keys[index][0] != stream:
            return None
        return self.blocks[self.keys[index]]


def _config(text: str) -> dict[str, float]:
    """PYTORCH_CUDA_ALLOC_CONF's options this allocator honours: ``max_split_size_mb:N``,
    ``roundup_power2_divisions:N``, ``garbage_collection_threshold:F`` and ``expandable_segments:True|False``
    (1.0 or 0.0 here).

    Raises:
        ValueError: an option it does not know, or a value that is not a number (for expandable_segments, not
            True or False, the only spellings PyTorch takes).
    """
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition(":")
        if name not in OPTIONS:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {name!r} is not an option this allocator knows "
                             f"({', '.join(OPTIONS)})")
        if name == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expandable_segments takes True or False, not {value!r}")
            out[name] = float(value == "True")
        else:
            out[name] = float(value)
    return out


class CachingAllocator(ExpandableRules, GraphPools, _Figures):
    """PyTorch's CUDA caching allocator over a context's device memory.

    Args:
        ctx: a blocking `Context` (its malloc, free and synchronize are the device's; with expandable segments
            its mem_address_reserve, mem_create, mem_map and the rest).
        config: PYTORCH_CUDA_ALLOC_CONF's syntax (default: that variable); ``max_split_size_mb``,
            ``roundup_power2_divisions`` (one number, for every size), ``garbage_collection_threshold`` (which,
            as in PyTorch, acts only under ``set_per_process_memory_fraction``) and ``expandable_segments`` are
            honoured.
        expandable_segments: overrides the option of that name in `config` (mpsd_client._expandable).
    """

    _block = _Block

    def __new__(cls, ctx: Any, config: str | None = None, strategy: str = "pytorch",
                expandable_segments: bool | None = None, **options: Any) -> Any:
        # strategy="buddy" | "slab" gives one of mpsd_client._strategies' allocators instead: the same calls
        # over other rules, for comparing how each fragments (imported here, as that module builds on this one).
        if strategy == "pytorch":
            if options:
                raise TypeError(f"the pytorch strategy takes no options {sorted(options)}")
            return super().__new__(cls)
        from ._strategies import STRATEGIES
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r}: one of pytorch, {', '.join(STRATEGIES)}")
        if expandable_segments:
            raise TypeError(f"expandable segments are PyTorch's strategy's, not {strategy}'s")
        return STRATEGIES[strategy](ctx, **options)

    def __init__(self, ctx: Any, config: str | None = None, strategy: str = "pytorch",
                 expandable_segments: bool | None = None) -> None:
        self.ctx = ctx
        self.config = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if config is None else config
        options = _config(self.config)
        self.expandable = bool(options.get("expandable_segments", 0.0)) if expandable_segments is None \
            else expandable_segments
        self._expandables: list[ExpandableSegment] = []
        self.max_split_size = int(options["max_split_size_mb"] * (1 << 20)) if "max_split_size_mb" in options \
            else UNLIMITED
        self.divisions = int(options.get("roundup_power2_divisions", 0))
        self.gc_threshold = options.get("garbage_collection_threshold", 0.0)
        self.allowed: int | None = None  # set_per_process_memory_fraction's bytes, if set
        self._reserved_total = 0  # bytes of every segment held: what the fraction caps
        self._gc_calls = {True: 0, False: 0}  # best-fit searches per pool while garbage collection is on
        self._pools = {True: _Pool(True), False: _Pool(False)}
        self._init_graph_pools(_Pool)  # graphs' private pools (mpsd_client._graph_pools)
        self._active: dict[int, _Block] = {}  # address of each allocated block
        self._segments: dict[int, _Block] = {}  # base address of each segment -> its first block
        self._stats = {name: {pool: _Stat() for pool in POOLS} for name in STATS}
        # (statistic, small) -> its "all" figure and its pool's, which every change moves together
        self._pairs = {(name, small): (pools["all"], pools["small_pool" if small else "large_pool"])
                       for name, pools in self._stats.items() for small in (True, False)}
        self._oversize = {"oversize_allocations": _Stat(), "oversize_segments": _Stat()}
        self._counts = {"num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0, "num_device_alloc": 0,
                        "num_device_free": 0}
        self._pending = PendingFrees(ctx)  # blocks freed while streams of record_stream may still use them
        self._history: History | None = None
        self._segment_frames: dict[int, list[dict[str, Any]]] = {}  # each segment's allocation stack

    # -- the allocator -------------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: Any = None) -> int:
        """An allocation of `nbytes` for use on `stream` (None: the default stream); its address.

        Raises:
            OutOfMemoryError: the device has no room even after the cache was emptied, with PyTorch's message.
        """
        self._process_events()
        size = self._round(nbytes)
        small = size <= SMALL_SIZE
        stream_key = _stream(stream)
        pool_id, pools = self._target(stream) if self._to_pool else (SHARED, self._pools)
        block = self._free_block(small, stream_key, size, pools[small])
        if block is None and pool_id != SHARED:
            block = self._new_segment(small, stream_key, size, False, pool_id)
        elif block is None:
            if self.allowed is not None and self.gc_threshold > 0:
                self._collect_garbage()
            block = self._alloc_block(small, stream_key, stream, size, retry=False)
            if block is None and self._release_available(small, stream_key, size):
                block = self._alloc_block(small, stream_key, stream, size, retry=False)
            if block is None and not self._capturing:  # emptying the cache synchronises: no capture allows it
                self._release_cached()
                block = self._alloc_block(small, stream_key, stream, size, retry=True)
        if block is None:  # (a private pool's new segment, too, when the device has no room for it)
            self._counts["num_ooms"] += 1
            if self._history is not None:
                self._history.add("oom", 0, size, stream_key, device_free=self.ctx.mem_get_info()[0])
            raise OutOfMemoryError(self._oom_message(_allocation_size(size)))
        block = self._hand_out(block, size, nbytes)
        if self._history is not None:
            block.frames = self._history.add("alloc", block.ptr, nbytes, stream_key)
        return block.ptr

    def record_stream(self, ptr: int, stream: Any) -> None:
        """Mark the allocation at `ptr` as used by work on `stream` too (torch.Tensor.record_stream): when it is
        freed, its block is not reused before the work queued on `stream` until then has completed.

        Raises:
            ValueError: `ptr` is not a live allocation of this allocator.
        """
        block = self._active.get(int(ptr))
        if block is None:
            raise ValueError(f"{int(ptr):#x} is not a live allocation of this allocator")
        key = _stream(stream)
        if key != block.stream:  # its own stream orders its reuse already
            block.stream_uses[key] = stream

    def free(self, ptr: int) -> None:
        """Give an allocation back to the cache (its memory stays reserved until empty_cache())."""
        block = self._active.pop(int(ptr), None)
        if block is None:
            raise ValueError(f"{int(ptr):#x} was not allocated by this allocator, or was freed already")
        block.allocated = False
        for stat in self._pairs["allocation", block.small]:
            stat.down(1)
        for stat in self._pairs["allocated_bytes", block.small]:
            stat.down(block.size)
        if block.size >= self.max_split_size:
            self._oversize["oversize_allocations"].down(1)
        if self._history is not None:
            self._history.add("free_requested", block.ptr, block.requested, block.stream)
        if block.stream_uses and self._capturing:
            self._deferred.append(block)  # its events are recorded once no capture is under way
        elif block.stream_uses:
            self._pending.hold(block, block.stream_uses)
            block.stream_uses = {}
        else:
            self._return_block(block)

    def _return_block(self, block: _Block) -> None:
        """A freed block goes back to its pool, merged with its free neighbours (once no stream uses it)."""
        if self._history is not None:
            self._history.add("free_completed", block.ptr, block.requested, block.stream)
        block.frames = []
        size, requested = block.size, block.requested
        blocks_change = bytes_change = 0
        for neighbour in (block.prev, block.next):
            merged = self._merge(block, neighbour)
            if merged:
                blocks_change -= 1
                bytes_change -= merged
        self._home(block).insert(block, self._gc_calls[block.small])
        if block.is_split():
            blocks_change += 1
            bytes_change += block.size
        if block.segment is None:  # PyTorch leaves expandable segments out of inactive_split: their free
            self._change("inactive_split", block.small, blocks_change)  # pages can always be unmapped
            self._change("inactive_split_bytes", block.small, bytes_change)
        for name, amount in (("active", 1), ("active_bytes", size), ("requested_bytes", requested)):
            for stat in self._pairs[name, block.small]:
                stat.down(amount)

    def set_per_process_memory_fraction(self, fraction: float) -> None:
        """Cap what this allocator may reserve at `fraction` of the device's memory."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"invalid fraction {fraction}: it must be between 0 and 1")
        self.allowed = int(fraction * self.ctx.mem_get_info()[1])

    def _process_events(self) -> None:
        """Blocks whose streams' events have all completed go back to their pools (at each malloc); blocks freed
        during a capture under record_stream have their events recorded, once no capture is under way."""
        self._hold_deferred()
        self._pending.process(self._return_block)

    def _hold_deferred(self) -> None:
        if self._deferred and not self._capturing:
            for block in self._deferred:
                self._pending.hold(block, block.stream_uses)
                block.stream_uses = {}
            self._deferred = []

    def empty_cache(self) -> None:
        """Give every whole, free segment back to the device (after waiting for the device's work, as PyTorch
        synchronises before it frees); with expandable segments, unmap every whole free page, and give back each
        segment's range once nothing of it is mapped. The private pools of graphs all reset are emptied too; those
        of live graphs keep their memory.

        Raises:
            RuntimeError: a capture is under way (the synchronisation would invalidate it).
        """
        if self._capturing:
            raise RuntimeError("empty_cache synchronises the device: not while a graph is being captured")
        self._release_cached()

    # -- statistics, as torch.cuda has them ------------------------------------------------------------------
    def memory_stats(self) -> dict[str, float]:
        """Every figure torch.cuda.memory_stats() gives, under the same keys, and mpsd's own
        ``fragmentation.*`` figures (see `fragmentation`)."""
        out = self._torch_figures()
        out["max_split_size"] = -1 if self.max_split_size == UNLIMITED else self.max_split_size
        free = [block.size for pool in self._pools.values() for block in pool.blocks.values()]
        out.update(fragmentation(free, out["requested_bytes.all.current"], out["allocated_bytes.all.current"]))
        return dict(sorted(out.items()))

    def memory_snapshot(self) -> list[dict[str, Any]]:
        """The segments and their blocks, in address order, in torch.cuda.memory_snapshot()'s shape; an
        expandable segment shows as one segment for each run of mapped memory, ``is_expandable`` True."""
        out = []
        heads: list[tuple[int, _Block, bool]] = [(base, block, False) for base, block in self._segments.items()]
        heads += [(run[0].ptr, run[0], True) for run in self._expandable_runs()]
        for base, head, expandable in sorted(heads, key=lambda h: h[0]):
            block: _Block | None = head
            first = block
            blocks: list[dict[str, Any]] = []
            while block is not None and block.mapped:
                state = ("active_allocated" if block.allocated else "active_pending_free" if block.event_count
                         else "inactive")
                blocks.append({"address": block.ptr, "size": block.size,
                               "requested_size": block.requested if state != "inactive" else 0,
                               "state": state, "frames": block.frames})
                block = block.next
            total = sum(b["size"] for b in blocks)
            allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            active = sum(b["size"] for b in blocks if b["state"] != "inactive")
            out.append({"device": 0, "address": base, "total_size": total, "allocated_size": allocated,
                        "active_size": active, "requested_size": sum(b["requested_size"] for b in blocks),
                        "stream": first.stream if first is not None else 0,
                        "segment_type": "small" if first is not None and first.small else "large",
                        "segment_pool_id": first.pool_id if first is not None else SHARED,
                        "is_expandable": expandable,
                        "frames": self._segment_frames.get(base, []), "blocks": blocks})
        return out

    def memory_summary(self, device: int = 0, abbreviated: bool = False) -> str:
        """torch.cuda.memory_summary()'s table of memory_stats(), in its layout."""
        return summary(self.memory_stats(), device, abbreviated)

    def _record_memory_history(self, enabled: str | None = "all", context: str | None = "all",
                               stacks: str = "python", max_entries: int = sys.maxsize) -> None:
        """torch.cuda.memory._record_memory_history: keep the allocator's events (alloc, free_requested,
        free_completed, segment_alloc, segment_free, oom; segment_map and segment_unmap with expandable
        segments), with the Python stack of each where `context` says
        ("all", "alloc", or None for none); `enabled=None` stops and forgets them. Stacks are Python's only.

        Raises:
            ValueError: an `enabled`, `context` or `stacks` PyTorch does not take.
        """
        if enabled not in (None, "all", "state") or context not in (None, "state", "alloc", "all") \
                or stacks not in ("python", "all"):
            raise ValueError(f"_record_memory_history(enabled={enabled!r}, context={context!r}, stacks={stacks!r})")
        self._history = None if enabled is None else History(context, max_entries if enabled == "all" else 0)

    def _snapshot(self) -> dict[str, Any]:
        """torch.cuda.memory._snapshot(): the segments and the recorded events (one device's list)."""
        return {"segments": self.memory_snapshot(),
                "device_traces": [list(self._history.entries) if self._history is not None else []],
                "allocator_settings": self.allocator_settings()}

    def allocator_settings(self) -> dict[str, Any]:
        """The settings the snapshot records under "allocator_settings", as PyTorch's do (its configuration
        text, and the options this allocator honours)."""
        return {"PYTORCH_CUDA_ALLOC_CONF": self.config,
                "max_split_size": -1 if self.max_split_size == UNLIMITED else self.max_split_size,
                "garbage_collection_threshold": self.gc_threshold, "expandable_segments": self.expandable,
                "roundup_power2_divisions": self.divisions}

    def _dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        """torch.cuda.memory._dump_snapshot: pickle _snapshot() to `filename`, which pytorch.org/memory_viz
        opens."""
        with open(filename, "wb") as f:
            pickle.dump(self._snapshot(), f)

    # -- inside --------------------------------------------------------------------------------------------
    def _round(self, nbytes: int) -> int:
        if nbytes < MIN_BLOCK:
            return MIN_BLOCK
        divisions = self.divisions
        if divisions > 1 and nbytes > MIN_BLOCK * divisions:
            return _power2_division(nbytes, divisions)
        return -(-nbytes // MIN_BLOCK) * MIN_BLOCK

    def _free_block(self, small: bool, stream: int, size: int, pool: _Pool) -> _Block | None:
        if self.allowed is not None and self.gc_threshold > 0:
            self._gc_calls[small] += 1  # a cached block's age counts these searches
        block = pool.best_fit(stream, size)
        if block is None:
            return None
        if block.segment is not None:
            # A block that can grow counts as large as it could grow: best fit looks on, among the stream's
            # larger blocks, for one that holds less that way (PyTorch's expandable_size).
            index = bisect.bisect_left(pool.keys, block.key) + 1
            while (block.segment is not None and index < len(pool.keys) and pool.keys[index][0] == stream
                   and expandable_size(pool.blocks[pool.keys[index]]) < expandable_size(block)):
                block = pool.blocks[pool.keys[index]]
                index += 1
        if size < self.max_split_size and block.size >= self.max_split_size:
            return None  # an oversize block is not cut up for a request below the limit
        if size >= self.max_split_size and block.size >= size + LARGE_BUFFER:
            return None  # nor given whole to a large request it exceeds by 20 MiB or more
        pool.remove(block)
        return block

    def _alloc_block(self, small: bool, stream: int, stream_object: Any, size: int, retry: bool) -> _Block | None:
        """A new free block for `size`: a new segment, or with expandable segments the stream's segment grown
        (what PyTorch's alloc_block does; the fraction is checked against the segment a cudaMalloc would make)."""
        if not self.expandable:
            return self._new_segment(small, stream, size, retry)
        if retry:
            self._counts["num_alloc_retries"] += 1
        nbytes = SMALL_BUFFER if small else _allocation_size(size)
        if self.allowed is not None and self._reserved_total + nbytes > self.allowed:
            return None
        grown: _Block | None = self._grow(small, stream, stream_object, size)
        return grown

    def _mapped(self, small: bool, stream: int, ptr: int, nbytes: int, up: bool) -> None:
        """An expandable segment mapped (or unmapped) `nbytes` at `ptr`: reserved bytes, device calls, history."""
        self._reserved_total += nbytes if up else -nbytes
        self._change("reserved_bytes", small, nbytes if up else -nbytes)
        self._counts["num_device_alloc" if up else "num_device_free"] += 1
        if self._history is not None:
            frames = self._history.add("segment_map" if up else "segment_unmap", ptr, nbytes, stream)
            if up and ptr not in self._segment_frames:
                self._segment_frames[ptr] = frames

    def _new_segment(self, small: bool, stream: int, size: int, retry: bool,
                     pool_id: tuple[int, int] = SHARED) -> _Block | None:
        # (A private pool's segments are never expandable: each is a cudaMalloc of its own.)
        nbytes = SMALL_BUFFER if small else _allocation_size(size)
        if retry:
            self._counts["num_alloc_retries"] += 1
        if self.allowed is not None and self._reserved_total + nbytes > self.allowed:
            return None  # past the process's fraction: as if the device had no room
        try:
            if self._capturing:  # PyTorch's cudaMallocMaybeCapturing: relaxed, so the capture goes on
                before = self.ctx.thread_exchange_stream_capture_mode("relaxed")
                try:
                    ptr = int(self.ctx.malloc(nbytes))
                finally:
                    self.ctx.thread_exchange_stream_capture_mode(before)
            else:
                ptr = int(self.ctx.malloc(nbytes))
        except OutOfMemoryError:
            return None
        self._reserved_total += nbytes
        block = _Block(stream, nbytes, ptr, small, pool_id=pool_id)
        self._new_private_segment(pool_id, ptr)
        self._segments[ptr] = block
        if self._history is not None:
            self._segment_frames[ptr] = self._history.add("segment_alloc", ptr, nbytes, stream)
        for name, amount in (("segment", 1), ("reserved_bytes", nbytes)):
            for stat in self._pairs[name, small]:
                stat.up(amount)
        if nbytes >= self.max_split_size:
            self._oversize["oversize_segments"].up(1)
        self._counts["num_device_alloc"] += 1
        return block

    def _hand_out(self, block: _Block, size: int, requested: int) -> _Block:
        """Take `size` bytes from the front of the free `block` (splitting off the rest where worth it)."""
        was_split = block.is_split()
        remaining = block.size - size
        if block.small or self.expandable:  # with expandable segments, large blocks split as small ones
            split = remaining >= MIN_BLOCK
        else:
            split = size < self.max_split_size and remaining > SMALL_SIZE
        if split:
            rest = _Block(block.stream, remaining, block.ptr + size, block.small, prev=None, next=block.next,
                          segment=block.segment, pool_id=block.pool_id)
            front = _Block(block.stream, size, block.ptr, block.small, prev=block.prev, next=rest,
                           segment=block.segment, pool_id=block.pool_id)
            rest.prev = front
            if front.prev is not None:
                front.prev.next = front
            else:
                self._set_head(front)
            if rest.next is not None:
                rest.next.prev = rest
            self._home(block).insert(rest, self._gc_calls[block.small])
            if block.segment is not None:
                pass  # expandable segments are left out of inactive_split, as in PyTorch
            elif was_split:
                self._change("inactive_split_bytes", block.small, -size)
            else:
                self._change("inactive_split_bytes", block.small, remaining)
                self._change("inactive_split", block.small, 1)
            block = front
        elif was_split and block.segment is None:
            self._change("inactive_split_bytes", block.small, -block.size)
            self._change("inactive_split", block.small, -1)
        block.allocated = True
        block.requested = requested
        self._active[block.ptr] = block
        for name, amount in (("allocation", 1), ("allocated_bytes", block.size), ("active", 1),
                             ("active_bytes", block.size), ("requested_bytes", requested)):
            for stat in self._pairs[name, block.small]:
                stat.up(amount)
        if block.size >= self.max_split_size:
            self._oversize["oversize_allocations"].up(1)
        return block

    def _merge(self, block: _Block, other: _Block | None) -> int:
        """Absorb the free neighbour `other` into `block`; the bytes absorbed (0 if it is not free)."""
        if other is None or other.allocated or other.event_count or other.mapped != block.mapped:
            return 0  # in use, waiting for a stream's event, or mapped where the block is not (or not where it is)
        if other.mapped:
            self._home(block).remove(other)
        else:
            self._pools[block.small].unmapped.remove(other)
        if block.prev is other:
            block.ptr = other.ptr
            block.prev = other.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                self._set_head(block)
        else:
            block.next = other.next
            if block.next is not None:
                block.next.prev = block
        block.size += other.size
        return other.size

    def _set_head(self, block: _Block) -> None:
        """`block` is now the first of its segment."""
        if block.segment is not None:
            block.segment.head = block
        else:
            self._segments[block.ptr] = block

    def _release_available(self, small: bool, stream: int, size: int) -> bool:
        """With a max_split_size, free oversize cached blocks, enough for `size`; whether any was."""
        if self.max_split_size == UNLIMITED:
            return False
        pool = self._pools[small]
        target = max(size, self.max_split_size)
        index = bisect.bisect_left(pool.keys, (stream, target, 0))
        if index < len(pool.keys) and pool.keys[index][0] == stream and pool.blocks[pool.keys[index]].segment is None:
            self._release(pool.blocks[pool.keys[index]])
            return True
        released = 0
        index -= 1  # the largest of this stream's, going down (an expandable segment's are passed over)
        while released < target and index >= 0:
            block = pool.blocks[pool.keys[index]]
            if block.size < self.max_split_size or block.stream != stream:
                break
            if block.segment is None:
                released += block.size
                self._release(block)
            index -= 1
        return released >= target

    def _collect_garbage(self) -> None:
        """Past the threshold's share of the allowed memory, give back the large pool's whole free segments that
        have sat longer than the average, until enough is back (PyTorch's garbage collection)."""
        assert self.allowed is not None
        threshold = int(self.gc_threshold * self.allowed)
        if self._reserved_total <= threshold:
            return
        target = self._reserved_total - threshold
        pool, now = self._pools[False], self._gc_calls[False]
        whole = [pool.blocks[k] for k in pool.keys if not pool.blocks[k].is_split() and pool.blocks[k].segment is None]
        if not whole:
            return
        total_age, count, reclaimed, freed = sum(now - b.gc_base for b in whole), len(whole), 0, True
        while reclaimed < target and freed and count > 0:
            average = total_age / count
            freed = False
            for key in list(pool.keys):
                block = pool.blocks.get(key)
                if block is not None and not block.is_split() and block.segment is None \
                        and now - block.gc_base >= average:
                    freed = True
                    reclaimed += block.size
                    total_age -= now - block.gc_base
                    count -= 1
                    self._release(block)

    def _release_cached(self) -> None:
        self._hold_deferred()
        self._pending.synchronize(self._return_block)
        self.ctx.synchronize()
        self._counts["num_sync_all_streams"] += 1
        for pool in [self._pools[False], self._pools[True], *self._freeable_private()]:
            growing = []  # an expandable segment's free blocks: their whole pages are unmapped after the rest
            for key in list(pool.keys):
                block = pool.blocks[key]
                if block.segment is not None:
                    growing.append(block)
                elif not block.is_split():
                    self._release(block)
            for block in growing:
                self._unmap_block(block)
        self._forget_empty_pools()

    def _release(self, block: _Block) -> None:
        """Give a whole free segment back to the device."""
        self._home(block).remove(block)
        self._segment_gone(block)
        del self._segments[block.ptr]
        self._segment_frames.pop(block.ptr, None)
        if self._history is not None:
            self._history.add("segment_free", block.ptr, block.size, block.stream)
        self.ctx.free(block.ptr)
        self._reserved_total -= block.size
        self._counts["num_device_free"] += 1
        for name, amount in (("segment", 1), ("reserved_bytes", block.size)):
            for stat in self._pairs[name, block.small]:
                stat.down(amount)
        if block.size >= self.max_split_size:
            self._oversize["oversize_segments"].down(1)

    def _change(self, name: str, small: bool, amount: int) -> None:
        if amount > 0:
            for stat in self._pairs[name, small]:
                stat.up(amount)
        elif amount < 0:
            for stat in self._pairs[name, small]:
                stat.down(-amount)

    def _oom_message(self, nbytes: int) -> str:
        return _oom_message(self.ctx, nbytes, self.memory_allocated(), self.memory_reserved(), self.allowed)


_DEFAULTS: weakref.WeakKeyDictionary[Any, CachingAllocator] = weakref.WeakKeyDictionary()


def caching_allocator(ctx: Any) -> CachingAllocator:
    """The context's default CachingAllocator, made on first use with PYTORCH_CUDA_ALLOC_CONF (as torch.cuda has
    one allocator per device): what a program's modules share instead of each caching memory of its own."""
    allocator = _DEFAULTS.get(ctx)
    if allocator is None:
        allocator = _DEFAULTS[ctx] = CachingAllocator(ctx)
    return allocator
