# Streams and events through the real daemon. Simulated times are exact once work is queued behind a
# "blocker" (one long single-block kernel): while it runs, everything after it is queued, so what follows
# starts when the simulator says and the wall clock no longer matters.
from __future__ import annotations

import pytest

import mpsd_client
from mpsd.sim import H200
from mpsd_client import InvalidResourceHandleError, NotReadyError

ONE_MS = int(1e-3 * 1.98e9)  # spin cycles for 1 ms at the H200's 1.98 GHz
OVERHEAD_MS = H200.kernel_overhead * 1e3  # the model's per-kernel launch overhead
FULL, QUARTER = 264, 66  # blocks of 1024 threads: one wave on 132 SMs, a quarter of it


def blocker(ctx, stream=None, seconds: float = 20.0) -> None:
    """A single-block kernel that holds `stream` for `seconds` of simulated time (0.2 s wall at 100x)."""
    ctx.launch("spin", 1, 32, [int(seconds * 1.98e9)], stream=stream)


def test_kernel_time_between_events_is_exact(ctx):
    """Events around a 1-ms full-wave kernel measure 1 ms plus the launch overhead, in simulated time."""
    s = ctx.create_stream()
    start, end = ctx.create_event(), ctx.create_event()
    blocker(ctx, s)
    start.record(s)
    ctx.launch("spin", FULL, 1024, [ONE_MS], stream=s)
    end.record(s)
    end.synchronize()
    assert start.elapsed_ms(end) == pytest.approx(1 + OVERHEAD_MS, abs=1e-9)


def test_work_in_one_stream_runs_in_order(ctx):
    """Two kernels in one stream run one after the other."""
    s = ctx.create_stream()
    start, end = ctx.create_event(), ctx.create_event()
    blocker(ctx, s)
    start.record(s)
    for _ in range(2):
        ctx.launch("spin", QUARTER, 1024, [ONE_MS], stream=s)
    end.record(s)
    end.synchronize()
    assert start.elapsed_ms(end) == pytest.approx(2 * (1 + OVERHEAD_MS), abs=1e-9)


def test_work_in_different_streams_overlaps(ctx):
    """Kernels in two streams that fit on the GPU together run at the same time."""
    s1, s2 = ctx.create_stream(), ctx.create_stream()
    start, e1, e2 = ctx.create_event(), ctx.create_event(), ctx.create_event()
    blocker(ctx)  # on the legacy default stream: both blocking streams wait for it
    start.record()
    for s, e in ((s1, e1), (s2, e2)):
        ctx.launch("spin", QUARTER, 1024, [ONE_MS], stream=s)
        e.record(s)
    ctx.synchronize()
    assert start.elapsed_ms(e1) == pytest.approx(1 + OVERHEAD_MS, abs=1e-9)
    assert start.elapsed_ms(e2) == pytest.approx(1 + OVERHEAD_MS, abs=1e-9)


def test_wait_event_orders_work_across_streams(ctx):
    """stream.wait_event makes later work wait for the event's record in another stream."""
    s1, s2 = ctx.create_stream(non_blocking=True), ctx.create_stream(non_blocking=True)
    ready, done = ctx.create_event(), ctx.create_event()
    blocker(ctx, s1)
    ready.record(s1)
    s2.wait_event(ready)
    ctx.launch("spin", FULL, 1024, [ONE_MS], stream=s2)
    done.record(s2)
    done.synchronize()
    assert ready.elapsed_ms(done) == pytest.approx(1 + OVERHEAD_MS, abs=1e-9)


def test_legacy_default_stream_waits_for_blocking_streams_only(ctx):
    """Work on stream 0 waits for blocking streams' earlier work, not for non-blocking streams'."""
    blocking, free = ctx.create_stream(), ctx.create_stream(non_blocking=True)
    after_blocking, after_null = ctx.create_event(), ctx.create_event()
    blocker(ctx, blocking, seconds=20)
    after_blocking.record(blocking)
    blocker(ctx, free, seconds=1000)
    ctx.launch("spin", QUARTER, 1024, [ONE_MS])
    after_null.record()
    after_null.synchronize()
    assert after_blocking.elapsed_ms(after_null) == pytest.approx(1 + OVERHEAD_MS, abs=1e-9)
    assert not free.query()


