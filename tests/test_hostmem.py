# The host RAM that simulated device memory costs stays within the daemon's budget (issue 13, item 7): device
# memory is sparse memfds, a touched page costs a page of RAM, and touching more than the budget fails that
# call with cudaErrorMemoryAllocation instead of taking the host to the OOM killer. A real daemon, real clients,
# and the daemon's own figures as mpsd-smi shows them; one in-process check of the page arithmetic.
from __future__ import annotations

import os

import numpy as np
import pytest

import mpsd_client
from daemons import start_daemon
from test_daemon import wait_for_log
from mpsd.backends.hostmem import PAGE, HostMemory
from mpsd.backends.memfd import Segment
from mpsd.tools.smi import query, render
from mpsd_protocol import Calls, OutOfMemoryError

MiB = 1 << 20


def _host(daemon) -> dict:
    return query(daemon.pipe_dir)["host_memory"]


def _gone(daemon, clients: int) -> None:
    """Once `clients` clients have left and been reclaimed (a reclaim may take several turns of the daemon's
    loop, with other calls answered between them: mpsd.runtime.teardown)."""
    wait_for_log(daemon, "disconnected; reclaimed", count=clients)


def test_touching_past_the_budget_fails_that_call_and_zeros_cost_nothing(daemon_factory):
    # 64 MiB for device pages, and 8 for the staging buffer the pageable copies below pin (it counts too)
    daemon = start_daemon("--time-scale", "100", "--host-memory", "72M")
    daemon_factory.append(daemon)
    with mpsd_client.connect(daemon.pipe_dir) as a, mpsd_client.connect(daemon.pipe_dir) as b:
        p = a.malloc(1 << 30)  # a GiB of device memory costs no RAM until it is touched
        a.memset(p, 0, 1 << 30)  # nor does clearing it: zeros are holes
        a.synchronize()
        assert _host(daemon)["resident"] < MiB
        a.memset(p, 7, 56 * MiB)
        a.synchronize()
        assert 56 * MiB <= _host(daemon)["resident"] < 58 * MiB
        with pytest.raises(OutOfMemoryError, match="budget of 72"):
            a.memset(p + 56 * MiB, 7, 32 * MiB)
        assert _host(daemon)["resident"] < 58 * MiB
        # A pageable copy goes in pieces: those that fit land, the first that does not fails.
        with pytest.raises(OutOfMemoryError):
            a.memcpy_htod(p + 56 * MiB, np.ones(32 * MiB, np.uint8))
        a.launch("fill_f32", 64, 256, [p + 64 * MiB, 1.0, 8 * MiB])  # 32 MiB of first touches
        with pytest.raises(OutOfMemoryError):
            a.synchronize()
        assert _host(daemon)["resident"] <= 64 * MiB
        # The other client goes on, and rewriting pages already resident costs nothing more.
        b.launch("spin", 8, 32, [1000])
        b.synchronize()
        a.memset(p, 9, 56 * MiB)
        a.synchronize()
        # Clearing gives the pages back, and then the same memset fits.
        a.memset(p, 0, 64 * MiB)
        a.synchronize()
        assert _host(daemon)["resident"] < MiB
        q = b.malloc(MiB)
        b.memset(q, 1, MiB)
        a.memset(p + 56 * MiB, 7, 32 * MiB)
        out = np.empty(4, np.uint8)
        a.memcpy_dtoh(out, p + 56 * MiB - 2)
        assert list(out) == [0, 0, 7, 7]
        host = _host(daemon)
        assert 32 * MiB <= host["resident"] < 36 * MiB and host["reserved"] == 0 and host["budget"] == 72 * MiB
        assert "Host RAM holding simulated device memory: 3" in render(query(daemon.pipe_dir))
        a.free(p)
        assert _host(daemon)["resident"] <= 2 * MiB  # b's chunk
    _gone(daemon, 2)
    assert _host(daemon)["resident"] == 0


