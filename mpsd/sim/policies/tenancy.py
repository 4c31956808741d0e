# Policies where one client (context) holds the whole GPU at a time: exclusive-process compute mode and
# time-slicing without MPS. Both must know which clients have work in flight, which the hardware order of
# ready kernels cannot tell (a kernel paying its launch overhead is not ready yet, but its client is still
# busy), so they count eligible, unfinished kernels per client through the engine's hooks. Time-slicing adds
# timers (slice ends, context switches) and preemption, both done by the engine on the policy's request.
"""The ``exclusive`` and ``timeslice`` policies."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from .base import KernelRun, Policy

__all__ = ["ExclusivePolicy", "TimeslicePolicy"]


class _Tenancy(Policy):
    """Tracks each client's eligible, unfinished kernels; places only the owner's."""

    dispatch_when_idle = True

    def __init__(self, sim, options=None) -> None:
        super().__init__(sim, options)
        self._live: dict[int, dict[KernelRun, float]] = {}  # client -> its live runs (ordered set)
        self.owner: int | None = None

    def eligible(self, run: KernelRun) -> None:
        """Count ``run`` as its client's work in flight."""
        self._live.setdefault(run.kernel.client, {})[run] = run.eligible

    def retired(self, run: KernelRun) -> None:
        """``run`` is over."""
        live = self._live.get(run.kernel.client)
        if live is not None:
            live.pop(run, None)
            if not live:
                del self._live[run.kernel.client]

    def busy(self, client: int | None) -> bool:
        """True if ``client`` has eligible kernels not yet finished."""
        return client in self._live

    def _place_owner(self, ready: list[KernelRun]) -> None:
        place = self.sim._place
        owner = self.owner
        for run in ready:  # already in hardware order
            if run.kernel.client == owner:
                place(run, run.unplaced)


class ExclusivePolicy(_Tenancy):
    """Exclusive-process compute mode: one client's kernels at a time, never preempted.

    The owner keeps the GPU while it has kernels eligible and unfinished (back-to-back kernels of a stream
    keep it); then it passes to the client whose oldest eligible kernel is oldest (ties: launch order).
    Inside the owner, kernels go in hardware order. SM caps hold.
    """

    name = "exclusive"

    def dispatch(self, ready: list[KernelRun]) -> None:
        """Hand the GPU on if the owner is done, then place the owner's kernels."""
        if not self.busy(self.owner):
            self.owner = None
            oldest = [min((r.eligible, r.kernel.seq) for r in runs) + (c,) for c, runs in self._live.items()]
            if oldest:
                self.owner = min(oldest)[2]
        if self.owner is not None:
            self._place_owner(ready)


class TimeslicePolicy(_Tenancy):
    """Time-slicing without MPS: one context owns the GPU for a timeslice at a time.

    The owner's kernels run as under ``mps`` (launch order inside the client, SM caps). When its slice ends
    and another client has work in flight, its resident blocks are preempted (they resume later with the
    work they had left; blocks that wait on the clock, like ``spin``, with their deadline: see
    ``BlockCost.clocked``) and, after a context switch during which the GPU runs nothing, the next client in
    rotation (ascending id after the owner) gets a slice. With nobody waiting the owner's slice is renewed.
    An owner that runs out of work hands over at once. Changing context costs ``switch``; handing the GPU
    back to the context that last held it costs nothing.

    Options:
        timeslice: seconds per slice (default 2.05 ms).
        switch: seconds a context switch leaves the GPU idle (default 227 us).

    Both defaults are what a real H200 showed without MPS (bench/fidelity/h200_timing_repeat.json, rows
    "gaps, 2 tenants" and "gaps, 3 tenants"; ``bench/fidelity/compare.py --calibration`` derives them): each
    process ran one 100-ms kernel that logged the jumps of the GPU's globaltimer, the times its context was
    switched out. The median run between two jumps is the slice (2.050 ms); a jump is every other context's
    slice plus one switch into each, which leaves 227 us a switch, the same from 2 and from 3 processes.
    """

    name = "timeslice"
    options: ClassVar[dict[str, Any]] = {"timeslice": 2.05e-3, "switch": 227e-6}

    def __init__(self, sim, options=None) -> None:
        super().__init__(sim, options)
        for key, zero_ok in (("timeslice", False), ("switch", True)):
            v = self.settings[key]
            if not (isinstance(v, (int, float)) and (v > 0.0 or (zero_ok and v == 0.0)) and v < math.inf):
                raise ValueError(f"{key} must be seconds {'>= 0' if zero_ok else '> 0'}, got {v!r}")
        self._slice = float(self.settings["timeslice"])
        self._switch = float(self.settings["switch"])
        self._resident: int | None = None  # the context loaded on the GPU (the last owner)
        self._incoming: int | None = None  # being switched in
        self._epoch = 0  # timers of older epochs are stale
        self.switches = 0

    def timer_stale(self, token: object) -> bool:
        """Only the latest slice-end or switch-end timer counts."""
        return token != self._epoch

    def _next(self) -> int | None:
        clients = sorted(self._live)
        if not clients:
            return None
        after = self._resident
        return next((c for c in clients if after is None or c > after), clients[0])

    def _hand_over(self) -> None:
        """The owner is gone: start switching to the next client, or take it on at once if it is resident."""
        self.owner = None
        self._epoch += 1
        nxt = self._next()
        if nxt is None:
            return
        if self._resident is None or nxt == self._resident or self._switch == 0.0:
            self._grant(nxt)
        else:
            self._incoming = nxt
            self.switches += 1
            self.sim._set_timer(self.sim.now + self._switch, self._epoch)

    def _grant(self, client: int) -> None:
        self.owner = self._resident = client
        self._incoming = None
        self._epoch += 1
        self.sim._set_timer(self.sim.now + self._slice, self._epoch)

    def on_timer(self, token: object) -> None:
        """A switch completed, or the owner's slice ended."""
        if self._incoming is not None:
            self._grant(self._incoming)
        elif any(c != self.owner for c in self._live):
            self.sim._preempt(self.owner)
            self._hand_over()
        else:
            self._epoch += 1
            self.sim._set_timer(self.sim.now + self._slice, self._epoch)

    def dispatch(self, ready: list[KernelRun]) -> None:
        """Hand over if the owner has run out of work; place the owner's kernels."""
        if self._incoming is not None:
            return
        if self.owner is None or not self.busy(self.owner):
            self._hand_over()
        if self.owner is not None:
            self._place_owner(ready)
