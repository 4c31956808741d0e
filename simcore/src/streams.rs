//! Stream order and cross-stream dependencies, never time: an op is eligible once it heads its stream and
//! every op in its `after` is done or cancelled. Streams are named by the caller's small integers for
//! (client, stream).

use crate::ops::Ops;
use crate::hash::Map;
use std::collections::VecDeque;

#[derive(Default)]
pub struct Streams {
    queues: Map<u64, (i64, VecDeque<u64>)>,
    blocked: Map<u64, u32>,
    waiters: Map<u64, Vec<u64>>,
}

impl Streams {
    /// Queue a newly submitted op; true if it is eligible right away.
    pub fn add(&mut self, op: u64, ops: &Ops) -> bool {
        let o = ops.at(op);
        let q = self.queues.entry(o.stream).or_insert_with(|| (o.client, VecDeque::new()));
        q.1.push_back(op);
        q.1.len() == 1 && self.arrive(op, ops)
    }

    fn arrive(&mut self, op: u64, ops: &Ops) -> bool {
        let mut pending = 0;
        for &dep in &ops.at(op).after {
            let over = match ops.get(dep) {
                Some(d) => d.done || d.cancelled,
                None => true, // reclaimed: it was done or cancelled
            };
            if !over {
                self.waiters.entry(dep).or_default().push(op);
                pending += 1;
            }
        }
        if pending > 0 {
            self.blocked.insert(op, pending);
        }
        pending == 0
    }

    /// `op` completed: advance its stream and release its dependents, in submission order.
    pub fn complete(&mut self, op: u64, ops: &Ops) -> Vec<u64> {
        let mut eligible = Vec::new();
        let stream = ops.at(op).stream;
        let mut head = None;
        if let Some((_, q)) = self.queues.get_mut(&stream) {
            if q.front() == Some(&op) {
                q.pop_front();
                if let Some(&h) = q.front() {
                    head = Some(h);
                } else {
                    self.queues.remove(&stream);
                }
            }
        }
        if let Some(h) = head {
            if self.arrive(h, ops) {
                eligible.push(h);
            }
        }
        self.release(op, &mut eligible);
        eligible.sort_by_key(|&h| ops.at(h).seq);
        eligible
    }

    /// `op` will never complete (its client was cancelled): its dependents treat it as done.
    pub fn resolve(&mut self, op: u64, ops: &mut Ops) -> Vec<u64> {
        ops.at_mut(op).cancelled = true;
        ops.touch(op);
        let mut eligible = Vec::new();
        self.release(op, &mut eligible);
        eligible.sort_by_key(|&h| ops.at(h).seq);
        eligible
    }

    fn release(&mut self, op: u64, eligible: &mut Vec<u64>) {
        if let Some(ws) = self.waiters.remove(&op) {
            for w in ws {
                let Some(left) = self.blocked.get_mut(&w) else { continue };
                if *left == 1 {
                    self.blocked.remove(&w);
                    eligible.push(w);
                } else {
                    *left -= 1;
                }
            }
        }
    }

    /// Forget every queued op of `client`; the ops removed, in submission order.
    pub fn drop_client(&mut self, client: i64, ops: &Ops) -> Vec<u64> {
        let keys: Vec<u64> = self.queues.iter().filter(|(_, (c, _))| *c == client).map(|(&k, _)| k).collect();
        let mut dropped = Vec::new();
        for k in keys {
            dropped.extend(self.queues.remove(&k).unwrap().1);
        }
        for op in &dropped {
            self.blocked.remove(op);
        }
        dropped.sort_by_key(|&h| ops.at(h).seq);
        dropped
    }
}
