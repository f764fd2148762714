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
    /// Later turns a session's first request is charged for, at the decode-side load each
    /// candidate has now (the sequences running there and the contexts they read), times
    /// the learned share of recent sessions that came back soon (where every session is a
    /// single request, or comes back only minutes later, it falls toward zero). A session's
    /// first placement decides where its later turns find their cache, so without this the
    /// replica holding a prefix all sessions share takes every new one. 0 turns it off.
    /// Chosen on fleet-sim's tuning split (seeds 1-2): 1 kept the TTFT geomeans against the
    /// best peer (0.879 / 1.140 against 0.874 / 1.140 without) for one more loss cell, and
    /// spread the agentic workload's sessions (busiest replica 33 % -> 25 %); 2 and 3 had
    /// four loss cells. Charged only to requests scored to their first token (chat,
    /// completions): the agent APIs price their own decode turn by turn already (see
    /// `session_start_ms`).
    pub start_turns: f64,
    /// A session counts as coming back (for the share `start_turns` is scaled by) when its
    /// next request follows the last within this long: the load a start is charged for is
    /// the load it finds now, which a turn much later would not find. Agent loops and chat
    /// turns come back within seconds; requests that only share a group key minutes apart
    /// do not.
    pub return_within_ms: u64,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            bonus_ms: 0.0,
            ttl_ms: 600_000,
            max_sessions: 100_000,
            max_kv_usage: 0.95,
            max_waiting: 8,
            start_turns: 1.0,
            return_within_ms: 10_000,
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
    /// When this key's session started (its first request after none within the TTL).
    started_ms: u64,
    /// Whether the session has been counted in [`SessionTable::return_share`] (or is not a
    /// session being counted at all: a stored response).
    judged: bool,
}

/// Sessions [`SessionTable::return_share`] is taken over: older counts are halved away, so it
/// follows the last thousand or so sessions.
const RETURN_WINDOW: f64 = 1024.0;

/// Key → replica, bounded in time and size: sessions (the filter's session key) and stored
/// responses (a response id) alike.
///
/// Keys are kept as 64-bit hashes (xxh3): a session key is a client's string of any length,
/// and every proxy VM deciding locally holds a table; two live keys sharing a hash (about one
/// chance in 10^10 at the default bound) would only share a remembered replica.
#[derive(Debug, Clone, Default)]
pub struct SessionTable {
    entries: HashMap<u64, Entry>,
    /// Touches in order, oldest first; stale ones (re-touched later) are skipped on eviction.
    order: VecDeque<(u64, u64)>,
    stats: SessionStats,
    /// Sessions started and not judged yet, `(key, started_ms)`, oldest first.
    pending: VecDeque<(u64, u64)>,
    /// Sessions whose second request came soon after their first, decayed.
    returned: f64,
    /// Sessions that did not (later, or never), decayed alike.
    single: f64,
}

fn key_hash(key: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key.as_bytes())
}

impl SessionTable {
    /// The replica `key` last went to, if remembered and not older than `ttl_ms`.
    pub fn lookup(&self, key: &str, now_ms: u64, ttl_ms: u64) -> Option<EndpointId> {
        let e = self.entries.get(&key_hash(key))?;
        (now_ms.saturating_sub(e.touched_ms) < ttl_ms).then_some(e.endpoint)
    }

    /// Records that `key` went to `endpoint` now, evicting beyond `max_sessions`.
    pub fn remember(
        &mut self,
        key: &str,
        endpoint: EndpointId,
        now_ms: u64,
        ttl_ms: u64,
        max: usize,
    ) {
        self.insert(key, endpoint, now_ms, ttl_ms, None, max);
    }

    /// [`SessionTable::remember`] for a session, which also counts toward
    /// [`SessionTable::return_share`]: it came back if its second request followed its first
    /// within `return_ms`.
    pub fn remember_session(
        &mut self,
        key: &str,
        endpoint: EndpointId,
        now_ms: u64,
        ttl_ms: u64,
        return_ms: u64,
        max: usize,
    ) {
        self.insert(key, endpoint, now_ms, ttl_ms, Some(return_ms), max);
    }

    fn insert(
        &mut self,
        key: &str,
        endpoint: EndpointId,
        now_ms: u64,
        ttl_ms: u64,
        return_ms: Option<u64>,
        max_sessions: usize,
    ) {
        if let Some(return_ms) = return_ms {
            self.judge_pending(now_ms, return_ms, max_sessions);
        }
        let hash = key_hash(key);
        let previous = self.entries.get(&hash).copied();
        let live = previous.filter(|e| now_ms.saturating_sub(e.touched_ms) < ttl_ms);
        let entry = match live {
            Some(e) => {
                if !e.judged {
                    // Not judged yet: its first request is less than `return_ms` old.
                    self.count_session(true);
                }
                Entry {
                    endpoint,
                    touched_ms: now_ms,
                    judged: true,
                    ..e
                }
            }
            None => {
                // An expired entry still held (overwritten below) is a session that ended.
                if previous.is_some_and(|e| !e.judged) {
                    self.count_session(false);
                }
                if return_ms.is_some() {
                    self.pending.push_back((hash, now_ms));
                }
                Entry {
                    endpoint,
                    touched_ms: now_ms,
                    started_ms: now_ms,
                    judged: return_ms.is_none(),
                }
            }
        };
        self.entries.insert(hash, entry);
        self.order.push_back((hash, now_ms));
        while self.entries.len() > max_sessions {
            let Some((old, stamp)) = self.order.pop_front() else {
                break;
            };
            if self
                .entries
                .get(&old)
                .is_some_and(|e| e.touched_ms == stamp)
            {
                self.drop_entry(old);
            }
        }
        // Re-touched keys leave stale entries behind; rebuild before they outgrow the table.
        if self.order.len() > 2 * self.entries.len() + 64 {
            let mut live: Vec<(u64, u64)> = self
                .entries
                .iter()
                .map(|(k, e)| (*k, e.touched_ms))
                .collect();
            live.sort_by_key(|(_, t)| *t);
            self.order = live.into();
        }
    }

