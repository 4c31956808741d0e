# A device's simulated time has one owner, as a SimPy Environment owns its `now`: this object. The simulator's
# compiled engine keeps the instant, since it orders its own events by it, but nothing reads or moves it except
# through here: the virtual clock (mpsd.clock.virtual), the engines that drive the device under the wall or the
# virtual clock (mpsd.backends.engine) and the backend that owns them (mpsd.backends.sim) share one DeviceClock,
# and the host model beside it (mpsd.clock.host) prices its host threads' calls by the same device's figures.
# How time advances, with the wall or as fast as the work allows, is the driver's; this holds no policy of its
# own. Pure: no I/O, no wall clock, no trio.
"""A device's simulated time: where it stands, what is due next, moving it on."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Callable

from .host import HostThread

if TYPE_CHECKING:
    from mpsd.sim import DeviceSpec, Op, Simulator

__all__ = ["DeviceClock"]


class DeviceClock:
    """Simulated time on one device.

    Args:
        sim: the device's simulator, whose engine keeps the instant and orders the events at it.

    Attributes:
        sim: that simulator, for the work the drivers hand it (submitting, cancelling): never for time.
        spec: the device's figures, the host model's among them.
        next_time: ``() -> float | None``, the next instant something happens on the device (now, if
            completions wait to be told), or None while nothing runs or waits on time.
        advance: ``(until, limit=None) -> list[Op]``, move the device on to ``until``, or through ``limit``
            instants if it gets there first: the ops that completed, in completion order, for the caller to
            tell whoever waits on them. Raises ValueError for a time before now (or NaN): simulated time never
            goes back.
    """

    __slots__ = ("_engine", "advance", "next_time", "sim", "spec")

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.spec: DeviceSpec = sim.spec
        # The simulator's own methods, bound once: both drivers call them at every step, and a method of ours
        # around each would cost a frame there for nothing.
        self.next_time: Callable[[], float | None] = sim.next_time
        self.advance: Callable[..., list[Op]] = sim.advance
        self._engine = sim._core  # the compiled engine, which keeps the instant (read by `now`)

    # The compiled engine's instant, read in C with no frame of ours (Simulator.now is the same value through one
    # more): the wall clock's driver reads it several times a launch, the virtual clock at every step.
    now = property(operator.attrgetter("_engine.now"), doc="The device's simulated now, in seconds.")

    def host_thread(self) -> HostThread:
        """A host thread whose calls cost what this device's figures say (the virtual clock's hosts)."""
        return HostThread(self.spec)
