# Policies that share the GPU among clients block by block: round-robin, strict priority (with aging) and
# weighted fair share. They differ only in which client is offered the next block, so the turn-taking
# machinery (per-client queues in hardware order, "serve one block", "only one client left: serve it all")
# lives here once. All three are work-conserving: a client that cannot place a block now drops out of this
# dispatch and the others go on, so capacity is never left idle while a fitting block waits (aging aside).
# A dispatch comes at every instant that frees capacity and usually places one block or two, so what it
# derives from the ready list (Turns: queues by client, clients by key) is kept until the list changes, and
# only clients with a kernel of a shape that has room are asked: the others would decline and change nothing.
"""The ``round-robin``, ``priority`` and ``fair`` policies."""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from itertools import chain
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


class Turns:
    """Ready kernels as turn-taking reads them: by client, the clients in ascending order, and which clients
    have kernels of each key.

    Capacity frees far more often than the ready list changes (``ReadyQueue.version``), so a policy builds
    this once per version rather than once per dispatch.

    Args:
        runs: ready kernels in hardware order, all with blocks unplaced.
    """

    def __init__(self, runs: list[KernelRun]) -> None:
        self.queues = client_queues(runs)
        self.clients = sorted(self.queues)
        self._by_key: dict[int, set[int]] = {}
        for run in runs:
            self._by_key.setdefault(run.key, set()).add(run.kernel.client)

    def able(self, open_keys: set[int]) -> set[int]:
        """The clients with a kernel of one of ``open_keys``: a client without one cannot place a block in
        this dispatch, since keys filed full stay full until it ends (do not modify the set)."""
        sets = [self._by_key[k] for k in open_keys if k in self._by_key]
        if len(sets) == 1:
            return sets[0]
        return set().union(*sets)


def serve_one(sim, queue: list[KernelRun], open_keys: set[int]) -> bool:
    """Place one block of the client's first kernel that has room; False if none has.

    A kernel whose key is filed full would place nothing, so it is not asked. A placement that takes the
    last room of its key files the keys now full at once (``close_keys``), so ``saturated`` turns true as
    soon as that was the last open one; other keys it filled are filed when next asked, as ``_place`` does.
    """
    full = sim._queue.full
    for run in queue:
        if run.unplaced and run.key not in full and sim._place(run, 1):
            if not sim._fit_index.rooms[run.key]:
                sim._queue.close_keys(open_keys)
            return True
    return False


def serve_all(sim, queue: list[KernelRun]) -> bool:
    """Place everything of one client that fits, kernels in order; False if nothing fitted."""
    placed = 0
    for run in queue:
        if run.unplaced:
            placed += sim._place(run, run.unplaced)
    return placed > 0


