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
