# SM state: free resources and the blocks resident on each SM. Blocks are never simulated one by one:
# blocks of one kernel placed on one SM at one instant form a Group with a single end time. Fixed-cost
# groups placed together share one heap event (see Simulator._place); throughput-bound ("shared") groups
# on an SM divide its issue rate, so
# their end times move whenever the SM's membership changes. Each SM therefore keeps a version counter:
# the engine pushes one event per reschedule and ignores any event whose version is stale (lazy
# invalidation), instead of searching the heap.
"""Streaming multiprocessors: resource accounting and processor sharing."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from .specs import BlockNeed, DeviceSpec, dram_bandwidth, dram_threads

__all__ = ["SM", "DramPool", "FitIndex", "Group"]

# Shared groups whose remaining service time is within this many seconds are finished (float slack).
_EPSILON = 1e-12
_MEMO_LIMIT = 1 << 16  # FitIndex rows remembered at most


@dataclass(eq=False, slots=True)
class Group:
    """Blocks of one kernel placed together on one SM at one instant.

    ``remaining`` (full-rate seconds of service still owed per block), ``demand`` and ``rate`` are used
    for shared groups only. ``planned`` is the work per block the group was placed with (a block resumed
    after preemption is placed with what it had left).
    """

    run: object  # the engine's per-kernel state (KernelRun)
    sm: int
    count: int
    start: float
    end: float = math.nan
    remaining: float = 0.0
    demand: float = 1.0
    rate: float = 1.0
    evicted: bool = False  # torn down or preempted: its end event is void
    planned: float = 0.0  # seconds of work per block when placed (full-rate seconds if shared)


@dataclass(eq=False, slots=True)
class SM:
    """One SM's free resources and resident shared groups."""

    index: int
    free_warps: int
    free_blocks: int
    free_regs: int
    free_smem: int
    resident: int = 0  # resident blocks, all clients
    shared: list[Group] = field(default_factory=list)
    last: float = 0.0  # time up to which shared groups' service has been accounted
    version: int = 0

    @classmethod
    def empty(cls, index: int, spec: DeviceSpec) -> SM:
        """An idle SM of ``spec``."""
        return cls(
            index,
            spec.max_threads_per_sm // spec.warp_size,
            spec.max_blocks_per_sm,
            spec.regs_per_sm,
            spec.smem_per_sm,
        )

    def fit(self, need: BlockNeed) -> int:
        """How many more blocks of shape ``need`` fit now."""
        n = min(self.free_blocks, self.free_warps // need.warps, self.free_smem // need.smem)
        if need.regs:
            n = min(n, self.free_regs // need.regs)
        return n

    def take(self, need: BlockNeed, count: int) -> None:
        """Reserve resources for ``count`` blocks."""
        self.free_blocks -= count
        self.free_warps -= need.warps * count
        self.free_regs -= need.regs * count
        self.free_smem -= need.smem * count
        self.resident += count

    def release(self, need: BlockNeed, count: int) -> None:
        """Give back the resources of ``count`` blocks."""
        self.free_blocks += count
        self.free_warps += need.warps * count
        self.free_regs += need.regs * count
        self.free_smem += need.smem * count
        self.resident -= count

    # --- processor sharing -------------------------------------------------------------------

    def account(self, now: float) -> None:
        """Charge the service shared groups received since the last change, at their current rates."""
        dt = now - self.last
        if dt > 0.0:
            for g in self.shared:
                g.remaining -= dt * g.rate
        self.last = now

    def add_shared(self, group: Group, now: float) -> None:
        """Make ``group`` resident; call ``reschedule`` once all of this instant's changes are made."""
        self.account(now)
        self.shared.append(group)

    def remove_shared(self, group: Group, now: float) -> None:
        """Take ``group`` off this SM before it finishes; call ``reschedule`` afterwards."""
        self.account(now)
        self.shared.remove(group)

    def pop_finished(self, now: float) -> list[Group]:
        """Remove and return the shared groups whose service is complete at ``now``."""
        self.account(now)
        done = [g for g in self.shared if g.remaining <= _EPSILON * g.rate]
        if done:
            self.shared = [g for g in self.shared if g.remaining > _EPSILON * g.rate]
        return done

    def reschedule(self) -> float | None:
        """Recompute rates after a membership change and bump the version.

        Each shared block demands ``min(1, threads / saturation_threads)`` of the issue rate; if the
        demands sum to more than 1 they are scaled down proportionally.

        Returns:
            When the next shared group will finish at the new rates, or None if none is resident.
        """
        self.version += 1
        if not self.shared:
            return None
        total = sum(g.count * g.demand for g in self.shared)
        scale = 1.0 if total <= 1.0 else 1.0 / total
        soonest = math.inf
        for g in self.shared:
            g.rate = g.demand * scale
            soonest = min(soonest, self.last + max(g.remaining, 0.0) / g.rate)
        return soonest


@dataclass(eq=False, slots=True)
class DramPool:
    """DRAM bandwidth, shared by every resident memory-bound ("dram") group of its domain (the device, or
    one MIG partition, whose bandwidth is at most ``cap``).

    A dram group's work is in seconds at the rate its threads reach alone (``threads`` times their
    ``BlockCost.weight`` times the first slope of ``spec.dram_curve``). Together, groups reach the curve's
    bandwidth at the sum over SMs of ``dram_threads`` (an SM's threads past ``spec.dram_knee`` count less,
    threads counting their weight everywhere), shared in proportion to threads, so every group runs at the
    same fraction ``rate`` of its speed alone. One number therefore tracks them all: ``progress``, the work
    every resident group has done since the pool began. A group is done when progress reaches its ``targets``
    entry, and a heap keeps the nearest first, so a group joining, leaving or finishing costs a heap
    operation, not a pass over the others. As with an SM's shared groups, the
    engine pushes one event per reschedule and ignores events of an older ``version``. A spec without a
    curve gives every group its speed alone.
    """

    spec: DeviceSpec
    key: int = 0  # the domain it serves (the policy's ``dram_share``)
    cap: float = math.inf  # bytes/s at most (a MIG partition's share of the device's)
    targets: dict[Group, float] = field(default_factory=dict)  # resident group -> progress when it is done
    heap: list[tuple[float, int, Group]] = field(default_factory=list)  # (target, order, group); lazy
    order: Iterator[int] = field(default_factory=itertools.count)
    threads: float = 0.0  # resident in dram groups, each counting its kernel's weight
    sm_threads: dict[int, float] = field(default_factory=dict)  # SM -> its (weighted) threads in dram groups
    axis: float = 0.0  # where they all count on the curve's axis (sum of dram_threads over SMs)
    progress: float = 0.0
    last: float = 0.0  # time up to which progress has been accounted
    rate: float = 1.0
    version: int = 0

    def _join(self, group: Group, sign: int) -> None:
        """Count ``group``'s threads (times their weight) in (sign 1) or out (-1), on its SM and in all."""
        kernel = group.run.kernel
        threads = sign * group.count * kernel.threads * kernel.cost.weight
        self.threads += threads
        before = self.sm_threads.get(group.sm, 0.0)
        after = before + threads
        if after > 1e-6:  # weights can leave a float residue where nothing is left
            self.sm_threads[group.sm] = after
        else:
            del self.sm_threads[group.sm]
        if self.sm_threads:
            self.axis += dram_threads(self.spec, after) - dram_threads(self.spec, before)
        else:
            self.axis = self.threads = 0.0  # empty: no float residue carried on

    def account(self, now: float) -> None:
        """Advance ``progress`` to ``now`` at the current rate."""
        dt = now - self.last
        if dt > 0.0:
            self.progress += dt * self.rate
        self.last = now

    def add(self, group: Group, now: float) -> None:
        """Make ``group`` resident with its ``remaining`` work; call ``reschedule`` once this instant's changes
        are made."""
        self.account(now)
        target = self.targets[group] = self.progress + group.remaining
        heapq.heappush(self.heap, (target, next(self.order), group))
        self._join(group, 1)

    def remove(self, group: Group, now: float) -> None:
        """Take ``group`` off before it finishes, its ``remaining`` set to the work it has left; call
        ``reschedule`` afterwards."""
        self.account(now)
        group.remaining = self.targets.pop(group) - self.progress
        self._join(group, -1)

    def pop_finished(self, now: float) -> list[Group]:
        """Remove and return the groups whose bytes are all moved at ``now``, in the order they joined when
        they finish together."""
        self.account(now)
        heap, targets = self.heap, self.targets
        done = []
        while heap:
            target, _, group = heap[0]
            if targets.get(group) != target:  # it left earlier
                heapq.heappop(heap)
                continue
            if target - self.progress > _EPSILON * self.rate:
                break
            heapq.heappop(heap)
            del targets[group]
            group.remaining = target - self.progress
            self._join(group, -1)
            done.append(group)
        return done

    def reschedule(self) -> float | None:
        """Recompute the rate after a membership change and bump the version.

        Returns:
            When the next group will finish at the new rate, or None if none is resident.
        """
        self.version += 1
        heap, targets = self.heap, self.targets
        while heap and targets.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
        if not heap:
            return None
        if self.spec.dram_curve:
            threads0, rate0 = self.spec.dram_curve[0]
            bandwidth = min(dram_bandwidth(self.spec, self.axis), self.cap)
            self.rate = min(1.0, bandwidth / (self.threads * rate0 / threads0))
        return self.last + max(heap[0][0] - self.progress, 0.0) / self.rate


class FitIndex:
    """For each block shape in use, within an SM window, how many more blocks fit on every SM and which
    SMs of the window have room, kept current as SMs take and release blocks.

    Scanning all SMs for every kernel dominated the simulator's cost; instead each SM that changes updates
    its entry in every table at once (a handful of shapes are in use at a time; ``sweep`` drops the others).
    The set of SMs with room is small on a busy device (often empty), so "is this shape full?" and the
    placement search cost what is free, not what the device holds.
    """

    def __init__(self, sms: list[SM]) -> None:
        self._sms = sms
        # table key -> [fits, room, warps, regs, smem, lo, hi, asked since the last sweep]
        self.tables: dict[object, list] = {}  # (read-only for callers)
        self.rooms: dict[object, set[int]] = {}  # table key -> its room set (read-only for callers)
        self.changes = 0  # calls to changed(), ever
        # What changed() walks: (fits, room, lo, hi) of every table, in the order of ``tables``; and the
        # fits an SM's free resources give in each of them, by (blocks, warps, regs, smem). A fit is a
        # pure function of those four numbers and the table's shape, and a busy device cycles through a
        # few hundred such states, so looking the row up gives the very numbers computing it would.
        # Both are rebuilt whenever a table is added or dropped.
        self._slots: list[tuple[list[int], set[int], int, int]] = []
        self._memo: dict[tuple[int, int, int, int], tuple[int, ...]] = {}

    def _retable(self) -> None:
        self._slots = [(t[0], t[1], t[5], t[6]) for t in self.tables.values()]
        self._memo = {}

    def _row(self, state: tuple[int, int, int, int]) -> tuple[int, ...]:
        """The fit of every table's shape on an SM with free resources ``state`` (SM.fit, memoised)."""
        blocks, warps, regs, smem = state
        row = []
        for table in self.tables.values():
            f = warps // table[2]
            if blocks < f:
                f = blocks
            n = smem // table[4]
            if n < f:
                f = n
            if table[3]:
                n = regs // table[3]
                if n < f:
                    f = n
            row.append(f)
        if len(self._memo) >= _MEMO_LIMIT:  # bound its memory on odd workloads; it refills as it goes
            self._memo = {}
        row = self._memo[state] = tuple(row)
        return row

    def changed(self, index: int) -> None:
        """SM ``index`` took or released blocks."""
        sm = self._sms[index]
        state = (sm.free_blocks, sm.free_warps, sm.free_regs, sm.free_smem)
        row = self._memo.get(state)
        if row is None:
            row = self._row(state)
        for (fits, room, lo, hi), f in zip(self._slots, row):  # runs for every group placed or ended
            if f != fits[index] and lo <= index < hi:  # an equal fit has its room entry right already
                fits[index] = f
                if f:
                    room.add(index)
                else:
                    room.discard(index)
        self.changes += 1

    def changed_many(self, indices: list[int]) -> None:
        """``changed`` for each SM of ``indices`` in turn (a wave ended or was placed): one call, not one
        per SM. An index may repeat; the tables end as ``changed`` would leave them."""
        sms = self._sms
        slots = self._slots
        memo = self._memo
        for index in indices:
            sm = sms[index]
            state = (sm.free_blocks, sm.free_warps, sm.free_regs, sm.free_smem)
            row = memo.get(state)
            if row is None:
                row = self._row(state)
                memo = self._memo  # _row may have started a new one
            for (fits, room, lo, hi), f in zip(slots, row):
                if f != fits[index] and lo <= index < hi:
                    fits[index] = f
                    if f:
                        room.add(index)
                    else:
                        room.discard(index)
        self.changes += len(indices)

    def fits(self, need: BlockNeed) -> list[int]:
        """Blocks of shape ``need`` that fit on each SM now, by SM index (do not modify the list)."""
        return self.lookup(need, need)[0]

    def lookup(self, key: object, need: BlockNeed, lo: int = 0, hi: int | None = None
               ) -> tuple[list[int], set[int]]:
        """The table of shape ``need`` in SMs ``lo`` .. ``hi - 1``, filed under ``key`` (any hashable that
        names this shape and window; the engine uses a small integer, cheaper to hash than a BlockNeed).

        Returns:
            (fits, room): blocks that fit on each SM by index (0 outside the window), and the indices in
            the window where at least one fits; both kept current as SMs change (do not modify either).
        """
        table = self.tables.get(key)
        if table is None:
            if hi is None:
                hi = len(self._sms)
            fits = [sm.fit(need) if lo <= sm.index < hi else 0 for sm in self._sms]
            room = {i for i, f in enumerate(fits) if f}
            table = self.tables[key] = [fits, room, need.warps, need.regs, need.smem, lo, hi, True]
            self.rooms[key] = room
            self._retable()
        table[7] = True
        return table[0], table[1]

    def sweep(self, keep) -> None:
        """Drop the tables not asked for since the last sweep, except those whose keys are in ``keep``;
        the rest stay (and count as not asked for yet)."""
        dropped = False
        for key in list(self.tables):
            table = self.tables[key]
            if not table[7] and key not in keep:
                del self.tables[key]
                del self.rooms[key]
                dropped = True
            table[7] = False
        if dropped:
            self._retable()
