"""Waves of blocks that end together: group ends that share an instant are handled (and recorded) in placement
order, and a teardown in the middle of a shared end event leaves the other client's blocks untouched (that the
fit tables stay exact under the engine's shortcuts is the crate's own test: simcore/src/fit.rs)."""

import pytest
from mpsd.sim import H200, Kernel, Simulator, kernel_cost

MS = 1e-3
OVERHEAD = H200.kernel_overhead
SPIN = kernel_cost(H200, "spin", 132, 1024, [round(1e-3 * 1.98e9)])  # 1 ms blocks


def test_waves_of_two_clients_ending_together_are_recorded_in_placement_order():
    """Two one-wave kernels placed in one dispatch with equal block times end at one instant; the trace
    lists the first kernel's groups, SM by SM, then the second's, as their placements came."""
    sim = Simulator(record=True)
    a = Kernel(client=1, stream=0, blocks=132, threads=1024, cost=SPIN)
    b = Kernel(client=2, stream=0, blocks=132, threads=1024, cost=SPIN)
    sim.submit(a)
    sim.submit(b)
    assert sim.run() == [a, b]
    assert a.ended == b.ended == pytest.approx(OVERHEAD + MS)
    assert [(g.op, g.sm, g.count) for g in sim.trace] == (
        [(a, i, 1) for i in range(132)] + [(b, i, 1) for i in range(132)]
    )
    assert len({(g.start, g.end) for g in sim.trace}) == 1  # one instant to start, one to end
    assert sim.trace[0].end == pytest.approx(OVERHEAD + MS)
    stats = sim.statistics()
    assert stats.blocks_completed == 264
    assert stats.per_client[1].block_seconds == pytest.approx(0.132)


def test_teardown_inside_a_shared_end_event_spares_the_other_client():
    """A client torn down while its wave shares an end event with another client's: the other's blocks
    end on time and are counted; the torn-down client's never complete."""
    sim = Simulator(record=True)
    a = Kernel(client=1, stream=0, blocks=132, threads=1024, cost=SPIN)
    b = Kernel(client=2, stream=0, blocks=132, threads=1024, cost=SPIN)
    sim.submit(a)
    sim.submit(b)
    assert sim.advance(OVERHEAD + 0.5 * MS) == []
    sim.cancel(1)
    assert sim.run() == [b]
    assert b.ended == pytest.approx(OVERHEAD + MS)
    assert not a.done
    stats = sim.statistics()
    assert stats.blocks_completed == 132
    assert stats.per_client[2].kernels == 1
    ends = sorted({round(g.end / MS, 6) for g in sim.trace if g.op is a})
    assert ends == [round(OVERHEAD / MS + 0.5, 6)]  # evicted at the teardown, recorded once per SM
    assert sum(g.count for g in sim.trace if g.op is b) == 132


def test_fair_one_block_groups_end_together_in_turn_order():
    """Under fair, two equal clients take turns block by block; a wave of their one-block groups ends at one
    instant and every group is recorded, alternating clients as they were placed."""
    sim = Simulator(policy="fair", record=True)
    a = Kernel(client=1, stream=0, blocks=132, threads=1024, cost=SPIN)
    b = Kernel(client=2, stream=0, blocks=132, threads=1024, cost=SPIN)
    sim.submit(a)
    sim.submit(b)
    sim.run()
    assert len(sim.trace) == 264
    assert all(g.count == 1 for g in sim.trace)
    assert [g.op for g in sim.trace[:4]] == [a, b, a, b]
    assert a.ended == b.ended == pytest.approx(OVERHEAD + MS)
