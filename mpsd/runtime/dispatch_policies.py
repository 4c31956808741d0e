# The kernel-level policies: which client's work the dispatcher (mpsd.runtime.dispatch) releases next. A policy
# sees the clients with a releasable head and room under the bound (`ready`), and the dispatcher itself for the
# rest (every tenant, the device's clock, whether a kernel has `room_for` it beside the work released); it
# returns one of `ready`, or None to hold them all until the next arrival or completion. The shipped policies
# release a kernel only where it fits (priority excepted for the most urgent work), so that the device queues no
# blocks that are not running and each choice is made when room opens, not when work arrives. These act on whole
# kernels, not blocks: a kernel released runs on the device's own block scheduler beside the others (the
# simulator's `mps` policy, or a GPU's hardware), and stream priorities still order the blocks there. The
# simulator's block-level policies of the same names (mpsd.sim.policies) model schedulers that could preempt or
# place blocks; these are what a daemon in front of a real GPU can do.
"""Kernel-level scheduling policies."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from mpsd.plugins import load

if TYPE_CHECKING:
    from mpsd.runtime.dispatch import Dispatcher, Tenant

__all__ = ["KERNEL_POLICIES", "KernelPolicy", "kernel_policy"]


class KernelPolicy:
    """The interface, and pass-through in arrival order. A policy of one's own subclasses it (``module:Class``
    to `--policy` with `--dispatch kernel`) and overrides `pick`, and `joined` or `ended` where it keeps state."""

    name = "fifo"
    # Whether a pick made while kernels run is the one the policy would make once they have ended, so that the
    # dispatcher may release it early, to wait on the device behind them (Dispatcher._choose). Not where the
    # choice depends on what the running kernels will have taken (fair's device time).
    ahead = True
    # Whether such work waits on the device at a gate too (Backend.gate), closed while `holds` says the policy
    # would hold it back: where what comes meanwhile may change the pick. Without a gate from the backend (the
    # simulator needs none) the policy does not look ahead.
    gate = False

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f"the {self.name} policy takes no options ({', '.join(sorted(options))} given)")

    def joined(self, tenant: Tenant, dispatcher: Dispatcher) -> None:
        """A client was first seen."""

    def ended(self, tenant: Tenant, dispatcher: Dispatcher) -> None:
        """Work of `tenant` released earlier has ended (or was cancelled)."""

    def bounded(self, tenant: Tenant, dispatcher: Dispatcher) -> bool:
        """Whether `tenant` is held to the bound on kernels in flight now (it is, unless a policy says not)."""
        return True

    def spread(self, tenant: Tenant, dispatcher: Dispatcher) -> bool:
        """Whether `tenant`'s kernels count one SM a block where the dispatcher counts the SMs they hold (for
        `room_for`), rather than as many blocks to an SM as fit: work that others may have to wait for is then
        released at one block to an SM, so that none of its blocks runs at half speed beside another."""
        return False

    def holds(self, tenant: Tenant, dispatcher: Dispatcher) -> bool:
        """Whether `tenant`'s work released ahead behind a gate is to wait at it now (with `gate`)."""
        return False

    def pick(self, dispatcher: Dispatcher, ready: list[Tenant]) -> Tenant | None:
        """The client whose head goes next, from `ready` (never empty), or None to hold all of them."""
        first = min(ready, key=lambda t: t.head().seq)  # type: ignore[union-attr]  # (a ready tenant has a head)
        return first if dispatcher.room_for(first) else None


