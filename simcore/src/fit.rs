//! The fit tables: for each (block shape, SM window) in use, how many more blocks fit on every SM and which
//! SMs of the window have room, kept current as SMs take and release blocks. A table is a cache of a pure
//! function of the SMs' free resources, so keeping, dropping or rebuilding one never changes a result; the
//! sweep drops the ones no ready kernel needs so that an SM's change walks only a handful.

use crate::hash::Map;
use crate::ops::Need;
use crate::room::Room;
use crate::sms::{fit_of, Sm};

pub struct Table {
    pub fits: Vec<u32>,
    pub room: Room,
    need: Need,
    lo: usize,
    hi: usize,
    asked: bool,
}

#[derive(Default)]
pub struct FitIndex {
    /// By key (the ready queue's small integers).
    pub tables: Vec<Option<Table>>,
    live: Vec<u32>,
    pub changes: u64,
    /// The fit in every live table (in `live`'s order) of an SM with these free (blocks, warps, regs, smem):
    /// a pure function of them, and a busy device cycles through a few hundred such states, so looking a row
    /// up gives the very numbers computing it would. Emptied whenever a table comes or goes.
    memo: Map<(i64, i64, i64, i64), Box<[u32]>>,
}

const MEMO_LIMIT: usize = 1 << 16; // rows remembered at most

impl FitIndex {
    pub fn get(&self, key: u32) -> Option<&Table> {
        self.tables.get(key as usize).and_then(|t| t.as_ref())
    }

    pub fn changed(&mut self, sms: &[Sm], index: usize) {
        let sm = &sms[index];
        let state = (sm.free_blocks, sm.free_warps, sm.free_regs, sm.free_smem);
        let row = match self.memo.get(&state) {
            Some(row) => row,
            None => {
                if self.memo.len() >= MEMO_LIMIT {
                    self.memo.clear();
                }
                let row: Box<[u32]> = self.live.iter().map(|&k| {
                    let t = self.tables[k as usize].as_ref().unwrap();
                    fit_of(state.0, state.1, state.2, state.3, t.need.warps, t.need.regs, t.need.smem) as u32
                }).collect();
                self.memo.entry(state).or_insert(row)
            }
        };
        for (n, &k) in self.live.iter().enumerate() {
            let t = self.tables[k as usize].as_mut().unwrap();
            let f = row[n];
            if f != t.fits[index] && t.lo <= index && index < t.hi {
                t.fits[index] = f;
                if f != 0 {
                    t.room.add(index);
                } else {
                    t.room.discard(index);
                }
            }
        }
        self.changes += 1;
    }

    pub fn changed_many(&mut self, sms: &[Sm], indices: &[usize]) {
        for &i in indices {
            self.changed(sms, i);
        }
    }

    /// The table of `need` in SMs lo..hi filed under `key`, made if it is not there.
    pub fn lookup(&mut self, sms: &[Sm], key: u32, need: Need, lo: usize, hi: usize) -> &Table {
        let k = key as usize;
        if self.tables.len() <= k {
            self.tables.resize_with(k + 1, || None);
        }
        if self.tables[k].is_none() {
            let mut room = Room::new(sms.len());
            let fits: Vec<u32> = sms.iter().enumerate()
                .map(|(i, sm)| if lo <= i && i < hi { sm.fit(&need) as u32 } else { 0 })
                .collect();
            for (i, &f) in fits.iter().enumerate() {
                if f != 0 {
                    room.add(i);
                }
            }
            self.tables[k] = Some(Table { fits, room, need, lo, hi, asked: true });
            self.live.push(key);
            self.memo.clear();
        }
        let t = self.tables[k].as_mut().unwrap();
        t.asked = true;
        t
    }

    /// Drop the tables not asked for since the last sweep whose keys `keep` does not hold.
    pub fn sweep(&mut self, keep: impl Fn(u32) -> bool) {
        let before = self.live.len();
        let tables = &mut self.tables;
        self.live.retain(|&k| {
            let t = tables[k as usize].as_mut().unwrap();
            let stay = t.asked || keep(k);
            t.asked = false;
            if !stay {
                tables[k as usize] = None;
            }
            stay
        });
        if self.live.len() != before {
            self.memo.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every table equals a fresh fit of each SM in its window (0 outside) and its room the SMs with a fit,
    /// after any takes and releases (told one by one or in batches), tables added late, and sweeps.
    fn check(index: &mut FitIndex, sms: &[Sm], keys: &[(u32, Need, usize, usize)]) {
        for &(key, need, lo, hi) in keys {
            let t = index.lookup(sms, key, need, lo, hi);
            let want: Vec<u32> = sms.iter().enumerate()
                .map(|(i, sm)| if lo <= i && i < hi { sm.fit(&need) as u32 } else { 0 }).collect();
            assert_eq!(t.fits, want);
            assert_eq!(t.room.to_vec(), (0..sms.len()).filter(|&i| want[i] > 0).collect::<Vec<_>>());
        }
    }

    proptest! {
        #[test]
        fn tables_stay_exact(steps in prop::collection::vec((0usize..132, 0usize..4, any::<bool>(), 0u8..100), 1..400)) {
            let needs = [Need { warps: 4, regs: 4096, smem: 1024 }, Need { warps: 32, regs: 32768, smem: 1024 },
                         Need { warps: 8, regs: 16384, smem: 17408 }, Need { warps: 3, regs: 0, smem: 1024 }];
            let windows = [(0, 132), (0, 60), (60, 120)];
            let mut sms: Vec<Sm> = (0..132).map(|_| Sm::empty(64, 32, 65536, 233472)).collect();
            let mut index = FitIndex::default();
            let mut keys: Vec<(u32, Need, usize, usize)> = Vec::new();
            let mut resident: Vec<(usize, Need, i64)> = Vec::new();
            let mut pending: Vec<usize> = Vec::new();
            for (step, &(i, n, release, r)) in steps.iter().enumerate() {
                if step % 50 == 0 {
                    index.changed_many(&sms, &pending);
                    pending.clear();
                    check(&mut index, &sms, &keys);
                    let (lo, hi) = windows[r as usize % 3];
                    keys.push((keys.len() as u32, needs[n], lo, hi));
                    let &(k, need, lo, hi) = keys.last().unwrap();
                    index.lookup(&sms, k, need, lo, hi);
                }
                if step % 170 == 169 {
                    index.changed_many(&sms, &pending);
                    pending.clear();
                    check(&mut index, &sms, &keys);
                    index.sweep(|_| false);
                }
                let need = needs[n];
                let changed = if release && !resident.is_empty() {
                    let (j, gone, count) = resident.remove(r as usize % resident.len());
                    sms[j].release(&gone, count);
                    Some(j)
                } else if sms[i].fit(&need) > 0 {
                    let count = 1 + r as i64 % sms[i].fit(&need);
                    sms[i].take(&need, count);
                    resident.push((i, need, count));
                    Some(i)
                } else {
                    None
                };
                if let Some(j) = changed {
                    if r % 2 == 0 { pending.push(j) } else { index.changed_many(&sms, &pending); pending.clear(); index.changed(&sms, j) }
                }
            }
            index.changed_many(&sms, &pending);
            check(&mut index, &sms, &keys);
        }
    }
}
