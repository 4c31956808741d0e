# Device memory through the real daemon (served in this process, tests/inproc.py, but for the smoke tests that
# want a daemon process and a client's real environment): allocation, per-client address spaces, copies in
# every direction (pageable and pinned, synchronous and on streams), memset, mem_get_info and CUDA's errors.
from __future__ import annotations

import numpy as np
import pytest

import mpsd_client
from inproc import in_process_daemon
from mpsd_client import DevicePointer, InvalidValueError, OutOfMemoryError

GiB = 1 << 30
MiB = 1 << 20


def test_a_lone_client_sees_what_a_real_h200_showed(ctx):
    """cudaMemGetInfo for the only client of an MPS server: the H200's total, less server and context."""
    free, total = ctx.mem_get_info()
    assert total == ctx.device_properties()["total_memory"] == 150_109_880_320
    assert total - free == 619_511_808  # bench/fidelity/h200_memory.json, "mps_no_limit"


async def test_malloc_is_charged_in_two_mib_chunks(actx, autojump_clock):
    """Allocations up to 1 MiB share 2 MiB chunks at 512-byte steps; larger ones are rounded to 2 MiB."""
    free0 = (await actx.mem_get_info())[0]
    a = await actx.malloc(3 * MiB)
    assert isinstance(a, DevicePointer) and a.size == 3 * MiB and a.addr == int(a) and a % (2 * MiB) == 0
    assert (await actx.mem_get_info())[0] == free0 - 4 * MiB
    small = [await actx.malloc(1000) for _ in range(16)]
    assert [p - small[0] for p in small] == [1024 * i for i in range(16)]
    assert (await actx.mem_get_info())[0] == free0 - 4 * MiB - 2 * MiB  # sixteen small ones cost one chunk
    ones = [await actx.malloc(MiB) for _ in range(4)]
    assert (await actx.mem_get_info())[0] == free0 - 4 * MiB - 2 * MiB - 4 * MiB
    for p in small[1:] + ones:
        await actx.free(p)
    assert (await actx.mem_get_info())[0] == free0 - 4 * MiB - 2 * MiB  # the chunk stays while small[0] lives
    await actx.free(small[0])
    await actx.free(a)
    assert (await actx.mem_get_info())[0] == free0
    stats = await actx.statistics()
    assert (stats["mallocs"], stats["frees"], stats["memory_used"]) == (21, 21, 0)


async def test_pointer_arithmetic_keeps_the_remaining_size(actx, autojump_clock):
    """p + 4096 is a pointer 4096 bytes on with 4096 fewer bytes behind it."""
    p = await actx.malloc(8192)
    q = p + 4096
    assert isinstance(q, DevicePointer) and q.addr == p.addr + 4096 and q.size == 4096 and q - p == 4096
    await actx.memcpy_htod(q, b"\x07" * 4096)
    out = bytearray(8192)
    await actx.memcpy_dtoh(out, p)
    assert out == b"\x00" * 4096 + b"\x07" * 4096


async def test_zero_sized_malloc_and_free_of_null_succeed(actx, autojump_clock):
    """cudaMalloc(0) gives a null pointer and cudaFree(NULL) does nothing, as in CUDA."""
    p = await actx.malloc(0)
    assert p == 0
    await actx.free(p)
    await actx.free(0)


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "1G", True])
async def test_malloc_of_a_non_size_is_invalid_value(actx, bad, autojump_clock):
    """Negative, overflowing or non-integer sizes are cudaErrorInvalidValue."""
    with pytest.raises(InvalidValueError):
        await actx.malloc(bad)


async def test_malloc_beyond_the_device_is_out_of_memory(actx, autojump_clock):
    """An allocation larger than the free device memory is cudaErrorMemoryAllocation, and loses nothing."""
    free = (await actx.mem_get_info())[0]
    with pytest.raises(OutOfMemoryError) as info:
        await actx.malloc(free + 1)
    assert info.value.code == 2 and info.value.name == "cudaErrorMemoryAllocation"
    assert (await actx.mem_get_info())[0] == free
    assert (await actx.get_last_error()).code == 2
    assert await actx.get_last_error() is None


