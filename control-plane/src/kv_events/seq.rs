//! Sequence bookkeeping of one publisher connection, free of I/O.
//!
//! vLLM numbers its batches from 0 per publisher (one per data-parallel rank). A subscriber
//! that sees the next number applies the batch; a jump forward is a gap (ask the replay socket
//! for what was missed); a number that goes backwards is either a batch also received through a
//! replay (identical payload) or a restarted publisher.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;

/// Replayed payloads remembered to recognise the same batch arriving live.
const RECENT_CAP: usize = 4096;

/// What to do with a batch that arrived on the live socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The next batch of its rank: apply it.
    Apply,
    /// Already applied through a replay: drop it.
    Duplicate,
    /// Batches `from..seq` of this rank are missing: replay them, then apply this one.
    Gap {
        /// First missing sequence number.
        from: u64,
    },
    /// The sequence went backwards with a different payload: the publisher restarted, its
    /// cache is gone; drop the endpoint's state, then apply this batch.
    Restart,
}

/// Last applied sequence number per data-parallel rank, plus recently replayed payloads.
#[derive(Debug, Default)]
pub struct SeqTracker {
    last: HashMap<u32, u64>,
    recent: BTreeMap<(u32, u64), Bytes>,
}

impl SeqTracker {
    /// A tracker that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Classifies a live batch `seq` of `rank` with raw `payload`. Does not record it: call
    /// [`SeqTracker::applied`] once it is applied.
    pub fn classify(&self, rank: u32, seq: u64, payload: &[u8]) -> Verdict {
        let Some(&last) = self.last.get(&rank) else {
            // Nothing seen yet: batch 0 starts the history, anything later means it began
            // before we listened.
            return if seq == 0 {
                Verdict::Apply
            } else {
                Verdict::Gap { from: 0 }
            };
        };
        if seq == last.wrapping_add(1) {
            Verdict::Apply
        } else if seq > last {
            Verdict::Gap { from: last + 1 }
        } else if self
            .recent
            .get(&(rank, seq))
            .is_some_and(|p| p.as_ref() == payload)
        {
            Verdict::Duplicate
        } else {
            Verdict::Restart
        }
    }

    /// Records that batch `seq` of `rank` was applied live.
    pub fn applied(&mut self, rank: u32, seq: u64) {
        self.last.insert(rank, seq);
    }

    /// Records that batch `seq` of `rank` was applied from a replay; its payload is kept so the
    /// same batch arriving live is recognised as a duplicate.
    pub fn replayed(&mut self, rank: u32, seq: u64, payload: Bytes) {
        let last = self.last.entry(rank).or_insert(seq);
        *last = (*last).max(seq);
        self.recent.insert((rank, seq), payload);
        while self.recent.len() > RECENT_CAP {
            self.recent.pop_first();
        }
    }

    /// Last applied sequence number of `rank`.
    pub fn last(&self, rank: u32) -> Option<u64> {
        self.last.get(&rank).copied()
    }

    /// Forgets everything (publisher restart, undecodable batch): the next batch starts afresh.
    pub fn reset(&mut self) {
        self.last.clear();
        self.recent.clear();
    }

    /// Every rank's last applied sequence number, by rank.
    pub fn snapshot(&self) -> BTreeMap<u32, u64> {
        self.last.iter().map(|(r, s)| (*r, *s)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_gap_duplicate_restart() {
        let mut t = SeqTracker::new();
        assert_eq!(
            t.classify(0, 5, b"a"),
            Verdict::Gap { from: 0 },
            "joined late"
        );
        assert_eq!(
            t.classify(0, 0, b"a"),
            Verdict::Apply,
            "joined at the start"
        );
        t.applied(0, 5);
        assert_eq!(t.classify(0, 6, b"b"), Verdict::Apply);
        t.applied(0, 6);
        assert_eq!(t.classify(0, 9, b"e"), Verdict::Gap { from: 7 });
        t.replayed(0, 7, Bytes::from_static(b"c"));
        t.replayed(0, 8, Bytes::from_static(b"d"));
        t.replayed(0, 9, Bytes::from_static(b"e"));
        assert_eq!(t.last(0), Some(9));
        assert_eq!(t.classify(0, 9, b"e"), Verdict::Duplicate);
        assert_eq!(t.classify(0, 8, b"d"), Verdict::Duplicate);
        assert_eq!(t.classify(0, 10, b"f"), Verdict::Apply);
        assert_eq!(t.classify(0, 0, b"new"), Verdict::Restart);
        assert_eq!(t.classify(0, 8, b"other"), Verdict::Restart);
        assert_eq!(
            t.classify(1, 0, b"x"),
            Verdict::Apply,
            "ranks are independent"
        );
        assert_eq!(t.classify(1, 2, b"x"), Verdict::Gap { from: 0 });
        t.reset();
        assert_eq!(t.classify(0, 0, b"new"), Verdict::Apply);
        assert!(t.snapshot().is_empty());
    }

    #[test]
    fn recent_payloads_are_bounded() {
        let mut t = SeqTracker::new();
        for seq in 0..(RECENT_CAP as u64 + 10) {
            t.replayed(0, seq, Bytes::from_static(b"p"));
        }
        assert_eq!(t.recent.len(), RECENT_CAP);
        assert_eq!(t.classify(0, 3, b"p"), Verdict::Restart, "forgotten");
    }
}
