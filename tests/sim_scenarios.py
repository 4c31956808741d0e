"""Seeded random scenarios for the simulator, and a player that runs one and writes down everything it shows.

The differential test (test_sim_differential.py) plays each scenario on the compiled engine and on the Python
one and asks for the very same record: every op's times and flags, every block group of the trace, every
list advance, run and cancel returned, next_time, busy_sms and stranded_blocks along the way, and the
statistics, floats compared by their bits. A scenario mixes kernels of every cost kind (fixed, clocked spin,
shared work, memory-bound dram with weights, memsets and device copies as kernels), copies on each engine,
markers, dependencies across streams and clients (some on ops submitted later), stream priorities, SM caps,
client priorities, weights and MIG partitions, cancellations and forget_client mid-run, and advance with and
without max_instants.
"""

from __future__ import annotations

import dataclasses
import random
import struct

from mpsd.sim import H200, BlockCost, Copy, Kernel, Marker, copy_kernel, kernel_cost

# Small devices make clients collide; the full H200 exercises the real figures; one without a DRAM curve and
# without copy time slices takes the other branches of those models.
SPECS = {
    "h200": H200,
    "small": dataclasses.replace(H200, sm_count=8),
    "tiny": dataclasses.replace(H200, sm_count=3, max_blocks_per_sm=4),
    "flat": dataclasses.replace(H200, sm_count=12, dram_curve=(), copy_timeslice=0.0, copy_duplex=()),
}
MIG_OPTIONS = {"h200": ["3g.71gb", "2g.35gb", "1g.18gb"], "small": [4, 2, 2], "tiny": [1, 2], "flat": [6, 4, 2]}


def options(rng: random.Random, policy: str, spec_name: str) -> dict | None:
    """Policy options for a scenario: the defaults, or other settings the policy accepts."""
    if policy == "mig":
        return {"partitions": MIG_OPTIONS[spec_name]} if rng.random() < 0.7 else None if spec_name == "h200" else {
            "partitions": MIG_OPTIONS[spec_name][:1]}
    if policy == "priority" and rng.random() < 0.5:
        return {"aging": rng.choice([0.0, 1e-5, 2e-4, 1e-3])}
    if policy == "timeslice" and rng.random() < 0.6:
        return {"timeslice": rng.choice([1e-4, 5e-4, 2e-3]), "switch": rng.choice([0.0, 1e-5, 1e-4]),
                "state": rng.choice([(), ((0.5, 1e-5, 1e-6), (1.0, 3e-5, 5e-6))])}
    return None


def _bits(x: float) -> str:
    return struct.pack("<d", x).hex()


def _kernel(rng: random.Random, spec, client: int, stream: int) -> Kernel:
    kind = rng.random()
    blocks = rng.choice([1, 1, 2, 3, 5, 8, 13, 24, 40, 66, 132, 300])
    threads = rng.choice([32, 64, 128, 256, 512, 1024])
    regs = rng.choice([16, 32, 32, 64, 128])
    smem = rng.choice([0, 0, 1024, 48 * 1024, 100 * 1024])
    if regs * threads > spec.regs_per_sm:
        regs = 32
    if kind < 0.25:
        cost = kernel_cost(spec, "spin", blocks, threads, [rng.choice([2_000, 40_000, 400_000])])
    elif kind < 0.45:
        cost = kernel_cost(spec, "work", blocks, threads, [rng.choice([200, 2_000, 20_000])])
    elif kind < 0.6:
        name = rng.choice(["fill_f32", "vector_add_f32", "reduce_sum_f32"])
        n = blocks * threads * rng.choice([1, 16, 64])
        cost = kernel_cost(spec, name, blocks, threads, [0, 0, 0, n] if name == "vector_add_f32" else [0, 0, n])
    elif kind < 0.7:
        blocks, threads, cost = copy_kernel(spec, rng.choice(["d2d", "memset"]),
                                            rng.choice([0, 4096, 1 << 20, 1 << 26]), rng.choice([None, 2, 8]))
        regs, smem = 32, 0
    elif kind < 0.8:
        cost = BlockCost(rng.choice([0.0, 1e-5, 1e-4]), dram=True, weight=rng.choice([0.5, 1.0, 1.364]))
    else:
        cost = BlockCost(rng.choice([0.0, 3e-6, 1e-5, 1e-4, 1e-3]), shared=rng.random() < 0.3)
    return Kernel(client=client, stream=stream, blocks=blocks, threads=threads, cost=cost, regs_per_thread=regs,
                  smem=smem, priority=rng.choice([0, 0, 0, -1, 1]),
                  sm_cap=rng.choice([None, None, None, 1, 2, 4, 66]))


