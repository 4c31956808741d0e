# Device memory through the real daemon: allocation, per-client address spaces, copies in every direction
# (pageable and pinned, synchronous and on streams), memset, mem_get_info and the errors CUDA gives.
from __future__ import annotations

import numpy as np
import pytest

import mpsd_client
from mpsd_client import DevicePointer, InvalidValueError, OutOfMemoryError

GiB = 1 << 30
MiB = 1 << 20


def test_a_lone_client_sees_what_a_real_h200_showed(ctx):
    """cudaMemGetInfo for the only client of an MPS server: the H200's total, less server and context."""
    free, total = ctx.mem_get_info()
    assert total == ctx.device_properties()["total_memory"] == 150_109_880_320
    assert total - free == 619_511_808  # bench/fidelity/h200_memory.json, "mps_no_limit"


def test_malloc_is_charged_in_two_mib_chunks(ctx):
    """Allocations up to 1 MiB share 2 MiB chunks at 512-byte steps; larger ones are rounded to 2 MiB."""
    free0 = ctx.mem_get_info()[0]
    a = ctx.malloc(3 * MiB)
    assert isinstance(a, DevicePointer) and a.size == 3 * MiB and a.addr == int(a) and a % (2 * MiB) == 0
    assert ctx.mem_get_info()[0] == free0 - 4 * MiB
    small = [ctx.malloc(1000) for _ in range(16)]
    assert [p - small[0] for p in small] == [1024 * i for i in range(16)]
    assert ctx.mem_get_info()[0] == free0 - 4 * MiB - 2 * MiB  # sixteen small ones cost one chunk
    ones = [ctx.malloc(MiB) for _ in range(4)]
    assert ctx.mem_get_info()[0] == free0 - 4 * MiB - 2 * MiB - 4 * MiB
    for p in small[1:] + ones:
        ctx.free(p)
    assert ctx.mem_get_info()[0] == free0 - 4 * MiB - 2 * MiB  # the chunk stays while small[0] lives
    ctx.free(small[0])
    ctx.free(a)
    assert ctx.mem_get_info()[0] == free0
    stats = ctx.statistics()
    assert (stats["mallocs"], stats["frees"], stats["memory_used"]) == (21, 21, 0)


def test_pointer_arithmetic_keeps_the_remaining_size(ctx):
    """p + 4096 is a pointer 4096 bytes on with 4096 fewer bytes behind it."""
    p = ctx.malloc(8192)
    q = p + 4096
    assert isinstance(q, DevicePointer) and q.addr == p.addr + 4096 and q.size == 4096 and q - p == 4096
    ctx.memcpy_htod(q, b"\x07" * 4096)
    out = bytearray(8192)
    ctx.memcpy_dtoh(out, p)
    assert out == b"\x00" * 4096 + b"\x07" * 4096


def test_zero_sized_malloc_and_free_of_null_succeed(ctx):
    """cudaMalloc(0) gives a null pointer and cudaFree(NULL) does nothing, as in CUDA."""
    p = ctx.malloc(0)
    assert p == 0
    ctx.free(p)
    ctx.free(0)


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "1G", True])
def test_malloc_of_a_non_size_is_invalid_value(ctx, bad):
    """Negative, overflowing or non-integer sizes are cudaErrorInvalidValue."""
    with pytest.raises(InvalidValueError):
        ctx.malloc(bad)


def test_malloc_beyond_the_device_is_out_of_memory(ctx):
    """An allocation larger than the free device memory is cudaErrorMemoryAllocation, and loses nothing."""
    free = ctx.mem_get_info()[0]
    with pytest.raises(OutOfMemoryError) as info:
        ctx.malloc(free + 1)
    assert info.value.code == 2 and info.value.name == "cudaErrorMemoryAllocation"
    assert ctx.mem_get_info()[0] == free
    assert ctx.get_last_error().code == 2
    assert ctx.get_last_error() is None


def test_double_free_interior_and_foreign_pointers_are_invalid_value(ctx, daemon):
    """Freeing a pointer twice, inside an allocation, or from another context is cudaErrorInvalidValue."""
    p = ctx.malloc(MiB)
    with pytest.raises(InvalidValueError):
        ctx.free(p + 512)
    ctx.free(p)
    with pytest.raises(InvalidValueError):
        ctx.free(p)
    with mpsd_client.connect(daemon.pipe_dir) as other:
        q = other.malloc(MiB)
        assert q == ctx.malloc(MiB)  # separate address spaces hand out the same first address
        other.free(q)
        with pytest.raises(InvalidValueError):
            other.free(q)


def test_address_spaces_are_per_client(ctx, daemon):
    """The same address in two clients names different bytes (Volta+ MPS)."""
    with mpsd_client.connect(daemon.pipe_dir) as other:
        a, b = ctx.malloc(4096), other.malloc(4096)
        assert a == b
        ctx.memset(a, 1, 4096)
        other.memset(b, 2, 4096)
        mine, theirs = bytearray(4096), bytearray(4096)
        ctx.memcpy_dtoh(mine, a)
        other.memcpy_dtoh(theirs, b)
        assert set(mine) == {1} and set(theirs) == {2}


@pytest.mark.parametrize("nbytes", [1, 4095, 4 * MiB + 3, 20 * MiB + 1])
def test_pageable_round_trip_through_staging(ctx, nbytes):
    """Pageable bytes of any size (over the staging buffer too) arrive intact and come back intact."""
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    p = ctx.malloc(nbytes)
    ctx.memcpy_htod(p, data)
    out = np.zeros(nbytes, np.uint8)
    ctx.memcpy_dtoh(out, p)
    assert np.array_equal(out, data)


