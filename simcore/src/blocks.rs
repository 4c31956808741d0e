//! Blocks onto SMs and off again: placement (spreading a grid over the SMs with room, resuming preempted
//! blocks first), the end of fixed-cost groups (a whole wave at a time), preemption, eviction and the
//! accounting every departure does. It is the engine's hot path. The fit tables are updated once for all the
//! SMs of a placement or of a wave's end, after the loop: nothing in it reads them (the policy's group hooks
//! only count; a kernel that finishes only releases ops in stream order, which queues copies and launch-
//! overhead events), so they end as per-SM updates would leave them.

use crate::engine::Core;
use crate::events::GROUP_END;
use crate::ops::Group;
use crate::policy::Policy;
use crate::sms::EPSILON;

impl Core {
    /// Schedule the end of fixed-cost `groups` at `time`, in one event with those pushed just before if that
    /// event ends groups at the same time and is surely still in the heap (nothing between them in (time,
    /// seq) order, so handling them in one event is handling them one after the other).
    pub fn push_groups(&mut self, time: f64, groups: Vec<u32>) {
        if let Some(last) = self.ev.last {
            if last.time == time && last.kind == GROUP_END {
                self.ev.list_mut(last.a).extend_from_slice(&groups);
                self.ev.recycle(groups);
                return;
            }
        }
        self.ev.push_list(time, groups);
    }

