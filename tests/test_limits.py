# Per-client limits on what a client can make the daemon hold (issue 29, item 4): each kind is refused past its
# setting with cudaErrorMemoryAllocation naming the setting, there is room again once one goes, and another client
# of the same daemon is untouched. In process (tests/inproc.py), but for the daemon's reserves of fds and memory
# mappings, which a client exhausts in a daemon process of its own (its fd limit lowered under it).
from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import trio
import trio.testing

import mpsd_client
from daemons import start_daemon
from inproc import in_process_daemon
from mpsd.daemon.config import ConfigError, load_config
from mpsd_client import OutOfMemoryError

MiB = 1 << 20


def _code_2(exc: pytest.ExceptionInfo[OutOfMemoryError]) -> None:
    assert (exc.value.code, exc.value.name) == (2, "cudaErrorMemoryAllocation")


async def test_a_client_past_its_streams_is_refused_and_another_is_not():
    """The fourth stream under --max-streams 3 is cudaErrorMemoryAllocation; one destroyed makes room, and another
    client makes its own three meanwhile."""
    async with in_process_daemon("--max-streams", "3") as d, d.connect() as a, d.connect() as b:
        streams = [await a.create_stream() for _ in range(3)]
        with pytest.raises(OutOfMemoryError, match=r"holds 3 streams, and one client may hold 3 \(mpsd --max-s") as no:
            await a.create_stream()
        _code_2(no)
        assert len([await b.create_stream() for _ in range(3)]) == 3
        await streams[0].destroy()
        await a.create_stream()


async def test_events_count_those_opened_from_ipc_handles():
    """Under --max-events 2 a client's third event is refused, made or opened from another's IPC handle alike."""
    async with in_process_daemon("--max-events", "2", shared_process=True) as d, d.connect() as a, \
            d.connect() as b:
        theirs = await b.ipc_get_event_handle(await b.create_event(disable_timing=True, interprocess=True))
        first = await a.create_event()
        await a.ipc_open_event_handle(theirs)
        with pytest.raises(OutOfMemoryError, match="--max-events") as refused:
            await a.create_event()
        _code_2(refused)
        await first.destroy()
        await a.create_event()
        with pytest.raises(OutOfMemoryError, match="--max-events"):
            await a.ipc_open_event_handle(theirs)


async def test_waits_past_the_limit_are_refused_before_they_do_anything(autojump_clock):
    """Under --max-pending-waits 3, four synchronize calls at once while a kernel runs: three wait for it, the
    fourth is refused at once; a copy from pinned memory, which would wait, is refused and never runs, one from
    pageable memory, which does not wait, goes on; once the kernel has run there is room again."""
    async with in_process_daemon("--time-scale", "100", "--max-pending-waits", "3") as d, d.connect() as a:
        p = await a.malloc(8)
        pinned = await a.host_alloc(4)
        pinned[:] = b"\1\1\1\1"
        await a.launch("spin", 1, 32, [int(1.98e11)])  # 100 simulated seconds: 1 s of the (mock) clock
        outcomes: list[str] = []

        async def synchronize() -> None:
            try:
                await a.synchronize()
                outcomes.append("waited")
            except OutOfMemoryError as exc:
                assert "holds 3 calls waiting for the device" in exc.message
                outcomes.append("refused")

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(synchronize)
            await trio.sleep(0.01)  # (mock time) the three are waiting
            await synchronize()
            assert outcomes == ["refused"]
            with pytest.raises(OutOfMemoryError, match="--max-pending-waits") as refused:
                await a.memcpy_htod(p, pinned)
            _code_2(refused)
            await a.memcpy_htod(p + 4, b"\2\2\2\2")
        assert outcomes == ["refused", "waited", "waited", "waited"]
        out = bytearray(8)
        await a.memcpy_dtoh(out, p)
        assert out == bytes(4) + b"\2\2\2\2"  # the refused copy never ran


async def test_allocations_of_every_kind_count_against_one_limit():
    """Under --max-allocations 4: a small and a large malloc, a mem_create and an IPC import make four; a fifth of
    any kind is refused; a free makes room."""
    async with in_process_daemon("--max-allocations", "4", shared_process=True) as d, d.connect() as a, \
            d.connect() as b:
        exported = await b.ipc_get_mem_handle(await b.malloc(MiB))
        small = await a.malloc(64)
        await a.malloc(4 * MiB)
        await a.mem_create(2 * MiB)
        await a.ipc_open_mem_handle(exported)
        for call, args in ((a.malloc, (64,)), (a.malloc, (4 * MiB,)), (a.mem_create, (2 * MiB,))):
            with pytest.raises(OutOfMemoryError, match=r"holds 4 allocations.*--max-allocations") as refused:
                await call(*args)
            _code_2(refused)
        await a.free(small)
        await a.malloc(64)
        assert len([await b.malloc(64) for _ in range(3)]) == 3  # b holds 1 + 3


