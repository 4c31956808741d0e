# mpsd_client.torch_memory: torch.cuda.memory's functions over a context's caching allocator, against a real
# daemon: the figures move as PyTorch's do, the resets reset what PyTorch's reset, and a MemPool keeps its blocks.
from __future__ import annotations

import os

import pytest

from mpsd_client import torch_memory as memory

MiB = 1 << 20


@pytest.fixture
def current(ctx):
    memory.set_context(ctx)
    yield ctx
    memory.set_context(None)


def test_allocations_move_the_figures_and_the_resets_reset_what_pytorchs_do(current):
    p = memory.caching_allocator_alloc(1000)
    assert memory.memory_allocated() == 1024 and memory.memory_reserved() == 2 * MiB  # 512-byte steps, a small segment
    memory.caching_allocator_delete(p)
    assert memory.memory_allocated() == 0 and memory.max_memory_allocated() == 1024
    nested = memory.memory_stats_as_nested_dict()
    flat = memory.memory_stats()
    assert nested["allocated_bytes"]["all"]["peak"] == flat["allocated_bytes.all.peak"] == 1024
    assert nested["num_device_alloc"] == flat["num_device_alloc"] == 1
    memory.reset_peak_memory_stats()
    assert memory.max_memory_allocated() == 0 and memory.max_memory_reserved() == 2 * MiB
    memory.reset_accumulated_memory_stats()
    after = memory.memory_stats()
    assert after["allocation.all.allocated"] == after["allocation.all.freed"] == after["num_device_alloc"] == 0
    assert after["segment.all.current"] == 1  # what is held stays
    with pytest.warns(FutureWarning):
        assert memory.memory_cached() == memory.memory_reserved()
    with pytest.warns(FutureWarning):
        memory.reset_max_memory_allocated()
    memory.empty_cache()
    assert memory.memory_reserved() == 0
    assert memory.get_allocator_backend() == "native"
    free, total = memory.mem_get_info()
    assert 0 < free <= total


def test_the_fraction_and_the_process_list(current):
    assert memory.get_per_process_memory_fraction() == 1.0
    memory.set_per_process_memory_fraction(0.5)
    assert memory.get_per_process_memory_fraction() == pytest.approx(0.5)
    p = memory.caching_allocator_alloc(4 * MiB)
    gpu, line = memory.list_gpu_processes().splitlines()
    assert gpu == "GPU:0"
    assert line.split()[:2] == ["process", str(os.getpid())] and line.endswith(" MB GPU memory")
    assert float(line.split()[3]) >= memory.memory_reserved() / MiB  # what the daemon counts: segments and more
    memory.caching_allocator_delete(p)


def test_a_mem_pool_keeps_its_blocks_for_allocations_made_within_it(current):
    pool = memory.MemPool()
    assert pool.use_count() == 1 and pool.snapshot() == []
    with memory.use_mem_pool(pool):
        assert pool.use_count() == 2
        p = memory.caching_allocator_alloc(MiB)
    assert pool.use_count() == 1
    (segment,) = pool.snapshot()
    assert segment["blocks"][0]["address"] == p
    memory.caching_allocator_delete(p)
    q = memory.caching_allocator_alloc(MiB)  # outside: the shared cache, not the pool's free block
    assert q != p and memory.memory_reserved() == 4 * MiB
    memory.caching_allocator_delete(q)
    del pool
    memory.empty_cache()  # the pool is gone: its segment goes back too
    assert memory.memory_reserved() == 0


def test_a_device_is_the_current_context_or_one_given(current, ctx):
    assert memory.memory_allocated("cuda:0") == memory.memory_allocated(ctx) == memory.memory_allocated(0)
    with pytest.raises(ValueError, match="a context has one device"):
        memory.memory_allocated(1)
    memory.set_context(None)
    with pytest.raises(RuntimeError, match="set_context"):
        memory.memory_allocated()


def test_the_caching_host_allocator_rounds_caches_and_counts_as_pytorchs(current):
    """Pinned requests are rounded up to a power of two and served from the freed buffers of that size; the
    figures are host_memory_stats's keys, flat and nested; empty_cache gives the cached buffers back."""
    host = memory.host_allocator()
    assert host.allocate(0) is None
    first = host.allocate(1000)
    assert first.nbytes == 1024
    host.free(first)
    again = host.allocate(600)  # the same power of two: the cached buffer
    assert again is first
    other = host.allocate(1025)
    assert other.nbytes == 2048
    flat = memory.host_memory_stats()
    stats = [f"{name}.{kind}" for name in ("allocations", "allocated_bytes", "active_requests", "active_bytes")
             for kind in ("current", "peak", "allocated", "freed")]
    times = [f"host_{call}_time.{kind}" for call in ("alloc", "free")
             for kind in ("total", "max", "min", "count", "avg")]
    assert list(flat) == sorted([*stats, *times, "num_host_alloc", "num_host_free"])
    assert (flat["allocations.current"], flat["allocated_bytes.current"], flat["num_host_alloc"]) == (2, 3072, 2)
    assert (flat["active_requests.current"], flat["active_requests.allocated"], flat["active_bytes.peak"]) == \
        (2, 3, 3072)
    assert flat["host_alloc_time.count"] == 2 and flat["host_alloc_time.min"] > 0
    assert memory.host_memory_stats_as_nested_dict()["allocated_bytes"]["current"] == 3072
    host.free(again)
    host.free(other)
    with pytest.raises(ValueError, match="not handed out by this allocator"):
        host.free(other)
    memory.reset_peak_host_memory_stats()
    assert memory.host_memory_stats()["active_bytes.peak"] == 0
    host.empty_cache()
    after = memory.host_memory_stats()
    assert (after["allocations.current"], after["allocations.freed"], after["num_host_free"]) == (0, 2, 2)
    memory.reset_accumulated_host_memory_stats()
    reset = memory.host_memory_stats()
    assert reset["allocations.allocated"] == reset["num_host_alloc"] == reset["host_alloc_time.count"] == 0


def test_a_pinned_buffer_recorded_on_a_stream_is_reused_only_after_its_work(current):
    """record_stream: a buffer freed while a stream's work may still read it stays active, and the next request
    of its size gets a new buffer; once that work is done, the freed one is handed out again."""
    host = memory.host_allocator()
    s = current.create_stream()
    buffer = host.allocate(4096)
    current.launch("spin", 1, 32, [int(50 * 1.98e9)], stream=s)  # 50 simulated seconds: 0.5 s at --time-scale 100
    host.record_stream(buffer, s)
    host.free(buffer)
    fresh = host.allocate(4096)
    assert fresh is not buffer and memory.host_memory_stats()["active_requests.current"] == 2
    s.synchronize()
    assert host.allocate(4096) is buffer
    stats = memory.host_memory_stats()
    assert (stats["active_requests.current"], stats["allocations.current"]) == (2, 2)
    host.free(buffer)
    host.free(fresh)
    host.empty_cache()
