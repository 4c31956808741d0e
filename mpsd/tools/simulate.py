# `mpsd simulate WORKLOAD.toml`: the daemon's GPU model alone, in virtual time, as fast as it can run. A
# scheduling question about many tenants is answered in seconds, identically on every run: the same engine,
# policies and virtual-clock driver (mpsd.clock) the daemon runs, fed from a workload file (the format of
# mpsd-stress, mpsd.stress.workload) instead of from client processes. Old scenario files are translated
# into one first (mpsd.tools.scenario), with a note saying so.
#
# Each tenant instance is one host thread whose calls follow one another, each reaching the device as it
# returns; a synchronise returns a while after the work ends, and both cost more the longer the thread was
# idle before (mpsd.clock.host, DeviceSpec's figures measured on a real H200). A request is its calls in order
# (input, [[tenant.kernel]], output) on one stream; an open-loop request's calls are made when it is due, even
# if the last one has not returned (its work then queues on the stream; mpsd-stress's tenant would wait for
# it); a closed loop's next request follows the last one's synchronise and think_ms. Each call's latency is
# timed from its request's due time to a synchronise on it alone. The model has no memory and no IPC: a
# tenant's memory, churn, pinned_mem_limit, ipc and deadline_ms are left out, and a note says so; so is graph
# (its calls are made one by one here: mpsd-stress --virtual-time launches the graph).
from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import math
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpsd.clock import DeviceClock, VirtualClock
from mpsd.sim import (COPY_KINDS, H200, Copy, DeviceSpec, Kernel, Op, Simulator, copy_kernel, function_cost,
                      kernel_cost)
from mpsd.stress.workload import COPIES, TenantSpec, Workload, WorkloadError, arrival_times, parse_workload
from mpsd.tools.scenario import is_scenario, to_toml, to_workload
from mpsd_protocol import DEFAULT_CONNECTIONS


@dataclass
class TenantResult:
    name: str
    client: int
    kernels: int = 0
    latencies: list[float] = field(default_factory=list)  # synchronise returned - launch called, seconds
    last_end: float = 0.0

    def summary(self, sm_seconds: float, total_sm_seconds: float) -> dict[str, Any]:
        ordered = sorted(self.latencies)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] * 1e3 if ordered else 0.0

        return {"tenant": self.name, "client": self.client, "kernels": self.kernels,
                "makespan_ms": self.last_end * 1e3, "latency_p50_ms": pct(0.5), "latency_p99_ms": pct(0.99),
                "sm_seconds": sm_seconds, "sm_share": sm_seconds / total_sm_seconds if total_sm_seconds else 0.0}


@dataclass
class _Loop:
    """A closed loop: its next request follows the last one's synchronise and a think time, until the run's
    duration and while it has requests left (None: no limit)."""

    make: Callable[[], list[Op]]
    left: int | None
    think: float
    until: float


def run_scenario(scenario: dict[str, Any]) -> dict[str, Any]:
    """Simulate the tables of an old scenario file (translated by mpsd.tools.scenario); see run_workload.

    Raises:
        WorkloadError: a missing, unknown or invalid setting, or a scenario with no workload form.
    """
    return run_workload(parse_workload(to_workload(scenario), source="the scenario"))


