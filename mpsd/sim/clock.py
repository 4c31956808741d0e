# The virtual clock: simulated time that moves only as far as the clients let it, so what real processes see
# does not depend on how fast their host runs them. It is conservative discrete-event simulation, as parallel
# simulators do it without rollback: every client (a host) has a clock of its own, and the device may go
# only as far as the earliest clock of the hosts that are *holding* (running their own code, about to call
# again), since none of them can send work stamped earlier. A host that waits (for the device, or asleep
# past the others) or is idle does not hold, so when every host waits the device jumps to its next event.
#
# The calls of every host are applied in the order of their stamps (time, then the host's client id, then the
# order they came in), never in the order the host scheduler delivered them; device instants at a time go
# before calls stamped at that time. What a call costs its host (and so its stamp) is the caller's business
# (mpsd.sim.host); this module only orders. Pure: no I/O, no wall clock; the daemon decides when a silent
# host counts as idle.
"""Ordering the calls of many hosts and a device's events in simulated time."""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

from .engine import Simulator
from .host import HostThread
from .ops import Op

__all__ = ["HOLDING", "IDLE", "WAITING", "Host", "VirtualClock"]

HOLDING, WAITING, IDLE = "holding", "waiting", "idle"


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


@dataclass(order=True)
class _Call:
    at: float
    client: int
    seq: int
    action: Callable[[], None] = field(compare=False)


class VirtualClock:
    """The calls of every host and the device's events, in simulated-time order.

    Args:
        sim: the device.
        finish: told of the ops that completed, in completion order, before anything later happens (so that
            a host woken by them can hold the clock at once).
    """

    def __init__(self, sim: Simulator, finish: Callable[[list[Op]], None]) -> None:
        self.sim = sim
        self.hosts: dict[int, Host] = {}
        self._finish = finish
        self._calls: list[_Call] = []
        self._seq = itertools.count()

    # -- hosts -------------------------------------------------------------------------------------------
    def join(self, client: int) -> Host:
        """A new host, holding at the device's now. Calls of several hosts stamped alike go in the order of
        their client ids (the order they connected, in the daemon), as the policies break their ties."""
        host = Host(client, HostThread(self.sim.spec), self.sim.now)
        self.hosts[client] = host
        return host

    def leave(self, client: int) -> None:
        """The host is gone; calls of it still queued are the caller's to make harmless."""
        self.hosts.pop(client, None)

    def start(self, host: Host, charged: float = 0.0) -> float:
        """A call of ``host`` arrives: when it starts, ``charged`` seconds of its own work after its clock.
        A host that was not holding resumes no earlier than the device's now."""
        if host.state != HOLDING:
            host.clock = max(host.clock, self.sim.now)
            host.state = HOLDING
        host.clock += charged
        host.calls += 1
        return host.clock

    def hold(self, host: Host, at: float) -> None:
        """``host`` runs its own code again from ``at`` (a call returned)."""
        host.clock, host.state = max(at, self.sim.now), HOLDING

    def wait(self, host: Host) -> None:
        host.state = WAITING

    def idle(self, host: Host) -> None:
        host.state = IDLE

    def post(self, host: Host, at: float, action: Callable[[], None]) -> None:
        """Apply ``action`` at simulated time ``at`` (no earlier than the device's now), in stamp order."""
        heapq.heappush(self._calls, _Call(max(at, self.sim.now), host.client, next(self._seq), action))

    def blocker(self) -> Host | None:
        """The holding host with the earliest clock: the one the device waits for when nothing else can go."""
        holding = [h for h in self.hosts.values() if h.state == HOLDING]
        return min(holding, key=lambda h: (h.clock, h.client)) if holding else None

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
        sim, calls = self.sim, self._calls
        for _ in range(budget):
            blocker = self.blocker()
            horizon = (math.inf, 0) if blocker is None else (blocker.clock, blocker.client)
            head = calls[0] if calls else None
            instant = sim.next_time()
            if instant is not None and instant <= horizon[0] and (head is None or instant <= head.at):
                self._done(sim.advance(instant, 1))
            elif head is not None and (head.at, head.client) <= horizon:
                heapq.heappop(calls)
                self._done(sim.advance(max(head.at, sim.now)))
                head.action()
                self._done(sim.advance(sim.now))  # what the call completed at once (a marker on idle streams)
            else:
                return False
        return True

    def _done(self, ops: list[Op]) -> None:
        if ops:
            self._finish(ops)
