# Properties of the two client-side allocators under random traces (Hypothesis): a stream-ordered pool
# (mpsd_client._pools, driven as the core drives it, with reservations at addresses a daemon would give) and
# the caching allocator (over a device that hands out addresses from the bottom up). No two live allocations
# overlap, the figures are the sums of what is live and reserved, free ranges are merged, memory freed on one
# stream goes to another only as the reuse flags allow, and emptying gives back every unused segment.
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd_client import CachingAllocator
from mpsd_client._pools import ALIGN, FLAGS, RESERVE_STEP, MemPool, Ordering
from mpsd_protocol import Calls

MiB = 1 << 20
STREAMS = (0, 1, 2)
SIZES = st.one_of(st.integers(1, 64 << 10), st.integers(1, 8 * MiB), st.integers(30 * MiB, 70 * MiB))
POOL_STEPS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), SIZES, st.sampled_from(STREAMS)),
    st.tuples(st.just("free"), st.integers(0, 1 << 16), st.sampled_from(STREAMS)),
    st.tuples(st.just("wait"), st.sampled_from(STREAMS), st.sampled_from(STREAMS)),
    st.tuples(st.just("sync"), st.sampled_from(STREAMS)),
    st.tuples(st.just("trim"), st.integers(0, 128 * MiB))), min_size=5, max_size=60)


class Owner:
    """What the core does around a pool, without the daemon: reservations at rising addresses."""

    def __init__(self, flags: dict[str, bool]) -> None:
        self.pool = MemPool(None, default=True)  # type: ignore[arg-type]
        self.pool.flags.update(flags)
        self.order = Ordering()
        self.live: dict[int, tuple[object, int, int, int]] = {}  # address -> segment, rounded size, stream, asked
        self.next_base = 1 << 40
        self.events = 0

    def alloc(self, nbytes: int, stream: int) -> tuple[int, list[int]]:
        size = -(-nbytes // ALIGN) * ALIGN
        found = self.pool.take(size, nbytes, stream, self.order)
        if found is None:
            grow = -(-size // RESERVE_STEP) * RESERVE_STEP
            self.pool.add(self.next_base, grow)
            self.next_base += grow + RESERVE_STEP  # reservations need not touch
            found = self.pool.take(size, nbytes, stream, self.order)
        assert found is not None
        addr, segment, after = found
        self.live[addr] = (segment, size, stream, nbytes)
        return addr, after

    def free(self, addr: int, stream: int) -> None:
        segment, size, _, nbytes = self.live.pop(addr)
        self.pool.give_back(segment, addr, size, nbytes, stream, self.order.freed(stream))

    def wait(self, waiter: int, recorder: int) -> None:
        """An event recorded on `recorder`, then `waiter` waits for it."""
        self.events += 1
        self.order.observe(Calls.event_record, {"event": self.events, "stream": recorder})
        self.order.observe(Calls.stream_wait_event, {"event": self.events, "stream": waiter})

    def check(self) -> None:
        pool = self.pool
        assert pool.used == sum(nbytes for *_, nbytes in self.live.values())
        assert pool.reserved == sum(s.size for s in pool.segments)
        spans = sorted([(a, a + size) for a, (_, size, *_) in self.live.items()]
                       + [(r.addr, r.addr + r.size) for s in pool.segments for r in s.free])
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "ranges overlap"
        for segment in pool.segments:
            mine = [(a, size) for a, (s, size, *_) in self.live.items() if s is segment]
            assert segment.live == len(mine)
            assert sum(size for _, size in mine) + sum(r.size for r in segment.free) == segment.size
            assert all(segment.base <= a and a + size <= segment.base + segment.size for a, size in mine)
            assert all(low.addr + low.size < high.addr for low, high in zip(segment.free, segment.free[1:])), \
                "free neighbours not merged"


@settings(max_examples=60, deadline=None)
@given(POOL_STEPS, st.fixed_dictionaries({flag: st.booleans() for flag in FLAGS}))
def test_a_pools_ranges_never_overlap_and_its_figures_add_up(steps, flags):
    """Whatever the trace and the flags: no overlap, used and reserved are the sums, the free ranges and the
    live allocations tile every reservation, and freeing all and trimming to 0 gives every byte back."""
    owner = Owner(flags)
    for step in steps:
        kind = step[0]
        if kind == "alloc":
            _, nbytes, stream = step
            _, after = owner.alloc(nbytes, stream)
            assert stream not in after
            assert not after or flags["reuse_allow_internal_dependencies"]
        elif kind == "free" and owner.live:
            owner.free(sorted(owner.live)[step[1] % len(owner.live)], step[2])
        elif kind == "wait":
            owner.wait(step[1], step[2])
        elif kind == "sync":
            owner.order.observe(Calls.stream_synchronize, {"stream": step[1]})
        elif kind == "trim":
            kept = owner.pool.reserved
            gone = owner.pool.unused(step[1])
            assert owner.pool.reserved >= min(step[1], kept) or not gone
        owner.check()
    for addr, (_, _, stream, _) in list(owner.live.items()):
        owner.free(addr, stream)
    owner.pool.unused(0)
    assert owner.pool.reserved == 0 and owner.pool.used == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4 * MiB), st.sampled_from((1, 2))), min_size=1, max_size=12),
       st.booleans())
