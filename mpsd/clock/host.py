# What a tenant's CUDA calls cost on its host thread, for the answers that run without real processes
# (`mpsd simulate`, mpsd-stress --virtual-time, bench/fidelity). A real H200 showed the cost depends on how long
# the thread stayed away from the driver: a launch and synchronise back to back took about 11 us, the same
# after a 5-ms sleep about 60 us, and in between it grows over a millisecond or two, whether the thread slept
# or spun, and whether the GPU was idle or busy with another process (bench/fidelity/h200_timing_host.json,
# "1 tenant alone"; beside a saturating tenant the launch calls after a sleep were still as slow). So the
# model keeps a warmth per thread that decays with idle time, and one thread's calls happen one after another.
# It lives beside the device's clock (mpsd.clock), not inside the simulator: it prices a host's calls, not the
# device's work; its figures are the DeviceSpec's.
"""Host-side latency of a tenant's launch and synchronise calls."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpsd.sim import DeviceSpec

__all__ = ["HostThread"]


@dataclass
class HostThread:
    """One tenant thread's CUDA calls, in the order it makes them.

    A launch call made ``idle`` seconds after the thread's previous call returned costs
    ``launch_latency - (launch_latency - launch_latency_busy) * w`` with ``w = exp(-idle / host_cooling)``
    (1 back to back, 0 long after), and its work reaches the device when it returns; the synchronise that
    follows costs the same mix of ``sync_latency`` and ``sync_latency_busy``. A spec without a cooling time
    has one host latency, its idle figures.

    Attributes:
        spec: the device (its host figures).
        free: when the thread's last call returned (-inf before its first).
        warmth: ``w`` of its last launch.
    """

    spec: DeviceSpec
    free: float = -math.inf
    warmth: float = 0.0

    def _warmth(self, start: float) -> float:
        cooling = self.spec.host_cooling
        return math.exp(-(start - self.free) / cooling) if cooling > 0.0 and self.free > -math.inf else 0.0

    def launch(self, at: float, scale: float = 1.0) -> float:
        """A launch called at ``at`` (or as the previous call returns, if later): when its work reaches the
        device. A call that costs ``scale`` times a kernel launch's (a copy's: ``DeviceSpec.copy_calls``)
        warms and cools the thread the same way."""
        start = max(at, self.free)
        w = self.warmth = self._warmth(start)
        spec = self.spec
        self.free = start + scale * (spec.launch_latency - (spec.launch_latency - spec.launch_latency_busy) * w)
        return self.free

    def sync_latency(self, warmth: float | None = None) -> float:
        """From the end of the work to the return of a synchronise on it, after a launch of ``warmth`` (by
        default the last launch's)."""
        spec = self.spec
        w = self.warmth if warmth is None else warmth
        return spec.sync_latency - (spec.sync_latency - spec.sync_latency_busy) * w

    def synchronize(self, ended: float, at: float = -math.inf) -> float:
        """A synchronise on work that ends at ``ended``, called at ``at`` (or as the last call returned, if
        later): when it returns (the thread waits in the driver, so the next call counts its idle time from
        then)."""
        self.free = max(self.free, at, ended) + self.sync_latency()
        return self.free

    def call(self, at: float, cost: float) -> float:
        """Any other call, made at ``at`` (or as the previous call returns, if later), that takes ``cost``
        seconds of the thread's time: when it returns."""
        self.free = max(at, self.free) + cost
        return self.free
