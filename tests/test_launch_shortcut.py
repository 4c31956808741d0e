# The launch notification's short way from the session to the backend (Session._launch, Context.planned): it
# serves a launch whose plan the context has kept, and hands everything else to the general path (the call's
# row, then Context.plan's checks in CUDA's order, then Context.launch). It must queue exactly what that path
# queues, never take a launch that path refuses, count in the client's launch queue as that path does, and leave
# every error what it was.
from __future__ import annotations

import dataclasses
import re

import pytest
import trio

from mpsd.backends.ops import Launch
from mpsd_client import IllegalAddressError
from mpsd_protocol import CALLS, CudaError, Notification

GOOD = {"name": "spin", "grid": [1, 1, 1], "block": [32, 1, 1], "args": [0], "shared_mem": 0, "stream": None}
MISSING = object()  # an argument left out of the map
# Launches that differ from GOOD by one value, and the error the general path gives each (its message, in part).
BAD = [
    ({"stream": True}, "invalid argument: launch: stream True is not a stream handle or None"),  # a dict: True is 1
    ({"stream": 1.0}, "invalid argument: launch: stream 1.0 is not a stream handle or None"),
    ({"stream": "0"}, "invalid argument: launch: stream '0' is not a stream handle or None"),
    ({"stream": 99}, "invalid resource handle: no stream 99 in this context"),
    ({"name": None}, "invalid argument: launch: name None is not a string"),
    ({"name": MISSING}, "invalid argument: launch needs name (a string)"),
    ({"name": "spinn"}, "invalid device function: no kernel named 'spinn'"),
    ({"shared_mem": True}, "invalid argument: launch: shared_mem True is not an int"),
    ({"shared_mem": 1.0}, "invalid argument: launch: shared_mem 1.0 is not an int"),
    ({"grid": [True, 1, 1]}, "invalid configuration argument: grid [True, 1, 1] is outside 1..(2147483647, 65535, "
                             "65535)"),
    ({"grid": [1.0, 1, 1]}, "invalid configuration argument: grid [1.0, 1, 1] is outside 1..(2147483647, 65535, "
                            "65535)"),
    ({"grid": [1, 1, 1, 32], "block": [1, 1]},  # the same values, split otherwise
     "invalid configuration argument: grid must be an int or a tuple of 1 to 3 ints, not [1, 1, 1, 32]"),
    ({"args": [False]}, "invalid argument: spin argument 0 must be i64, got False"),
    ({"args": [0.0]}, "invalid argument: spin argument 0 must be i64, got 0.0"),
    ({"args": [0, 0]}, "invalid argument: spin takes 1 arguments (i64), got 2"),
    ({"args": [[0]]}, "invalid argument: spin argument 0 must be i64, got [0]"),  # unhashable: no key at all
]


def _bad(change: dict) -> dict:
    return {key: value for key, value in {**GOOD, **change}.items() if value is not MISSING}


def _only_context(served):
    (ctx,) = served.daemon.devices[0].contexts.values()
    return ctx


def _general(ctx, args: dict) -> Launch:
    """What the session's general path does with a launch's argument map: the row's checks, the plan, then
    `launch` (Session.on_launch)."""
    name, grid, block, kargs, shared_mem, stream = CALLS["launch"].check(args)
    return ctx.launch(ctx.plan(name, grid, block, kargs, shared_mem), stream)


def _short(ctx, args: dict) -> Launch | None:
    """What the short way does with a launch's argument map: its plan, where one was kept, launched (the
    session checks first that its stream is an int or None, which `test_a_bad_launch_gets_the_same_error_after_a_
    good_one` holds it to)."""
    plan = ctx.planned(args)
    return None if plan is None else ctx.launch(plan, args.get("stream"))


def _fields(work: Launch) -> dict:
    return {f.name: getattr(work, f.name) for f in dataclasses.fields(work) if f.name != "handle"}


async def test_the_shortcut_queues_what_the_general_path_queues(served, actx, autojump_clock):
    """Once a launch's plan is kept, the shortcut gives the Launch that the general path gives, on the default
    stream and on another, and makes it its stream's last work."""
    ctx = _only_context(served)
    await actx.create_stream()
    stream = max(ctx.streams)
    assert _short(ctx, GOOD) is None  # nothing kept yet: it does nothing
    assert ctx.counters.launches == 0 and ctx.last_op is None
    for args in (GOOD, {**GOOD, "stream": stream}):
        general = _general(ctx, args)
        short = _short(ctx, args)
        assert short is not None and short is not general and ctx.last_op is short
        assert _fields(short) == _fields(general)
        assert ctx.streams[0 if args["stream"] is None else stream].tail is short
    assert ctx.counters.launches == 4
    await actx.synchronize()
    assert (await actx.statistics())["kernels_completed"] == 4


