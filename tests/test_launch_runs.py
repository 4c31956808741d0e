# A client's loop launches one kernel again and again, and its notifications repeat byte for byte. The
# connection remembers such a frame once the session has served it the short way (Connection.remember), hands
# back the frames that repeat it undecoded, as a count (Connection.repeats), and the session serves them as one
# call of `count` launches (Session._repeat, Context.launch), which the backend takes as `count` launches with
# one record (Backend.submit; the simulator's `launch(count=...)`). Each layer must give what the one-at-a-time
# way gives: the same messages in the same order, the same kernels at the same simulated times, the same errors,
# the same place in the launch queue, the same waits by the legacy default stream's rules, and a run must end
# wherever the context stops being what it was.
from __future__ import annotations

import os
import random
import struct
from types import SimpleNamespace

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.backends.ops import Launch, Plan
from mpsd.backends.sim import SimBackend
from mpsd.sim import H200, Simulator, kernel_cost
from mpsd_client import IllegalAddressError, InvalidResourceHandleError
from mpsd_protocol import NEED_DATA, Connection, Notification, RemoteProtocolError, Request, Role

GOOD = {"name": "spin", "grid": [1, 1, 1], "block": [32, 1, 1], "args": [0], "shared_mem": 0, "stream": None}
COMPILED = ["mps", "round-robin", "priority", "fair", "exclusive", "mig", "timeslice"]


# -- the connection ------------------------------------------------------------------------------------------
def _pair() -> tuple[Connection, Connection]:
    """A client connection and a server one that has taken its hello."""
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    server.receive_data(client.send(Request(1, "hello", {})))
    assert isinstance(server.next_event(), Request)
    return client, server


def _launch(client: Connection, **change) -> bytes:
    return client.send(Notification("launch", {**GOOD, **change}))


def _remembered(server: Connection, client: Connection, token: object, **change) -> None:
    server.receive_data(_launch(client, **change))
    assert server.next_event() == Notification("launch", {**GOOD, **change})
    assert server.remember(token)


def test_frames_that_repeat_a_remembered_one_come_back_as_its_token_and_a_count():
    client, server = _pair()
    a, b = object(), object()
    _remembered(server, client, a)
    _remembered(server, client, b, args=[7])
    server.receive_data(_launch(client) * 5 + _launch(client, args=[7]) * 2 + _launch(client, args=[8]))
    assert server.repeats(3) == (a, 3)  # no more than asked for
    assert server.repeats(100) == (a, 2)  # a run is of one token: the next frame is b's
    assert server.repeats(100) == (b, 2)
    assert server.repeats(100) is None  # args [8] was never remembered: it is left where it is
    assert server.next_event() == Notification("launch", {**GOOD, "args": [8]})
    assert server.repeats(100) is None and server.next_event() is NEED_DATA


def test_an_incomplete_frame_ends_a_run_and_counts_once_complete():
    client, server = _pair()
    token = object()
    _remembered(server, client, token)
    data = _launch(client) * 3
    server.receive_data(data[:-5])  # the third frame lacks its last bytes
    assert server.repeats(10) == (token, 2)
    assert server.repeats(10) is None
    server.receive_data(data[-5:])
    assert server.repeats(10) == (token, 1)


def test_a_frame_with_fds_never_repeats():
    """The same body with fds declared in its header is another message (its fds must be claimed): left for
    next_event, as is everything while received fds wait for their frames; nor is a frame taken with fds
    remembered."""
    client, server = _pair()
    token = object()
    _remembered(server, client, token)
    body = _launch(client)[8:]
    server.receive_data(struct.pack("<II", len(body), 1) + body, [_fd()])
    assert server.repeats(10) is None
    message = server.next_event()
    assert isinstance(message, Notification) and len(message.fds) == 1
    assert not server.remember(object())  # it had an fd
    _close(message.fds)
    server.receive_data(_launch(client))
    assert server.repeats(10) == (token, 1)


def test_fds_that_came_with_a_repeat_break_the_protocol_as_they_always_did():
    """Fds attached to frames that declare none are the peer's error, found when those frames are taken: a repeat
    that came with fds is not taken as one, and next_event fails the connection."""
    client, server = _pair()
    _remembered(server, client, object())
    server.receive_data(_launch(client), [_fd()])
    assert server.repeats(10) is None
    with pytest.raises(RemoteProtocolError, match="file descriptors arrived with bytes of frames that declared none"):
        server.next_event()


