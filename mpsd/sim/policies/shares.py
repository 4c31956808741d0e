# Policies that share the GPU among clients block by block: round-robin, strict priority (with aging) and
# weighted fair share. They differ only in which client is offered the next block, so the turn-taking
# machinery (per-client queues in hardware order, "serve one block", "only one client left: serve it all")
# lives here once. All three are work-conserving: a client that cannot place a block now drops out of this
# dispatch and the others go on, so capacity is never left idle while a fitting block waits (aging aside).
"""The ``round-robin``, ``priority`` and ``fair`` policies."""

from __future__ import annotations

import heapq
import math
from typing import Any, ClassVar

from ..sms import Group
from .base import ClientConfig, KernelRun, Policy

__all__ = ["FairPolicy", "PriorityPolicy", "RoundRobinPolicy"]


def client_queues(runs: list[KernelRun]) -> dict[int, list[KernelRun]]:
    """Ready kernels by client, each client's in hardware order (stream priority, eligibility, launch);
    ``runs`` is in that order already (the engine keeps its ready list so)."""
    queues: dict[int, list[KernelRun]] = {}
    for run in runs:
        queues.setdefault(run.kernel.client, []).append(run)
    return queues


def serve_one(sim, queue: list[KernelRun]) -> bool:
    """Place one block of the client's first kernel that has room; False if none has."""
    for run in queue:
        if run.unplaced and sim._place(run, 1):
            return True
    return False


def serve_all(sim, queue: list[KernelRun]) -> bool:
    """Place everything of one client that fits, kernels in order; False if nothing fitted."""
    placed = 0
    for run in queue:
        if run.unplaced:
            placed += sim._place(run, run.unplaced)
    return placed > 0


def take_turns(sim, queues: dict[int, list[KernelRun]], after: int | None) -> int | None:
    """Clients place one block each in rotation (ascending id, starting after ``after``) until none can.

    Returns:
        The last client that placed a block (``after`` if none did).
    """
    # Once every shape of the ready kernels is full (sim._queue.saturated), no client can place anything
    # more in this dispatch: the rounds left would all fail and change nothing, so they are skipped.
    if not sim._queue.open_keys():
        return after
    clients = sorted(queues)
    if after is not None:
        cut = next((i for i, c in enumerate(clients) if c > after), len(clients))
        clients = clients[cut:] + clients[:cut]
    last = after
    saturated = sim._queue.saturated
    while len(clients) > 1:
        still = []
        for c in clients:
            if saturated():
                return last
            if serve_one(sim, queues[c]):
                still.append(c)
                last = c
        clients = still
    if clients and serve_all(sim, queues[clients[0]]):
        last = clients[0]
    return last


class RoundRobinPolicy(Policy):
    """Clients take turns at block granularity.

    When capacity frees, clients with ready work are offered one block each in rotation (ascending client
    id, resuming after the last client served, across dispatches); within a client, kernels go in hardware
    order. SM caps hold as under ``mps``.
    """

    name = "round-robin"

    def __init__(self, sim, options=None) -> None:
        super().__init__(sim, options)
        self._last: int | None = None

    def dispatch(self, ready: list[KernelRun]) -> None:
        """Offer capacity block by block to clients in rotation."""
        self._last = take_turns(self.sim, client_queues(ready), self._last)


class PriorityPolicy(Policy):
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
        self._last: dict[int, int | None] = {}  # level -> last client served at that level

    def dispatch(self, ready: list[KernelRun]) -> None:
        """Serve aged kernels first (holding the line), then levels in order, round-robin within each."""
        sim = self.sim
        if self._aging is not None:
            horizon = sim.now - self._aging
            aged = sorted((r for r in ready if r.eligible <= horizon), key=lambda r: (r.eligible, r.kernel.seq))
            for run in aged:
                if not sim._place(run, run.unplaced) and run.unplaced:
                    return  # hold the line for the oldest starving kernel
        levels: dict[int, list[KernelRun]] = {}
        for run in ready:
            if run.unplaced:
                levels.setdefault(sim.client_config(run.kernel.client).priority, []).append(run)
        for level in sorted(levels):
            self._last[level] = take_turns(sim, client_queues(levels[level]), self._last.get(level))


