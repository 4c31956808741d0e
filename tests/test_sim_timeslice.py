"""Exact timelines of the timeslice policy: slices, context switches, preemption and resumption with the
work left, and the measured two-tenant time-slicing row."""

import dataclasses

import pytest

from mpsd.sim import H200, BlockCost, Kernel, Simulator, kernel_cost

MS = 1e-3
OVERHEAD = H200.kernel_overhead
SPEC = dataclasses.replace(H200, sm_count=4)
SPIN = BlockCost(1 * MS)
# Costs that ignore what a context holds (test_switch_costs_grow_with_the_state_saved covers those).
OPTS = {"timeslice": 0.5 * MS, "switch": 0.1 * MS, "state": ()}


def launch(sim, client, n=1, blocks=16, cost=SPIN, stream=0):
    ks = [Kernel(client=client, stream=stream, blocks=blocks, threads=1024, cost=cost) for _ in range(n)]
    for k in ks:
        sim.submit(k)
    return ks


def ms(t):
    """A time in ms, counted from the moment the first kernel is ready (its launch overhead paid)."""
    return round(t + OVERHEAD / MS, 6)


def pieces(sim, client):
    return [(g.sm, g.count, round(g.start / MS, 6), round(g.end / MS, 6))
            for g in sorted(sim.trace, key=lambda g: (g.start, g.sm)) if g.op.client == client]


def test_one_client_never_switches():
    """Alone, a client keeps the GPU slice after slice: the same timeline as mps."""
    sim = Simulator(SPEC, "timeslice", policy_options=OPTS)
    (k,) = launch(sim, 1)
    sim.run()
    assert k.ended == pytest.approx(OVERHEAD + 2 * MS)
    assert sim.policy.switches == 0


def test_two_clients_alternate_slices_with_preemption():
    """Slices of 0.5 ms with 0.1 ms switches; preempted blocks resume with the 0.5 ms they had left."""
    sim = Simulator(SPEC, "timeslice", record=True, policy_options=OPTS)
    (a,), (b,) = launch(sim, 1), launch(sim, 2)
    sim.run()
    assert pieces(sim, 1)[:4] == [(i, 2, ms(0), ms(0.5)) for i in range(4)]
    assert pieces(sim, 2)[:4] == [(i, 2, ms(0.6), ms(1.1)) for i in range(4)]
    assert pieces(sim, 1)[4:8] == [(i, 2, ms(1.2), ms(1.7)) for i in range(4)]  # the first wave's second half
    assert pieces(sim, 1)[8:12] == [(i, 2, ms(2.4), ms(2.9)) for i in range(4)]  # wave 2, after 2 ends a slice
    assert a.ended == pytest.approx(OVERHEAD + 4.1 * MS)
    assert b.ended == pytest.approx(OVERHEAD + 4.7 * MS)
    # Every block got exactly its 1 ms, in pieces: preempted blocks were resumed, not restarted.
    assert sim.statistics().per_client[1].block_seconds == pytest.approx(16 * MS)
    assert sim.statistics().blocks_completed == 32


def test_switch_costs_grow_with_the_state_saved():
    """A switch costs 0.1 ms plus half the extra of the context it saves and half that of the one it restores
    (0.04 ms at every warp slot, linear below), and a restored context's slice is shorter by its loss (0.02 ms
    at every warp slot). Client 1 fills the 4 SMs (h = 1), client 2 half of them (h = 0.5)."""
    opts = {"timeslice": 0.5 * MS, "switch": 0.1 * MS, "state": ((1.0, 0.04 * MS, 0.02 * MS),)}
    sim = Simulator(SPEC, "timeslice", record=True, policy_options=opts)
    (a,), (b,) = launch(sim, 1, blocks=8), launch(sim, 2, blocks=4)
    sim.run()
    # 1 runs 0..0.5; saving h=1 into a context with nothing saved: 0.1 + 0.04 / 2. 2 runs 0.62..1.12 (its slice
    # is whole), then 1 is restored after 0.1 + (0.02 + 0.04) / 2 with a slice of 0.48: 1.25..1.73, 0.02 ms
    # short of its 1 ms. Then 2 (slice 0.49) at 1.86..2.35, 1 at 2.48..2.50, done; 1 hands over having saved
    # nothing: 0.1 + 0.02 / 2, and 2 finishes its last 0.01 ms at 2.61..2.62.
    assert [p[2:] for p in pieces(sim, 1)[::4]] == [(ms(0), ms(0.5)), (ms(1.25), ms(1.73)), (ms(2.48), ms(2.5))]
    assert [p[2:] for p in pieces(sim, 2)[::4]] == [(ms(0.62), ms(1.12)), (ms(1.86), ms(2.35)),
                                                    (ms(2.61), ms(2.62))]
    assert a.ended == pytest.approx(OVERHEAD + 2.5 * MS)
    assert b.ended == pytest.approx(OVERHEAD + 2.62 * MS)
    assert sim.policy.switches == 5