def test_memory_freed_on_one_stream_goes_to_another_only_as_the_flags_allow(sizes, follow):
    """With internal dependencies and opportunistic reuse off, stream 2 gets none of what stream 1 freed, until
    it waits for an event recorded on stream 1 after the frees (if it follows event dependencies)."""
    owner = Owner({"reuse_allow_internal_dependencies": False, "reuse_allow_opportunistic": False,
                   "reuse_follow_event_dependencies": follow})
    first = [owner.alloc(nbytes, 1)[0] for nbytes, _ in sizes]
    freed = {a: owner.live[a][1] for a in first}
    for addr in first:
        owner.free(addr, 1)

    def reused(addr: int, size: int) -> bool:
        return any(a <= addr < a + n or addr <= a < addr + size for a, n in freed.items())

    for nbytes, _ in sizes:
        addr, _ = owner.alloc(nbytes, 2)
        assert not reused(addr, owner.live[addr][1])
    owner.wait(2, 1)
    addr, _ = owner.alloc(sizes[0][0], 2)
    assert reused(addr, owner.live[addr][1]) == follow
    owner.check()


class Device:
    """Addresses from the bottom up, with a gap between segments, and nothing to wait for."""

    def __init__(self) -> None:
        self.next = 1 << 40
        self.live: set[int] = set()

    def malloc(self, nbytes: int) -> int:
        self.next += nbytes + (2 << 20)
        self.live.add(self.next - nbytes - (2 << 20))
        return self.next - nbytes - (2 << 20)

    def free(self, ptr: int) -> None:
        self.live.remove(ptr)

    def synchronize(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        return 1 << 30, 1 << 34


CACHE_STEPS = st.lists(st.one_of(
    st.tuples(st.just("malloc"), SIZES, st.sampled_from((None, 1))),
    st.tuples(st.just("free"), st.integers(0, 1 << 16)),
    st.tuples(st.just("empty_cache"))), min_size=5, max_size=60)


@settings(max_examples=60, deadline=None)
@given(CACHE_STEPS, st.sampled_from(["", "max_split_size_mb:24", "roundup_power2_divisions:4"]))
def test_the_caching_allocators_statistics_are_the_sums_of_its_blocks(steps, config):
    """No two blocks overlap and they tile their segments; the statistics are the sums of the snapshot's blocks
    and segments; the device holds exactly the segments; empty_cache leaves no segment without an active block."""
    device = Device()
    allocator = CachingAllocator(device, config=config)
    live: list[int] = []
    for step in steps:
        if step[0] == "malloc":
            live.append(allocator.malloc(step[1], step[2]))
        elif step[0] == "free" and live:
            allocator.free(live.pop(step[1] % len(live)))
        elif step[0] == "empty_cache":
            allocator.empty_cache()
            assert all(any(b["state"] != "inactive" for b in s["blocks"]) for s in allocator.memory_snapshot())
        segments = allocator.memory_snapshot()
        stats = allocator.memory_stats()
        blocks = [b for s in segments for b in s["blocks"]]
        for s in segments:
            ends = [b["address"] + b["size"] for b in s["blocks"]]
            assert [b["address"] for b in s["blocks"]] == [s["address"]] + ends[:-1]
            assert ends[-1] == s["address"] + s["total_size"]
        allocated = [b for b in blocks if b["state"] == "active_allocated"]
        assert sorted(b["address"] for b in allocated) == sorted(live)
        assert stats["allocated_bytes.all.current"] == sum(b["size"] for b in allocated)
        assert stats["requested_bytes.all.current"] == sum(b["requested_size"] for b in allocated)
        assert stats["reserved_bytes.all.current"] == sum(s["total_size"] for s in segments)
        assert stats["segment.all.current"] == len(segments) and device.live == {s["address"] for s in segments}
        _check_fragmentation(stats, segments)
    for ptr in live:
        allocator.free(ptr)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0 and not device.live


def _check_fragmentation(stats: dict, segments: list[dict]) -> None:
    """mpsd's fragmentation figures are what the snapshot's blocks give: free bytes and the largest free block
    over the inactive blocks, external = 1 - largest / free, internal = 1 - requested / allocated."""
    free = [b["size"] for s in segments for b in s["blocks"] if b["state"] == "inactive"]
    allocated = [b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
    assert stats["fragmentation.free_bytes"] == sum(free) == stats["reserved_bytes.all.current"] \
        - stats["active_bytes.all.current"]
    assert stats["fragmentation.largest_free_block"] == max(free, default=0)
    if free:
        assert stats["fragmentation.external"] == pytest.approx(1 - max(free) / sum(free))
    else:
        assert stats["fragmentation.external"] == 0
    size, asked = sum(b["size"] for b in allocated), sum(b["requested_size"] for b in allocated)
    assert 0 <= stats["fragmentation.internal"] < 1 and 0 <= stats["fragmentation.external"] < 1
    assert stats["fragmentation.internal"] == (pytest.approx(1 - asked / size) if size else 0)


@settings(max_examples=40, deadline=None)
@given(CACHE_STEPS, st.sampled_from(["pytorch", "buddy", "slab"]))
def test_every_strategys_blocks_tile_its_segments_and_its_figures_add_up(steps, strategy):
    """For PyTorch's rules, buddy and slab alike: blocks tile their segments without overlap, the statistics and
    the fragmentation figures are the sums of the snapshot's blocks, and empty_cache after freeing everything
    gives every segment back. Buddy's blocks are powers of two aligned to their size in the arena, and no free
    block's buddy is free and whole (it would have merged); a slab's blocks are all of its one size class."""
    device = Device()
    allocator = CachingAllocator(device, strategy=strategy)
    live: list[int] = []
    for step in steps:
        if step[0] == "malloc":
            live.append(allocator.malloc(step[1], step[2]))
        elif step[0] == "free" and live:
            allocator.free(live.pop(step[1] % len(live)))
        elif step[0] == "empty_cache":
            allocator.empty_cache()
        segments = allocator.memory_snapshot()
        stats = allocator.memory_stats()
        blocks = [b for s in segments for b in s["blocks"]]
        for s in segments:
            ends = [b["address"] + b["size"] for b in s["blocks"]]
            assert [b["address"] for b in s["blocks"]] == [s["address"]] + ends[:-1]
            assert ends[-1] == s["address"] + s["total_size"]
            offsets = {b["address"] - s["address"]: b for b in s["blocks"]}
            if strategy == "buddy":
                for offset, b in offsets.items():
                    assert b["size"] & (b["size"] - 1) == 0 and offset % b["size"] == 0
                    buddy = offsets.get(offset ^ b["size"])
                    assert not (b["state"] == "inactive" and buddy is not None and buddy["state"] == "inactive"
                                and buddy["size"] == b["size"] and b["size"] < s["total_size"]), "buddies unmerged"
            elif strategy == "slab":
                assert len({b["size"] for b in s["blocks"]}) == 1
        allocated = [b for b in blocks if b["state"] == "active_allocated"]
        assert sorted(b["address"] for b in allocated) == sorted(live)
        assert all(b["requested_size"] <= b["size"] for b in allocated)
        assert stats["allocated_bytes.all.current"] == sum(b["size"] for b in allocated)
        assert stats["requested_bytes.all.current"] == sum(b["requested_size"] for b in allocated)
        assert stats["reserved_bytes.all.current"] == sum(s["total_size"] for s in segments)
        assert stats["segment.all.current"] == len(segments) and device.live == {s["address"] for s in segments}
        assert stats["inactive_split_bytes.all.current"] <= stats["fragmentation.free_bytes"]
        _check_fragmentation(stats, segments)
    for ptr in live:
        allocator.free(ptr)
    stats = allocator.memory_stats()
    assert stats["fragmentation.internal"] == 0 and stats["inactive_split.all.current"] == 0
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0 and not device.live
    assert allocator.memory_stats()["fragmentation.free_bytes"] == 0


class VirtualDevice(Device):
    """Device with the driver's virtual memory calls, which checks CUDA's rules as the daemon does: whole pages,
    no page mapped twice, nothing unmapped that is not mapped, no range freed while mapped."""

    PAGE = 2 << 20

    def __init__(self) -> None:
        super().__init__()
        self.reserved: dict[int, int] = {}  # base -> size
        self.mapped: dict[int, int] = {}  # address of each mapped page -> its handle
        self.handles: dict[int, int] = {}  # live handle -> size
        self.maps: dict[int, int] = {}  # address of each mapping -> its size (a segment's page: 2 or 20 MiB)
        self.next_va, self.next_handle = 1 << 47, 1

    def mem_address_reserve(self, size: int, alignment: int = 0) -> int:
        assert size % self.PAGE == 0
        base, self.next_va = self.next_va, self.next_va + size + self.PAGE
        self.reserved[base] = size
        return base

    def mem_address_free(self, ptr: int, size: int) -> None:
        assert self.reserved.pop(ptr) == size and not any(ptr <= p < ptr + size for p in self.mapped)

    def mem_create(self, size: int) -> int:
        assert size % self.PAGE == 0
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.handles[handle] = size
        return handle

    def mem_release(self, handle: int) -> None:
        del self.handles[handle]

    def mem_map(self, ptr: int, size: int, offset: int, handle: int) -> None:
        assert offset == 0 and size == self.handles[handle] and ptr % self.PAGE == 0
        assert any(base <= ptr and ptr + size <= base + n for base, n in self.reserved.items())
        for page in range(ptr, ptr + size, self.PAGE):
            assert page not in self.mapped
            self.mapped[page] = handle
        self.maps[ptr] = size

    def mem_unmap(self, ptr: int, size: int) -> None:
        assert self.maps.pop(ptr) == size  # whole mappings only
        for page in range(ptr, ptr + size, self.PAGE):
            del self.mapped[page]


@settings(max_examples=60, deadline=None)
@given(CACHE_STEPS)
def test_expandable_segments_map_exactly_what_their_blocks_hold(steps):
    """With expandable_segments: blocks never overlap and tile each mapped run, which the snapshot shows as one
    expandable segment; reserved_bytes is what the device has mapped, and every mapped page lies in a shown
    segment; one reservation per stream and pool; "segment" counts none of them; after empty_cache no mapped
    page lies wholly in free blocks; at the end everything is unmapped, released and the ranges freed."""
    device = VirtualDevice()
    allocator = CachingAllocator(device, config="expandable_segments:True")
    live: list[int] = []
    for step in steps:
        if step[0] == "malloc":
            live.append(allocator.malloc(step[1], step[2]))
        elif step[0] == "free" and live:
            allocator.free(live.pop(step[1] % len(live)))
        elif step[0] == "empty_cache":
            allocator.empty_cache()
            for page, size in device.maps.items():
                assert any(b["state"] != "inactive" and b["address"] < page + size
                           and page < b["address"] + b["size"]
                           for s in allocator.memory_snapshot() for b in s["blocks"]), "a free page stayed mapped"
        segments = allocator.memory_snapshot()
        stats = allocator.memory_stats()
        assert all(s["is_expandable"] for s in segments)
        shown = sorted((s["address"], s["address"] + s["total_size"]) for s in segments)
        assert all(end <= start for (_, end), (start, _) in zip(shown, shown[1:]))  # no two overlap
        for s in segments:
            ends = [b["address"] + b["size"] for b in s["blocks"]]
            assert [b["address"] for b in s["blocks"]] == [s["address"]] + ends[:-1]
            assert ends[-1] == s["address"] + s["total_size"]
        assert {p for start, end in shown for p in range(start, end, device.PAGE)} == set(device.mapped)
        allocated = [b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
        assert sorted(b["address"] for b in allocated) == sorted(live)
        assert stats["allocated_bytes.all.current"] == sum(b["size"] for b in allocated)
        assert stats["requested_bytes.all.current"] == sum(b["requested_size"] for b in allocated)
        assert stats["reserved_bytes.all.current"] == len(device.mapped) * device.PAGE \
            == sum(s["total_size"] for s in segments)
        assert stats["segment.all.current"] == 0 and stats["inactive_split.all.current"] == 0
        assert len(device.reserved) <= len({(s["stream"], s["segment_type"]) for s in segments}) + 2
        _check_fragmentation(stats, segments)
    for ptr in live:
        allocator.free(ptr)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0 and not device.mapped and not device.handles and not device.reserved


class EventDevice(VirtualDevice):
    """A device whose events complete only when the test says the side stream's work is done (a "sync")."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = self.done = 0

    def create_event(self, disable_timing: bool = False) -> "_Event":
        return _Event(self)

    def synchronize(self) -> None:
        self.done = self.clock


class _Event:
    def __init__(self, device: EventDevice) -> None:
        self.device, self.at = device, 0

    def record(self, stream: object) -> None:
        self.device.clock += 1
        self.at = self.device.clock

    def query(self) -> bool:
        return self.device.done >= self.at

    def synchronize(self) -> None:
        self.device.done = max(self.device.done, self.at)


SIDE = 7  # the stream record_stream names: no allocation is made on it
STREAM_STEPS = st.lists(st.one_of(
    st.tuples(st.just("malloc"), SIZES, st.sampled_from((None, 1))),
    st.tuples(st.just("free"), st.integers(0, 1 << 16)),
    st.tuples(st.just("record"), st.integers(0, 1 << 16)),
    st.tuples(st.just("sync")),
    st.tuples(st.just("empty_cache"))), min_size=5, max_size=60)


@settings(max_examples=40, deadline=None)
@given(STREAM_STEPS, st.sampled_from([("pytorch", ""), ("pytorch", "expandable_segments:True"), ("buddy", None),
                                      ("slab", None)]))
def test_no_strategy_hands_out_a_block_before_its_streams_are_done(steps, strategy):
    """Under every strategy, a block freed after record_stream is never handed out again while the side stream's
    event is pending; it is active_pending_free, counted active but not allocated; the figures stay the sums of
    the snapshot's blocks; empty_cache waits for the events, and at the end everything goes back."""
    device = EventDevice()
    name, config = strategy
    allocator = CachingAllocator(device, strategy=name, **({"config": config} if config is not None else {}))
    live: list[int] = []
    recorded: set[int] = set()
    waiting: set[int] = set()  # freed addresses whose side-stream event has not completed
    for step in steps:
        if step[0] == "malloc":
            ptr = allocator.malloc(step[1], step[2])
            assert ptr not in waiting, "a block was reused before its stream's event completed"
            live.append(ptr)
        elif step[0] == "free" and live:
            ptr = live.pop(step[1] % len(live))
            allocator.free(ptr)
            if ptr in recorded:
                recorded.discard(ptr)
                waiting.add(ptr)
        elif step[0] == "record" and live:
            ptr = live[step[1] % len(live)]
            allocator.record_stream(ptr, SIDE)
            recorded.add(ptr)
        elif step[0] == "sync":
            device.synchronize()
            waiting.clear()
        elif step[0] == "empty_cache":
            allocator.empty_cache()
            waiting.clear()
        blocks = [b for s in allocator.memory_snapshot() for b in s["blocks"]]
        states = {b["address"]: b["state"] for b in blocks}
        assert all(states[ptr] == "active_pending_free" for ptr in waiting)
        stats = allocator.memory_stats()
        assert stats["allocated_bytes.all.current"] == sum(b["size"] for b in blocks
                                                           if b["state"] == "active_allocated")
        assert stats["active_bytes.all.current"] == sum(b["size"] for b in blocks if b["state"] != "inactive")
        assert stats["active.all.current"] == sum(1 for b in blocks if b["state"] != "inactive")
    for ptr in live:
        allocator.free(ptr)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0 and allocator.memory_stats()["active.all.current"] == 0
