# Copy engines: one FIFO per (engine, lane), a lane being a set of copy engines (the device's one set, or a
# MIG partition's own). Copies never share an SM with blocks, so their bookkeeping is apart from the
# engine's: this module decides only which copy runs on a lane and for how long; the engine owns the
# events, the counters and what a finished copy releases in stream order.
"""Copy engines: FIFO lanes of copies and their durations."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .ops import Copy
from .specs import DeviceSpec

__all__ = ["CopyEngines"]

Lane = tuple[str, int]


class CopyEngines:
    """The copies queued or in flight, one FIFO per lane, one copy at a time per lane.

    Args:
        spec: the device (bandwidths, fixed latency).
        schedule: called as ``schedule(end_time, copy)`` when a copy starts; the engine turns it into
            an event.
    """

    def __init__(self, spec: DeviceSpec, schedule: Callable[[float, Copy], None]) -> None:
        self._spec = spec
        self._schedule = schedule
        self._queues: dict[Lane, deque[Copy]] = {}  # lane -> FIFO
        self._busy: dict[Lane, Copy | None] = {}
        self._lane: dict[Copy, Lane] = {}  # copies queued or in flight -> their FIFO
        self._stopped: set[Copy] = set()  # copies of cancelled clients stopped in flight

    def enqueue(self, op: Copy, lane: Lane, now: float) -> None:
        """Queue ``op`` on ``lane`` and start it if the lane is idle."""
        self._lane[op] = lane
        queue = self._queues.get(lane)
        if queue is None:
            queue = self._queues[lane] = deque()
            self._busy[lane] = None
        queue.append(op)
        self.start(lane, now)

    def start(self, lane: Lane, now: float) -> None:
        """Start the head of ``lane``'s FIFO if nothing runs there."""
        queue = self._queues[lane]
        if self._busy[lane] is not None or not queue:
            return
        op = queue.popleft()
        self._busy[lane] = op
        op.started = now
        spec = self._spec
        bandwidth = spec.mem_bandwidth / 2 if op.engine == "d2d" else spec.pcie_bandwidth
        self._schedule(now + spec.copy_latency + op.nbytes / bandwidth, op)

    def start_all(self, now: float) -> None:
        """Start every idle lane's head (after a cancel emptied some)."""
        for lane in list(self._queues):
            self.start(lane, now)

    def end(self, op: Copy) -> Lane:
        """``op``'s end event came: free its lane (the caller starts the next one after reporting ``op``).

        Returns:
            The lane it ran on.
        """
        lane = self._lane.pop(op)
        self._busy[lane] = None
        return lane

    def stopped(self, op: Copy) -> bool:
        """True if ``op`` was stopped in flight by a cancel (its end event is void)."""
        return op in self._stopped

    def cancel(self, op: Copy) -> bool | None:
        """``op``'s client is torn down: stop it in flight or take it out of its FIFO.

        Returns:
            True if it was in flight (stopped), False if it was queued (dropped), None if it is not here
            (not yet eligible).
        """
        lane = self._lane.pop(op, None)
        if lane is None:
            return None
        if self._busy[lane] is op:
            self._busy[lane] = None
            self._stopped.add(op)
            return True
        self._queues[lane].remove(op)
        return False
