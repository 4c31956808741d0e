# Streams and events through the real daemon: served in this process under the autojump clock (tests/inproc.py),
# but for one smoke test against a daemon process. Simulated times are exact once work is queued behind a
# "blocker" (one long single-block kernel): while it runs, everything after it is queued, so what follows
# starts when the simulator says and the wall clock no longer matters.
from __future__ import annotations

import sys
import textwrap

import pytest
import trio

import mpsd_client
from inproc import in_process_daemon
from mpsd.sim import H200
from mpsd_client import InvalidResourceHandleError, NotReadyError

ONE_MS = int(1e-3 * 1.98e9)  # spin cycles for 1 ms at the H200's 1.98 GHz
OVERHEAD_MS = H200.kernel_overhead * 1e3  # the model's per-kernel launch overhead
FULL, QUARTER = 264, 66  # blocks of 1024 threads: one wave on 132 SMs, a quarter of it


async def blocker(actx, stream=None, seconds: float = 20.0) -> None:
    """A single-block kernel that holds `stream` for `seconds` of simulated time (none of the wall's under the
    autojump clock)."""
    await actx.launch("spin", 1, 32, [int(seconds * 1.98e9)], stream=stream)


def test_kernel_time_between_events_is_exact(ctx):
    """Events around a 1-ms full-wave kernel measure 1 ms plus the launch overhead, in simulated time."""
    s = ctx.create_stream()
    start, end = ctx.create_event(), ctx.create_event()
    ctx.launch("spin", 1, 32, [int(20 * 1.98e9)], stream=s)  # a blocker: 0.2 s of the wall at 100x
    start.record(s)
    ctx.launch("spin", FULL, 1024, [ONE_MS], stream=s)
    end.record(s)
    end.synchronize()
    assert start.elapsed_ms(end) == pytest.approx(1 + OVERHEAD_MS, abs=1e-9)


async def test_work_in_one_stream_runs_in_order(actx, autojump_clock):
    """Two kernels in one stream run one after the other."""
    s = await actx.create_stream()
    start, end = await actx.create_event(), await actx.create_event()
    await blocker(actx, s)
    await start.record(s)
    for _ in range(2):
        await actx.launch("spin", QUARTER, 1024, [ONE_MS], stream=s)
    await end.record(s)
    await end.synchronize()
    assert await start.elapsed_ms(end) == pytest.approx(2 * (1 + OVERHEAD_MS), abs=1e-9)


async def test_work_in_different_streams_overlaps(actx, autojump_clock):
    """Kernels in two streams that fit on the GPU together run at the same time."""
    s1, s2 = await actx.create_stream(), await actx.create_stream()
    start, e1, e2 = await actx.create_event(), await actx.create_event(), await actx.create_event()
    await blocker(actx)  # on the legacy default stream: both blocking streams wait for it
    await start.record()
    for s, e in ((s1, e1), (s2, e2)):
        await actx.launch("spin", QUARTER, 1024, [ONE_MS], stream=s)
        await e.record(s)
    await actx.synchronize()
    assert await start.elapsed_ms(e1) == pytest.approx(1 + OVERHEAD_MS, abs=1e-9)
    assert await start.elapsed_ms(e2) == pytest.approx(1 + OVERHEAD_MS, abs=1e-9)


async def test_wait_event_orders_work_across_streams(actx, autojump_clock):
    """stream.wait_event makes later work wait for the event's record in another stream."""
    s1, s2 = await actx.create_stream(non_blocking=True), await actx.create_stream(non_blocking=True)
    ready, done = await actx.create_event(), await actx.create_event()
    await blocker(actx, s1)
    await ready.record(s1)
    await s2.wait_event(ready)
    await actx.launch("spin", FULL, 1024, [ONE_MS], stream=s2)
    await done.record(s2)
    await done.synchronize()
    assert await ready.elapsed_ms(done) == pytest.approx(1 + OVERHEAD_MS, abs=1e-9)


async def test_legacy_default_stream_waits_for_blocking_streams_only(actx, autojump_clock):
    """Work on stream 0 waits for blocking streams' earlier work, not for non-blocking streams'."""
    blocking, free = await actx.create_stream(), await actx.create_stream(non_blocking=True)
    after_blocking, after_null = await actx.create_event(), await actx.create_event()
    await blocker(actx, blocking, seconds=20)
    await after_blocking.record(blocking)
    await blocker(actx, free, seconds=1000)
    await actx.launch("spin", QUARTER, 1024, [ONE_MS])
    await after_null.record()
    await after_null.synchronize()
    assert await after_blocking.elapsed_ms(after_null) == pytest.approx(1 + OVERHEAD_MS, abs=1e-9)
    assert not await free.query()


