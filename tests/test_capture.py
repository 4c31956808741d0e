# Stream capture's rules, each as an H200 showed it or as CUDA documents it where no measurement covers it. The
# measured ones are replayed whole: every case of bench/fidelity/graph_capture_h200.json runs here, step by step,
# through the trio client on an in-process daemon, and every step's answer must be the H200's. The rest (forks and
# joins, the errors 902 to 908, the modes' thread rules, copies that synchronise) are cases of their own below.
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import mpsd_client
from inproc import in_process_daemon
from mpsd_client import (CudaError, IllegalStateError, StreamCaptureImplicitError, StreamCaptureInvalidatedError,
                         StreamCaptureIsolationError, StreamCaptureMergeError, StreamCaptureUnjoinedError,
                         StreamCaptureUnmatchedError, StreamCaptureUnsupportedError)

MEASURED = json.loads((Path(__file__).parent.parent / "bench/fidelity/graph_capture_h200.json").read_text())
STATUS = {"none": "cudaStreamCaptureStatusNone", "active": "cudaStreamCaptureStatusActive",
          "invalidated": "cudaStreamCaptureStatusInvalidated"}
MIB = 1 << 20


def _driver_name(answer: str) -> str:
    """CuPy's launch errors are the driver's (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: ...): the runtime's name."""
    if answer.startswith("CUDADriverError: CUDA_ERROR_"):
        words = answer.split(":")[1].strip()[len("CUDA_ERROR_"):].split("_")
        return "cudaError" + "".join(w.title() for w in words)
    return answer


class Case:
    """One measured case, made again through mpsd's client: its calls as measure_graph_capture.py makes them."""

    def __init__(self, ctx, mode: str) -> None:
        self.ctx, self.mode, self.out = ctx, mode, []

    async def call(self, name: str, op) -> object:
        try:
            result = await op
        except CudaError as exc:
            self.out.append([name, exc.name])
            return None
        self.out.append([name, "cudaSuccess"])
        return result

    async def launch(self, name: str, stream) -> None:
        """An empty kernel: a launch is fire-and-forget here, so its own error is the last error it left (the
        last error of the calls before it cleared first)."""
        await self.ctx.get_last_error()
        await self.ctx.launch("spin", 1, 32, [0], stream=stream)
        error = await self.ctx.get_last_error()
        self.out.append([name, error.name if error else "cudaSuccess"])

    async def status(self, stream) -> None:
        info = await stream.capture_info() if stream is not None else mpsd_client.CaptureInfo("none")
        self.out.append(["is capturing", ["cudaSuccess", STATUS[info.status]]])

    async def run(self, case: str) -> list:
        ctx = self.ctx
        s, n = await ctx.create_stream(), await ctx.create_stream(non_blocking=True)
        e = await ctx.create_event(disable_timing=True)
        await self.launch("warm launch on s", s)
        await ctx.synchronize()
        host, dev = await ctx.host_alloc(MIB), await ctx.malloc(MIB)
        target = {"legacy": None, "s": s, "n": n}[case.split(":")[0]]
        stream = target if target is not None else mpsd_client.Stream(ctx, 0, 0, False)  # the legacy stream
        await self.call("begin capture", stream.begin_capture(self.mode))
        if case.endswith("twice"):
            await self.call("begin again", stream.begin_capture(self.mode))
        await self.status(target)
        for step in case.split(":")[1].split(",") if ":" in case and not case.endswith("twice") else []:
            await self.step(step, target, n, e, host, dev)
        await self.status(target)
        graph = await self.call("end capture", stream.end_capture())
        if graph is not None:
            self.out.append(["nodes", len(await graph.nodes())])
            executable = await self.call("instantiate", graph.instantiate())
            if executable is not None:
                await self.call("graph launch on n", executable.launch(n))
                await self.call("graph launch on legacy", executable.launch(None))
                await self.call("synchronize", ctx.synchronize())
        await self.call("end again", stream.end_capture())
        await self.call("stream sync after", stream.synchronize())
        await self.launch("launch after", target)
        await self.call("device sync after", ctx.synchronize())
        return self.out

    async def step(self, step: str, target, n, e, host, dev) -> None:
        ctx = self.ctx
        if step == "launch":
            await self.launch("launch on it", target)
        elif step == "memset":
            await self.call("memset on it", ctx.memset(dev, 0, MIB, target))
        elif step == "dtod":
            await self.call("dtod on it", ctx.memcpy_dtod(dev, dev, 0, target))
        elif step == "htod_pinned":
            await self.call("htod pinned on it", ctx.memcpy_htod(dev, host, target))
        elif step == "device_sync":
            await self.call("cudaDeviceSynchronize", ctx.synchronize())
        elif step == "stream_sync":
            await self.call("cudaStreamSynchronize(it)", target.synchronize())
        elif step == "stream_query":
            await self.call("cudaStreamQuery(it)", target.query())
        elif step == "other_sync":
            await self.call("cudaStreamSynchronize(n)", n.synchronize())
        elif step == "legacy_launch":
            await self.launch("launch on the legacy stream", None)
        elif step == "other_launch":
            await self.launch("launch on n", n)
        elif step == "malloc":
            await self.call("cudaMalloc", ctx.malloc(MIB))
        elif step == "free":
            await self.call("cudaFree", ctx.free(dev))
        elif step == "mem_get_info":
            await self.call("cudaMemGetInfo", ctx.mem_get_info())
        elif step == "record":
            await self.call("cudaEventRecord(e, it)", e.record(target))
        elif step == "event_query":
            await self.call("cudaEventQuery(e)", e.query())
        elif step == "event_sync":
            await self.call("cudaEventSynchronize(e)", e.synchronize())
        elif step == "sync_memcpy":
            await self.call("cudaMemcpy dtod", ctx.memcpy_dtod(dev, dev, 0))
        else:
            raise AssertionError(step)


