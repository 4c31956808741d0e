//! A set of SM indices as a bitset: which SMs of a fit table have room. Iterates in index order, which is the
//! order every use of it sorts into anyway.

#[derive(Clone, Default)]
pub struct Room {
    bits: Vec<u64>,
    len: u32,
}

impl Room {
    pub fn new(n: usize) -> Self {
        Room { bits: vec![0; n.div_ceil(64)], len: 0 }
    }
    #[inline]
    pub fn add(&mut self, i: usize) {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        if self.bits[w] & b == 0 {
            self.bits[w] |= b;
            self.len += 1;
        }
    }
    #[inline]
    pub fn discard(&mut self, i: usize) {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        if self.bits[w] & b != 0 {
            self.bits[w] &= !b;
            self.len -= 1;
        }
    }
    #[inline]
    pub fn len(&self) -> usize {
        self.len as usize
    }
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.bits.iter().enumerate().flat_map(|(w, &word)| {
            let mut word = word;
            std::iter::from_fn(move || {
                if word == 0 {
                    return None;
                }
                let t = word.trailing_zeros() as usize;
                word &= word - 1;
                Some(w * 64 + t)
            })
        })
    }
    pub fn to_vec(&self) -> Vec<usize> {
        self.iter().collect()
    }
}