async def test_query_reports_progress(actx, autojump_clock):
    """stream.query and event.query are False while work is pending and True once it is done."""
    s = await actx.create_stream()
    e = await actx.create_event()
    assert await s.query() and await e.query()  # an empty stream, a never-recorded event
    await e.synchronize()  # returns at once for a never-recorded event
    await blocker(actx, s, seconds=30)
    await e.record(s)
    assert not await s.query() and not await e.query()
    await s.synchronize()
    assert await s.query() and await e.query()


async def test_elapsed_time_errors(actx, autojump_clock):
    """elapsed_ms needs two completed, recorded, timing-enabled events, with CUDA's error codes."""
    a, b = await actx.create_event(), await actx.create_event()
    untimed = await actx.create_event(disable_timing=True)
    with pytest.raises(InvalidResourceHandleError):
        await a.elapsed_ms(b)  # never recorded
    await a.record()
    await untimed.record()
    await actx.synchronize()
    with pytest.raises(InvalidResourceHandleError):
        await a.elapsed_ms(untimed)
    await blocker(actx, seconds=30)
    await b.record()
    with pytest.raises(NotReadyError):
        await a.elapsed_ms(b)
    await b.synchronize()
    assert await a.elapsed_ms(b) > 0
    with pytest.raises(mpsd_client.InvalidValueError):
        await actx.create_event(interprocess=True)  # interprocess events must also disable timing


async def test_stream_priorities_are_clamped_to_the_device_range(actx, autojump_clock):
    """Priorities outside [-5, 0] are clamped, as cudaStreamCreateWithPriority does."""
    assert actx.stream_priority_range() == (0, -5)
    assert (await actx.create_stream(priority=-10)).priority == -5
    assert (await actx.create_stream(priority=3)).priority == 0
    assert (await actx.create_stream(priority=-2)).priority == -2


async def test_destroyed_handles_are_invalid_resource_handles(actx, served, autojump_clock):
    """Destroyed streams and events, and handles of another context, give cudaErrorInvalidResourceHandle."""
    s, e = await actx.create_stream(), await actx.create_event()
    await s.destroy()
    await e.destroy()

    async def record_new_event_in_s():
        await (await actx.create_event()).record(s)

    for call in (s.synchronize, s.query, s.destroy, e.query, e.synchronize, e.record, record_new_event_in_s):
        with pytest.raises(InvalidResourceHandleError):
            await call()
    await actx.launch("spin", 1, 32, [0], stream=s)  # fire-and-forget: the error surfaces at the next sync
    with pytest.raises(InvalidResourceHandleError):
        await actx.synchronize()
    await actx.synchronize()  # reported once; not sticky
    async with served.connect() as other:
        theirs = await other.create_stream()
        with pytest.raises(InvalidResourceHandleError):
            await actx.launch("spin", 1, 32, [0], stream=theirs)


async def test_stream_destroy_lets_queued_work_finish(actx, autojump_clock):
    """cudaStreamDestroy returns at once; work already queued on the stream still runs to completion."""
    s = await actx.create_stream()
    p = await actx.malloc(4096)
    await blocker(actx, s, seconds=10)
    await actx.launch("fill_f32", 4, 256, [p, 2.5, 1024], stream=s)
    await s.destroy()
    await actx.synchronize()
    out = bytearray(4096)
    await actx.memcpy_dtoh(out, p)
    assert bytes(out) == b"\x00\x00\x20\x40" * 1024


async def test_a_kernel_that_never_ends_holds_no_other_streams_launches(actx, autojump_clock):
    """The launch queue counts work that has not ended: 1,500 short launches on one stream go through while a
    kernel that outlasts the test holds another stream (a queue freed only from its oldest entry, across
    streams, would hold the 1,024th for ever)."""
    a, b = await actx.create_stream(), await actx.create_stream()
    await actx.launch("spin", 1, 32, [10**15], stream=a)  # days of simulated time
    with trio.fail_after(60):
        for _ in range(1500):
            await actx.launch("spin", 1, 32, [1000], stream=b)
        await b.synchronize()
    assert not await a.query()