async def test_double_free_interior_and_foreign_pointers_are_invalid_value(actx, served, autojump_clock):
    """Freeing a pointer twice, inside an allocation, or from another context is cudaErrorInvalidValue."""
    p = await actx.malloc(MiB)
    with pytest.raises(InvalidValueError):
        await actx.free(p + 512)
    await actx.free(p)
    with pytest.raises(InvalidValueError):
        await actx.free(p)
    async with served.connect() as other:
        q = await other.malloc(MiB)
        assert q == await actx.malloc(MiB)  # separate address spaces hand out the same first address
        await other.free(q)
        with pytest.raises(InvalidValueError):
            await other.free(q)


async def test_address_spaces_are_per_client(actx, served, autojump_clock):
    """The same address in two clients names different bytes (Volta+ MPS)."""
    async with served.connect() as other:
        a, b = await actx.malloc(4096), await other.malloc(4096)
        assert a == b
        await actx.memset(a, 1, 4096)
        await other.memset(b, 2, 4096)
        mine, theirs = bytearray(4096), bytearray(4096)
        await actx.memcpy_dtoh(mine, a)
        await other.memcpy_dtoh(theirs, b)
        assert set(mine) == {1} and set(theirs) == {2}


@pytest.mark.parametrize("nbytes", [1, 4095, 4 * MiB + 3, 20 * MiB + 1])
async def test_pageable_round_trip_through_staging(actx, nbytes, autojump_clock):
    """Pageable bytes of any size (over the staging buffer too) arrive intact and come back intact."""
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    p = await actx.malloc(nbytes)
    await actx.memcpy_htod(p, data)
    out = np.zeros(nbytes, np.uint8)
    await actx.memcpy_dtoh(out, p)
    assert np.array_equal(out, data)


async def test_any_buffer_protocol_object_works(actx, autojump_clock):
    """bytes, bytearray, memoryview slices, arrays of any dtype and 2-D arrays are all valid sources."""
    p = await actx.malloc(64)
    for src in (b"a" * 64, bytearray(b"b" * 64), memoryview(b"xc" * 64)[1::2].tobytes(),
                np.full(16, 1.5, np.float32), np.ones((4, 4), np.float32)):
        await actx.memcpy_htod(p, src)
        out = bytearray(len(memoryview(src).cast("B")))
        await actx.memcpy_dtoh(out, p)
        assert bytes(out) == memoryview(src).cast("B").tobytes()
    with pytest.raises(InvalidValueError):
        await actx.memcpy_htod(p, np.ones((8, 8), np.float32)[:, ::2])  # not contiguous
    with pytest.raises(InvalidValueError):
        await actx.memcpy_dtoh(b"read-only", p)
    with pytest.raises(InvalidValueError):
        await actx.memcpy_htod(p, 12345)


async def test_pinned_host_buffers_copy_without_staging(actx, autojump_clock):
    """A HostBuffer is shared memory: copies from and into it, and from slices of it, move the bytes."""
    h = await actx.host_alloc(2 * MiB)
    view = memoryview(h)
    view[:MiB] = bytes(range(256)) * 4096
    p = await actx.malloc(MiB)
    await actx.memcpy_htod(p, view[:MiB])
    await actx.memcpy_dtoh(view[MiB:], p)
    assert view[MiB:] == view[:MiB]
    s = await actx.create_stream()
    await actx.memset(p, 9, MiB, stream=s)
    await actx.memcpy_dtoh(view[:MiB], p, stream=s)  # into pinned memory: lands when the copy runs
    await s.synchronize()
    assert set(view[:MiB]) == {9}
    view.release()
    await actx.free_host(h)
    with pytest.raises(InvalidValueError):
        await actx.free_host(h)


async def test_dtod_and_memset(actx, autojump_clock):
    """memcpy_dtod copies between allocations (overlap included); memset writes the low byte of its value."""
    a, b = await actx.malloc(1024), await actx.malloc(1024)
    await actx.memcpy_htod(a, bytes(range(256)) * 4)
    await actx.memcpy_dtod(b, a, 1024)
    await actx.memcpy_dtod(a + 1, a, 512)  # overlapping, like memmove
    await actx.memset(b + 1000, 0x1FF, 24)
    out_a, out_b = bytearray(1024), bytearray(1024)
    await actx.memcpy_dtoh(out_a, a)
    await actx.memcpy_dtoh(out_b, b)
    expected = bytearray(bytes(range(256)) * 4)
    assert out_b == expected[:1000] + b"\xff" * 24
    expected[1:513] = expected[0:512]
    assert out_a == expected


