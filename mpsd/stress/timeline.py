# What one run of a workload leaves behind, whichever way it ran (real processes against the daemon, or the
# simulator alone in virtual time): the tenants and their quotas, every request as the tenant saw it, every
# kernel and every block group as the device ran them. Metrics and reports read nothing else.
# Times are simulated seconds from the run's start, on one clock: requests are stamped by the tenants with
# their simulated clocks (ctx.clock()), kernels and spans by the device model.
"""The record of one stress run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from mpsd.sim import Kernel, Simulator

__all__ = ["KernelRecord", "Request", "Span", "TenantInfo", "Timeline", "partitions_of", "spans_of"]


@dataclass(frozen=True, slots=True)
class TenantInfo:
    """One tenant instance and what it was promised.

    Attributes:
        name: unique in the run, e.g. "training#1" (copy 1 of the workload's "training").
        group: the workload entry it was made from, e.g. "training".
        sm_cap: most SMs it may occupy at once (from its active thread percentage); None for all.
        mem_limit: its pinned device memory limit, bytes; None for none.
        entitlement: its due share of the device's SM-time; the tenants' entitlements sum to 1.
        deadline: latency objective for its requests, seconds; None for none.
        priority: client priority (0 normal, 1 below normal, finer levels for the priority policy).
    """

    name: str
    group: str
    sm_cap: int | None = None
    mem_limit: int | None = None
    entitlement: float = 1.0
    deadline: float | None = None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Request:
    """One unit of a tenant's work, from the host call that issued it to the host seeing it complete.

    Attributes:
        tenant: TenantInfo.name.
        submitted: when the tenant issued it (for open-loop arrivals: when it was due, so queueing in the
            tenant counts as latency).
        completed: when the tenant saw it complete; NaN if it failed.
        error: the CUDA error name if it failed, else None.
        host: how long the tenant took to issue it (its calls before the synchronize), seconds.
    """

    tenant: str
    submitted: float
    completed: float = math.nan
    error: str | None = None
    host: float = 0.0

    @property
    def latency(self) -> float:
        return self.completed - self.submitted


@dataclass(frozen=True, slots=True)
class KernelRecord:
    """One kernel as the device ran it.

    Attributes:
        tenant: TenantInfo.name.
        kernel: id, unique in the run; spans refer to it.
        name: the kernel's function name.
        blocks: blocks in its grid.
        submitted: when it reached the device (its stream's turn still to come).
        started: when its first block started; NaN if it never did.
        ended: when its last block ended; NaN if it never did.
        eligible: when its stream's turn came (earlier work on the stream, and what it waits for, done); its
            blocks may start the device's launch overhead later. NaN if unknown or never: then submitted stands in.
    """

    tenant: str
    kernel: int
    name: str
    blocks: int
    submitted: float
    started: float = math.nan
    ended: float = math.nan
    eligible: float = math.nan

    @property
    def ready(self) -> float:
        """The earliest its blocks could start, given its stream (``launch_overhead`` still to add)."""
        return self.submitted if math.isnan(self.eligible) else self.eligible


class Span(NamedTuple):
    """Blocks of one kernel resident together on one SM. (A named tuple: a run makes millions, and one costs a
    third of what a frozen dataclass costs to build.)

    Attributes:
        tenant: TenantInfo.name.
        kernel: KernelRecord.kernel.
        sm: SM index.
        blocks: blocks in the group.
        sm_fraction: share of the SM they hold, in (0, 1]: blocks x threads / the SM's thread slots, at most 1.
        start, end: seconds.
    """

    tenant: str
    kernel: int
    sm: int
    blocks: int
    sm_fraction: float
    start: float
    end: float


@dataclass(slots=True)
class Timeline:
    """Everything one run recorded.

    Attributes:
        policy: the scheduling policy it ran under.
        sm_count: SMs on the device.
        duration: seconds from the run's start to the last request's completion (the window metrics use).
        launch_overhead: the device's fixed delay from a kernel's turn to its first block (seconds); a kernel
            counts as queued from its stream's turn (KernelRecord.ready) + launch_overhead until its last
            block starts.
        tenants: every tenant instance, in workload order.
        requests, kernels, spans: as recorded, in no particular order.
        memory_high_water: tenant name -> most device memory charged to it at once, bytes.
        allocators: tenant name -> its caching allocator's figures (mpsd.stress.churn), for tenants with one.
        allocator_series: tenant name -> (submitted, reserved, allocated, segments) after each request's churn.
        partitions: MIG partitions as (name, first SM, end SM), for trace rows; empty without MIG.
        virtual: True if the run was on the virtual clock (every time is the model's, not the host's).
        lag: the furthest the daemon's model fell behind the wall clock, seconds (0 on the virtual clock): when
            the model cannot keep up with the work in real time, completions come late and device times stretch.
        traced: the device's side was recorded (the simulator's trace: kernels, spans, memory). Without it (a
            real GPU, or a run that asked for no trace) kernels and spans are empty, and the figures drawn from
            them are unknown, not zero; memory_high_water is then what each tenant's context reported.
    """

    policy: str
    sm_count: int
    duration: float
    launch_overhead: float = 0.0
    tenants: list[TenantInfo] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    kernels: list[KernelRecord] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    memory_high_water: dict[str, int] = field(default_factory=dict)
    allocators: dict[str, dict[str, Any]] = field(default_factory=dict)
    allocator_series: dict[str, list[tuple[float, int, int, int]]] = field(default_factory=dict)
    partitions: list[tuple[str, int, int]] = field(default_factory=list)
    virtual: bool = False
    lag: float = 0.0
    traced: bool = True


def spans_of(sim: Simulator, tenant_of: dict[int, str], ids: dict[Kernel, int]) -> list[Span]:
    """The spans of a simulator that recorded its trace, for the kernels in ``ids`` (kernel -> its id), named
    by ``tenant_of`` (client -> tenant name). The daemon's recorder and the virtual-time runner share it."""
    per_sm = sim.spec.max_threads_per_sm
    return [Span(tenant_of[g.op.client], ids[g.op], g.sm, g.count, min(1.0, g.count * g.op.threads / per_sm),
                 g.start, g.end) for g in sim.trace if g.op in ids]


def partitions_of(sim: Simulator) -> list[tuple[str, int, int]]:
    """The simulator's MIG partitions as Timeline.partitions has them; empty under other policies."""
    return [(f"{i}: {p.profile}", p.first_sm, p.first_sm + p.sm_count)
            for i, p in enumerate(getattr(sim.policy, "partitions", None) or ())]