async def test_a_cached_launch_keeps_the_legacy_default_streams_order(served, actx, autojump_clock):
    """A launch the short way on a blocking stream waits for the default stream's work, and one on the default
    stream for the blocking stream's, as `launch` queues them (a kernel of 1 ms of one block, which would
    otherwise run beside the other)."""
    ctx = _only_context(served)
    await actx.create_stream()
    stream = max(ctx.streams)
    ms = {**GOOD, "args": [int(1.98e6)]}
    works = []
    for args in (ms, {**ms, "stream": stream}, ms):
        await _error_of(actx, args)
        works.append(ctx.last_op)
    assert ctx.planned(ms) is not None  # the second and third went the short way too
    await actx.synchronize()
    first, second, third = (work.ended for work in works)
    assert second - first == pytest.approx(1e-3, rel=0.01) and third - second == pytest.approx(1e-3, rel=0.01)


async def test_the_shortcut_takes_no_launch_the_general_path_refuses(served, actx, autojump_clock):
    """Every launch that differs from a planned one by a value of another kind is left to the general path,
    which refuses it; one that differs by its stream alone finds the plan, and the stream is looked at where
    the launch is made."""
    ctx = _only_context(served)
    await actx.create_stream()
    assert 1 in ctx.streams  # what True and 1.0 would find, taken for 1
    _general(ctx, GOOD)
    plan = ctx.planned(GOOD)
    assert plan is not None and ctx.counters.launches == 1
    for change, message in BAD:
        args = _bad(change)
        assert ctx.planned(args) is (plan if set(change) == {"stream"} else None), change
        with pytest.raises(CudaError, match=re.escape(message)):
            _general(ctx, args)
    assert ctx.counters.launches == 1
    await actx.synchronize()


async def _error_of(client, args: dict) -> CudaError | None:
    def op():
        yield Notification("launch", args)
    await client._drive(op())
    return await client.get_last_error()


async def test_a_bad_launch_gets_the_same_error_after_a_good_one(served, actx, autojump_clock):
    """Through the daemon, a bad launch sent after a good one of its shape (the shortcut's case) is refused with
    exactly the error a client that never launched gets (the general path's), and is not queued."""
    await actx.create_stream()  # stream 1, which True and 1.0 must not be taken for
    await _error_of(actx, GOOD)
    for change, message in BAD:
        async with served.connect() as fresh:
            await fresh.create_stream()
            first = await _error_of(fresh, _bad(change))
        again = await _error_of(actx, _bad(change))
        assert first is not None and first.message == message, (change, first)
        assert type(again) is type(first) and again.message == first.message, change
    await actx.synchronize()
    assert (await actx.statistics())["kernels_completed"] == 1


async def test_after_a_sticky_error_a_cached_launch_queues_nothing(served, actx, autojump_clock):
    ctx = _only_context(served)
    await _error_of(actx, GOOD)
    p = await actx.malloc(64)
    await actx.launch("fill_f32", 1, 32, [p, 0.0, 17])  # one float past the allocation
    with pytest.raises(IllegalAddressError):
        await actx.synchronize()
    launches = ctx.counters.launches
    assert isinstance(await _error_of(actx, GOOD), IllegalAddressError)
    assert ctx.counters.launches == launches


async def test_launches_by_the_shortcut_fill_the_launch_queue(served, actx, autojump_clock):
    """The client's 1,025th unfinished launch waits, though all but the first went the short way: each took its
    place in the queue. The call after it is answered once the first kernel has ended."""
    long = [int(1.98e9)]  # 1 s of spin
    for _ in range(1025):
        await actx.launch("spin", 1, 32, long)
    start = trio.current_time()
    await actx.mem_get_info()
    assert trio.current_time() - start > 0.5 / 100  # most of a second of the device's, at --time-scale 100
    with trio.fail_after(10):
        while "1024 launches queued; its next call waits for its work to run" not in served.server_log():
            await trio.sleep(0.01)
