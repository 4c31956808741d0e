# PyTorch's expandable_segments, through the daemon's virtual memory calls: hand-built traces with the outcomes
# PyTorch's source gives (c10/cuda/CUDACachingAllocator.cpp): one segment
# per stream and pool that grows at its end in 20 MiB pages (2 MiB in the small pool), at the same addresses;
# free whole pages unmapped by empty_cache wherever they lie; one snapshot segment per run of mapped memory.
# PyTorch's own traces with the option, recorded on the H200, are replayed in tests/test_caching_allocator.py.
from __future__ import annotations

import numpy as np
import pytest

import mpsd_client
from daemons import start_daemon
from mpsd_client import CachingAllocator
from mpsd_protocol import OutOfMemoryError

MiB = 1 << 20
CONFIG = "expandable_segments:True"


def _segments(allocator):
    return [(s["address"], s["total_size"], s["segment_type"], s["is_expandable"], s["stream"])
            for s in allocator.memory_snapshot()]


def test_a_segment_grows_in_place_by_mapping_pages_at_its_end(ctx):
    """10 MiB, 50 MiB, 10 MiB: three blocks back to back in one segment, which maps one 20 MiB page for the first,
    two more for the second (what the first page left plus 40 MiB), one for the third: 80 MiB reserved, three
    device allocations (one per map), and no "segment" counted (PyTorch counts only cudaMalloc's)."""
    allocator = CachingAllocator(ctx, config=CONFIG)
    free0 = ctx.mem_get_info()[0]
    a = allocator.malloc(10 * MiB)
    b = allocator.malloc(50 * MiB)
    c = allocator.malloc(10 * MiB)
    assert (b - a, c - b) == (10 * MiB, 50 * MiB)
    stats = allocator.memory_stats()
    assert stats["reserved_bytes.all.current"] == stats["reserved_bytes.large_pool.current"] == 80 * MiB
    assert (stats["num_device_alloc"], stats["segment.all.current"], stats["inactive_split.all.current"]) == (3, 0, 0)
    assert free0 - ctx.mem_get_info()[0] == 80 * MiB  # the device charged what was mapped, no more
    assert _segments(allocator) == [(a, 80 * MiB, "large", True, 0)]
    states = [(b_["address"], b_["size"], b_["state"]) for b_ in allocator.memory_snapshot()[0]["blocks"]]
    assert states == [(a, 10 * MiB, "active_allocated"), (b, 50 * MiB, "active_allocated"),
                      (c, 10 * MiB, "active_allocated"), (c + 10 * MiB, 10 * MiB, "inactive")]


def test_empty_cache_unmaps_free_whole_pages_anywhere_and_regrows_at_the_same_addresses(ctx):
    """Freeing the 50 MiB block in the middle and emptying the cache unmaps the two whole pages inside it
    (one num_device_free for the one block), which splits the snapshot into two mapped runs; a 30 MiB request
    then grows into the hole at the old block's address. Freeing everything gives the range back."""
    allocator = CachingAllocator(ctx, config=CONFIG)
    free0 = ctx.mem_get_info()[0]
    a, b, c = allocator.malloc(10 * MiB), allocator.malloc(50 * MiB), allocator.malloc(10 * MiB)
    allocator.free(b)
    allocator.empty_cache()
    stats = allocator.memory_stats()
    assert (stats["reserved_bytes.all.current"], stats["num_device_free"]) == (40 * MiB, 1)
    assert _segments(allocator) == [(a, 20 * MiB, "large", True, 0), (c, 20 * MiB, "large", True, 0)]
    again = allocator.malloc(30 * MiB)
    assert again == b and allocator.memory_reserved() == 60 * MiB
    assert _segments(allocator) == [(a, 40 * MiB, "large", True, 0), (c, 20 * MiB, "large", True, 0)]  # one page mapped
    for ptr in (a, c, again):
        allocator.free(ptr)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0 and allocator.memory_snapshot() == []
    assert ctx.mem_get_info()[0] == free0


def test_each_stream_and_pool_has_its_own_segment(ctx):
    """A small allocation grows a small-pool segment in 2 MiB pages; another stream gets segments of its own."""
    allocator = CachingAllocator(ctx, expandable_segments=True)
    side = ctx.create_stream()
    small = [allocator.malloc(600 << 10) for _ in range(4)]  # 2.4 MiB in all: two 2 MiB pages
    large = allocator.malloc(3 * MiB)
    other = allocator.malloc(3 * MiB, side)
    assert [s - small[0] for s in small] == [0, 600 << 10, 1200 << 10, 1800 << 10]
    stats = allocator.memory_stats()
    assert stats["reserved_bytes.small_pool.current"] == 4 * MiB
    assert stats["reserved_bytes.large_pool.current"] == 40 * MiB
    assert sorted(_segments(allocator)) == sorted([(small[0], 4 * MiB, "small", True, 0),
                                                   (large, 20 * MiB, "large", True, 0),
                                                   (other, 20 * MiB, "large", True, side.handle)])