class Priority(KernelPolicy):
    """The most urgent work first, by client priority, then stream priority (CUDA's: lower is more urgent), then
    arrival. Less urgent work is held while more urgent work waits here, so that urgent work waits at most for
    the kernels already on the device, which the device's stream priorities then let it overtake block by
    block.

    Args:
        aging: seconds after which held work is released as if most urgent (as the simulator's block-level
            policy ages a waiting kernel); None (default) never.
        ahead: less urgent work that fills the device is released while the work before it runs, to wait on the
            device behind it and at its client's gate (`KernelPolicy.gate`), where the backend gives gates (a
            real GPU). Off by default: on the H200 it took DISB-C's best-effort throughput from 761 to 920
            req/s, but two GPU tests of it failed or hung (bench/fidelity/h200_dec04/summary.txt).
    """

    name = "priority"
    # Ahead only with `ahead`, and behind a gate: less urgent work released to wait on the device would otherwise
    # start in the gap between two kernels of urgent work that came meanwhile (the next is not yet eligible when
    # the first ends), where the daemon would have held it until the urgent work had ended.
    ahead = False
    gate = True

    def __init__(self, aging: float | None = None, ahead: bool = False, **options: Any) -> None:
        super().__init__(**options)
        if aging is not None and not (isinstance(aging, (int, float)) and 0.0 <= aging < math.inf):
            raise ValueError(f"aging must be a finite number of seconds >= 0, not {aging!r}")
        if not isinstance(ahead, bool):
            raise ValueError(f"ahead must be true or false, not {ahead!r}")
        self.aging = aging
        self.ahead = ahead
        self._seen = -1  # the dispatcher's version `_most` is of
        # client -> (its stamp, its urgency, since when it holds work): computed again only when it changes or ages
        self._levels: dict[int, tuple[int, tuple[float, float], float]] = {}
        self._most = self._held = (math.inf, math.inf)

    def _level(self, tenant: Tenant, dispatcher: Dispatcher) -> tuple[float, float]:
        """`tenant`'s urgency, computed once for each state of the client (six clients' decisions took 400 us
        of the daemon's time a kernel, and the H200 sat idle meanwhile)."""
        if self._seen != dispatcher.version:
            self._update(dispatcher)
        return self._levels[tenant.id][1]

    def _update(self, dispatcher: Dispatcher) -> None:
        levels, aging = self._levels, self.aging
        now = dispatcher.inner.now() if aging is not None else 0.0
        tenants = dispatcher.tenants
        for gone in [c for c in levels if c not in tenants]:  # (a client that left, another come meanwhile)
            del levels[gone]
        for t in tenants.values():
            cached = levels.get(t.id)
            if cached is not None and cached[0] == t.stamp and (aging is None or now - cached[2] < aging):
                continue
            since = t.waiting_since() if aging is not None else math.inf
            aged = aging is not None and now - since >= aging
            levels[t.id] = (t.stamp, (-math.inf, -math.inf) if aged else t.urgency(), since)
        self._most = min((level for _, level, _ in levels.values()), default=(math.inf, math.inf))
        # The most urgent of the work held (work held only for an event another client has yet to record holds
        # no one back).
        self._held = min((levels[t.id][1] for t in tenants.values() if t.head() is not None),
                         default=(math.inf, math.inf))
        self._seen = dispatcher.version

    def bounded(self, tenant: Tenant, dispatcher: Dispatcher) -> bool:
        """The most urgent work is not bounded: nothing it could hold back is more urgent, and each kernel of a
        request held until the one before has ended would add the time the device takes to say so."""
        return self._level(tenant, dispatcher) > self._most

    def spread(self, tenant: Tenant, dispatcher: Dispatcher) -> bool:
        """Less urgent work goes one block to an SM: urgent work that comes waits for the blocks on the device,
        and two blocks sharing an SM each take about twice as long as one alone."""
        return self.bounded(tenant, dispatcher)

    def holds(self, tenant: Tenant, dispatcher: Dispatcher) -> bool:
        """While more urgent work is held or on the device: it then starts once that has ended, as it would
        have, held in the daemon."""
        if self._seen != dispatcher.version:
            self._update(dispatcher)
        levels = self._levels
        mine = levels[tenant.id][1]
        return any(levels[t.id][1] < mine and (t.queued or t.in_flight) for t in dispatcher.tenants.values())

    def pick(self, dispatcher: Dispatcher, ready: list[Tenant]) -> Tenant | None:
        if self._seen != dispatcher.version:
            self._update(dispatcher)
        levels = self._levels
        # (a ready tenant has a head)
        order = sorted(ready, key=lambda t: (levels[t.id][1], t.head().seq))  # type: ignore[union-attr]
        urgency = levels[order[0].id][1]
        if urgency <= self._most:
            return order[0]  # the most urgent work goes at once: the device's stream priorities put it first there
        # Less urgent work goes only where nothing more urgent is held, and only to SMs left free, so that what is
        # more urgent, when it comes, waits for no block that has not started.
        if urgency > self._held:
            return None
        # The oldest of the equally urgent that fits: one at its cap holds back none as urgent as itself.
        for t in order:
            if levels[t.id][1] != urgency:
                break
            if dispatcher.room_for(t):
                return t
        return None