def run_workload(workload: Workload, latencies: bool = False) -> dict[str, Any]:
    """Simulate a workload on the model alone; returns per-tenant results and the device's figures (with
    ``latencies``, each tenant's every latency in seconds too, in the order its calls ended, as
    ``latencies_s``: what a sweep needs to pool a group's instances).

    Raises:
        WorkloadError: a setting the model refuses (a policy option, a partition, a block too large).
    """
    spec = H200
    options = workload.policy_options.get(workload.policy, {})
    try:
        sim = Simulator(spec, policy=workload.policy, policy_options=options if isinstance(options, dict) else None)
    except ValueError as exc:
        raise WorkloadError(f"[run.policy_options.{workload.policy}]: {exc}") from None
    results: dict[int, TenantResult] = {}
    # Each tenant is one host thread: its calls are made one after another (``calls``, in the order they are
    # due), and only its next one is posted to the daemon's driver (mpsd.clock), at the time its work
    # reaches the device; the driver applies them and the device's events in time order, the device's first
    # at equal times, calls due alike in the order they were listed. No tenant holds the clock: each call is
    # posted as soon as it is known, and the driver runs the device on until the next.
    calls: dict[int, list[tuple[float, int, Op, _Loop | None]]] = {}  # (call made, seq, op, loop it ends)
    seq = itertools.count()

    def request(client: int, at: float, ops: list[Op], loop: _Loop | None) -> None:
        for op in ops:
            heapq.heappush(calls[client], (at, next(seq), op, loop if op is ops[-1] else None))

    for tenant in workload.tenants:
        for copy in range(tenant.count):
            client = len(results) + 1
            results[client], calls[client] = TenantResult(tenant.instance(copy), client), []
            try:
                sim.configure_client(client, priority=tenant.priority, weight=tenant.weight,
                                     partition=tenant.partition, connections=DEFAULT_CONNECTIONS)
            except ValueError as exc:
                raise WorkloadError(f"tenant {tenant.name}: {exc}") from None
            make = _requests(spec, client, tenant)
            arrivals = arrival_times(tenant, workload.duration, workload.seed, copy)
            if arrivals is None:
                left = None if tenant.requests is None else tenant.requests - 1
                request(client, tenant.start or 0.0, make(), _Loop(make, left, tenant.think, workload.duration))
            for at in arrivals or ():
                request(client, at, make(), None)
    done: list = []
    posted: set[int] = set()  # the tenants with a call posted
    launched: dict[int, tuple[float, float]] = {}  # id(op) -> (when its request was due, the call's warmth)
    following: dict[int, _Loop] = {}  # closed loops waiting for their request's last op to end, by id(op)
    scales: dict[object, float] = dict(spec.copy_calls)  # a copy call's host time against a launch's, by kind
    # (the ops' tag)

    def call_next(client: int) -> None:
        if calls[client] and client not in posted:
            posted.add(client)
            at, n, op, loop = heapq.heappop(calls[client])
            thread = hosts[client].thread
            reaches = thread.launch(at, scales.get(op.tag, 1.0))
            launched[id(op)] = (at, thread.warmth)
            clock.post(hosts[client], reaches, functools.partial(submit, op, loop), order=n)

    def submit(op: Op, loop: _Loop | None) -> None:
        posted.discard(op.client)
        sim.submit(op)
        if loop is not None:
            following[id(op)] = loop
        call_next(op.client)

    def finished(ops: list) -> None:
        # A closed loop's next request: the synchronise returns, the tenant thinks, then makes its calls.
        done.extend(ops)
        for op in ops:
            loop = following.pop(id(op), None)
            if loop is None or loop.left == 0:
                continue
            at = hosts[op.client].thread.synchronize(op.ended) + loop.think
            if at >= loop.until:
                continue
            left = None if loop.left is None else loop.left - 1
            request(op.client, at, loop.make(), _Loop(loop.make, left, loop.think, loop.until))
            call_next(op.client)

    clock = VirtualClock(DeviceClock(sim), finished)
    hosts = {client: clock.join(client) for client in results}
    for host in hosts.values():
        clock.wait(host)
    for client in calls:
        call_next(client)
    while clock.pump(1 << 16):
        pass
    for op in done:
        result = results[op.client]
        result.kernels += 1
        at, warmth = launched[id(op)]
        returned = op.ended + hosts[op.client].thread.sync_latency(warmth)
        result.latencies.append(returned - at)
        result.last_end = max(result.last_end, returned)
    stats = sim.statistics()
    total = sum(c.sm_seconds for c in stats.per_client.values())
    tenants = [r.summary(stats.per_client[c].sm_seconds if c in stats.per_client else 0.0, total)
               for c, r in results.items()]
    if latencies:
        for row, r in zip(tenants, results.values()):
            row["latencies_s"] = list(r.latencies)
    return {"policy": workload.policy, "simulated_seconds": stats.now,
            "blocks": stats.blocks_completed, "kernels": stats.kernels_completed, "tenants": tenants}


