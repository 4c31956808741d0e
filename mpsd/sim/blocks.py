# Blocks onto SMs and off again: placement (spreading a grid over the SMs with room, resuming preempted
# blocks first), the end of fixed-cost groups (a whole wave at a time), preemption, eviction and the
# accounting every departure does. It is the engine's hot path, kept in its own module so the event loop
# in engine.py stays readable; it is a mixin of Simulator rather than an object of its own because every
# step touches the same state the loop owns (SMs, fit tables, the ready queue, counters, the heap through
# _push_groups), and passing that around per group would cost more than the work.
# State it uses, all set up by Simulator.__init__: now, _sms, _fit_index, _queue, _client_sms, _touched,
# _dram_of, _dram_touched, _runs, _placed_hook, _vacated_hook, _policy, _record, trace, _blocks, _kernels,
# _dirty; methods it calls: _push_groups, _counter, _finish, _dram_pool.
"""Block placement, completion, preemption and eviction (a mixin of ``Simulator``)."""

from __future__ import annotations

import math

from .ops import BlockGroup
from .policies import KernelRun
from .policies.base import spread
from .sms import _EPSILON, Group

__all__ = ["Blocks"]

# Rooms smaller than this are searched SM by SM for a lone block's place; larger ones through the whole fit
# table (a C-level scan of every SM that costs about as much as a Python pass over this many).
_FEW = 16


