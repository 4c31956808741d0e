# What every policy shares: the engine's per-kernel record, the per-client configuration, the placement rule
# (spread a grid over the SMs with the most room, within an SM window and a cap), and the base class whose
# hooks the engine calls. A policy decides only which kernel gets freed capacity next and which SMs a client
# may use; the engine owns time, events, SM accounting and preemption, so each policy stays a small class.
"""Policy base class, per-client configuration and block placement."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ..ops import Kernel
from ..specs import BlockNeed, DeviceSpec

if TYPE_CHECKING:
    from ..engine import PythonEngine as Simulator
    from ..sms import Group

__all__ = ["ClientConfig", "KernelRun", "Policy", "mps_key", "place_in_launch_order", "spread"]


@dataclass(eq=False, slots=True)
class KernelRun:
    """The engine's state of one submitted kernel.

    Attributes:
        kernel: the op.
        need: resources one of its blocks takes.
        eligible: when it became eligible (head of stream, dependencies done).
        unplaced: blocks not on an SM now (fresh ones plus preempted ones waiting to resume).
        running: blocks resident now.
        cancelled: its client was cancelled; place nothing more, report nothing.
        groups: its block groups resident now, in placement order (an ordered set: values are None).
        partial: preempted blocks waiting to resume, as [count, seconds of work left per block] entries
            (for clocked costs, [count, the simulated time its blocks end]), oldest first; they are placed
            before fresh blocks.
        seconds: a fresh block's duration (full-rate seconds if shared), at least the device's minimum.
        demand: share of an SM's issue rate one of its blocks asks for (shared kernels).
        sm_share: share of an SM's threads one of its blocks holds (for SM-time statistics).
        shape: the engine's small-integer name for ``need`` (cheaper to hash than the BlockNeed).
        key: the engine's small-integer name for (shape, SM window of its client), set while it is ready:
            kernels with equal keys compete for the very same room, so one found full stands for all.
        counters: its client's statistics counters once it has placed a block (the engine's, kept here
            to save a lookup per group).
    """

    kernel: Kernel
    need: BlockNeed
    eligible: float = 0.0
    unplaced: int = 0
    running: int = 0
    cancelled: bool = False
    groups: dict = field(default_factory=dict)
    partial: list = field(default_factory=list)
    shape: int = 0
    seconds: float = 0.0
    demand: float = 1.0
    sm_share: float = 1.0
    key: int = -1
    counters: Any = None


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """How a policy treats one client (``Simulator.configure_client``).

    Attributes:
        priority: client priority, lower is more urgent: 0 normal, 1 below normal (CUDA_MPS_CLIENT_PRIORITY),
            any other integer for finer daemon-side levels.
        weight: share of SM-time under ``fair`` (> 0).
        partition: MIG partition under ``mig``: an index into the layout, its decimal string, or a profile
            name (the first partition of that profile); None for partition 0.
    """

    priority: int = 0
    weight: float = 1.0
    partition: str | int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")  # noqa: TRY004
        if not (isinstance(self.weight, (int, float)) and 0.0 < self.weight < math.inf):
            raise ValueError(f"weight must be a positive finite number, got {self.weight!r}")
        if self.partition is not None and (isinstance(self.partition, bool)
                                           or not isinstance(self.partition, (int, str))):
            raise ValueError(f"partition must be an index, a profile name or None, got {self.partition!r}")


DEFAULT_CLIENT = ClientConfig()


def mps_key(run: KernelRun) -> tuple[int, float, int]:
    """The hardware's order among pending kernels: stream priority, then when eligible, then launch order."""
    return (run.kernel.priority, run.eligible, run.kernel.seq)


class Policy:
    """Base of every policy: the hooks the engine calls, all no-ops here.

    Subclasses implement ``dispatch``. The engine's methods a policy may call are ``sim._place(run, limit)``
    (place up to ``limit`` blocks, returns how many it placed), ``sim._set_timer(time, token)`` (calls
    ``on_timer(token)`` at ``time`` unless ``timer_stale(token)``), ``sim._preempt(client)`` (take the
    client's resident blocks off, to resume later with the work they had left or their deadline; returns
    the warps taken off) and
    ``sim.client_config(c)``;
    ``sim._queue`` (a ``ReadyQueue``) says which ready kernels could still place a block in this dispatch.
    The per-kernel and per-group hooks (``eligible``, ``retired``, ``placed``, ``vacated``) only keep the
    policy's own accounts: the engine calls them in the middle of its own bookkeeping (a wave's fit-table
    update comes after them), so they must not place blocks or read the fit tables.

    Args:
        sim: the simulator this policy serves.
        options: policy-specific settings (see each policy); unknown keys are an error.

    Raises:
        ValueError: an unknown or invalid option.
    """

    name = "base"
    options: ClassVar[dict[str, Any]] = {}
    # Call dispatch at the end of every instant where something changed, even with no kernel ready
    # (policies that hand the GPU from client to client must notice an owner running out of work).
    dispatch_when_idle = False

    def __init__(self, sim: Simulator, options: dict[str, Any] | None = None) -> None:
        self.sim = sim
        self.spec: DeviceSpec = sim.spec
        given = dict(options or {})
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for policy {self.name!r}; known: {sorted(self.options)}")
        self.settings = {**self.options, **given}

    def dispatch(self, ready: list[KernelRun]) -> None:
        """Offer the free capacity to ``ready`` kernels by calling ``sim._place``.

        Args:
            ready: kernels past their launch overhead with blocks left to place, in hardware order
                (``mps_key``); do not modify the list.
        """
        raise NotImplementedError

    def configure(self, client: int, config: ClientConfig) -> None:
        """Check a client's configuration against this policy.

        Raises:
            ValueError: the configuration makes no sense here (a partition that does not exist).
        """

    def forget(self, client: int) -> None:
        """`client` is gone for good, its work torn down: drop whatever the policy keeps about it."""

    def window(self, client: int) -> tuple[int, int] | None:
        """SMs ``client`` may use, as a half-open index range; None for all."""
        return None

    def copy_lane(self, client: int) -> int:
        """Which set of copy engines serves ``client`` (0: the device's one set)."""
        return 0

    def dram_share(self, client: int) -> tuple[int, float]:
        """Which DRAM bandwidth serves ``client``'s memory-bound blocks, and the share of the device's it is
        ((0, 1.0): the device's one)."""
        return (0, 1.0)

    def eligible(self, run: KernelRun) -> None:
        """``run`` became eligible (head of its stream, dependencies done)."""

    def retired(self, run: KernelRun) -> None:
        """``run`` completed or its client was cancelled."""

    def placed(self, group: Group) -> None:
        """``group`` was just placed."""

    def vacated(self, group: Group) -> None:
        """``group`` left its SM (ended, preempted or evicted); ``group.end`` is now."""

    def on_timer(self, token: object) -> None:
        """A timer set with ``sim._set_timer`` fired."""

    def timer_stale(self, token: object) -> bool:
        """True if the timer ``token`` no longer matters (the engine then drops it unhandled)."""
        return False


