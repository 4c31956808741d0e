"""Properties over random small scenarios: caps and SM resources hold at every instant, every op
completes, stream and dependency order are kept, the same scenario gives the same trace, and a copy engine
serves its streams in turn without losing time."""

import dataclasses
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.sim import H200, BlockCost, Copy, Kernel, Marker, Simulator, block_need, kernel_cost, occupancy

SPEC = dataclasses.replace(H200, sm_count=8)  # small, so clients collide
CAPS = {1: None, 2: 2, 3: 4, 4: 6}

op_spec = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["kernel", "kernel", "kernel", "copy", "marker"]),
        "client": st.integers(1, 4),
        "stream": st.integers(0, 1),
        "at": st.sampled_from([0.0, 0.0, 1e-4, 5e-4, 2e-3]),
        "blocks": st.integers(1, 24),
        "threads": st.sampled_from([32, 64, 256, 512, 1024]),
        "regs": st.sampled_from([16, 32, 64, 128]),
        "smem": st.sampled_from([0, 1024, 48 * 1024, 100 * 1024]),
        "seconds": st.sampled_from([1e-5, 1e-4, 3e-4, 1e-3]),
        "cost": st.sampled_from(["fixed", "shared", "dram"]),  # dram: blocks share DRAM bandwidth
        "priority": st.integers(-1, 0),
        "engine": st.sampled_from(["h2d", "d2h"]),
        "nbytes": st.integers(0, 10**7),
        "deps": st.lists(st.integers(0, 100), max_size=2),
    }
)
scenarios = st.lists(op_spec, min_size=1, max_size=14)


def build(scenario):
    """Turn drawn specs into ops (deps point at earlier ops only), in submission-time order."""
    ops = []
    for i, s in enumerate(sorted(scenario, key=lambda s: s["at"])):
        after = tuple({ops[d % i][1]: None for d in s["deps"]}) if i else ()
        common = dict(client=s["client"], stream=s["stream"], after=after, tag=i)
        if s["kind"] == "kernel":
            if not occupancy(SPEC, s["threads"], s["regs"], s["smem"]):
                s = {**s, "regs": 32}  # keep every drawn shape launchable
            op = Kernel(
                **common,
                blocks=s["blocks"],
                threads=s["threads"],
                regs_per_thread=s["regs"],
                smem=s["smem"],
                cost=BlockCost(s["seconds"], shared=s["cost"] == "shared", dram=s["cost"] == "dram"),
                priority=s["priority"],
                sm_cap=CAPS[s["client"]],
            )
        elif s["kind"] == "copy":
            op = Copy(**common, engine=s["engine"], nbytes=s["nbytes"])
        else:
            op = Marker(**common)
        ops.append((s["at"], op))
    return ops


def simulate(scenario):
    sim = Simulator(SPEC, record=True)
    timed = build(scenario)
    done = []
    for at, op in timed:
        done += sim.advance(max(at, sim.now))
        sim.submit(op)
    done += sim.run()
    return sim, [op for _, op in timed], done


@settings(max_examples=150, deadline=None)
@given(scenarios)
def test_caps_resources_and_completion(scenario):
    """At every instant no SM is over-committed and no client exceeds its cap; every op completes."""
    sim, ops, done = simulate(scenario)
    assert sorted(op.tag for op in done) == sorted(op.tag for op in ops)
    assert all(op.done for op in ops)
    assert sim.busy_sms() == 0

    instants = sorted({g.start for g in sim.trace})
    per_warps = SPEC.max_threads_per_sm // SPEC.warp_size
    for t in instants:
        live = [g for g in sim.trace if g.start <= t < g.end]
        sms_of = defaultdict(set)
        use = defaultdict(lambda: [0, 0, 0, 0])
        for g in live:
            k = g.op
            need = block_need(SPEC, k.threads, k.regs_per_thread, k.smem)
            u = use[g.sm]
            u[0] += g.count
            u[1] += need.warps * g.count
            u[2] += need.regs * g.count
            u[3] += need.smem * g.count
            sms_of[k.client].add(g.sm)
        for u in use.values():
            assert u[0] <= SPEC.max_blocks_per_sm
            assert u[1] <= per_warps
            assert u[2] <= SPEC.regs_per_sm
            assert u[3] <= SPEC.smem_per_sm
        for client, sms in sms_of.items():
            cap = CAPS[client]
            assert len(sms) <= (SPEC.sm_count if cap is None else cap)