    /// Judges the sessions that started `return_ms` ago or longer without a second request:
    /// they did not come back soon.
    fn judge_pending(&mut self, now_ms: u64, return_ms: u64, max_sessions: usize) {
        while let Some(&(key, started)) = self.pending.front() {
            if now_ms.saturating_sub(started) < return_ms && self.pending.len() <= max_sessions {
                break;
            }
            self.pending.pop_front();
            if let Some(e) = self.entries.get_mut(&key)
                && e.started_ms == started
                && !e.judged
            {
                e.judged = true;
                self.count_session(false);
            }
        }
    }

    /// The share of recent sessions whose second request followed their first within the
    /// window they were remembered with: how likely a new session is to bring later turns,
    /// soon, to the replica its cache is on. Each session is judged once, at its second
    /// request or when the window has passed without one; before any is, the share is a
    /// half.
    pub fn return_share(&self) -> f64 {
        (self.returned + 0.5) / (self.returned + self.single + 1.0)
    }

    /// Counts one session's verdict for [`SessionTable::return_share`].
    fn count_session(&mut self, returned: bool) {
        if self.returned + self.single >= RETURN_WINDOW {
            self.returned /= 2.0;
            self.single /= 2.0;
        }
        if returned {
            self.returned += 1.0;
        } else {
            self.single += 1.0;
        }
    }

    /// Forgets `key`'s entry; a session not judged yet counts as not having come back.
    fn drop_entry(&mut self, key: u64) {
        if let Some(e) = self.entries.remove(&key)
            && !e.judged
        {
            self.count_session(false);
        }
    }

    /// Drops sessions older than `ttl_ms`.
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) {
        while let Some(&(key, stamp)) = self.order.front() {
            if now_ms.saturating_sub(stamp) < ttl_ms {
                break;
            }
            if self
                .entries
                .get(&key)
                .is_some_and(|e| e.touched_ms == stamp)
            {
                self.drop_entry(key);
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
        t.remember("s", EndpointId(3), 1_000, 1_000_000, 10);
        assert_eq!(t.lookup("s", 1_500, 1_000), Some(EndpointId(3)));
        assert_eq!(t.lookup("s", 2_000, 1_000), None);
        t.expire(2_000, 1_000);
        assert!(t.is_empty());
    }

    #[test]
    fn size_is_bounded_least_recently_used_first() {
        let mut t = SessionTable::default();
        for i in 0..5u64 {
            t.remember(&format!("s{i}"), EndpointId(0), i, 1_000_000, 3);
        }
        // s0 is touched again, so s1 and s2 are the oldest.
        t.remember("s0", EndpointId(1), 10, 1_000_000, 3);
        t.remember("s5", EndpointId(1), 11, 1_000_000, 3);
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
            t.remember("same", EndpointId(0), i, 1_000_000, 100);
        }
        assert_eq!(t.len(), 1);
        assert!(t.order.len() <= 2 + 64 + 1, "{}", t.order.len());
    }

    #[test]
    fn removed_endpoints_lose_their_sessions_and_outcomes_are_counted() {
        let mut t = SessionTable::default();
        t.remember("a", EndpointId(1), 0, 1_000_000, 10);
        t.remember("b", EndpointId(2), 0, 1_000_000, 10);
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
    fn the_return_share_counts_sessions_back_soon_and_judges_the_rest_when_their_time_passes() {
        let (ttl, soon, max) = (600_000, 10_000, 100);
        let mut t = SessionTable::default();
        let at = |t: &mut SessionTable, key: &str, now: u64| {
            t.remember_session(key, EndpointId(0), now, ttl, soon, max);
        };
        let share_is = |t: &SessionTable, want: f64| {
            assert!(
                (t.return_share() - want).abs() < 1e-9,
                "{}",
                t.return_share()
            );
        };
        share_is(&t, 0.5);
        // Four sessions come back within the window, each judged once however often.
        for k in 0..4u64 {
            for turn in 0..3 {
                at(&mut t, &format!("chat {k}"), k * 100 + turn * 1_000);
            }
        }
        share_is(&t, 4.5 / 5.0);
        // Four come back only a minute later: judged single once the window has passed (at
        // the next remembered request), and their late return does not count.
        for k in 0..4u64 {
            at(&mut t, &format!("group {k}"), 20_000 + k);
        }
        at(&mut t, "another", 35_000);
        share_is(&t, 4.5 / 9.0);
        for k in 0..4u64 {
            at(&mut t, &format!("group {k}"), 80_000 + k);
        }
        // (`another`, never back, is judged now too.)
        share_is(&t, 4.5 / 10.0);
        // A session forgotten before its window passed never came back.
        let mut small = SessionTable::default();
        small.remember_session("a", EndpointId(0), 0, ttl, soon, 1);
        small.remember_session("b", EndpointId(0), 1, ttl, soon, 1);
        assert!((small.return_share() - 0.5 / 2.0).abs() < 1e-9);
        // Stored responses (plain `remember`) are not sessions.
        let mut responses = SessionTable::default();
        responses.remember("resp_1", EndpointId(0), 0, ttl, max);
        responses.remember("resp_1", EndpointId(0), 1, ttl, max);
        assert_eq!(responses.return_share(), 0.5);
        assert!(responses.pending.is_empty());
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
