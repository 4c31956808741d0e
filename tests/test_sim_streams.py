"""Stream order, `after` dependencies, markers, copy engines, cancel() and the clock."""

import dataclasses

import pytest

from mpsd.sim import H200, BlockCost, Copy, Kernel, Marker, Simulator, copy_kernel
from mpsd.sim.specs import dram_bandwidth, dram_threads

MS = 1e-3
OVERHEAD = H200.kernel_overhead
SPIN = BlockCost(1 * MS)


def kernel(client=1, stream=0, blocks=66, cost=SPIN, **kw):
    """A QUARTER-sized 1024-thread kernel."""
    return Kernel(client=client, stream=stream, blocks=blocks, threads=1024, cost=cost, **kw)


def submit(sim, *ops):
    for op in ops:
        sim.submit(op)
    return ops


def test_stream_runs_in_order():
    """The second kernel of a stream starts one launch overhead after the first ends."""
    sim = Simulator()
    a, b = submit(sim, kernel(), kernel())
    assert sim.run() == [a, b]
    assert b.started == pytest.approx(a.ended + OVERHEAD)
    assert b.ended == pytest.approx(2 * (1 * MS + OVERHEAD))


def test_streams_run_concurrently():
    """Kernels on different streams of one client overlap."""
    sim = Simulator()
    a, b = submit(sim, kernel(stream=0), kernel(stream=1))
    sim.run()
    assert a.started == b.started == pytest.approx(OVERHEAD)
    assert a.ended == b.ended == pytest.approx(OVERHEAD + MS)


def test_same_stream_id_of_two_clients_is_two_streams():
    """Stream identity is (client, stream): clients' default streams do not serialise each other."""
    sim = Simulator()
    a, b = submit(sim, kernel(client=1), kernel(client=2))
    sim.run()
    assert a.ended == b.ended == pytest.approx(OVERHEAD + MS)


def test_after_waits_for_other_stream():
    """An op with after=(x,) on another stream starts only once x has completed."""
    sim = Simulator()
    a = kernel(stream=0)
    b = kernel(stream=1, after=(a,))
    c = kernel(stream=2)
    submit(sim, a, b, c)
    assert sim.run() == [a, c, b]
    assert b.started == pytest.approx(a.ended + OVERHEAD)


def test_after_on_already_done_op():
    """A dependency that completed before submission is satisfied at once."""
    sim = Simulator()
    (a,) = submit(sim, kernel())
    sim.run()
    (b,) = submit(sim, kernel(stream=1, after=(a,)))
    sim.run()
    assert b.started == pytest.approx(a.ended + OVERHEAD)


def test_after_across_clients():
    """after= may name another client's op (IPC events)."""
    sim = Simulator()
    a = kernel(client=1)
    b = kernel(client=2, after=(a,))
    submit(sim, a, b)
    sim.run()
    assert b.started == pytest.approx(a.ended + OVERHEAD)


def test_marker_completes_with_its_stream():
    """A marker behind a kernel completes when the kernel does, taking no time."""
    sim = Simulator()
    k, m, k2 = submit(sim, kernel(), Marker(client=1, stream=0), kernel())
    assert sim.run() == [k, m, k2]
    assert m.started == m.ended == k.ended
    assert k2.started == pytest.approx(k.ended + OVERHEAD)


def test_marker_on_idle_stream_completes_at_submit():
    """A marker on an idle stream completes at submission and is returned by the next advance."""
    sim = Simulator()
    sim.advance(1.0)
    (m,) = submit(sim, Marker(client=1, stream=0))
    assert m.done and m.ended == 1.0
    assert sim.next_time() == 1.0
    assert sim.advance(1.0) == [m]
    assert sim.next_time() is None


def test_marker_with_after_waits_on_other_stream():
    """A marker with after= on an idle stream completes when its dependency does."""
    sim = Simulator()
    k = kernel(stream=0)
    m = Marker(client=1, stream=1, after=(k,))
    submit(sim, k, m)
    assert sim.run() == [k, m]
    assert m.ended == k.ended


