# The engine drives one device's clock (mpsd.clock.DeviceClock, the one owner of its simulated time, shared with
# the backend) in one of two ways, as SimPy's RealtimeEnvironment is a way of running an Environment. Under the
# wall clock (`Engine`), simulated seconds = wall seconds since the engine started x time_scale: the only place
# where simulated time meets real time. Under the virtual clock (`VirtualEngine`), simulated time never follows
# the wall: it moves as the clients' calls, stamped with their own simulated host clocks, let it
# (mpsd.clock.virtual), and jumps from event to event while every client waits. Either way completed ops come
# back in simulated order; each op's tag (a callback set by its context) applies the op's effect on the bytes,
# then whoever waits on the op is told. Work (submitting, cancelling) goes to the simulator; time, only through
# the clock.
from __future__ import annotations

import logging
import math
import sys
import time
from typing import Callable, Iterable

import trio

from mpsd.backends.base import when_all
from mpsd.clock import HOLDING, DeviceClock, Host, VirtualClock
from mpsd.sim import BlockCost, Op

log = logging.getLogger("mpsd.backends.engine")
# Instants of simulated time processed before the engine lets other tasks run. When the model falls behind
# the wall clock (huge grids of tiny blocks), simulated time lags instead of the daemon going deaf.
MAX_INSTANTS_PER_STEP = 16
# Calls and instants the virtual clock applies before the engine lets other tasks run.
MAX_VIRTUAL_STEPS = 64
TIMER_STEP = 1e-3  # what a trio timer may oversleep by, under epoll
DEFAULT_IDLE_GRACE = 0.5  # wall seconds of silence after which a holding client counts as idle


