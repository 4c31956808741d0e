# The driver's virtual memory calls (mpsd.runtime.vmm) on the simulated device, in-process: reserved address
# ranges, physical memory charged as cudaMalloc's, mappings that kernels, copies and host_view see as one range
# across pieces, CUDA_ERROR_INVALID_VALUE for misuse, and an illegal address for work on an unmapped page.
from __future__ import annotations

import numpy as np
import pytest
import trio

from mpsd_protocol import IllegalAddressError, InvalidValueError, OutOfMemoryError

MiB = 1 << 20
PAGE = 2 * MiB


async def test_granularity_is_the_h200s_two_mebibytes(actx):
    """cuMemGetAllocationGranularity gives 2 MiB on the H200; every size here is a multiple of it."""
    assert await actx.mem_get_allocation_granularity() == PAGE


async def test_pieces_mapped_side_by_side_are_one_range_for_kernels_copies_and_host_view(actx):
    """Two physical allocations mapped at consecutive pages of a reservation: a kernel and a copy across the
    boundary see one buffer, and host_view of each piece sees the bytes the kernel wrote."""
    va = await actx.mem_address_reserve(8 * PAGE)
    first, second = await actx.mem_create(PAGE), await actx.mem_create(PAGE)
    await actx.mem_map(va, PAGE, 0, first)
    await actx.mem_map(va + PAGE, PAGE, 0, second)
    count = 2 * PAGE // 4
    await actx.launch("fill_f32", 64, 256, [va, 3.0, count])
    out = bytearray(64)
    await actx.memcpy_dtoh(out, va + PAGE - 32)  # straddles the two pieces
    assert np.frombuffer(bytes(out), np.float32).tolist() == [3.0] * 16
    await actx.memcpy_htod(va + PAGE - 4, np.array([7.0, 8.0], np.float32).tobytes())
    tail = await actx.host_view(va + PAGE - 4)  # a view ends where its piece's mapping does
    head = await actx.host_view(va + PAGE)
    assert len(tail) == 4 and np.frombuffer(bytes(tail), np.float32)[0] == 7.0
    assert np.frombuffer(bytes(head[:4]), np.float32)[0] == 8.0
    await actx.mem_unmap(va + PAGE, PAGE)
    with pytest.raises(InvalidValueError):  # nothing is mapped there any more: no view, and no stale one
        await actx.host_view(va + PAGE)


async def test_physical_memory_keeps_its_bytes_and_can_be_mapped_twice(actx):
    """As cuMemCreate's memory: mapped at two addresses it shows the same bytes, and unmapping one mapping
    loses nothing."""
    va = await actx.mem_address_reserve(4 * PAGE)
    handle = await actx.mem_create(PAGE)
    await actx.mem_map(va, PAGE, 0, handle)
    await actx.mem_map(va + 2 * PAGE, PAGE, 0, handle)
    await actx.memcpy_htod(va + 100, b"shared")
    await actx.mem_unmap(va, PAGE)
    out = bytearray(6)
    await actx.memcpy_dtoh(out, va + 2 * PAGE + 100)
    assert bytes(out) == b"shared"


async def test_memory_is_charged_when_made_and_freed_when_released_and_unmapped(actx):
    """mem_create charges as cudaMalloc does; the memory stays charged while a mapping holds it after its
    handle is released, and goes with the last unmapping. A reservation costs nothing."""
    free0, _ = await actx.mem_get_info()
    va = await actx.mem_address_reserve(64 * PAGE)
    assert (await actx.mem_get_info())[0] == free0
    handle = await actx.mem_create(3 * PAGE)
    assert (await actx.mem_get_info())[0] == free0 - 3 * PAGE
    await actx.mem_map(va, 3 * PAGE, 0, handle)
    await actx.mem_release(handle)
    assert (await actx.mem_get_info())[0] == free0 - 3 * PAGE
    await actx.mem_unmap(va, 3 * PAGE)
    assert (await actx.mem_get_info())[0] == free0
    await actx.mem_address_free(va, 64 * PAGE)


