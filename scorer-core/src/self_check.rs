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
//!   configured but its KV-event stream is not live ([`StateReason::NoKvEvents`]), its
//!   engine's block size is not the configured one ([`StateReason::BlockSize`]), or its stream
//!   lost batches that no replay could fill ([`StateReason::KvEventGap`], until
//!   [`SelfCheckConfig::clean_batches_after_gap`] batches in a row arrive in sequence: see
//!   [`EventGapCheck`]), its KV events do not hold the blocks the router hashed for the
//!   requests it served ([`StateReason::HashMismatch`]: see [`EventHashCheck`]), or its events
//!   store only blocks of KV-cache groups the index cannot use ([`StateReason::EventGroups`]:
//!   see [`EventGroupCheck`]);
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
    /// After a KV-event gap that could not be replayed, batches that must arrive in sequence
    /// (none lost) before the endpoint's event index is trusted again.
    pub clean_batches_after_gap: u32,
    /// How long after a served request's outcome its first block must be in the endpoint's
    /// event-fed index (the engine published it before it answered), in ms.
    pub confirm_after_ms: u64,
    /// KV-event batches in a row that stored blocks of other KV-cache groups only (none the
    /// index can use) before the endpoint is degraded with reason `event_groups`. Generous:
    /// a healthy hybrid model whose other groups have smaller blocks stores them in batches
    /// of their own between full-attention stores. Left out of the serialized form at its
    /// default, so a filter built before it still accepts the copy's configuration.
    #[serde(skip_serializing_if = "is_default_unusable_group_batches")]
    pub unusable_group_batches: u32,
    /// How far (as a fraction) an endpoint's learned canonical bytes per prompt token may sit
    /// from the median of the other endpoints of its pool before it is `degraded` (reason
    /// `bytes_per_token`); it is trusted again within half that. 0 turns the check off. Left
    /// out of the serialized form at its default, as `unusable_group_batches` is.
    #[serde(skip_serializing_if = "is_default_bytes_per_token_drift")]
    pub bytes_per_token_drift: f64,
}

/// The default of [`SelfCheckConfig::bytes_per_token_drift`]: tokenisers of one model family
/// count the same text within about a tenth of each other, so a quarter apart is another
/// tokeniser or template, not noise.
const DEFAULT_BYTES_PER_TOKEN_DRIFT: f64 = 0.25;

fn is_default_bytes_per_token_drift(v: &f64) -> bool {
    *v == DEFAULT_BYTES_PER_TOKEN_DRIFT
}

/// The default of [`SelfCheckConfig::unusable_group_batches`].
const DEFAULT_UNUSABLE_GROUP_BATCHES: u32 = 64;

fn is_default_unusable_group_batches(n: &u32) -> bool {
    *n == DEFAULT_UNUSABLE_GROUP_BATCHES
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
            clean_batches_after_gap: 32,
            confirm_after_ms: 1_000,
            unusable_group_batches: DEFAULT_UNUSABLE_GROUP_BATCHES,
            bytes_per_token_drift: DEFAULT_BYTES_PER_TOKEN_DRIFT,
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
    /// The endpoint's KV-event stream lost batches (a sequence gap) that its replay socket
    /// could not fill: the event index misses what they said, so it is scored from the
    /// approximate index until the stream has run clean for a while ([`EventGapCheck`]).
    KvEventGap,
    /// The endpoint's KV events do not hold the blocks the router hashed for the requests the
    /// endpoint served: the engine hashes prompts otherwise (a cache salt it ignores, another
    /// chat template, a LoRA adapter under another name), so the event index never matches a
    /// request and the approximate index stands in ([`EventHashCheck`]).
    HashMismatch,
    /// The endpoint's KV events store blocks only for KV-cache groups other than full
    /// attention (a hybrid model whose full-attention group is not group 0, Mamba state, a
    /// spec kind the decoder does not know): the event index stays empty while the stream
    /// looks healthy, so the approximate index stands in ([`EventGroupCheck`]).
    EventGroups,
    /// The endpoint counts prompts in a clearly different number of tokens than the rest of
    /// its pool (another tokeniser or chat template behind the same model name): its
    /// token-hashed KV events cannot match the router's tokenisation, so the approximate index
    /// stands in ([`TokenRatioCheck`], on canonical bytes for approximate requests and on the
    /// router's own token count for precise ones).
    BytesPerToken,
}

