# The event loop, in SimPy's manner: a heap of (time, seq, kind, payload) with seq from itertools.count,
# so ties keep their order and payloads are never compared. Work is handled an instant at a time: every
# event at time t is processed first (blocks ending, kernels passing their launch overhead, copies
# ending), then freed capacity is dispatched once, so blocks that end together free their SMs together.
# The engine owns time and bookkeeping; stream order lives in streams.py, SM accounting, processor
# sharing and the shared DRAM bandwidth in sms.py, placing blocks and taking them off in blocks.py, the
# ready kernels and their keys in ready.py, the copy engines in copies.py, the choice of which kernel goes next
# and which SMs a client may use in policies/.
# Policies act only through _place, _set_timer and _preempt (and read the ready queue); the engine does
# the accounting for them.
# What keeps an instant cheap on a busy device (each of these is exact, not an approximation): ready
# kernels are kept in hardware order, so policies never sort; a dispatch stops as soon as every (shape,
# window) key of the ready kernels is full (ready.py says why that is exact); the fit tables say which SMs
# have room (their rows memoised by an SM's free resources); the fixed-cost groups of one placement, and
# of placements pushed back to back with the same end time, share one heap event (_push_groups), and such
# a wave ends in one pass with one fit-table update (blocks.py).
# The clock is the caller's: virtual time with run(), or any external clock driving advance().
"""The simulation engine."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from typing import Any

from .blocks import Blocks
from .copies import CopyEngines
from .ops import ENGINES, BlockGroup, Copy, Kernel, Marker, Op
from .policies import DEFAULT_CLIENT, ClientConfig, KernelRun, Policy, make_policy
from .ready import ReadyQueue
from .shapes import Shapes
from .sms import SM, DramPool, FitIndex, Group
from .specs import H200, BlockNeed, DeviceSpec
from .stats import Counters, SimStatistics
from .streams import Streams

__all__ = ["PythonEngine"]

_READY, _GROUP_END, _SM, _COPY_END, _TIMER, _DRAM = range(6)
_SWEEP = 1 << 12  # SM changes between sweeps of the fit tables no ready kernel needs


class PythonEngine(Blocks):
    """The simulator's engine in Python: the reference the compiled one (``mpsd.sim.Simulator``) must match to
    the bit, and the engine of the policies not compiled yet; its API is ``Simulator``'s.

    Args:
        spec: the device model.
        policy: dispatch policy name, a key of ``POLICIES``: "mps", "round-robin", "priority", "fair",
            "exclusive", "mig" or "timeslice".
        record: keep a trace of every block group in ``trace`` (a block preempted and resumed appears once
            per stretch it ran).
        policy_options: the policy's settings, e.g. ``{"aging": 0.005}`` for "priority",
            ``{"partitions": ["3g.71gb", "3g.71gb"]}`` for "mig", ``{"timeslice": 1e-3, "switch": 25e-6}``
            for "timeslice".

    Raises:
        ValueError: unknown policy, or an option it does not know or accept.
    """

    def __init__(self, spec: DeviceSpec = H200, policy: str = "mps", record: bool = False,
                 policy_options: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self.now = 0.0
        self.trace: list[BlockGroup] = []
        self._record = record
        self._clients: dict[int, ClientConfig] = {}
        self._sms = [SM.empty(i, spec) for i in range(spec.sm_count)]
        self._fit_index = FitIndex(self._sms)
        self._shapes = Shapes(spec)
        self._heap: list[tuple] = []
        self._last: tuple | None = None  # the event pushed last, while it is surely still in the heap
        self._event_seq = itertools.count()
        self._op_seq = itertools.count()
        self._streams = Streams()
        self._runs: dict[Kernel, KernelRun] = {}
        self._next_sweep = _SWEEP
        self._dirty = False  # capacity freed or a kernel became ready since the last dispatch
        self._touched: set[int] = set()  # SMs whose shared groups changed this instant
        # Memory-bound groups share DRAM bandwidth: one pool per domain the policy names (MIG partitions have
        # their own), the pool of each resident dram group, and the pools whose membership changed this instant.
        self._dram: dict[int, DramPool] = {}
        self._dram_of: dict[Group, DramPool] = {}
        self._dram_touched: dict[int, DramPool] = {}
        self._client_sms: dict[int, dict[int, int]] = {}  # client -> SM -> resident blocks
        self._copy_engines = CopyEngines(spec, lambda at, token: self._push(at, _COPY_END, token))
        self._completed: list[Op] = []  # completions at self.now not yet returned
        self._counters: dict[int, Counters] = {}
        self._departed_sm_seconds = 0.0  # SM-time of clients forgotten since
        self._kernels = self._blocks = self._copies = 0
        self._policy: Policy = make_policy(policy, self, policy_options)
        # Kernels past their launch overhead with blocks to place; policies read ``_queue.runs`` and ask
        # it ``open_keys``, ``close_keys`` and ``saturated``.
        self._queue = ReadyQueue(self._fit_index, spec.sm_count, self._policy.window)
        # The policy's per-group hooks, or None where it keeps the base class's no-ops (most do).
        cls = type(self._policy)
        self._placed_hook = self._policy.placed if cls.placed is not Policy.placed else None
        self._vacated_hook = self._policy.vacated if cls.vacated is not Policy.vacated else None

    # --- public API ------------------------------------------------------------------------

    def submit(self, op: Op) -> None:
        """Submit an op at the current time (sets ``op.submitted`` and ``op.seq``).

        Args:
            op: a Kernel, Copy or Marker not submitted before.

        Raises:
            ValueError: the op was already submitted; a kernel with blocks < 1, a block that cannot fit
                on an SM, or sm_cap < 1; a copy on an unknown engine or with negative nbytes.
            TypeError: not a Kernel, Copy or Marker.
        """
        if op.seq != -1:
            raise ValueError("op already submitted")
        if isinstance(op, Kernel):
            if op.blocks < 1:
                raise ValueError(f"kernel needs at least one block, got {op.blocks}")
            launch = self._shapes.launches.get((op.threads, op.regs_per_thread, op.smem))
            if launch is None:
                launch = self._shapes.launch(op.threads, op.regs_per_thread, op.smem)
            if op.sm_cap is not None and op.sm_cap < 1:
                raise ValueError(f"sm_cap must be >= 1, got {op.sm_cap}")
            shape, need, demand, sm_share = launch
            self._runs[op] = KernelRun(op, need, unplaced=op.blocks, shape=shape,
                                       seconds=max(op.cost.seconds, self.spec.min_block_time),
                                       demand=demand, sm_share=sm_share)
        elif isinstance(op, Copy):
            if op.engine not in ENGINES:
                raise ValueError(f"unknown copy engine {op.engine!r}; known: {ENGINES}")
            if op.nbytes < 0:
                raise ValueError(f"nbytes must be >= 0, got {op.nbytes}")
        elif not isinstance(op, Marker):
            raise TypeError(f"cannot submit {type(op).__name__}")
        op.seq = next(self._op_seq)
        op.submitted = self.now
        if self._streams.add(op):
            self._settle([op])

    def block_need(self, threads: int, regs_per_thread: int = 32, smem: int = 0) -> BlockNeed | None:
        """What one block of this shape takes from an SM, or None if one cannot fit (cached: every launch
        asks)."""
        return self._shapes.block_need(threads, regs_per_thread, smem)

    def configure_client(self, client: int, *, priority: int = 0, weight: float = 1.0,
                         partition: str | int | None = None) -> None:
        """Set how the policy treats ``client`` (call when it attaches; unconfigured clients get the defaults).

        Takes effect for blocks placed from now on; blocks already resident stay where they are.

        Args:
            client: the tenant id.
            priority: lower is more urgent: 0 normal, 1 below normal (CUDA_MPS_CLIENT_PRIORITY), other
                integers for finer daemon-side levels (used by "priority").
            weight: share of SM-time, > 0 (used by "fair").
            partition: MIG partition: index, its decimal string or a profile name; None for partition 0
                (used by "mig").

        Raises:
            ValueError: a non-integer priority, a weight that is not positive and finite, or a partition
                the MIG layout does not have.
        """
        config = ClientConfig(priority, weight, partition)
        self._policy.configure(client, config)
        self._clients[client] = config
        self._queue.forget_windows()  # the policy's windows follow the configuration
        self._dirty = True

    def forget_client(self, client: int) -> None:
        """A client is gone for good: cancel what it left, and keep nothing per client about it (its SM-time
        still counts in ``statistics().sm_seconds``)."""
        self.cancel(client)
        self._policy.forget(client)
        self._clients.pop(client, None)
        counters = self._counters.pop(client, None)
        if counters is not None:
            self._departed_sm_seconds += counters.sm_seconds

    def client_config(self, client: int) -> ClientConfig:
        """The configuration ``client`` was given, or the defaults."""
        return self._clients.get(client, DEFAULT_CLIENT)

    @property
    def policy(self) -> Policy:
        """The policy in force (its name is ``policy.name``)."""
        return self._policy

    def next_time(self) -> float | None:
        """Time of the next internal event.

        Returns:
            ``now`` if completions are waiting to be returned, else the time of the earliest pending
            event, or None if nothing is running or waiting on time.
        """
        if self._completed:
            return self.now
        heap = self._heap
        return heap[0][0] if heap and not self._stale(heap[0]) else self._peek()

    def advance(self, until: float, max_instants: int | None = None) -> list[Op]:
        """Process every event with time <= ``until`` and move the clock to ``until``.

        Args:
            until: the new simulated time.
            max_instants: stop after this many instants with events; the clock then stays at the last
                one processed (below ``until``), so a caller in real time can yield and come back.

        Returns:
            The ops completed (including those completed at submit), in completion order, ties in
            submission order; each has started, ended and done set.

        Raises:
            ValueError: ``until`` is before ``now`` (or NaN).
        """
        if not until >= self.now:
            raise ValueError(f"cannot go back in time from {self.now} to {until}")
        out: list[Op] = []
        heap = self._heap
        instants = 0
        while True:
            t = heap[0][0] if heap and not self._stale(heap[0]) else self._peek()
            if t is None or t > until:
                break
            if max_instants is not None and instants >= max_instants:
                out.extend(self._flush())
                return out
            instants += 1
            if t > self.now:
                out.extend(self._flush())
                self.now = t
            self._instant(t)
        out.extend(self._flush())
        self.now = until
        return out

    def run(self) -> list[Op]:
        """Advance in virtual time until nothing is left to do.

        Returns:
            Every op completed, in completion order.
        """
        # advance(next_time()) until None, without the per-call set-up: completions are flushed whenever
        # the clock moves, exactly where those calls would have returned them.
        out: list[Op] = []
        while (t := self._peek()) is not None:
            if t > self.now:
                out.extend(self._flush())
                self.now = t
            self._instant(t)
        out.extend(self._flush())
        return out

    def cancel(self, client: int) -> list[Op]:
        """A client's context is torn down (it died, or a fatal fault took it): drop all its work.

        Ops not yet started are dropped; running blocks are evicted at once and a copy in flight stops, as
        when the MPS server destroys a context. None of them is reported as completed. Other clients' ops
        that depend on any of them go ahead now.

        Args:
            client: the tenant id.

        Returns:
            The dropped (never started) ops, in submission order.
        """
        dropped: list[Op] = []
        resolved: list[Op] = []
        for op in self._streams.drop_client(client):
            if isinstance(op, Kernel):
                run = self._runs.pop(op)
                run.cancelled = True
                run.unplaced = 0
                for group in list(run.groups):
                    self._evict(group)
                (dropped if math.isnan(op.started) else resolved).append(op)
                self._policy.retired(run)
            elif isinstance(op, Copy) and self._copy_engines.cancel(op):
                resolved.append(op)  # stopped in flight
            else:
                dropped.append(op)
        self._queue.drop_cancelled()
        for op in sorted(dropped + resolved, key=lambda o: o.seq):
            self._settle(self._streams.resolve(op))
        self._copy_engines.start_all(self.now)
        self._dirty = True
        self._end_instant()
        return dropped

    def statistics(self) -> SimStatistics:
        """A snapshot of the counters (see ``SimStatistics``)."""
        return SimStatistics(
            self.now,
            self._kernels,
            self._blocks,
            self._copies,
            {c: n.freeze() for c, n in sorted(self._counters.items())},
            self._departed_sm_seconds + sum(n.sm_seconds for n in self._counters.values()),
        )

    def busy_sms(self, client: int | None = None) -> int:
        """SMs with at least one resident block (of ``client``, if given)."""
        if client is None:
            return sum(1 for sm in self._sms if sm.resident)
        return len(self._client_sms.get(client, ()))

    def stranded_blocks(self) -> int:
        """Blocks of ready kernels that would fit now on SMs their client may use (its MIG window, its SM
        cap), yet wait: idle capacity while work is queued. Always 0 between calls under the
        work-conserving policies ("mps", "round-robin", "fair", "mig", and "priority" without aging)."""
        return self._queue.stranded(self._client_sms)

    # --- events ------------------------------------------------------------------------------

    def _push(self, time: float, kind: int, payload: object) -> None:
        self._last = event = (time, next(self._event_seq), kind, payload)
        heapq.heappush(self._heap, event)

    def _push_groups(self, time: float, groups: list[Group]) -> None:
        """Schedule the end of fixed-cost ``groups`` at ``time``, in one event with those pushed just before.

        Exact: if the last event pushed ends groups at this same time and is still in the heap, a new
        event would come right after it in (time, seq) order, nothing between them, so both would be
        handled one after the other in that order: appending to its list does the same with one event.
        (Its stale check asks whether every group is evicted; a partly evicted list still has live
        groups at that time, as the separate events would.)
        """
        last = self._last
        if last is not None and last[0] == time and last[2] == _GROUP_END:
            last[3].extend(groups)
        else:
            self._push(time, _GROUP_END, groups)

    def _dram_pool(self, client: int) -> DramPool:
        """The DRAM pool ``client``'s memory-bound blocks share (made on first use)."""
        key, share = self._policy.dram_share(client)
        pool = self._dram.get(key)
        if pool is None:
            top = self.spec.dram_curve[-1][1] if self.spec.dram_curve else 0.0
            pool = self._dram[key] = DramPool(self.spec, key, top * share if share < 1.0 else math.inf)
        return pool

    def _set_timer(self, time: float, token: object) -> None:
        """Call the policy's ``on_timer(token)`` at ``time`` (>= now), unless it says the token is stale."""
        self._push(time, _TIMER, token)

    def _stale(self, event: tuple) -> bool:
        kind, payload = event[2], event[3]
        if kind == _GROUP_END:
            for group in payload:
                if not group.evicted:
                    return False
            return True
        if kind == _SM:
            return self._sms[payload[0]].version != payload[1]
        if kind == _TIMER:
            return self._policy.timer_stale(payload)
        if kind == _DRAM:
            return payload[0].version != payload[1]
        if kind == _COPY_END:
            return self._copy_engines.stale(payload)
        return payload.cancelled

    def _peek(self) -> float | None:
        """Time of the earliest event that still matters (stale ones are dropped), or None."""
        heap = self._heap
        while heap and self._stale(heap[0]):
            heapq.heappop(heap)
            self._last = None  # it may have been the last pushed: _push_groups must not extend it
        return heap[0][0] if heap else None

    def _instant(self, t: float) -> None:
        """Handle every event due at ``t`` (== now), those they add at ``t`` too, then dispatch once."""
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= t:
            _, _, kind, payload = pop(heap)
            self._last = None  # see _push_groups
            if kind == _GROUP_END:
                self._end_fixed(payload)
            elif kind == _SM:
                sm = self._sms[payload[0]]
                if sm.version != payload[1]:
                    continue
                for group in sm.pop_finished(t):
                    self._end_group(group)
                self._touched.add(sm.index)
            elif kind == _READY:
                if not payload.cancelled:
                    self._queue.add(payload)
                    self._dirty = True
            elif kind == _TIMER:
                if not self._policy.timer_stale(payload):
                    self._policy.on_timer(payload)
                    self._dirty = True
            elif kind == _DRAM:
                pool = payload[0]
                if pool.version != payload[1]:
                    continue
                for group in pool.pop_finished(t):
                    del self._dram_of[group]
                    self._end_group(group)
                self._dram_touched[pool.key] = pool
            elif not self._copy_engines.stale(payload):
                op, lane = self._copy_engines.fire(payload, t)
                if op is not None:
                    self._end_copy(op)
                self._copy_engines.start(lane, t)
        self._end_instant()

    def _end_instant(self) -> None:
        queue = self._queue
        if self._dirty and (queue.runs or self._policy.dispatch_when_idle):
            queue.full.clear()
            self._policy.dispatch(queue.runs)
            queue.prune()
        self._dirty = False
        if self._fit_index.changes >= self._next_sweep:
            self._fit_index.sweep(queue.counts)
            self._next_sweep = self._fit_index.changes + _SWEEP
        if self._touched:
            for i in sorted(self._touched):
                soonest = self._sms[i].reschedule()
                if soonest is not None:
                    self._push(soonest, _SM, (i, self._sms[i].version))
            self._touched.clear()
        if self._dram_touched:
            for key in sorted(self._dram_touched):
                pool = self._dram_touched[key]
                soonest = pool.reschedule()
                if soonest is not None:
                    self._push(soonest, _DRAM, (pool, pool.version))
            self._dram_touched.clear()

    def _flush(self) -> list[Op]:
        done = self._completed
        self._completed = []
        done.sort(key=lambda o: o.seq)
        return done

    def _counter(self, client: int) -> Counters:
        c = self._counters.get(client)
        if c is None:
            c = self._counters[client] = Counters()
        return c

    # --- stream order ------------------------------------------------------------------------

    def _settle(self, ops: list[Op]) -> None:
        """Start what became eligible now: markers complete, kernels wait out the launch overhead,
        copies join their engine's queue."""
        work = deque(ops)
        lanes: set[tuple[str, int]] = set()
        while work:
            op = work.popleft()
            op.eligible = self.now
            if isinstance(op, Marker):
                op.started = op.ended = self.now
                op.done = True
                self._completed.append(op)
                work.extend(self._streams.complete(op))
            elif isinstance(op, Kernel):
                run = self._runs[op]
                run.eligible = self.now
                self._policy.eligible(run)
                self._push(self.now + self.spec.kernel_overhead, _READY, run)
            else:
                lane = (op.engine, self._policy.copy_lane(op.client))
                self._copy_engines.enqueue(op, lane, self.now)
                lanes.add(lane)
        for lane in sorted(lanes):
            self._copy_engines.start(lane, self.now)

    def _finish(self, op: Op) -> None:
        """``op`` ended now: report it and start what it held up."""
        op.ended = self.now
        op.done = True
        self._completed.append(op)
        self._settle(self._streams.complete(op))

    # --- copies ------------------------------------------------------------------------------

    def _end_copy(self, op: Copy) -> None:
        c = self._counter(op.client)
        c.copies += 1
        c.bytes_copied += op.nbytes
        self._copies += 1
        self._finish(op)
