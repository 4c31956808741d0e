"""Properties of every policy over random small scenarios: SM resources and caps hold at every instant and
every op completes; the work-conserving policies never leave a fitting block waiting; aging bounds a
low-priority kernel's wait; MIG partitions never touch each other; timeslice runs one client at a time and
resumes preempted blocks with their remaining work; everything is deterministic."""

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sim_properties import CAPS, SPEC, build, scenarios

from mpsd.sim import BlockCost, Copy, Kernel, Simulator, block_need

SETUPS = {
    "mps": None,
    "round-robin": None,
    "priority": None,
    "priority-aging": {"aging": 5e-4},
    "fair": None,
    "exclusive": None,
    "mig": {"partitions": [4, 4]},
    "timeslice": {"timeslice": 2e-4, "switch": 3e-5},
}
WORK_CONSERVING = ["mps", "round-robin", "priority", "fair", "mig"]


def make(setup, record=True):
    sim = Simulator(SPEC, setup.split("-aging")[0], record=record, policy_options=SETUPS[setup])
    for c in CAPS:  # levels, weights and partitions differ between clients
        sim.configure_client(c, priority=c % 3, weight=c, partition=c % 2)
    return sim


def drive(sim, timed, check=None):
    """Submit at the drawn times, stepping instant by instant; call check(sim) after every step."""
    done = []
    for at, op in timed:
        while (t := sim.next_time()) is not None and t <= at:
            done += sim.advance(t)
            check and check(sim)
        done += sim.advance(max(at, sim.now))
        sim.submit(op)
    while (t := sim.next_time()) is not None:
        done += sim.advance(t)
        check and check(sim)
    return done


def check_trace(sim):
    per_warps = SPEC.max_threads_per_sm // SPEC.warp_size
    for t in sorted({g.start for g in sim.trace}):
        live = [g for g in sim.trace if g.start <= t < g.end]
        use = defaultdict(lambda: [0, 0, 0, 0])
        sms_of = defaultdict(set)
        for g in live:
            k = g.op
            need = block_need(SPEC, k.threads, k.regs_per_thread, k.smem)
            u = use[g.sm]
            for j, v in enumerate((1, need.warps, need.regs, need.smem)):
                u[j] += v * g.count
            sms_of[k.client].add(g.sm)
        for u in use.values():
            assert u[0] <= SPEC.max_blocks_per_sm and u[1] <= per_warps
            assert u[2] <= SPEC.regs_per_sm and u[3] <= SPEC.smem_per_sm
        for client, sms in sms_of.items():
            assert len(sms) <= (CAPS[client] or SPEC.sm_count)
        yield live


@pytest.mark.parametrize("setup", sorted(SETUPS))
@settings(max_examples=60, deadline=None)
@given(scenario=scenarios)
def test_resources_caps_and_completion(setup, scenario):
    """Under every policy: no SM over-committed, no cap exceeded, every op completes exactly once."""
    sim = make(setup)
    timed = build(scenario)
    done = drive(sim, timed)
    assert sorted(op.tag for op in done) == sorted(op.tag for _, op in timed)
    assert sim.busy_sms() == 0
    for live in check_trace(sim):
        if setup == "timeslice" or setup == "exclusive":
            assert len({g.op.client for g in live}) <= 1  # one context on the GPU at a time
        if setup == "mig":
            for g in live:
                assert g.sm // 4 == g.op.client % 2  # never outside its partition


@pytest.mark.parametrize("setup", WORK_CONSERVING)
@settings(max_examples=60, deadline=None)
@given(scenario=scenarios)
def test_work_conservation(setup, scenario):
    """No SM capacity is left idle while a ready block that fits there (cap and partition allowing) waits."""
    sim = make(setup, record=False)

    def check(s):
        assert s.stranded_blocks() == 0

    drive(sim, build(scenario), check)


