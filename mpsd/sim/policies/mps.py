# The hardware-faithful policy, alone in its module because every other policy is measured against it and
# the fidelity tables pin its behaviour: it must not change when the others do. Its dispatch is compiled
# (simcore/src/policy.rs: Mps and place_in_launch_order).
"""The ``mps`` policy: what a real GPU under MPS does."""

from __future__ import annotations

from .base import BuiltinPolicy

__all__ = ["MpsPolicy"]


class MpsPolicy(BuiltinPolicy):
    """Hardware-faithful MPS: no preemption, stream priorities, launch order, SM caps.

    Kernels are served by (stream priority, time they became eligible, submission order), whatever their
    client; each places as many blocks as fit and later kernels back-fill what is left. Client priority and
    weight are ignored (on a real H200, CUDA_MPS_CLIENT_PRIORITY=1 made no measurable difference). A pass
    offers capacity only to kernels whose (block shape, SM window) still has room and ends once none has:
    the result of offering every kernel in turn.
    """

    name = "mps"
