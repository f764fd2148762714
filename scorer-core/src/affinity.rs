//! Session affinity: a conversation (the filter's session key: a header such as
//! `x-session-id`, or the body's `user`) keeps going to the replica that served it last, as a
//! strong preference rather than a pin.
//!
//! The remembered replica gets a bonus (a negative cost term) only while it is ready, its
//! metrics are fresh and it is not overloaded; otherwise the request is scored like any other
//! and the session moves. Entries live `ttl_ms` after their last use and the table holds at
//! most `max_sessions` of them (least recently used go first), so memory stays bounded.

use std::collections::VecDeque;

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

use crate::index::EndpointId;

/// The `router.sessions` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    /// Cost bonus (ms) of the session's remembered replica; 0 turns affinity off.
    pub bonus_ms: f64,
    /// A session is forgotten this long after its last request.
    pub ttl_ms: u64,
    /// Most sessions remembered (least recently used are dropped first).
    pub max_sessions: usize,
    /// The bonus applies only while the replica's KV usage is below this.
    pub max_kv_usage: f64,
    /// The bonus applies only while the replica's waiting queue is at most this.
    pub max_waiting: u32,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            bonus_ms: 0.0,
            ttl_ms: 600_000,
            max_sessions: 100_000,
            max_kv_usage: 0.95,
            max_waiting: 8,
        }
    }
}

impl SessionConfig {
    /// Whether the remembered replica, with this KV usage and waiting queue, may keep the
    /// session (`None`: no fresh metrics, which is not enough to trust it).
    pub fn healthy(&self, load: Option<(f64, u32)>) -> bool {
        load.is_some_and(|(kv_usage, waiting)| {
            kv_usage < self.max_kv_usage && waiting <= self.max_waiting
        })
    }
}

/// What became of the sessions of routed requests: the `kvroute_sessions_total` counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionStats {
    /// The request went to its session's remembered replica.
    pub hits: u64,
    /// The session was new or expired.
    pub misses: u64,
    /// The session moved: its replica was gone, unhealthy, overloaded or clearly worse.
    pub broken: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    endpoint: EndpointId,
    touched_ms: u64,
}

/// Session key → replica, bounded in time and size.
#[derive(Debug, Clone, Default)]
pub struct SessionTable {
    entries: HashMap<String, Entry>,
    /// Touches in order, oldest first; stale ones (re-touched later) are skipped on eviction.
    order: VecDeque<(String, u64)>,
    stats: SessionStats,
}

impl SessionTable {
    /// The replica `key` last went to, if remembered and not older than `ttl_ms`.
    pub fn lookup(&self, key: &str, now_ms: u64, ttl_ms: u64) -> Option<EndpointId> {
        let e = self.entries.get(key)?;
        (now_ms.saturating_sub(e.touched_ms) < ttl_ms).then_some(e.endpoint)
    }

    /// Records that `key` went to `endpoint` now, evicting beyond `max_sessions`.
    pub fn remember(&mut self, key: &str, endpoint: EndpointId, now_ms: u64, max_sessions: usize) {
        self.entries.insert(
            key.to_string(),
            Entry {
                endpoint,
                touched_ms: now_ms,
            },
        );
        self.order.push_back((key.to_string(), now_ms));
        while self.entries.len() > max_sessions {
            let Some((old, stamp)) = self.order.pop_front() else {
                break;
            };
            if self
                .entries
                .get(&old)
                .is_some_and(|e| e.touched_ms == stamp)
            {
                self.entries.remove(&old);
            }
        }
        // Re-touched keys leave stale entries behind; rebuild before they outgrow the table.
        if self.order.len() > 2 * self.entries.len() + 64 {
            let mut live: Vec<(String, u64)> = self
                .entries
                .iter()
                .map(|(k, e)| (k.clone(), e.touched_ms))
                .collect();
            live.sort_by_key(|(_, t)| *t);
            self.order = live.into();
        }
    }

    /// Drops sessions older than `ttl_ms`.
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) {
        while let Some((key, stamp)) = self.order.front() {
            if now_ms.saturating_sub(*stamp) < ttl_ms {
                break;
            }
            if self
                .entries
                .get(key)
                .is_some_and(|e| e.touched_ms == *stamp)
            {
                self.entries.remove(key);
            }
            self.order.pop_front();
        }
    }

    /// Forgets every session of `endpoint` (it was removed; its slot may be reused).
    pub fn forget_endpoint(&mut self, endpoint: EndpointId) {
        self.entries.retain(|_, e| e.endpoint != endpoint);
    }

    /// Counts what happened to one routed request's session.
    pub fn count(&mut self, remembered: Option<EndpointId>, chosen: EndpointId) {
        match remembered {
            None => self.stats.misses += 1,
            Some(e) if e == chosen => self.stats.hits += 1,
            Some(_) => self.stats.broken += 1,
        }
    }

    /// Sessions remembered now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no session is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Counters since start.
    pub fn stats(&self) -> SessionStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_until_the_ttl() {
        let mut t = SessionTable::default();
        t.remember("s", EndpointId(3), 1_000, 10);
        assert_eq!(t.lookup("s", 1_500, 1_000), Some(EndpointId(3)));
        assert_eq!(t.lookup("s", 2_000, 1_000), None);
        t.expire(2_000, 1_000);
        assert!(t.is_empty());
    }

    #[test]
    fn size_is_bounded_least_recently_used_first() {
        let mut t = SessionTable::default();
        for i in 0..5u64 {
            t.remember(&format!("s{i}"), EndpointId(0), i, 3);
        }
        // s0 is touched again, so s1 and s2 are the oldest.
        t.remember("s0", EndpointId(1), 10, 3);
        t.remember("s5", EndpointId(1), 11, 3);
        assert_eq!(t.len(), 3);
        assert_eq!(t.lookup("s0", 12, 100), Some(EndpointId(1)));
        assert_eq!(t.lookup("s1", 12, 100), None);
        assert_eq!(t.lookup("s2", 12, 100), None);
        assert_eq!(t.lookup("s4", 12, 100), Some(EndpointId(0)));
    }

    #[test]
    fn stale_touches_do_not_grow_without_bound() {
        let mut t = SessionTable::default();
        for i in 0..10_000u64 {
            t.remember("same", EndpointId(0), i, 100);
        }
        assert_eq!(t.len(), 1);
        assert!(t.order.len() <= 2 + 64 + 1, "{}", t.order.len());
    }

    #[test]
    fn removed_endpoints_lose_their_sessions_and_outcomes_are_counted() {
        let mut t = SessionTable::default();
        t.remember("a", EndpointId(1), 0, 10);
        t.remember("b", EndpointId(2), 0, 10);
        t.forget_endpoint(EndpointId(1));
        assert_eq!(t.lookup("a", 1, 100), None);
        assert_eq!(t.lookup("b", 1, 100), Some(EndpointId(2)));
        t.count(None, EndpointId(0));
        t.count(Some(EndpointId(2)), EndpointId(2));
        t.count(Some(EndpointId(2)), EndpointId(0));
        assert_eq!(
            t.stats(),
            SessionStats {
                hits: 1,
                misses: 1,
                broken: 1
            }
        );
    }

    #[test]
    fn health_needs_fresh_metrics_below_the_limits() {
        let c = SessionConfig::default();
        assert!(c.healthy(Some((0.5, 0))));
        assert!(!c.healthy(Some((0.99, 0))));
        assert!(!c.healthy(Some((0.5, 100))));
        assert!(!c.healthy(None));
    }
}