@pytest.mark.parametrize("key", sorted(MEASURED))
async def test_every_measured_case_answers_as_the_h200_did(key, autojump_clock):
    """Each call of each case of graph_capture_h200.json, in every mode measured, gives the H200's answer: what is
    captured, what is refused (900, 906, 907, 401) and invalidates, and what works again after the end."""
    mode, case = key.split(" ", 1)
    async with in_process_daemon("--time-scale", "100") as d, d.connect() as ctx:
        got = await Case(ctx, mode).run(case)
    want = [[name, _driver_name(answer) if isinstance(answer, str) else answer] for name, answer in MEASURED[key]]
    assert got == want


# -- the rules no measurement covers yet: as CUDA's documentation gives them ---------------------------------
async def _fork(actx, origin, other):
    """Record an event on `origin` and make `other` wait on it: `other` joins the capture (a fork)."""
    fork = await actx.create_event(disable_timing=True)
    await fork.record(origin)
    await other.wait_event(fork)


async def test_a_fork_joins_the_other_stream_to_the_capture_and_a_join_ends_it(actx, autojump_clock):
    """A stream that waits on an event recorded in a capture captures too; its work depends on the fork point, and
    the origin's next work on both branches once it waits on the other's event (a join)."""
    s, t = await actx.create_stream(), await actx.create_stream(non_blocking=True)
    p = await actx.malloc(MIB)
    await s.begin_capture()
    await actx.launch("fill_f32", 1, 256, [p, 1.0, 256], stream=s)
    await _fork(actx, s, t)
    assert await t.is_capturing() and (await t.capture_info()).id == (await s.capture_info()).id
    await actx.launch("fill_f32", 1, 256, [p + 4096, 2.0, 256], stream=t)
    await actx.launch("fill_f32", 1, 256, [p + 8192, 3.0, 256], stream=s)
    join = await actx.create_event(disable_timing=True)
    await join.record(t)
    await s.wait_event(join)
    await actx.launch("fill_f32", 1, 256, [p + 12288, 4.0, 256], stream=s)
    graph = await s.end_capture()
    assert not await t.is_capturing()
    first, branch, other, last = await graph.nodes()
    assert branch.deps == (first.id,) and other.deps == (first.id,)
    assert set(last.deps) == {branch.id, other.id}


