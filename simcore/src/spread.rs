//! Choosing SMs for a grid's blocks: greedy, one block at a time, on the SM with the most room (the rule of
//! `mpsd/sim/policies/base.py`'s `spread`, which this must match block for block).

/// SMs for up to `left` blocks, as (SM index, block count) pairs by SM index.
///
/// Rounds: at level L every usable SM whose fit is at least L takes one block, in index order, for L from the
/// largest fit down to 1, so ties go to the lowest index and a grid spreads before it stacks. An SM the client
/// does not occupy yet costs one unit of `budget`; once it is spent only occupied SMs take blocks (an MPS SM
/// cap counts distinct SMs). `room`, when known, lists the SMs whose fit is not 0, in any order.
pub fn spread(
    fits: &[u32],
    left: u32,
    budget: u32,
    occupied: impl Fn(usize) -> bool,
    lo: usize,
    hi: usize,
    room: Option<&[usize]>,
) -> Vec<(usize, u32)> {
    if left == 1 && budget > 0 {
        // the common small kernel: the first SM with the most room
        let mut best: Option<(usize, u32)> = None;
        for (i, &f) in fits.iter().enumerate().take(hi).skip(lo) {
            if f > best.map_or(0, |b| b.1) {
                best = Some((i, f));
            }
        }
        return best.map(|(i, _)| vec![(i, 1)]).unwrap_or_default();
    }
    let mut cand: Vec<usize> = match room {
        None => (lo..hi).filter(|&i| fits[i] > 0).collect(),
        Some(room) => room.iter().copied().filter(|&i| lo <= i && i < hi).collect(),
    };
    cand.sort_unstable();
    if cand.is_empty() {
        return Vec::new();
    }
    if cand.len() == 1 {
        // a busy device: one SM has room; it takes what fits, if the client may use it
        let i = cand[0];
        return if budget > 0 || occupied(i) { vec![(i, fits[i].min(left))] } else { Vec::new() };
    }
    let budget = budget as usize;
    if budget >= cand.len() || budget >= cand.iter().filter(|&&i| !occupied(i)).count() {
        return spread_uncapped(fits, left, &cand);
    }
    let mut budget = budget;
    let mut left = left;
    let mut taken = vec![0u32; cand.len()];
    let top = cand.iter().map(|&i| fits[i]).max().unwrap_or(0);
    'levels: for level in (1..=top).rev() {
        for (k, &i) in cand.iter().enumerate() {
            if fits[i] < level {
                continue;
            }
            if taken[k] == 0 && !occupied(i) {
                if budget == 0 {
                    continue;
                }
                budget -= 1;
            }
            taken[k] += 1;
            left -= 1;
            if left == 0 {
                break 'levels;
            }
        }
    }
    cand.iter().zip(taken).filter(|&(_, n)| n > 0).map(|(&i, n)| (i, n)).collect()
}

/// `spread` where the budget cannot run out, in closed form: every level above the one where `left` runs out
/// is taken in full, so only the last level is partial, and its first SMs in index order take one more.
fn spread_uncapped(fits: &[u32], left: u32, cand: &[usize]) -> Vec<(usize, u32)> {
    let top = cand.iter().map(|&i| fits[i]).max().unwrap_or(0) as usize;
    let mut at_level = vec![0u32; top + 1];
    for &i in cand {
        at_level[fits[i] as usize] += 1;
    }
    let (mut above, mut reach, mut level) = (0u32, 0u32, top as u32);
    while level > 0 {
        reach += at_level[level as usize];
        if above + reach >= left {
            break;
        }
        above += reach;
        level -= 1;
    }
    if level == 0 {
        return cand.iter().map(|&i| (i, fits[i])).collect();
    }
    let mut extra = left - above;
    let mut out = Vec::new();
    for &i in cand {
        let f = fits[i];
        let mut n = if f > level { f - level } else { 0 };
        if extra > 0 && f >= level {
            n += 1;
            extra -= 1;
        }
        if n > 0 {
            out.push((i, n));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The rule itself, block by block: the reference the fast paths must agree with.
    fn one_by_one(fits: &[u32], mut left: u32, mut budget: u32, occ: &[bool], lo: usize, hi: usize) -> Vec<(usize, u32)> {
        let mut free: Vec<u32> = fits.to_vec();
        let mut taken = vec![0u32; fits.len()];
        while left > 0 {
            let mut best: Option<usize> = None;
            for i in lo..hi {
                let usable = taken[i] > 0 || occ[i] || budget > 0;
                if free[i] > 0 && usable && best.map_or(true, |b| free[i] > free[b]) {
                    best = Some(i);
                }
            }
            let Some(i) = best else { break };
            if taken[i] == 0 && !occ[i] {
                budget -= 1;
            }
            taken[i] += 1;
            free[i] -= 1;
            left -= 1;
        }
        (0..fits.len()).filter(|&i| taken[i] > 0).map(|i| (i, taken[i])).collect()
    }

    proptest! {
        #[test]
        fn matches_block_by_block(fits in prop::collection::vec(0u32..5, 1..24), left in 1u32..40,
                                  budget in 0u32..30, occ_bits in any::<u32>(), a in 0usize..24, b in 0usize..24) {
            let n = fits.len();
            let (lo, hi) = (a.min(b) % n, (a.max(b) % n) + 1);
            let (lo, hi) = if lo < hi { (lo, hi) } else { (0, n) };
            let occ: Vec<bool> = (0..n).map(|i| occ_bits >> i & 1 == 1).collect();
            let got = spread(&fits, left, budget, |i| occ[i], lo, hi, None);
            prop_assert_eq!(got, one_by_one(&fits, left, budget, &occ, lo, hi));
        }
    }

    #[test]
    fn a_cap_counts_distinct_sms() {
        // two SMs of room 3 and a budget of one new SM: the occupied one stacks, the other takes one
        let got = spread(&[3, 3, 3], 6, 1, |i| i == 2, 0, 3, None);
        assert_eq!(got, vec![(0, 3), (2, 3)]);
    }
}
