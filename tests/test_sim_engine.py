"""Exact timelines of the mps policy: waves, SM caps, sharing between clients, priorities."""

import dataclasses

import pytest

from mpsd.sim import H200, BlockCost, Kernel, Simulator, kernel_cost, sm_cap

MS = 1e-3
OVERHEAD = H200.kernel_overhead
SPIN = kernel_cost(H200, "spin", 264, 1024, [round(1e-3 * 1.98e9)])  # 1 ms blocks
WORK = kernel_cost(H200, "work", 264, 1024, [93638])  # 0.5 ms of full-rate issue per block
FULL, QUARTER = 264, 66


def launch(sim, client, n, blocks=FULL, cost=SPIN, stream=0, **kw):
    """Submit n identical kernels on one stream; return them."""
    ks = [
        Kernel(client=client, stream=stream, blocks=blocks, threads=1024, cost=cost, **kw)
        for _ in range(n)
    ]
    for k in ks:
        sim.submit(k)
    return ks


def test_one_client_100_full_spin():
    """100 back-to-back FULL 1-ms spin kernels take 100 x (1 ms + launch overhead)."""
    sim = Simulator()
    ks = launch(sim, 1, 100)
    done = sim.run()
    assert done == ks
    for i, k in enumerate(ks):
        assert k.started == pytest.approx(i * (MS + OVERHEAD) + OVERHEAD)
        assert k.ended == pytest.approx((i + 1) * (MS + OVERHEAD))
    assert sim.now == pytest.approx(100 * (MS + OVERHEAD))
    stats = sim.statistics()
    assert stats.kernels_completed == 100
    assert stats.blocks_completed == 26400
    assert stats.per_client[1].max_sms == 132
    assert stats.per_client[1].block_seconds == pytest.approx(26.4)
    assert stats.per_client[1].sm_seconds == pytest.approx(13.2)


def test_quarter_cap_takes_five_waves():
    """At 25% (32 SMs, 64 resident blocks) a FULL kernel needs 5 waves: 100 x (5 ms + overhead)."""
    sim = Simulator()
    ks = launch(sim, 1, 100, sm_cap=sm_cap(H200, 25))
    sim.run()
    assert ks[0].ended == pytest.approx(OVERHEAD + 5 * MS)
    assert ks[-1].ended == pytest.approx(100 * (OVERHEAD + 5 * MS))
    assert sim.statistics().per_client[1].max_sms == 32


def test_half_cap_takes_two_waves():
    """At 50% (66 SMs) a FULL kernel needs exactly 2 waves: 100 x (2 ms + overhead)."""
    sim = Simulator()
    ks = launch(sim, 1, 100, sm_cap=sm_cap(H200, 50))
    sim.run()
    assert ks[0].ended == pytest.approx(OVERHEAD + 2 * MS)
    assert ks[-1].ended == pytest.approx(100 * (OVERHEAD + 2 * MS))


def test_two_clients_at_half_cap_run_side_by_side():
    """Two 50% clients each get 66 disjoint SMs and finish together, as measured (0.203, 0.202)."""
    sim = Simulator(record=True)
    a = launch(sim, 1, 100, sm_cap=66)
    b = launch(sim, 2, 100, sm_cap=66)
    sim.run()
    assert a[-1].ended == pytest.approx(100 * (OVERHEAD + 2 * MS))
    assert b[-1].ended == pytest.approx(100 * (OVERHEAD + 2 * MS))
    sms_of = {c: {g.sm for g in sim.trace if g.op.client == c} for c in (1, 2)}
    assert len(sms_of[1]) == len(sms_of[2]) == 66
    assert sms_of[1].isdisjoint(sms_of[2])


def test_two_clients_full_spin_alternate_waves():
    """Two clients of FULL kernels alternate whole waves: both finish at about twice one alone. Each
    client's next kernel pays its launch overhead while the other's wave runs, so only the first one shows."""
    sim = Simulator()
    a = launch(sim, 1, 100)
    b = launch(sim, 2, 100)
    sim.run()
    assert a[0].ended == pytest.approx(OVERHEAD + MS)
    assert b[0].ended == pytest.approx(OVERHEAD + 2 * MS)
    assert a[-1].ended == pytest.approx(OVERHEAD + 199 * MS)
    assert b[-1].ended == pytest.approx(OVERHEAD + 200 * MS)