def test_copy_durations():
    """A copy alone runs at PCIe bandwidth after the fixed latency; h2d and d2h have engines of their own, but
    while both run they share the link unevenly (DeviceSpec.copy_duplex, as an H200 did): the one that ends
    first gives the other its full speed back for the rest."""
    sim = Simulator()
    (alone,) = submit(sim, Copy(client=1, stream=0, engine="h2d", nbytes=55_000_000))
    sim.run()
    each = H200.copy_latency + 1 * MS
    assert alone.ended == pytest.approx(each)
    sim = Simulator()
    h2d = Copy(client=1, stream=0, engine="h2d", nbytes=55_000_000)
    d2h = Copy(client=1, stream=1, engine="d2h", nbytes=55_000_000)
    submit(sim, h2d, d2h)
    sim.run()
    share = dict(H200.copy_duplex)
    assert share["h2d"] < share["d2h"] < 1
    assert h2d.started == d2h.started == 0.0
    assert d2h.ended == pytest.approx(each / share["d2h"])
    assert h2d.ended == pytest.approx(d2h.ended + each - d2h.ended * share["h2d"])
    stats = sim.statistics()
    assert stats.copies_completed == 2
    assert stats.per_client[1].bytes_copied == 110_000_000


def test_a_cancelled_copy_gives_the_other_direction_its_speed_back():
    """A client torn down mid-copy frees the link at once: the other direction's copy runs at full speed from
    that instant."""
    sim = Simulator()
    h2d = Copy(client=1, stream=0, engine="h2d", nbytes=55_000_000)
    d2h = Copy(client=2, stream=0, engine="d2h", nbytes=55_000_000)
    submit(sim, h2d, d2h)
    sim.advance(0.5 * MS)
    sim.cancel(2)
    assert sim.run() == [h2d]
    done = 0.5 * MS * dict(H200.copy_duplex)["h2d"]
    assert h2d.ended == pytest.approx(0.5 * MS + H200.copy_latency + 1 * MS - done)


def test_copy_engine_serves_streams_in_turn():
    """Copies shorter than a slice run one at a time in the order they became eligible, across clients."""
    sim = Simulator()
    a = Copy(client=1, stream=0, engine="h2d", nbytes=55_000_000)
    b = Copy(client=2, stream=0, engine="h2d", nbytes=55_000)
    c = Copy(client=1, stream=1, engine="h2d", nbytes=0)
    submit(sim, a, b, c)
    assert sim.run() == [a, b, c]
    assert b.started == a.ended
    assert c.started == b.ended
    assert c.ended == pytest.approx(3 * H200.copy_latency + 1 * MS + 1e-6)


Q = H200.copy_timeslice
LONG = 10 * 55_000_000  # 10 ms at PCIe bandwidth
SMALL = 55_000  # 1 us


def test_copy_engine_time_slices_a_long_copy():
    """A small copy beside a long one waits for the long one's slice to end, not for the copy: then it runs,
    and the long one resumes with the time it had left."""
    sim = Simulator()
    (big,) = submit(sim, Copy(client=1, stream=0, engine="h2d", nbytes=LONG))
    sim.advance(0.3 * MS)
    (small,) = submit(sim, Copy(client=2, stream=0, engine="h2d", nbytes=SMALL))
    assert sim.run() == [small, big]
    assert small.started == pytest.approx(Q)
    small_time = H200.copy_latency + 1e-6
    assert small.ended == pytest.approx(Q + small_time)
    assert big.ended == pytest.approx(H200.copy_latency + 10 * MS + small_time)


def test_copy_slices_run_on_a_grid_while_the_engine_is_alone():
    """The slices of a stream alone on the engine end on a grid from when it got it: a copy arriving after
    2.5 slices waits for the third slice to end."""
    sim = Simulator()
    submit(sim, Copy(client=1, stream=0, engine="h2d", nbytes=LONG))
    sim.advance(2.5 * Q)
    (small,) = submit(sim, Copy(client=2, stream=0, engine="h2d", nbytes=SMALL))
    sim.run()
    assert small.started == pytest.approx(3 * Q)


def test_back_to_back_copies_keep_the_slice():
    """A stream whose next copy is queued behind the one that ends keeps the engine until its slice ends;
    two such streams alternate a slice each."""
    sim = Simulator()
    n = 4 * 55_000  # 4 us: many to a slice
    a = [Copy(client=1, stream=0, engine="h2d", nbytes=n) for _ in range(400)]
    b = [Copy(client=2, stream=0, engine="h2d", nbytes=n) for _ in range(400)]
    submit(sim, *a, *b)
    sim.run()
    each = H200.copy_latency + 4e-6
    per_slice = sum(1 for c in a if c.ended <= Q + 1e-12)
    assert per_slice == int(Q / each)  # the copy under way when the slice ends is set aside, then resumes
    assert b[0].started == pytest.approx(Q)
    assert a[per_slice].ended > 2 * Q  # client 1 waits out client 2's slice
    assert max(c.ended for c in a + b) == pytest.approx(800 * each)  # no time lost to the switches