class Blocks:
    """Placing blocks and taking them off their SMs; mixed into ``Simulator``, whose state it uses."""

    def _place(self, run: KernelRun, limit: int) -> int:
        """Place up to ``limit`` of ``run``'s unplaced blocks where they fit, within its client's SM cap and
        the SMs the policy lets it use; blocks preempted earlier go first, with the work they had left.

        Returns:
            Blocks placed.
        """
        left = run.unplaced
        if limit < left:  # noqa: PLR1730 (min() is a call, and this runs per placement)
            left = limit
        if left <= 0:
            return 0
        key = run.key
        queue = self._queue
        if key in queue.full:
            return 0
        table = self._fit_index.tables.get(key)
        if table is None:
            fits, room = queue.lookup(key)  # room: SMs of its window
        else:
            fits = table[0]
            room = table[1]
        if not room:
            queue.full.add(key)
            return 0
        kernel = run.kernel
        client = kernel.client
        occupied = self._client_sms.get(client)
        if occupied is None:
            occupied = self._client_sms[client] = {}
        cap = kernel.sm_cap
        budget = len(fits) if cap is None else cap - len(occupied)
        # spread's first two cases, inlined, in its order (fits is 0 outside the window, so spread over
        # the whole list is what the engine asks of it): one block at a time (policies that share), and a
        # busy device where a single SM has room.
        if left == 1 and budget > 0:
            if len(room) < _FEW:  # a busy device: only SMs with room can hold the first one with the most
                top = max([fits[i] for i in room])
                placements = [(min([i for i in room if fits[i] == top]), 1)]
            else:
                top = max(fits)  # > 0: room is not empty
                placements = [(fits.index(top), 1)]
        elif len(room) == 1:
            for i in room:
                break
            if budget <= 0 and i not in occupied:
                return 0  # its SM cap: the room is on an SM it may not add
            f = fits[i]
            placements = [(i, f if f < left else left)]  # noqa: FURB136 (as above)
        else:
            placements = spread(fits, left, budget, occupied, room=room)
        if not placements:  # its SM cap: the room is on SMs it may not add
            return 0
        now = self.now
        sms = self._sms
        need = run.need
        hook = self._placed_hook
        shared = kernel.cost.shared
        dram = kernel.cost.dram
        fresh = run.seconds
        partial = run.partial
        groups = run.groups
        # Fresh fixed-cost groups placed now all end at now + fresh: one heap event carries them all (a
        # wave), handled in placement order, which is the order their own events would have had, since
        # nothing else is pushed while they are placed. Resumed blocks (partial) come first, each with
        # the work it had left, and keep an event apiece.
        wave: list[Group] = []
        placed = 0
        pool = self._dram_pool(client) if dram else None
        if not partial and not shared and not dram:
            # The usual case, fresh fixed-cost blocks only: the loop below with its branches decided
            # (one group per SM, all in the wave), the same steps in the same order.
            end = now + fresh
            warps, regs, smem = need.warps, need.regs, need.smem
            touched = []  # the fit tables are updated once for all of them, after the loop: nothing
            # in it reads them (the placed hook only counts), so they end as per-SM updates leave them
            for i, count in placements:
                sm = sms[i]  # SM.take, inlined
                sm.free_blocks -= count
                sm.free_warps -= warps * count
                sm.free_regs -= regs * count
                sm.free_smem -= smem * count
                sm.resident += count
                touched.append(i)
                occupied[i] = occupied.get(i, 0) + count
                placed += count
                group = Group(run, i, count, now, end, 0.0, 1.0, 1.0, False, fresh)
                wave.append(group)
                groups[group] = None
                if hook is not None:
                    hook(group)
            self._fit_index.changed_many(touched)
            placements = ()
        for i, count in placements:
            sms[i].take(need, count)
            occupied[i] = occupied.get(i, 0) + count
            placed += count
            while count:
                resumed = bool(partial)
                if resumed:
                    entry = partial[0]
                    n, seconds = min(count, entry[0]), entry[1]
                    if kernel.cost.clocked:  # its clock ran on while it was off: entry[1] is its deadline
                        seconds = max(seconds - now, self.spec.min_block_time)
                    entry[0] -= n
                    if not entry[0]:
                        partial.pop(0)
                else:
                    n, seconds = count, fresh
                count -= n
                if shared:
                    group = Group(run, i, n, now, math.nan, seconds, run.demand, 1.0, False, seconds)
                    sms[i].add_shared(group, now)
                    self._touched.add(i)
                elif dram:
                    group = Group(run, i, n, now, math.nan, seconds, 1.0, 1.0, False, seconds)
                    self._dram_of[group] = pool
                    pool.add(group, now)
                    self._dram_touched[pool.key] = pool
                elif resumed:
                    group = Group(run, i, n, now, now + seconds, 0.0, 1.0, 1.0, False, seconds)
                    self._push_groups(group.end, [group])
                else:
                    group = Group(run, i, n, now, now + fresh, 0.0, 1.0, 1.0, False, seconds)
                    wave.append(group)
                groups[group] = None
                if hook is not None:
                    hook(group)
        if placements:  # the fit tables once for them all, as in the usual case above (nothing in the loop reads them)
            self._fit_index.changed_many([i for i, _ in placements])
        if wave:
            self._push_groups(now + fresh, wave)
        run.unplaced -= placed
        run.running += placed
        if not run.unplaced:
            queue.drained_key(key)
        if kernel.started != kernel.started:  # NaN: its first block
            kernel.started = now
        c = run.counters
        if c is None:
            c = run.counters = self._counter(client)
        if len(occupied) > c.max_sms:
            c.max_sms = len(occupied)
        return placed

    def _preempt(self, client: int | None) -> int:
        """Take ``client``'s resident blocks off their SMs now; each resumes later with the work it had left,
        or, if it waits on the clock, with its deadline (blocks whose work is already done end normally
        instead).

        Returns:
            The warps taken off (the state a context switch saves).
        """
        now = self.now
        warps = 0
        for run in list(self._runs.values()):
            if run.kernel.client != client or not run.groups:
                continue
            for group in list(run.groups):
                cost = run.kernel.cost
                if cost.shared or cost.dram:
                    if cost.shared:
                        self._sms[group.sm].remove_shared(group, now)
                        self._touched.add(group.sm)
                        rate = group.rate
                    else:
                        pool = self._dram_of.pop(group)
                        pool.remove(group, now)
                        self._dram_touched[pool.key] = pool
                        rate = pool.rate
                    left = group.remaining
                    if left <= _EPSILON * rate:
                        self._end_group(group)
                        continue
                else:
                    left = group.end - now
                    if left <= 0.0:
                        continue  # its end event is due this very instant
                    if run.kernel.cost.clocked:
                        left = group.end
                group.evicted = True
                self._vacate(group)
                if not run.unplaced:
                    self._queue.add(run)
                run.unplaced += group.count
                run.partial.append([group.count, left])
                warps += group.count * run.need.warps
        return warps

    def _end_fixed(self, groups: list[Group]) -> None:
        """Fixed-cost ``groups`` (one event's, often a whole wave) end now: ``_end_group`` for each, in
        order, skipping evicted ones.

        The same steps as ``_vacate`` then ``_end_group``, group by group in the same order (so the fit
        tables, counters, float sums, trace and completions are the very same), inlined: a wave of a
        large grid ends on every SM at once, and the calls cost more than the work.
        """
        now = self.now
        sms = self._sms
        client_sms = self._client_sms
        hook = self._vacated_hook
        # The fit tables are updated for all the SMs at once at the end: nothing in the loop reads them
        # (the vacated and retired hooks only count; a kernel that finishes only releases ops in stream
        # order, which queues copies and launch-overhead events), so they end as per-group updates would.
        touched = []
        trace = self.trace if self._record else None
        ended = 0
        for group in groups:
            if group.evicted:
                continue
            run = group.run
            count = group.count
            i = group.sm
            del run.groups[group]
            need = run.need
            sm = sms[i]  # SM.release, inlined
            sm.free_blocks += count
            sm.free_warps += need.warps * count
            sm.free_regs += need.regs * count
            sm.free_smem += need.smem * count
            sm.resident -= count
            touched.append(i)
            kernel = run.kernel
            occupied = client_sms[kernel.client]
            left = occupied[i] - count
            if left:
                occupied[i] = left
            else:
                del occupied[i]
            group.end = now
            run.running -= count
            if hook is not None:
                hook(group)
            c = run.counters
            block_seconds = count * (now - group.start)
            c.block_seconds += block_seconds
            c.sm_seconds += block_seconds * run.sm_share
            if trace is not None:
                trace.append(BlockGroup(kernel, i, count, group.start, now))
            ended += 1
            self._blocks += count
            c.blocks += count
            if run.running == 0 and run.unplaced == 0:
                del self._runs[kernel]
                c.kernels += 1
                self._kernels += 1
                self._policy.retired(run)
                self._finish(kernel)
        if ended:
            self._fit_index.changed_many(touched)
            self._dirty = True

    def _end_group(self, group: Group) -> None:
        run = group.run
        self._vacate(group)
        self._blocks += group.count
        c = run.counters
        c.blocks += group.count
        if run.running == 0 and run.unplaced == 0:
            del self._runs[run.kernel]
            c.kernels += 1
            self._kernels += 1
            self._policy.retired(run)
            self._finish(run.kernel)

    def _evict(self, group: Group) -> None:
        """Take a cancelled client's resident group off its SM now; it never completes."""
        group.evicted = True
        if group.run.kernel.cost.shared:
            self._sms[group.sm].remove_shared(group, self.now)
            self._touched.add(group.sm)
        elif group.run.kernel.cost.dram:
            pool = self._dram_of.pop(group)
            pool.remove(group, self.now)
            self._dram_touched[pool.key] = pool
        self._vacate(group)

    def _vacate(self, group: Group) -> None:
        """Give a group's SM resources back and account the SM-time it held."""
        now = self.now
        run = group.run
        kernel = run.kernel
        count = group.count
        i = group.sm
        del run.groups[group]
        self._sms[i].release(run.need, count)
        self._fit_index.changed(i)
        occupied = self._client_sms[kernel.client]
        left = occupied[i] - count
        if left:
            occupied[i] = left
        else:
            del occupied[i]
        group.end = now
        run.running -= count
        self._dirty = True
        if self._vacated_hook is not None:
            self._vacated_hook(group)
        c = run.counters
        block_seconds = count * (now - group.start)
        c.block_seconds += block_seconds
        c.sm_seconds += block_seconds * run.sm_share
        if self._record:
            self.trace.append(BlockGroup(kernel, i, count, group.start, now))
