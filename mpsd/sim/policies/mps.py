# The hardware-faithful policy, alone in its module because every other policy is measured against it and
# the fidelity tables pin its behaviour: it must not change when the others do.
"""The ``mps`` policy: what a real GPU under MPS does."""

from __future__ import annotations

from .base import KernelRun, Policy, place_in_launch_order

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
        place_in_launch_order(self.sim, ready)