async def test_async_context_runs_calls_from_concurrent_tasks(served, autojump_clock):
    """AsyncContext: the same calls, awaited; one task synchronising does not hold up another."""
    import numpy as np
    import trio

    async with served.connect() as actx:
        p = await actx.malloc(4 << 10)
        await actx.memcpy_htod(p, np.arange(1024, dtype=np.float32))
        slow = await actx.create_stream(non_blocking=True)
        await actx.launch("spin", 1, 32, [int(30 * 1.98e9)], stream=slow)
        order = []

        async def sync_slow():
            await slow.synchronize()
            order.append("slow")

        async def quick():
            out = np.empty(1024, np.float32)
            await actx.launch("saxpy_f32", 4, 256, [2.0, p, p, 1024])
            await actx.memcpy_dtoh(out, p)  # the legacy stream does not wait for non-blocking ones
            order.append(("quick", float(out[3])))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync_slow)
            await trio.sleep(0.01)
            nursery.start_soon(quick)
        assert order[-1] == "slow"
        assert ("quick", 9.0) in order
        assert (await actx.statistics())["kernels_completed"] == 2


async def test_calls_read_together_reach_the_device_together(tmp_path):
    """Under the wall clock, launches a client sent faster than the daemon serves them are submitted at the
    simulated time they were read, not spread out by the daemon's own time over each (which would leave the
    device idle in the model while they wait in the socket); that wait counts as lag instead."""
    trace = tmp_path / "trace.json"
    async with in_process_daemon("--time-scale", "1000", "--trace", str(trace)) as d:
        worker = """
            import mpsd_client
            with mpsd_client.connect() as ctx:
                for _ in range(400):
                    ctx.launch("spin", 1, 32, [0])
                ctx.synchronize()
        """
        proc = await trio.run_process([sys.executable, "-c", textwrap.dedent(worker)], capture_stderr=True,
                                      check=False, env={"CUDA_MPS_PIPE_DIRECTORY": str(d.pipe_dir)})
        assert proc.returncode == 0, proc.stderr
        backend = d.daemon.devices[0].backend
        submitted = [op.submitted for op, _ in backend.recorder.kernels]
    assert len(submitted) == 400
    # Each read from the socket holds many launches; every launch of one read has one submission time.
    assert len(set(submitted)) < len(submitted) / 4
    assert backend.engine.max_lag > 0


async def _false_dependency_ms(actx, between: int) -> float:
    """Streams a and b, with `between` streams first used between them: 1 ms and 1 ms of quarter waves on a
    (one after the other), 2 ms on b; ms from their common start to b's end. 2 ms (plus overheads) if b runs
    beside a; 3 if b's work is queued behind a's second kernel, which waits for a's first to end."""
    streams = [await actx.create_stream(non_blocking=True) for _ in range(between + 3)]
    first, a, *others, b = streams
    start, end = await actx.create_event(), await actx.create_event()
    await blocker(actx, first)  # the streams are first used in this order, after it: their work is queued
    await start.record(first)
    for s in (a, *others, b):
        await s.wait_event(start)
    await actx.launch("spin", QUARTER, 1024, [ONE_MS], stream=a)
    await actx.launch("spin", QUARTER, 1024, [ONE_MS], stream=a)
    await actx.launch("spin", QUARTER, 1024, [2 * ONE_MS], stream=b)
    await end.record(b)
    await end.synchronize()
    return await start.elapsed_ms(end)


@pytest.mark.parametrize(("connections", "between", "serial"), [
    (None, 0, False), ("1", 0, True),  # streams on queues of their own; one queue for all
    (None, 7, True), ("9", 7, False),  # the ninth stream after a shares its queue under CUDA's default of 8
    ("0", 0, True), ("100", 7, False),  # the driver takes what it can: 1 to 32
])
async def test_streams_sharing_a_hardware_queue_falsely_depend_on_each_other(autojump_clock, connections, between,
                                                                             serial):
    """CUDA_DEVICE_MAX_CONNECTIONS hardware work queues (8 unset) carry a client's streams, round robin: work on a
    stream that shares a's queue waits behind a's second kernel until that kernel's turn comes (a's first ends),
    then runs beside it: the order of the queue, not of the streams."""
    environ = {} if connections is None else {"CUDA_DEVICE_MAX_CONNECTIONS": connections}
    async with in_process_daemon() as d, d.connect(**environ) as actx:
        elapsed = await _false_dependency_ms(actx, between)
    assert elapsed == pytest.approx((3 if serial else 2) + OVERHEAD_MS, abs=2 * OVERHEAD_MS)


async def test_a_malformed_connection_count_is_refused_naming_it(autojump_clock):
    async with in_process_daemon() as d:
        with pytest.raises(mpsd_client.InvalidValueError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
            async with d.connect(CUDA_DEVICE_MAX_CONNECTIONS="eight"):
                pass