    /// Place up to `limit` of `run`'s unplaced blocks where they fit, within its client's SM cap and the SMs
    /// the policy lets it use; preempted blocks go first with the work they had left. Returns blocks placed.
    pub fn place(&mut self, pol: &mut dyn Policy, run: u64, limit: i64) -> i64 {
        let (mut left, key, client, ci, cap) = {
            let o = self.ops.at(run);
            (o.unplaced, o.key, o.client, o.ci, o.sm_cap)
        };
        if limit < left {
            left = limit;
        }
        if left <= 0 {
            return 0;
        }
        if self.ready.is_full(key) {
            return 0;
        }
        if self.fit.get(key).is_none() {
            self.ready.lookup(&mut self.fit, &self.sms, key);
        }
        if self.fit.get(key).unwrap().room.is_empty() {
            self.ready.set_full(key);
            return 0;
        }
        let n = self.sms.len();
        if self.cl[ci].occupied.is_empty() {
            self.cl[ci].occupied = vec![0; n];
        }
        let occ_len = self.cl[ci].occ_len;
        let budget = match cap { None => n as i64, Some(c) => c - occ_len };
        let mut placements = std::mem::take(&mut self.place_buf);
        placements.clear();
        {
            let t = self.fit.get(key).unwrap();
            let occupied = &self.cl[ci].occupied;
            if left == 1 && budget > 0 {
                let (mut best, mut top) = (0, 0);
                for i in t.room.iter() {
                    if t.fits[i] > top {
                        top = t.fits[i];
                        best = i;
                    }
                }
                placements.push((best, 1));
            } else if t.room.len() == 1 {
                let i = t.room.iter().next().unwrap();
                if budget <= 0 && occupied[i] == 0 {
                    self.place_buf = placements;
                    return 0;
                }
                let f = t.fits[i] as i64;
                placements.push((i, if f < left { f } else { left }));
            } else {
                let room = t.room.to_vec();
                placements.extend(crate::spread::spread(&t.fits, left.min(u32::MAX as i64) as u32,
                                                        budget.max(0) as u32, |i| occupied[i] > 0, 0, n, Some(&room))
                    .into_iter().map(|(i, c)| (i, c as i64)));
            }
        }
        if placements.is_empty() {
            self.place_buf = placements;
            return 0;
        }
        let now = self.now;
        let hooks = pol.group_hooks();
        let (need, cost, fresh, demand, has_partial) = {
            let o = self.ops.at(run);
            (o.need, o.cost, o.seconds, o.demand, !o.partial.is_empty())
        };
        let mut wave: Vec<u32> = self.ev.fresh_list();
        let mut placed = 0;
        let pool = if cost.dram { Some(self.dram_pool(pol, client)) } else { None };
        if !has_partial && !cost.shared && !cost.dram {
            // The usual case, fresh fixed-cost blocks only: one group per SM, all in the wave; the fit tables
            // once for them all afterwards (nothing in the loop reads them).
            let end = now + fresh;
            let mut touched = std::mem::take(&mut self.sm_buf);
            touched.clear();
            for &(i, count) in &placements {
                self.sms[i].take(&need, count);
                touched.push(i);
                self.occupy(ci, i, count);
                placed += count;
                let gid = self.new_group(run, i, count, now, end, 0.0, 1.0, fresh);
                wave.push(gid);
                if hooks {
                    pol.placed(self, gid);
                }
            }
            self.fit.changed_many(&self.sms, &touched);
            self.sm_buf = touched;
        } else {
            for &(i, count) in &placements {
                self.sms[i].take(&need, count);
                self.occupy(ci, i, count);
                placed += count;
                let mut count = count;
                while count > 0 {
                    let resumed = !self.ops.at(run).partial.is_empty();
                    let (k, seconds) = if resumed {
                        let min_block = self.spec.min_block_time;
                        let o = self.ops.at_mut(run);
                        let entry = o.partial.front_mut().unwrap();
                        let k = if count < entry.0 { count } else { entry.0 };
                        let mut seconds = entry.1;
                        if cost.clocked {
                            let s = seconds - now;
                            seconds = if min_block > s { min_block } else { s };
                        }
                        entry.0 -= k;
                        if entry.0 == 0 {
                            o.partial.pop_front();
                        }
                        (k, seconds)
                    } else {
                        (count, fresh)
                    };
                    count -= k;
                    let gid;
                    if cost.shared {
                        gid = self.new_group(run, i, k, now, f64::NAN, seconds, demand, seconds);
                        self.sms[i].add_shared(gid, now, &mut self.groups);
                        self.touch_sm(i);
                    } else if cost.dram {
                        gid = self.new_group(run, i, k, now, f64::NAN, seconds, 1.0, seconds);
                        let key = pool.unwrap();
                        self.groups.at_mut(gid).pool = key;
                        let p = self.dram.get_mut(&key).unwrap();
                        p.add(&self.spec.dram, gid, now, &self.groups, &self.ops);
                        self.touch_pool(key);
                    } else if resumed {
                        gid = self.new_group(run, i, k, now, now + seconds, 0.0, 1.0, seconds);
                        let end = self.groups.at(gid).end;
                        self.push_groups(end, vec![gid]);
                    } else {
                        gid = self.new_group(run, i, k, now, now + fresh, 0.0, 1.0, seconds);
                        wave.push(gid);
                    }
                    if hooks {
                        pol.placed(self, gid);
                    }
                }
            }
            for &(i, _) in &placements {
                self.fit.changed(&self.sms, i);
            }
        }
        if !wave.is_empty() {
            self.push_groups(now + fresh, wave);
        } else {
            self.ev.recycle(wave);
        }
        self.place_buf = placements;
        let o = self.ops.at_mut(run);
        o.unplaced -= placed;
        o.running += placed;
        let drained = o.unplaced == 0;
        let first = o.started.is_nan();
        if first {
            o.started = now;
        }
        if drained {
            self.ready.drained_key(key);
        }
        if first {
            self.ops.touch(run);
        }
        let occ_len = self.cl[ci].occ_len;
        let c = self.counter(ci);
        if occ_len > c.max_sms {
            c.max_sms = occ_len;
        }
        placed
    }

    #[allow(clippy::too_many_arguments)]
    fn new_group(&mut self, run: u64, sm: usize, count: i64, start: f64, end: f64, remaining: f64, demand: f64,
                 planned: f64) -> u32 {
        let gid = self.groups.insert(Group { run, sm: sm as u32, count, start, end, remaining, demand, rate: 1.0,
                                             evicted: false, planned, slot: 0, pool: u64::MAX });
        let slot = self.ops.at_mut(run).add_group(gid);
        self.groups.at_mut(gid).slot = slot;
        gid
    }

