# Stream-ordered allocation and memory pools (mpsd_client._pools, and the reservations of mpsd.runtime.context):
# what the H200 showed (32 MiB steps, allocations back to back, threshold 0 releasing at the next
# synchronisation, UINT64_MAX keeping until trim_to), CUDA's reuse rules across streams, every error, the
# charge against the pinned limit, and no round trip per allocation. Most against a daemon served in this trio
# loop (tests/inproc.py); what only a real process shows (a killed client's pool memory) against daemon
# processes.
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mpsd_client
from daemons import spawn_worker
from mpsd_client import InvalidResourceHandleError, InvalidValueError, MemPool, OutOfMemoryError
from mpsd_client._core import MAX_OPS

MiB = 1 << 20
UINT64_MAX = (1 << 64) - 1


async def _used(actx) -> int:
    free, total = await actx.mem_get_info()
    return total - free


def _requests(actx) -> list[str]:
    """The requests `actx` sends from now on (its core's one way out for them), by op."""
    sent: list[str] = []
    request = actx._core._request

    def tapped(op, args, fds):
        sent.append(op)
        return (yield from request(op, args, fds))

    actx._core._request = tapped
    return sent


async def test_the_default_pool_reserves_32_mib_steps_and_packs_allocations_back_to_back(actx, autojump_clock):
    """As on the H200: the first allocation reserves 32 MiB, the next ones follow it with no gap, and the 33rd
    MiB reserves 32 MiB more; mem_get_info counts the reservations as used, the attributes say the same."""
    pool = actx.device_get_default_mem_pool()
    assert pool is actx.device_get_mem_pool() and pool.default
    base = await _used(actx)
    stream = await actx.create_stream()
    ptrs = [await actx.malloc_async(MiB, stream) for _ in range(32)]
    assert [p - ptrs[0] for p in ptrs] == [i * MiB for i in range(32)]
    assert await _used(actx) - base == 32 * MiB
    ptrs.append(await actx.malloc_async(MiB, stream))
    assert await _used(actx) - base == 64 * MiB
    small = await actx.malloc_async(100, stream)  # 512-byte steps
    assert small == ptrs[-1] + MiB and await actx.malloc_async(100, stream) == small + 512
    # used counts the bytes asked for, as the H200's did (8 allocations of 513 bytes: 4104 used)
    assert (pool.get_attribute("reserved_mem_current"), pool.get_attribute("used_mem_current")) == (64 * MiB,
                                                                                                    33 * MiB + 200)
    stats = await actx.statistics()
    assert (stats["memory_pool_reserved"], stats["memory_in_use"]) == (64 * MiB, 33 * MiB + 200)
    assert (stats["async_mallocs"], stats["async_frees"]) == (35, 0)


async def test_a_pointer_is_usable_in_stream_order_and_reused_there_at_once(actx, autojump_clock):
    """Work after malloc_async on its stream may use the bytes; memory freed on a stream is what the next
    allocation of that size on the same stream gets, and the stream orders the two uses."""
    s = await actx.create_stream()
    n = 1 << 18
    p = await actx.malloc_async(4 * n, s)
    await actx.launch("fill_f32", 256, 256, [p, 3.0, n], stream=s)
    actx.free_async(p, s)
    q = await actx.malloc_async(4 * n, s)
    assert q == p
    await actx.launch("saxpy_f32", 256, 256, [1.0, q, q, n], stream=s)  # q = q + q: after the fill
    out = np.empty(n, np.float32)
    await actx.memcpy_dtoh(out, q, s)
    assert (out == 6.0).all()
    assert len(await actx.host_view(q)) == 4 * n  # a pool allocation's bytes, not its reservation's


def _pool(actx, **flags) -> MemPool:
    pool = actx.mem_pool_create()
    for name, value in flags.items():
        pool.set_attribute(name, value)
    return pool


