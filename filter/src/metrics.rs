//! The filter's proxy metrics, one definition for every host that runs it (proxy-wasm's
//! `define_metric`, Envoy's dynamic-module counters): the names dashboards and alerts read, and
//! which of them each machine [`Counter`] and each tick call bumps.

use crate::machine::{Counter, FailKind};

/// The host's ids of the filter's metrics (`u32` in proxy-wasm, `usize` in Envoy's dynamic
/// modules); `None` where the host refused to define one, which costs a count, never a request.
#[derive(Debug, Clone, Copy, Default)]
#[allow(missing_docs)] // Each field is the metric of the same name, `kvroute_` before it.
pub struct MetricIds<T> {
    pub requests_routed: Option<T>,
    pub requests_skipped: Option<T>,
    pub fail_open: Option<T>,
    pub body_parse_errors: Option<T>,
    pub outcomes_dropped: Option<T>,
    pub feedback_sent: Option<T>,
    pub feedback_failed: Option<T>,
    pub requests_rejected: Option<T>,
    pub decisions_local: Option<T>,
    pub sync_applied: Option<T>,
    pub sync_failed: Option<T>,
    /// Histogram: the route call's round trip as the filter sees it, ms.
    pub route_latency_ms: Option<T>,
    /// Histogram: parse and hash (with `time-decision`, the local decision), µs.
    pub hash_duration_us: Option<T>,
}

impl<T: Copy> MetricIds<T> {
    /// Defines every metric through the host's `counter` and `histogram` calls.
    pub fn define(
        mut counter: impl FnMut(&str) -> Option<T>,
        mut histogram: impl FnMut(&str) -> Option<T>,
    ) -> Self {
        MetricIds {
            requests_routed: counter("kvroute_requests_routed"),
            requests_skipped: counter("kvroute_requests_skipped"),
            fail_open: counter("kvroute_fail_open"),
            body_parse_errors: counter("kvroute_body_parse_errors"),
            outcomes_dropped: counter("kvroute_outcomes_dropped"),
            feedback_sent: counter("kvroute_feedback_sent"),
            feedback_failed: counter("kvroute_feedback_failed"),
            requests_rejected: counter("kvroute_requests_rejected"),
            decisions_local: counter("kvroute_decisions_local"),
            sync_applied: counter("kvroute_sync_applied"),
            sync_failed: counter("kvroute_sync_failed"),
            route_latency_ms: histogram("kvroute_route_latency_ms"),
            hash_duration_us: histogram("kvroute_hash_duration_us"),
        }
    }

    /// The counters a machine's [`Counter`] adds 1 to (a body-parse fail-open is also a
    /// parse error).
    pub fn counted(&self, counter: Counter) -> impl Iterator<Item = T> {
        let (first, second) = match counter {
            Counter::Routed => (self.requests_routed, None),
            Counter::Skipped(_) => (self.requests_skipped, None),
            Counter::Rejected(_) => (self.requests_rejected, None),
            Counter::DecidedLocally => (self.decisions_local, None),
            Counter::FailOpen(kind) => (
                self.fail_open,
                (kind == FailKind::BodyParse)
                    .then_some(self.body_parse_errors)
                    .flatten(),
            ),
        };
        first.into_iter().chain(second)
    }

    /// The counter of how a tick's call ended: a sync with `decision: local`, else a feedback
    /// batch.
    pub fn tick_call(&self, local: bool, ok: bool) -> Option<T> {
        match (local, ok) {
            (true, true) => self.sync_applied,
            (true, false) => self.sync_failed,
            (false, true) => self.feedback_sent,
            (false, false) => self.feedback_failed,
        }
    }
}

/// The warning a host logs the first time requests fail open for `kind` (later ones are only
/// counted).
pub fn fail_open_warning(kind: FailKind) -> String {
    format!(
        "kvroute: request failed open ({}); later occurrences are only counted in \
         kvroute_fail_open",
        kind.as_str()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::SkipReason;

    /// Ids 1, 2, 3, ... in definition order.
    fn ids() -> MetricIds<u32> {
        let next = std::cell::Cell::new(0);
        let id = |_: &str| {
            next.set(next.get() + 1);
            Some(next.get())
        };
        MetricIds::define(id, id)
    }

    #[test]
    fn a_body_parse_fail_open_counts_twice_any_other_once() {
        let m = ids();
        let parse: Vec<u32> = m.counted(Counter::FailOpen(FailKind::BodyParse)).collect();
        assert_eq!(parse, vec![3, 4]);
        let timeout: Vec<u32> = m.counted(Counter::FailOpen(FailKind::Timeout)).collect();
        assert_eq!(timeout, vec![3]);
        let skipped: Vec<u32> = m.counted(Counter::Skipped(SkipReason::NotJson)).collect();
        assert_eq!(skipped, vec![2]);
    }

    #[test]
    fn a_refused_metric_counts_nothing() {
        let m = MetricIds::<u32>::define(|_| None, |_| None);
        assert_eq!(m.counted(Counter::Routed).count(), 0);
        assert_eq!(m.tick_call(true, true), None);
    }

    #[test]
    fn tick_calls_count_as_syncs_only_when_deciding_locally() {
        let m = MetricIds::<u32>::define(|_| Some(1), |_| Some(2));
        assert_eq!(m.tick_call(true, false), m.sync_failed);
        assert_eq!(m.tick_call(false, true), m.feedback_sent);
    }
}