    #[inline]
    fn occupy(&mut self, ci: usize, i: usize, count: i64) {
        let c = &mut self.cl[ci];
        if c.occupied[i] == 0 {
            c.occ_len += 1;
        }
        c.occupied[i] += count;
    }

    #[inline]
    fn unoccupy(&mut self, ci: usize, i: usize, count: i64) {
        let c = &mut self.cl[ci];
        c.occupied[i] -= count;
        if c.occupied[i] == 0 {
            c.occ_len -= 1;
        }
    }

    fn unlink(&mut self, gid: u32) {
        let g = *self.groups.at(gid);
        let o = self.ops.at_mut(g.run);
        o.groups[g.slot as usize] = u32::MAX;
        o.live_groups -= 1;
        if o.live_groups == 0 {
            o.groups.clear();
        } else if o.groups.len() > 64 && o.groups.len() > 4 * o.live_groups as usize {
            o.groups.retain(|&x| x != u32::MAX);
            let ids = o.groups.clone();
            for (k, x) in ids.into_iter().enumerate() {
                self.groups.at_mut(x).slot = k as u32;
            }
        }
    }

    /// Fixed-cost `groups` (one event's, often a whole wave) end now, in order, skipping evicted ones: the
    /// steps of `vacate` then `end_group`, with one fit-table update for all their SMs at the end.
    pub fn end_fixed(&mut self, pol: &mut dyn Policy, groups: &[u32]) {
        let now = self.now;
        let hooks = pol.group_hooks();
        let mut touched = std::mem::take(&mut self.sm_buf);
        touched.clear();
        let mut ended = 0;
        for &gid in groups {
            let g = *self.groups.at(gid);
            if g.evicted {
                continue;
            }
            self.unlink(gid);
            let i = g.sm as usize;
            let (need, ci, sm_share) = {
                let o = self.ops.at(g.run);
                (o.need, o.ci, o.sm_share)
            };
            self.sms[i].release(&need, g.count);
            touched.push(i);
            self.unoccupy(ci, i, g.count);
            self.groups.at_mut(gid).end = now;
            self.ops.at_mut(g.run).running -= g.count;
            if hooks {
                pol.vacated(self, gid);
            }
            let c = self.counter(ci);
            let block_seconds = g.count as f64 * (now - g.start);
            c.block_seconds += block_seconds;
            c.sm_seconds += block_seconds * sm_share;
            if self.record {
                self.trace.push((g.run, g.sm, g.count, g.start, now));
            }
            ended += 1;
            self.blocks += g.count;
            let c = self.counter(ci);
            c.blocks += g.count;
            self.retire_if_done(pol, g.run, ci);
        }
        if ended > 0 {
            self.fit.changed_many(&self.sms, &touched);
            self.dirty = true;
        }
        self.sm_buf = touched;
    }

    fn retire_if_done(&mut self, pol: &mut dyn Policy, run: u64, ci: usize) {
        let o = self.ops.at(run);
        if o.running == 0 && o.unplaced == 0 {
            self.ops.at_mut(run).has_run = false;
            self.counter(ci).kernels += 1;
            self.kernels += 1;
            pol.retired(self, run);
            self.finish(pol, run);
        }
    }

    /// A shared or dram group's work is done now.
    pub fn end_group(&mut self, pol: &mut dyn Policy, gid: u32) {
        self.vacate(pol, gid);
        let g = *self.groups.at(gid);
        self.blocks += g.count;
        let ci = self.ops.at(g.run).ci;
        self.counter(ci).blocks += g.count;
        self.retire_if_done(pol, g.run, ci);
    }