async def test_physical_memory_counts_against_the_pinned_limit(served):
    """Past the client's pinned device memory limit mem_create fails as cudaMalloc does."""
    async with served.connect(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=1G") as ctx:
        free, total = await ctx.mem_get_info()
        assert free < total
        handle = await ctx.mem_create(free // PAGE * PAGE)
        with pytest.raises(OutOfMemoryError):
            await ctx.mem_create(PAGE)
        await ctx.mem_release(handle)
        await ctx.mem_create(PAGE)


@pytest.mark.parametrize("call, args", [
    ("mem_address_reserve", (PAGE + 512,)),
    ("mem_address_reserve", (0,)),
    ("mem_address_reserve", (PAGE, 3)),
    ("mem_create", (MiB,)),
    ("map_unaligned", ()),
    ("map_beyond_memory", ()),
    ("map_over_mapped", ()),
    ("map_outside_reservation", ()),
    ("unmap_part_of_a_mapping", ()),
    ("unmap_unmapped", ()),
    ("free_while_mapped", ()),
    ("free_wrong_size", ()),
    ("release_twice", ()),
])
async def test_misuse_is_an_invalid_value(actx, call, args):
    """What the driver answers CUDA_ERROR_INVALID_VALUE for: sizes and addresses not whole pages, mappings out
    of bounds or over mapped pages, unmapping part of a mapping or nothing, freeing a reservation still mapped
    or by the wrong size, a handle released already."""
    va = await actx.mem_address_reserve(4 * PAGE)
    handle = await actx.mem_create(2 * PAGE)
    cases = {
        "map_unaligned": lambda: actx.mem_map(va + 4096, PAGE, 0, handle),
        "map_beyond_memory": lambda: actx.mem_map(va, 2 * PAGE, PAGE, handle),
        "map_over_mapped": lambda: actx.mem_map(va + PAGE, PAGE, 0, handle),
        "map_outside_reservation": lambda: actx.mem_map(va + 3 * PAGE, 2 * PAGE, 0, handle),
        "unmap_part_of_a_mapping": lambda: actx.mem_unmap(va, PAGE),
        "unmap_unmapped": lambda: actx.mem_unmap(va + 2 * PAGE, PAGE),
        "free_while_mapped": lambda: actx.mem_address_free(va, 4 * PAGE),
        "free_wrong_size": lambda: actx.mem_address_free(va, 2 * PAGE),
        "release_twice": lambda: actx.mem_release(handle),
    }
    await actx.mem_map(va, 2 * PAGE, 0, handle)
    if call == "release_twice":
        await actx.mem_release(handle)
    with pytest.raises(InvalidValueError):
        if call in cases:
            await cases[call]()
        else:
            await getattr(actx, call)(*args)


async def test_a_kernel_on_an_unmapped_page_is_an_illegal_address(served):
    """A launch whose buffer reaches past the mapped pages into unmapped ones faults when it runs, sticky, as
    today's bounds checks make any pointer outside live memory."""
    async with served.connect() as ctx:
        va = await ctx.mem_address_reserve(4 * PAGE)
        handle = await ctx.mem_create(PAGE)
        await ctx.mem_map(va, PAGE, 0, handle)
        await ctx.launch("fill_f32", 64, 256, [va, 1.0, PAGE // 4])  # exactly the mapped page: fine
        await ctx.synchronize()
        await ctx.launch("fill_f32", 64, 256, [va, 1.0, PAGE // 4 + 1])  # one float into the unmapped page
        with pytest.raises(IllegalAddressError):
            await ctx.synchronize()


@pytest.mark.parametrize("work", ["kernel", "memset"])
async def test_work_queued_before_an_unmapping_faults_when_it_runs(served, work, autojump_clock):
    """mem_unmap does not wait for queued work (PyTorch synchronises its stream before it unmaps): a kernel or
    a memset queued behind a long kernel on the unmapped page faults instead of touching freed memory. (On
    trio's mock clock, so that the long kernel is still running however slowly the calls after it arrive.)"""
    async with served.connect() as ctx:
        va = await ctx.mem_address_reserve(2 * PAGE)
        handle = await ctx.mem_create(PAGE)
        await ctx.mem_map(va, PAGE, 0, handle)
        stream = await ctx.create_stream()
        await ctx.launch("spin", 8, 32, [int(1e9)], stream=stream)
        if work == "kernel":
            await ctx.launch("fill_f32", 64, 256, [va, 1.0, 1024], stream=stream)
        else:
            await ctx.memset(va, 7, 4096, stream)
        await ctx.mem_unmap(va, PAGE)
        with pytest.raises(IllegalAddressError):
            await ctx.synchronize()


async def test_a_client_that_goes_gives_back_its_physical_memory(served):
    """Everything a client made with mem_create, mapped or not, released or not, is reclaimed when it exits."""
    async with served.connect() as watcher:
        free0, _ = await watcher.mem_get_info()
        async with served.connect() as ctx:
            va = await ctx.mem_address_reserve(8 * PAGE)
            mapped, loose = await ctx.mem_create(2 * PAGE), await ctx.mem_create(PAGE)
            await ctx.mem_map(va, 2 * PAGE, 0, mapped)
            await ctx.mem_release(mapped)
            assert (await watcher.mem_get_info())[0] < free0 - 2 * PAGE
            del loose
        with trio.fail_after(10):  # the daemon reclaims once it has read the client's EOF, and then logs it
            while (await watcher.mem_get_info())[0] != free0 or "disconnected" not in served.server_log():
                await trio.sleep(0.01)
    assert "1 address reservations, 2 physical allocations" in served.server_log()


async def test_a_client_may_reserve_eight_device_memories_of_address_space(actx):
    """Reservations are host address space in the daemon, which all clients share: one client may hold eight
    times the device's memory reserved (PyTorch's expandable segments need 1 1/8 per stream and pool), and past
    that mem_address_reserve fails as the driver does when the address space is exhausted."""
    _, total = await actx.mem_get_info()
    share = total // PAGE * PAGE
    held = [await actx.mem_address_reserve(share) for _ in range(7)]
    with pytest.raises(OutOfMemoryError, match="address space"):
        await actx.mem_address_reserve(2 * share)
    await actx.mem_address_free(held[0], share)
    await actx.mem_address_reserve(2 * share)


async def test_mapped_memory_is_no_cudamalloc_allocation(actx):
    """cudaFree and cudaIpcGetMemHandle take cudaMalloc's allocations only: on a mapped address they are
    invalid values (exporting VMM memory is cuMemExportToShareableHandle's, which mpsd does not have)."""
    va = await actx.mem_address_reserve(2 * PAGE)
    await actx.mem_map(va, PAGE, 0, await actx.mem_create(PAGE))
    with pytest.raises(InvalidValueError):
        await actx.free(va)
    with pytest.raises(InvalidValueError):
        await actx.ipc_get_mem_handle(va)