async def test_another_stream_reuses_freed_memory_only_as_the_flags_allow(actx, autojump_clock):
    """With internal dependencies off, memory freed on stream A goes to stream B only after B waits for an
    event recorded after the free (follow_event_dependencies), or once A is synchronised, whatever the flags, as
    on the H200 (the pools keep their memory through synchronisations here, so that there is something to
    reuse)."""
    a, b = await actx.create_stream(), await actx.create_stream()
    pool = _pool(actx, reuse_allow_internal_dependencies=False, reuse_allow_opportunistic=False)
    p = await actx.malloc_from_pool_async(MiB, pool, a)
    actx.free_async(p, a)
    elsewhere = await actx.malloc_from_pool_async(MiB, pool, b)
    assert elsewhere != p  # no order between the free and B
    freed = await actx.create_event(disable_timing=True)
    await freed.record(a)
    await b.wait_event(freed)
    assert await actx.malloc_from_pool_async(MiB, pool, b) == p  # B follows the free through the event

    pool = _pool(actx, reuse_allow_internal_dependencies=False, release_threshold=UINT64_MAX)  # opportunistic on
    p = await actx.malloc_from_pool_async(MiB, pool, a)
    actx.free_async(p, a)
    assert await actx.malloc_from_pool_async(MiB, pool, b) != p
    await a.synchronize()
    assert await actx.malloc_from_pool_async(MiB, pool, b) == p  # the free is known to have completed

    pool = _pool(actx, reuse_allow_internal_dependencies=False, reuse_follow_event_dependencies=False,
                 reuse_allow_opportunistic=False, release_threshold=UINT64_MAX)
    p = await actx.malloc_from_pool_async(MiB, pool, a)
    actx.free_async(p, a)
    await freed.record(a)
    await b.wait_event(freed)
    assert await actx.malloc_from_pool_async(MiB, pool, b) != p  # the event does not count without its flag
    assert await actx.malloc_from_pool_async(MiB, pool, a) == p  # its own stream always may
    actx.free_async(p, a)
    await actx.synchronize()
    assert await actx.malloc_from_pool_async(MiB, pool, b) == p  # a completed free is anyone's


async def test_internal_dependencies_make_the_reusing_stream_wait_for_the_freeing_one(actx, autojump_clock):
    """By default memory freed on A goes to B at once where no range that needs no wait fits, and B's work then
    waits for A's work before the free (the pool inserts the dependency); memory that is not reused adds no
    wait."""
    a, b = await actx.create_stream(), await actx.create_stream()
    p = await actx.malloc_async(32 * MiB, a)  # the whole reservation, freed behind A's spin
    await actx.launch("spin", 8, 32, [20_000_000], stream=a)  # about 10 ms
    actx.free_async(p, a)
    q = await actx.malloc_async(32 * MiB, b)
    assert q == p
    done = await actx.create_event()
    await done.record(b)
    await done.synchronize()
    assert await a.query()  # B's record came after A's spin

    fresh = await actx.malloc_async(64 * MiB, b)  # a reservation of its own: no one freed it
    await actx.launch("spin", 8, 32, [20_000_000], stream=a)
    await done.record(b)
    await done.synchronize()
    assert not await a.query()
    actx.free_async(fresh, b)


async def test_threshold_zero_gives_memory_back_at_the_next_synchronisation(actx, autojump_clock):
    """The default release threshold is 0: freed memory stays reserved until a stream, event or device
    synchronisation, and then goes back to the device (mem_get_info sees it)."""
    pool = actx.device_get_default_mem_pool()
    assert pool.get_attribute("release_threshold") == 0
    base = await _used(actx)
    s = await actx.create_stream()
    for sync in (s.synchronize, actx.synchronize):
        p = await actx.malloc_async(40 * MiB, s)
        actx.free_async(p, s)
        assert await _used(actx) - base == 64 * MiB and pool.statistics().used_mem_current == 0
        await sync()
        assert await _used(actx) == base and pool.get_attribute("reserved_mem_current") == 0
    p = await actx.malloc_async(MiB, s)
    event = await actx.create_event()
    actx.free_async(p, s)
    await event.record(s)
    await event.synchronize()
    assert await _used(actx) == base
    assert pool.statistics().reserved_mem_high == 64 * MiB