def test_without_a_time_slice_each_copy_runs_to_its_end():
    """A spec with no copy time slice runs the long copy to its end before the small one."""
    sim = Simulator(dataclasses.replace(H200, copy_timeslice=0.0))
    (big,) = submit(sim, Copy(client=1, stream=0, engine="h2d", nbytes=LONG))
    sim.advance(0.3 * MS)
    (small,) = submit(sim, Copy(client=2, stream=0, engine="h2d", nbytes=SMALL))
    assert sim.run() == [big, small]
    assert small.started == big.ended


def test_device_copies_are_kernels():
    """A device-to-device copy or a memset is a kernel of one wave on the SMs its client sees: a full-device
    copy takes its traffic at the DRAM curve (its threads weighted) over the kind's efficiency, and an SM cap
    slows it as it does any memory-bound kernel."""
    n = 256 << 20
    for kind, traffic in (("d2d", 2 * n), ("memset", n)):
        bytes_per, weight = {k: (b, w) for k, b, w in H200.copy_kernels}[kind]
        times = []
        for cap, grid in ((None, 264), (33, 66)):
            blocks, threads, cost = copy_kernel(H200, kind, n, cap)
            assert (blocks, threads) == (grid, 1024) and cost.dram and cost.weight == weight
            sim = Simulator()
            (k,) = submit(sim, Kernel(client=1, stream=0, blocks=blocks, threads=threads, cost=cost, sm_cap=cap))
            sim.run()
            times.append(k.ended - k.started)
        axis = H200.sm_count * dram_threads(H200, 2 * 1024 * weight)  # two blocks on every SM, weighted
        assert times[0] == pytest.approx(traffic / bytes_per / dram_bandwidth(H200, axis))
        assert times[1] > 1.5 * times[0]  # a quarter of the SMs: on the H200, 1.9 times as long
    assert copy_kernel(H200, "memset", 4096)[0] == 1  # small: one block
    with pytest.raises(ValueError):
        copy_kernel(H200, "p2p", 1)


def test_copy_and_kernel_share_stream_order():
    """A kernel behind a copy in its stream becomes eligible when the copy ends."""
    sim = Simulator()
    c, k = submit(sim, Copy(client=1, stream=0, engine="h2d", nbytes=0), kernel())
    sim.run()
    assert k.started == pytest.approx(H200.copy_latency + OVERHEAD)


def test_cancel_drops_queued_work_and_evicts_running_blocks():
    """cancel() tears the client's work down: queued ops dropped, running blocks evicted at once, none
    reported; another client's waiting kernel gets the SMs at that instant."""
    sim = Simulator()
    a = [kernel(client=1, blocks=264) for _ in range(3)]
    submit(sim, *a)
    b = kernel(client=2, blocks=264)
    sim.advance(0.5 * MS)
    submit(sim, b)
    sim.advance(0.6 * MS)
    dropped = sim.cancel(1)
    assert dropped == a[1:]
    assert sim.busy_sms(1) == 0
    done = sim.run()
    assert done == [b]
    assert b.started == pytest.approx(0.6 * MS)
    assert not any(k.done for k in a)
    assert sim.busy_sms() == 0
    stats = sim.statistics()
    assert stats.per_client[1].kernels == 0
    assert stats.per_client[1].blocks == 0  # evicted blocks never completed
    assert stats.per_client[1].block_seconds == pytest.approx(264 * (0.6 * MS - OVERHEAD))  # but held SMs


def test_cancel_resolves_dependencies_of_other_clients():
    """Other clients' ops after a cancelled op, dropped or running, go ahead at once."""
    sim = Simulator()
    running, queued = kernel(client=1), kernel(client=1)
    submit(sim, running, queued)
    on_running = Marker(client=2, stream=0, after=(running,))
    on_queued = Marker(client=2, stream=1, after=(queued,))
    submit(sim, on_running, on_queued)
    sim.advance(0.5 * MS)
    assert sim.cancel(1) == [queued]
    assert sim.advance(0.5 * MS) == [on_running, on_queued]
    assert on_running.ended == pytest.approx(0.5 * MS)


