# A policy answers two questions, and nothing else: in what order do dispatchable kernels get freed
# capacity, and on which SMs do a kernel's blocks go. The engine owns time, events and bookkeeping, so a
# new policy (round-robin, fair, ...) is one small class registered in POLICIES.
"""Dispatch policies: the hardware-faithful ``mps`` policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from .ops import Kernel
from .specs import BlockNeed

__all__ = ["POLICIES", "KernelRun", "MpsPolicy", "make_policy"]


@dataclass(eq=False, slots=True)
class KernelRun:
    """The engine's state of one submitted kernel.

    Attributes:
        kernel: the op.
        need: resources one of its blocks takes.
        eligible: when it became eligible (head of stream, dependencies done).
        unplaced: blocks not yet placed on an SM.
        running: blocks resident now.
        cancelled: its client was cancelled; place nothing more, report nothing.
        groups: its block groups resident now (so a cancelled client's blocks can be evicted).
    """

    kernel: Kernel
    need: BlockNeed
    eligible: float = 0.0
    unplaced: int = 0
    running: int = 0
    cancelled: bool = False
    groups: set = field(default_factory=set)  # its groups resident now


class MpsPolicy:
    """Hardware-faithful MPS: no preemption, stream priorities, launch order, SM caps.

    Kernels are served by (stream priority, time they became eligible, submission order); each places as
    many blocks as fit and later kernels back-fill what is left. Blocks go to the SM with the most room
    for one more block of that kernel (ties: lowest SM index), one block at a time, so a grid spreads
    over the GPU before it stacks. A client never occupies more than its kernel's ``sm_cap`` distinct SMs.
    """

    name = "mps"

    def order(self, runs: list[KernelRun]) -> list[KernelRun]:
        """Dispatchable kernels in the order they are offered capacity.

        Args:
            runs: kernels that have unplaced blocks and are past their launch overhead.

        Returns:
            The same runs, most deserving first.
        """
        return sorted(runs, key=lambda r: (r.kernel.priority, r.eligible, r.kernel.seq))

    def place(self, run: KernelRun, fits: list[int], occupied: dict[int, int]) -> list[tuple[int, int]]:
        """Choose SMs for as many of ``run``'s unplaced blocks as fit now.

        Greedy one-block-at-a-time placement on the SM with the largest remaining fit (ties by lowest
        index) is computed in rounds: at level L every allowed SM whose fit is at least L takes one block,
        in index order, for L from the largest fit down to 1.

        Args:
            run: the kernel.
            fits: how many of its blocks fit on each SM now, by SM index.
            occupied: SM index -> resident blocks of this kernel's client.

        Returns:
            (SM index, block count) pairs, by SM index; the caller reserves the resources.
        """
        top = max(fits)
        if top == 0:
            return []
        left = run.unplaced
        cap = run.kernel.sm_cap
        budget = len(fits) if cap is None else cap - len(occupied)
        if left == 1 and budget > 0:  # the common small kernel: the first SM with the most room
            return [(fits.index(top), 1)]
        return self._place_rounds(fits, top, left, budget, occupied)

    @staticmethod
    def _place_rounds(fits: list[int], top: int, left: int, budget: int,
                      occupied: dict[int, int]) -> list[tuple[int, int]]:
        taken = [0] * len(fits)
        for level in range(top, 0, -1):
            for i, f in enumerate(fits):
                if f < level:
                    continue
                if not taken[i] and i not in occupied:
                    if budget <= 0:
                        continue
                    budget -= 1
                taken[i] += 1
                left -= 1
                if not left:
                    break
            if not left:
                break
        return [(i, n) for i, n in enumerate(taken) if n]


POLICIES = {"mps": MpsPolicy}


def make_policy(name: str) -> MpsPolicy:
    """Build the named policy.

    Raises:
        ValueError: unknown policy name.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