@settings(max_examples=100, deadline=None)
@given(scenarios)
def test_order_is_kept(scenario):
    """Ops start after their stream predecessor and their dependencies end; kernels pay the overhead."""
    _, ops, done = simulate(scenario)
    last = {}
    for op in ops:  # submission order
        key = (op.client, op.stream)
        floor = max([op.submitted] + [d.ended for d in op.after] + ([last[key].ended] if key in last else []))
        if isinstance(op, Kernel):
            floor += SPEC.kernel_overhead
        assert op.started >= floor - 1e-12
        assert op.ended >= op.started
        last[key] = op
    ends = [op.ended for op in done]
    assert ends == sorted(ends)


@settings(max_examples=30, deadline=None)
@given(scenarios)
def test_deterministic(scenario):
    """The same scenario run twice gives an identical trace and completion order."""

    def fingerprint():
        sim, _, done = simulate(scenario)
        return (
            [(g.op.tag, g.sm, g.count, g.start, g.end) for g in sim.trace],
            [(op.tag, op.started, op.ended) for op in done],
        )

    assert fingerprint() == fingerprint()


@settings(max_examples=100, deadline=None)
@given(scenarios, st.integers(1, 4), st.sampled_from([0.0, 5e-5, 3e-4, 1e-3]))
def test_cancel_never_strands_other_clients(scenario, victim, when):
    """After cancel(victim) every other client's op still completes, the victim's unfinished ops never
    do, and all SMs drain."""
    sim = Simulator(SPEC, record=True)
    timed = build(scenario) + [(max(when, 1.0), None)]
    submitted, done, dropped, unfinished = [], [], None, []
    for at, op in timed:
        if dropped is None and at > when:
            done += sim.advance(when)
            unfinished = [o for o in submitted if o.client == victim and not o.done]
            dropped = sim.cancel(victim)
        if op is not None:
            done += sim.advance(max(at, sim.now))
            sim.submit(op)
            submitted.append(op)
    done += sim.run()
    assert {id(o) for o in dropped} <= {id(o) for o in unfinished}
    assert not any(o.done for o in unfinished)
    assert all(o.done for o in submitted if o not in unfinished)
    assert sim.busy_sms() == 0
    assert len(done) == len({id(o) for o in done})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.sampled_from([128, 256, 1024]), st.integers(1, 10**8),
                          st.integers(1, 4), st.sampled_from([0.0, 1e-4, 1e-3])), min_size=1, max_size=6))
def test_memory_bound_kernels_never_beat_the_dram_curve(specs):
    """However memory-bound grids from several clients overlap, the bytes they move over the time they take
    never exceed the H200's DRAM bandwidth (the top of its curve), and every one completes."""
    sim = Simulator(H200)
    timed = sorted(((at, Kernel(client=c, stream=i, blocks=g, threads=t,
                                cost=kernel_cost(H200, "fill_f32", g, t, [0, 0.0, n])), 4 * n)
                    for i, (g, t, n, c, at) in enumerate(specs)), key=lambda x: x[0])
    for at, k, _ in timed:
        sim.advance(max(at, sim.now))
        sim.submit(k)
    sim.run()
    kernels = [k for _, k, _ in timed]
    assert all(k.done for k in kernels)
    span = max(k.ended for k in kernels) - min(k.started for k in kernels)
    moved = sum(nbytes for _, _, nbytes in timed)
    assert moved <= H200.dram_curve[-1][1] * span * (1 + 1e-9)


copy_streams = st.lists(
    st.tuples(st.integers(1, 3), st.integers(0, 1), st.integers(0, 6 * 10**8), st.sampled_from([0.0, 3e-4, 2e-3])),
    min_size=1, max_size=12)


@settings(max_examples=100, deadline=None)
@given(copy_streams)
def test_copy_engine_shares_its_slices(copies):
    """Host-to-device copies of up to four streams on one engine: every copy completes; none waits longer
    than one slice per other stream before it first runs (round robin, no starvation); and copies all
    eligible at time 0 keep the engine busy to the end (no time lost to switching)."""
    sim = Simulator(H200)
    timed = sorted(((at, Copy(client=c, stream=s, tag=i, engine="h2d", nbytes=n))
                    for i, (c, s, n, at) in enumerate(copies)), key=lambda x: (x[0], x[1].tag))
    for at, op in timed:
        sim.advance(max(at, sim.now))
        sim.submit(op)
    sim.run()
    ops = [op for _, op in timed]
    assert all(op.done for op in ops)
    streams = len({(op.client, op.stream) for op in ops})
    for op in ops:
        assert op.started - op.eligible <= (streams - 1) * H200.copy_timeslice + 1e-9
    if all(at == 0.0 for at, _ in timed):
        busy = sum(H200.copy_latency + op.nbytes / H200.pcie_bandwidth for op in ops)
        assert max(op.ended for op in ops) == pytest.approx(busy, rel=1e-9)
