//! Root-context state shared by all requests of one VM: the configuration, the bounded queue of
//! outcomes waiting to be flushed to `/v1/feedback`, counters, and the "logged once" memory.
//!
//! Envoy runs one VM per worker thread, so each worker flushes its own batches.

use std::collections::VecDeque;
use std::rc::Rc;

use scorer_core::protocol::{FeedbackBatch, Outcome};

use crate::config::FilterConfig;
use crate::machine::{Counter, FailKind, RequestMachine};

/// Most outcomes sent in one feedback call; the rest wait for the next tick.
pub const MAX_BATCH_OUTCOMES: usize = 512;

/// Counters kept inside the VM (the host also mirrors them into proxy metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Requests given a destination header.
    pub routed: u64,
    /// Inference requests let through without routing (see `SkipReason`).
    pub skipped: u64,
    /// Requests released unrouted because something failed.
    pub fail_open: u64,
    /// Requests the control plane refused, answered locally (404, 413, 429).
    pub rejected: u64,
    /// Fail-opens caused by an unparseable request body.
    pub body_parse_errors: u64,
    /// Outcomes dropped because the queue was full.
    pub outcomes_dropped: u64,
    /// Feedback calls answered with a 2xx.
    pub feedback_sent: u64,
    /// Feedback calls that could not start or did not succeed.
    pub feedback_failed: u64,
}

/// A feedback call for the host to dispatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedbackCall {
    /// Serialized [`FeedbackBatch`].
    pub body: Vec<u8>,
    /// Outcomes in the batch.
    pub outcomes: usize,
}

/// The root context's state.
#[derive(Debug)]
pub struct RootState {
    config: Rc<FilterConfig>,
    queue: VecDeque<Outcome>,
    /// When the outstanding feedback call was dispatched.
    feedback_in_flight_since_ms: Option<u64>,
    logged: [bool; FailKind::ALL.len()],
    stats: Stats,
}

impl RootState {
    /// State for a freshly configured root context.
    pub fn new(config: FilterConfig) -> Self {
        RootState {
            config: Rc::new(config),
            queue: VecDeque::new(),
            feedback_in_flight_since_ms: None,
            logged: [false; FailKind::ALL.len()],
            stats: Stats::default(),
        }
    }

    /// The active configuration.
    pub fn config(&self) -> &Rc<FilterConfig> {
        &self.config
    }

