# The kernel-level dispatcher: one scheduler in the daemon between the clients' streams and the device, the same on
# every backend. A real GPU's block scheduler is not ours, so in front of one this is the only place a policy can
# act: each client's work waits here in per-stream queues and is released to the backend by the policy, with at
# most `in_flight` of a client's kernels on the device at once, so that work held back can still be reordered.
# In front of the simulator (`--dispatch kernel`) the same code runs over the simulator's hardware-faithful `mps`
# blocks, so what a policy will do on a GPU is predicted, and tested, on a machine without one.
#
# It is shaped as a Backend that wraps a Backend: the runtime keeps speaking the one protocol (mpsd.backends.base),
# and work it holds simply has no handle yet (`Work.done` is False, as for work queued on a GPU). Rules:
# - per stream, work is released in the order it came; work whose `after` names work not yet released waits for it
#   (an event recorded on a held stream, the legacy default stream's implicit waits); event records and waits go
#   as soon as they reach their stream's head, outside the policy (they take no SM);
# - a client's work never released is dropped when the client is cancelled or goes, and whoever waits on it is
#   told at once, as for cancelled work;
# - the policy (mpsd.runtime.dispatch_policies) picks the next client to release from among those with a
#   releasable head and room under the bound, or holds them all; `room_for` tells it whether a kernel would find SMs
#   free beside what is already released. A device whose queue holds no blocks of work that is not running lets
#   the next urgent kernel start as soon as blocks end, and lets a policy choose among clients each time room opens:
#   a block, once it runs, cannot be preempted, and neither a GPU nor the simulator's `mps` will reorder them;
# - the bound is there for the others: a client alone on the device is pass-through (no policy is asked: it has
#   no one to give way to), and a policy may lift the bound for a client no other can be more urgent than
#   (`KernelPolicy.bounded`: priority's most urgent), whose runs then go whole. Each kernel held back costs the
#   device the time it takes to learn that the one before it ended (a poll, on a GPU);
# - released work is not watched kernel by kernel: what has ended is read from the work itself whenever the
#   dispatcher next decides, and only while it holds something back does it ask the backend to say when a
#   stream's oldest released work ends (on a GPU a watch makes the backend look often; with a callback a
#   kernel, no pass-through and runs split, a launch through the dispatcher cost the daemon 22.4 us of CPU on
#   the simulator, 5.5 us with these rules: bench/launch_rate.py --policy priority --dispatch kernel).
"""The kernel-level dispatcher."""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from mpsd.backends.base import Backend, Client, Gate, when_all
from mpsd.backends.ops import GraphLaunch, Launch, Record, Work
from mpsd_protocol import DEFAULT_CONNECTIONS, CudaError

if TYPE_CHECKING:
    from mpsd.runtime.dispatch_policies import KernelPolicy

__all__ = ["DEFAULT_IN_FLIGHT", "Dispatcher", "Tenant"]

log = logging.getLogger("mpsd.runtime.dispatch")
DEFAULT_IN_FLIGHT = 2  # kernels of one client on the device at once


class _Dropped:
    """The handle of work the dispatcher never released: done, and cancelled (its client went)."""

    __slots__ = ()
    done = True
    cancelled = True
    ended = math.nan
    tag = None


DROPPED = _Dropped()


@dataclass(eq=False, slots=True)
class _Item:
    seq: int  # arrival order across every client
    work: Work
    count: int  # kernels it stands for: what is left of a run's count, else 1
    stream_priority: int
    queued_at: float  # the device's clock when it came


@dataclass(eq=False, slots=True)
class _Flight:
    """Work released to the backend and not yet seen to end."""

    work: Work
    count: int  # kernels it stands for (none for an event record)
    stream_priority: int
    sms: int  # its footprint (what Tenant.occupied counts of it)
    released_at: float
    watched: bool = False  # the backend calls back when it ends