class FairPolicy(Policy):
    """Weighted fair share of SM-time, work-conserving.

    Each client's service is the SM-time its blocks have held (a block's duration times its share of an
    SM's threads), charged at placement with the block's nominal duration and corrected to the real one when
    it leaves. Capacity goes one block at a time to the client with the least service / weight among those
    with ready work (ties: lowest client id); a client that cannot place a block drops out and the rest go
    on. A client that joins after being idle (no blocks resident, no work waiting) starts level with the
    least-served active client rather than with its old total, so a newcomer cannot monopolise the GPU to
    catch up for time it did not ask for.
    """

    name = "fair"

    def __init__(self, sim, options=None) -> None:
        super().__init__(sim, options)
        self._service: dict[int, float] = {}
        self._resident: dict[int, int] = {}  # client -> blocks resident
        self._waiting: set[int] = set()  # clients left with unplaced work after the last dispatch
        # client -> its configured weight, the value sim.client_config(c).weight gives (configure() sees
        # every configuration first), kept here because dispatch asks for every client every time.
        self._weights: dict[int, float] = {}

    def configure(self, client: int, config: ClientConfig) -> None:
        """Remember the client's weight."""
        self._weights[client] = config.weight

    def service(self, client: int) -> float:
        """SM-seconds charged to ``client`` so far (nominal for blocks still resident)."""
        return self._service.get(client, 0.0)

    # A block's share of an SM's threads is ``run.sm_share``, min(1, threads / max_threads_per_sm), which
    # the engine computed once per launch shape: the very same float as computing it here per group.

    def placed(self, group: Group) -> None:
        """Charge the group's nominal SM-time."""
        run = group.run
        c = run.kernel.client
        self._service[c] = self._service.get(c, 0.0) + group.count * group.planned * run.sm_share
        self._resident[c] = self._resident.get(c, 0) + group.count

    def vacated(self, group: Group) -> None:
        """Replace the nominal charge by the time the group really held its SM."""
        run = group.run
        c = run.kernel.client
        held = group.end - group.start
        self._service[c] += group.count * (held - group.planned) * run.sm_share
        self._resident[c] -= group.count

    def dispatch(self, ready: list[KernelRun]) -> None:
        """Offer each block to the least-served client (by service / weight) that can place one."""
        # The same steps as reading service() and client_config(c).weight each time, with the dicts read
        # directly (a default weight is DEFAULT_CLIENT's 1.0) and serve_one inlined: this loop runs once
        # per block placed.
        sim = self.sim
        service = self._service
        weights = self._weights
        resident = self._resident
        waiting = self._waiting
        queues = client_queues(ready)
        weight = {c: weights.get(c, 1.0) for c in queues}
        active = [c for c, n in resident.items() if n] + [c for c in waiting if c in queues]
        if active:
            floor = min(service.get(c, 0.0) / weights.get(c, 1.0) for c in active)
            for c in queues:
                if not resident.get(c) and c not in waiting:
                    service[c] = max(service.get(c, 0.0), floor * weight[c])
        heap = [(service.get(c, 0.0) / weight[c], c) for c in queues]
        heapq.heapify(heap)
        saturated = sim._queue.saturated
        place = sim._place
        pop, push = heapq.heappop, heapq.heappush
        while len(heap) > 1 and not saturated():  # saturated: nobody could place a block
            _, c = pop(heap)
            for run in queues[c]:  # serve_one
                if run.unplaced and place(run, 1):
                    push(heap, (service[c] / weight[c], c))  # placed() has charged it
                    break
        if heap:
            serve_all(sim, queues[heap[0][1]])
        self._waiting = {c for c, q in queues.items() if any(r.unplaced for r in q)}