def test_query_reports_progress(ctx):
    """stream.query and event.query are False while work is pending and True once it is done."""
    s = ctx.create_stream()
    e = ctx.create_event()
    assert s.query() and e.query()  # an empty stream, a never-recorded event
    e.synchronize()  # returns at once for a never-recorded event
    blocker(ctx, s, seconds=30)
    e.record(s)
    assert not s.query() and not e.query()
    s.synchronize()
    assert s.query() and e.query()


def test_elapsed_time_errors(ctx):
    """elapsed_ms needs two completed, recorded, timing-enabled events, with CUDA's error codes."""
    a, b = ctx.create_event(), ctx.create_event()
    untimed = ctx.create_event(disable_timing=True)
    with pytest.raises(InvalidResourceHandleError):
        a.elapsed_ms(b)  # never recorded
    a.record()
    untimed.record()
    ctx.synchronize()
    with pytest.raises(InvalidResourceHandleError):
        a.elapsed_ms(untimed)
    blocker(ctx, seconds=30)
    b.record()
    with pytest.raises(NotReadyError):
        a.elapsed_ms(b)
    b.synchronize()
    assert a.elapsed_ms(b) > 0
    with pytest.raises(mpsd_client.InvalidValueError):
        ctx.create_event(interprocess=True)  # interprocess events must also disable timing


def test_stream_priorities_are_clamped_to_the_device_range(ctx):
    """Priorities outside [-5, 0] are clamped, as cudaStreamCreateWithPriority does."""
    assert ctx.stream_priority_range() == (0, -5)
    assert ctx.create_stream(priority=-10).priority == -5
    assert ctx.create_stream(priority=3).priority == 0
    assert ctx.create_stream(priority=-2).priority == -2


def test_destroyed_handles_are_invalid_resource_handles(ctx, daemon):
    """Destroyed streams and events, and handles of another context, give cudaErrorInvalidResourceHandle."""
    s, e = ctx.create_stream(), ctx.create_event()
    s.destroy()
    e.destroy()
    for call in (s.synchronize, s.query, s.destroy, e.query, e.synchronize, lambda: e.record(),
                 lambda: ctx.create_event().record(s)):
        with pytest.raises(InvalidResourceHandleError):
            call()
    ctx.launch("spin", 1, 32, [0], stream=s)  # fire-and-forget: the error surfaces at the next sync
    with pytest.raises(InvalidResourceHandleError):
        ctx.synchronize()
    ctx.synchronize()  # reported once; not sticky
    with mpsd_client.connect(daemon.pipe_dir) as other:
        theirs = other.create_stream()
        with pytest.raises(InvalidResourceHandleError):
            ctx.launch("spin", 1, 32, [0], stream=theirs)


def test_stream_destroy_lets_queued_work_finish(ctx):
    """cudaStreamDestroy returns at once; work already queued on the stream still runs to completion."""
    s = ctx.create_stream()
    p = ctx.malloc(4096)
    blocker(ctx, s, seconds=10)
    ctx.launch("fill_f32", 4, 256, [p, 2.5, 1024], stream=s)
    s.destroy()
    ctx.synchronize()
    out = bytearray(4096)
    ctx.memcpy_dtoh(out, p)
    assert bytes(out) == b"\x00\x00\x20\x40" * 1024


async def test_async_context_runs_calls_from_concurrent_tasks(daemon):
    """AsyncContext: the same calls, awaited; one task synchronising does not hold up another."""
    import numpy as np
    import trio

    async with mpsd_client.open_context(daemon.pipe_dir) as actx:
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