def test_any_buffer_protocol_object_works(ctx):
    """bytes, bytearray, memoryview slices, arrays of any dtype and 2-D arrays are all valid sources."""
    p = ctx.malloc(64)
    for src in (b"a" * 64, bytearray(b"b" * 64), memoryview(b"xc" * 64)[1::2].tobytes(),
                np.full(16, 1.5, np.float32), np.ones((4, 4), np.float32)):
        ctx.memcpy_htod(p, src)
        out = bytearray(len(memoryview(src).cast("B")))
        ctx.memcpy_dtoh(out, p)
        assert bytes(out) == memoryview(src).cast("B").tobytes()
    with pytest.raises(InvalidValueError):
        ctx.memcpy_htod(p, np.ones((8, 8), np.float32)[:, ::2])  # not contiguous
    with pytest.raises(InvalidValueError):
        ctx.memcpy_dtoh(b"read-only", p)
    with pytest.raises(InvalidValueError):
        ctx.memcpy_htod(p, 12345)


def test_pinned_host_buffers_copy_without_staging(ctx):
    """A HostBuffer is shared memory: copies from and into it, and from slices of it, move the bytes."""
    h = ctx.host_alloc(2 * MiB)
    view = memoryview(h)
    view[:MiB] = bytes(range(256)) * 4096
    p = ctx.malloc(MiB)
    ctx.memcpy_htod(p, view[:MiB])
    ctx.memcpy_dtoh(view[MiB:], p)
    assert view[MiB:] == view[:MiB]
    s = ctx.create_stream()
    ctx.memset(p, 9, MiB, stream=s)
    ctx.memcpy_dtoh(view[:MiB], p, stream=s)  # into pinned memory: lands when the copy runs
    s.synchronize()
    assert set(view[:MiB]) == {9}
    view.release()
    ctx.free_host(h)
    with pytest.raises(InvalidValueError):
        ctx.free_host(h)


def test_dtod_and_memset(ctx):
    """memcpy_dtod copies between allocations (overlap included); memset writes the low byte of its value."""
    a, b = ctx.malloc(1024), ctx.malloc(1024)
    ctx.memcpy_htod(a, bytes(range(256)) * 4)
    ctx.memcpy_dtod(b, a, 1024)
    ctx.memcpy_dtod(a + 1, a, 512)  # overlapping, like memmove
    ctx.memset(b + 1000, 0x1FF, 24)
    out_a, out_b = bytearray(1024), bytearray(1024)
    ctx.memcpy_dtoh(out_a, a)
    ctx.memcpy_dtoh(out_b, b)
    expected = bytearray(bytes(range(256)) * 4)
    assert out_b == expected[:1000] + b"\xff" * 24
    expected[1:513] = expected[0:512]
    assert out_a == expected


def test_copies_outside_live_memory_are_invalid_value(ctx):
    """Copies that run past an allocation, touch freed memory or use a bad pointer are cudaErrorInvalidValue."""
    p = ctx.malloc(4096)
    for call in (lambda: ctx.memcpy_htod(p + 4000, bytes(100)), lambda: ctx.memcpy_dtoh(bytearray(4097), p),
                 lambda: ctx.memcpy_dtod(p, p + 1, 4096), lambda: ctx.memset(p, 0, 4097),
                 lambda: ctx.memcpy_htod(12345, b"x"), lambda: ctx.memcpy_htod(-1, b"x")):
        with pytest.raises(InvalidValueError):
            call()
    ctx.free(p)
    with pytest.raises(InvalidValueError):
        ctx.memset(p, 0, 16)
    ctx.synchronize()  # none of it was sticky


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


def test_environment_only_tightens_the_daemons_limit(daemon_factory, monkeypatch):
    """A client asking for more memory than the daemon's limit still gets the daemon's limit."""
    from daemons import start_daemon

    d = start_daemon("--pinned-mem-limit", "2G")
    daemon_factory.append(d)
    monkeypatch.setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "4G")
    with mpsd_client.connect(d.pipe_dir) as ctx:
        assert ctx.mem_get_info()[0] == 1_609_144_176  # 2G less the context, as measured ("mps_limit_2G")
    monkeypatch.setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G")
    with mpsd_client.connect(d.pipe_dir) as ctx:
        assert ctx.mem_get_info()[0] == 535_402_352


def test_malformed_memory_limit_variable_is_reported(daemon, monkeypatch):
    """A malformed CUDA_MPS_PINNED_DEVICE_MEM_LIMIT fails connect with an error naming the variable."""
    monkeypatch.setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=plenty")
    with pytest.raises(InvalidValueError, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        mpsd_client.connect(daemon.pipe_dir)


def test_staged_copies_are_bounded(ctx):
    """A staged (pageable) copy larger than 64 MiB in one request is refused: the daemon never buffers more."""
    h = ctx.host_alloc(65 * MiB)
    p = ctx.malloc(65 * MiB)
    with pytest.raises(InvalidValueError, match="at most 64 MiB"):
        ctx._drive(ctx._core.call("memcpy_htod", {"dst": int(p), "host": h.id, "offset": 0, "nbytes": 65 * MiB,
                                                  "stream": None, "staged": True}))
    ctx.memcpy_htod(p, memoryview(h))  # the pinned path has no such bound