async def test_threshold_uint64_max_keeps_memory_until_trim_to(actx, autojump_clock):
    """A pool whose threshold is UINT64_MAX keeps what it reserved through synchronisations; trim_to(n) gives
    back unused reservations while at least n bytes stay, trim_to(0) all of them; live ones stay."""
    pool = actx.device_get_default_mem_pool()
    pool.set_attribute("release_threshold", UINT64_MAX)
    base = await _used(actx)
    s = await actx.create_stream()
    big = [await actx.malloc_async(32 * MiB, s) for _ in range(3)]
    for p in big[1:]:
        actx.free_async(p, s)
    await actx.synchronize()
    assert await _used(actx) - base == 96 * MiB
    await pool.trim_to(40 * MiB)
    assert await _used(actx) - base == 64 * MiB
    await pool.trim_to(0)
    assert await _used(actx) - base == 32 * MiB  # the live allocation's reservation stays
    actx.free_async(big[0], s)
    await pool.trim_to(0)
    assert await _used(actx) == base


async def test_high_marks_reset_to_the_current_figures(actx, autojump_clock):
    """reserved_mem_high and used_mem_high are resettable by setting them to 0, as cudaMemPoolSetAttribute
    allows; the current figures are read-only."""
    pool = actx.device_get_default_mem_pool()
    p, q = await actx.malloc_async(3 * MiB), await actx.malloc_async(MiB)
    actx.free_async(p)
    stats = pool.statistics()
    assert (stats.used_mem_current, stats.used_mem_high, stats.reserved_mem_high) == (MiB, 4 * MiB, 32 * MiB)
    pool.set_attribute("used_mem_high", 0)
    assert pool.get_attribute("used_mem_high") == MiB
    await actx.synchronize()
    pool.set_attribute("reserved_mem_high", 0)
    assert pool.get_attribute("reserved_mem_high") == 32 * MiB  # q still holds the reservation
    for name, value in [("used_mem_current", 0), ("used_mem_high", 5), ("release_threshold", -1),
                        ("reuse_allow_opportunistic", "yes"), ("no_such_attribute", 0)]:
        with pytest.raises(InvalidValueError):
            pool.set_attribute(name, value)
    with pytest.raises(InvalidValueError):
        pool.get_attribute("no_such_attribute")
    actx.free_async(q)


async def test_created_pools_become_current_and_are_destroyed_when_their_memory_is_free(actx, autojump_clock):
    """device_set_mem_pool makes malloc_async take from a created pool; destroying it makes the default pool
    current again, gives back its unused memory at once and the rest when its last allocation is freed."""
    base = await _used(actx)
    pool = actx.mem_pool_create(location=0)
    actx.device_set_mem_pool(pool)
    assert actx.device_get_mem_pool() is pool
    p = await actx.malloc_async(MiB)
    assert pool.get_attribute("used_mem_current") == MiB
    assert actx.device_get_default_mem_pool().get_attribute("reserved_mem_current") == 0
    unused = await actx.malloc_from_pool_async(40 * MiB, pool)
    actx.free_async(unused)
    await pool.destroy()
    assert actx.device_get_mem_pool() is actx.device_get_default_mem_pool()
    assert await _used(actx) - base == 32 * MiB  # the 64 MiB reservation of nothing went
    with pytest.raises(InvalidValueError, match="not a memory pool"):
        await actx.malloc_from_pool_async(MiB, pool)
    actx.free_async(p)  # a destroyed pool's allocation may still be freed: its memory goes with it
    assert await _used(actx) == base


