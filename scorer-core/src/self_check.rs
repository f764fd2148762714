//! Routing that checks itself: does an endpoint deliver the cache hits the index says it holds?
//!
//! The commonest silent failure of a cache-aware router is an index that no longer matches the
//! engine behind it (a different chat template or tokeniser, a cache salt or LoRA name left out
//! of the hash, prefix caching switched off, a block size that differs), while every
//! dashboard stays green. The router already learns what each engine delivered
//! (`usage.prompt_tokens_details.cached_tokens` in the outcome); this module compares it with
//! what the index believed the endpoint held when it was chosen, per endpoint, and names the
//! endpoint's state:
//!
//! - [`RoutingState::Exact`]: the index is trusted, prefix hits are credited;
//! - [`RoutingState::Degraded`]: the endpoint's KV-event index cannot be trusted, so its prefix
//!   comes from the approximate index (derived by the router, not kept here): precise mode is
//!   configured but its KV-event stream is not live ([`StateReason::NoKvEvents`]), or its
//!   engine's block size is not the configured one ([`StateReason::BlockSize`]);
//! - [`RoutingState::LoadOnly`]: the endpoint delivered almost none of the hits the index
//!   believed in over a window of outcomes ([`StateReason::Mismatch`]); scoring credits it no
//!   cached prefix, so it is chosen by load, until outcomes show the index right again.
//!
//! A load-only endpoint may get no request whose prefix it was believed to hold (the others are
//! credited, it is not), so it could never show that it was fixed. Like a circuit breaker's
//! half-open state, it is *probed*: after [`SelfCheckConfig::probe_after_ms`] its prefix is
//! credited again for [`SelfCheckConfig::min_samples`] believed hits while its state stays
//! load-only; if they deliver, it is exact again, else the next probe waits twice as long (up
//! to [`SelfCheckConfig::max_probe_after_ms`]). A probe costs a few requests' cache misses on
//! an endpoint that is still broken.
//!
//! The two thresholds are far apart on purpose: eviction under memory pressure makes an engine
//! deliver *part* of a believed hit (the index learns evictions late or not at all), which must
//! not switch cache-aware routing off; a mismatch makes it deliver *none*. Entering needs the
//! delivered share under [`SelfCheckConfig::enter_below`] (0.1) over at least
//! [`SelfCheckConfig::min_samples`] outcomes that each believed a real hit; leaving needs it
//! back over [`SelfCheckConfig::leave_above`] (0.5) on fresh evidence. Neither number is fitted
//! to a workload: they bound "nearly nothing" and "a real share" of what the index believed.
//!
//! Sans-IO like the rest of the crate: outcomes and time come in as arguments; a state change
//! is returned, for the caller to log and count once.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// The `router.self_check` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SelfCheckConfig {
    /// Compare believed and delivered hits and fall back to load-only routing on a mismatch.
    pub enabled: bool,
    /// Outcomes (each with a believed hit) the delivered share is computed over.
    pub window: usize,
    /// Outcomes needed before the state may change, entering or leaving.
    pub min_samples: usize,
    /// An outcome counts only when the index believed at least this many cached tokens: a
    /// one-block belief says little either way.
    pub min_believed_tokens: u32,
    /// Delivered / believed cached tokens under which the endpoint goes load-only.
    pub enter_below: f64,
    /// Delivered / believed cached tokens over which a load-only endpoint is trusted again.
    pub leave_above: f64,
    /// How long after going load-only (or after a failed probe) an endpoint's prefix is
    /// credited again to see whether it delivers, in ms.
    pub probe_after_ms: u64,
    /// The longest wait between probes (the wait doubles after each failed one).
    pub max_probe_after_ms: u64,
}

impl Default for SelfCheckConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            window: 32,
            min_samples: 8,
            min_believed_tokens: 64,
            enter_below: 0.1,
            leave_above: 0.5,
            probe_after_ms: 30_000,
            max_probe_after_ms: 600_000,
        }
    }
}

/// How far the router trusts its prefix knowledge of one endpoint (issue #18's named states).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum RoutingState {
    /// Prefix hits are credited as the index reports them.
    #[default]
    Exact,
    /// The KV-event index cannot be trusted (no live stream, or the engine's blocks are not
    /// the configured size): the approximate index stands in.
    Degraded,
    /// No prefix credit: the endpoint is chosen by load alone.
    LoadOnly,
}

impl RoutingState {
    /// The metric label and the JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingState::Exact => "exact",
            RoutingState::Degraded => "degraded",
            RoutingState::LoadOnly => "load-only",
        }
    }
}