def test_what_may_be_remembered():
    """Only the frame next_event returned last, once; not one over 256 bytes; a few dozen frames at most (the
    65th distinct one starts the memory afresh)."""
    assert not Connection(Role.SERVER).remember(object())  # nothing taken yet
    client, server = _pair()
    _remembered(server, client, "x")
    assert not server.remember("again")  # once per frame
    server.receive_data(_launch(client, name="spin" + "n" * 300))
    server.next_event()
    assert not server.remember("long")
    for i in range(1, 65):
        _remembered(server, client, i, args=[i])
    server.receive_data(_launch(client) + _launch(client, args=[64]))
    assert server.repeats(10) is None  # "x" was forgotten when the 65th came
    server.next_event()
    assert server.repeats(10) == (64, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40)), min_size=1, max_size=30),
       st.lists(st.integers(1, 200), min_size=1, max_size=20))
def test_reading_with_repeats_gives_the_messages_in_their_order(sequence, cuts):
    """However the bytes are cut into reads, and whichever frames are remembered along the way, reading with
    `repeats` before each `next_event` gives the very messages next_event alone gives, in order."""
    client, server = _pair()
    wanted = [Notification("launch", {**GOOD, "args": [kind]}) for kind, n in sequence for _ in range(n)]
    data = b"".join(client.send(m) for m in wanted)
    tokens: dict[object, Notification] = {}
    got: list[Notification] = []
    at, cut = 0, 0
    while len(got) < len(wanted):
        run = server.repeats(cuts[len(got) % len(cuts)])
        if run is not None:
            got += [tokens[run[0]]] * run[1]
            continue
        message = server.next_event()
        if not isinstance(message, Notification):  # NEED_DATA: the next read
            step = cuts[cut % len(cuts)]
            cut += 1
            server.receive_data(data[at:at + step])
            at += step
            continue
        got.append(message)
        if message.args["args"][0] % 2 == 0:  # the even kinds are remembered the first time they are seen
            token = object()
            if server.remember(token):
                tokens[token] = message
    assert got == wanted


def _fd() -> int:
    r, w = os.pipe()
    os.close(w)
    return r


def _close(fds) -> None:
    for fd in fds:
        os.close(fd)


# -- the simulator -------------------------------------------------------------------------------------------
def _play(policy: str, seed: int, runs: bool) -> list:
    """A seeded mix of runs of launches on a few clients' streams, advances and a cancellation, each run
    launched as `count` kernels at once (`runs`) or one by one; what it shows of each run's last kernel, of
    every advance and cancel (as runs' numbers), of the busy SMs and of the statistics, floats by their bits."""
    rng = random.Random(seed)
    sim = Simulator(H200, policy, False, None)
    for client in range(1, 4):
        sim.configure_client(client, priority=rng.choice([0, 0, 1]))
    now, record, last = 0.0, [], {}
    shown = lambda ops: [last[id(op)] for op in ops if id(op) in last]  # noqa: E731
    for step in range(60):
        choice = rng.random()
        if choice < 0.6:
            client, stream = rng.randint(1, 3), rng.randint(0, 2)
            blocks, threads = rng.choice([1, 3, 40, 132, 300]), rng.choice([32, 256, 1024])
            cost = kernel_cost(H200, "spin", blocks, threads, [rng.choice([0, 2_000, 200_000])])
            count = rng.randint(1, 20)
            if runs:
                handle = sim.launch(client, (client, stream), (), blocks, threads, cost, count=count)
            else:
                for _ in range(count):
                    handle = sim.launch(client, (client, stream), (), blocks, threads, cost)
            last[id(handle)] = step
            record.append(("run", step, handle))
        elif choice < 0.95:
            now += rng.choice([1e-6, 1e-5, 1e-4, 1e-3])
            record.append(("advance", shown(sim.advance(now, rng.choice([None, 4])))))
        else:
            record.append(("cancel", shown(sim.cancel(rng.randint(1, 3)))))
        record.append(("busy", sim.busy_sms(), sim.next_time()))
    record.append(("rest", shown(sim.run())))
    out = []
    for item in record:
        if item[0] == "run":
            h = item[2]
            out.append(("run", item[1], h.seq, *(struct.pack("<d", t).hex() for t in
                                                   (h.submitted, h.eligible, h.started, h.ended)), h.done, h.cancelled))
        else:
            out.append(item)
    return out + [repr(sim.statistics())]