async def test_ending_an_unjoined_fork_is_unjoined_and_ends_the_capture(actx, autojump_clock):
    """cudaErrorStreamCaptureUnjoined (904) where a forked stream's work was not waited for by the origin; the
    capture is over for both streams, and both work again."""
    s, t = await actx.create_stream(), await actx.create_stream(non_blocking=True)
    await s.begin_capture()
    await _fork(actx, s, t)
    await actx.launch("spin", 1, 32, [0], stream=t)
    with pytest.raises(StreamCaptureUnjoinedError):
        await s.end_capture()
    assert not await s.is_capturing() and not await t.is_capturing()
    await t.synchronize()
    await actx.synchronize()


async def test_ending_on_a_forked_stream_is_unmatched(actx, autojump_clock):
    """cudaErrorStreamCaptureUnmatched (903) on a stream the capture did not begin on; the capture is invalidated
    (its end on the origin says so) and then over."""
    s, t = await actx.create_stream(), await actx.create_stream(non_blocking=True)
    await s.begin_capture()
    await _fork(actx, s, t)
    with pytest.raises(StreamCaptureUnmatchedError):
        await t.end_capture()
    assert (await s.capture_info()).status == "invalidated"
    with pytest.raises(StreamCaptureInvalidatedError):
        await s.end_capture()
    await actx.synchronize()


async def test_waiting_on_an_event_recorded_outside_the_capture_is_isolation(actx, autojump_clock):
    """cudaErrorStreamCaptureIsolation (905): a capturing stream waits on an event recorded outside its capture;
    an event never recorded is no dependency at all."""
    s, n = await actx.create_stream(), await actx.create_stream(non_blocking=True)
    outside, never = await actx.create_event(), await actx.create_event()
    await outside.record(n)
    await s.begin_capture()
    await s.wait_event(never)
    assert (await s.capture_info()).status == "active"
    with pytest.raises(StreamCaptureIsolationError):
        await s.wait_event(outside)
    with pytest.raises(StreamCaptureInvalidatedError):
        await s.end_capture()


async def test_joining_two_captures_is_a_merge(actx, autojump_clock):
    """cudaErrorStreamCaptureMerge (902): a stream of one capture waits on an event of another; both invalidated."""
    s, t = await actx.create_stream(), await actx.create_stream()
    e = await actx.create_event(disable_timing=True)
    await s.begin_capture()
    await t.begin_capture()
    await e.record(s)
    with pytest.raises(StreamCaptureMergeError):
        await t.wait_event(e)
    for stream in (s, t):
        with pytest.raises(StreamCaptureInvalidatedError):
            await stream.end_capture()


async def test_work_on_an_invalidated_capture_and_its_records_are_invalidated(actx, autojump_clock):
    """After a refused call, every call into the capture (a copy, a record, a wait) is
    cudaErrorStreamCaptureInvalidated, and the end is too; the stream then works as before."""
    s = await actx.create_stream()
    p, e = await actx.malloc(MIB), await actx.create_event()
    await s.begin_capture()
    with pytest.raises(StreamCaptureUnsupportedError):
        await actx.synchronize()
    for call in (actx.memset(p, 0, 16, s), e.record(s), actx.memcpy_dtod(p, p + 64, 64, s)):
        with pytest.raises(StreamCaptureInvalidatedError):
            await call
    with pytest.raises(StreamCaptureInvalidatedError):
        await s.end_capture()
    with pytest.raises(IllegalStateError):
        await s.end_capture()
    await actx.memset(p, 7, 16, s)
    await s.synchronize()
    assert bytes((await actx.host_view(p))[:16]) == b"\x07" * 16