def test_blocks_of_a_grown_segment_are_device_memory_kernels_can_use_across_pages(ctx):
    """A 30 MiB block across two mapped 20 MiB pages is one buffer for a kernel and a copy."""
    allocator = CachingAllocator(ctx, config=CONFIG)
    allocator.malloc(15 * MiB)
    ptr = allocator.malloc(30 * MiB)
    count = 30 * MiB // 4
    ctx.launch("fill_f32", 1024, 256, [ptr, 2.5, count])
    out = bytearray(4 * 8)
    ctx.memcpy_dtoh(out, ptr + 5 * MiB - 16)  # across the boundary between the first and the second page
    assert np.frombuffer(bytes(out), np.float32).tolist() == [2.5] * 8


def test_large_blocks_split_to_512_bytes_and_best_fit_prefers_what_cannot_grow(ctx):
    """With expandable segments a large block is split whenever 512 bytes or more are left (PyTorch's
    should_split), and among free blocks best fit treats the growing end as large as it could grow, so a
    free block inside the segment is taken before the free end."""
    allocator = CachingAllocator(ctx, config=CONFIG)
    a = allocator.malloc(2 * MiB)
    b = allocator.malloc(int(1.5 * MiB))
    c = allocator.malloc(3 * MiB)
    allocator.free(b)  # a 1.5 MiB hole between a and c; after c, 13.5 MiB free at the growing end
    d = allocator.malloc(int(1.2 * MiB))
    assert d == b  # the hole, though the end's block would fit too
    blocks = [(x["size"], x["state"]) for x in allocator.memory_snapshot()[0]["blocks"]]
    assert blocks[:3] == [(2 * MiB, "active_allocated"), (-(-int(1.2 * MiB) // 512) * 512, "active_allocated"),
                          (int(1.5 * MiB) - -(-int(1.2 * MiB) // 512) * 512, "inactive")]
    assert c == a + 2 * MiB + int(1.5 * MiB)


def test_a_request_past_the_device_empties_the_cache_retries_and_raises_pytorchs_error(daemon_factory):
    """When the device has no room for the pages, cached free pages are unmapped and the map retried
    (num_alloc_retries), then OutOfMemoryError with PyTorch's message; nothing is left half-mapped. (Under a
    pinned limit of 1 GiB, so that finding the device full takes tens of mem_create calls, not thousands.)"""
    daemon = start_daemon("--time-scale", "100", "--pinned-mem-limit", "1G")
    daemon_factory.append(daemon)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        allocator = CachingAllocator(ctx, config=CONFIG)
        cached = allocator.malloc(200 * MiB)
        allocator.free(cached)
        free = ctx.mem_get_info()[0]
        with pytest.raises(OutOfMemoryError, match="CUDA out of memory. Tried to allocate"):
            allocator.malloc(free + 300 * MiB)
        stats = allocator.memory_stats()
        assert (stats["num_alloc_retries"], stats["num_ooms"], allocator.memory_reserved()) == (1, 1, 0)
        assert ctx.mem_get_info()[0] == free + 200 * MiB
        assert allocator.malloc(free) == cached  # the segment's range is given back, and taken again


def test_the_option_takes_only_true_or_false():
    """PyTorch takes expandable_segments:True or :False; anything else is an error, not a silent default."""
    with pytest.raises(ValueError):
        CachingAllocator(None, config="expandable_segments:yes")
    with pytest.raises(TypeError):
        CachingAllocator(None, strategy="buddy", expandable_segments=True)


def test_history_records_each_map_and_unmap(ctx, tmp_path):
    """With history on, each map and unmap is a segment_map or segment_unmap event (what memory_viz draws for
    expandable segments), with its address and bytes; the dumped snapshot carries them."""
    import pickle
    allocator = CachingAllocator(ctx, config=CONFIG)
    allocator._record_memory_history()
    a = allocator.malloc(10 * MiB)
    b = allocator.malloc(50 * MiB)
    allocator.free(b)
    allocator.empty_cache()
    events = [(e["action"], e["addr"] - a, e["size"] >> 20) for e in allocator._snapshot()["device_traces"][0]
              if e["action"].startswith("segment")]
    assert events == [("segment_map", 0, 20), ("segment_map", 20 * MiB, 40), ("segment_unmap", 20 * MiB, 40)]
    assert allocator.memory_snapshot()[0]["frames"]  # the segment's first map's stack
    allocator._dump_snapshot(str(tmp_path / "snapshot.pickle"))
    dumped = pickle.loads((tmp_path / "snapshot.pickle").read_bytes())
    assert dumped["segments"][0]["is_expandable"]
    assert [e["action"] for e in dumped["device_traces"][0]] == [
        "segment_map", "alloc", "segment_map", "alloc", "free_requested", "free_completed", "segment_unmap"]