impl StateReason {
    /// The metric label and the JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            StateReason::Mismatch => "mismatch",
            StateReason::NoKvEvents => "no_kv_events",
            StateReason::BlockSize => "block_size",
            StateReason::KvEventGap => "kv_event_gap",
            StateReason::HashMismatch => "hash_mismatch",
            StateReason::EventGroups => "event_groups",
            StateReason::BytesPerToken => "bytes_per_token",
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
    /// Delivered / believed cached tokens over the evidence that decided it; for
    /// [`StateReason::HashMismatch`], the share of looked-up blocks the event index held.
    pub delivered_share: f64,
    /// Outcomes (for `HashMismatch`, lookups) that evidence counted.
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

/// Whether one endpoint's KV-event stream has lost batches no replay could fill, and whether
/// it has run clean since. A lost batch may have stored or removed any block, so the event
/// index is not trusted from the loss until [`SelfCheckConfig::clean_batches_after_gap`]
/// batches in a row arrived in sequence: a stream still losing batches (a publisher whose
/// high-water mark keeps dropping them) never gets there, one that was fixed does. Counting
/// batches rather than time needs no clock: batches come with the engine's activity, and so
/// does the evidence that the stream is whole.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventGapCheck {
    /// Batches in sequence since the last unfilled gap; `None` while no gap is outstanding.
    clean_since_gap: Option<u32>,
}

impl EventGapCheck {
    /// A gap the replay could not fill: the index is not trusted from here.
    pub fn lost(&mut self) {
        self.clean_since_gap = Some(0);
    }

    /// One batch applied in sequence. Returns whether it ended an outstanding gap (the stream
    /// has now run clean for `config.clean_batches_after_gap` batches).
    pub fn in_sequence(&mut self, config: &SelfCheckConfig) -> bool {
        let Some(clean) = self.clean_since_gap.as_mut() else {
            return false;
        };
        *clean = clean.saturating_add(1);
        if *clean >= config.clean_batches_after_gap {
            self.clean_since_gap = None;
            return true;
        }
        false
    }

    /// Forgets an outstanding gap (a new session rebuilt the history from the replay socket).
    pub fn clear(&mut self) {
        self.clean_since_gap = None;
    }

    /// Whether a gap is outstanding (the event index is not trusted).
    pub fn outstanding(&self) -> bool {
        self.clean_since_gap.is_some()
    }
}

/// Whether one endpoint's KV events store blocks of a KV-cache group the index can use. A model
/// whose every store names another group leaves the event index empty while its stream looks
/// healthy; after [`SelfCheckConfig::unusable_group_batches`] batches in a row that stored only
/// such blocks the endpoint is degraded ([`StateReason::EventGroups`]) and precise requests
/// read the approximate index, until a batch stores a usable block. Batches that store nothing
/// (removals only, a cleared cache) say nothing either way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventGroupCheck {
    /// Batches in a row whose stores were all of other groups.
    only_other_groups: u32,
    /// Whether that run reached the threshold (and no usable store has come since).
    unusable: bool,
}

impl EventGroupCheck {
    /// One batch that stored `usable` runs of blocks the index applies and `other_groups` runs
    /// of other groups' blocks.
    pub fn batch(&mut self, usable: u32, other_groups: u32, config: &SelfCheckConfig) {
        if usable > 0 {
            *self = Self::default();
        } else if other_groups > 0 {
            self.only_other_groups = self.only_other_groups.saturating_add(1);
            self.unusable |= self.only_other_groups >= config.unusable_group_batches.max(1);
        }
    }

    /// Forgets the run (a new stream session).
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Whether the endpoint's events have stored only unusable groups for long enough.
    pub fn unusable(&self) -> bool {
        self.unusable
    }
}