def test_cancel_copies():
    """A cancelled client's queued copy is dropped and one in flight stops, freeing the engine at once."""
    sim = Simulator()
    flying = Copy(client=1, stream=0, engine="h2d", nbytes=55_000_000)
    queued = Copy(client=1, stream=1, engine="h2d", nbytes=55_000_000)
    other = Copy(client=2, stream=0, engine="h2d", nbytes=0)
    submit(sim, flying, queued, other)
    sim.advance(0.1 * MS)
    assert sim.cancel(1) == [queued]
    assert sim.run() == [other]
    assert other.started == pytest.approx(0.1 * MS)
    assert 1 not in sim.statistics().per_client  # nothing of it completed


def test_advance_never_goes_backwards():
    """advance() to an earlier time is an error; to a later time moves the clock there."""
    sim = Simulator()
    (k,) = submit(sim, kernel())
    assert sim.advance(0.5 * MS) == []
    assert sim.now == 0.5 * MS
    with pytest.raises(ValueError):
        sim.advance(0.4 * MS)
    assert sim.next_time() == pytest.approx(OVERHEAD + MS)
    assert sim.advance(2 * MS) == [k]
    assert sim.now == 2 * MS
    assert sim.next_time() is None


def test_submit_stamps_time_and_rejects_resubmission():
    """submit() stamps the current time; an op cannot be submitted twice; copies need a known engine."""
    sim = Simulator()
    sim.advance(3.0)
    (k,) = submit(sim, kernel())
    assert k.submitted == 3.0
    with pytest.raises(ValueError):
        sim.submit(k)
    with pytest.raises(ValueError):
        sim.submit(Copy(client=1, stream=0, engine="p2p", nbytes=1))


def test_a_shared_hardware_queue_keeps_its_order_of_dispatch_not_of_completion():
    """With one connection, a kernel on stream 1 submitted after stream 0's second waits until that second one's
    turn (stream 0's first ends), then runs beside it; a marker (an event's record) waits in the queue too, and
    a copy, on its engine's own queue, does not. Without connections the kernel starts at once."""
    for connections, start in ((None, OVERHEAD), (1, MS + 2 * OVERHEAD)):
        sim = Simulator()
        sim.configure_client(1, connections=connections)
        a1, a2, b = submit(sim, kernel(stream=0), kernel(stream=0), kernel(stream=1))
        mark, other = Marker(client=1, stream=2), Copy(client=1, stream=3, engine="h2d", nbytes=1 << 20)
        submit(sim, mark, other)
        sim.run()
        assert b.started == pytest.approx(start) and a2.started == pytest.approx(MS + 2 * OVERHEAD)
        assert mark.ended == pytest.approx(0.0 if connections is None else a2.eligible)
        assert other.started == pytest.approx(0.0, abs=1e-5)


def test_streams_go_round_robin_onto_a_clients_queues_and_another_client_has_its_own():
    """Two connections: streams 0 and 2 share one (the third stream falsely waits for the first's second
    kernel), stream 1 has the other; another client's stream is on queues of its own."""
    sim = Simulator()
    sim.configure_client(1, connections=2)
    sim.configure_client(2, connections=1)
    a1, a2 = submit(sim, kernel(stream=0), kernel(stream=0))
    b, c, d = submit(sim, kernel(stream=1), kernel(stream=2), kernel(client=2, stream=0))
    sim.run()
    assert b.started == d.started == pytest.approx(OVERHEAD)
    assert c.started == pytest.approx(a2.started)


def test_cancelling_a_client_with_work_waiting_in_its_queue_frees_the_others():
    """A client's kernels parked behind its queue's head go with cancel(); another client's work, and its own
    later work, run as if they had never been."""
    sim = Simulator()
    sim.configure_client(1, connections=1)
    submit(sim, kernel(stream=0), kernel(stream=0), kernel(stream=1))
    sim.advance(0.5 * MS)
    dropped = sim.cancel(1)
    assert len(dropped) == 2  # the second of stream 0 and the one parked behind it; the first had started
    other, again = submit(sim, kernel(client=2), kernel(stream=1))
    sim.run()
    assert other.started == pytest.approx(0.5 * MS + OVERHEAD)
    assert again.started == pytest.approx(0.5 * MS + OVERHEAD)


def test_connections_must_be_a_positive_int():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="connections"):
            Simulator().configure_client(1, connections=bad)
