# One owner of simulated time, as SimPy's Environment is: a device's DeviceClock, which the virtual clock, the
# engines that drive the device (mpsd.backends.engine) and its backend share, and beside it the host model that
# prices a client's calls on its own simulated host clock. Out of the simulator (mpsd.sim): the simulator models
# the device's work; when that work reaches it, and what a host's calls cost, are the clock's. Pure: no I/O, no
# wall clock, no trio; mpsd.sim only for its types.
"""mpsd.clock: a device's simulated time, the virtual clock over it, and what a host's calls cost."""

from .device import DeviceClock
from .host import HostThread
from .virtual import CALL, HOLDING, IDLE, LAUNCH, SYNC, WAITING, Host, Timing, VirtualClock

__all__ = [
    "CALL",
    "HOLDING",
    "IDLE",
    "LAUNCH",
    "SYNC",
    "WAITING",
    "DeviceClock",
    "Host",
    "HostThread",
    "Timing",
    "VirtualClock",
]