/// Whether one endpoint's engine counts prompts as the rest of its pool does. The router
/// learns, per endpoint, how many canonical prompt bytes (the text the filter hashes) its
/// engine counts as one token (`usage.prompt_tokens` of its outcomes, decayed like
/// [`crate::token_ratio::TokenRatio`]). Endpoints of one model share a tokeniser and chat
/// template, so their ratios agree when they serve the same mix of text (a shift of the whole
/// traffic moves them all); one that sits more than [`SelfCheckConfig::bytes_per_token_drift`]
/// from the median of the others, each with [`SelfCheckConfig::min_samples`] outcomes,
/// tokenises otherwise, and its KV events (hashed from its token ids) cannot match the
/// router's. It is trusted again once within half that distance. Two other endpoints at
/// least: with one, which side drifted cannot be told.
///
/// Cache-aware routing does not give every endpoint the same mix, though: the sessions over
/// Cyrillic documents stay where their prefix is, the code reviews where theirs is, and the
/// byte ratios move apart with no tokeniser at fault. So the bound also grows with how far
/// the other endpoints' ratios already spread (three robust standard deviations, from their
/// median absolute deviation in log space, the usual outlier rule): an endpoint is judged
/// against the spread its own pool shows. Precise requests are checked in the router's own
/// token count instead of bytes (the router's `token_count` check), where the mix cannot
/// move the ratio.
#[derive(Debug, Clone)]
pub struct TokenRatioCheck {
    ratio: crate::token_ratio::TokenRatio,
    drifted: bool,
}

impl Default for TokenRatioCheck {
    fn default() -> Self {
        Self {
            ratio: crate::token_ratio::TokenRatio::new(0.0, true),
            drifted: false,
        }
    }
}

impl TokenRatioCheck {
    /// A served request of `prompt_bytes` canonical bytes counted `prompt_tokens` tokens.
    pub fn observe(&mut self, prompt_bytes: u64, prompt_tokens: u32) {
        self.ratio.observe(prompt_bytes, prompt_tokens);
    }

    /// The endpoint's learned bytes per token, once it has `config.min_samples` outcomes.
    pub fn ratio(&self, config: &SelfCheckConfig) -> Option<f64> {
        let enough = self.ratio.samples() as usize >= config.min_samples.max(1);
        self.ratio.observed().filter(|_| enough)
    }

    /// Judges the endpoint against `others`, the learned ratios of the rest of its pool.
    pub fn judge(&mut self, others: &mut [f64], config: &SelfCheckConfig) {
        let drift = config.bytes_per_token_drift;
        let Some(own) = self.ratio(config) else {
            return;
        };
        if !(drift.is_finite() && drift > 0.0) {
            self.drifted = false;
            return;
        }
        if others.len() < 2 {
            return;
        }
        let Some(middle) = median(others).filter(|m| *m > 0.0) else {
            return;
        };
        // Symmetric in log space: twice as many bytes per token is as far off as half.
        let off = (own / middle).ln().abs();
        let mut deviations: Vec<f64> = others
            .iter()
            .filter(|r| **r > 0.0)
            .map(|r| (r / middle).ln().abs())
            .collect();
        // 1.4826 x MAD estimates a normal spread's standard deviation.
        let spread = 1.4826 * median(&mut deviations).unwrap_or(0.0);
        let bound = if self.drifted {
            (1.0 + drift / 2.0).ln().max(1.5 * spread)
        } else {
            (1.0 + drift).ln().max(3.0 * spread)
        };
        self.drifted = off > bound;
    }

    /// Whether the endpoint tokenises otherwise than its pool.
    pub fn drifted(&self) -> bool {
        self.drifted
    }
}

/// The median of `values` (sorting them), `None` when there are none: what a check that
/// compares one endpoint with its peers takes as the peers' typical value.
pub(crate) fn median(values: &mut [f64]) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    match values.len() {
        0 => None,
        n if n.is_multiple_of(2) => Some((values[mid - 1] + values[mid]) / 2.0),
        _ => Some(values[mid]),
    }
}

/// Served requests whose first block is awaited in one endpoint's event index, at most.
const MAX_AWAITED: usize = 256;