@dataclass(eq=False)
class Tenant:
    """What the dispatcher knows of one client, and what a policy reads.

    Attributes:
        id: the client's id.
        priority: its client priority as the daemon set it (0 normal, 1 below normal).
        weight: its share under `fair`.
        queued: items waiting to be released (a run of launches is one).
        in_flight: its kernels released and not yet seen to end (counted when the dispatcher next decides).
        gpu_ns: device nanoseconds its released kernels took (from their completion times; copies and event
            waits take none), whole, so that equal shares compare equal.
        released: kernels released so far.
        sm_cap: the SMs its client may hold at once.
        footprints: the footprints of its released, unfinished work, summed.
        occupied: what of them Dispatcher.busy counts: no more than its SM cap (a capped client's two kernels
            in flight hold its cap's SMs, not twice as many).
    """

    id: int
    priority: int = 0
    weight: float = 1.0
    queued: int = 0
    in_flight: int = 0
    gpu_ns: int = 0
    released: int = 0
    sm_cap: int | None = None
    footprints: int = 0
    occupied: int = 0
    last_end: float = -math.inf
    queues: dict[tuple[int, int], deque[_Item]] = field(default_factory=dict, repr=False)
    # stream priority -> its released kernels not yet ended, so that work on the device keeps its urgency
    running: dict[int, int] = field(default_factory=dict, repr=False)
    # per stream, its released work not yet seen to end, oldest first (a stream's work ends in its order)
    flights: dict[tuple[int, int], deque[_Flight]] = field(default_factory=dict, repr=False)
    # Counts every change of its own queues, running work and settings, so that what is computed from them (its
    # head, a policy's view of it) is computed once for each (a decision asks for its head some 36 times).
    stamp: int = 0
    gate: Gate | None = field(default=None, repr=False)  # the backend's gate its work released ahead waits at
    # The dispatcher, whose count of handles given says when a head held for a dependency must look again.
    owner: Dispatcher | None = field(default=None, repr=False)
    _seen: tuple[int, int] = field(default=(-1, -1), repr=False)
    _head: _Item | None = field(default=None, repr=False)

    def head(self) -> _Item | None:
        """The item it would release next: among its streams' heads whose dependencies are released, the most
        urgent stream's (lowest CUDA priority), then the oldest."""
        owner = self.owner
        seen = (self.stamp, owner.handles if owner is not None else -1)
        if owner is not None and seen == self._seen:
            return self._head
        best: _Item | None = None
        for queue in self.queues.values():
            if queue:
                item = queue[0]
                if all(a.handle is not None for a in item.work.after) and (
                        best is None or (item.stream_priority, item.seq) < (best.stream_priority, best.seq)):
                    best = item
        if owner is not None:
            self._seen, self._head = seen, best
        return best

    @property
    def gpu_time(self) -> float:
        """`gpu_ns` in seconds."""
        return self.gpu_ns / 1e9

    def waiting_since(self) -> float:
        """When its oldest held work came (infinity when it holds none)."""
        return min((q[0].queued_at for q in self.queues.values() if q), default=math.inf)

    def urgency(self) -> tuple[int, int]:
        """(client priority, most urgent stream priority among its held and running work, or the most urgent
        it has used while it has none): lower goes first."""
        most = math.inf
        for q in self.queues.values():
            if q and q[0].stream_priority < most:
                most = q[0].stream_priority
        for p, n in self.running.items():
            if n and p < most:
                most = p
        return self.priority, int(most) if most != math.inf else min(self.running, default=0)


