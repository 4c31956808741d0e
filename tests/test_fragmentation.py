# The seed article's fragmentation example (section 2.5) through each strategy of the caching allocator, on a
# device of exactly 1 GiB that counts bytes as CUDA's does (any free bytes can back a new allocation, wherever
# the earlier ones lie: the driver maps pages, so the device itself does not fragment), and the strategies on
# a real daemon.
from __future__ import annotations

import pytest

from mpsd_client import CachingAllocator
from mpsd_protocol import OutOfMemoryError

MiB = 1 << 20
GiB = 1 << 30
A, B = 256 * MiB, 128 * MiB


class OneGigabyte:
    """A 1 GiB device: allocations at rising addresses (never reused, as a virtual address space would not need
    to), refused past 1 GiB in use."""

    def __init__(self) -> None:
        self.total = GiB
        self.live: dict[int, int] = {}
        self.next = 1 << 40

    def malloc(self, nbytes: int) -> int:
        if sum(self.live.values()) + nbytes > self.total:
            raise OutOfMemoryError(f"{nbytes} bytes: the device is full")
        ptr, self.next = self.next, self.next + nbytes
        self.live[ptr] = nbytes
        return ptr

    def free(self, ptr: int) -> None:
        del self.live[ptr]

    def synchronize(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - sum(self.live.values()), self.total


def _after_freeing_a(strategy: str) -> tuple[CachingAllocator, OneGigabyte, int]:
    """A = 256 MiB, B = 128 MiB, free A; the allocator, its device and B's address. Buddy manages the whole
    gigabyte as one arena: the seed's picture, one address range that A, B and the holes share."""
    device = OneGigabyte()
    allocator = CachingAllocator(device, strategy=strategy, **({"arena": GiB} if strategy == "buddy" else {}))
    a = allocator.malloc(A)
    b = allocator.malloc(B)
    allocator.free(a)
    return allocator, device, b


def _power_of_two(nbytes: int) -> int:
    return 1 << (nbytes - 1).bit_length()


@pytest.mark.parametrize("strategy", ["pytorch", "buddy", "slab"])
def test_the_seeds_example_896_mib_free_after_freeing_a(strategy):
    """Whatever the strategy, 1 GiB less B is free once A is freed, in the cache or on the device; where it
    lies is what differs. PyTorch and slab keep A's 256 MiB segment cached and the device has the other 640 MiB
    (one free block each, no external fragmentation in the cache); buddy's arena holds all 896 MiB free, in
    blocks of 256 (A's, whose buddy B's half is split), 128 (B's buddy) and 512 MiB (the arena's upper half)."""
    allocator, device, _ = _after_freeing_a(strategy)
    stats = allocator.memory_stats()
    device_free = device.mem_get_info()[0]
    assert device_free + stats["fragmentation.free_bytes"] == GiB - B
    assert stats["allocated_bytes.all.current"] == B and stats["fragmentation.internal"] == 0
    if strategy == "buddy":
        assert device_free == 0 and stats["reserved_bytes.all.current"] == GiB
        assert sorted(b["size"] for s in allocator.memory_snapshot() for b in s["blocks"]
                      if b["state"] == "inactive") == [B, A, GiB // 2]
        assert stats["fragmentation.largest_free_block"] == GiB // 2
        assert stats["fragmentation.external"] == pytest.approx(1 - (GiB // 2) / (GiB - B))
    else:
        assert device_free == GiB - A - B and stats["fragmentation.largest_free_block"] == A
        assert stats["fragmentation.external"] == 0


def test_the_seeds_400_mib_request_fails_under_no_strategy():
    """The seed says 400 MiB cannot be had, but its own picture leaves the 640 MiB after B free in one piece, so
    every strategy serves it: PyTorch and slab with a new segment from the device (PyTorch of 400 MiB, slab of
    its size class, 448 MiB), no retry needed; buddy from its arena's free upper half, 512 MiB for 400 asked, so
    a fifth of what it hands out is rounding (internal fragmentation) and no new memory is reserved."""
    request = 400 * MiB
    for strategy in ("pytorch", "buddy", "slab"):
        allocator, device, _ = _after_freeing_a(strategy)
        allocator.malloc(request)
        stats = allocator.memory_stats()
        assert stats["num_alloc_retries"] == 0 and stats["num_ooms"] == 0
        assert stats["requested_bytes.all.current"] == B + request
        given = stats["allocated_bytes.all.current"] - B
        if strategy == "buddy":
            assert given == _power_of_two(request) and stats["num_device_alloc"] == 1
            assert stats["fragmentation.internal"] == pytest.approx(1 - (B + request) / (B + given))
        else:
            assert stats["num_device_alloc"] == 3 and stats["reserved_bytes.all.current"] == A + B + given
            assert request <= given <= request * 5 // 4  # the slab class is at most a quarter larger


def test_a_request_past_the_largest_free_piece_fails_where_free_memory_cannot_be_rejoined():
    """The seed's failure is real for requests larger than every free piece yet smaller than the 896 MiB free:
    700 MiB. Buddy fails it with 896 MiB free in its arena: the request rounds to 1 GiB, and A's hole cannot join
    the upper half while B sits between them. PyTorch's first device allocation fails too (640 MiB free), but it
    then gives A's cached segment back and retries: the device maps those bytes anywhere, so 896 MiB are one
    range to it. Slab does the same (its 768 MiB class fits once A's slab is gone). Past 896 MiB every strategy
    fails, with PyTorch's message."""
    request = 700 * MiB
    for strategy in ("pytorch", "slab"):
        allocator, device, b = _after_freeing_a(strategy)
        allocator.malloc(request)
        stats = allocator.memory_stats()
        assert stats["num_alloc_retries"] == 1 and stats["num_device_free"] == 1 and stats["num_ooms"] == 0
        assert stats["segment.all.current"] == 2  # B's and the new one
    allocator, device, b = _after_freeing_a("buddy")
    with pytest.raises(OutOfMemoryError, match=r"CUDA out of memory. Tried to allocate 1024.00 MiB.*Of the allocated "
                                               r"memory 128.00 MiB is allocated by PyTorch, and 896.00 MiB is "
                                               r"reserved by PyTorch but unallocated"):
        allocator.malloc(request)
    stats = allocator.memory_stats()
    assert stats["num_ooms"] == 1 and stats["num_alloc_retries"] == 1
    assert stats["fragmentation.free_bytes"] > request > stats["fragmentation.largest_free_block"]
    allocator.free(b)  # once B goes, its half merges back up to the whole arena, and the request fits
    allocator.malloc(request)
    assert allocator.memory_stats()["fragmentation.largest_free_block"] == 0
    for strategy in ("pytorch", "buddy", "slab"):
        allocator, device, b = _after_freeing_a(strategy)
        with pytest.raises(OutOfMemoryError):
            allocator.malloc(GiB - B + MiB)


def test_strategies_are_named_and_checked():
    """An unknown strategy, options the PyTorch strategy does not take, and a buddy arena that is not a power
    of two are refused when the allocator is made."""
    device = OneGigabyte()
    with pytest.raises(ValueError, match="strategy 'first-fit'"):
        CachingAllocator(device, strategy="first-fit")
    with pytest.raises(TypeError, match="arena"):
        CachingAllocator(device, arena=GiB)
    with pytest.raises(ValueError, match="power of two"):
        CachingAllocator(device, strategy="buddy", arena=3 * MiB)
    assert type(CachingAllocator(device, strategy="slab")).__name__ == "SlabAllocator"


@pytest.mark.parametrize("strategy", ["buddy", "slab"])
def test_on_a_daemon_each_strategy_serves_and_gives_everything_back(ctx, strategy):
    """On mpsd's device the segments are real allocations: memory written through a block reads back, the
    device's free memory falls by what the allocator reserved, and empty_cache returns all of it."""
    free_before = ctx.mem_get_info()[0]
    allocator = CachingAllocator(ctx, strategy=strategy)
    ptrs = [allocator.malloc(n) for n in (1000, 3 * MiB, 300_000, 12 * MiB, 1000)]
    assert len(set(ptrs)) == len(ptrs)
    data = bytes(range(256)) * 4
    ctx.memcpy_htod(ptrs[2], data)
    back = bytearray(len(data))
    ctx.memcpy_dtoh(back, ptrs[2])
    assert back == data
    assert free_before - ctx.mem_get_info()[0] >= allocator.memory_reserved() > 0
    for ptr in ptrs:
        allocator.free(ptr)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0 and ctx.mem_get_info()[0] == free_before