def _requests(spec: DeviceSpec, client: int, tenant: TenantSpec) -> Callable[[], list[Op]]:
    """What makes one request's ops: its input copy, its calls in order, its output copy.

    Raises:
        WorkloadError: a kernel the model refuses (a block too large for an SM).
    """
    cap = tenant.sm_cap(spec)

    def copy(kind: str, nbytes: int) -> Callable[[], Op]:
        if kind in COPY_KINDS:  # a kernel the runtime launches: the tenant's SM cap holds
            blocks, threads, cost = copy_kernel(spec, kind, nbytes, cap)
            return functools.partial(Kernel, client=client, stream=0, tag=kind, blocks=blocks, threads=threads,
                                     cost=cost, priority=tenant.stream_priority, sm_cap=cap)
        return functools.partial(Copy, client=client, stream=0, tag=kind, engine=kind, nbytes=nbytes)

    steps = [copy("h2d", tenant.input)] if tenant.input else []
    for k in tenant.kernels:
        if k.name in COPIES:
            make = copy(COPIES[k.name], k.scalar)
        else:
            declared = k.declared() if k.params else None  # a module's kernel: its declaration's cost and resources
            try:
                cost = (kernel_cost(spec, k.name, k.grid, k.block, k.args((0, 0, 0))) if declared is None
                        else function_cost(spec, declared, k.grid, k.block, k.args()))
            except ValueError as exc:
                raise WorkloadError(f"tenant {tenant.name}: kernel {k.name!r}: {exc}") from None
            smem, regs = (0, 32) if declared is None else (declared.shared, declared.registers)
            make = functools.partial(Kernel, client=client, stream=0, blocks=k.grid, threads=k.block, cost=cost,
                                     priority=tenant.stream_priority, sm_cap=cap, smem=smem, regs_per_thread=regs)
        steps.extend([make] * k.repeat)
    if tenant.output:
        steps.append(copy("d2h", tenant.output))
    return lambda: [make() for make in steps]


def left_out(workload: Workload) -> list[str]:
    """What the model alone does not run of a workload, by tenant ("tenant a: memory, churn")."""
    out = []
    for t in workload.tenants:
        names = [key for key, value in (("memory", t.memory), ("churn", t.churn), ("ipc", t.ipc),
                                        ("pinned_mem_limit", t.pinned_mem_limit), ("deadline_ms", t.deadline),
                                        ("think_ms", t.think if t.arrival != "closed" else 0),
                                        ("graph", t.graph)) if value]
        if names:
            out.append(f"tenant {t.name}: {', '.join(names)}")
    return out


def render(result: dict[str, Any]) -> str:
    lines = [f"policy {result['policy']}: {result['kernels']} kernels, {result['blocks']} blocks, "
             f"{result['simulated_seconds'] * 1e3:.3f} ms simulated", "",
             f"{'tenant':<16} {'kernels':>7} {'makespan ms':>12} {'p50 ms':>9} {'p99 ms':>9} {'SM share':>8}"]
    for t in result["tenants"]:
        lines.append(f"{t['tenant']:<16} {t['kernels']:>7} {t['makespan_ms']:>12.3f} {t['latency_p50_ms']:>9.3f} "
                     f"{t['latency_p99_ms']:>9.3f} {t['sm_share']:>8.1%}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="mpsd simulate", description="Run a workload on the GPU model alone, "
                                                                       "in virtual time.")
    parser.add_argument("workload", type=Path, help="a workload TOML file (or an old scenario file)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--convert", action="store_true",
                        help="print the file as a workload file instead of running it (for old scenario files)")
    options = parser.parse_args(argv)
    path = options.workload
    try:
        data = tomllib.loads(path.read_text())
        if is_scenario(data):
            print(f"mpsd simulate: {path}: note: scenario files are deprecated; write it as a workload file "
                  f"(examples/workloads/): `mpsd simulate --convert {path}` prints it as one", file=sys.stderr)
            data = to_workload(data)
        workload = parse_workload(data, base=path.parent, source=str(path))
        if options.convert:
            print(f"# {path}, converted by mpsd simulate --convert\n" + to_toml(data), end="")
            return 0
        result = run_workload(workload)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, WorkloadError) as exc:
        print(f"mpsd simulate: {path}: {exc}", file=sys.stderr)
        return 2
    if left_out(workload):
        print(f"mpsd simulate: {path}: not modelled here (mpsd-stress --virtual-time runs them): "
              f"{'; '.join(left_out(workload))}", file=sys.stderr)
    print(json.dumps(result) if options.json else render(result))
    return 0