hog = st.lists(
    st.tuples(st.integers(1, 16), st.sampled_from([1e-4, 3e-4, 1e-3]), st.integers(0, 2),
              st.sampled_from([0.0, 1e-4, 5e-4, 1e-3, 2e-3])),
    min_size=1, max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(hog, st.integers(1, 16), st.sampled_from([0.0, 2e-4, 1e-3]))
def test_aging_bounds_the_wait(load, blocks, aging):
    """A below-normal kernel eligible at 0 starts within aging + launch overhead + the longest block, however
    much normal-priority work keeps arriving (fixed-cost blocks of at most 1 ms)."""
    sim = Simulator(SPEC, "priority", policy_options={"aging": aging})
    sim.configure_client(9, priority=1)
    low = Kernel(client=9, stream=0, blocks=blocks, threads=1024, cost=BlockCost(1e-4))
    timed = [(0.0, low)] + sorted(
        ((at, Kernel(client=1 + s, stream=s, blocks=b, threads=1024, cost=BlockCost(sec)))
         for b, sec, s, at in load), key=lambda x: x[0])
    drive(sim, timed)
    assert low.started <= max(aging, SPEC.kernel_overhead) + 1e-3 + 1e-12


kernels_only = st.lists(
    st.tuples(st.integers(1, 4), st.integers(1, 24), st.sampled_from([256, 1024]),
              st.sampled_from([1e-4, 1e-3]), st.sampled_from(["fixed", "shared", "dram"]),
              st.sampled_from([0.0, 1e-4, 1e-3]),
              st.sampled_from(["kernel", "kernel", "copy"])),
    min_size=1, max_size=16,
)


@settings(max_examples=100, deadline=None)
@given(kernels_only)
def test_mig_partition_unaffected_by_the_other(specs):
    """Partition 0's timeline (blocks and copies) is the same with or without partition 1's load, memory-bound
    blocks included: each partition has its own DRAM bandwidth."""

    def run(keep):
        sim = Simulator(SPEC, "mig", record=True, policy_options={"partitions": [4, 4]})
        for c in range(1, 5):
            sim.configure_client(c, partition=c % 2)
        timed = []
        for i, (c, blocks, threads, sec, cost, at, kind) in enumerate(specs):
            if not keep(c):
                continue
            if kind == "copy":
                op = Copy(client=c, stream=0, tag=i, engine="h2d", nbytes=blocks * 10**6)
            else:
                op = Kernel(client=c, stream=0, tag=i, blocks=blocks, threads=threads,
                            cost=BlockCost(sec, shared=cost == "shared", dram=cost == "dram"))
            timed.append((at, op))
        timed.sort(key=lambda x: x[0])
        drive(sim, timed)
        mine = [(g.op.tag, g.sm, g.count, g.start, g.end) for g in sim.trace if g.op.client % 2 == 0]
        return mine, sorted((op.tag, op.started, op.ended) for _, op in timed if op.client % 2 == 0)

    assert run(lambda c: True) == run(lambda c: c % 2 == 0)


@settings(max_examples=100, deadline=None)
@given(scenarios)
def test_timeslice_resumes_not_restarts(scenario):
    """Preempted fixed-cost blocks run exactly their duration in total, summed over their pieces."""
    sim = make("timeslice")
    timed = build(scenario)
    drive(sim, timed)
    held = defaultdict(float)
    for g in sim.trace:
        held[g.op] += g.count * (g.end - g.start)
    for _, op in timed:
        if isinstance(op, Kernel) and not op.cost.shared and not op.cost.dram:  # those vary their rate
            assert held[op] == pytest.approx(op.blocks * max(op.cost.seconds, SPEC.min_block_time))


@pytest.mark.parametrize("setup", sorted(SETUPS))
@settings(max_examples=20, deadline=None)
@given(scenario=scenarios)
def test_deterministic(setup, scenario):
    """The same scenario under the same policy gives an identical trace twice."""

    def fingerprint():
        sim = make(setup)
        timed = build(scenario)
        done = drive(sim, timed)
        return ([(g.op.tag, g.sm, g.count, g.start, g.end) for g in sim.trace],
                [(op.tag, op.started, op.ended) for op in done])

    assert fingerprint() == fingerprint()