async def test_overlapping_dtod_copies_move_as_memmove_either_way(actx, autojump_clock):
    """A copy within one allocation reads every byte before it is overwritten, whichever way the two overlap."""
    a = await actx.malloc(4096)
    data = bytes(range(256)) * 16
    expected = bytearray(data)
    await actx.memcpy_htod(a, data)
    await actx.memcpy_dtod(a + 7, a, 3000)  # the destination above the source
    expected[7:3007] = expected[0:3000]
    await actx.memcpy_dtod(a, a + 1000, 3000)  # and below it
    expected[0:3000] = expected[1000:4000]
    out = bytearray(4096)
    await actx.memcpy_dtoh(out, a)
    assert out == expected


async def test_copies_outside_live_memory_are_invalid_value(actx, autojump_clock):
    """Copies that run past an allocation, touch freed memory or use a bad pointer are cudaErrorInvalidValue."""
    p = await actx.malloc(4096)
    for call in (lambda: actx.memcpy_htod(p + 4000, bytes(100)), lambda: actx.memcpy_dtoh(bytearray(4097), p),
                 lambda: actx.memcpy_dtod(p, p + 1, 4096), lambda: actx.memset(p, 0, 4097),
                 lambda: actx.memcpy_htod(12345, b"x"), lambda: actx.memcpy_htod(-1, b"x")):
        with pytest.raises(InvalidValueError):
            await call()
    await actx.free(p)
    with pytest.raises(InvalidValueError):
        await actx.memset(p, 0, 16)
    await actx.synchronize()  # none of it was sticky


def test_pinned_limit_from_the_environment(daemon, monkeypatch):
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G behaves as it did on a real H200: the context is charged
    513 MiB of the limit, 256 MiB then succeeds and 512 MiB fails, and 510 MiB is the largest allocation."""
    monkeypatch.setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G,1=512M")
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        total = ctx.device_properties()["total_memory"]
        assert ctx.mem_get_info() == (535_402_352, total)  # bench/fidelity/h200_memory.json, "mps_limit_1G"
        assert ctx.quotas["pinned_mem_limit"] == GiB
        p = ctx.malloc(256 * MiB)
        with pytest.raises(OutOfMemoryError, match="under this client's limit of 1 GiB"):
            ctx.malloc(512 * MiB)
        ctx.free(p)
        ctx.free(ctx.malloc(510 * MiB))
        with pytest.raises(OutOfMemoryError):
            ctx.malloc(511 * MiB)


async def test_environment_only_tightens_the_daemons_limit(autojump_clock):
    """A client asking for more memory than the daemon's limit still gets the daemon's limit."""
    async with in_process_daemon("--pinned-mem-limit", "2G") as d:
        async with d.connect(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="4G") as actx:
            assert (await actx.mem_get_info())[0] == 1_609_144_176  # 2G less the context, as measured ("mps_limit_2G")
        async with d.connect(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=1G") as actx:
            assert (await actx.mem_get_info())[0] == 535_402_352


async def test_malformed_memory_limit_variable_is_reported(served, autojump_clock):
    """A malformed CUDA_MPS_PINNED_DEVICE_MEM_LIMIT fails connect with an error naming the variable."""
    with pytest.raises(InvalidValueError, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        async with served.connect(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=plenty"):
            pass


async def test_staged_copies_are_bounded(actx, autojump_clock):
    """A staged (pageable) copy larger than 64 MiB in one request is refused: the daemon never buffers more."""
    h = await actx.host_alloc(65 * MiB)
    p = await actx.malloc(65 * MiB)
    with pytest.raises(InvalidValueError, match="at most 64 MiB"):
        await actx._drive(actx._core.call("memcpy_htod", {"dst": int(p), "host": h.id, "offset": 0,
                                                           "nbytes": 65 * MiB, "stream": None, "staged": True}))
    await actx.memcpy_htod(p, memoryview(h))  # the pinned path has no such bound