@pytest.mark.parametrize("clients", [1, 2, 4])
def test_quarter_kernels_run_concurrently(clients):
    """1, 2 or 4 clients of QUARTER kernels fit side by side: each finishes as if alone."""
    sim = Simulator()
    per = [launch(sim, c, 200, blocks=QUARTER) for c in range(clients)]
    sim.run()
    for ks in per:
        assert ks[-1].ended == pytest.approx(200 * (MS + OVERHEAD))


def test_quarter_grid_spreads_one_block_per_sm():
    """Placement by most free resources spreads a 66-block grid over 66 SMs before stacking."""
    sim = Simulator()
    launch(sim, 1, 1, blocks=QUARTER)
    sim.advance(0.5 * MS)
    assert sim.busy_sms() == 66
    assert sim.busy_sms(1) == 66
    assert sim.busy_sms(2) == 0


def test_full_work_wave_takes_one_ms():
    """Two co-resident 1024-thread work blocks share an SM: a FULL work wave takes 1.0 ms."""
    sim = Simulator()
    (k,) = launch(sim, 1, 1, cost=WORK)
    sim.run()
    assert k.ended == pytest.approx(OVERHEAD + 1 * MS)


def test_lone_work_block_takes_half_ms():
    """A lone 1024-thread work block gets the SM's whole issue rate: 0.5 ms."""
    sim = Simulator()
    (k,) = launch(sim, 1, 1, blocks=132, cost=WORK)
    sim.run()
    assert k.ended == pytest.approx(OVERHEAD + 0.5 * MS)


def test_small_work_blocks_do_not_saturate():
    """A 256-thread block demands a quarter of the issue rate; alone it runs at that quarter."""
    sim = Simulator()
    cost = kernel_cost(H200, "work", 132, 256, [93638])
    k = Kernel(client=1, stream=0, blocks=132, threads=256, cost=cost)
    sim.submit(k)
    sim.run()
    assert cost.seconds == pytest.approx(0.125 * MS)
    assert k.ended == pytest.approx(OVERHEAD + 0.5 * MS)


def test_processor_sharing_rates_change_midway():
    """A work block that gains a neighbour halfway slows to half rate; the neighbour speeds up after."""
    sim = Simulator()
    (a,) = launch(sim, 1, 1, blocks=132, cost=WORK)
    sim.advance(0.25 * MS)
    (b,) = launch(sim, 2, 1, blocks=132, cost=WORK)
    sim.run()
    # a: 0.25 ms alone (until b is ready), then 0.25 ms of service at half rate, which takes 0.5 ms.
    assert a.ended == pytest.approx(OVERHEAD + 0.75 * MS)
    # b: half rate until a ends (0.25 of service), then full rate for the remaining 0.25.
    assert b.started == pytest.approx(0.25 * MS + OVERHEAD)
    assert b.ended == pytest.approx(OVERHEAD + 1 * MS)


def test_two_clients_full_work_take_twice_as_long():
    """Two clients of FULL work kernels each finish at about twice one alone."""
    alone = Simulator()
    solo = launch(alone, 1, 100, cost=WORK)
    alone.run()
    assert solo[-1].ended == pytest.approx(100 * (MS + OVERHEAD))
    sim = Simulator()
    a = launch(sim, 1, 100, cost=WORK)
    b = launch(sim, 2, 100, cost=WORK)
    sim.run()
    assert a[-1].ended == pytest.approx(OVERHEAD + 199 * MS)
    assert b[-1].ended == pytest.approx(OVERHEAD + 200 * MS)


def test_fixed_and_shared_blocks_coexist():
    """Fixed-cost (spin) blocks do not take issue rate from co-resident work blocks."""
    sim = Simulator()
    (w,) = launch(sim, 1, 1, blocks=132, cost=WORK)
    (s,) = launch(sim, 2, 1, blocks=132, cost=SPIN)
    sim.run()
    assert w.ended == pytest.approx(OVERHEAD + 0.5 * MS)
    assert s.ended == pytest.approx(OVERHEAD + 1 * MS)