/// Why an endpoint is not [`RoutingState::Exact`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateReason {
    /// Outcomes delivered almost none of the cached tokens the index believed in.
    Mismatch,
    /// Precise mode, and the endpoint's KV-event stream is not live.
    NoKvEvents,
    /// The engine's `block_size` (`vllm:cache_config_info`) is not `router.precise.block_tokens`:
    /// its KV events name blocks the router never hashes, so it is scored from the
    /// approximate index until the sizes match.
    BlockSize,
}

impl StateReason {
    /// The metric label and the JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            StateReason::Mismatch => "mismatch",
            StateReason::NoKvEvents => "no_kv_events",
            StateReason::BlockSize => "block_size",
        }
    }
}

/// A change of an endpoint's checked state, returned once for the caller to log and count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StateChange {
    /// The state left.
    pub from: RoutingState,
    /// The state entered.
    pub to: RoutingState,
    /// Why, for a change into a state other than exact; for a change back, why it was left.
    pub reason: StateReason,
    /// Delivered / believed cached tokens over the evidence that decided it.
    pub delivered_share: f64,
    /// Outcomes that evidence counted.
    pub samples: usize,
}

/// One endpoint's comparison of believed and delivered hits.
#[derive(Debug, Clone, Default)]
pub struct EndpointCheck {
    /// `(believed, delivered)` cached tokens of recent outcomes with a believed hit, oldest
    /// first; cleared on every state change, so each verdict rests on fresh evidence.
    samples: VecDeque<(u32, u32)>,
    believed: u64,
    delivered: u64,
    load_only: bool,
    /// A load-only endpoint whose prefix is credited for a while, to see whether it delivers.
    probing: bool,
    /// When the next probe may start.
    probe_at_ms: u64,
    /// The wait before the next probe after this one fails.
    probe_wait_ms: u64,
}

impl EndpointCheck {
    /// Takes one served outcome: what the index believed the endpoint held for the request
    /// when it was chosen, and what the engine reported it served from cache. Returns the
    /// state change it caused, if any.
    pub fn observe(
        &mut self,
        believed: u32,
        delivered: u32,
        now_ms: u64,
        config: &SelfCheckConfig,
    ) -> Option<StateChange> {
        if !config.enabled || believed < config.min_believed_tokens.max(1) {
            return None;
        }
        // Delivered beyond the belief (another request's blocks) says nothing about this one.
        let delivered = delivered.min(believed);
        self.samples.push_back((believed, delivered));
        self.believed += u64::from(believed);
        self.delivered += u64::from(delivered);
        while self.samples.len() > config.window.max(1) {
            if let Some((b, d)) = self.samples.pop_front() {
                self.believed -= u64::from(b);
                self.delivered -= u64::from(d);
            }
        }
        if self.samples.len() < config.min_samples.max(1) {
            return None;
        }
        let share = self.delivered_share();
        let change = if !self.load_only && share < config.enter_below {
            self.probe_wait_ms = config.probe_after_ms;
            self.probe_at_ms = now_ms.saturating_add(self.probe_wait_ms);
            (RoutingState::Exact, RoutingState::LoadOnly)
        } else if self.load_only && share > config.leave_above {
            (RoutingState::LoadOnly, RoutingState::Exact)
        } else if self.probing {
            // The probe had its evidence and the endpoint still does not deliver: wait longer.
            self.probing = false;
            self.probe_wait_ms = self
                .probe_wait_ms
                .saturating_mul(2)
                .clamp(config.probe_after_ms, config.max_probe_after_ms.max(1));
            self.probe_at_ms = now_ms.saturating_add(self.probe_wait_ms);
            self.clear_window();
            return None;
        } else {
            return None;
        };
        let samples = self.samples.len();
        self.load_only = change.1 == RoutingState::LoadOnly;
        self.probing = false;
        self.clear_window();
        Some(StateChange {
            from: change.0,
            to: change.1,
            reason: StateReason::Mismatch,
            delivered_share: share,
            samples,
        })
    }

    fn clear_window(&mut self) {
        self.samples.clear();
        self.believed = 0;
        self.delivered = 0;
    }

    /// Whether the endpoint is load-only (its state, probing or not).
    pub fn load_only(&self) -> bool {
        self.load_only
    }

    /// Whether scoring credits the endpoint's cached prefix at `now_ms`: always when exact; when
    /// load-only, only while a probe runs, which starts here once its time has come.
    pub fn credits_prefix(&mut self, now_ms: u64) -> bool {
        if !self.load_only {
            return true;
        }
        if !self.probing && now_ms >= self.probe_at_ms {
            self.probing = true;
            self.clear_window();
        }
        self.probing
    }

    /// Whether a probe of a load-only endpoint is running.
    pub fn probing(&self) -> bool {
        self.probing
    }

    /// Delivered / believed cached tokens over the current window (1 with no evidence).
    pub fn delivered_share(&self) -> f64 {
        if self.believed == 0 {
            1.0
        } else {
            self.delivered as f64 / self.believed as f64
        }
    }