class Engine:
    """Runs a device in real time, scaled.

    Args:
        device_clock: the device's clock (its simulator is `device_clock.sim`), shared with the backend.
        time_scale: simulated seconds per wall second (0.5: the GPU runs at half speed).
    """

    def __init__(self, device_clock: DeviceClock, time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise ValueError("time_scale must be positive")
        self.device_clock = device_clock
        self.sim = device_clock.sim
        self.time_scale = time_scale
        self._origin: float | None = None
        self._clock: trio.abc.Clock | None = None  # set with _origin, by run
        self._wake = trio.Event()
        self._waiters: dict[Op, list[Callable[[], None]]] = {}
        # The furthest simulated time has fallen behind the clock (seconds of simulated time): the model
        # could not keep up with the work given (huge grids of short blocks), so completions came late; or
        # the daemon could not keep up with its clients, so work was submitted well after its call arrived.
        self.max_lag = 0.0
        # trio time the calls being served were read (a session says so before serving each): the work they
        # queue is submitted at that simulated time, so calls read together reach the device together,
        # rather than spread out by however long the daemon takes over each one. None: now.
        self.arrival: float | None = None

    def sim_now(self) -> float:
        """The simulated time that corresponds to now."""
        if self._origin is None:
            return self.device_clock.now
        return max(self.device_clock.now, (trio.current_time() - self._origin) * self.time_scale)

    def monotonic_origin(self) -> float:
        """``time.monotonic()`` at simulated time 0 (trio's clock has an offset of its own)."""
        now = trio.current_time()
        origin = now if self._origin is None else self._origin
        return time.monotonic() - (now - origin)

    def catch_up(self, due: float | None = None) -> None:
        """Bring the simulator up to now (or to `due`, if later), or as far towards it as one step goes, and
        finish whatever completed meanwhile."""
        self._advance_to(self.sim_now() if due is None else max(due, self.sim_now()))

    def _advance_to(self, target: float) -> None:
        device = self.device_clock
        now = device.now
        for op in device.advance(target if target > now else now, MAX_INSTANTS_PER_STEP):
            self._finish(op)
        now = device.now
        if now < target:
            self._wake.set()  # behind: the run loop comes back after letting other tasks in
            self.max_lag = max(self.max_lag, target - now)

    def submit(self, op: Op) -> None:
        """Hand `op` to the simulator at the time its call arrived (or later, where the simulator is past it:
        simulated time never goes back); the time from arrival to submission counts as lag.

        Raises:
            ValueError: the simulator refused it (a kernel that cannot fit on an SM, say).
        """
        self._arrive()
        self.sim.submit(op)

    def launch(self, client: int, stream: tuple[int, int], after: tuple, blocks: int, threads: int,
               cost: BlockCost, smem: int, priority: int, sm_cap: int | None, count: int = 1,
               regs: int = 32) -> object:
        """`submit` for `count` kernels given by plain values (`Simulator.launch`): the last one's handle."""
        self._arrive()
        return self.sim.launch(client, stream, after, blocks, threads, cost, smem, priority, sm_cap, regs,
                               count=count)

    def _arrive(self) -> None:
        """Bring the simulator to the time the call being served arrived, count how late it is served as lag,
        and wake the run loop for the work about to be submitted."""
        device, origin = self.device_clock, self._origin
        before = device.now
        if origin is None:
            arrived = now = before
        else:
            # trio.current_time(), less two calls
            # (an origin comes with the clock)
            wall = (self._clock.current_time() - origin) * self.time_scale  # type: ignore[union-attr]
            now = wall if wall > before else before
            arrived = now if self.arrival is None else min(now, (self.arrival - origin) * self.time_scale)
        # Calls read together arrive together: after the first, the simulator is already there, and advancing
        # to where it is does nothing unless something is due at this very instant (an op completed at submit).
        if arrived > before or ((due := device.next_time()) is not None and due <= before):
            self._advance_to(arrived)
            before = device.now
        lag = now - before
        if lag > self.max_lag:
            self.max_lag = lag
        self._wake.set()  # the run loop runs only once this task yields: after the submit

    def when_done(self, ops: Iterable[Op | None], callback: Callable[[], None]) -> None:
        """Call `callback` (now, if they are) once every op of `ops` has completed or was cancelled."""
        pending = [op for op in ops if op is not None and not op.done]
        if pending and not self._waiters:
            self._wake.set()  # the run loop waits for the next event more closely while someone waits (run)
        when_all(pending, lambda op, told: self._waiters.setdefault(op, []).append(told), callback)

    def cancel(self, client: int) -> None:
        """Tear down a client's work (queued dropped, running evicted) and wake everyone waiting on it."""
        self.catch_up()  # the teardown happens now, not at the simulator's last instant
        for op in self.sim.cancel(client):
            op.tag = None  # its effect (and the bytes a staged copy holds) goes now, whoever still sees the op
        for op in [op for op in self._waiters if op.client == client]:
            _tell(self._waiters.pop(op))
        self._wake.set()  # the freed SMs go to the others now: the run loop must dispatch and re-plan its wait

    def forget(self, client: int) -> None:
        """A client has detached: the simulator keeps nothing about it (its work was cancelled already)."""
        self.catch_up()
        self.sim.forget_client(client)

    def _finish(self, op: Op) -> None:
        # (the engine's ops are tagged with their callbacks)
        callback: Callable[[Op], None] | None = op.tag  # type: ignore[assignment]
        if callback is not None:
            op.tag = None  # an effect applies once; what it holds (a staged copy's bytes) goes now
            try:
                callback(op)
            except Exception:  # an effect must never take the engine down with it
                log.exception("completion of %r failed", op)
        waiters = self._waiters.pop(op, None)
        if waiters is not None:
            _tell(waiters)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Drive the simulator until cancelled."""
        self._clock = trio.lowlevel.current_clock()  # trio's clock for this run (a test's MockClock, say)
        self._origin = self._clock.current_time() - self.device_clock.now / self.time_scale
        task_status.started()
        # trio's timers are whole milliseconds under epoll (a timeout rounds up): on the real clock, while
        # someone waits for work, the engine waits with one to within a millisecond of the next event, then
        # spins to it (letting the other tasks run), so that a completion is told when it is due, not up to a
        # millisecond after.
        # A MockClock exists only where trio.testing was imported; the daemon itself does not import it (with
        # pytest installed, trio.testing imports pytest: a tenth of a second of every daemon's start).
        testing = sys.modules.get("trio.testing")
        real = testing is None or not isinstance(self._clock, testing.MockClock)
        while True:
            next_time = self.device_clock.next_time()
            deadline = math.inf if next_time is None else self._origin + next_time / self.time_scale
            spin = TIMER_STEP if real and self._waiters else 0.0
            with trio.move_on_at(deadline - spin) as waited:
                await self._wake.wait()
            due = waited.cancelled_caught
            if due and spin:
                while not self._wake.is_set() and trio.current_time() < deadline:
                    await trio.lowlevel.checkpoint()
                due = not self._wake.is_set()
            self._wake = trio.Event()
            # Woken by the deadline: the next event is due, even where rounding (origin + t / scale, and back)
            # puts the clock a hair short of it. Under a clock that stands still while we loop (trio's
            # MockClock, in tests) we would otherwise spin at that instant for ever.
            self.catch_up(next_time if due else None)


class VirtualEngine(Engine):
    """Runs a device under the virtual clock: simulated time advances only as the clients' stamped calls allow.

    Args:
        device_clock: the device's clock (its simulator is `device_clock.sim`), shared with the backend.
        idle_grace: wall seconds a holding client may stay silent before it counts as idle (so that one
            blocked on something outside mpsd cannot stall the others).
        on_idle: told of each client that went idle that way.
    """

    def __init__(self, device_clock: DeviceClock, idle_grace: float = DEFAULT_IDLE_GRACE,
                 on_idle: Callable[[Host], None] = lambda host: None) -> None:
        super().__init__(device_clock, 1.0)
        if not idle_grace > 0:
            raise ValueError("idle_grace must be positive")
        self.clock = VirtualClock(device_clock, self._finish_all)
        self.idle_grace = idle_grace
        self._on_idle = on_idle

    def sim_now(self) -> float:
        return self.device_clock.now

    def monotonic_origin(self) -> float:
        return math.nan  # simulated time has no fixed relation to the host's clock

    def catch_up(self, due: float | None = None) -> None:
        """Nothing to do: the clock is the clients', and work is applied in their order (see run)."""

    def submit(self, op: Op) -> None:
        """Hand `op` to the simulator at the current simulated time (the clock is applying its call).

        Raises:
            ValueError: the simulator refused it.
        """
        self.sim.submit(op)

    def launch(self, client: int, stream: tuple[int, int], after: tuple, blocks: int, threads: int,
               cost: BlockCost, smem: int, priority: int, sm_cap: int | None, count: int = 1,
               regs: int = 32) -> object:
        return self.sim.launch(client, stream, after, blocks, threads, cost, smem, priority, sm_cap, regs,
                               count=count)

    def cancel(self, client: int) -> None:
        super().cancel(client)
        self._finish_all(self.device_clock.advance(self.device_clock.now))

    def heard(self, host: Host) -> None:
        """`host` called (or was answered) just now: its idle grace starts again, and the clock may move."""
        clock = self._clock  # trio.current_time(), less two calls, once run has started
        host.since = clock.current_time() if clock is not None else trio.current_time()
        self._wake.set()

    def leaving(self, host: Host) -> None:
        """`host`'s client is being torn down (in pieces, between which other tasks run): it holds the clock at
        the device's now, however long that takes in wall time, until it leaves the clock. No call stamped
        later is applied before the teardown is over, so in simulated time it is one instant, as it was when
        it was one step of the daemon's; at that instant, calls of clients with lower ids go first, as ties go."""
        self.clock.hold(host, self.device_clock.now)
        host.since = math.inf  # never counted idle

    def _finish_all(self, ops: list[Op]) -> None:
        for op in ops:
            self._finish(op)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply the clients' calls and the device's events in simulated-time order until cancelled."""
        self._clock = trio.lowlevel.current_clock()
        task_status.started()
        clock = self.clock
        while True:
            if clock.pump(MAX_VIRTUAL_STEPS):
                await trio.lowlevel.checkpoint()
                continue
            blocker = clock.blocker()
            deadline = math.inf if blocker is None else blocker.since + self.idle_grace
            if deadline <= trio.current_time():
                assert blocker is not None and blocker.state == HOLDING
                clock.idle(blocker)
                self._on_idle(blocker)
                continue
            with trio.move_on_at(deadline):
                await self._wake.wait()
            self._wake = trio.Event()


def _tell(waiters: list[Callable[[], None]]) -> None:
    for waiter in waiters:
        try:
            waiter()
        except Exception:  # one waiter's failure must not keep the others from being told
            log.exception("a waiter of a completed op failed")
