//! The fit tables: for each (block shape, SM window) in use, how many more blocks fit on every SM and which
//! SMs of the window have room, kept current as SMs take and release blocks. A table is a cache of a pure
//! function of the SMs' free resources, so keeping, dropping or rebuilding one never changes a result; the
//! sweep drops the ones no ready kernel needs so that an SM's change walks only a handful.

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
}

impl FitIndex {
    pub fn get(&self, key: u32) -> Option<&Table> {
        self.tables.get(key as usize).and_then(|t| t.as_ref())
    }

    pub fn changed(&mut self, sms: &[Sm], index: usize) {
        let sm = &sms[index];
        for &k in &self.live {
            let t = self.tables[k as usize].as_mut().unwrap();
            if index < t.lo || index >= t.hi {
                continue;
            }
            let f = fit_of(sm.free_blocks, sm.free_warps, sm.free_regs, sm.free_smem, t.need.warps, t.need.regs,
                           t.need.smem) as u32;
            if f != t.fits[index] {
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
        }
        let t = self.tables[k].as_mut().unwrap();
        t.asked = true;
        t
    }

    /// Drop the tables not asked for since the last sweep whose keys `keep` does not hold.
    pub fn sweep(&mut self, keep: impl Fn(u32) -> bool) {
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
    }
}