    /// Outcomes in the current window.
    pub fn samples(&self) -> usize {
        self.samples.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(c: &mut EndpointCheck, n: usize, believed: u32, delivered: u32) -> Vec<StateChange> {
        let config = SelfCheckConfig::default();
        (0..n)
            .filter_map(|i| c.observe(believed, delivered, i as u64, &config))
            .collect()
    }

    #[test]
    fn an_endpoint_that_delivers_nothing_goes_load_only_and_comes_back() {
        let mut c = EndpointCheck::default();
        let changes = feed(&mut c, 7, 1_000, 0);
        assert!(changes.is_empty(), "too few samples: {changes:?}");
        let changes = feed(&mut c, 1, 1_000, 0);
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].to, RoutingState::LoadOnly);
        assert_eq!(changes[0].reason, StateReason::Mismatch);
        assert!(c.load_only());
        // Still nothing: it stays.
        assert!(feed(&mut c, 20, 1_000, 0).is_empty());
        assert!(c.load_only());
        // The engine delivers again (the misconfiguration was fixed): it comes back once the
        // window holds more than half of what was believed, and only once.
        let back = feed(&mut c, 40, 1_000, 900);
        assert_eq!(back.len(), 1, "{back:?}");
        assert_eq!(back[0].to, RoutingState::Exact);
        assert!(back[0].delivered_share > 0.5);
        assert!(!c.load_only());
    }

    #[test]
    fn eviction_that_keeps_part_of_the_hits_does_not_switch_routing_off() {
        // Under memory pressure an engine serves a fifth of what the index believed.
        let mut c = EndpointCheck::default();
        assert!(feed(&mut c, 200, 2_000, 400).is_empty());
        assert!(!c.load_only());
        // A window of mixed outcomes: most hits whole, some evicted to nothing.
        let mut c = EndpointCheck::default();
        let config = SelfCheckConfig::default();
        for i in 0..200u64 {
            let delivered = if i % 3 == 0 { 0 } else { 1_500 };
            assert!(c.observe(1_500, delivered, i, &config).is_none());
        }
    }

    #[test]
    fn a_load_only_endpoint_is_probed_and_the_wait_doubles_while_it_stays_broken() {
        let config = SelfCheckConfig::default();
        let mut c = EndpointCheck::default();
        for i in 0..8 {
            c.observe(1_000, 0, 1_000 + i, &config);
        }
        assert!(c.load_only());
        let went = 1_007;
        assert!(
            !c.credits_prefix(went + 29_999),
            "no probe before probe_after_ms"
        );
        assert!(
            c.credits_prefix(went + 30_000),
            "the probe credits its prefix"
        );
        assert!(c.probing());
        // The probe's evidence: still nothing delivered. No state change, the next probe
        // waits twice as long.
        for i in 0..8 {
            assert!(c.observe(1_000, 0, went + 30_000 + i, &config).is_none());
        }
        assert!(c.load_only() && !c.probing());
        let failed = went + 30_007;
        assert!(!c.credits_prefix(failed + 59_999));
        assert!(c.credits_prefix(failed + 60_000));
        // Fixed: the next probe's evidence brings it back.
        let back: Vec<_> = (0..8)
            .filter_map(|i| c.observe(1_000, 1_000, failed + 60_000 + i, &config))
            .collect();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].to, RoutingState::Exact);
        assert!(c.credits_prefix(failed + 60_010));
    }

    #[test]
    fn small_beliefs_and_a_disabled_check_count_nothing() {
        let mut c = EndpointCheck::default();
        assert!(feed(&mut c, 100, 32, 0).is_empty());
        assert_eq!(c.samples(), 0);
        let off = SelfCheckConfig {
            enabled: false,
            ..SelfCheckConfig::default()
        };
        for i in 0..100 {
            assert!(c.observe(5_000, 0, i, &off).is_none());
        }
        assert!(!c.load_only());
    }

    #[test]
    fn delivered_beyond_the_belief_is_capped() {
        let mut c = EndpointCheck::default();
        let config = SelfCheckConfig::default();
        c.observe(100, 10_000, 0, &config);
        assert_eq!(c.delivered_share(), 1.0);
    }

    #[test]
    fn states_and_reasons_have_the_wire_spellings() {
        assert_eq!(
            serde_json::to_string(&RoutingState::LoadOnly).unwrap(),
            "\"load-only\""
        );
        assert_eq!(RoutingState::LoadOnly.as_str(), "load-only");
        assert_eq!(
            serde_json::to_string(&StateReason::NoKvEvents).unwrap(),
            "\"no_kv_events\""
        );
        assert_eq!(StateReason::Mismatch.as_str(), "mismatch");
    }
}
