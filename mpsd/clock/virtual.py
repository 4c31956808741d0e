# The virtual clock: simulated time that moves only as far as the clients let it, so what real processes see
# does not depend on how fast their host runs them. It is conservative discrete-event simulation, as parallel
# simulators do it without rollback: every client (a host) has a clock of its own, and the device may go
# only as far as the earliest clock of the hosts that are *holding* (running their own code, about to call
# again), since none of them can send work stamped earlier. A host that waits (for the device, or asleep
# past the others) or is idle does not hold, so when every host waits the device jumps to its next event.
#
# The calls of every host are applied in the order of their stamps (time, then the host's client id, then the
# order they came in), never in the order the host scheduler delivered them; device instants at a time go
# before calls stamped at that time. A call's cost kind (which mpsd_protocol's table of calls gives each call)
# says what it costs its host thread (mpsd.clock.host, its figures the DeviceSpec's, calibrated on an H200), and
# so when it is applied and when it returns. The device's time is the DeviceClock's (mpsd.clock.device), shared
# with the engine that drives this and the backend. Pure: no I/O, no wall clock; the daemon decides when a
# silent host counts as idle.
"""Ordering the calls of many hosts and a device's events in simulated time."""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .device import DeviceClock
from .host import HostThread

if TYPE_CHECKING:
    from mpsd.sim import Op

__all__ = ["CALL", "HOLDING", "IDLE", "LAUNCH", "SYNC", "WAITING", "Host", "Timing", "VirtualClock"]

HOLDING, WAITING, IDLE = "holding", "waiting", "idle"
# What a call costs its host thread, by its cost (kind, what). LAUNCH: a launch call whose work reaches the
# device as it returns, `what` the copy kind whose call costs a fraction of a kernel launch's
# (DeviceSpec.copy_calls), or "graph", a graph launch's (DeviceSpec.graph_launch_call); a launch that must wait
# (a synchronous copy) then returns a synchronise's latency after the work ends. SYNC: waits for the device, then
# a synchronise's latency. CALL: `what` "alloc" costs
# DeviceSpec.alloc_call_latency, "instantiate" (cudaGraphInstantiate) DeviceSpec.graph_instantiate_call where the
# spec has one, anything else call_latency, after any wait for the device. Event records and
# stream waits were not measured apart from launches: they cost what a kernel launch call does.
LAUNCH, SYNC, CALL = "launch", "sync", "call"


@dataclass(eq=False)
class Host:
    """One client's host thread under the virtual clock.

    Attributes:
        client: its client id.
        thread: what its calls cost (warmth and the time its last call returned).
        clock: its simulated now: its next call starts no earlier.
        state: HOLDING (its next call may come at ``clock``), WAITING (for the device) or IDLE.
        since: when (by the caller's clock, e.g. the wall) it was last heard from or answered.
    """

    client: int
    thread: HostThread
    clock: float
    state: str = HOLDING
    since: float = 0.0
    calls: int = 0  # calls stamped, for statistics


@dataclass(frozen=True, slots=True)
class Timing:
    """A call on a host's clock: its kind (LAUNCH, SYNC, CALL), the fixed host time it takes after it is
    applied (CALL), and when it is applied: as it starts, or for a launch as its work reaches the device."""

    kind: str
    cost: float
    at: float


# A posted call: (at, order, seq, action), a plain tuple so that the heap compares stamps in C (seq is unique:
# an action is never compared).
_Call = tuple[float, int, int, Callable[[], None]]
# A host's place among those holding the clock: its clock, then its client id (C code, not a lambda per host).
_HOLD_ORDER = operator.attrgetter("clock", "client")