    /// A machine for a new request under this configuration.
    pub fn new_request(&self) -> RequestMachine {
        RequestMachine::new(Rc::clone(&self.config))
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Outcomes waiting for a flush.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Counts `counter`; returns true when it is a failure kind seen for the first time, which
    /// the host logs (once per kind, not once per request).
    pub fn count(&mut self, counter: Counter) -> bool {
        match counter {
            Counter::Routed => self.stats.routed += 1,
            Counter::Skipped(_) => self.stats.skipped += 1,
            Counter::Rejected(_) => self.stats.rejected += 1,
            Counter::FailOpen(kind) => {
                self.stats.fail_open += 1;
                if kind == FailKind::BodyParse {
                    self.stats.body_parse_errors += 1;
                }
                let first = !self.logged[kind.index()];
                self.logged[kind.index()] = true;
                return first;
            }
        }
        false
    }

    /// Queues a finished request's outcome; when full, the oldest is dropped (newer outcomes
    /// describe the fleet's current state better). Returns true when one was dropped.
    pub fn push_outcome(&mut self, outcome: Outcome) -> bool {
        let full = self.queue.len() >= self.config.max_queued_outcomes;
        if full {
            self.queue.pop_front();
            self.stats.outcomes_dropped += 1;
        }
        self.queue.push_back(outcome);
        full
    }

    /// On a tick: the next batch to send, unless the queue is empty or a previous call is still
    /// outstanding. A call outstanding for twice its timeout is presumed lost.
    pub fn on_tick(&mut self, now_ms: u64) -> Option<FeedbackCall> {
        if let Some(since) = self.feedback_in_flight_since_ms {
            if now_ms.saturating_sub(since) < self.config.feedback_timeout_ms.saturating_mul(2) {
                return None;
            }
            self.feedback_in_flight_since_ms = None;
            self.stats.feedback_failed += 1;
        }
        if self.queue.is_empty() {
            return None;
        }
        let n = self.queue.len().min(MAX_BATCH_OUTCOMES);
        let batch = FeedbackBatch {
            outcomes: self.queue.drain(..n).collect(),
        };
        match serde_json::to_vec(&batch) {
            Ok(body) => {
                self.feedback_in_flight_since_ms = Some(now_ms);
                Some(FeedbackCall { body, outcomes: n })
            }
            Err(_) => {
                self.stats.feedback_failed += 1;
                None
            }
        }
    }

    /// The host could not start the feedback call. The batch is dropped: feedback is
    /// best-effort and must not grow memory while the control plane is away.
    pub fn on_feedback_dispatch_failed(&mut self) {
        self.feedback_in_flight_since_ms = None;
        self.stats.feedback_failed += 1;
    }

    /// The feedback call finished; `status` is `None` on reset. Returns whether it succeeded.
    pub fn on_feedback_response(&mut self, status: Option<u16>) -> bool {
        self.feedback_in_flight_since_ms = None;
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        if ok {
            self.stats.feedback_sent += 1;
        } else {
            self.stats.feedback_failed += 1;
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(id: u64) -> Outcome {
        Outcome {
            decision_id: id,
            status: 200,
            ..Outcome::default()
        }
    }

    fn batch(call: &FeedbackCall) -> Vec<u64> {
        let b: FeedbackBatch = serde_json::from_slice(&call.body).unwrap();
        b.outcomes.iter().map(|o| o.decision_id).collect()
    }

    #[test]
    fn batches_in_order_one_call_at_a_time() {
        let mut r = RootState::new(FilterConfig::default());
        assert_eq!(r.on_tick(0), None, "nothing queued");
        for id in 1..=MAX_BATCH_OUTCOMES as u64 + 3 {
            r.push_outcome(outcome(id));
        }
        let first = r.on_tick(10).unwrap();
        assert_eq!(first.outcomes, MAX_BATCH_OUTCOMES);
        assert_eq!(batch(&first)[..2], [1, 2]);
        assert_eq!(r.on_tick(20), None, "previous call outstanding");
        assert!(r.on_feedback_response(Some(200)));
        let second = r.on_tick(30).unwrap();
        assert_eq!(batch(&second), [513, 514, 515]);
        assert!(!r.on_feedback_response(None));
        assert_eq!(r.queued(), 0);
        assert_eq!((r.stats().feedback_sent, r.stats().feedback_failed), (1, 1));
    }

    #[test]
    fn lost_call_is_given_up_and_dispatch_failure_drops_batch() {
        let mut r = RootState::new(FilterConfig::default());
        r.push_outcome(outcome(1));
        assert!(r.on_tick(0).is_some());
        r.push_outcome(outcome(2));
        assert_eq!(r.on_tick(1999), None);
        assert_eq!(batch(&r.on_tick(2000).unwrap()), [2]);
        r.on_feedback_dispatch_failed();
        assert_eq!(r.on_tick(2001), None);
        assert_eq!(r.stats().feedback_failed, 2);
    }

    #[test]
    fn queue_is_bounded_dropping_oldest() {
        let mut r = RootState::new(FilterConfig {
            max_queued_outcomes: 3,
            ..FilterConfig::default()
        });
        for id in 1..=5 {
            r.push_outcome(outcome(id));
        }
        assert_eq!(r.stats().outcomes_dropped, 2);
        assert_eq!(batch(&r.on_tick(0).unwrap()), [3, 4, 5]);
    }

    #[test]
    fn failures_log_once_per_kind() {
        let mut r = RootState::new(FilterConfig::default());
        assert!(r.count(Counter::FailOpen(FailKind::Timeout)));
        assert!(!r.count(Counter::FailOpen(FailKind::Timeout)));
        assert!(r.count(Counter::FailOpen(FailKind::BodyParse)));
        assert!(!r.count(Counter::Routed));
        let s = r.stats();
        assert_eq!((s.fail_open, s.body_parse_errors, s.routed), (3, 1, 1));
    }
}