def test_state_costs_must_be_points_ascending_in_h():
    for bad in (((0.5, 1e-5, 1e-5), (0.25, 1e-5, 1e-5)), ((1.5, 1e-5, 0.0),), ((1.0, -1e-5, 0.0),),
                ((1.0, 0.0, 1.0),), (1.0,), "x"):
        with pytest.raises(ValueError, match="state"):
            Simulator(SPEC, "timeslice", policy_options={"state": bad})


def test_clocked_blocks_keep_their_deadline_while_preempted():
    """Blocks waiting on the clock (spin) are preempted as others are, but their clock runs on: back after
    the other context's slice, a block whose millisecond has passed ends at once, and one whose has not
    ends on time. Two 2-wave kernels finish at 2.4 and 2.8 ms instead of 4.1 and 4.7 (test above)."""
    sim = Simulator(SPEC, "timeslice", record=True, policy_options=OPTS)
    clocked = BlockCost(1 * MS, clocked=True)
    (a,), (b,) = launch(sim, 1, cost=clocked), launch(sim, 2, cost=clocked)
    sim.run()
    least = H200.min_block_time / MS
    assert pieces(sim, 1)[:4] == [(i, 2, ms(0), ms(0.5)) for i in range(4)]
    assert pieces(sim, 2)[:4] == [(i, 2, ms(0.6), ms(1.1)) for i in range(4)]
    # Back at 1.2 ms, past their 1.0-ms deadline: the first wave ends at once, the second starts.
    assert pieces(sim, 1)[4:8] == [(i, 2, ms(1.2), ms(1.2 + least)) for i in range(4)]
    assert pieces(sim, 1)[8:12] == [(i, 2, ms(1.2 + least), ms(1.7)) for i in range(4)]
    # Client 2's second wave, placed at 1.8 ms, is resumed at 2.5 ms and ends at its own 2.8.
    assert pieces(sim, 2)[-4:] == [(i, 2, ms(2.5 + least), ms(2.8 + least)) for i in range(4)]
    assert a.ended == pytest.approx(OVERHEAD + (2.4 + least) * MS)
    assert b.ended == pytest.approx(OVERHEAD + (2.8 + least) * MS)
    assert sim.statistics().blocks_completed == 32


def test_owner_out_of_work_hands_over_at_once():
    """A client whose work ends mid-slice gives the GPU up then, paying one switch."""
    sim = Simulator(SPEC, "timeslice", policy_options=OPTS)
    (a,) = launch(sim, 1, blocks=8, cost=BlockCost(0.2 * MS))
    (b,) = launch(sim, 2, blocks=8, cost=BlockCost(0.2 * MS))
    sim.run()
    assert a.ended == pytest.approx(OVERHEAD + 0.2 * MS)
    assert b.started == pytest.approx(OVERHEAD + 0.3 * MS)
    assert b.ended == pytest.approx(OVERHEAD + 0.5 * MS)


def test_back_to_the_resident_context_costs_nothing():
    """If the client that last held the GPU comes back to an idle GPU, no switch is paid."""
    sim = Simulator(SPEC, "timeslice", policy_options=OPTS)
    (_a,) = launch(sim, 1, blocks=8)
    sim.advance(2 * MS)
    (b,) = launch(sim, 1, blocks=8)
    sim.run()
    assert b.started == pytest.approx(2 * MS + OVERHEAD)
    assert sim.policy.switches == 0


def test_shared_blocks_resume_with_remaining_service():
    """A throughput-bound block preempted halfway needs only its remaining half afterwards."""
    work = BlockCost(0.8 * MS, shared=True)  # 1024 threads: two co-resident blocks share an SM's issue
    sim = Simulator(SPEC, "timeslice", record=True, policy_options=OPTS)
    (a,) = launch(sim, 1, blocks=8, cost=work)  # 8 blocks on 4 SMs: each at half rate, 1.6 ms alone
    (b,) = launch(sim, 2, blocks=8, cost=BlockCost(0.3 * MS))
    sim.run()
    # From the launch overhead on: a 0..0.5 ms (0.25 ms of service each), b 0.6..0.9, a resumes at 1.0 with
    # 0.55 ms left each at half rate: 1.1 ms -> ends at 2.1.
    assert b.started == pytest.approx(OVERHEAD + 0.6 * MS)
    assert a.ended == pytest.approx(OVERHEAD + 2.1 * MS)


def test_cancel_during_switch():
    """Cancelling the incoming client mid-switch leaves the GPU to whoever has work."""
    sim = Simulator(SPEC, "timeslice", policy_options=OPTS)
    (a,) = launch(sim, 1)
    (b,) = launch(sim, 2)
    sim.advance(0.55 * MS)  # client 2 is being switched in
    sim.cancel(2)
    sim.run()
    assert a.done and not b.done
    assert sim.busy_sms() == 0


def test_two_tenants_full_work_as_measured():
    """Measured without MPS on an H200: 2 tenants x 100 FULL work kernels took 0.220 and 0.222 s."""
    work = kernel_cost(H200, "work", 264, 1024, [93638])
    sim = Simulator(policy="timeslice")
    per = [launch(sim, c, 100, blocks=264, cost=work) for c in (1, 2)]
    sim.run()
    assert per[0][-1].ended == pytest.approx(0.220, rel=0.02)
    assert per[1][-1].ended == pytest.approx(0.222, rel=0.02)