class RoundRobin(KernelPolicy):
    """One kernel of each client with work, in turn."""

    name = "round-robin"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._last = -1

    def pick(self, dispatcher: Dispatcher, ready: list[Tenant]) -> Tenant | None:
        after = [t for t in ready if t.id > self._last]
        chosen = min(after or ready, key=lambda t: t.id)
        if not dispatcher.room_for(chosen):
            return None  # its turn waits for room
        self._last = chosen.id
        return chosen


class Fair(KernelPolicy):
    """The client with the least device time for its weight goes next (device time from its work's completion
    times). A client that arrives starts level with the least served of the others, so that it cannot claim the
    device for as long as they have had it."""

    name = "fair"
    ahead = False

    def joined(self, tenant: Tenant, dispatcher: Dispatcher) -> None:
        others = [t.gpu_ns / t.weight for t in dispatcher.tenants.values() if t is not tenant]
        tenant.gpu_ns = round(min(others) * tenant.weight) if others else 0

    def pick(self, dispatcher: Dispatcher, ready: list[Tenant]) -> Tenant | None:
        # (a ready tenant has a head)
        least = min(ready, key=lambda t: (t.gpu_ns / max(t.weight, 1e-9), t.head().seq))  # type: ignore[union-attr]
        return least if dispatcher.room_for(least) else None


class Timeslice(KernelPolicy):
    """One client's work at a time, for a slice of device time each in turn: at the end of its slice its work is
    held and what it has on the device drains before the next client's goes (no block is preempted).

    Args:
        timeslice: the slice, in seconds (infinite: `exclusive`, each client until it has nothing left).
    """

    name = "timeslice"

    def __init__(self, timeslice: float = 0.0020854, **options: Any) -> None:
        super().__init__(**options)
        if not timeslice > 0:
            raise ValueError("timeslice must be positive")
        self.slice = timeslice
        self.active: Tenant | None = None
        self._since = 0.0

    def pick(self, dispatcher: Dispatcher, ready: list[Tenant]) -> Tenant | None:
        now = dispatcher.inner.now()
        active = self.active if self.active is not None and self.active.id in dispatcher.tenants else None
        if active is None:  # a client that was alone went without a policy: what it has on the device is its slice
            active = next((t for t in dispatcher.tenants.values() if t.in_flight), None)
            if active is not None:
                self.active, self._since = active, now
        if active is not None and (active.queued or active.in_flight):
            if now - self._since < self.slice or not _others(dispatcher, active):
                return active if active in ready else None  # its slice (alone, it has no one to give way to)
            if active.in_flight:
                return None  # its slice is over: what it has on the device drains before the next client's goes
        waiting = [t for t in dispatcher.tenants.values() if t.queued]
        if not waiting:
            return None
        last = active.id if active is not None else -1
        chosen = min([t for t in waiting if t.id > last] or waiting, key=lambda t: t.id)
        self.active, self._since = chosen, now
        return chosen if chosen in ready else None


class Exclusive(Timeslice):
    """One client's work at a time, each until it has nothing queued or running."""

    name = "exclusive"

    def __init__(self, **options: Any) -> None:
        super().__init__(timeslice=math.inf, **options)


def _others(dispatcher: Dispatcher, tenant: Tenant) -> bool:
    return any(t.queued for t in dispatcher.tenants.values() if t is not tenant)


KERNEL_POLICIES: dict[str, type[KernelPolicy]] = {
    p.name: p for p in (Priority, RoundRobin, Fair, Timeslice, Exclusive)}


def kernel_policy(name: str, options: dict[str, Any]) -> KernelPolicy:
    """The kernel-level policy `name` (or ``module:Class``, a KernelPolicy of one's own) with the options it takes.

    Raises:
        ValueError: no such policy, or an option it does not take.
    """
    if ":" in name:
        return load(name, KernelPolicy, options)
    if name in KERNEL_POLICIES:
        cls = KERNEL_POLICIES[name]
    else:
        raise ValueError(f"no kernel-level policy {name!r} (known: {', '.join(KERNEL_POLICIES)}, or module:Class)")
    try:
        return cls(**options)
    except TypeError as exc:  # an option its constructor does not take
        raise ValueError(f"the {name} policy: {exc}") from None
