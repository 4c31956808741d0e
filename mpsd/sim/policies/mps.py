# The hardware-faithful policy, alone in its module because every other policy is measured against it and
# the fidelity tables pin its behaviour: it must not change when the others do.
"""The ``mps`` policy: what a real GPU under MPS does."""

from __future__ import annotations

from .base import KernelRun, Policy

__all__ = ["MpsPolicy"]


class MpsPolicy(Policy):
    """Hardware-faithful MPS: no preemption, stream priorities, launch order, SM caps.

    Kernels are served by (stream priority, time they became eligible, submission order), whatever their
    client; each places as many blocks as fit and later kernels back-fill what is left. Client priority and
    weight are ignored (on a real H200, CUDA_MPS_CLIENT_PRIORITY=1 made no measurable difference).
    """

    name = "mps"

    def dispatch(self, ready: list[KernelRun]) -> None:
        """Place every ready kernel's blocks in launch order, as far as they fit."""
        # A kernel whose (shape, window) has no room would place nothing, so only the others are offered
        # capacity, and the pass ends once every shape is full: the result is the same as offering
        # every kernel in turn, without walking a long queue of kernels that cannot start.
        sim = self.sim
        place = sim._place
        if len(ready) == 1:  # a lone kernel (the daemon's common case): nothing to skip
            place(ready[0], ready[0].unplaced)
            return
        open_keys = sim._queue.open_keys()
        if not open_keys:
            return
        for run in ready:  # already in hardware order
            if run.key in open_keys and place(run, run.unplaced):
                sim._queue.close_keys(open_keys)
                if not open_keys:
                    return