class VirtualClock:
    """The calls of every host and the device's events, in simulated-time order.

    Args:
        device_clock: the device's clock.
        finish: told of the ops that completed, in completion order, before anything later happens (so that
            a host woken by them can hold the clock at once).
    """

    def __init__(self, device_clock: DeviceClock, finish: Callable[[list[Op]], None]) -> None:
        self.device_clock = device_clock
        self.hosts: dict[int, Host] = {}
        self._finish = finish
        self._calls: list[_Call] = []
        self._seq = itertools.count()

    # -- hosts -------------------------------------------------------------------------------------------
    def join(self, client: int) -> Host:
        """A new host, holding at the device's now. Calls of several hosts stamped alike go in the order of
        their client ids (the order they connected, in the daemon), as the policies break their ties."""
        host = Host(client, self.device_clock.host_thread(), self.device_clock.now)
        self.hosts[client] = host
        return host

    def leave(self, client: int) -> None:
        """The host is gone; calls of it still queued are the caller's to make harmless."""
        self.hosts.pop(client, None)

    def start(self, host: Host, charged: float = 0.0) -> float:
        """A call of ``host`` arrives: when it starts, ``charged`` seconds of its own work after its clock.
        A host that was not holding resumes no earlier than the device's now."""
        if host.state != HOLDING:
            host.clock = max(host.clock, self.device_clock.now)
            host.state = HOLDING
        host.clock += charged
        host.calls += 1
        return host.clock

    def call(self, host: Host, cost: tuple[str, str | None], charged: float = 0.0) -> Timing:
        """A call of `cost` (kind, what) arrives from `host`, after `charged` seconds of its own code: when it
        is applied. A launch's cost is charged at once (its call returns as its work is queued); the client's
        clock stays at the call's start otherwise, until `returned`."""
        start = self.start(host, charged)
        kind, what = cost
        spec = self.device_clock.spec
        if kind == LAUNCH:
            scale = (spec.graph_launch_call if what == "graph" else dict(spec.copy_calls).get(what, 1.0)
                     ) if what else 1.0
            host.clock = host.thread.launch(start, scale)
            return Timing(kind, 0.0, host.clock)
        if what == "alloc":
            return Timing(kind, spec.alloc_call_latency, start)
        if what == "instantiate" and spec.graph_instantiate_call:
            return Timing(kind, spec.graph_instantiate_call, start)
        return Timing(kind, spec.call_latency, start)

    def returned(self, host: Host, timing: Timing, waited: bool) -> float:
        """The call `timing` returns at the device's now, after waiting for the device if `waited`: when it
        returns on the host's clock; the host holds the clock from then."""
        now, thread = self.device_clock.now, host.thread
        if timing.kind == SYNC or (timing.kind == LAUNCH and waited):
            back = thread.synchronize(now, timing.at)
        elif timing.kind == LAUNCH:
            back = timing.at  # the launch call's time was charged when it arrived
        else:
            back = thread.call(now if waited else timing.at, timing.cost)
        self.hold(host, back)
        return back

    def hold(self, host: Host, at: float) -> None:
        """``host`` runs its own code again from ``at`` (a call returned)."""
        host.clock, host.state = max(at, self.device_clock.now), HOLDING

    def wait(self, host: Host) -> None:
        host.state = WAITING

    def idle(self, host: Host) -> None:
        host.state = IDLE

    def post(self, host: Host, at: float, action: Callable[[], None], order: int | None = None) -> None:
        """Apply ``action`` at simulated time ``at`` (no earlier than the device's now), in stamp order; calls
        stamped alike go by ``order`` (default: the host's client id), then as they were posted."""
        now = self.device_clock.now
        heapq.heappush(self._calls, (now if now > at else at, host.client if order is None else order,
                                     next(self._seq), action))

    def blocker(self) -> Host | None:
        """The holding host with the earliest clock: the one the device waits for when nothing else can go."""
        holding = [h for h in self.hosts.values() if h.state == HOLDING]
        return min(holding, key=_HOLD_ORDER) if holding else None

    def pending(self) -> int:
        return len(self._calls)

    # -- time ----------------------------------------------------------------------------------------------
    def pump(self, budget: int) -> bool:
        """Apply calls and device instants, earliest first, while no holding host could still send anything
        earlier; at most ``budget`` of them.

        Returns:
            True if the budget ran out (more may be ready), False if nothing more can go until a host calls
            again or stops holding.
        """
        device, calls = self.device_clock, self._calls
        for _ in range(budget):
            blocker = self.blocker()
            horizon = (math.inf, 0) if blocker is None else (blocker.clock, blocker.client)
            head = calls[0] if calls else None
            instant = device.next_time()
            if instant is not None and instant <= horizon[0] and (head is None or instant <= head[0]):
                self._done(device.advance(instant, 1))
            elif head is not None and (head[0], head[1]) <= horizon:
                heapq.heappop(calls)
                self._done(device.advance(max(head[0], device.now)))
                head[3]()
                self._done(device.advance(device.now))  # what the call completed at once (a marker on idle streams)
            else:
                return False
        return True

    def _done(self, ops: list[Op]) -> None:
        if ops:
            self._finish(ops)