@pytest.mark.parametrize("policy", COMPILED)
def test_a_run_of_launches_runs_as_its_launches_one_by_one(policy):
    """`launch(count=n)` runs, to the bit, as n launches of the same kernel made one after another: each run's
    last kernel at the same times, every advance and cancel returning the same runs' last kernels (the others
    have no record to return), the same busy SMs and the same statistics."""
    for seed in range(60):
        assert _play(policy, seed, True) == _play(policy, seed, False), f"seed {seed}"


def test_a_run_is_of_one_kernel_or_more():
    sim = Simulator(H200)
    cost = kernel_cost(H200, "spin", 1, 32, [0])
    with pytest.raises(ValueError, match="count must be at least 1"):
        sim.launch(1, (1, 0), (), 1, 32, cost, count=0)
    handle = sim.launch(1, (1, 0), (), 1, 32, cost, count=1000)
    assert sim.run() == [handle] and handle.done
    assert sim.statistics().kernels_completed == 1000


@pytest.mark.parametrize("traced", [False, True])
def test_the_simulated_backend_submits_a_run_as_its_launches(tmp_path, traced):
    """A run is `count` kernels on the device either way: launched at once with one record, or, where a trace
    needs every kernel's own object, one Kernel each (the last of them the run's record)."""
    backend = SimBackend(H200, trace=tmp_path / "trace.json" if traced else None)
    backend.attach(SimpleNamespace(id=1, pid=1, uid=0), sm_cap=132, priority=0, weight=1.0, instance=None)
    work = Launch.of(1, (1, 0), 0, None, Plan("spin", (1, 1, 1), (32, 1, 1), 0, (0,)), ())
    backend.submit(work, 5)
    done = backend.sim.run()
    assert len(done) == (5 if traced else 1) and done[-1] is work.handle and work.handle.done
    assert backend.sim.statistics().kernels_completed == 5


# -- the daemon ----------------------------------------------------------------------------------------------
def _only(served):
    (ctx,) = served.daemon.devices[0].contexts.values()
    (session,) = served.daemon.sessions
    return ctx, session


async def _send(client, *notes: dict):
    """Send launch notifications with these argument maps as they are (the client's own checks skipped; the
    daemon's loop reads what has arrived whenever the client lets it run, many frames at a time), then ask for
    the last error: the answer comes once all of them have been served."""
    def op():
        for args in notes:
            yield Notification("launch", args)
    await client._drive(op())
    return await client.get_last_error()


async def test_repeated_launches_are_served_as_runs(served, actx, autojump_clock):
    """A loop's launches after its second go as runs: the launch queue holds fewer works than launches, each
    counting the launches it stands for, and every kernel runs."""
    ctx, session = _only(served)
    long = {**GOOD, "args": [int(1.98e6)]}  # 1 ms each: all still queued when the last arrives
    assert await _send(actx, *[long] * 200) is None
    queued = [entry for queue in session._queues.values() for entry in queue]
    assert sum(calls for _, _, calls in queued) == 200 == session._queued == ctx.counters.launches
    assert len(queued) < 50 and max(calls for _, _, calls in queued) > 1
    start = trio.current_time()
    await actx.synchronize()
    assert trio.current_time() - start == pytest.approx(0.2 / 100, rel=0.02)  # 200 ms of the device's
    assert (await actx.statistics())["kernels_completed"] == 200


async def test_a_run_keeps_the_legacy_default_streams_order(served, actx, autojump_clock):
    """Launches on the default stream that ran as runs while it was the only stream wait, once a blocking
    stream exists, for that stream's work, as `launch` queues them (1-ms kernels of one block, which would
    otherwise run side by side)."""
    ctx, session = _only(served)
    ms = {**GOOD, "args": [int(1.98e6)]}
    await _send(actx, *[ms] * 5)
    await actx.synchronize()
    assert session._repeating
    stream = await actx.create_stream()
    await _send(actx, {**ms, "stream": stream.handle})
    blocking = ctx.last_op
    await _send(actx, ms, ms, ms)
    after = ctx.last_op
    await actx.synchronize()
    assert after.ended - blocking.ended == pytest.approx(3e-3, rel=0.01)


