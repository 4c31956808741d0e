# Policies where one client (context) holds the whole GPU at a time: exclusive-process compute mode and
# time-slicing without MPS. Both must know which clients have work in flight, which the hardware order of
# ready kernels cannot tell (a kernel paying its launch overhead is not ready yet, but its client is still
# busy), so they count eligible, unfinished kernels per client through the engine's hooks. Time-slicing adds
# timers (slice ends, context switches) and preemption, both done by the engine on the policy's request. The
# dispatch is compiled (simcore/src/tenancy.rs); these classes check the options and say what it does.
"""The ``exclusive`` and ``timeslice`` policies."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from .base import BuiltinPolicy

__all__ = ["ExclusivePolicy", "TimeslicePolicy"]


class ExclusivePolicy(BuiltinPolicy):
    """Exclusive-process compute mode: one client's kernels at a time, never preempted.

    The owner keeps the GPU while it has kernels eligible and unfinished (back-to-back kernels of a stream
    keep it); then it passes to the client whose oldest eligible kernel is oldest (ties: launch order).
    Inside the owner, kernels go in hardware order. SM caps hold.
    """

    name = "exclusive"
    dispatch_when_idle = True


class TimeslicePolicy(BuiltinPolicy):
    """Time-slicing without MPS: one context owns the GPU for a timeslice at a time.

    The owner's kernels run as under ``mps`` (launch order inside the client, SM caps). When its slice ends
    and another client has work in flight, its resident blocks are preempted (they resume later with the
    work they had left; blocks that wait on the clock, like ``spin``, with their deadline: see
    ``BlockCost.clocked``) and, after a context switch during which the GPU runs nothing, the next client in
    rotation (ascending id after the owner) gets a slice. With nobody waiting the owner's slice is renewed.
    An owner that runs out of work hands over at once. Handing the GPU back to the context that last held it
    costs nothing.

    What a switch costs grows with the state it saves and restores. With ``h`` the share of the device's
    warp slots a context's preempted blocks hold, ``state`` gives, at a few values of ``h``, what a switch
    costs more (``extra(h)``) and what the slice runs less (``loss(h)``), interpolated linearly from 0 at
    ``h = 0``. A switch from a context that left ``h_out`` to one that left ``h_in`` costs
    ``switch + (extra(h_out) + extra(h_in)) / 2``, and the incoming context's slice is
    ``timeslice - loss(h_in)``.

    Options:
        timeslice: seconds per slice of a context that holds next to nothing (default 2.0854 ms).
        switch: seconds a switch between two such contexts leaves the GPU idle (default 164.3 us).
        state: (h, extra seconds, loss seconds) points, h ascending in (0, 1] (default: at 0.25, 0.5 and 1,
            extra 8.1, 25.2 and 69.0 us, loss 5.6, 16.8 and 37.9 us); () for costs that ignore the state.

    The defaults are what a real H200 showed without MPS (bench/fidelity/h200_timing_slices.json; ``python
    bench/fidelity/compare.py --calibration`` derives them): two processes each ran one 200-ms kernel of 1,
    8, 66, 132 or 264 blocks of 1024 threads that logged the jumps of the GPU's globaltimer, the times its
    context was switched out. The run between two jumps is the slice; a jump is the other context's slice
    and two switches. With 1 or 8 blocks the slice was 2.085 ms and a switch 164 us; with 264 blocks (every
    warp slot) 2.047 ms and 233 us. A 264-block context beside a 1-block one, and three 1-block contexts,
    are predicted by these figures (``compare.py``'s "slices" rows).
    """

    name = "timeslice"
    options: ClassVar[dict[str, Any]] = {
        "timeslice": 2.0854e-3, "switch": 164.3e-6,
        "state": ((0.25, 8.1e-6, 5.6e-6), (0.5, 25.2e-6, 16.8e-6), (1.0, 69.0e-6, 37.9e-6))}
    dispatch_when_idle = True

    def __init__(self, sim, options=None) -> None:
        super().__init__(sim, options)
        for key, zero_ok in (("timeslice", False), ("switch", True)):
            v = self.settings[key]
            if not (isinstance(v, (int, float)) and (v > 0.0 or (zero_ok and v == 0.0)) and v < math.inf):
                raise ValueError(f"{key} must be seconds {'>= 0' if zero_ok else '> 0'}, got {v!r}")
        self._slice = float(self.settings["timeslice"])
        self._switch = float(self.settings["switch"])
        self._state = self._state_points(self.settings["state"], self._slice)
        self._warp_slots = sim.spec.sm_count * (sim.spec.max_threads_per_sm // sim.spec.warp_size)

    @property
    def switches(self) -> int:
        """Context switches so far (the compiled engine counts them)."""
        switches = self.sim._core.policy_counter("switches")
        assert switches is not None  # (the time-slicing engine keeps this counter)
        return switches

    def engine_args(self) -> object:
        """(timeslice, switch, state points, warp slots of the device)."""
        return (self._slice, self._switch, self._state, self._warp_slots)

    @staticmethod
    def _state_points(points: Any, timeslice: float) -> list[tuple[float, float, float]]:
        try:
            out = [(float(h), float(extra), float(loss)) for h, extra, loss in points]
        except (TypeError, ValueError):
            raise ValueError(f"state must be (h, extra seconds, loss seconds) points, got {points!r}") from None
        last = 0.0
        for h, extra, loss in out:
            if not (last < h <= 1.0 and 0.0 <= extra < math.inf and 0.0 <= loss < timeslice):
                raise ValueError(f"state: h must ascend in (0, 1] and costs be seconds >= 0 (loss below the "
                                 f"timeslice), got {points!r}")
            last = h
        return out