async def test_every_error_is_cudas_and_raised_by_the_call(served, autojump_clock):
    """Double frees, foreign pointers, bad pools, streams and sizes are raised by the call itself, as CUDA's
    host calls return them, and are the last error; so is a pool that cannot grow past the pinned limit or its
    max_size; a forged notification is refused by the daemon, whose ledger stays whole."""
    async with served.connect(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=1G") as actx, served.connect() as other:
        p = await actx.malloc_async(MiB)
        actx.free_async(p)
        with pytest.raises(InvalidValueError, match="not a live stream-ordered allocation"):
            actx.free_async(p)
        assert (await actx.get_last_error()).code == 1
        plain = await actx.malloc(MiB)
        with pytest.raises(InvalidValueError):
            actx.free_async(plain)
        with pytest.raises(InvalidValueError):
            actx.free_async(p + 512)
        with pytest.raises(InvalidValueError):
            await actx.device_get_default_mem_pool().destroy()
        foreign = other.device_get_default_mem_pool()
        for bad in (foreign, "pool", None):
            with pytest.raises(InvalidValueError):
                await actx.malloc_from_pool_async(MiB, bad)
            with pytest.raises(InvalidValueError):
                actx.device_set_mem_pool(bad)
        with pytest.raises(InvalidResourceHandleError):
            await actx.malloc_async(MiB, await other.create_stream())
        for size in (-1, 1.5, True):
            with pytest.raises(InvalidValueError):
                await actx.malloc_async(size)
        with pytest.raises(InvalidValueError):
            actx.mem_pool_create(location=1)
        assert await actx.malloc_async(0) == 0
        actx.free_async(0)

        capped = actx.mem_pool_create(max_size=64 * MiB)
        kept = await actx.malloc_from_pool_async(60 * MiB, capped)
        with pytest.raises(OutOfMemoryError, match="max_size"):
            await actx.malloc_from_pool_async(5 * MiB, capped)  # 4 MiB are left; a third 32 MiB step passes it
        actx.free_async(kept)
        await actx.synchronize()
        with pytest.raises(OutOfMemoryError, match="limit"):
            await actx.malloc_async(1 << 30)
        held = []
        with pytest.raises(OutOfMemoryError):
            for _ in range(64):
                held.append(await actx.malloc_async(32 * MiB))
        free, _ = await actx.mem_get_info()
        assert free < 32 * MiB and 0 < len(held) < 32  # the context's own 513 MiB come first
        for q in held:
            actx.free_async(q)
        await actx.synchronize()
        assert (await actx.mem_get_info())[0] >= free + len(held) * 32 * MiB

        # Operations only the client's pools should send: what a client that bypassed them gets.
        stats = await actx.statistics()
        for ops in ([[0, int(plain), 8, 0, []]], [[1, int(p), 0]], [[2, int(plain)]], [[7]], ["x"],
                    [[0, "p", 1, 0, []]]):
            with pytest.raises(InvalidValueError):
                await actx._drive(actx._core.call("mem_pool_ops", {"ops": ops}))
        with pytest.raises(InvalidValueError):
            await actx._drive(actx._core.call("mem_pool_reserve", {"nbytes": 1000}))
        assert (await actx.statistics())["memory_in_use"] == stats["memory_in_use"]
        with pytest.raises(InvalidValueError, match="pool"):
            await actx.ipc_get_mem_handle(await actx.malloc_async(MiB))


async def test_forged_overlapping_pool_operations_cannot_count_more_in_use_than_is_reserved(actx):
    """A client that bypasses its pool and claims overlapping ranges of one reservation has the overlapping ones
    refused: "in use" stays within what it reserved (forged, it said 2.0 GB in use with 2 MiB reserved)."""
    base = await actx._drive(actx._core.call("mem_pool_reserve", {"nbytes": 2 * MiB}))
    before = (await actx.statistics())["memory_in_use"]
    ops = [[0, base, 2 * MiB, 0, []]] + [[0, base + 4096 * i, 2 * MiB - 4096 * i, 0, []] for i in range(1, 500)]
    with pytest.raises(InvalidValueError, match="handed out twice"):
        await actx._drive(actx._core.call("mem_pool_ops", {"ops": ops}))
    assert (await actx.statistics())["memory_in_use"] - before == 2 * MiB
    with pytest.raises(InvalidValueError, match="handed out twice"):  # inside it, and across its start
        await actx._drive(actx._core.call("mem_pool_ops", {"ops": [[0, base + MiB, 4096, 0, []]]}))
    await actx._drive(actx._core.call("mem_pool_ops", {"ops": [[1, base, 0]]}))
    await actx._drive(actx._core.call("mem_pool_ops", {"ops": [[0, base + MiB, MiB, 0, []], [0, base, MiB, 0, []]]}))
    assert (await actx.statistics())["memory_in_use"] - before == 2 * MiB  # side by side they fit


async def test_a_pair_makes_no_round_trip_and_the_daemon_hears_of_it_with_the_next_call(actx, autojump_clock):
    """Once the pool has memory, malloc_async and free_async wait for no reply: they are notifications, sent
    ahead of the client's next message (or in batches); the daemon's ledger has them all after its next call."""
    s = await actx.create_stream()
    actx.free_async(await actx.malloc_async(MiB, s), s)
    sent = _requests(actx)
    for _ in range(1000):
        actx.free_async(await actx.malloc_async(MiB, s), s)
    live = [await actx.malloc_async(MiB, s) for _ in range(3)]
    assert sent == [] and 0 < len(actx._core._ops) <= MAX_OPS  # they go in batches, with no reply to wait for
    stats = await actx.statistics()
    assert (stats["async_mallocs"], stats["async_frees"], stats["memory_in_use"]) == (1004, 1001, 3 * MiB)
    assert sent == ["statistics"] and actx._core._ops == []
    await actx.free(live[0])  # cudaFree of pool memory: freed in order, after the context's work
    assert (await actx.statistics())["memory_in_use"] == 2 * MiB


def test_a_killed_clients_pool_memory_is_reclaimed(daemon):
    """A client killed with reservations and live stream-ordered allocations leaves nothing charged."""
    with mpsd_client.connect(daemon.pipe_dir) as ctx:
        free = ctx.mem_get_info()[0]
        worker = spawn_worker("""
            import sys, mpsd_client
            ctx = mpsd_client.connect()
            pool = ctx.mem_pool_create()
            pool.set_attribute("release_threshold", 1 << 62)
            s = ctx.create_stream()
            ptrs = [ctx.malloc_from_pool_async(8 << 20, pool, s) for _ in range(12)]
            ctx.free_async(ptrs[0], s)
            ctx.malloc_async(1 << 20)
            ctx.synchronize()
            print(ctx.statistics()["memory_pool_reserved"], flush=True)
            sys.stdin.readline()
        """, daemon.pipe_dir)
        try:
            assert worker.stdout.readline() == f"{128 * MiB}\n"
            assert free - ctx.mem_get_info()[0] >= 128 * MiB
        finally:
            worker.send_signal(signal.SIGKILL)
            worker.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while ctx.mem_get_info()[0] != free and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctx.mem_get_info()[0] == free


async def test_a_destroyed_stream_is_refused_at_once_and_the_ledger_stays_whole(actx, autojump_clock):
    """free_async on a stream destroyed since is cudaErrorInvalidResourceHandle from the call, as CUDA's host
    call gives it; the allocation stays live and is freed on another stream."""
    s = await actx.create_stream()
    p = await actx.malloc_async(MiB, s)
    await s.destroy()
    with pytest.raises(InvalidResourceHandleError):
        actx.free_async(p, s)
    actx.free_async(p)
    assert (await actx.statistics())["memory_in_use"] == 0


def test_the_fidelity_probe_finds_on_mpsd_what_it_found_on_the_h200(daemon):
    """bench/fidelity/measure_pools.py, run on the H200 through cuda-python (h200_pools.json) and here against
    mpsd: the packing, the used bytes, the reservations of large requests, the thresholds and trim_to, the
    high marks and the reuse flags come out the same, but for the two cases we knowingly differ in (the README
    says why): a free on an idle stream that the H200 reused opportunistically after an event, and unused room
    that the H200 preferred to a just-freed range it could have made a stream wait for."""
    probe = Path(__file__).parent.parent / "bench" / "fidelity" / "measure_pools.py"
    result = subprocess.run([sys.executable, str(probe), "--mpsd", "--no-timing"], capture_output=True, text=True,
                            env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(daemon.pipe_dir)}, timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    h200 = json.loads((probe.parent / "h200_pools.json").read_text())
    for key in ("packing", "large", "thresholds", "marks"):
        assert found[key] == h200[key], key
    differ = {("reuse_follow_event_dependencies=0/reuse_allow_opportunistic=1/reuse_allow_internal_dependencies=0",
               "after_an_event"),
              ("reuse_follow_event_dependencies=1/reuse_allow_opportunistic=1/reuse_allow_internal_dependencies=1",
               "at_once")}
    assert {(flags, case) for flags, row in h200["reuse"].items() for case, reused in row.items()
            if found["reuse"][flags][case] != reused} == differ