    /// Take a cancelled client's resident group off its SM now; it never completes.
    pub fn evict(&mut self, pol: &mut dyn Policy, gid: u32) {
        self.groups.at_mut(gid).evicted = true;
        let g = *self.groups.at(gid);
        let cost = self.ops.at(g.run).cost;
        if cost.shared {
            self.sms[g.sm as usize].remove_shared(gid, self.now, &mut self.groups);
            self.touch_sm(g.sm as usize);
        } else if cost.dram {
            let key = g.pool;
            self.groups.at_mut(gid).pool = u64::MAX;
            let p = self.dram.get_mut(&key).unwrap();
            p.remove(&self.spec.dram, gid, self.now, &mut self.groups, &self.ops);
            self.touch_pool(key);
        }
        self.vacate(pol, gid);
    }

    /// Give a group's SM resources back and account the SM-time it held.
    pub fn vacate(&mut self, pol: &mut dyn Policy, gid: u32) {
        let now = self.now;
        let g = *self.groups.at(gid);
        self.unlink(gid);
        let i = g.sm as usize;
        let (need, ci, sm_share) = {
            let o = self.ops.at(g.run);
            (o.need, o.ci, o.sm_share)
        };
        self.sms[i].release(&need, g.count);
        self.fit.changed(&self.sms, i);
        self.unoccupy(ci, i, g.count);
        self.groups.at_mut(gid).end = now;
        self.ops.at_mut(g.run).running -= g.count;
        self.dirty = true;
        if pol.group_hooks() {
            pol.vacated(self, gid);
        }
        let c = self.counter(ci);
        let block_seconds = g.count as f64 * (now - g.start);
        c.block_seconds += block_seconds;
        c.sm_seconds += block_seconds * sm_share;
        if self.record {
            self.trace.push((g.run, g.sm, g.count, g.start, now));
        }
    }

    /// Take `client`'s resident blocks off their SMs now; each resumes later with the work it had left, or,
    /// if it waits on the clock, with its deadline (blocks whose work is already done end normally instead).
    /// Returns the warps taken off.
    pub fn preempt(&mut self, pol: &mut dyn Policy, client: i64) -> i64 {
        let now = self.now;
        let mut warps = 0;
        // Python walks its runs in submission order
        let mut runs: Vec<u64> = (0..self.ops.v.len())
            .filter(|&i| {
                let o = &self.ops.v[i];
                o.kind == crate::ops::Kind::Kernel && o.has_run && o.client == client && o.live_groups > 0
            })
            .map(|i| self.ops.handle(i))
            .collect();
        runs.sort_by_key(|&h| self.ops.at(h).seq);
        for run in runs {
            for gid in self.ops.at(run).group_ids() {
                let cost = self.ops.at(run).cost;
                let left;
                if cost.shared || cost.dram {
                    let rate;
                    let g = *self.groups.at(gid);
                    if cost.shared {
                        self.sms[g.sm as usize].remove_shared(gid, now, &mut self.groups);
                        self.touch_sm(g.sm as usize);
                        rate = self.groups.at(gid).rate;
                    } else {
                        let key = g.pool;
                        self.groups.at_mut(gid).pool = u64::MAX;
                        let p = self.dram.get_mut(&key).unwrap();
                        p.remove(&self.spec.dram, gid, now, &mut self.groups, &self.ops);
                        rate = p.rate;
                        self.touch_pool(key);
                    }
                    left = self.groups.at(gid).remaining;
                    if left <= EPSILON * rate {
                        self.end_group(pol, gid);
                        self.groups.free(gid);
                        continue;
                    }
                } else {
                    let end = self.groups.at(gid).end;
                    let l = end - now;
                    if l <= 0.0 {
                        continue; // its end event is due this very instant
                    }
                    left = if cost.clocked { end } else { l };
                }
                self.groups.at_mut(gid).evicted = true;
                self.vacate(pol, gid);
                let count = self.groups.at(gid).count;
                if self.ops.at(run).unplaced == 0 {
                    let w = |c: i64| pol.window(c);
                    self.ready.add(run, &mut self.ops, &w);
                }
                let o = self.ops.at_mut(run);
                o.unplaced += count;
                o.partial.push_back((count, left));
                warps += count * o.need.warps;
                if cost.shared || cost.dram {
                    self.groups.free(gid);
                }
            }
        }
        warps
    }
}