def take_turns(sim, turns: Turns, after: int | None) -> int | None:
    """Clients place one block each in rotation (ascending id, starting after ``after``) until none can.

    Returns:
        The last client that placed a block (``after`` if none did).
    """
    # Once every shape of the ready kernels is full (sim._queue.saturated), no client can place anything
    # more in this dispatch: the rounds left would all fail and change nothing, so they are skipped.
    queue = sim._queue
    open_keys = queue.open_keys()
    if not open_keys:
        return after
    clients = turns.clients
    last = after
    queues = turns.queues
    if len(clients) > 1:
        # The first round goes round every client, starting after ``after``; one with no kernel of an open
        # key would drop out of it without placing anything, so it is not asked. The rounds after it go
        # round those that placed, while two or more did.
        able = turns.able(open_keys)
        cut = 0 if after is None else bisect_right(clients, after)
        rotation = (c for c in chain(clients[cut:], clients[:cut]) if c in able)
        while True:
            still = []
            for c in rotation:
                if queue.saturated():
                    return last
                if serve_one(sim, queues[c], open_keys):
                    still.append(c)
                    last = c
            rotation = clients = still
            if len(clients) <= 1:
                break
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
        self._turns: Turns | None = None
        self._version = -1  # the ready list's version _turns was built from

    def dispatch(self, ready: list[KernelRun]) -> None:
        """Offer capacity block by block to clients in rotation."""
        version = self.sim._queue.version
        if self._turns is None or version != self._version:
            self._turns, self._version = Turns(ready), version
        self._last = take_turns(self.sim, self._turns, self._last)


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
        # Derived from the ready list, rebuilt when its version changes (or a client's level may have).
        self._version = -1
        self._levels: list[tuple[int, Turns]] = []  # (level, its clients' ready kernels), most urgent first
        self._by_age: list[KernelRun] = []  # the ready kernels by (eligible, launch), with aging only

    def configure(self, client: int, config: ClientConfig) -> None:
        """The client's level may change: rebuild the levels at the next dispatch."""
        self._version = -1

    def _levels_of(self, runs: list[KernelRun]) -> list[tuple[int, Turns]]:
        """The levels of the kernels of ``runs`` with blocks unplaced, most urgent first."""
        levels: dict[int, list[KernelRun]] = {}
        for run in runs:
            if run.unplaced:
                levels.setdefault(self.sim.client_config(run.kernel.client).priority, []).append(run)
        return [(level, Turns(levels[level])) for level in sorted(levels)]

    def dispatch(self, ready: list[KernelRun]) -> None:
        """Serve aged kernels first (holding the line), then levels in order, round-robin within each."""
        sim = self.sim
        queue = sim._queue
        if queue.version != self._version:
            self._version = queue.version
            self._levels = self._levels_of(ready)
            if self._aging is not None:
                self._by_age = sorted(ready, key=lambda r: (r.eligible, r.kernel.seq))
        levels = self._levels
        if self._aging is not None:
            horizon = sim.now - self._aging
            for run in self._by_age:
                if run.eligible > horizon:
                    break  # the rest are younger
                if not sim._place(run, run.unplaced) and run.unplaced:
                    return  # hold the line for the oldest starving kernel
            if queue.drained:  # an aged kernel placed its last block: its client may have no work left
                levels = self._levels_of(ready)
        for level, turns in levels:
            if queue.saturated():  # every level after would place nothing, its last client unchanged
                break
            self._last[level] = take_turns(sim, turns, self._last.get(level))


