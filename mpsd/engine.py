# The engine drives one device's simulator against trio's clock: simulated seconds = wall seconds since the
# engine started × time_scale. It is the only place where simulated time meets real time. Completed ops
# come back in simulated order; each op's tag (a callback set by its context) applies the op's effect on
# the bytes, then whoever waits on the op is woken.
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Iterable

import trio

from mpsd.sim import Op, Simulator

log = logging.getLogger("mpsd.engine")
# Instants of simulated time processed before the engine lets other tasks run. When the model falls behind
# the wall clock (huge grids of tiny blocks), simulated time lags instead of the daemon going deaf.
MAX_INSTANTS_PER_STEP = 16


class Engine:
    """Runs `sim` in real time, scaled.

    Args:
        sim: the device's simulator.
        time_scale: simulated seconds per wall second (0.5: the GPU runs at half speed).
    """

    def __init__(self, sim: Simulator, time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise ValueError("time_scale must be positive")
        self.sim = sim
        self.time_scale = time_scale
        self._origin: float | None = None
        self._wake = trio.Event()
        self._waiters: dict[Op, trio.Event] = {}
        # The furthest simulated time has fallen behind the clock (seconds of simulated time): the model
        # could not keep up with the work given (huge grids of short blocks), so completions came late.
        self.max_lag = 0.0

    def sim_now(self) -> float:
        """The simulated time that corresponds to now."""
        if self._origin is None:
            return self.sim.now
        return max(self.sim.now, (trio.current_time() - self._origin) * self.time_scale)

    def monotonic_origin(self) -> float:
        """``time.monotonic()`` at simulated time 0 (trio's clock has an offset of its own)."""
        now = trio.current_time()
        origin = now if self._origin is None else self._origin
        return time.monotonic() - (now - origin)

    def catch_up(self) -> None:
        """Bring the simulator up to now, or as far towards it as one step goes, and finish whatever
        completed meanwhile."""
        target = self.sim_now()
        for op in self.sim.advance(target, MAX_INSTANTS_PER_STEP):
            self._finish(op)
        if self.sim.now < target:
            self._wake.set()  # behind: the run loop comes back after letting other tasks in
            self.max_lag = max(self.max_lag, target - self.sim.now)

    def submit(self, op: Op) -> None:
        """Hand `op` to the simulator at the current time.

        Raises:
            ValueError: the simulator refused it (a kernel that cannot fit on an SM, say).
        """
        self.catch_up()
        self.sim.submit(op)
        self._wake.set()

    async def wait(self, op: Op) -> None:
        """Return once `op` has completed, or its client's work was cancelled."""
        if op.done:
            return
        event = self._waiters.get(op)
        if event is None:
            event = self._waiters[op] = trio.Event()
        await event.wait()

    async def wait_all(self, ops: Iterable[Op | None]) -> None:
        for op in ops:
            if op is not None:
                await self.wait(op)

    def cancel(self, client: int) -> None:
        """Tear down a client's work (queued dropped, running evicted) and wake everyone waiting on it."""
        self.catch_up()  # the teardown happens now, not at the simulator's last instant
        self.sim.cancel(client)
        for op in [op for op in self._waiters if op.client == client]:
            self._waiters.pop(op).set()
        self._wake.set()  # the freed SMs go to the others now: the run loop must dispatch and re-plan its wait

    def _finish(self, op: Op) -> None:
        callback: Callable[[Op], None] | None = op.tag  # type: ignore[assignment]
        if callback is not None:
            try:
                callback(op)
            except Exception:  # an effect must never take the engine down with it
                log.exception("completion of %r failed", op)
        event = self._waiters.pop(op, None)
        if event is not None:
            event.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Drive the simulator until cancelled."""
        self._origin = trio.current_time() - self.sim.now / self.time_scale
        task_status.started()
        while True:
            next_time = self.sim.next_time()
            deadline = math.inf if next_time is None else self._origin + next_time / self.time_scale
            with trio.move_on_at(deadline):
                await self._wake.wait()
            self._wake = trio.Event()
            self.catch_up()
