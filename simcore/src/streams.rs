//! Stream order and cross-stream dependencies, never time: an op is eligible once it heads its stream and
//! every op in its `after` is done or cancelled. Streams are named by the caller's small integers for
//! (client, stream).
//!
//! A stream may also be given a hardware work queue (CUDA_DEVICE_MAX_CONNECTIONS: a context's streams are
//! aliased onto that many in-order queues). Its kernels and markers then also wait until every earlier one of
//! the queue has become eligible: the head of a queue that waits for its own stream blocks the queue, which is
//! the false dependency between streams that share one. Copies go to their engines' own queues, not these.

use crate::hash::{Map, Set};
use crate::ops::{Kind, Ops};
use std::collections::VecDeque;

#[derive(Default)]
pub struct Streams {
    queues: Map<u64, (i64, VecDeque<u64>)>,
    blocked: Map<u64, u32>,
    waiters: Map<u64, Vec<u64>>,
    /// stream -> (its client, its hardware queue); streams without one are not held by any queue.
    queue_of: Map<u64, (i64, u64)>,
    /// hardware queue -> its kernels and markers not yet eligible, in submission order.
    hw: Map<u64, VecDeque<u64>>,
    /// Ops free of their stream and dependencies that wait for their hardware queue's earlier ones.
    parked: Set<u64>,
}

impl Streams {
    /// Alias `stream` (of `client`) onto hardware queue `queue`, for the ops submitted to it from now on.
    pub fn set_queue(&mut self, stream: u64, client: i64, queue: u64) {
        self.queue_of.insert(stream, (client, queue));
    }

    /// `client` is gone for good: its streams' queues go with it (its ops went with drop_client).
    pub fn forget_client(&mut self, client: i64) {
        self.queue_of.retain(|_, (c, _)| *c != client);
    }

    /// Queue a newly submitted op; true if it is eligible right away.
    pub fn add(&mut self, op: u64, ops: &Ops) -> bool {
        let o = ops.at(op);
        if !self.queue_of.is_empty() && o.kind != Kind::Copy {
            if let Some(&(_, q)) = self.queue_of.get(&o.stream) {
                self.hw.entry(q).or_default().push_back(op);
            }
        }
        let q = self.queues.entry(o.stream).or_insert_with(|| (o.client, VecDeque::new()));
        q.1.push_back(op);
        if q.1.len() == 1 && self.arrive(op, ops) {
            let mut eligible = Vec::new();
            self.gate(op, ops, &mut eligible);
            return !eligible.is_empty(); // the queue was empty before it, or it waits: nothing else moves
        }
        false
    }

    /// `op` is free of its stream and its dependencies: eligible if it heads its hardware queue (then the
    /// queue's next ones that were waiting only for it follow), else parked until it does.
    fn gate(&mut self, mut op: u64, ops: &Ops, eligible: &mut Vec<u64>) {
        loop {
            let o = ops.at(op);
            let queue = if self.queue_of.is_empty() || o.kind == Kind::Copy {
                None
            } else {
                self.queue_of.get(&o.stream)
            };
            // set_queue comes before a stream's first op, so each of its kernels and markers is in its line
            let Some(line) = queue.and_then(|&(_, q)| self.hw.get_mut(&q)) else {
                eligible.push(op);
                return;
            };
            let q = queue.unwrap().1;
            if line.front() != Some(&op) {
                self.parked.insert(op);
                return;
            }
            line.pop_front();
            eligible.push(op);
            match line.front().copied() {
                None => {
                    self.hw.remove(&q);
                    return;
                }
                Some(next) if self.parked.remove(&next) => op = next,
                Some(_) => return,
            }
        }
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
                self.gate(h, ops, &mut eligible);
            }
        }
        self.release(op, ops, &mut eligible);
        eligible.sort_by_key(|&h| ops.at(h).seq);
        eligible
    }

    /// `op` will never complete (its client was cancelled): its dependents treat it as done.
    pub fn resolve(&mut self, op: u64, ops: &mut Ops) -> Vec<u64> {
        ops.at_mut(op).cancelled = true;
        ops.touch(op);
        let mut eligible = Vec::new();
        self.release(op, ops, &mut eligible);
        eligible.sort_by_key(|&h| ops.at(h).seq);
        eligible
    }

    fn release(&mut self, op: u64, ops: &Ops, eligible: &mut Vec<u64>) {
        if let Some(ws) = self.waiters.remove(&op) {
            for w in ws {
                let Some(left) = self.blocked.get_mut(&w) else { continue };
                if *left == 1 {
                    self.blocked.remove(&w);
                    self.gate(w, ops, eligible);
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
            self.parked.remove(op);
        }
        self.hw.retain(|_, line| {
            line.retain(|h| ops.at(*h).client != client);
            !line.is_empty()
        });
        dropped.sort_by_key(|&h| ops.at(h).seq);
        dropped
    }
}