def test_memory_bound_kernel_time_does_not_depend_on_grid():
    """fill_f32 over 4.8 GB runs at the bandwidth of every warp slot busy (3636.1 GB/s on the H200's curve),
    whether in one wave or two."""
    n = 1_200_000_000
    for blocks in (264, 528):
        sim = Simulator()
        cost = kernel_cost(H200, "fill_f32", blocks, 1024, [0, 0.0, n])
        (k,) = launch(sim, 1, 1, blocks=blocks, cost=cost)
        sim.run()
        assert k.ended - k.started == pytest.approx(4 * n / 3636.1e9)


def test_memory_bound_kernels_share_dram_bandwidth():
    """Two clients' memory-bound grids, each alone on half the SMs' threads, share the curve's bandwidth by
    threads: 132 blocks each reach 2690.8 GB/s alone, and 3636.1 GB/s together (1818.05 each). A compute
    neighbour takes none of it."""
    n = 1_000_000_000  # 4 GB a grid
    cost = kernel_cost(H200, "fill_f32", 132, 1024, [0, 0.0, n])
    sim = Simulator()
    (alone,) = launch(sim, 1, 1, blocks=132, cost=cost)
    (spin,) = launch(sim, 2, 1, blocks=132, cost=SPIN)
    sim.run()
    assert alone.ended - alone.started == pytest.approx(4 * n / 2690.8e9)
    assert spin.ended == pytest.approx(OVERHEAD + 1 * MS)
    sim = Simulator()
    (a,), (b,) = launch(sim, 1, 1, blocks=132, cost=cost), launch(sim, 2, 1, blocks=132, cost=cost)
    sim.run()
    assert a.ended - a.started == pytest.approx(4 * n / 1818.05e9)
    assert b.ended == pytest.approx(a.ended)


def test_memory_bound_share_follows_arrivals_and_departures():
    """A grid that joins halfway slows the first from its rate alone to the shared one, and the first's
    departure speeds the second up: every byte is accounted at the rate in force while it moved."""
    n = 1_000_000_000
    cost = kernel_cost(H200, "fill_f32", 132, 1024, [0, 0.0, n])
    sim = Simulator()
    (a,) = launch(sim, 1, 1, blocks=132, cost=cost)
    half = 2 * n / 2690.8e9  # a has moved half its bytes alone
    sim.advance(OVERHEAD + half)
    (b,) = launch(sim, 2, 1, blocks=132, cost=cost)
    sim.run()
    # b is ready one launch overhead later; a moves on alone meanwhile, then the two share 3636.1 GB/s.
    left = 2 * n - OVERHEAD * 2690.8e9
    assert a.ended == pytest.approx(OVERHEAD + half + OVERHEAD + left / 1818.05e9)
    moved = (a.ended - b.started) * 1818.05e9
    assert b.ended == pytest.approx(a.ended + (4 * n - moved) / 2690.8e9)


def test_a_mig_partition_has_its_memory_eighths_of_the_bandwidth():
    """A 1g.18gb instance holds one eighth of the memory slices: its 16 SMs' 32,768 threads would reach
    876 GB/s on the curve, but it gets at most 3636.1 / 8 GB/s, whatever the other partition does."""
    n = 100_000_000
    for neighbour in (False, True):
        sim = Simulator(H200, "mig", policy_options={"partitions": ["1g.18gb", "3g.71gb"]})
        sim.configure_client(2, partition=1)
        (k,) = launch(sim, 1, 1, blocks=32, cost=kernel_cost(H200, "fill_f32", 32, 1024, [0, 0.0, n]))
        if neighbour:
            launch(sim, 2, 1, blocks=120, cost=kernel_cost(H200, "fill_f32", 120, 1024, [0, 0.0, 10 * n]))
        sim.run()
        assert k.ended - k.started == pytest.approx(4 * n / (3636.1e9 / 8))


def test_a_spec_without_a_dram_curve_keeps_fixed_memory_bound_blocks():
    spec = dataclasses.replace(H200, dram_curve=())
    cost = kernel_cost(spec, "fill_f32", 264, 1024, [0, 0.0, 1_200_000_000])
    assert not cost.dram and cost.seconds == pytest.approx(4.8e9 / 264 * 264 / spec.mem_bandwidth)
    sim = Simulator(spec)  # and a dram cost given by hand runs at its speed alone
    (k,) = launch(sim, 1, 1, blocks=4, cost=BlockCost(1 * MS, dram=True))
    sim.run()
    assert k.ended - k.started == pytest.approx(1 * MS)


