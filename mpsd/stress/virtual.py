# A workload played on the GPU model alone, in virtual time: no daemon, no processes, as fast as the simulator
# runs, identical on every run. Each tenant instance behaves as its process would: one request at a time, its
# input copy, kernels and output copy launched one call after another, each reaching the device as its call
# returns, the request complete when the host would see its synchronize return, every call costing what a
# thread idle that long pays (mpsd.sim.host).
# Closed loops issue the next request when the last completes (plus think time), open loops when it is due
# or when the last completes, whichever is later (so queueing in the tenant counts).
# Memory is checked against the tenant's limit as the daemon checks it, charged as the daemon charges it (by its
# own mpsd.memory.AddressSpace).
"""Running a stress workload in virtual time."""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from mpsd.sim import H200, Copy, DeviceSpec, Kernel, Op, Simulator, kernel_cost
from mpsd.memory import AddressSpace, Allocation
from mpsd.sim.host import HostThread
from mpsd.stress.timeline import KernelRecord, Request, TenantInfo, Timeline, partitions_of, spans_of
from mpsd.stress.workload import POINTER_KERNELS, TenantSpec, Workload, arrival_times, entitlements

__all__ = ["run_virtual"]

OOM = "cudaErrorMemoryAllocation"
FAILED_CALL = 1e-6  # least host time a refused call takes, so a closed loop of refusals still moves on


@dataclass
class _Instance:
    client: int
    name: str
    spec: TenantSpec
    arrivals: list[float] | None
    cap: int
    thread: HostThread  # its process's host thread: what its calls cost
    charged: int = 0
    high_water: int = 0
    issued: int = 0  # requests issued so far
    space: AddressSpace = field(default_factory=AddressSpace)  # charged as the daemon charges (mpsd.memory)
    churn: int | None = None  # the address of the live request's churn allocation

    def charge(self, nbytes: int, limit: int) -> int | None:
        """Allocate ``nbytes`` against ``limit``, charged as the daemon charges it; its address, or None if it
        does not fit."""
        addr, span, charge = self.space.plan(nbytes)
        if self.charged + charge > limit:
            return None
        self.space.insert(Allocation(addr, nbytes, span, None))  # type: ignore[arg-type]  # no bytes behind it
        self.charged += charge
        self.high_water = max(self.high_water, self.charged)
        return addr

    def free(self, addr: int) -> None:
        self.charged -= self.space.remove(addr)[1]


def run_virtual(workload: Workload, policy: str, policy_options: dict[str, Any],
                tenants: list[TenantSpec] | None = None, spec: DeviceSpec = H200) -> Timeline:
    """Simulate ``tenants`` (default: all the workload's) under ``policy``.

    Raises:
        ValueError: the policy, its options or a tenant's partition is not valid.
    """
    specs = list(workload.tenants if tenants is None else tenants)
    sim = Simulator(spec, policy=policy, policy_options=policy_options, record=True)
    instances: list[_Instance] = []
    requests: list[Request] = []
    names: dict[Kernel, tuple[str, str]] = {}  # every kernel -> (instance, kernel name)
    # (a launch's work reaches the device, seq, instance, its request's stamp, the request's ops still to
    # launch after it: None for a request's first launch, which builds them)
    pending: list[tuple[float, int, int, float, list[Op] | None]] = []
    outstanding: dict[Op, tuple[_Instance, float]] = {}  # a request's last op -> whose, its stamp
    calls = dict(spec.copy_calls)  # a copy call's host time against a launch's, by kind
    order = itertools.count()

    def schedule(inst: _Instance, now: float) -> None:
        """Queue the instance's next request, if it has one: closed loops until the end, open loops until
        their arrivals run out."""
        first = calls.get("h2d", 1.0) if inst.spec.input else 1.0  # the request's first call: its input copy
        if inst.arrivals is None:
            at = now + (inst.spec.think if inst.issued else 0.0)
            if at < workload.duration:
                heapq.heappush(pending, (inst.thread.launch(at, first), next(order), inst.client - 1, at, None))
        elif inst.issued < len(inst.arrivals):
            due = inst.arrivals[inst.issued]
            heapq.heappush(pending, (inst.thread.launch(max(due, now), first), next(order), inst.client - 1, due,
                                     None))

    for t in specs:
        limit = _limit(t, spec)
        for copy in range(t.count):
            inst = _Instance(len(instances) + 1, t.instance(copy), t,
                             arrival_times(t, workload.duration, workload.seed, copy), t.sm_cap(spec),
                             HostThread(spec))
            sim.configure_client(inst.client, priority=t.priority, weight=t.weight, partition=t.partition)
            instances.append(inst)
            for nbytes in _setup_allocations(t):
                if inst.charge(nbytes, limit) is None:
                    requests.append(Request(inst.name, 0.0, math.nan, OOM))
            schedule(inst, 0.0)

    while pending or outstanding:
        next_event = sim.next_time()
        if pending and (next_event is None or pending[0][0] <= next_event):
            at, _, index, stamp, later = heapq.heappop(pending)
            inst = instances[index]
            done = sim.advance(max(sim.now, at))
            t = inst.spec
            if later is None:  # a request's first launch
                inst.issued += 1
                inst.churn = inst.charge(t.churn, _limit(t, spec)) if t.churn else None
                if t.churn and inst.churn is None:
                    requests.append(Request(inst.name, stamp, math.nan, OOM))
                    # The refusal is one round trip to the daemon: the tenant tries again no sooner.
                    schedule(inst, max(inst.thread.synchronize(at), stamp + FAILED_CALL))
                    later = []
                else:
                    later = _request_ops(inst, spec, names)
                    outstanding[later[0]] = (inst, stamp)
            if later:
                sim.submit(later.pop())
                if later:  # the next launch call follows this one's return
                    nxt = later[-1]
                    scale = calls.get(nxt.engine, 1.0) if isinstance(nxt, Copy) else 1.0
                    heapq.heappush(pending, (inst.thread.launch(at, scale), next(order), index, stamp, later))
        else:
            done = sim.advance(next_event)
        for op in done:
            if op in outstanding:
                inst, stamp = outstanding.pop(op)
                completed = inst.thread.synchronize(op.ended)
                requests.append(Request(inst.name, stamp, completed))
                if inst.churn is not None:
                    inst.free(inst.churn)
                    inst.churn = None
                schedule(inst, completed)
    return _timeline(workload, policy, sim, specs, instances, requests, names)