class Dispatcher:
    """`backend`, with its clients' work released by `policy`, at most `in_flight` kernels of a client at once.

    Args:
        backend: the device.
        policy: which client's work goes next (mpsd.runtime.dispatch_policies).
        in_flight: the bound on each client's released, unfinished kernels (at least 1).
    """

    def __init__(self, backend: Backend, policy: KernelPolicy, in_flight: int = DEFAULT_IN_FLIGHT,
                 reaction: float = 0.0) -> None:
        if in_flight < 1:
            raise ValueError("in_flight must be at least 1")
        self.inner = backend
        self.rule = policy
        self.policy = policy.name
        self.in_flight = in_flight
        # Seconds the daemon takes, on a real GPU, from a kernel's end to the launch it decides on then (about
        # 100 us on the H200: bench/fidelity/h200_dec04/summary.txt, run 1): a model's backend adds it to what is
        # released on an end (`late`), so that it predicts what the policy does on a GPU. 0: an ideal daemon.
        self.reaction = reaction
        self._late = 0.0  # while a pump runs on an end: what its launches are late by
        self.tenants: dict[int, Tenant] = {}
        self._seq = itertools.count()
        self._waiters: dict[Work, list[Callable[[], None]]] = {}  # held work -> told once it is done
        props = backend.properties(0)
        self.sms = int(props["multiprocessor_count"])
        self._sm_limits = (int(props["max_blocks_per_multiprocessor"]), int(props["max_threads_per_multiprocessor"]),
                           int(props["shared_memory_per_multiprocessor"]))
        self.busy = 0  # SMs that released, unfinished kernels occupy: the sum of the tenants' `occupied`
        # Counts every change of what a policy reads (queues, heads, work released or ended, clients), so that a
        # policy may compute what it needs once per state rather than at each of a decision's questions.
        self.version = 0
        self.handles = 0  # handles given to released or dropped work: a head held for one may be free now
        # The kernel released to wait on the device behind everything running (`_choose`), and what it waits for;
        # while any of that runs, no other is released so.
        self._behind: tuple[Work, ...] = ()
        self._ahead = False  # room_for answers as if the work running had ended (while a policy looks ahead)
        self._gated: list[tuple[Tenant, Work]] = []  # work released ahead at its tenant's gate, not yet ended
        self._gating: bool | None = None  # whether the backend gives gates (asked the first time one is needed)
        self._pumping = False
        self._again = False
        # Work the backend refused when it was released, after its call had returned: (client, error)
        self.on_refused: Callable[[int, CudaError], None] = lambda client, error: log.warning(
            "client %d: released work refused: %s", client, error)

    def __getattr__(self, name: str) -> Any:  # everything else is the backend's
        return getattr(self.inner, name)

    # The device sets these on its backend: they are the wrapped backend's to call.
    @property
    def on_fault(self) -> Callable[[int, CudaError], None]:
        return self.inner.on_fault

    @on_fault.setter
    def on_fault(self, value: Callable[[int, CudaError], None]) -> None:
        self.inner.on_fault = value

    @property
    def on_idle(self) -> Callable[[int, float, float], None]:
        return self.inner.on_idle

    @on_idle.setter
    def on_idle(self, value: Callable[[int, float, float], None]) -> None:
        self.inner.on_idle = value

    # -- clients -------------------------------------------------------------------------------------------
    def attach(self, client: Client, *, sm_cap: int, priority: int, weight: float, instance: int | None,
               sms: tuple[int, int] | None = None, connections: int = DEFAULT_CONNECTIONS) -> None:
        tenant = self._tenant(client.id)
        tenant.priority, tenant.weight, tenant.sm_cap = priority, weight, sm_cap
        tenant.stamp += 1
        self.version += 1
        self.inner.attach(client, sm_cap=sm_cap, priority=priority, weight=weight, instance=instance, sms=sms,
                          connections=connections)
        self._pump()

    def cancel(self, client: int) -> None:
        self._drop(client)
        self.inner.cancel(client)
        self._pump()

    def forget(self, client: int) -> None:
        self._drop(client)
        tenant = self.tenants.pop(client, None)
        self.version += 1
        if tenant is not None:  # what it left on the device no longer counts (the backend let it go)
            self.busy -= tenant.occupied
            if tenant.gate is not None:
                tenant.gate.free()
        self.inner.forget(client)
        self._pump()

    def _tenant(self, client: int) -> Tenant:
        tenant = self.tenants.get(client)
        if tenant is None:
            tenant = self.tenants[client] = Tenant(client, owner=self)
            self.rule.joined(tenant, self)
        return tenant

    def _drop(self, client: int) -> None:
        """Work of `client` never released is dropped; whoever waits on it is told now."""
        tenant = self.tenants.get(client)
        if tenant is None:
            return
        if tenant.gate is not None:  # what waits at its gate runs out (a GPU cannot take it back)
            tenant.gate.set(False)
            self._gated = [(t, w) for t, w in self._gated if t is not tenant]
        for queue in tenant.queues.values():
            for item in queue:
                item.work.handle = DROPPED
                for told in self._waiters.pop(item.work, ()):
                    told()
        tenant.queues.clear()
        tenant.queued = 0
        tenant.stamp += 1
        self.handles += 1
        self.version += 1

    # -- work ----------------------------------------------------------------------------------------------
    def submit(self, work: Work, count: int = 1, gate: Gate | None = None, late: float = 0.0) -> None:
        """Queue `work` and release what the policy lets go. Where `work` itself is released now and the
        backend refuses it, the call fails as it would without the dispatcher, and nothing stays queued. (A gate
        and a lateness are the dispatcher's own to give the backend under it: nothing above it has either.)"""
        assert gate is None and not late, "the runtime gives the dispatcher no gate and no lateness"
        tenant = self._tenant(work.client)
        item = _Item(next(self._seq), work, count, work.priority, self.inner.now())
        tenant.queues.setdefault(work.stream, deque()).append(item)
        tenant.queued += 1
        tenant.stamp += 1
        self.version += 1
        self._pump(item)

    def when_done(self, work: Iterable[Work | None], callback: Callable[[], None]) -> None:
        when_all([w for w in work if w is not None and not w.done], self._wait, callback)

    def _wait(self, work: Work, told: Callable[[], None]) -> None:
        if work.handle is None:  # still held here: waited on once released
            self._waiters.setdefault(work, []).append(told)
        else:
            self.inner.when_done((work,), told)

    def footprint(self, work: Work, spread: bool = False) -> int:
        """The SMs a kernel occupies while it runs: its blocks over as many SMs as they fill (by the threads and
        shared memory they take; registers as the built-in kernels use them), or with `spread` one SM a block,
        within its client's SM cap. Copies, memsets and event records take none; a graph launch, one unit of work
        here however many nodes it has, what its largest kernel takes."""
        if isinstance(work, GraphLaunch):
            return max((self.footprint(node, spread) for node in work.nodes), default=0)
        if not isinstance(work, Launch):
            return 0
        plan = work.plan
        blocks = plan.blocks
        cap = self.sms if work.sm_cap is None else min(self.sms, work.sm_cap)
        if spread:
            return min(cap, blocks)
        blocks_per_sm, threads_per_sm, smem_per_sm = self._sm_limits
        per_sm = min(blocks_per_sm, threads_per_sm // max(1, plan.threads),
                     smem_per_sm // plan.smem if plan.smem else blocks_per_sm)  # (a module kernel's static too)
        return min(cap, -(-blocks // max(1, per_sm)))

    def room_for(self, tenant: Tenant) -> bool:
        """Whether `tenant`'s next kernel would run at once beside the work released (or the device is idle),
        counted as the policy counts its SMs (`KernelPolicy.spread`)."""
        head = tenant.head()
        if head is None:
            return False
        if self.busy == 0:
            return True
        sms = self.footprint(head.work, self.rule.spread(tenant, self))
        if self._ahead:  # a kernel of the whole device has room exactly when all that runs has ended
            return sms >= self.sms
        cap = self.sms if tenant.sm_cap is None else tenant.sm_cap
        return tenant.footprints + sms <= cap and self.busy + sms <= self.sms

    def _pump(self, raising: _Item | None = None) -> None:
        """Release work while the policy picks a client, having first counted what has ended; then, while
        anything is held, watch each stream's oldest released work, so that its end decides again. Re-entered
        from a completion the backend reports during a release, it leaves the work to the loop already
        running."""
        if self._pumping:
            self._again = True
            return
        self._pumping = True
        try:
            while True:
                self._again = False
                self._reap()
                self._release_records(raising)
                if len(self.tenants) == 1:  # alone: nobody to give way to, so no policy and no bound
                    (tenant,) = self.tenants.values()
                    while tenant.queued and tenant.head() is not None:  # (its event records too)
                        self._release(tenant, raising, whole=True)
                    chosen = None
                else:
                    chosen, whole, behind, gate = self._choose()
                if chosen is None:
                    if self._again:
                        continue
                    break
                self._release(chosen, raising, whole=whole, behind=behind, gate=gate)
            if self._gated:
                self._set_gates()
            if self._gated or any(t.queued for t in self.tenants.values()):
                self._watch()
        finally:
            self._pumping = False

    def _choose(self) -> tuple[Tenant | None, bool, tuple[Work, ...], Gate | None]:
        """The policy's pick among the clients with releasable work and room under their bound, whether the
        pick is unbounded (its runs then go whole), and the work it is to wait behind on the device.

        Where the policy holds them all for want of room, it is asked again, with room only for kernels that
        fill the device (which have room exactly when everything running has ended): its pick then goes at
        once, waiting on the device for all that runs (a stream wait on each), so that it starts as they end
        rather than once the daemon has learnt of it and launched it (125 to 200 us a kernel on the H200,
        bench/fidelity/h200_dec03/summary.txt, runs 8 and 10). It holds no SM until then. One kernel at a
        time waits so, so that whatever comes next is still the policy's to choose; a smaller kernel, which
        may find room before all has ended, waits in the daemon (behind everything, capped trainers sharing
        the device went in turn: inference_training's under round-robin lost a sixth of their throughput on
        the model). Where the policy's pick may change with what comes meanwhile (`KernelPolicy.gate`), the
        kernel waits at its client's gate too, which the dispatcher closes while the policy `holds` it back."""
        rule, bound = self.rule, self.in_flight
        ready, unbounded = [], set()
        for t in self.tenants.values():
            if t.queued and t.head() is not None:
                bounded = rule.bounded(t, self)
                if bounded and t.in_flight >= bound:
                    continue
                ready.append(t)
                if not bounded:
                    unbounded.add(t.id)
        if not ready:
            return None, False, (), None
        chosen = rule.pick(self, ready)
        behind: tuple[Work, ...] = ()
        gate: Gate | None = None
        if chosen is None:
            running = tuple(f.work for t in self.tenants.values() for flights in t.flights.values()
                            for f in flights if f.count and not f.work.done)
            if not running:
                # Never idle while work could go: what a policy holds may be what the work it favours waits for
                # (an event recorded on a held stream).
                # (a ready tenant has a head)
                chosen = min(ready, key=lambda t: t.head().seq)  # type: ignore[union-attr]
            elif rule.ahead and all(w.done for w in self._behind) and (not rule.gate or self._gates()):
                self._ahead = True
                try:
                    chosen = rule.pick(self, ready)
                finally:
                    self._ahead = False
                if chosen is not None and rule.gate:
                    if chosen.gate is None:
                        chosen.gate = self.inner.gate()
                    gate = chosen.gate
                    if gate is None:  # the backend has no more
                        return None, False, (), None
                if chosen is not None:
                    behind = self._behind = running
        return chosen, chosen is not None and chosen.id in unbounded, behind, gate

    def _gates(self) -> bool:
        """Whether the backend gives gates (it is asked once)."""
        if self._gating is None:
            probe = self.inner.gate()
            self._gating = probe is not None
            if probe is not None:
                probe.free()
        return self._gating

    def _set_gates(self) -> None:
        """Each gate with work at it closed while the policy holds its client back, else open."""
        self._gated = gated = [(t, w) for t, w in self._gated if not w.done]
        for tenant, _ in gated:
            # (a tenant in _gated has its gate)
            tenant.gate.set(self.rule.holds(tenant, self))  # type: ignore[union-attr]

    def _release_records(self, raising: _Item | None) -> None:
        """Event records and waits at a stream's head go at once, outside the policy and the bound: they take
        no SM and no time of the device's, and held, they would only hold back whoever waits on them."""
        for tenant in list(self.tenants.values()):
            for queue in list(tenant.queues.values()):
                while queue and isinstance(queue[0].work, Record) and all(
                        a.handle is not None for a in queue[0].work.after):
                    self._release(tenant, raising, queue[0])

    def _release(self, tenant: Tenant, raising: _Item | None, item: _Item | None = None,
                 whole: bool = False, behind: tuple[Work, ...] = (), gate: Gate | None = None) -> None:
        item = item or tenant.head()
        assert item is not None
        work = item.work
        tenant.stamp += 1
        self.version += 1
        # One kernel a pick, a run's too, so that each is the policy's choice; an unbounded client's run goes
        # whole (as without a dispatcher).
        n = item.count if whole else 1
        part: Work
        if n < item.count:  # part of a run goes: a copy of the launch (only launches make runs) stands for it
            assert isinstance(work, Launch)
            part = Launch.of(work.client, work.stream, work.priority, work.sm_cap, work.plan, work.extents)
            part.after, work.after = work.after, ()
            item.count -= n
        else:
            tenant.queues[work.stream].popleft()
            tenant.queued -= 1
            part = work
        if part.after or behind:
            # (dropped work, say, holds nothing back)
            part.after = tuple(a for a in (*part.after, *behind) if not a.done)
        # (Work released ahead waits behind what runs: the reaction passes meanwhile, as on a GPU.)
        late = self._late if isinstance(part, Launch) and not behind else 0.0
        try:
            if late:
                self.inner.submit(part, n, late=late)
            elif gate is None:
                self.inner.submit(part, n)
            else:
                gate.set(self.rule.holds(tenant, self))
                self.inner.submit(part, n, gate=gate)
                self._gated.append((tenant, part))
        except CudaError as error:
            part.handle = DROPPED
            self.handles += 1  # whoever waited on it may go now
            self.version += 1
            self._tell_held(part)
            if item is raising:
                raise
            self.on_refused(tenant.id, error)
            return
        sms = self.footprint(part, len(self.tenants) > 1 and self.rule.spread(tenant, self))  # alone: no policy
        if isinstance(part, Record):
            n = 0  # outside the bound
        tenant.in_flight += n
        tenant.released += n
        tenant.running[item.stream_priority] = tenant.running.get(item.stream_priority, 0) + n
        flights = tenant.flights.get(part.stream)
        if flights is None:
            flights = tenant.flights[part.stream] = deque()
        flights.append(_Flight(part, n, item.stream_priority, sms, self.inner.now()))
        self._occupy(tenant, sms)
        self.handles += 1  # its handle is set: work that waited on it may be a head now
        self.version += 1
        self._tell_held(part)

    def _tell_held(self, work: Work) -> None:
        for told in self._waiters.pop(work, ()):
            self._wait(work, told)

    def _occupy(self, tenant: Tenant, more: int) -> None:
        """`more` SMs of footprints released for `tenant` (fewer, where negative), counted in `busy` within its
        cap."""
        tenant.footprints += more
        occupied = min(tenant.footprints, self.sms if tenant.sm_cap is None else tenant.sm_cap)
        self.busy += occupied - tenant.occupied
        tenant.occupied = occupied

    def _reap(self) -> None:
        """Count the released work that has ended (or was cancelled), in the order it ended."""
        ended: list[tuple[Tenant, _Flight]] = []
        for tenant in self.tenants.values():
            for flights in tenant.flights.values():
                while flights and flights[0].work.done:
                    ended.append((tenant, flights.popleft()))
        if len(ended) > 1:
            ended.sort(key=lambda e: (e[1].work.ended, e[1].released_at))  # nan (cancelled) sorts anywhere
        for tenant, flight in ended:
            self._ended(tenant, flight)

    def _watch(self) -> None:
        """Ask the backend to say when each stream's oldest released work ends."""
        for tenant in self.tenants.values():
            for flights in tenant.flights.values():
                if flights and not flights[0].watched:
                    flights[0].watched = True
                    self.inner.when_done((flights[0].work,), self._react)

    def _react(self) -> None:
        """A watched kernel ended: decide again, what goes now late by the daemon's reaction."""
        self._late = self.reaction
        try:
            self._pump()
        finally:
            self._late = 0.0

    def _ended(self, tenant: Tenant, flight: _Flight) -> None:
        n, work = flight.count, flight.work
        tenant.stamp += 1
        self.version += 1
        tenant.in_flight -= n
        tenant.running[flight.stream_priority] -= n
        self._occupy(tenant, -flight.sms)
        ended = work.ended
        if ended == ended and isinstance(work, (Launch, GraphLaunch)):  # kernels that completed: their time counts
            start = max(flight.released_at, tenant.last_end)
            tenant.gpu_ns += max(0, round((ended - start) * 1e9))
            tenant.last_end = max(tenant.last_end, ended)
        self.rule.ended(tenant, self)

    def dispatch_statistics(self) -> dict[int, dict[str, Any]]:
        """Per client: work held (a run counts its kernels), kernels in flight and released, device seconds."""
        self._reap()
        return {t.id: {"queued": sum(item.count for q in t.queues.values() for item in q), "in_flight": t.in_flight,
                       "released": t.released, "gpu_time": t.gpu_time} for t in self.tenants.values()}