/// Whether one endpoint's KV events hold the blocks the router hashed for the requests it
/// served there. An engine publishes `BlockStored` for every prompt block it computes, so once
/// it has answered a request it computed from the start (it reported less than one block
/// cached), the first block of the prompt (as the router hashed it) is in its event-fed index.
/// (A request that hit says nothing: its first block may have been stored before the index
/// was last dropped.) When it is almost never there,
/// the engine hashes prompts otherwise than the router (a cache salt it leaves out, another
/// chat template or tokeniser, a LoRA adapter it knows under another name): believed and
/// delivered hits cannot show that, since neither side ever believes a hit there.
///
/// Each served request's first block is awaited for [`SelfCheckConfig::confirm_after_ms`]
/// (the events may trail the answer), then looked up: held or not. Over a window of such
/// verdicts the same thresholds as for hits apply: under
/// [`SelfCheckConfig::enter_below`] held the endpoint is mismatched, over
/// [`SelfCheckConfig::leave_above`] on fresh verdicts it is trusted again. Eviction before the
/// lookup makes a few verdicts false; it cannot make nearly all of them false. The verdicts go
/// on while mismatched (they need no credit, only served requests), so no probe is needed.
#[derive(Debug, Clone, Default)]
pub struct EventHashCheck {
    /// First-block hashes of served requests and when to look them up, oldest first.
    awaited: VecDeque<(u64, u64)>,
    /// Recent verdicts (whether the index held the block), oldest first.
    verdicts: VecDeque<bool>,
    held: usize,
    mismatched: bool,
    /// The held share and the verdicts of the window that made the last change.
    decided: (f64, usize),
}

impl EventHashCheck {
    /// A request the endpoint served, whose prompt's first block the router hashed as `hash`:
    /// it is looked up from `now_ms + confirm_after_ms` on.
    pub fn expect(&mut self, hash: u64, now_ms: u64, config: &SelfCheckConfig) {
        if !config.enabled {
            return;
        }
        self.awaited
            .push_back((hash, now_ms.saturating_add(config.confirm_after_ms)));
        while self.awaited.len() > MAX_AWAITED {
            self.awaited.pop_front();
        }
    }

    /// The next awaited hash whose time has come at `now_ms`, removed.
    pub fn next_due(&mut self, now_ms: u64) -> Option<u64> {
        if self.awaited.front().is_some_and(|&(_, at)| at <= now_ms) {
            return self.awaited.pop_front().map(|(hash, _)| hash);
        }
        None
    }

    /// Forgets the awaited hashes (the event index was dropped: nothing they said holds).
    pub fn forget_awaited(&mut self) {
        self.awaited.clear();
    }

    /// One verdict: whether the event index held an awaited block. Returns whether it changed
    /// [`EventHashCheck::mismatched`].
    pub fn observe(&mut self, held: bool, config: &SelfCheckConfig) -> bool {
        if !config.enabled {
            return false;
        }
        self.verdicts.push_back(held);
        self.held += usize::from(held);
        while self.verdicts.len() > config.window.max(1) {
            if self.verdicts.pop_front() == Some(true) {
                self.held -= 1;
            }
        }
        if self.verdicts.len() < config.min_samples.max(1) {
            return false;
        }
        let share = self.held_share();
        let changed = if self.mismatched {
            share > config.leave_above
        } else {
            share < config.enter_below
        };
        if changed {
            self.mismatched = !self.mismatched;
            self.decided = (share, self.verdicts.len());
            self.verdicts.clear();
            self.held = 0;
        }
        changed
    }

    /// Whether the endpoint's events are known not to hold the router's blocks.
    pub fn mismatched(&self) -> bool {
        self.mismatched
    }

    /// The held share and the number of verdicts that made the last change.
    pub fn decided(&self) -> (f64, usize) {
        self.decided
    }