async def test_reserved_ranges_and_host_buffers_have_limits_of_their_own():
    """--max-reservations 2 and --max-host-buffers 2: the third of each is refused, room once one goes."""
    async with in_process_daemon("--max-reservations", "2", "--max-host-buffers", "2") as d, d.connect() as a:
        ranges = [await a.mem_address_reserve(2 * MiB) for _ in range(2)]
        with pytest.raises(OutOfMemoryError, match="--max-reservations") as refused:
            await a.mem_address_reserve(2 * MiB)
        _code_2(refused)
        await a.mem_address_free(ranges[0], 2 * MiB)
        await a.mem_address_reserve(2 * MiB)
        buffers = [await a.host_alloc(4096) for _ in range(2)]
        with pytest.raises(OutOfMemoryError, match="--max-host-buffers") as refused:
            await a.host_alloc(4096)
        _code_2(refused)
        await a.free_host(buffers[0])
        await a.host_alloc(4096)


async def test_a_clients_fds_are_limited_and_given_back():
    """Under --max-fds 7, a client holds three 4 MiB allocations (two fds each); a fourth, a first small one (its
    chunk's segment) and a mem_create are refused, a host buffer (one fd) is not; another client allocates as
    much; a free gives the fds back, and so does each client's exit."""
    async with in_process_daemon("--max-fds", "7") as d:
        async with d.connect() as a, d.connect() as b:
            large = [await a.malloc(4 * MiB) for _ in range(3)]
            for call, args in ((a.malloc, (4 * MiB,)), (a.malloc, (64,)), (a.mem_create, (2 * MiB,))):
                with pytest.raises(OutOfMemoryError, match=r"holds 6 file descriptors.*hold 7 \(mpsd --max-fds") as no:
                    await call(*args)
                _code_2(no)
            await a.host_alloc(4096)
            assert len([await b.malloc(4 * MiB) for _ in range(3)]) == 3
            await a.free(large[0])
            await a.malloc(64)
            assert d.daemon.fds.held == 2 * 3 + 2 * 3 + 1
        await trio.testing.wait_all_tasks_blocked()  # the daemon has seen both go
        assert d.daemon.fds.held == 0


def test_one_client_taking_every_fd_it_may_leaves_others_room_to_allocate_and_connect(daemon_factory):
    """A daemon whose fd limit is lowered (prlimit) to 400 more than it holds: a client's 4 MiB allocations are
    refused with cudaErrorMemoryAllocation at half of what the limit less its reserve leaves clients, and then a
    client already connected still allocates, and a new one connects and allocates."""
    d = start_daemon("--time-scale", "100")
    daemon_factory.append(d)
    with mpsd_client.connect(d.pipe_dir) as other:
        process = psutil.Process(d.proc.pid)
        limit = process.num_fds() + 400
        process.rlimit(psutil.RLIMIT_NOFILE, (limit, limit))
        with mpsd_client.connect(d.pipe_dir) as greedy:
            held = []
            with pytest.raises(OutOfMemoryError) as refused:
                for _ in range(limit):
                    held.append(greedy.malloc(4 * MiB))
            mine = [other.malloc(4 * MiB) for _ in range(20)]
            with mpsd_client.connect(d.pipe_dir) as late:
                late.free(late.malloc(4 * MiB))
            _code_2(refused)
            assert "half of what its limit" in refused.value.message
            kept = limit // 4  # the reserve of 1,024, cut to a quarter of the limit
            assert len(held) == (limit - kept) // 2 // 2
            for p in mine:
                other.free(p)
            for p in held:
                greedy.free(p)
        assert process.num_fds() < limit - kept


async def test_a_clients_memory_mappings_are_limited_and_given_back():
    """Under --max-maps 6, a client's reserved range (one mapping of the daemon's), mem_create (one) and two pieces
    mapped into the range (two each) are all it may hold: a third piece, a host buffer and a large malloc are
    refused; an unmapped piece gives its two back; and everything goes with the client."""
    async with in_process_daemon("--max-maps", "6") as d:
        async with d.connect() as a, d.connect() as b:
            r = await a.mem_address_reserve(16 * MiB)
            h = await a.mem_create(2 * MiB)
            await a.mem_map(r, 2 * MiB, 0, h)
            await a.mem_map(r + 4 * MiB, 2 * MiB, 0, h)
            for call, args in ((a.mem_map, (r + 8 * MiB, 2 * MiB, 0, h)), (a.host_alloc, (4096,)),
                               (a.malloc, (4 * MiB,))):
                with pytest.raises(OutOfMemoryError, match=r"holds 6 memory mappings.*hold 6 \(mpsd --max-maps") as no:
                    await call(*args)
                _code_2(no)
            assert len([await b.malloc(4 * MiB) for _ in range(6)]) == 6
            await a.mem_unmap(r + 4 * MiB, 2 * MiB)
            await a.malloc(4 * MiB)
            assert d.daemon.maps.held == 5 + 6  # a: the range, the handle, a piece and the malloc
        await trio.testing.wait_all_tasks_blocked()  # the daemon has seen both go
        assert d.daemon.maps.held == 0