def spread(fits: list[int], left: int, budget: int, occupied: dict[int, int],
           lo: int = 0, hi: int | None = None, room: set[int] | None = None) -> list[tuple[int, int]]:
    """Choose SMs for up to ``left`` blocks: greedy, one block at a time, on the SM with the most room.

    Computed in rounds: at level L every usable SM whose fit is at least L takes one block, in index order,
    for L from the largest fit down to 1; so ties go to the lowest index and a grid spreads before it stacks.
    SMs the client does not occupy yet cost one unit of ``budget`` each; once it is spent only occupied SMs
    take blocks (an MPS SM cap counts distinct SMs). Only SMs with room can take a block, so the rounds run
    over those alone (``room``, when the caller knows it: on a busy device it is a handful of SMs).

    Args:
        fits: how many blocks of the kernel's shape fit on each SM now, by SM index.
        left: most blocks to place (>= 1).
        budget: SMs the client may still add.
        occupied: SM index -> the client's resident blocks there.
        lo, hi: the SM window the client may use (default: all).
        room: the indices of ``fits`` that are not 0, if known (any order).

    Returns:
        (SM index, block count) pairs, by SM index; the caller reserves the resources.
    """
    if hi is None:
        hi = len(fits)
    if left == 1 and budget > 0:  # the common small kernel: the first SM with the most room
        window = fits if lo == 0 and hi == len(fits) else fits[lo:hi]
        top = max(window, default=0)
        return [(window.index(top) + lo, 1)] if top else []
    if room is None:
        cand = [i for i in range(lo, hi) if fits[i]]
    elif lo == 0 and hi == len(fits):
        cand = sorted(room)
    else:
        cand = sorted(i for i in room if lo <= i < hi)
    if not cand:
        return []
    if len(cand) == 1:  # a busy device: one SM has room; it takes what fits, if the client may use it
        i = cand[0]
        return [(i, min(fits[i], left))] if budget > 0 or i in occupied else []
    if budget >= len(cand) or budget >= sum(1 for i in cand if i not in occupied):
        return _spread_uncapped(fits, left, cand)
    taken: dict[int, int] = {}
    for level in range(max(fits[i] for i in cand), 0, -1):
        for i in cand:
            if fits[i] < level:
                continue
            n = taken.get(i, 0)
            if not n and i not in occupied:
                if budget <= 0:
                    continue
                budget -= 1
            taken[i] = n + 1
            left -= 1
            if not left:
                break
        if not left:
            break
    return [(i, taken[i]) for i in cand if i in taken]


def _spread_uncapped(fits: list[int], left: int, cand: list[int]) -> list[tuple[int, int]]:
    """``spread`` where the budget cannot run out, in closed form rather than block by block.

    Every level above the one where ``left`` runs out is taken in full (an SM of fit f takes one block at
    each level from f down), so only the last level is partial: its first SMs in index order take one more.
    """
    top = max(fits[i] for i in cand)
    at_level = [0] * (top + 1)  # SMs whose fit is exactly L
    for i in cand:
        at_level[fits[i]] += 1
    above = 0  # blocks taken at the levels done so far
    reach = 0  # SMs taking a block at the current level (fit >= level)
    level = top
    while level:
        reach += at_level[level]
        if above + reach >= left:
            break
        above += reach
        level -= 1
    if not level:  # everything fits
        return [(i, fits[i]) for i in cand]
    extra = left - above  # SMs at the last level that take one more
    out = []
    for i in cand:
        f = fits[i]
        n = f - level if f > level else 0
        if extra and f >= level:
            n += 1
            extra -= 1
        if n:
            out.append((i, n))
    return out


def place_in_launch_order(sim: Simulator, ready: list[KernelRun]) -> None:
    """Place every ready kernel's blocks as far as they fit, in the order given (hardware order): ``mps``, and
    ``mig`` within each partition's window.

    A kernel whose (shape, window) has no room would place nothing, so only the others are offered capacity,
    and the pass ends once every shape is full: the result is the same as offering every kernel in turn,
    without walking a long queue of kernels that cannot start.
    """
    place = sim._place
    if len(ready) == 1:  # a lone kernel (the daemon's common case): nothing to skip
        place(ready[0], ready[0].unplaced)
        return
    open_keys = sim._queue.open_keys()
    if not open_keys:
        return
    for run in ready:
        if run.key in open_keys and place(run, run.unplaced):
            sim._queue.close_keys(open_keys)
            if not open_keys:
                return
