//! The discrete-event queue every fleet-sim model runs on: events in time order, ties in the
//! order they were scheduled, so a run is deterministic.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// A time-ordered queue of `E` (virtual milliseconds).
#[derive(Debug)]
pub struct EventQueue<E> {
    heap: BinaryHeap<Scheduled<E>>,
    seq: u64,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self {
            heap: BinaryHeap::new(),
            seq: 0,
        }
    }
}

impl<E> EventQueue<E> {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Schedules `event` at `at_ms`; events at the same time come out in scheduling order.
    pub fn push(&mut self, at_ms: f64, event: E) {
        self.seq += 1;
        self.heap.push(Scheduled {
            at_ms,
            seq: self.seq,
            event,
        });
    }

    /// The earliest event and its time.
    pub fn pop(&mut self) -> Option<(f64, E)> {
        self.heap.pop().map(|s| (s.at_ms, s.event))
    }
}

#[derive(Debug)]
struct Scheduled<E> {
    at_ms: f64,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Scheduled<E> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl<E> Eq for Scheduled<E> {}
impl<E> PartialOrd for Scheduled<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Scheduled<E> {
    // Reversed: BinaryHeap is a max-heap and the earliest event must come out first.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at_ms
            .total_cmp(&self.at_ms)
            .then(other.seq.cmp(&self.seq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn earliest_first_and_ties_in_scheduling_order() {
        let mut q = EventQueue::new();
        q.push(5.0, "late");
        q.push(1.0, "first");
        q.push(1.0, "second");
        assert_eq!(q.pop(), Some((1.0, "first")));
        assert_eq!(q.pop(), Some((1.0, "second")));
        assert_eq!(q.pop(), Some((5.0, "late")));
        assert_eq!(q.pop(), None);
    }
}