async def test_runs_beside_a_blocking_stream_wait_as_the_legacy_rules_say(served, actx, autojump_clock):
    """With a blocking stream beside it, a run on the default stream waits for that stream's last work, and a
    run on the blocking stream for the default stream's, as each of their launches would (1-ms kernels again,
    which would otherwise run side by side): all of them one after another."""
    ctx, session = _only(served)
    ms = {**GOOD, "args": [int(1.98e6)]}
    stream = await actx.create_stream()
    other = {**ms, "stream": stream.handle}
    await _send(actx, ms, ms, other, other)  # the second of each is remembered
    await actx.synchronize()
    assert session._repeating
    start = trio.current_time()
    await _send(actx, *[ms] * 6, *[other] * 6, *[ms] * 6, *[other, other, ms, ms] * 3)
    queued = [entry for queue in session._queues.values() for entry in queue]
    assert max(calls for _, _, calls in queued) > 1  # (runs, not launches one by one)
    await actx.synchronize()
    assert trio.current_time() - start == pytest.approx(30e-3 / 100, rel=0.02)
    assert ctx.counters.launches == 34


async def test_a_run_ends_with_its_stream(served, actx, autojump_clock):
    """Launches on a non-blocking stream run as runs; once the stream is destroyed the same launch gets the
    error the general path gives, and queues nothing."""
    ctx, _ = _only(served)
    stream = await actx.create_stream(non_blocking=True)
    on = {**GOOD, "stream": stream.handle}
    await _send(actx, *[on] * 10)
    await actx.synchronize()
    await stream.destroy()
    launches = ctx.counters.launches
    error = await _send(actx, on, on, on)
    assert isinstance(error, InvalidResourceHandleError) and ctx.counters.launches == launches == 10


async def test_after_a_sticky_error_a_repeated_launch_queues_nothing(served, actx, autojump_clock):
    ctx, session = _only(served)
    await _send(actx, *[GOOD] * 10)
    await actx.synchronize()
    assert session._repeating
    p = await actx.malloc(64)
    await actx.launch("fill_f32", 1, 32, [p, 0.0, 17])  # one float past the allocation
    with pytest.raises(IllegalAddressError):
        await actx.synchronize()
    launches = ctx.counters.launches
    assert isinstance(await _send(actx, *[GOOD] * 10), IllegalAddressError)
    assert ctx.counters.launches == launches


async def test_calls_between_runs_keep_their_place(served, actx, autojump_clock):
    """An event recorded between two runs of 1-ms launches on the default stream is recorded between them: the
    time from it to the end of the second run is that run's."""
    ms = {**GOOD, "args": [int(1.98e6)]}
    await _send(actx, *[ms] * 4)
    event = await actx.create_event()
    await _send(actx, *[ms] * 6)
    await event.record()
    await _send(actx, *[ms] * 9)
    end = await actx.create_event()
    await end.record()
    await end.synchronize()
    assert await event.elapsed_ms(end) == pytest.approx(9.0, rel=0.01)


# -- a real daemon process -----------------------------------------------------------------------------------
def test_runs_in_a_real_daemon_keep_their_place_among_calls_with_fds(ctx):
    """Over a real socket, where one read holds many launch frames and a frame with fds ends one: loops of one
    launch, each between a pinned buffer's registration (its memfd travels with the call) and a memset whose
    bytes come back through that buffer, all run, and every copy reads what the memset before it wrote."""
    p = ctx.malloc(4096)
    for value in range(1, 21):
        for _ in range(300):
            ctx.launch("spin", 1, 32, [0])
        host = ctx.host_alloc(4096)  # the fd's frame, between two runs
        for _ in range(300):
            ctx.launch("spin", 1, 32, [0])
        ctx.memset(p, value, 4096)
        ctx.memcpy_dtoh(host, p)
        ctx.synchronize()
        assert bytes(memoryview(host)[:8]) == bytes([value]) * 8
        ctx.free_host(host)
    assert ctx.statistics()["kernels_completed"] == 20 * 600 + 20  # and the memsets, which run as kernels