def _limit(t: TenantSpec, spec: DeviceSpec) -> int:
    """Bytes the tenant may allocate: its pinned limit (or the device) less what its context takes."""
    limit = spec.total_memory if t.pinned_mem_limit is None else min(t.pinned_mem_limit, spec.total_memory)
    return limit - spec.context_memory


def _setup_allocations(t: TenantSpec) -> list[int]:
    """What the tenant process allocates before its first request, in its order."""
    out = [t.memory] if t.memory else []
    out += [n for n in (t.input, t.output) if n]
    for k in t.kernels:
        out += [4 * k.scalar] * POINTER_KERNELS.get(k.name, 0)
    if t.ipc == "producer":
        out.append(t.ipc_size)
    elif t.ipc == "consumer":
        out.append(4)
    return out


def _request_ops(inst: _Instance, spec: DeviceSpec, names: dict[Kernel, tuple[str, str]]) -> list[Op]:
    """The ops of one of the instance's requests (its input copy, its kernels, named in ``names``, and its
    output copy), last first (they are popped)."""
    t = inst.spec
    ops: list[Op] = []
    if t.input:
        ops.append(Copy(client=inst.client, stream=0, engine="h2d", nbytes=t.input))
    for name, grid, block, args, repeat in _request_kernels(t):
        cost = kernel_cost(spec, name, grid, block, args)
        for _ in range(repeat):
            op = Kernel(client=inst.client, stream=0, blocks=grid, threads=block, cost=cost,
                        priority=t.stream_priority, sm_cap=inst.cap)
            names[op] = (inst.name, name)
            ops.append(op)
    if t.output:
        ops.append(Copy(client=inst.client, stream=0, engine="d2h", nbytes=t.output))
    ops.reverse()
    return ops


def _request_kernels(t: TenantSpec) -> list[tuple[str, int, int, list[Any], int]]:
    """(name, grid, block, args, repeat) of one request, as the tenant process launches them (pointers are
    placeholders: only the sizes matter to the model)."""
    out: list[tuple[str, int, int, list[Any], int]] = []
    n = t.ipc_size // 4
    if t.ipc == "producer":
        out.append(("fill_f32", 132, 256, [0, 1.0, n], 1))
    elif t.ipc == "consumer":
        out.append(("reduce_sum_f32", 132, 256, [0, 0, n], 1))
    out += [(k.name, k.grid, k.block, k.args((0, 0, 0)), k.repeat) for k in t.kernels]
    return out


def _timeline(workload: Workload, policy: str, sim: Simulator, specs: list[TenantSpec], instances: list[_Instance],
              requests: list[Request], names: dict[Kernel, tuple[str, str]]) -> Timeline:
    entitlement = entitlements(specs)
    by_client = {i.client: i.name for i in instances}
    ids = {op: n for n, op in enumerate(names)}
    kernels = [KernelRecord(tenant, ids[op], name, op.blocks, op.submitted, op.started, op.ended, op.eligible)
               for op, (tenant, name) in names.items()]
    tenants = [TenantInfo(name=i.name, group=i.spec.name, sm_cap=i.cap, mem_limit=i.spec.pinned_mem_limit,
                          entitlement=entitlement[i.name], deadline=i.spec.deadline, priority=i.spec.priority)
               for i in instances]
    ends = [r.completed for r in requests if not math.isnan(r.completed)]
    return Timeline(policy=policy, sm_count=sim.spec.sm_count, duration=max([workload.duration, *ends]),
                    launch_overhead=sim.spec.kernel_overhead, tenants=tenants, requests=requests, kernels=kernels,
                    spans=spans_of(sim, by_client, ids), memory_high_water={i.name: i.high_water for i in instances},
                    partitions=partitions_of(sim), virtual=True)