    /// Held / looked up over the current window (1 with no verdict).
    pub fn held_share(&self) -> f64 {
        if self.verdicts.is_empty() {
            1.0
        } else {
            self.held as f64 / self.verdicts.len() as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A check that learned `ratio` bytes per token, judged against `others`.
    fn judged(ratio: f64, others: &[f64]) -> bool {
        let config = SelfCheckConfig::default();
        let mut check = TokenRatioCheck::default();
        for _ in 0..config.min_samples {
            check.observe((ratio * 1_000.0) as u64, 1_000);
        }
        check.judge(&mut others.to_vec(), &config);
        check.drifted()
    }

    #[test]
    fn an_endpoint_is_judged_against_the_spread_its_pool_shows() {
        // Others agree: 40 % more bytes a token is another tokeniser.
        assert!(judged(5.6, &[4.0, 4.0, 4.1]));
        assert!(!judged(4.4, &[4.0, 4.0, 4.1]));
        // Others already spread as far (prose, code and tables where their prefixes are):
        // the Cyrillic documents' endpoint is one more mix, not a verdict.
        assert!(!judged(5.6, &[2.7, 3.2, 4.5]));
        // Twice the spread's reach is still out.
        assert!(judged(12.0, &[2.7, 3.2, 4.5]));
    }

    fn feed(c: &mut EndpointCheck, n: usize, believed: u32, delivered: u32) -> Vec<StateChange> {
        let config = SelfCheckConfig::default();
        (0..n)
            .filter_map(|i| c.observe(believed, delivered, i as u64, &config))
            .collect()
    }

    // A control plane sends its configuration to the filters' copies; one built before
    // `unusable_group_batches` rejects unknown fields, so the default is left out.
    #[test]
    fn the_default_unusable_group_batches_is_not_serialized() {
        let text = serde_json::to_string(&SelfCheckConfig::default()).unwrap();
        assert!(!text.contains("unusable_group_batches"), "{text}");
        let set = SelfCheckConfig {
            unusable_group_batches: 8,
            ..SelfCheckConfig::default()
        };
        let back: SelfCheckConfig =
            serde_json::from_str(&serde_json::to_string(&set).unwrap()).unwrap();
        assert_eq!(back, set);
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
    fn an_unfilled_gap_is_outstanding_until_enough_batches_arrive_in_sequence() {
        let config = SelfCheckConfig {
            clean_batches_after_gap: 3,
            ..SelfCheckConfig::default()
        };
        let mut g = EventGapCheck::default();
        assert!(!g.in_sequence(&config), "no gap: nothing to end");
        assert!(!g.outstanding());
        g.lost();
        assert!(g.outstanding());
        assert!(!g.in_sequence(&config));
        assert!(!g.in_sequence(&config));
        // Another loss before the stream ran clean: the count starts again.
        g.lost();
        assert!(!g.in_sequence(&config));
        assert!(!g.in_sequence(&config));
        assert!(g.outstanding());
        assert!(g.in_sequence(&config), "the third batch in a row ends it");
        assert!(!g.outstanding());
        assert!(!g.in_sequence(&config), "ended once");
        g.lost();
        g.clear();
        assert!(!g.outstanding());
    }

    #[test]
    fn blocks_the_events_never_hold_mismatch_the_endpoint_until_they_do_again() {
        let config = SelfCheckConfig::default();
        let mut c = EventHashCheck::default();
        c.expect(7, 100, &config);
        assert_eq!(c.next_due(1_099), None, "the events may trail the answer");
        assert_eq!(c.next_due(1_100), Some(7));
        assert_eq!(c.next_due(1_100), None);
        // Never held: mismatched once the window has enough verdicts, and only once.
        let entered: Vec<bool> = (0..8).map(|_| c.observe(false, &config)).collect();
        assert_eq!(
            entered,
            [false, false, false, false, false, false, false, true]
        );
        assert!(c.mismatched());
        assert_eq!(c.decided(), (0.0, 8));
        assert!((0..20).all(|_| !c.observe(false, &config)));
        // Held again (the engine was fixed): trusted once more than half are held.
        let left = (0..40).filter(|_| c.observe(true, &config)).count();
        assert_eq!(left, 1);
        assert!(!c.mismatched());
    }

    #[test]
    fn evictions_before_the_lookup_do_not_mismatch_an_endpoint() {
        let config = SelfCheckConfig::default();
        let mut c = EventHashCheck::default();
        // A third of the blocks evicted before they are looked up.
        assert!((0..300).all(|i| !c.observe(i % 3 != 0, &config)));
        assert!(!c.mismatched());
    }

    #[test]
    fn awaited_blocks_are_bounded_and_can_be_forgotten() {
        let config = SelfCheckConfig::default();
        let mut c = EventHashCheck::default();
        for h in 0..(MAX_AWAITED as u64 + 10) {
            c.expect(h, 0, &config);
        }
        assert_eq!(c.next_due(u64::MAX), Some(10), "the oldest were dropped");
        c.forget_awaited();
        assert_eq!(c.next_due(u64::MAX), None);
        let off = SelfCheckConfig {
            enabled: false,
            ..SelfCheckConfig::default()
        };
        c.expect(1, 0, &off);
        assert_eq!(c.next_due(u64::MAX), None);
        assert!((0..100).all(|_| !c.observe(false, &off)));
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
        assert_eq!(
            serde_json::to_string(&StateReason::KvEventGap).unwrap(),
            "\"kv_event_gap\""
        );
        assert_eq!(StateReason::KvEventGap.as_str(), "kv_event_gap");
    }
}
