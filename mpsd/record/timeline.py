# What one run of a workload leaves behind, whichever way it ran (real processes against the daemon, or the
# simulator alone in virtual time): the tenants and their quotas, every request as the tenant saw it, every
# kernel and every block group as the device ran them. Metrics and reports read nothing else.
# Times are simulated seconds from the run's start, on one clock: requests are stamped by the tenants with
# their simulated clocks (ctx.clock()), kernels and spans by the device model.
# A run has millions of spans (block groups), so they travel as one table of numpy columns (Spans) from the
# simulator's trace to the metrics, the plots and the trace file: no Python object per span on the way.
"""The record of one stress run."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from mpsd.sim import Kernel, Simulator

__all__ = ["KernelRecord", "Request", "Span", "Spans", "TenantInfo", "Timeline", "partitions_of", "spans_of"]


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
    """One row of a Spans table: blocks of one kernel resident together on one SM. Only for tables written by
    hand (Spans.of_rows) and read back row by row (iterating a Spans); a run never makes them.

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


_INT_COLUMNS = ("tenant", "kernel", "sm", "blocks")
_FLOAT_COLUMNS = ("sm_fraction", "start", "end")


class Spans:
    """Every span of a run as columns: row i is ``Span(names[tenant[i]], kernel[i], sm[i], blocks[i],
    sm_fraction[i], start[i], end[i])``.

    Args:
        names: the tenants' names; the tenant column holds positions in it.
        tenant, kernel, sm, blocks: int64 columns (tenant: an index into names).
        sm_fraction, start, end: float64 columns, as in Span.

    Raises:
        ValueError: the columns differ in length, or a tenant code is not an index into names.
    """

    __slots__ = ("names", *_INT_COLUMNS, *_FLOAT_COLUMNS)
    names: list[str]
    tenant: np.ndarray
    kernel: np.ndarray
    sm: np.ndarray
    blocks: np.ndarray
    sm_fraction: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def __init__(self, names: Sequence[str] = (), tenant: Any = (), kernel: Any = (), sm: Any = (),
                 blocks: Any = (), sm_fraction: Any = (), start: Any = (), end: Any = ()) -> None:
        self.names = list(names)
        for column, values in zip(_INT_COLUMNS, (tenant, kernel, sm, blocks)):
            setattr(self, column, np.asarray(values, dtype=np.int64).reshape(-1))
        for column, values in zip(_FLOAT_COLUMNS, (sm_fraction, start, end)):
            setattr(self, column, np.asarray(values, dtype=np.float64).reshape(-1))
        if len({len(getattr(self, c)) for c in (*_INT_COLUMNS, *_FLOAT_COLUMNS)}) > 1:
            raise ValueError("the columns of a Spans table differ in length")
        if len(self.tenant) and not (0 <= self.tenant.min() and self.tenant.max() < len(self.names)):
            raise ValueError(f"tenant codes outside 0..{len(self.names) - 1}")

    @classmethod
    def of_rows(cls, rows: Iterable[tuple[str, int, int, int, float, float, float]]) -> Spans:
        """A table of rows given one by one (Span or plain tuples), tenants named in the order they first come."""
        rows = list(rows)
        codes: dict[str, int] = {}
        tenant = [codes.setdefault(row[0], len(codes)) for row in rows]
        columns = list(zip(*rows)) or [()] * 7
        return cls(list(codes), tenant, *columns[1:])

    def __len__(self) -> int:
        return len(self.tenant)

    def __iter__(self) -> Iterator[Span]:
        """The rows as Spans: slow, for tests and small tables."""
        names = self.names
        return (Span(names[t], *rest) for t, *rest in zip(*(getattr(self, c).tolist()
                                                              for c in (*_INT_COLUMNS, *_FLOAT_COLUMNS))))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spans) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Spans.of_rows({list(self)!r})"  # Python floats: every bit shows

    def tenants(self) -> np.ndarray:
        """Each span's tenant name (an object array)."""
        return np.array(self.names, dtype=object)[self.tenant] if self.names else np.array([], dtype=object)

    def codes(self, index: Mapping[str, int], missing: int) -> np.ndarray:
        """Each span's tenant as its position in ``index`` (name -> position), ``missing`` for names not in it."""
        table = np.array([index.get(name, missing) for name in self.names], dtype=np.int64)
        return table[self.tenant] if len(table) else np.zeros(0, dtype=np.int64)

    def take(self, which: Any) -> Spans:
        """The rows ``which`` selects (a boolean mask, or row indices in the order wanted), same names."""
        return self.replace(**{c: getattr(self, c)[which] for c in (*_INT_COLUMNS, *_FLOAT_COLUMNS)})

    def replace(self, **columns: Any) -> Spans:
        """A table with some columns (or names) replaced, the rest shared with this one."""
        current = {c: getattr(self, c) for c in ("names", *_INT_COLUMNS, *_FLOAT_COLUMNS)}
        return Spans(**(current | columns))

    def renamed(self, rename: Mapping[str, str | None]) -> Spans:
        """Tenants renamed by ``rename``; spans of tenants it names as None (or leaves out) are dropped."""
        names: dict[str, int] = {}
        new = [names.setdefault(to, len(names)) if (to := rename.get(name)) else -1 for name in self.names]
        code = np.array(new, dtype=np.int64)[self.tenant] if new else np.zeros(0, dtype=np.int64)
        kept = code >= 0
        if kept.all():  # the usual case: every span kept, its columns shared rather than copied
            return self.replace(names=list(names), tenant=code)
        return self.take(kept).replace(names=list(names), tenant=code[kept])

    def shifted(self, by: float) -> Spans:
        """Every start and end ``by`` seconds earlier."""
        return self.replace(start=self.start - by, end=self.end - by)


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
        requests, kernels, spans: as recorded, in no particular order (spans: one table of columns).
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
    spans: Spans = field(default_factory=Spans)
    memory_high_water: dict[str, int] = field(default_factory=dict)
    allocators: dict[str, dict[str, Any]] = field(default_factory=dict)
    allocator_series: dict[str, list[tuple[float, int, int, int]]] = field(default_factory=dict)
    partitions: list[tuple[str, int, int]] = field(default_factory=list)
    virtual: bool = False
    lag: float = 0.0
    traced: bool = True


