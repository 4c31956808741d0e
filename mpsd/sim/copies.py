# Copy engines over PCIe: one per direction and lane, a lane being a set of copy engines (the device's one
# set, or a MIG partition's own). A real H200 time-slices an engine between the streams that have copies
# for it, MPS or not: a 64-KiB copy beside another process's stream of 256-MiB copies waited for a grid of
# about 1.05-ms slices that starts when the stream got the engine and runs on while it is alone
# (bench/fidelity/h200_copies2.json: after sleeps of 0 to 0.5 ms the small copy's latency was 1.05 ms less
# the sleep; after 2 and 3 ms, either almost nothing or a whole slice). Copies never share an SM with blocks
# (device-to-device copies and memsets are kernels: mpsd.sim.costs.copy_kernel), so this module decides only
# which copy runs on an engine and until when; the engine owns the events, the counters and what a finished
# copy releases in stream order. The two directions of a lane share the PCIe link unevenly: while both run,
# host-to-device copies were 18 to 44% slower on the H200 and device-to-host ones about 5%
# (h200_copies.json and h200_copies3.json); DeviceSpec.copy_duplex holds the means.
"""Copy engines: PCIe copies, time-sliced between streams."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from .ops import Copy
from .specs import DeviceSpec

__all__ = ["CopyEngines"]

Lane = tuple[str, int]


@dataclass(slots=True)
class _Engine:
    """One copy engine: the copy it runs and the copies waiting for it, one per stream at most (a stream's
    next copy becomes eligible only when its last one ends)."""

    waiting: deque[Copy] = field(default_factory=deque)
    running: Copy | None = None
    since: float = 0.0  # when ``running`` last started or resumed
    owner: Hashable | None = None  # the stream holding the slice
    granted: float = 0.0  # when the owner got the engine: its slices end on a grid from here
    version: int = 0  # bumped whenever the pending event changes
    speed: float = 1.0  # the fraction of its bandwidth ``running`` gets (less while the other direction runs)


class CopyEngines:
    """The copies queued or in flight, by engine.

    A copy takes ``copy_latency`` plus its bytes at PCIe bandwidth. The stream whose copy runs holds the
    engine in slices of ``spec.copy_timeslice``; when a slice ends and another stream waits, the copy is
    set aside with the time it has left and the next stream waiting gets the engine. A stream whose copy
    ends keeps the engine if its next copy is eligible at that instant (back-to-back copies, as a queued
    stream has); otherwise the next waiting one gets it, in the order they became eligible. While the other
    direction's engine of the lane runs, a copy moves at its direction's share of the bandwidth
    (``spec.copy_duplex``). A spec without a time slice runs each copy to its end.

    Args:
        spec: the device (bandwidth, fixed latency, time slice, shares of the link).
        schedule: called as ``schedule(time, token)`` for the engine's next event; the engine passes the
            token back to ``stale`` and ``fire``.
    """

    def __init__(self, spec: DeviceSpec, schedule: Callable[[float, tuple], None]) -> None:
        self._spec = spec
        self._schedule = schedule
        self._engines: dict[Lane, _Engine] = {}
        self._lane: dict[Copy, Lane] = {}  # copies waiting or in flight -> their engine
        self._left: dict[Copy, float] = {}  # seconds each started copy still needs at full speed
        self._duplex = dict(spec.copy_duplex)

    def enqueue(self, op: Copy, lane: Lane, now: float) -> None:
        """``op`` became eligible: queue it on ``lane``; the caller calls ``start`` once this instant's
        copies are queued."""
        self._lane[op] = lane
        engine = self._engines.get(lane)
        if engine is None:
            engine = self._engines[lane] = _Engine()
        engine.waiting.append(op)
        if engine.running is not None:
            self._plan(lane, engine, now)  # a slice end may matter now

    def start(self, lane: Lane, now: float) -> None:
        """If ``lane``'s engine is idle, give it to the next copy: the slice holder's, else the first waiting."""
        engine = self._engines[lane]
        if engine.running is not None:
            return
        if not engine.waiting:
            engine.owner = None
            self._pace(self._partner(lane), now)  # idle now: the other direction has the link to itself
            return
        op = next((o for o in engine.waiting if (o.client, o.stream) == engine.owner), None)
        if op is None:
            op = engine.waiting[0]
            engine.owner, engine.granted = (op.client, op.stream), now
        engine.waiting.remove(op)
        self._run(lane, engine, op, now)

    def start_all(self, now: float) -> None:
        """Start every idle engine's next copy (after a cancel emptied some)."""
        for lane in list(self._engines):
            self.start(lane, now)

    def stale(self, token: tuple) -> bool:
        """True if the event ``token`` was superseded."""
        lane, version = token
        return self._engines[lane].version != version

    def fire(self, token: tuple, now: float) -> tuple[Copy | None, Lane]:
        """The event ``token`` is due: the running copy ended (returned, its engine now idle: the caller
        reports it, then calls ``start``), or its slice did and another stream's copy took over (None)."""
        lane, _ = token
        engine = self._engines[lane]
        op = engine.running
        assert op is not None
        left = self._left[op] - (now - engine.since) * engine.speed
        if left <= 1e-12 * max(1.0, now):
            del self._left[op], self._lane[op]
            engine.running = None
            engine.version += 1
            return op, lane
        self._left[op] = left  # the slice ended with another stream waiting: set it aside
        engine.waiting.append(op)
        nxt = engine.waiting.popleft()
        engine.owner, engine.granted = (nxt.client, nxt.stream), now
        self._run(lane, engine, nxt, now)
        return None, lane

    def cancel(self, op: Copy) -> bool | None:
        """``op``'s client is torn down: stop it in flight or take it out of its queue.

        Returns:
            True if it was in flight (stopped; the caller calls ``start_all``), False if it was queued
            (dropped), None if it is not here (not yet eligible).
        """
        lane = self._lane.pop(op, None)
        if lane is None:
            return None
        self._left.pop(op, None)
        engine = self._engines[lane]
        if engine.running is op:
            engine.running = None
            engine.owner = None
            engine.version += 1
            return True  # start_all paces the other direction
        engine.waiting.remove(op)
        return False

    def _run(self, lane: Lane, engine: _Engine, op: Copy, now: float) -> None:
        if op not in self._left:
            op.started = now
            self._left[op] = self._spec.copy_latency + op.nbytes / self._spec.pcie_bandwidth
        engine.running, engine.since = op, now
        engine.speed = self._speed(lane)
        self._plan(lane, engine, now)
        self._pace(self._partner(lane), now)

    @staticmethod
    def _partner(lane: Lane) -> Lane:
        return ("d2h" if lane[0] == "h2d" else "h2d", lane[1])

    def _speed(self, lane: Lane) -> float:
        """The fraction of its bandwidth ``lane``'s engine gets now: less while the other direction runs."""
        partner = self._engines.get(self._partner(lane))
        return self._duplex.get(lane[0], 1.0) if partner is not None and partner.running is not None else 1.0

    def _pace(self, lane: Lane, now: float) -> None:
        """The other direction started or stopped: if ``lane``'s copy changes speed, account what it did at the
        old one and plan its end at the new."""
        engine = self._engines.get(lane)
        if engine is None or engine.running is None:
            return
        speed = self._speed(lane)
        if speed != engine.speed:
            self._left[engine.running] -= (now - engine.since) * engine.speed
            engine.since, engine.speed = now, speed
            self._plan(lane, engine, now)

    def _plan(self, lane: Lane, engine: _Engine, now: float) -> None:
        """Schedule the engine's next event: its copy's end, or the end of the slice it runs in if another
        stream waits and that comes first."""
        assert engine.running is not None
        at = engine.since + self._left[engine.running] / engine.speed
        quantum = self._spec.copy_timeslice
        if engine.waiting and quantum > 0.0:
            slices = max(1, math.ceil((now - engine.granted) / quantum - 1e-9))
            at = min(at, engine.granted + slices * quantum)
        engine.version += 1
        self._schedule(at, (lane, engine.version))