def test_pages_are_counted_as_the_kernel_touches_them():
    """The arithmetic on one segment: what a reservation counts, what settling measures, what zeroing frees."""
    host = HostMemory(budget=16 * PAGE)
    segment = Segment(64 * PAGE)
    try:
        first = host.reserve([(segment, PAGE // 2, 4 * PAGE)])  # straddles five pages
        assert first.nbytes == 5 * PAGE and host.pending == 5 * PAGE
        segment.map[0:5 * PAGE] = b"\1" * (5 * PAGE)
        host.settle(first)
        assert (host.pending, host.resident) == (0, 5 * PAGE)
        assert host.reserve([(segment, 0, 5 * PAGE)]).nbytes == 0  # resident already
        with pytest.raises(OutOfMemoryError):
            host.reserve([(segment, 5 * PAGE, 12 * PAGE)])
        host.zero(segment, 100, 5 * PAGE - 200)  # three whole pages punched; the two ends written
        assert host.resident == 2 * PAGE == os.fstat(segment.fd).st_blocks * 512
        assert bytes(segment.map[100:5 * PAGE - 100]) == bytes(5 * PAGE - 200)
        assert segment.map[99] == 1 and segment.map[5 * PAGE - 100] == 1
    finally:
        segment.release()
    assert host.resident == 0


def test_memory_mapped_into_a_reservation_counts_against_the_budget(daemon_factory):
    """The driver's virtual memory is the same memfds behind a reserved range: touching it through the range
    is counted against --host-memory as a cudaMalloc's is, across the pieces, and zeros still cost nothing."""
    daemon = start_daemon("--time-scale", "100", "--host-memory", "64M")
    daemon_factory.append(daemon)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        page = ctx.mem_get_allocation_granularity()
        va = ctx.mem_address_reserve(256 * MiB)
        for offset in range(0, 128 * MiB, 32 * MiB):  # four pieces side by side
            ctx.mem_map(va + offset, 32 * MiB, 0, ctx.mem_create(32 * MiB))
        ctx.memset(va, 0, 128 * MiB)
        ctx.synchronize()
        assert _host(daemon)["resident"] < MiB
        ctx.memset(va + 16 * MiB, 7, 40 * MiB)  # across the first piece into the second
        ctx.synchronize()
        assert 40 * MiB <= _host(daemon)["resident"] < 42 * MiB
        with pytest.raises(OutOfMemoryError, match="budget of 64"):
            ctx.memset(va + 64 * MiB, 7, 32 * MiB)
        ctx.memset(va, 0, 128 * MiB)  # the pages go back, piece by piece
        ctx.synchronize()
        assert _host(daemon)["resident"] < MiB and page == 2 * MiB


def _file_bytes(address: int, nbytes: int) -> int:
    """Bytes of RAM the file mapped at [address, address + nbytes) holds (its memfd's st_blocks)."""
    return os.stat(f"/proc/self/map_files/{address:x}-{address + nbytes:x}").st_blocks * 512


def _memfd(nbytes: int) -> int:
    """A sealed memfd of `nbytes` whose pages nobody has touched, as a hostile client would register it."""
    import fcntl

    fd = os.memfd_create("untouched", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def test_pinned_buffers_the_daemon_maps_count_against_the_budget(daemon_factory):
    """Issue 29, item 1: a copy into (or out of) a pinned buffer makes the daemon touch its pages, so every buffer
    it maps counts against --host-memory whole, beside device memory, from registration to unmapping; untouched
    memfds registered through the raw call are refused past the budget instead of growing the daemon's RAM."""
    daemon = start_daemon("--time-scale", "100", "--host-memory", "64M")
    daemon_factory.append(daemon)
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        big = ctx.host_alloc(40 * MiB)
        assert _file_bytes(big.base_address, 40 * MiB) == 40 * MiB  # pinned is resident: the client's own pages
        assert _host(daemon)["pinned"] == 40 * MiB
        with pytest.raises(OutOfMemoryError, match="pinned host memory would take the daemon's host RAM past"):
            ctx.host_alloc(32 * MiB)
        p = ctx.malloc(64 * MiB)
        with pytest.raises(OutOfMemoryError, match="budget of 64"):  # device pages share the budget
            ctx.memset(p, 7, 32 * MiB)
        ctx.memset(p, 7, 16 * MiB)
        ctx.memcpy_dtoh(memoryview(big)[:16 * MiB], p)  # writes pages of the client's buffer, counted from registration
        assert big[16 * MiB - 1] == 7
        held = []
        try:  # the attack: untouched memfds registered one after another, each the daemon's to fault in
            for _ in range(8):
                fd = _memfd(32 * MiB)
                try:
                    held.append(ctx._drive(ctx._core.invoke(Calls.host_register, 32 * MiB, fds=(fd,))))
                finally:
                    os.close(fd)
        except OutOfMemoryError:
            pass
        assert held == [] and _host(daemon)["pinned"] == 40 * MiB
        ctx.free_host(big)
        assert _host(daemon)["pinned"] == 0
        fd = _memfd(32 * MiB)
        try:  # with the room back, the same call fits
            held.append(ctx._drive(ctx._core.invoke(Calls.host_register, 32 * MiB, fds=(fd,))))
        finally:
            os.close(fd)
        assert _host(daemon)["pinned"] == 32 * MiB
    _gone(daemon, 1)
    assert _host(daemon)["pinned"] == 0  # a client's buffers are unmapped and uncounted as it goes


async def test_a_refused_staged_copy_lets_go_of_its_bytes_at_once():
    """A pageable copy refused by the host budget gives its staged bytes back when it is refused, not when Python's
    cyclic collector next runs (the error's traceback holds them until then): with the collector off, 40 refused
    8-MiB pieces leave the daemon's RSS where it was (it grew by the 320 MiB they staged before)."""
    import gc

    import psutil

    from inproc import in_process_daemon

    me = psutil.Process()
    async with in_process_daemon("--host-memory", "64M") as d, d.connect() as ctx:
        p = await ctx.malloc(1 << 30)
        await ctx.memset(p, 7, 56 * MiB)
        await ctx.synchronize()
        piece = np.full(8 * MiB, 3, np.uint8)
        gc.disable()
        try:
            before = me.memory_info().rss
            for i in range(40):
                with pytest.raises(OutOfMemoryError, match="budget of 64"):
                    await ctx.memcpy_htod(p + 512 * MiB + i * 8 * MiB, piece)
            grown = me.memory_info().rss - before
        finally:
            gc.enable()
    assert grown < 64 * MiB, grown