def spans_of(sim: Simulator, tenant_of: dict[int, str], ids: dict[Kernel, int]) -> Spans:
    """The spans of a simulator that recorded its trace, for the kernels in ``ids`` (kernel -> its id), named
    by ``tenant_of`` (client -> tenant name). The daemon's recorder and the virtual-time runner share it."""
    names = list(dict.fromkeys(tenant_of.values()))
    code = {name: i for i, name in enumerate(names)}
    # The engine's columns, and what depends on the kernel looked up once per kernel (id -1: not asked about)
    # and spread over its groups by numpy.
    kernels, of_kernel, sm, count, start, end = sim.trace_columns()
    kernel_id = np.array([ids.get(op, -1) for op in kernels], dtype=np.int64)
    tenant = np.array([code[tenant_of[op.client]] if op in ids else 0 for op in kernels], dtype=np.int64)
    threads = np.array([op.threads for op in kernels], dtype=np.int64)
    kept = kernel_id[of_kernel] >= 0
    of_kernel, blocks = of_kernel[kept], count[kept]
    # int * int exactly, then one correctly rounded division, as Python's count * threads / per_sm
    fraction = np.minimum(1.0, blocks * threads[of_kernel] / sim.spec.max_threads_per_sm)
    return Spans(names, tenant[of_kernel], kernel_id[of_kernel], sm[kept], blocks, fraction, start[kept], end[kept])


def partitions_of(sim: Simulator) -> list[tuple[str, int, int]]:
    """The simulator's MIG partitions as Timeline.partitions has them; empty under other policies."""
    return [(f"{i}: {p.profile}", p.first_sm, p.first_sm + p.sm_count)
            for i, p in enumerate(getattr(sim.policy, "partitions", None) or ())]