async def test_one_client_mapping_all_it_may_leaves_others_room_to_allocate_and_connect(daemon_factory):
    """A client that maps one 2 MiB handle into every other page of a range (two of the daemon's memory mappings
    each) is refused at half of what vm.max_map_count less the reserve leaves clients, and then another client
    still allocates and a new one connects and allocates. (Before, it went on to vm.max_map_count, its last call
    an internal error, and every mmap of the daemon failed after: the other clients' mallocs with them.)"""
    limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    if limit > 262_144:
        pytest.skip(f"vm.max_map_count is {limit}: reaching half of it would take too long")
    d = start_daemon("--time-scale", "100")
    daemon_factory.append(d)
    async with mpsd_client.open_context(d.pipe_dir, environ={}) as other, \
            mpsd_client.open_context(d.pipe_dir, environ={}) as greedy:
        pages = limit  # of 2 MiB: room for more pieces than the daemon could map
        r = await greedy.mem_address_reserve(pages * 2 * MiB)
        h = await greedy.mem_create(2 * MiB)
        left = iter(range(0, pages, 2))
        refusals: list[OutOfMemoryError] = []

        async def map_pieces() -> None:  # many at once: one at a time, the daemon waits on each round trip
            for page in left:
                try:
                    await greedy.mem_map(r + page * 2 * MiB, 2 * MiB, 0, h)
                except OutOfMemoryError as exc:
                    refusals.append(exc)
                    return

        async with trio.open_nursery() as nursery:
            for _ in range(32):
                nursery.start_soon(map_pieces)
        await other.free(await other.malloc(4 * MiB))
        async with mpsd_client.open_context(d.pipe_dir, environ={}) as late:
            await late.free(await late.malloc(4 * MiB))
        assert len(refusals) == 32
        assert all("half of what its limit" in exc.message for exc in refusals)


def test_the_limits_are_settings_of_the_daemon(tmp_path):
    """Each limit has a default, an option and an [mpsd] key of the option's name; nonsense is a usage error."""
    limits = load_config(["--pipe-dir", str(tmp_path)], environ={}).client_limits
    assert (limits.streams, limits.events, limits.waits, limits.allocations, limits.reservations,
            limits.host_buffers, limits.fds, limits.fd_reserve, limits.maps, limits.map_reserve) == (
        65_536, 262_144, 4_096, 1_048_576, 65_536, 65_536, 150_000, 1_024, 150_000, 8_192)
    config = tmp_path / "mpsd.toml"
    config.write_text("[mpsd]\nmax-streams = 5\nmax-pending-waits = 7\nfd-reserve = 0\n")
    limits = load_config(["--pipe-dir", str(tmp_path), "--config", str(config), "--max-streams", "6"],
                         environ={}).client_limits
    assert (limits.streams, limits.waits, limits.fd_reserve, limits.events) == (6, 7, 0, 262_144)
    for bad in (["--max-events", "0"], ["--fd-reserve", "-1"]):
        with pytest.raises(ConfigError, match=bad[0]):
            load_config(["--pipe-dir", str(tmp_path), *bad], environ={})
    config.write_text("[mpsd]\nmax-fds = true\n")
    with pytest.raises(ConfigError, match="--max-fds"):
        load_config(["--pipe-dir", str(tmp_path), "--config", str(config)], environ={})


async def test_graphs_and_their_nodes_are_limited_and_given_back():
    """Under --max-graphs 3 --max-graph-nodes 6: a fourth graph (made, cloned, captured or instantiated) is
    refused, and a seventh node, by hand, by a clone or by an executable graph's copy of its graph's; what is
    destroyed makes room again; another client has its own."""
    async with in_process_daemon("--max-graphs", "3", "--max-graph-nodes", "6") as d, d.connect() as a, \
            d.connect() as b:
        graphs = [await a.graph_create() for _ in range(2)]
        for _ in range(3):
            await graphs[0].add_empty_node()
        executable = await graphs[0].instantiate()  # the third graph, with a copy of the three nodes
        with pytest.raises(OutOfMemoryError, match=r"holds 3 graphs and executable graphs.*--max-graphs") as no:
            await a.graph_create()
        _code_2(no)
        s = await a.create_stream()
        with pytest.raises(OutOfMemoryError, match="--max-graphs"):
            await s.begin_capture()
        assert len([await b.graph_create() for _ in range(3)]) == 3
        await executable.destroy()  # a graph and three nodes back
        for _ in range(3):
            await graphs[1].add_empty_node()
        with pytest.raises(OutOfMemoryError, match=r"holds 6 graph nodes.*--max-graph-nodes") as no:
            await graphs[1].add_empty_node()
        _code_2(no)
        with pytest.raises(OutOfMemoryError, match="--max-graph-nodes"):
            await graphs[0].clone()
        await graphs[0].destroy()
        clone = await graphs[1].clone()  # nothing of the refused clone was kept
        assert len(await clone.nodes()) == 3
        await a.graph_create()
        with pytest.raises(OutOfMemoryError, match="--max-graphs"):
            await a.graph_create()