async def test_a_copy_that_synchronises_is_unsafe_and_pageable_memory_cannot_be_captured(actx, autojump_clock):
    """A synchronous copy is a potentially unsafe call (refused in global mode); a pageable copy on the capturing
    stream cannot be captured in any mode (its bytes are staged when the call is made)."""
    s = await actx.create_stream()
    p, host = await actx.malloc(MIB), await actx.host_alloc(4096)
    await s.begin_capture()
    with pytest.raises(StreamCaptureUnsupportedError):
        await actx.memcpy_htod(p, host)  # no stream: it synchronises
    with pytest.raises(StreamCaptureInvalidatedError):
        await s.end_capture()
    await s.begin_capture("relaxed")
    with pytest.raises(StreamCaptureUnsupportedError):
        await actx.memcpy_htod(p, bytearray(4096), s)  # pageable
    with pytest.raises(StreamCaptureInvalidatedError):
        await s.end_capture()


async def test_a_synchronous_copy_in_relaxed_mode_beside_a_blocking_capture_is_implicit(actx, autojump_clock):
    """Relaxed mode lets a synchronous copy go, onto the legacy stream, which would wait for the capturing
    blocking stream: cudaErrorStreamCaptureImplicit, as a launch there is."""
    s = await actx.create_stream()
    p, host = await actx.malloc(MIB), await actx.host_alloc(4096)
    await s.begin_capture("relaxed")
    with pytest.raises(StreamCaptureImplicitError):
        await actx.memcpy_htod(p, host)
    with pytest.raises(StreamCaptureInvalidatedError):
        await s.end_capture()


async def test_destroying_the_capturing_stream_ends_its_capture(actx, autojump_clock):
    """The origin of a capture destroyed: the capture is over (nothing is left capturing), and synchronize works."""
    s, t = await actx.create_stream(), await actx.create_stream(non_blocking=True)
    await s.begin_capture()
    await _fork(actx, s, t)
    await s.destroy()
    assert not await t.is_capturing()
    await actx.synchronize()


def test_thread_local_and_global_modes_follow_the_capturing_thread(ctx):
    """An unsafe call from another thread is refused while a global capture is under way and allowed beside a
    thread-local one; from the capturing thread both refuse it; a thread in relaxed mode
    (cudaThreadExchangeStreamCaptureMode) may make it beside a global capture; a thread-local capture ends only
    in its own thread (cudaErrorStreamCaptureWrongThread, 908)."""

    def in_thread(call):
        result: list[object] = []
        thread = threading.Thread(target=lambda: result.append(_outcome(call)))
        thread.start()
        thread.join()
        return result[0]

    def relaxed_malloc():
        before = ctx.thread_exchange_stream_capture_mode("relaxed")
        try:
            return ctx.malloc(MIB)
        finally:
            ctx.thread_exchange_stream_capture_mode(before)

    s = ctx.create_stream()
    s.begin_capture("thread_local")
    assert in_thread(lambda: ctx.malloc(MIB)) == "cudaSuccess"
    assert in_thread(s.end_capture) == "cudaErrorStreamCaptureWrongThread"
    with pytest.raises(StreamCaptureUnsupportedError):
        ctx.malloc(MIB)
    with pytest.raises(StreamCaptureInvalidatedError):
        s.end_capture()
    s.begin_capture("global")
    assert in_thread(relaxed_malloc) == "cudaSuccess"
    assert in_thread(lambda: ctx.malloc(MIB)) == "cudaErrorStreamCaptureUnsupported"
    with pytest.raises(StreamCaptureInvalidatedError):
        s.end_capture()
    s.begin_capture("relaxed")
    assert in_thread(lambda: ctx.malloc(MIB)) == "cudaSuccess"
    ctx.malloc(MIB)
    assert s.end_capture().nodes() == []


def _outcome(call) -> str:
    try:
        call()
    except CudaError as exc:
        return exc.name
    return "cudaSuccess"