def test_stream_priority_wins_freed_capacity():
    """When a wave ends, a pending high-priority kernel is placed before the rest of a low-priority grid."""
    short = BlockCost(0.1 * MS)
    for priority, expected_end in ((-1, OVERHEAD + 1.1 * MS), (0, OVERHEAD + 2.1 * MS)):
        sim = Simulator()
        (big,) = launch(sim, 1, 1, blocks=2 * FULL)
        sim.advance(0.5 * MS)
        (urgent,) = launch(sim, 2, 1, blocks=QUARTER, cost=short, priority=priority)
        sim.run()
        assert urgent.started == pytest.approx(expected_end - 0.1 * MS)
        assert urgent.ended == pytest.approx(expected_end)
    # Without priority the big grid goes first and the urgent kernel starts after it.
    assert big.ended == pytest.approx(OVERHEAD + 2 * MS)


def test_big_grid_back_fills_around_urgent_kernel():
    """After an urgent kernel takes 66 slots, the low-priority grid's last 66 blocks start when it ends."""
    sim = Simulator()
    (big,) = launch(sim, 1, 1, blocks=2 * FULL)
    sim.advance(0.5 * MS)
    launch(sim, 2, 1, blocks=QUARTER, cost=BlockCost(0.1 * MS), priority=-1)
    sim.run()
    assert big.ended == pytest.approx(OVERHEAD + 2.1 * MS)


def test_no_preemption():
    """A high-priority kernel arriving on a full GPU waits for the running blocks to end."""
    sim = Simulator()
    launch(sim, 1, 3)
    sim.advance(0.3 * MS)
    (urgent,) = launch(sim, 2, 1, blocks=8, cost=BlockCost(0.1 * MS), priority=-5)
    sim.run()
    assert urgent.started == pytest.approx(OVERHEAD + 1 * MS)
    assert urgent.ended == pytest.approx(OVERHEAD + 1.1 * MS)


def test_cap_counts_distinct_sms_not_blocks():
    """A capped client stacks blocks on the SMs it holds: 8 blocks of 256 threads on 2 SMs at cap 2."""
    sim = Simulator(record=True)
    k = Kernel(client=1, stream=0, blocks=16, threads=256, cost=SPIN, sm_cap=2)
    sim.submit(k)
    sim.run()
    assert {g.sm for g in sim.trace} == {0, 1}
    assert k.ended == pytest.approx(OVERHEAD + 1 * MS)


def test_launch_shape_validation():
    """Kernels with no blocks or blocks that cannot fit are rejected at submit."""
    sim = Simulator()
    with pytest.raises(ValueError):
        sim.submit(Kernel(client=1, stream=0, blocks=0, threads=32, cost=SPIN))
    with pytest.raises(ValueError):
        sim.submit(Kernel(client=1, stream=0, blocks=1, threads=2048, cost=SPIN))
    with pytest.raises(ValueError):
        sim.submit(Kernel(client=1, stream=0, blocks=1, threads=32, cost=SPIN, smem=300_000))
    with pytest.raises(ValueError):
        Simulator(policy="nope")


def test_the_trace_read_part_way_grows_with_the_run_and_matches_its_columns():
    """Simulator.trace builds its groups from the engine's columns when read: read before, during and after a
    run it holds every group recorded so far, and trace_columns gives the same groups from any position."""
    sim = Simulator(record=True)
    assert sim.trace == [] and len(sim.trace_columns()[1]) == 0
    first = launch(sim, 1, 2)
    sim.advance(OVERHEAD + 1.5 * MS)
    so_far = list(sim.trace)
    assert so_far and all(g.op is first[0] for g in so_far)
    second = launch(sim, 2, 1, blocks=QUARTER)
    sim.run()
    assert sim.trace[:len(so_far)] == so_far and len(sim.trace) > len(so_far)
    assert {g.op for g in sim.trace} == {*first, *second}
    kernels, kernel, sm, count, start, end = sim.trace_columns(len(so_far))
    assert [(kernels[k], s, c, a, b) for k, s, c, a, b in zip(kernel.tolist(), sm.tolist(), count.tolist(),
                                                             start.tolist(), end.tolist())] \
        == [tuple(g) for g in sim.trace[len(so_far):]]
    assert sum(g.count for g in sim.trace) == 2 * FULL + QUARTER