def build(seed: int) -> tuple[str, list]:
    """The scenario of ``seed``: its spec's name and its steps, fresh op objects each call.

    Steps: ("at", t) advance to t; ("step", t, n) advance to t at most n instants; ("submit", op);
    ("cancel", client); ("forget", client); ("configure", client, priority, weight, partition); ("run",).
    """
    rng = random.Random(seed)
    spec_name = rng.choice(list(SPECS))
    spec = SPECS[spec_name]
    clients = rng.randint(1, 4)
    streams = rng.randint(1, 3)
    steps: list = []
    for c in range(clients):
        if rng.random() < 0.6:
            steps.append(("configure", c, rng.choice([0, 0, 1, -1, 2]), rng.choice([1.0, 0.5, 2.0, 3.0]),
                          rng.choice([None, 0, 1, 2])))
    ops: list = []
    pending: list = []  # ops named in an `after` before they are submitted
    t = 0.0
    for _ in range(rng.randint(3, 30)):
        r = rng.random()
        client, stream = rng.randrange(clients), rng.randrange(streams)
        if pending and rng.random() < 0.3:
            op = pending.pop(0)
        elif r < 0.65:
            op = _kernel(rng, spec, client, stream)
        elif r < 0.85:
            op = Copy(client=client, stream=stream, engine=rng.choice(["h2d", "d2h"]),
                      nbytes=rng.choice([0, 4096, 1 << 20, 64 << 20, 256 << 20]))
        else:
            op = Marker(client=client, stream=stream)
        deps = []
        if ops and rng.random() < 0.3:
            deps = rng.sample(ops, min(len(ops), rng.randint(1, 2)))
        if rng.random() < 0.05:
            later = Marker(client=rng.randrange(clients), stream=rng.randrange(streams))
            pending.append(later)
            deps.append(later)
        op.after = tuple(deps)
        ops.append(op)
        steps.append(("submit", op))
        u = rng.random()
        if u < 0.35:
            t += rng.choice([0.0, 1e-6, 1e-5, 1e-4, 5e-4, 2e-3])
            if rng.random() < 0.3:
                steps.append(("step", t, rng.randint(0, 3)))
            else:
                steps.append(("at", t))
        elif u < 0.4:
            steps.append(("cancel", rng.randrange(clients)))
        elif u < 0.43:
            steps.append(("forget", rng.randrange(clients)))
        elif u < 0.45:
            c = rng.randrange(clients)
            steps.append(("configure", c, rng.choice([0, 1, -1]), rng.choice([1.0, 2.0]), rng.choice([None, 0, 1])))
    for op in pending:
        steps.append(("submit", op))
    steps.append(("run",))
    return spec_name, steps


def _submit(sim, op):
    sim.submit(op)
    return op


def play(make, seed: int, policy: str, submit=_submit) -> list:
    """Run scenario ``seed`` on ``make(spec, policy, record=True, policy_options=...)``; everything it showed.
    ``submit(sim, op)`` submits each op and gives what stands for it in what the simulator returns (the op
    itself, or a record made for it, such as ``Simulator.launch``'s handle)."""
    spec_name, steps = build(seed)
    spec = SPECS[spec_name]
    sim = make(spec, policy, True, options(random.Random(seed + 1 << 20), policy, spec_name))
    index: dict[int, int] = {}
    ops: list = []
    out: list = [spec_name]

    def name(op) -> int:
        return index[id(op)]

    for step in steps:
        kind = step[0]
        if kind == "submit":
            op = submit(sim, step[1])
            index[id(op)] = len(ops)
            ops.append(op)
            got = None
        elif kind == "at":
            got = sim.advance(step[1])
        elif kind == "step":
            got = sim.advance(max(step[1], sim.now), step[2])
        elif kind == "cancel":
            got = sim.cancel(step[1])
        elif kind == "forget":
            sim.forget_client(step[1])
            got = None
        elif kind == "configure":
            try:
                sim.configure_client(step[1], priority=step[2], weight=step[3], partition=step[4])
                got = None
            except ValueError as exc:
                got = f"ValueError: {exc}"
        else:
            got = sim.run()
        nt = sim.next_time()
        out.append((kind, [name(o) for o in got] if isinstance(got, list) else got,
                    None if nt is None else _bits(nt), _bits(sim.now), sim.busy_sms(),
                    [sim.busy_sms(c) for c in range(4)], sim.stranded_blocks()))
    out.append([(name(o), o.seq, _bits(o.submitted), _bits(o.eligible), _bits(o.started), _bits(o.ended), o.done,
                 o.cancelled) for o in ops])
    out.append([(name(g.op), g.sm, g.count, _bits(g.start), _bits(g.end)) for g in sim.trace])
    s = sim.statistics()
    out.append((_bits(s.now), s.kernels_completed, s.blocks_completed, s.copies_completed, _bits(s.sm_seconds),
                [(c, v.kernels, v.blocks, _bits(v.block_seconds), _bits(v.sm_seconds), v.copies, v.bytes_copied,
                  v.max_sms) for c, v in s.per_client.items()]))
    return out


def first_difference(a: list, b: list) -> str:
    """Where two records part, for a failure message."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"entry {i}: {x!r}\n  vs {y!r}"
    return f"lengths {len(a)} and {len(b)}" if len(a) != len(b) else "none"

