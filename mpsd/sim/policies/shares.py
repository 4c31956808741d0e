# Policies that share the GPU among clients block by block: round-robin, strict priority (with aging) and
# weighted fair share. They differ only in which client is offered the next block, so the turn-taking
# machinery (per-client queues in hardware order, "serve one block", "only one client left: serve it all")
# is written once, in the compiled engine (simcore/src/shares.rs), whose comments say why its shortcuts are
# exact. All three are work-conserving: a client that cannot place a block now drops out of this dispatch and
# the others go on, so capacity is never left idle while a fitting block waits (aging aside).
"""The ``round-robin``, ``priority`` and ``fair`` policies."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from .base import BuiltinPolicy

__all__ = ["FairPolicy", "PriorityPolicy", "RoundRobinPolicy"]


class RoundRobinPolicy(BuiltinPolicy):
    """Clients take turns at block granularity.

    When capacity frees, clients with ready work are offered one block each in rotation (ascending client
    id, resuming after the last client served, across dispatches); within a client, kernels go in hardware
    order. SM caps hold as under ``mps``.
    """

    name = "round-robin"


class PriorityPolicy(BuiltinPolicy):
    """Strict client priority, round-robin within a level, optional aging.

    A client's level is its ``ClientConfig.priority`` (lower is more urgent). All ready work of the most
    urgent level is offered capacity before any of the next, clients of one level taking turns block by
    block. With ``aging`` set (seconds), a kernel that has been eligible that long is served before every
    level, oldest first; while the oldest such kernel cannot place a block, nothing else is placed, so the
    capacity freed drains to it and low priority is never starved forever (the price: the GPU is not
    work-conserving during that wait).

    Options:
        aging: seconds after which a waiting kernel is served as if most urgent; None (default) never.
    """

    name = "priority"
    options: ClassVar[dict[str, Any]] = {"aging": None}

    def __init__(self, sim, options=None) -> None:
        super().__init__(sim, options)
        aging = self.settings["aging"]
        if aging is not None and not (isinstance(aging, (int, float)) and 0.0 <= aging < math.inf):
            raise ValueError(f"aging must be None or seconds >= 0, got {aging!r}")
        self._aging = aging

    def engine_args(self) -> object:
        """The aging horizon in seconds, or None."""
        return None if self._aging is None else float(self._aging)


class FairPolicy(BuiltinPolicy):
    """Weighted fair share of SM-time, work-conserving.

    Each client's service is the SM-time its blocks have held (a block's duration times its share of an
    SM's threads), charged at placement with the block's nominal duration and corrected to the real one when
    it leaves. Capacity goes one block at a time to the client with the least service / weight among those
    with ready work (ties: lowest client id); a client that cannot place a block drops out and the rest go
    on. A client that joins after being idle (for a while, no kernel of it eligible and unfinished) starts
    level with the least-served active client rather than with its old total, so a newcomer cannot
    monopolise the GPU to catch up for time it did not ask for. A stream of dependent kernels is not idle
    between them: the next becomes eligible the instant the last ends, though it pays its launch overhead
    before it is ready.
    """

    name = "fair"