class FairPolicy(Policy):
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

    def __init__(self, sim, options=None) -> None:
        super().__init__(sim, options)
        self._service: dict[int, float] = {}
        self._resident: dict[int, int] = {}  # client -> blocks resident
        self._waiting: set[int] = set()  # clients left with unplaced work after the last dispatch
        # client -> its configured weight, the value sim.client_config(c).weight gives (configure() sees
        # every configuration first), kept here because dispatch asks for every client every time.
        self._weights: dict[int, float] = {}
        # Derived from the ready list, rebuilt when its version changes (or a weight does).
        self._version = -1
        self._turns = Turns([])
        self._weight: dict[int, float] = {}  # the weights of the clients with ready work
        self._everyone: set[int] = set()  # the clients with ready work (do not modify: _waiting may be it)
        # client -> (service / weight, client), its place in the queue for blocks, brought up to date at
        # the start of each dispatch for the clients whose service moved since (those in _moved): a
        # dispatch reads it for every client that could place a block, and a wave ending or being placed
        # moves a few clients' service hundreds of times.
        self._rank: dict[int, tuple[float, int]] = {}
        self._moved: set[int] = set()
        self._live: dict[int, set[KernelRun]] = {}  # client -> its eligible, unfinished kernels
        self._idle_since: dict[int, float] = {}  # client -> when its last live kernel ended
        self._joining: set[int] = set()  # clients whose work began after an idle while: newcomers

    def eligible(self, run: KernelRun) -> None:
        """A kernel of the client is in flight; if it had none for a while, the client is joining."""
        c = run.kernel.client
        live = self._live.setdefault(c, set())
        if not live and self._idle_since.get(c, -math.inf) < self.sim.now:
            self._joining.add(c)
        live.add(run)

    def retired(self, run: KernelRun) -> None:
        """The kernel is over (or cancelled)."""
        c = run.kernel.client
        live = self._live.get(c)
        if live is not None and run in live:
            live.discard(run)
            if not live:
                self._idle_since[c] = self.sim.now

    def configure(self, client: int, config: ClientConfig) -> None:
        """Remember the client's weight."""
        self._weights[client] = config.weight
        self._moved.add(client)
        self._version = -1

    def forget(self, client: int) -> None:
        """Its service, weight and idle time go: it has no work left (the engine cancelled it first)."""
        for table in (self._service, self._resident, self._weights, self._rank, self._live, self._idle_since):
            table.pop(client, None)
        self._moved.discard(client)
        self._joining.discard(client)
        self._version = -1

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
        self._moved.add(c)
        self._resident[c] = self._resident.get(c, 0) + group.count

    def vacated(self, group: Group) -> None:
        """Replace the nominal charge by the time the group really held its SM."""
        run = group.run
        c = run.kernel.client
        held = group.end - group.start
        self._service[c] += group.count * (held - group.planned) * run.sm_share
        self._moved.add(c)
        self._resident[c] -= group.count

    def dispatch(self, ready: list[KernelRun]) -> None:
        """Offer each block to the least-served client (by service / weight) that can place one."""
        queue = self.sim._queue
        if self._moved:
            for c in self._moved:
                self._rank[c] = (self._service.get(c, 0.0) / self._weights.get(c, 1.0), c)
            self._moved.clear()
        if queue.version != self._version:
            self._version = queue.version
            self._turns = Turns(ready)
            self._weight = {c: self._weights.get(c, 1.0) for c in self._turns.queues}
            self._everyone = set(self._turns.queues)
            self._level_newcomers()
            rank = self._rank
            for c, w in self._weight.items():
                if c not in rank:  # never charged
                    rank[c] = (self._service.get(c, 0.0) / w, c)
        open_keys = queue.open_keys()
        if open_keys:
            self._offer(open_keys)
        if queue.drained:  # a client may have placed its last block
            self._waiting = {c for c, q in self._turns.queues.items() if any(r.unplaced for r in q)}
        else:  # every client with ready work still has all of it (it is the ready list's, so: everyone)
            self._waiting = self._everyone

    def _level_newcomers(self) -> None:
        """Start each newcomer level with the least-served active client.

        Only a change of the ready list can bring one: when the list is as it was at the last dispatch,
        every client in it was left waiting by that dispatch.
        """
        service = self._service
        resident = self._resident
        waiting = self._waiting
        queues = self._turns.queues
        newcomers = [c for c in queues if c in self._joining]
        if not newcomers:
            return
        self._joining.difference_update(newcomers)
        active = [c for c, n in resident.items() if n] + [c for c in waiting if c in queues]
        if active:
            floor = min(service.get(c, 0.0) / self._weights.get(c, 1.0) for c in active)
            for c in newcomers:
                w = self._weight[c]
                service[c] = max(service.get(c, 0.0), floor * w)
                self._rank[c] = (service[c] / w, c)

    def _offer(self, open_keys: set[int]) -> None:
        """Offer blocks one at a time to the least-served client that can place one, until one client is
        left (it then places all it can) or everything is full.

        Only the clients with a kernel of an open key can place a block in this dispatch. The others
        ("stuck") matter only as they would leave the queue of clients: one by one as each reaches its
        head, changing nothing, since their service does not move. So while two or more clients that may
        place are left, the least served of them takes the block; with one left, it takes blocks one at a
        time until its service passes the most-served stuck client's (all the stuck have left by then),
        and then takes everything that fits.
        """
        # serve_one is inlined in the loop below, which runs once per block placed.
        sim = self.sim
        place = sim._place
        full = sim._queue.full
        close_keys = sim._queue.close_keys
        rooms = sim._fit_index.rooms
        saturated = sim._queue.saturated
        rank = self._rank
        service = self._service
        weight = self._weight
        turns = self._turns
        queues = turns.queues
        able = turns.able(open_keys)
        heap = [rank[c] for c in able]
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        stuck = None  # rank of the most-served stuck client; () if none
        while heap and not saturated():  # saturated: nobody could place a block
            if len(heap) == 1:
                if stuck is None:
                    stuck = max((rank[c] for c in turns.clients if c not in able), default=())
                if heap[0] > stuck:
                    serve_all(sim, queues[heap[0][1]])
                    return
            _, c = pop(heap)
            for run in queues[c]:
                if run.unplaced and run.key not in full and place(run, 1):
                    if not rooms[run.key]:
                        close_keys(open_keys)
                    push(heap, (service[c] / weight[c], c))  # placed() has charged it
                    break
