//! The routing state machine: endpoints, their load, the prefix index, and the scorer.
//!
//! `Router` is sans-IO in quinn's style: inputs are method calls with `now_ms` (and a seed where a
//! random choice is made), outputs are returned values. The control plane drives it from HTTP
//! and scrapes; fleet-sim drives the very same code from virtual time.
//!
//! Cost model: for each usable endpoint, an estimate in milliseconds of how long this request
//! would wait and prefill there:
//! `queue_ms` (prefill work already sent there and not yet drained, router-side) +
//! `prefill_ms` (this request's uncached tokens) + `decode_ms` (running sequences slow every
//! step, and the context they hold brings their next turns back) + `kv_ms` (KV pressure:
//! near-full caches evict and preempt; the scraped usage, or the router's own in-flight
//! allocations over the replica's capacity when those are higher, since the scrape lags a
//! burst). Lowest cost wins; ties break by the seed; a guard keeps one hot
//! replica from taking everything.

use std::collections::VecDeque;

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

use crate::address::EndpointAddress;

use crate::affinity::{SessionConfig, SessionStats};
use crate::calibration::{
    Calibrated, CalibrationConfig, EndpointCalibration, EngineCounters, Prior,
};
use crate::disagg::{EndpointRole, PdConfig};
use crate::index::{EndpointId, EndpointSet, MAX_ENDPOINTS, PrefixIndex};
use crate::latency::{
    EndpointLatencyModel, LatencyConfig, LatencyFeatures, LatencyPrediction, Observation,
    PredictionErrors,
};
use crate::lora::{LoraConfig, LoraState};
use crate::pools::{Eligibility, FleetState, ModelsConfig, PoolStats, ServedModel};
use crate::precise::{ApplyError, KvEvent, PreciseTracker};
use crate::protocol::{Outcome, Reject, RouteReason, RouteRequest, RouteResponse};
use crate::reuse::{
    Aim, MismatchLog, MismatchRecord, PoolKey, PoolTotals, ReuseConfig, ReuseOutcome, ReuseTotals,
    ReuseWindow,
};
use crate::self_check::{
    EndpointCheck, EventGapCheck, EventGroupCheck, EventHashCheck, RoutingState, SelfCheckConfig,
    StateChange, StateReason, TokenRatioCheck,
};
use crate::token_ratio::TokenRatio;

/// Tunables of the scorer. Defaults come from fleet-sim sweeps (see README).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringConfig {
    /// Prefill throughput a replica is assumed to have before calibration has seen it work,
    /// tokens per millisecond (with `calibration.enabled: false`, the rate for every replica).
    pub prefill_tokens_per_ms: f64,
    /// Weight of this request's own prefill in the cost. Above 1 it also charges the delay that
    /// extra (uncached) work imposes on later requests to that replica, which keeps a
    /// saturated fleet from trading cache hits for momentarily shorter queues.
    pub prefill_weight: f64,
    /// Added cost per active sequence on a replica (decode steps grow with batch size).
    pub decode_ms_per_seq: f64,
    /// Added cost at 100% KV usage, linear in usage: decode steps slow down as the batch's KV
    /// grows (about two steps' worth of slow-down for a new request).
    pub kv_decode_ms: f64,
    /// Time per output token on an idle replica (a decode step with one short sequence), the
    /// prior calibration starts from.
    pub itl_ms_idle: f64,
    /// Time per output token when the replica's KV cache is full, the prior calibration
    /// starts from.
    pub itl_ms_full: f64,
    /// Weight of the stall this request's prefill imposes on the replica's running sequences:
    /// vLLM runs prefill and decode in the same steps, so every one of the `active` sequences
    /// there waits about this request's prefill time once. The cost adds `weight x active x
    /// prefill_ms`; without it a shared prefix draws every conversation onto the one replica
    /// that holds it, whose decode then crawls while its TTFT stays low.
    pub prefill_stall_weight: f64,
    /// Weight of a candidate's decode occupancy: the prompt tokens of the requests the router
    /// has in flight there (a prefix they share counted once, as vLLM holds it; no expected
    /// output), priced at the candidate's prefill rate. Each of them lengthens every decode
    /// step there, and in a tool-call loop or a chat brings its next turn back to the replica
    /// holding its context; without it a prefix every session shares (an agent's tool prompt)
    /// keeps drawing new sessions onto its few holders, whose decode then crawls. Dynamo's
    /// router weighs its workers' active KV blocks for the same reason.
    pub decode_occupancy_weight: f64,
    /// What the decode occupancy counts: `false`, the prompt tokens in flight with a prefix they
    /// share counted once (the KV they hold); `true`, every request's whole context, a shared
    /// prefix once per request (what each decode step reads: attention runs over each
    /// sequence's own context, shared blocks or not). Off by default: see docs/BENCHMARKS.md.
    /// Left out of the serialized form while off, so a filter built before it still accepts
    /// the copy's configuration.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub decode_occupancy_per_request: bool,
    /// Weight of the decode estimate (output tokens x time per token) in the cost: 0 scores
    /// time to first token only, 1 scores time to the last token.
    pub decode_weight: f64,
    /// Output tokens assumed when a request sets no `max_tokens`.
    pub default_output_tokens: u32,
    /// KV usage above which a replica is penalised.
    pub kv_pressure_threshold: f64,
    /// Penalty at 100% KV usage, scaled linearly from the threshold.
    pub kv_pressure_ms: f64,
    /// Tokens assumed for each waiting request the router did not send itself.
    pub unknown_request_tokens: f64,
    /// Guard: a replica with this many more in-flight requests than the least loaded one ...
    pub guard_abs: u32,
    /// ... and this many times as many, is skipped while any other replica is usable.
    pub guard_rel: f64,
    /// Costs within this many ms of the best count as a tie (broken by the seed).
    pub tie_ms: f64,
    /// Weight of the prefill contention this request's decode would meet on a candidate. vLLM
    /// runs prefill chunks in the same steps as decode, so a replica taking uncached prompt
    /// tokens at a share `rho` of its prefill rate spends about `rho` of its time prefilling,
    /// and a sequence decoding there takes about `1 / (1 - rho)` as long. The cost adds
    /// `weight x expected output tokens x idle time per token x rho / (1 - rho)`, `rho` being
    /// the uncached prompt tokens routed there over the last `prefill_contention_window_ms`
    /// (decayed) plus this request's own, so the price is convex: a long miss costs most where
    /// prefill already flows. The rate is the one calibration has learned for that
    /// replica, the prior until it has (learned whether or not `calibration.enabled`: a
    /// replica twice as fast takes twice the prefill for the same contention, which the prior
    /// cannot tell). The expected output is `max_tokens` capped at `default_output_tokens`: a
    /// client's cap is not its length. 0 turns it off. Left out of the serialized form at its
    /// default, so a filter built before it still accepts the copy's configuration.
    #[serde(skip_serializing_if = "is_default_contention_weight")]
    pub prefill_contention_weight: f64,
    /// Time constant of the decayed sum of uncached prompt tokens routed to each replica,
    /// ms: how far back the prefill contention looks (about the life of a short request).
    #[serde(skip_serializing_if = "is_default_contention_window")]
    pub prefill_contention_window_ms: f64,
}

/// The default `prefill_contention_weight`. Chosen on fleet-sim's tuning split (seeds 1-2):
/// TTFT geomean against the best peer p50 / p99 was 0.961 / 1.180 without the term, 0.909 /
/// 1.136 at 0.5 and 0.915 / 1.142 at 1.0 (window 1 s), 0.916 / 1.162 at 0.25 (window 2 s);
/// see docs/BENCHMARKS.md.
const CONTENTION_WEIGHT: f64 = 0.5;
/// The default `prefill_contention_window_ms`, chosen with the weight: at 0.5, a 0.5 s window
/// gave 0.961 / 1.178, 1 s 0.909 / 1.136, 2 s 0.916 / 1.181 and 4 s 0.917 / 1.161.
const CONTENTION_WINDOW_MS: f64 = 1000.0;

fn is_default_contention_weight(w: &f64) -> bool {
    *w == CONTENTION_WEIGHT
}

fn is_default_contention_window(w: &f64) -> bool {
    *w == CONTENTION_WINDOW_MS
}

impl Default for ScoringConfig {
    fn default() -> Self {
        Self {
            // A deliberately generic prior (a mid-size model on one GPU, roughly), not any one
            // machine's figures: online calibration replaces all three per endpoint once it has
            // served traffic (see `calibration`).
            prefill_tokens_per_ms: 5.0,
            prefill_weight: 2.0,
            decode_ms_per_seq: 1.0,
            kv_decode_ms: 0.0,
            itl_ms_idle: 15.0,
            itl_ms_full: 45.0,
            decode_weight: 0.0,
            // Chosen on fleet-sim's tuning split (seeds 1-2): 0.25 lowered the TTFT p50 geomean
            // against the best peer from 1.25 to 1.05 with p99 unchanged (1.29); 0.5 and 1.0
            // lowered p50 further but raised p99 (1.34, 1.39). Not a profile constant: the
            // stall is the candidate's own prefill estimate times its running sequences.
            prefill_stall_weight: 0.25,
            // Chosen on fleet-sim's tuning split (seeds 1-2, with the fleet-wide measured queue):
            // TTFT geomean against the best peer p50 / p99 was 1.00 / 1.17 at 0, 0.98 / 1.16 at
            // 0.05, 0.96 / 1.18 at 0.1, 0.97 / 1.17 at 0.25 and 1.01 / 1.17 at 0.5; above 0.1
            // the shared-prefix cells lose hits (p50 1.10 -> 1.15 at 0.25, 1.41 at 0.5).
            decode_occupancy_weight: 0.1,
            decode_occupancy_per_request: false,
            default_output_tokens: 300,
            kv_pressure_threshold: 0.9,
            kv_pressure_ms: 500.0,
            unknown_request_tokens: 512.0,
            guard_abs: 64,
            guard_rel: 1.5,
            tie_ms: 0.5,
            prefill_contention_weight: CONTENTION_WEIGHT,
            prefill_contention_window_ms: CONTENTION_WINDOW_MS,
        }
    }
}

/// The `router.responses` section. vLLM keeps a stored response (`VLLM_ENABLE_RESPONSES_API_STORE`)
/// in the memory of the replica that answered it, so a request continuing it, reading it or
/// cancelling it must go there. The router learns response id → replica from outcome reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoredResponsesConfig {
    /// A response id is forgotten this long after it was stored or last used.
    pub ttl_ms: u64,
    /// Most response ids remembered (least recently used are dropped first): every copy of
    /// the routing state holds this table, so it is bounded.
    pub max_entries: usize,
}

impl Default for StoredResponsesConfig {
    fn default() -> Self {
        Self {
            ttl_ms: 6 * 3_600_000,
            max_entries: 50_000,
        }
    }
}

/// The `router.cache_control` section: how firmly a prefix the client marked with Anthropic's
/// `cache_control` stays where it is cached. vLLM's cache ignores the markers (its LRU treats
/// every block alike, so the index does too); what a marker tells the router is that the
/// client will send that prefix again, so moving it costs its prefill now *and* on the turns
/// that follow it to its new replica.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheControlConfig {
    /// Future reads of a marked prefix the router counts on: a candidate holding `t` marked
    /// tokens is credited `reuse_weight × t / prefill rate` ms on top of the prefill it saves
    /// now, so the holder keeps a marked request until its extra wait exceeds that margin
    /// (an unmarked one moves sooner). 0 (the default) treats marked and unmarked prefixes
    /// alike. 1 is Anthropic's own break-even for a cache write (written to be read at least
    /// once). Off by default because it has not paid on fleet-sim: on its agentic workload
    /// with every prompt marked, as Claude Code marks them (tuning seeds 1-2), each weight
    /// from 0.25 to 2 raised the end-to-end p50 (1,488 ms at 0; 1,693 at 0.25, 2,077 at 1)
    /// by piling more sessions onto their holders, with TTFT p99 no better on the whole;
    /// marking only the shared tool prompt did no better (2,005 ms at 1).
    pub reuse_weight: f64,
}

impl Default for CacheControlConfig {
    fn default() -> Self {
        Self { reuse_weight: 0.0 }
    }
}

impl CacheControlConfig {
    /// Whether markers change nothing (`reuse_weight` 0 or less).
    pub fn is_off(&self) -> bool {
        self.reuse_weight.is_nan() || self.reuse_weight <= 0.0
    }
}

/// Router-wide configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Canonical bytes a hash block covers (must match the filter's setting).
    pub block_bytes: usize,
    /// Canonical bytes per token, to turn blocks into tokens (the starting value when
    /// `learn_bytes_per_token` is on).
    pub bytes_per_token: f64,
    /// Learn `bytes_per_token` from the engines' `usage.prompt_tokens` of routed requests (a
    /// decayed average over about the last 50), so the approximate index counts tokens right
    /// for the traffic's language without tuning.
    pub learn_bytes_per_token: bool,
    /// How long an approximate index entry lives without a touch.
    pub index_ttl_ms: u64,
    /// How long an in-flight entry lives without feedback (a lost report leaks nothing).
    pub inflight_ttl_ms: u64,
    /// Most prompt tokens, and most output tokens, one request is charged for: no served
    /// model takes more, so a forged route call cannot price a replica busy for days.
    pub max_request_tokens: u32,
    /// Fallback endpoints returned after the chosen one.
    pub fallbacks: usize,
    /// Metrics older than this count as stale.
    pub stale_after_ms: u64,
    /// The scorer's tunables.
    pub scoring: ScoringConfig,
    /// Precise mode (KV events) tunables.
    pub precise: PreciseConfig,
    /// Model pools: how a request's `model` narrows the candidates.
    pub models: ModelsConfig,
    /// Session affinity: the bonus of a session's remembered replica.
    pub sessions: SessionConfig,
    /// Stored responses (Responses API): which replica holds each response id.
    pub responses: StoredResponsesConfig,
    /// LoRA awareness: adapter load and full-slot costs.
    pub lora: LoraConfig,
    /// The learned per-endpoint latency model (predicted TTFT / time per output token).
    pub latency: LatencyConfig,
    /// Online calibration: each endpoint's prefill rate and decode step time from its counters.
    pub calibration: CalibrationConfig,
    /// Prefill/decode disaggregation: when a request also gets a prefill endpoint.
    pub pd: PdConfig,
    /// Local decisions: which requests a proxy's copy leaves to the control plane.
    pub local: crate::sync::LocalConfig,
    /// Believed against delivered cache hits per endpoint, and the load-only fallback.
    pub self_check: SelfCheckConfig,
    /// Prefixes the client marked with `cache_control`: how much firmer they stay. Left out of
    /// the configuration sent to copies while off, so copies built before it still parse it.
    #[serde(skip_serializing_if = "CacheControlConfig::is_off")]
    pub cache_control: CacheControlConfig,
    /// The fleet numbers: the traffic's reuse ceiling, its window and pool bounds. Copies keep
    /// no window, so the defaults are left out of the configuration sent to them (copies built
    /// before it still parse it).
    #[serde(skip_serializing_if = "ReuseConfig::is_default")]
    pub reuse: ReuseConfig,
}

/// Tunables of precise mode: an index fed by the engines' KV events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PreciseConfig {
    /// Tokens per engine KV block (vLLM `block_size`); request token hashes use the same size.
    pub block_tokens: usize,
    /// How long a routed request's blocks count as present on its endpoint before events
    /// confirm them, so a burst with one prefix does not scatter before the first events land.
    pub speculative_ttl_ms: u64,
    /// Credit for a block held in a CPU or storage tier, relative to GPU (recompute is 0).
    pub offload_weight: f64,
}

impl Default for PreciseConfig {
    fn default() -> Self {
        Self {
            block_tokens: 16,
            speculative_ttl_ms: 2_000,
            offload_weight: 0.5,
        }
    }
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            block_bytes: crate::hash::DEFAULT_BLOCK_BYTES,
            bytes_per_token: 4.0,
            learn_bytes_per_token: false,
            index_ttl_ms: 120_000,
            inflight_ttl_ms: 300_000,
            max_request_tokens: 1 << 20,
            fallbacks: 2,
            stale_after_ms: 2_000,
            scoring: ScoringConfig::default(),
            precise: PreciseConfig::default(),
            models: ModelsConfig::default(),
            sessions: SessionConfig::default(),
            responses: StoredResponsesConfig::default(),
            lora: LoraConfig::default(),
            latency: LatencyConfig::default(),
            calibration: CalibrationConfig::default(),
            pd: PdConfig::default(),
            local: crate::sync::LocalConfig::default(),
            self_check: SelfCheckConfig::default(),
            cache_control: CacheControlConfig::default(),
            reuse: ReuseConfig::default(),
        }
    }
}

/// The scraped view of one replica (vLLM `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EndpointMetrics {
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc` (0..=1).
    pub kv_usage: f64,
    /// KV capacity in tokens (`num_gpu_blocks * block_size` of `vllm:cache_config_info`).
    pub capacity_tokens: Option<u64>,
    /// The cumulative counters online calibration learns rates from (absent: an engine that
    /// does not export them, or a scraper that does not read them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<EngineCounters>,
    /// Tokens per KV block, the `block_size` label of `vllm:cache_config_info`: an engine
    /// whose blocks differ from `router.precise.block_tokens` is `degraded` (its KV events
    /// name other blocks than the router hashes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// The engine's own prefix-cache counters (`vllm:prefix_cache_hits_total` over
    /// `vllm:prefix_cache_queries_total`): delivered reuse over all its traffic, routed here or
    /// not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_cache: Option<PrefixCacheCounters>,
}

/// An engine's cumulative prefix-cache counters, in tokens, as last scraped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefixCacheCounters {
    /// `vllm:prefix_cache_hits_total`: prompt tokens served from the prefix cache.
    pub hits: f64,
    /// `vllm:prefix_cache_queries_total`: prompt tokens looked up in it.
    pub queries: f64,
}

/// Why an endpoint is not a candidate right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Usable.
    Ready,
    /// Its metrics endpoint does not answer.
    Unreachable,
}

#[derive(Debug, Clone)]
struct Slot {
    address: EndpointAddress,
    health: Health,
    metrics: Option<EndpointMetrics>,
    scraped_at_ms: u64,
    /// Prefill tokens sent here and not yet drained, as of `backlog_at_ms`.
    backlog_tokens: f64,
    backlog_at_ms: u64,
    /// Uncached prompt tokens routed here, decayed: the prefill contention's inflow.
    prefill_inflow: DecayedTokens,
    /// Prefill tokens of the router's streamed in-flight requests here whose first token has
    /// not been reported: the queue measured, where `backlog_tokens` is estimated from a rate.
    unconfirmed_tokens: f64,
    /// The part of the backlog no first token will measure (buffered requests, prefills for
    /// another endpoint), drained at the rate as `backlog_tokens` is, as of `backlog_at_ms`.
    buffered_tokens: f64,
    inflight: u32,
    /// The KV the router's in-flight requests here hold: a prediction of KV use that does not
    /// wait for the next scrape, so a burst cannot pile more concurrent prompts onto one
    /// replica than its KV cache holds (they would wait there).
    inflight_kv: InflightKv,
    /// Whether this endpoint's KV-event stream is live (precise scoring trusts it).
    events_live: bool,
    /// Whether it has a KV-event stream at all (one was ever reported live or down): without a
    /// live one it is `degraded` (precise requests are scored from the approximate index).
    events_expected: bool,
    /// Whether it delivers the hits the index believes it holds ([`crate::self_check`]).
    check: EndpointCheck,
    /// Its engine's block size when it differs from `router.precise.block_tokens`: it is
    /// `degraded` (reason `block_size`) and scored from the approximate index.
    other_block_size: Option<u32>,
    /// Whether its KV-event stream lost batches no replay filled, and has not run clean since:
    /// it is `degraded` (reason `kv_event_gap`) and scored from the approximate index.
    event_gap: EventGapCheck,
    /// Whether its KV events hold the blocks the router hashed for the requests it served:
    /// when they almost never do it is `degraded` (reason `hash_mismatch`) and scored from the
    /// approximate index.
    hashes: EventHashCheck,
    /// Whether its KV events store blocks of a KV-cache group the index can use: when they
    /// store only other groups it is `degraded` (reason `event_groups`) and scored from the
    /// approximate index.
    event_groups: EventGroupCheck,
    /// Whether its engine counts canonical prompt bytes in as many tokens as the rest of its
    /// pool: when it clearly does not it is `degraded` (reason `bytes_per_token`) and scored
    /// from the approximate index.
    bytes_per_token: TokenRatioCheck,
    /// What the engine reported for requests it served (for per-endpoint hit rates).
    served: ServedTotals,
    /// The fleet numbers of the outcomes it served ([`crate::reuse`]).
    reuse: ReuseTotals,
    /// TTFT / TPOT model learned from this endpoint's outcomes.
    latency: EndpointLatencyModel,
    /// Prefill rate and decode step time learned from its counters ...
    calibration: EndpointCalibration,
    /// ... what it has learned (the prior until it has done work) ...
    learned: Calibrated,
    /// ... and the rates scoring uses: `learned` with `calibration.enabled`, else the prior.
    rates: Calibrated,
    /// Prefill, decode or both (disaggregated serving).
    role: EndpointRole,
    /// Times it was picked as a request's prefill endpoint.
    prefill_picks: u64,
    /// The endpoint table's version when what copies see of this slot last changed
    /// ([`Router::endpoint_changes`]).
    version: u64,
    /// The scrape time copies were last sent (the refresh rule in `note_scrape`).
    sent_scrape_ms: u64,
}

impl Slot {
    /// Prefill tokens still queued at `now_ms`: the backlog drained at `tokens_per_ms` since
    /// the last decision.
    fn backlog_at(&self, now_ms: u64, tokens_per_ms: f64) -> f64 {
        let elapsed = now_ms.saturating_sub(self.backlog_at_ms) as f64;
        (self.backlog_tokens - elapsed * tokens_per_ms).max(0.0)
    }

    /// Waiting requests the router did not send, and the batch a new request joins: the queue
    /// and batch terms scoring and admission share. `fresh` is the scrape when not stale.
    fn unseen_waiting_and_active(&self, fresh: Option<EndpointMetrics>) -> (u32, u32) {
        match fresh {
            Some(m) => (
                m.waiting.saturating_sub(self.inflight),
                (m.running + m.waiting).max(self.inflight),
            ),
            None => (0, self.inflight),
        }
    }

    /// Ends one in-flight request here (answered, expired).
    fn release(&mut self, entry: &InFlight) {
        self.inflight = self.inflight.saturating_sub(1);
        self.inflight_kv.remove(entry);
        if entry.awaiting_first_token {
            self.unconfirmed_tokens =
                (self.unconfirmed_tokens - f64::from(entry.prefill_tokens)).max(0.0);
        }
    }

    /// How far scoring trusts what the index says this endpoint holds: load-only on a
    /// mismatch, else degraded while an expected KV-event stream is down, else exact.
    fn routing_state(&self) -> RoutingState {
        self.state_and_reason().0
    }

    /// Why [`Slot::routing_state`] is not exact.
    fn state_reason(&self) -> Option<StateReason> {
        self.state_and_reason().1
    }

    /// The state and its reason: load-only on a mismatch; else degraded when the engine's
    /// block size is not the configured one, while an expected KV-event stream is down, while
    /// it has not run clean since it lost batches, while its events store only KV-cache groups
    /// the index cannot use, while its events do not hold the blocks the router hashes, or
    /// while it counts prompts in other tokens than its pool; else exact.
    fn state_and_reason(&self) -> (RoutingState, Option<StateReason>) {
        if self.check.load_only() {
            (RoutingState::LoadOnly, Some(StateReason::Mismatch))
        } else if self.other_block_size.is_some() {
            (RoutingState::Degraded, Some(StateReason::BlockSize))
        } else if self.events_expected && !self.events_live {
            (RoutingState::Degraded, Some(StateReason::NoKvEvents))
        } else if self.event_gap.outstanding() {
            (RoutingState::Degraded, Some(StateReason::KvEventGap))
        } else if self.event_groups.unusable() {
            (RoutingState::Degraded, Some(StateReason::EventGroups))
        } else if self.hashes.mismatched() {
            (RoutingState::Degraded, Some(StateReason::HashMismatch))
        } else if self.bytes_per_token.drifted() {
            (RoutingState::Degraded, Some(StateReason::BytesPerToken))
        } else {
            (RoutingState::Exact, None)
        }
    }

    /// Whether its KV-event index may score precise requests: a live stream of blocks of the
    /// configured size that lost no batch since it last ran clean, and holds the blocks the
    /// router hashes.
    fn precise_usable(&self) -> bool {
        self.events_whole() && !self.hashes.mismatched() && !self.bytes_per_token.drifted()
    }

    /// Whether its event index says what the engine holds, in the engine's hashes: a live
    /// stream of blocks of the configured size that lost no batch since it last ran clean.
    /// Only then does a block missing from it say the router's hashes are not the engine's.
    fn events_whole(&self) -> bool {
        self.events_live
            && self.other_block_size.is_none()
            && !self.event_gap.outstanding()
            && !self.event_groups.unusable()
    }

    /// What a copy needs of this endpoint ([`Router::endpoint_snapshots`]).
    fn snapshot(&self, now_ms: u64) -> crate::sync::EndpointSnapshot {
        crate::sync::EndpointSnapshot {
            address: self.address.to_string(),
            usable: self.health == Health::Ready,
            metrics: self.metrics.filter(|_| self.health == Health::Ready),
            metrics_age_ms: now_ms.saturating_sub(self.scraped_at_ms),
        }
    }
}

/// How long first-token reports may pause before queues are estimated from prefill rates again
/// (the proxies stopped sending them, or the whole fleet idled).
const FIRST_TOKEN_WINDOW_MS: u64 = 10_000;

/// Prompt tokens one in-flight KV sample stands for: a chained hash names its whole prefix, so
/// the blocks ending each 512 tokens of two prompts agree exactly when their prefixes do, and
/// one map entry per 512 tokens keeps the union within one sample of exact at a fraction of the
/// cost (every block of a prompt cost 13k instructions per decision in `route_loop`).
const KV_SAMPLE_TOKENS: f64 = 512.0;

/// How many blocks of `block_tokens` one sample stands for.
fn kv_sample_blocks(block_tokens: f64) -> usize {
    (KV_SAMPLE_TOKENS / block_tokens.max(1.0)).round().max(1.0) as usize
}

/// The sampled chained hashes of `blocks` (the last block of each full run of `step`).
fn kv_samples(blocks: &[u64], step: usize) -> impl Iterator<Item = &u64> {
    blocks.iter().skip(step - 1).step_by(step)
}

/// The KV held by one endpoint's in-flight requests: the union of their prompt blocks (a prefix
/// they share is held once, as vLLM holds it) plus each one's private tokens (expected output,
/// the prompt's tail after its last sampled block).
#[derive(Debug, Clone, Default)]
struct InflightKv {
    /// Sampled block hash (standing for the `KV_SAMPLE_TOKENS` ending at it) -> in-flight
    /// requests holding it.
    blocks: HashMap<u64, u32>,
    tokens: f64,
    /// The part of `tokens` that is expected output, not prompt (the decode occupancy leaves
    /// it out: a client's `max_tokens` cap is no estimate of the answer).
    output_tokens: f64,
    /// Every in-flight request's prompt tokens, a shared prefix counted once per request: what
    /// each decode step reads (attention runs over each sequence's own context).
    contexts: f64,
}

impl InflightKv {
    fn add(&mut self, entry: &InFlight) {
        for &h in entry.kv_blocks.iter() {
            let holders = self.blocks.entry(h).or_insert(0);
            if *holders == 0 {
                self.tokens += entry.kv_block_tokens;
            }
            *holders += 1;
        }
        self.tokens += f64::from(entry.kv_private_tokens);
        self.output_tokens += f64::from(entry.kv_output_tokens);
        self.contexts += entry.context_tokens();
    }

    /// Prompt tokens of every in-flight request, a shared prefix once per request.
    fn context_tokens(&self) -> f64 {
        self.contexts
    }

    /// Prompt tokens held (a shared prefix once), without expected output: the decode
    /// occupancy.
    fn prompt_tokens(&self) -> f64 {
        (self.tokens - self.output_tokens).max(0.0)
    }

    /// Tokens of the prompt prefix `blocks` (chained hashes of `block_tokens` each) that
    /// in-flight requests hold, in whole samples.
    fn held_prefix_tokens(&self, blocks: &[u64], block_tokens: f64) -> f64 {
        let step = kv_sample_blocks(block_tokens);
        let held = kv_samples(blocks, step)
            .take_while(|h| self.blocks.contains_key(*h))
            .count();
        (held * step) as f64 * block_tokens
    }

    fn remove(&mut self, entry: &InFlight) {
        for h in entry.kv_blocks.iter() {
            if let Some(holders) = self.blocks.get_mut(h) {
                *holders -= 1;
                if *holders == 0 {
                    self.blocks.remove(h);
                    self.tokens -= entry.kv_block_tokens;
                }
            }
        }
        self.tokens = (self.tokens - f64::from(entry.kv_private_tokens)).max(0.0);
        self.output_tokens = (self.output_tokens - f64::from(entry.kv_output_tokens)).max(0.0);
        self.contexts = (self.contexts - entry.context_tokens()).max(0.0);
        if self.blocks.is_empty() && self.tokens < 1.0 {
            self.tokens = 0.0;
            self.output_tokens = 0.0;
            self.contexts = 0.0;
        }
    }
}

/// Totals of the outcomes an endpoint served, as the engines reported them: the fleet page and
/// `/metrics` turn their rates into per-endpoint prefix-cache hit rates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServedTotals {
    /// Outcomes reported for requests this endpoint served.
    pub outcomes: u64,
    /// Outcomes whose chosen endpoint was a different one (Envoy used a fallback).
    pub fallbacks: u64,
    /// `usage.prompt_tokens`, over outcomes reporting both prompt and cached tokens.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`, over the same outcomes.
    pub cached_tokens: u64,
}

#[derive(Debug, Clone)]
struct InFlight {
    endpoint: EndpointId,
    predicted_cached_tokens: u32,
    /// What the index believed the endpoint held of the prompt when it was chosen, credited
    /// or not (a load-only endpoint's belief is still checked against what it delivers).
    believed_cached_tokens: u32,
    /// The request's canonical bytes, to learn bytes per token from its reported usage.
    prompt_bytes: u64,
    /// Its sampled prompt blocks, held in its endpoint's `inflight_kv` until it ends.
    kv_blocks: Box<[u64]>,
    /// Tokens one of `kv_blocks` stands for (about `KV_SAMPLE_TOKENS`).
    kv_block_tokens: f64,
    /// Tokens it holds that no block covers (expected output, unhashed prompt).
    kv_private_tokens: u32,
    /// The part of `kv_private_tokens` that is expected output.
    kv_output_tokens: u32,
    /// The latency model's inputs at decision time, so the outcome can teach the model.
    latency_features: LatencyFeatures,
    /// Prefilled on another endpoint: its TTFT says nothing about this endpoint's prefill.
    remote_prefill: bool,
    /// The prefill tokens it added to its endpoint's backlog, refunded if the engine refuses
    /// it without prefilling.
    prefill_tokens: u32,
    /// When it was decided here: no reported time may exceed the time since.
    started_ms: u64,
    /// Its prefill is in its endpoint's `unconfirmed_tokens` until its first token is reported.
    awaiting_first_token: bool,
    /// The proxy's route call id, so the proxy can withdraw it (see [`Router::withdraw`]).
    call_id: Option<u64>,
    /// What the router knew of the request's reuse when it chose ([`crate::reuse`]).
    aim: Aim,
    /// The pool (model) its fleet numbers count under.
    pool: PoolKey,
    /// Whether the KV-event index scored the chosen endpoint.
    precise: bool,
    /// The chosen endpoint's routing state then.
    state: RoutingState,
    /// The first block of the prompt as the router hashed it for the KV-event index (precise
    /// requests), looked up there once the endpoint served it ([`EventHashCheck`]).
    first_token_block: Option<u64>,
}

impl InFlight {
    /// Its prompt tokens as the in-flight KV counts them (sampled blocks plus the unhashed
    /// tail; expected output left out).
    fn context_tokens(&self) -> f64 {
        self.kv_blocks.len() as f64 * self.kv_block_tokens
            + f64::from(self.kv_private_tokens.saturating_sub(self.kv_output_tokens))
    }
}

/// One candidate's score terms: what the explain output shows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CandidateScore {
    /// `ip:port` of the candidate.
    pub endpoint: EndpointAddress,
    /// Leading engine KV blocks (`precise.block_tokens` tokens each) of the prompt the
    /// candidate is believed to hold, in every mode (see `RouteResponse::cached_blocks`).
    pub cached_blocks: u32,
    /// Prompt tokens a hit there saves, in every mode (offload tiers count at their weight, a
    /// precise hit the queue ahead will evict does not count): compare candidates and modes
    /// on this, not on `cached_blocks`.
    pub cached_tokens: u32,
    /// Whether the KV-event index scored this candidate (false: the approximate index).
    pub precise: bool,
    /// Prompt tokens that would still need prefill there.
    pub uncached_tokens: u32,
    /// Wait for prefill work queued ahead.
    pub queue_ms: f64,
    /// This request's own prefill.
    pub prefill_ms: f64,
    /// Slow-down from running sequences (their count, the stall of this request's prefill, the
    /// decode occupancy of their prompts), the prefill contention this request's decode would
    /// meet, plus the weighted estimate of this request's decode.
    pub decode_ms: f64,
    /// KV-pressure penalty.
    pub kv_ms: f64,
    /// Cost: the terms summed, this request's prefill weighted by `prefill_weight`.
    pub total_ms: f64,
    /// Router-side in-flight requests on the candidate.
    pub inflight: u32,
    /// Set when the guard skipped this candidate.
    pub guarded: bool,
    /// Session-affinity bonus (negative) of the session's remembered, healthy replica.
    #[serde(default)]
    pub session_ms: f64,
    /// LoRA cost: loading the adapter, plus a penalty when all adapter slots hold others.
    #[serde(default)]
    pub lora_ms: f64,
    /// Credit (negative) for the part of the client's `cache_control`-marked prefix the
    /// candidate holds (`cache_control.reuse_weight`); the guard takes it back.
    #[serde(default)]
    pub cache_control_ms: f64,
    /// Time to first token the endpoint's learned latency model predicts for this request.
    #[serde(default)]
    pub predicted_ttft_ms: f64,
    /// Time per output token the learned model predicts there.
    #[serde(default)]
    pub predicted_tpot_ms: f64,
    /// Outcomes the endpoint's model has learned from (it steers scoring from
    /// `latency.min_samples` on).
    #[serde(default)]
    pub latency_samples: u32,
    /// What the learned model adds to `total_ms`: `blend × (learned − analytic)` estimate of
    /// this request's wait and prefill (0 while the model is cold or disabled).
    #[serde(default)]
    pub latency_ms: f64,
    /// The candidate's role. `prefill` candidates are listed after the decode candidates and
    /// scored on prefill terms only (`total_ms` = queue + weighted prefill + KV pressure).
    #[serde(default)]
    pub role: EndpointRole,
}

/// A routing decision and its explanation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// What the filter gets back.
    pub response: RouteResponse,
    /// Every candidate's terms, best first.
    pub candidates: Vec<CandidateScore>,
}

/// Counters the control plane exports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RouterStats {
    /// Decisions made.
    pub decisions: u64,
    /// Decisions with no usable endpoint (the filter fails open).
    pub no_endpoint: u64,
    /// Decisions where the guard skipped the cheapest candidate.
    pub guarded: u64,
    /// Outcomes received.
    pub outcomes: u64,
    /// In-flight entries that expired without an outcome.
    pub expired_inflight: u64,
    /// Sum of cached tokens the router predicted, over outcomes that reported cached tokens.
    pub predicted_cached_tokens: u64,
    /// Sum of cached tokens the engines reported, over the same outcomes.
    pub actual_cached_tokens: u64,
    /// KV events applied.
    pub kv_events: u64,
    /// KV events that could not be applied (the endpoint's precise state was dropped).
    pub kv_event_errors: u64,
    /// Decisions whose chosen endpoint was scored from KV events (the rest, bar
    /// `no_endpoint`, were scored from the approximate index).
    #[serde(default)]
    pub precise_decisions: u64,
    /// Outcomes served by another endpoint than the chosen one (a fallback of the list).
    #[serde(default)]
    pub fallbacks: u64,
    /// Decisions that also named a prefill endpoint (disaggregated prefill/decode).
    #[serde(default)]
    pub disaggregated: u64,
    /// Decisions another router took that this one accounted for ([`Router::record_decision`]).
    #[serde(default)]
    pub recorded_decisions: u64,
    /// Requests naming a stored response that went to the replica holding it.
    #[serde(default)]
    pub stored_response_pinned: u64,
    /// Requests naming a stored response no report had placed (routed as any other; a replica
    /// without it answers 404 as vLLM does).
    #[serde(default)]
    pub stored_response_unknown: u64,
    /// Requests naming a stored response whose replica is not usable now (gone, not ready, or
    /// not serving the model): routed as any other, so a replica answers 404.
    #[serde(default)]
    pub stored_response_unavailable: u64,
    /// Decisions withdrawn by the proxy that asked (it stopped waiting and failed open),
    /// before or after they were taken: their load was released at once.
    #[serde(default)]
    pub withdrawn: u64,
    /// Requests a local copy left to the control plane ([`Router::route_or_defer`]).
    #[serde(default)]
    pub deferred: u64,
    /// First-token reports received ([`Router::first_token`]).
    #[serde(default)]
    pub first_tokens: u64,
    /// Endpoint routing-state changes ([`crate::self_check`]): into load-only and back.
    #[serde(default)]
    pub state_changes: u64,
    /// Outcomes whose reported times exceeded the time since their decision (clamped).
    #[serde(default)]
    pub clamped_outcomes: u64,
}

/// Read-only view of one endpoint for metrics and the fleet page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointView {
    /// `ip:port`.
    pub address: String,
    /// Health as the scraper last saw it.
    pub health: Health,
    /// Whether the last scrape is older than `stale_after_ms`.
    pub stale: bool,
    /// Last scraped metrics.
    pub metrics: Option<EndpointMetrics>,
    /// Router-side in-flight requests.
    pub inflight: u32,
    /// Undrained prefill tokens the router sent.
    pub backlog_tokens: f64,
    /// Blocks the approximate index holds for it.
    pub indexed_blocks: usize,
    /// GPU blocks its KV events say it holds.
    pub precise_blocks: usize,
    /// Whether its KV-event stream is live.
    pub events_live: bool,
    /// What the engine reported for the requests it served.
    #[serde(default)]
    pub served: ServedTotals,
    /// How well its learned latency model predicted the outcomes it was then taught.
    #[serde(default)]
    pub latency_errors: PredictionErrors,
    /// Outcomes its latency model has learned from.
    #[serde(default)]
    pub latency_samples: u32,
    /// Prefill, decode or both.
    #[serde(default)]
    pub role: EndpointRole,
    /// Times it was picked as a request's prefill endpoint.
    #[serde(default)]
    pub prefill_picks: u64,
    /// The prefill rate and decode step time learned from its counters (the prior until it has
    /// finished requests); scoring uses them with `calibration.enabled`.
    #[serde(default)]
    pub calibration: Calibrated,
    /// How far scoring trusts what the index says it holds ([`crate::self_check`]).
    #[serde(default)]
    pub routing_state: RoutingState,
    /// Why it is not `exact`.
    #[serde(default)]
    pub state_reason: Option<StateReason>,
    /// Delivered over believed cached tokens of its recent outcomes (1 with no evidence).
    #[serde(default)]
    pub delivered_share: f64,
    /// The fleet numbers of the outcomes it served: reuse available, aimed for, delivered,
    /// and the gap by reason ([`crate::reuse`]).
    #[serde(default)]
    pub reuse: ReuseTotals,
}

/// Errors of endpoint management (routing itself never fails: no endpoint means an empty list).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouterError {
    /// The fleet is at `MAX_ENDPOINTS`.
    #[error("too many endpoints (at most {MAX_ENDPOINTS})")]
    TooManyEndpoints,
}

/// Endpoint state changes kept for [`Router::take_state_changes`] between two calls.
pub const MAX_STATE_CHANGES: usize = 256;

/// Endpoints, load accounting, prefix index and scorer behind one sans-IO API.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    slots: Vec<Option<Slot>>,
    by_address: HashMap<String, EndpointId>,
    index: PrefixIndex,
    precise: PreciseIndexes,
    inflight: HashMap<u64, InFlight>,
    /// `(started_ms, decision_id)` in decision order, so expiry pops what aged out instead of
    /// scanning every in-flight entry (profiles showed that scan at 22% of an HTTP decision
    /// while reports lagged). Entries already answered are skipped lazily.
    inflight_order: VecDeque<(u64, u64)>,
    next_decision_id: u64,
    /// Route call id → decision id of in-flight entries that came with one.
    calls: HashMap<u64, u64>,
    /// Call ids withdrawn before their decision was taken (the call was still queued), each
    /// with when: a decision arriving for one is not taken. Bounded ([`MAX_WITHDRAWN`]).
    withdrawn: VecDeque<(u64, u64)>,
    stats: RouterStats,
    /// Endpoint state changes not yet taken by [`Router::take_state_changes`], oldest first
    /// (bounded: [`MAX_STATE_CHANGES`]).
    state_changes: VecDeque<(String, StateChange)>,
    /// Recently seen prompt blocks: the traffic's reuse ceiling ([`crate::reuse`]), as large
    /// as the fleet's KV unless configured or overridden.
    reuse_window: ReuseWindow,
    /// The window's size set by [`Router::set_reuse_window`], whatever the fleet.
    reuse_window_override: Option<usize>,
    /// The fleet numbers per pool (model).
    reuse_pools: PoolTotals,
    /// Recent outcomes that delivered less than the index believed (`/debug/mismatch`).
    mismatches: MismatchLog,

    /// A running average of the rates endpoints have learned: the prior of one that has not.
    fleet_rates: Option<Prior>,
    /// `now_ms` of the last `expire`, so back-to-back decisions skip it.
    last_expire_ms: u64,
    /// Model pools, sessions and LoRA adapters (see `pools`, `affinity`, `lora`).
    fleet: FleetState,
    /// Per-decision working buffers, kept between decisions so `route` allocates none of them.
    scratch: RouteScratch,
    /// Canonical bytes per token in force (configured or learned).
    token_ratio: TokenRatio,
    /// What changed in the endpoint table and when, for sync answers that carry only that.
    table: TableVersions,
    /// Most blocks the approximate index holds over all endpoints (a proxy's copy sets it,
    /// [`Router::set_max_index_blocks`]); `None`: each endpoint's KV capacity alone bounds it.
    max_index_blocks: Option<usize>,
    /// When a first-token report (for any endpoint) last arrived: while they keep arriving, every
    /// endpoint's queue is measured, not drained at a rate. Fleet-wide, because the endpoint a
    /// long miss is sent to is often one that was idle and so has reported nothing lately: its
    /// queue drained at the prior rate (2-4x too fast on slower hardware) looked empty while
    /// the prefill ran, and the next long misses piled onto it.
    first_token_at_ms: Option<u64>,
}

/// Versions of the endpoint table as copies see it ([`crate::sync::EndpointSnapshot`]): every
/// change a copy must learn of (an endpoint added, removed, newly usable or unusable, a scrape
/// with other numbers, or a re-sent one) takes the next version, so a sync answer can carry
/// only what changed after the version a copy last got ([`Router::endpoint_changes`]).
#[derive(Debug, Default)]
struct TableVersions {
    /// The newest version handed out.
    version: u64,
    /// Endpoints removed, with their removal's version, oldest first; at most
    /// [`MAX_REMOVALS_KEPT`].
    removed: VecDeque<(u64, EndpointAddress)>,
    /// A copy at a version below this missed a removal no longer kept: it gets the whole table.
    floor: u64,
}

impl TableVersions {
    fn next(&mut self) -> u64 {
        self.version += 1;
        self.version
    }
}

/// Removals the endpoint table remembers for copies behind it: far more than a fleet's churn
/// between two syncs, and small. A copy behind more of them gets the whole table.
pub(crate) const MAX_REMOVALS_KEPT: usize = 1024;

/// Buffers `Router::route` fills every decision; reused, so a decision allocates only what it
/// returns (profiles showed a third of a decision's allocations were these).
#[derive(Debug, Default)]
struct RouteScratch {
    /// Matched prefix depths per endpoint slot (see [`look_up_prefixes`]).
    depths: DepthBuffers,
    /// The latency model's inputs per endpoint slot, written as each candidate is scored, so
    /// the chosen one's reach its in-flight entry.
    features: Vec<LatencyFeatures>,
    /// What the index believes each candidate holds of the prompt, in tokens, before a
    /// load-only endpoint's credit is taken away (written like `features`).
    believed: Vec<u32>,
    /// Sort keys of the candidates (see `cost_order`).
    keys: Vec<u128>,
    short_keys: Vec<u64>,
}

/// Matched prefix depth per endpoint slot: approximate index, then precise GPU, speculative and
/// offload indexes (the last three only for precise requests).
#[derive(Debug, Default)]
struct DepthBuffers {
    matched: Vec<usize>,
    gpu: Vec<usize>,
    spec: Vec<usize>,
    offload: Vec<usize>,
}

/// How deep each index matches one request's prompt, per endpoint slot: what
/// [`look_up_prefixes`] found, read per candidate by [`cached_prefix`].
#[derive(Debug, Clone, Copy)]
struct PrefixDepths<'s> {
    /// Hash blocks (`block_bytes` of canonical text each) of the approximate index.
    approximate: &'s [usize],
    /// Engine blocks the KV events say are on GPU (empty unless the request is precise).
    gpu: &'s [usize],
    /// Engine blocks recent decisions put there before events confirmed them (idem).
    speculative: &'s [usize],
    /// Engine blocks in CPU or storage tiers (idem).
    offload: &'s [usize],
}

/// What serving a request involves on any endpoint, worked out once per decision
/// ([`Router::shape_request`]).
#[derive(Debug, Clone, Copy)]
struct RequestShape<'r> {
    /// Token-block hashes came with the request: endpoints with a live event stream are scored
    /// from the event-fed indexes.
    precise: bool,
    /// Prompt tokens: a tokenizer's count when precise, canonical bytes at the ratio in force
    /// otherwise.
    tokens: u32,
    /// `tokens`, at least 1, as the cost terms use it.
    prompt_tokens: f64,
    /// Leading prompt tokens the client marked with `cache_control` (0: none), bounded by
    /// the prompt.
    marked_tokens: f64,
    /// The request's canonical bytes, bounded by the blocks it hashed.
    prompt_bytes: u64,
    /// `max_tokens`, or `scoring.default_output_tokens`.
    output_tokens: u32,
    /// Tokens one approximate hash block stands for.
    tokens_per_block: f64,
    /// Tokens of one engine block (`precise.block_tokens`).
    block_tokens: usize,
    /// Engine blocks a hit can cover: vLLM recomputes at least the last prompt token.
    hittable_blocks: usize,
    /// The request's token-block hashes (empty unless precise).
    token_blocks: &'r [u64],
    /// The blocks whose KV this request will hold (engine blocks when precise).
    kv_blocks: KvBlocks<'r>,
}

/// A prompt's chained block hashes and the tokens each stands for: what in-flight KV
/// accounting samples.
#[derive(Debug, Clone, Copy)]
struct KvBlocks<'r> {
    hashes: &'r [u64],
    block_tokens: f64,
}

/// Which endpoints may serve a request, and what about it favours some of them
/// ([`Router::select_pool`]).
#[derive(Debug)]
struct CandidatePool<'r> {
    /// By model pool: every endpoint, or those serving the model (or its base model).
    eligible: Eligibility,
    /// The model names a LoRA adapter: candidates pay its load cost ([`crate::lora`]).
    adapter: bool,
    /// The request's session and the replica it went to last.
    session: SessionAffinity<'r>,
    /// A decision made elsewhere (a proxy, another control plane) being recorded: the
    /// request went there, so its endpoint is scored whatever this router knows of its health
    /// and models. A control plane replaying the shared stream before it has polled every
    /// endpoint's `/v1/models` would otherwise drop those endpoints' decisions.
    recorded: Option<EndpointId>,
}

/// A request's session, when affinity is on, and the replica that session remembers.
#[derive(Debug, Clone, Copy, Default)]
struct SessionAffinity<'r> {
    /// The session key (`None`: no session, or `sessions.bonus_ms` is 0).
    key: Option<&'r str>,
    /// Where the session went last, within `sessions.ttl_ms`.
    remembered: Option<EndpointId>,
}

/// One usable endpoint while it is scored.
#[derive(Debug, Clone, Copy)]
struct Candidate<'s> {
    id: EndpointId,
    slot: &'s Slot,
    /// Its scrape, unless stale.
    fresh: Option<EndpointMetrics>,
    /// The decision's time.
    now_ms: u64,
}

/// How much of the prompt one candidate is believed to hold ([`cached_prefix`]).
#[derive(Debug, Clone, Copy)]
struct CachedPrefix {
    /// Leading engine blocks (`precise.block_tokens` tokens each) the hit covers: on GPU when
    /// precise, the approximate hit's tokens in whole blocks otherwise.
    blocks: usize,
    /// Prompt tokens a hit there saves: offloaded blocks at `precise.offload_weight`, less what
    /// the prefill queued ahead will evict first; below the prompt's length.
    tokens: f64,
    /// Scored from the event-fed indexes.
    precise: bool,
}

/// A candidate's analytic cost terms ([`cost_terms`]): the explain output's numbers.
#[derive(Debug, Clone, Copy)]
struct CostTerms {
    /// Prompt tokens still to prefill there.
    uncached_tokens: f64,
    /// The batch this request would join.
    active: u32,
    /// KV usage from a fresh scrape (0 without one).
    kv_usage: f64,
    /// Time per output token at that KV usage.
    itl_ms: f64,
    queue_ms: f64,
    prefill_ms: f64,
    decode_ms: f64,
    kv_ms: f64,
}

/// What moves a candidate's cost off the analytic terms ([`steering`]).
#[derive(Debug, Clone, Copy)]
struct Steering {
    /// Session-affinity bonus (negative) of the session's healthy replica.
    session_ms: f64,
    /// Credit (negative) for the marked prefix held there.
    cache_control_ms: f64,
    /// LoRA adapter load and full-slot cost.
    lora_ms: f64,
    /// The learned latency model's correction (0 while it is cold or off).
    latency_ms: f64,
    /// The learned model's prediction, shown in the explain output.
    predicted: LatencyPrediction,
    /// The learned model's inputs, kept for the chosen endpoint's outcome to teach it.
    features: LatencyFeatures,
}

/// The candidates in cost order and the choice among them ([`Router::rank`]).
#[derive(Debug)]
struct Ranking {
    /// The chosen endpoint.
    chosen: EndpointId,
    /// Its position in `candidates`.
    chosen_at: usize,
    /// Why it won (`guard`, `prefix` or `load`).
    reason: RouteReason,
    /// Decode candidates in slot order (`scratch.keys` holds their cost order).
    candidates: Vec<(EndpointId, CandidateScore)>,
    /// Prefill-only candidates, cheapest prefill first.
    prefill_only: Vec<(EndpointId, CandidateScore)>,
}

impl Ranking {
    fn chosen_score(&self) -> &CandidateScore {
        &self.candidates[self.chosen_at].1
    }
}

/// Where the chosen request's prompt is prefilled ([`Router::account_choice`]).
#[derive(Debug, Clone, PartialEq, Eq)]
enum PrefillSite {
    /// On the chosen (decode) endpoint itself.
    Chosen,
    /// On this prefill endpoint (`ip:port`), its KV transferred to the chosen one.
    Remote(String),
}

/// Sets `buffer` to `len` zeros, keeping its allocation.
fn zeroed(buffer: &mut Vec<usize>, len: usize) -> &mut [usize] {
    buffer.clear();
    buffer.resize(len, 0);
    buffer
}

/// The event-fed indexes of precise mode, keyed by token-block hashes.
#[derive(Debug)]
struct PreciseIndexes {
    tracker: PreciseTracker,
    gpu: PrefixIndex,
    offload: PrefixIndex,
    speculative: PrefixIndex,
    /// Endpoints whose engine evicted GPU blocks since their state was last rebuilt: their
    /// cache runs full (vLLM evicts only when no free block is left), so a queued prefill's
    /// every new block evicts a cached one.
    evicting: EndpointSet,
}

impl PreciseIndexes {
    fn clear(&mut self, id: EndpointId) {
        self.tracker.clear(id, &mut self.gpu, &mut self.offload);
        self.speculative.clear_endpoint(id);
        self.evicting.remove(id);
    }
}

/// The decision for a request the router refuses (the filter answers it locally).
fn rejected(decision_id: u64, reject: Reject) -> Decision {
    Decision {
        response: RouteResponse {
            decision_id,
            reason: reject.error_type.clone().into(),
            reject: Some(reject),
            ..Default::default()
        },
        candidates: Vec::new(),
    }
}

/// `request.prompt_bytes`, at most the whole blocks its `block_hashes` cover plus one partial
/// block: the filter hashes every whole block, so a prompt with no hash is shorter than one.
fn bounded_prompt_bytes(request: &RouteRequest, block_bytes: usize) -> u64 {
    let covered = (request.block_hashes.len() as u64 + 1).saturating_mul(block_bytes as u64);
    if block_bytes == 0 {
        request.prompt_bytes
    } else {
        request.prompt_bytes.min(covered)
    }
}

/// The most tokens `blocks` whole engine blocks plus one partial block hold.
fn block_count_tokens(blocks: usize, block_tokens: usize) -> u32 {
    u32::try_from((blocks + 1).saturating_mul(block_tokens)).unwrap_or(u32::MAX)
}

/// Withdrawn call ids remembered ahead of their decision: far more than the route calls a
/// proxy fleet can have queued during a stall, and a few kilobytes.
const MAX_WITHDRAWN: usize = 4096;

/// How long a withdrawn call id waits for its decision: a call queued longer than this is
/// presumed never to arrive.
const WITHDRAWN_TTL_MS: u64 = 60_000;

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Router {
    /// A router with no endpoints. `first_decision_id` lets a restarted control plane avoid
    /// reusing ids (pass e.g. the start time).
    pub fn new(config: RouterConfig, first_decision_id: u64) -> Self {
        let index = PrefixIndex::new(config.index_ttl_ms);
        // Event-fed entries live until the engine says they are gone.
        let precise = PreciseIndexes {
            tracker: PreciseTracker::new(),
            gpu: PrefixIndex::new(u64::MAX / 4),
            offload: PrefixIndex::new(u64::MAX / 4),
            speculative: PrefixIndex::new(config.precise.speculative_ttl_ms),
            evicting: EndpointSet::default(),
        };
        Self {
            slots: Vec::new(),
            by_address: HashMap::new(),
            index,
            precise,
            inflight: HashMap::new(),
            inflight_order: VecDeque::new(),
            next_decision_id: first_decision_id.max(1),
            calls: HashMap::new(),
            withdrawn: VecDeque::new(),
            stats: RouterStats::default(),
            state_changes: VecDeque::new(),
            reuse_window: ReuseWindow::new(config.reuse.window_for(0)),
            reuse_window_override: None,
            reuse_pools: PoolTotals::default(),
            mismatches: MismatchLog::default(),
            fleet_rates: None,
            last_expire_ms: u64::MAX,
            fleet: FleetState::default(),
            scratch: RouteScratch::default(),
            token_ratio: TokenRatio::new(config.bytes_per_token, config.learn_bytes_per_token),
            first_token_at_ms: None,
            config,
            table: TableVersions::default(),
            max_index_blocks: None,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Tokens one hash block stands for.
    pub fn tokens_per_block(&self) -> f64 {
        (self.config.block_bytes as f64 / self.token_ratio.bytes_per_token()).max(1.0)
    }

    /// Canonical bytes per token in force: `router.bytes_per_token`, or what outcomes taught
    /// when `learn_bytes_per_token` is on.
    pub fn bytes_per_token(&self) -> f64 {
        self.token_ratio.bytes_per_token()
    }

    /// Adds an endpoint (idempotent) and returns its id.
    pub fn upsert_endpoint(&mut self, address: &str) -> Result<EndpointId, RouterError> {
        if let Some(id) = self.by_address.get(address) {
            return Ok(*id);
        }
        let free = self.slots.iter().position(Option::is_none);
        let i = match free {
            Some(i) => i,
            None if self.slots.len() < MAX_ENDPOINTS => {
                self.slots.push(None);
                self.slots.len() - 1
            }
            None => return Err(RouterError::TooManyEndpoints),
        };
        let id = EndpointId(i as u16);
        self.slots[i] = Some(Slot {
            address: address.into(),
            health: Health::Ready,
            metrics: None,
            scraped_at_ms: 0,
            backlog_tokens: 0.0,
            backlog_at_ms: 0,
            prefill_inflow: DecayedTokens::default(),
            unconfirmed_tokens: 0.0,
            buffered_tokens: 0.0,
            inflight: 0,
            inflight_kv: InflightKv::default(),
            events_live: false,
            events_expected: false,
            check: EndpointCheck::default(),
            other_block_size: None,
            event_gap: EventGapCheck::default(),
            hashes: EventHashCheck::default(),
            event_groups: EventGroupCheck::default(),
            bytes_per_token: TokenRatioCheck::default(),
            served: ServedTotals::default(),
            reuse: ReuseTotals::default(),
            latency: EndpointLatencyModel::new(&self.config.scoring, &self.config.latency),
            calibration: EndpointCalibration::default(),
            learned: Calibrated::from_prior(prior(&self.config.scoring)),
            rates: Calibrated::from_prior(prior(&self.config.scoring)),
            role: EndpointRole::Both,
            prefill_picks: 0,
            version: self.table.next(),
            sent_scrape_ms: 0,
        });
        self.index.clear_endpoint(id);
        self.precise.clear(id);
        self.fleet.clear_endpoint(id);
        self.by_address.insert(address.to_string(), id);
        if self.max_index_blocks.is_some() {
            self.bound_every_index_share();
        }
        Ok(id)
    }

    /// Removes an endpoint and everything known about it.
    pub fn remove_endpoint(&mut self, address: &str) {
        if let Some(id) = self.by_address.remove(address) {
            if let Some(slot) = self.slots[usize::from(id.0)].take() {
                self.resize_reuse_window();
                let version = self.table.next();
                self.table.removed.push_back((version, slot.address));
                while self.table.removed.len() > MAX_REMOVALS_KEPT {
                    if let Some((forgotten, _)) = self.table.removed.pop_front() {
                        self.table.floor = forgotten;
                    }
                }
            }
            self.index.clear_endpoint(id);
            self.precise.clear(id);
            self.fleet.clear_endpoint(id);
            self.inflight.retain(|_, f| f.endpoint != id);
            if self.max_index_blocks.is_some() {
                self.bound_every_index_share();
            }
        }
    }

    /// The id of `address`, if known.
    pub fn endpoint_id(&self, address: &str) -> Option<EndpointId> {
        self.by_address.get(address).copied()
    }

    fn slot_mut(&mut self, address: &str) -> Option<(EndpointId, &mut Slot)> {
        let id = *self.by_address.get(address)?;
        self.slots[usize::from(id.0)].as_mut().map(|s| (id, s))
    }

    /// Records a successful scrape of `address`.
    pub fn update_metrics(&mut self, address: &str, metrics: EndpointMetrics, now_ms: u64) {
        let Some(&id) = self.by_address.get(address) else {
            return;
        };
        let Some(slot) = self.slots[usize::from(id.0)].as_mut() else {
            return;
        };
        let was = slot.state_and_reason();
        let block_tokens = self.config.precise.block_tokens;
        let other_block_size = metrics
            .block_size
            .filter(|&b| usize::try_from(b).ok() != Some(block_tokens));
        let new_mismatch = other_block_size.is_some() && slot.other_block_size.is_none();
        slot.other_block_size = other_block_size;
        let kv_changed = slot.metrics.and_then(|m| m.capacity_tokens) != metrics.capacity_tokens;
        // What copies see changes with other numbers or health; the same numbers are re-sent
        // once the scrape they hold is a quarter of `stale_after_ms` old, so a copy never
        // judges stale an endpoint the control plane scrapes: its scrape lags this one by at
        // most that, a scrape interval and a sync interval.
        let resend_after = (self.config.stale_after_ms / 4).max(1);
        if slot.health != Health::Ready
            || slot.metrics != Some(metrics)
            || now_ms.saturating_sub(slot.sent_scrape_ms) >= resend_after
        {
            slot.version = self.table.next();
            slot.sent_scrape_ms = now_ms;
        }
        slot.metrics = Some(metrics);
        slot.scraped_at_ms = now_ms;
        slot.health = Health::Ready;
        let (scoring, calibration) = (&self.config.scoring, &self.config.calibration);
        // An endpoint that has not shown its own rates yet starts from what its peers showed
        // (the configured prior only before any has): a fleet half on the prior and half
        // learned would otherwise price the learned half as slower or faster than it is
        // relative to the rest, and shift load onto whichever side the prior flatters.
        let prior = self.fleet_rates.unwrap_or_else(|| prior(scoring));
        if let Some(counters) = metrics.counters {
            slot.calibration
                .observe(counters, metrics.kv_usage, now_ms, prior, calibration);
        }
        slot.learned = slot.calibration.calibrated(prior, calibration);
        let mut rates = slot.learned;
        if slot.learned.is_learned() {
            let learned = slot.learned.as_prior();
            // Within `SAME_HARDWARE` of the fleet's average an endpoint is scored at the
            // average: replicas of one kind differ by measurement noise, and per-endpoint
            // noise would steer load to whichever replica happens to read fastest. A real
            // difference (another GPU in the pool) keeps its own rates.
            if let Some(f) = self.fleet_rates {
                let ratio = learned.prefill_tokens_per_ms / f.prefill_tokens_per_ms.max(1e-9);
                if (1.0 / SAME_HARDWARE..=SAME_HARDWARE).contains(&ratio) {
                    rates.prefill_tokens_per_ms = f.prefill_tokens_per_ms;
                    rates.itl_ms_idle = f.itl_ms_idle;
                    rates.itl_ms_full = f.itl_ms_full;
                }
            }
            self.fleet_rates = Some(match self.fleet_rates {
                None => learned,
                Some(f) => Prior {
                    prefill_tokens_per_ms: 0.8 * f.prefill_tokens_per_ms
                        + 0.2 * learned.prefill_tokens_per_ms,
                    itl_ms_idle: 0.8 * f.itl_ms_idle + 0.2 * learned.itl_ms_idle,
                    itl_ms_full: 0.8 * f.itl_ms_full + 0.2 * learned.itl_ms_full,
                },
            });
        }
        slot.rates = if calibration.enabled {
            rates
        } else {
            Calibrated::from_prior(self::prior(scoring))
        };
        if let Some(cap) = metrics.capacity_tokens {
            let engine_blocks = cap as usize / self.config.precise.block_tokens.max(1);
            self.precise.gpu.set_capacity(id, engine_blocks.max(1));
        }
        if new_mismatch {
            // Built from events whose blocks are not the router's: nothing in it can match.
            slot.hashes.forget_awaited();
            self.precise.clear(id);
        }
        self.bound_index(id);
        if kv_changed {
            self.resize_reuse_window();
        }
        self.note_transition(id, was);
    }

    /// Notes `id`'s state change, once, when its state or reason is no longer `was`. A change
    /// back to exact carries the reason it left.
    fn note_transition(&mut self, id: EndpointId, was: (RoutingState, Option<StateReason>)) {
        let Some(slot) = self.slots[usize::from(id.0)].as_ref() else {
            return;
        };
        let now = slot.state_and_reason();
        let Some(reason) = now.1.or(was.1).filter(|_| now != was) else {
            return;
        };
        let (delivered_share, samples) = if reason == StateReason::HashMismatch {
            slot.hashes.decided()
        } else {
            (slot.check.delivered_share(), slot.check.samples())
        };
        let change = StateChange {
            from: was.0,
            to: now.0,
            reason,
            delivered_share,
            samples,
        };
        let address = slot.address.to_string();
        self.note_state_change(address, change);
    }

    /// Bounds the approximate index to `max` blocks over all endpoints (`None`: no bound but
    /// each endpoint's KV capacity). What a proxy's copy sets, so that a VM's memory is bounded
    /// by its configuration whatever the fleet reports: each endpoint then keeps at most
    /// `max / endpoints` blocks (and never more than its KV capacity), its least recently used
    /// evicted first.
    pub fn set_max_index_blocks(&mut self, max: Option<usize>) {
        self.max_index_blocks = max;
        self.bound_every_index_share();
    }

    /// Re-applies every endpoint's index bound (the fleet's size or the bound changed). With a
    /// configured bound the index's big table is sized for it at once, so it never grows in
    /// steps (each step holds the old table and the new one, and a wasm VM's memory keeps its
    /// high-water mark).
    fn bound_every_index_share(&mut self) {
        if let Some(max) = self.max_index_blocks {
            self.index.reserve_blocks(max);
        }
        for i in 0..self.slots.len() {
            if self.slots[i].is_some() {
                self.bound_index(EndpointId(i as u16));
            }
        }
    }

    /// `id`'s share of the approximate index: its KV capacity in blocks, when known, and its
    /// share of `max_index_blocks`, when set ([`Router::set_max_index_blocks`]).
    fn bound_index(&mut self, id: EndpointId) {
        let kv_blocks = self.slots[usize::from(id.0)]
            .as_ref()
            .and_then(|s| s.metrics)
            .and_then(|m| m.capacity_tokens)
            .map(|cap| (cap as f64 / self.tokens_per_block()) as usize);
        let share = self
            .max_index_blocks
            .map(|max| max / self.by_address.len().max(1));
        let bound = match (kv_blocks, share) {
            (Some(kv), Some(share)) => Some(kv.min(share)),
            (kv, share) => kv.or(share),
        };
        if let Some(blocks) = bound {
            self.index.set_capacity(id, blocks.max(1));
        }
    }

    /// Records a failed scrape: the endpoint stops being a candidate until it answers again.
    pub fn mark_unreachable(&mut self, address: &str) {
        let Some(&id) = self.by_address.get(address) else {
            return;
        };
        if let Some(slot) = self.slots[usize::from(id.0)].as_mut()
            && slot.health != Health::Unreachable
        {
            slot.health = Health::Unreachable;
            slot.version = self.table.next();
        }
    }

    /// Gives the index direct access (precise mode feeds it from KV events).
    pub fn index_mut(&mut self) -> &mut PrefixIndex {
        &mut self.index
    }

    /// Marks `address`'s KV-event stream live or down. Going down drops its precise state: it
    /// is scored from the approximate index until the stream is back and rebuilt.
    pub fn set_event_stream(&mut self, address: &str, live: bool) {
        let Some((id, slot)) = self.slot_mut(address) else {
            return;
        };
        let was = slot.events_live;
        let was_state = slot.state_and_reason();
        slot.events_live = live;
        slot.events_expected = true;
        if was != live {
            // A new session rebuilds the history from the replay socket, and a stream that is
            // down is degraded for that: a gap of the old session says nothing any more, nor
            // do blocks awaited in the index it had.
            slot.event_gap.clear();
            slot.event_groups.clear();
            slot.hashes.forget_awaited();
        }
        // (A load-only endpoint stays load-only whatever its stream does: no change.)
        self.note_transition(id, was_state);
        if was && !live {
            self.precise.clear(id);
        }
    }

    /// `address`'s KV-event stream lost batches its replay socket could not fill (the caller
    /// dropped its precise state, which may miss what they said): it is `degraded` (reason
    /// `kv_event_gap`) and scored from the approximate index until
    /// [`Router::note_event_batch_in_sequence`] has seen it run clean.
    pub fn note_event_gap(&mut self, address: &str) {
        self.check_slot(address, |slot, _| {
            slot.event_gap.lost();
            slot.hashes.forget_awaited();
        });
    }

    /// One of `address`'s KV-event batches arrived in sequence: after
    /// `router.self_check.clean_batches_after_gap` in a row, an outstanding gap ends and its
    /// event index is trusted again.
    pub fn note_event_batch_in_sequence(&mut self, address: &str) {
        self.check_slot(address, |slot, config| {
            slot.event_gap.in_sequence(config);
        });
    }

    /// One of `address`'s KV-event batches stored `usable` runs of blocks the index applies and
    /// `other_groups` runs of KV-cache groups it skips: after
    /// `router.self_check.unusable_group_batches` batches in a row with only the latter the
    /// endpoint is `degraded` (reason `event_groups`), and a usable store ends that.
    pub fn note_event_groups(&mut self, address: &str, usable: u32, other_groups: u32) {
        self.check_slot(address, |slot, config| {
            slot.event_groups.batch(usable, other_groups, config);
        });
    }

    /// Teaches endpoint `id` that a prompt of `prompt_bytes` canonical bytes was `tokens`
    /// tokens there, then compares its learned ratio with the rest of its pool's
    /// ([`TokenRatioCheck`]; every 8th outcome, as the ratios move slowly).
    fn judge_bytes_per_token(
        &mut self,
        id: EndpointId,
        pool: PoolKey,
        prompt_bytes: u64,
        tokens: u32,
    ) {
        let Some(slot) = self.slots[usize::from(id.0)].as_mut() else {
            return;
        };
        slot.bytes_per_token.observe(prompt_bytes, tokens);
        let check = &self.config.self_check;
        if !check.enabled
            || slot.bytes_per_token.ratio(check).is_none()
            || slot.served.outcomes % 8 != 0
        {
            return;
        }
        let eligible = self.fleet.eligible(
            self.reuse_pools.name(pool),
            self.slots.len(),
            crate::pools::UnknownModelPolicy::PassThrough,
        );
        let mut others: Vec<f64> = self
            .slots
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != usize::from(id.0) && eligible.allows(i))
            .filter_map(|(_, s)| s.as_ref()?.bytes_per_token.ratio(check))
            .collect();
        let Some(slot) = self.slots[usize::from(id.0)].as_mut() else {
            return;
        };
        let was = slot.state_and_reason();
        slot.bytes_per_token
            .judge(&mut others, &self.config.self_check);
        self.note_transition(id, was);
    }

    /// Runs `change` on `address`'s slot with the self-check settings, then notes the
    /// routing-state change it made, if any: how the event-stream checks move a state.
    fn check_slot(&mut self, address: &str, change: impl FnOnce(&mut Slot, &SelfCheckConfig)) {
        let Some(&id) = self.by_address.get(address) else {
            return;
        };
        let Some(slot) = self.slots[usize::from(id.0)].as_mut() else {
            return;
        };
        let was = slot.state_and_reason();
        change(slot, &self.config.self_check);
        self.note_transition(id, was);
    }

    /// Applies one KV event from `address` (serving `model`). On error the endpoint's precise
    /// state is dropped rather than kept possibly corrupt, and the error is returned.
    pub fn apply_kv_event(
        &mut self,
        address: &str,
        model: &str,
        event: &KvEvent,
        now_ms: u64,
    ) -> Result<(), ApplyError> {
        self.apply_event(address, model, event, now_ms, false)
    }

    /// Like [`Router::apply_kv_event`], for a stream whose history is known to be incomplete
    /// (subscribed after the engine started, or after a gap that could not be replayed). There
    /// a store whose parent was never seen is expected, not a sign of corruption: it is skipped
    /// (the error is returned, nothing changed) and the endpoint keeps its state. Any other
    /// error still drops the endpoint's precise state.
    pub fn apply_kv_event_partial(
        &mut self,
        address: &str,
        model: &str,
        event: &KvEvent,
        now_ms: u64,
    ) -> Result<(), ApplyError> {
        self.apply_event(address, model, event, now_ms, true)
    }

    fn apply_event(
        &mut self,
        address: &str,
        model: &str,
        event: &KvEvent,
        now_ms: u64,
        history_incomplete: bool,
    ) -> Result<(), ApplyError> {
        let Some(id) = self.endpoint_id(address) else {
            return Ok(());
        };
        let p = &mut self.precise;
        let evicted = p.tracker.removed_from_gpu(id, event);
        match p
            .tracker
            .apply(id, model, event, &mut p.gpu, &mut p.offload, now_ms)
        {
            Ok(()) => {
                if matches!(event, KvEvent::AllBlocksCleared) {
                    p.evicting.remove(id);
                } else if !evicted.is_empty() {
                    p.evicting.insert(id);
                }
                // A routed request's speculative blocks no longer count once the engine evicts them.
                for h in evicted {
                    p.speculative.remove(id, h);
                }
                self.stats.kv_events += 1;
                Ok(())
            }
            Err(e @ ApplyError::UnknownParent(_)) if history_incomplete => Err(e),
            Err(e) => {
                self.stats.kv_event_errors += 1;
                p.clear(id);
                Err(e)
            }
        }
    }

    /// Forgets `address`'s precise state (cache reset, publisher restart, unreplayable gap).
    pub fn clear_precise(&mut self, address: &str) {
        if let Some((id, slot)) = self.slot_mut(address) {
            // The blocks awaited there are gone with the index, whoever hashed them.
            slot.hashes.forget_awaited();
            self.precise.clear(id);
        }
    }

    /// Looks up, in each endpoint's event-fed index, the first blocks of the requests it
    /// served whose time has come ([`EventHashCheck`]); a change of state is noted. Blocks of
    /// an endpoint whose event index is not whole now say nothing and are dropped.
    fn check_event_hashes(&mut self, now_ms: u64) {
        let mut changed = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(slot) = slot.as_mut() else {
                continue;
            };
            let id = EndpointId(i as u16);
            let was = slot.state_and_reason();
            let mut flipped = false;
            while let Some(hash) = slot.hashes.next_due(now_ms) {
                if !slot.events_whole() {
                    continue;
                }
                let held = self.precise.gpu.holds(id, hash) || self.precise.offload.holds(id, hash);
                flipped |= slot.hashes.observe(held, &self.config.self_check);
            }
            if flipped {
                changed.push((id, was));
            }
        }
        for (id, was) in changed {
            self.note_transition(id, was);
        }
    }

    /// Records which models `address` serves (its `/v1/models`, plus configured names), so
    /// requests for other models no longer go there.
    pub fn set_served_models(&mut self, address: &str, models: Vec<ServedModel>) {
        if let Some(id) = self.endpoint_id(address) {
            self.fleet.catalog.set(id, models);
        }
    }

    /// The models `address` is known to serve (`None`: not known yet).
    pub fn served_models(&self, address: &str) -> Option<&[ServedModel]> {
        self.fleet.catalog.models(self.endpoint_id(address)?)
    }

    /// Records `address`'s LoRA adapters (its `vllm:lora_requests_info`).
    pub fn set_lora_state(&mut self, address: &str, state: LoraState) {
        if let Some(id) = self.endpoint_id(address) {
            self.fleet.loras.set(id, state);
        }
    }

    /// `address`'s LoRA adapters as last scraped.
    pub fn lora_state(&self, address: &str) -> Option<&LoraState> {
        self.fleet.loras.get(self.endpoint_id(address)?)
    }

    /// Stored response ids remembered now (the `router.responses` table).
    pub fn stored_responses(&self) -> usize {
        self.fleet.responses.len()
    }

    /// Whether this router knows which endpoint stored response `id` (a copy that does not
    /// asks the control plane, which may have heard first).
    pub fn knows_stored_response(&self, id: &str, now_ms: u64) -> bool {
        let ttl = self.config.responses.ttl_ms;
        self.fleet.responses.lookup(id, now_ms, ttl).is_some()
    }

    /// Session-affinity counters since start, and the sessions remembered now.
    pub fn session_stats(&self) -> (SessionStats, usize) {
        (self.fleet.sessions.stats(), self.fleet.sessions.len())
    }

    /// Model-pool counters since start.
    pub fn pool_stats(&self) -> PoolStats {
        self.fleet.stats
    }

    /// Blocks `address`'s KV events say it holds in CPU or storage tiers (precise mode).
    pub fn offload_blocks(&self, address: &str) -> usize {
        self.endpoint_id(address)
            .map_or(0, |id| self.precise.offload.len_for(id))
    }

    /// Drops expired index entries and in-flight entries whose report never came.
    pub fn expire(&mut self, now_ms: u64) {
        self.last_expire_ms = now_ms;
        self.index.expire(now_ms);
        self.fleet
            .sessions
            .expire(now_ms, self.config.sessions.ttl_ms);
        self.fleet
            .responses
            .expire(now_ms, self.config.responses.ttl_ms);
        self.precise.speculative.expire(now_ms);
        self.check_event_hashes(now_ms);
        while self
            .withdrawn
            .front()
            .is_some_and(|&(at, _)| at.saturating_add(WITHDRAWN_TTL_MS) <= now_ms)
        {
            self.withdrawn.pop_front();
        }
        let ttl = self.config.inflight_ttl_ms;
        while let Some(&(started_ms, decision_id)) = self.inflight_order.front() {
            if started_ms.saturating_add(ttl) > now_ms {
                break;
            }
            self.inflight_order.pop_front();
            let Some(entry) = self.inflight.remove(&decision_id) else {
                continue;
            };
            if let Some(call) = entry.call_id {
                self.calls.remove(&call);
            }
            self.stats.expired_inflight += 1;
            if let Some(slot) = self.slots[usize::from(entry.endpoint.0)].as_mut() {
                slot.release(&entry);
            }
        }
    }

    /// Remembers a new in-flight entry for expiry, dropping answered ones from the queue when
    /// they outnumber the live ones (memory stays proportional to what is really in flight).
    fn track_inflight(&mut self, decision_id: u64, now_ms: u64) {
        self.inflight_order.push_back((now_ms, decision_id));
        if self.inflight_order.len() > 2 * self.inflight.len() + 1024 {
            let live = &self.inflight;
            self.inflight_order.retain(|(_, id)| live.contains_key(id));
        }
    }

    /// Chooses endpoints for `request`. Never fails: with no usable endpoint the list is empty
    /// and the filter lets Envoy's fallback policy pick.
    ///
    /// A decision runs as named stages, each with a typed result, so each question is answered
    /// in one place: [`Router::shape_request`] (what the request needs wherever it goes),
    /// [`Router::select_pool`] (who may serve it, and its session's replica),
    /// [`Router::score_candidates`] (each candidate's cached prefix, cost terms and steering),
    /// [`Router::rank`] (guard, order, tie-break and the reason), [`Router::account_choice`]
    /// (the chosen endpoint's load, indexes, session and prefill endpoint), then
    /// [`Router::respond`].
    pub fn route(&mut self, request: &RouteRequest, now_ms: u64, seed: u64) -> Decision {
        // With no deferral threshold every request is decided; the default is never built.
        self.decide(request, now_ms, seed, None)
            .unwrap_or_else(|| Decision {
                response: RouteResponse::default(),
                candidates: Vec::new(),
            })
    }

    /// [`Router::route`] for a copy of the state that other routers decide beside
    /// ([`crate::sync::LocalRouter`]): `None`, with nothing accounted, when the request is a
    /// placement by load among several candidates (no candidate holds more of its prompt than
    /// the chosen one) whose own prefill is predicted to take at least `defer_above_ms`. Such
    /// a request is where the other routers' unseen decisions matter most (each copy sees the
    /// same stale loads and would send its long misses to the same replica), and where a route
    /// call's fraction of a millisecond is least: the caller asks the control plane, which sees
    /// every such miss.
    pub fn route_or_defer(
        &mut self,
        request: &RouteRequest,
        now_ms: u64,
        seed: u64,
        defer_above_ms: f64,
    ) -> Option<Decision> {
        self.decide(request, now_ms, seed, Some(defer_above_ms))
    }

    fn decide(
        &mut self,
        request: &RouteRequest,
        now_ms: u64,
        seed: u64,
        defer_above_ms: Option<f64>,
    ) -> Option<Decision> {
        // Expiry has per-endpoint work, and nothing new can expire within one millisecond.
        if now_ms != self.last_expire_ms {
            self.expire(now_ms);
        }
        let decision_id = self.next_decision_id;
        self.next_decision_id += 1;
        self.stats.decisions += 1;
        // The proxy gave up on this call while it was queued: it went elsewhere already.
        if let Some(call) = request.call_id
            && let Some(at) = self.withdrawn.iter().position(|&(_, c)| c == call)
        {
            self.withdrawn.remove(at);
            return Some(Decision {
                response: RouteResponse {
                    decision_id,
                    reason: RouteReason::Withdrawn,
                    ..Default::default()
                },
                candidates: Vec::new(),
            });
        }

        let shape = self.shape_request(request);
        let pool = match self.select_pool(request, now_ms) {
            Ok(pool) => pool,
            Err(reject) => return Some(rejected(decision_id, reject)),
        };
        let candidates = self.score_candidates(request, &shape, &pool, now_ms);
        let stored = self.stored_response_endpoint(request, now_ms);
        let Some(mut ranking) = self.rank(candidates, decision_id, seed) else {
            self.stats.no_endpoint += 1;
            return Some(Decision {
                response: RouteResponse {
                    decision_id,
                    reason: RouteReason::NoEndpoint,
                    ..Default::default()
                },
                candidates: Vec::new(),
            });
        };
        let pinned = match stored {
            Some(endpoint) => self.pin(&mut ranking, endpoint),
            None => false,
        };
        if let Some(threshold) = defer_above_ms
            && !pinned
            && ranking.candidates.len() > 1
            && ranking.reason != RouteReason::Prefix
            && ranking.chosen_score().prefill_ms >= threshold
        {
            self.stats.deferred += 1;
            self.stats.decisions -= 1;
            return None;
        }
        let prefill = self.account_choice(
            request,
            &shape,
            &pool.session,
            &ranking,
            decision_id,
            now_ms,
        );
        let mut decision = self.respond(decision_id, ranking, prefill);
        if pinned {
            // Another replica cannot continue the response: no fallbacks.
            decision.response.endpoints.truncate(1);
        }
        Some(decision)
    }

    /// The replica that stored the response `request` names: remembered from an outcome
    /// report, or (not reported yet) the one the asking proxy saw serve it. Counts a miss.
    fn stored_response_endpoint(
        &mut self,
        request: &RouteRequest,
        now_ms: u64,
    ) -> Option<EndpointId> {
        let id = request.previous_response_id.as_deref()?;
        let ttl = self.config.responses.ttl_ms;
        let found = self.fleet.responses.lookup(id, now_ms, ttl).or_else(|| {
            request
                .previous_response_endpoint
                .as_deref()
                .and_then(|a| self.endpoint_id(a))
        });
        if found.is_none() {
            self.stats.stored_response_unknown += 1;
        }
        found
    }

    /// Makes `endpoint` the ranking's choice (reason `stored_response`) when it is a usable
    /// candidate; otherwise leaves the ranking alone and counts the response unavailable.
    fn pin(&mut self, ranking: &mut Ranking, endpoint: EndpointId) -> bool {
        let keys = &mut self.scratch.keys;
        let Some(at) = keys
            .iter()
            .position(|&k| ranking.candidates[key_position(k)].0 == endpoint)
        else {
            self.stats.stored_response_unavailable += 1;
            return false;
        };
        let key = keys.remove(at);
        keys.insert(0, key);
        ranking.chosen = endpoint;
        ranking.chosen_at = key_position(key);
        ranking.reason = RouteReason::StoredResponse;
        self.stats.stored_response_pinned += 1;
        true
    }

    /// How many endpoints this router knows (usable or not).
    pub fn endpoint_count(&self) -> usize {
        self.by_address.len()
    }

    /// Accounts for a decision another router took: a proxy that decided locally, or a peer
    /// control-plane replica. The chosen endpoint gets the in-flight entry, backlog and KV, the
    /// prompt's blocks and the session, exactly as if this router had chosen it, so every copy
    /// of the routing state converges on the same fleet. Nothing is ranked and no prefill
    /// endpoint is picked (the deciding router did both). `decision_id` is the deciding
    /// router's id, which the outcome report will name. `age_ms` is how long ago it was taken:
    /// the prefill the endpoint has done since leaves the backlog, and a decision older than
    /// `inflight_ttl_ms` is ignored (its entry would have expired). The request went to the
    /// endpoint, so it is recorded whatever this router believes of that endpoint's health and
    /// models. Returns false when the endpoint is unknown here, the decision is too old, or it
    /// was recorded already (the decision is then ignored).
    pub fn record_decision(
        &mut self,
        request: &RouteRequest,
        endpoint: &str,
        decision_id: u64,
        now_ms: u64,
        age_ms: u64,
    ) -> bool {
        let Some(chosen) = self.endpoint_id(endpoint) else {
            return false;
        };
        if age_ms >= self.config.inflight_ttl_ms {
            return false;
        }
        // A report sent again (its first sync's answer was lost) is the same decision: counting
        // it twice would charge its endpoint twice and release it once.
        if self.inflight.contains_key(&decision_id) {
            return false;
        }
        if now_ms != self.last_expire_ms {
            self.expire(now_ms);
        }
        let shape = self.shape_request(request);
        let mut pool = self
            .select_pool(request, now_ms)
            .unwrap_or_else(|_| CandidatePool {
                eligible: Eligibility::Only(Vec::new()),
                adapter: self.fleet.is_adapter(&request.model),
                session: SessionAffinity::default(),
                recorded: None,
            });
        pool.recorded = Some(chosen);
        let candidates = self.score_candidates(request, &shape, &pool, now_ms);
        let Some(chosen_at) = candidates.iter().position(|(id, _)| *id == chosen) else {
            return false;
        };
        let ranking = Ranking {
            chosen,
            chosen_at,
            reason: RouteReason::Load,
            candidates,
            prefill_only: Vec::new(),
        };
        self.stats.recorded_decisions += 1;
        let uncached = f64::from(ranking.chosen_score().uncached_tokens);
        self.account_choice(
            request,
            &shape,
            &pool.session,
            &ranking,
            decision_id,
            now_ms,
        );
        if age_ms > 0
            && let Some(slot) = self.slots[usize::from(chosen.0)].as_mut()
        {
            let done = (age_ms as f64 * slot.rates.prefill_tokens_per_ms).min(uncached);
            slot.backlog_tokens = (slot.backlog_tokens - done).max(0.0);
            // A streamed decision's first token, if it came, is in the log after it.
            if !request.stream {
                slot.buffered_tokens = (slot.buffered_tokens - done).max(0.0);
            }
        }
        true
    }

    /// Stage 1: what serving `request` involves on any endpoint: its prompt in tokens, the
    /// blocks a hit can cover, and the blocks its KV will hold once admitted.
    fn shape_request<'r>(&self, request: &'r RouteRequest) -> RequestShape<'r> {
        let tokens_per_block = self.tokens_per_block();
        // Precise mode: the event-fed GPU index (plus speculative entries of recent decisions)
        // and the offload tiers, in engine blocks.
        let precise = !request.token_block_hashes.is_empty();
        // A precise request's tokens were counted by a tokenizer. An approximate one's are
        // estimated from its canonical bytes at the ratio the index counts blocks in (the
        // filter's own estimate assumes 4 bytes a token).
        //
        // Every number is bounded by what the request could be, so a forged or confused call
        // prices nothing it did not carry: canonical bytes by the whole blocks hashed plus one
        // partial block (a load route hashes none and sends no bytes), tokens by the engine
        // blocks hashed plus one, and both by `max_request_tokens`.
        let block_tokens = self.config.precise.block_tokens.max(1);
        let prompt_bytes = bounded_prompt_bytes(request, self.config.block_bytes);
        let max_tokens = self.config.max_request_tokens.max(1);
        let tokens = match prompt_bytes {
            bytes if !precise && bytes > 0 => {
                (bytes as f64 / self.token_ratio.bytes_per_token()).ceil() as u32
            }
            _ if precise => request.prompt_tokens.min(block_count_tokens(
                request.token_block_hashes.len(),
                block_tokens,
            )),
            _ => request.prompt_tokens,
        }
        .min(max_tokens);
        let kv_blocks = if precise {
            KvBlocks {
                hashes: &request.token_block_hashes,
                block_tokens: block_tokens as f64,
            }
        } else {
            KvBlocks {
                hashes: &request.block_hashes,
                block_tokens: tokens_per_block,
            }
        };
        // Marked blocks are approximate (canonical-byte) blocks in both modes; a forged count
        // marks at most the prompt.
        let marked_tokens = (f64::from(request.marked_blocks) * tokens_per_block)
            .min(f64::from(tokens))
            .max(0.0);
        RequestShape {
            precise,
            tokens,
            prompt_bytes,
            prompt_tokens: f64::from(tokens.max(1)),
            marked_tokens,
            output_tokens: request
                .max_output_tokens
                .unwrap_or(self.config.scoring.default_output_tokens)
                .min(max_tokens),
            tokens_per_block,
            block_tokens,
            // vLLM recomputes at least the last prompt token, so only blocks of the first n-1 count.
            hittable_blocks: (tokens.saturating_sub(1) as usize) / block_tokens,
            token_blocks: &request.token_block_hashes,
            kv_blocks,
        }
    }

    /// Stage 2: which endpoints may serve `request` (model pools and LoRA adapters, modules
    /// `pools` and `lora`) and the replica its session remembers (`affinity`). A model nobody
    /// serves is refused here, under `models.unknown_model: reject`.
    fn select_pool<'r>(
        &mut self,
        request: &'r RouteRequest,
        now_ms: u64,
    ) -> Result<CandidatePool<'r>, Reject> {
        let eligible = self.fleet.admit(
            &request.model,
            self.slots.len(),
            self.config.models.unknown_model,
        )?;
        let sessions = &self.config.sessions;
        let key = request
            .session
            .as_deref()
            .filter(|_| sessions.bonus_ms > 0.0);
        let remembered = key.and_then(|k| self.fleet.sessions.lookup(k, now_ms, sessions.ttl_ms));
        Ok(CandidatePool {
            eligible,
            adapter: self.fleet.is_adapter(&request.model),
            session: SessionAffinity { key, remembered },
            recorded: None,
        })
    }

    /// Stage 3: every usable endpoint of `pool` as a scored candidate, in slot order: its
    /// cached prefix ([`cached_prefix`]), the analytic cost terms ([`cost_terms`]) and what
    /// steers them ([`steering`]: session bonus, LoRA cost, the learned latency correction).
    /// Drains each candidate's backlog to `now_ms` and records its latency features.
    fn score_candidates(
        &mut self,
        request: &RouteRequest,
        shape: &RequestShape<'_>,
        pool: &CandidatePool<'_>,
        now_ms: u64,
    ) -> Vec<(EndpointId, CandidateScore)> {
        let n = self.slots.len();
        let measured = self
            .first_token_at_ms
            .is_some_and(|at| now_ms.saturating_sub(at) <= FIRST_TOKEN_WINDOW_MS);
        let Router {
            config,
            slots,
            index,
            precise,
            fleet,
            scratch,
            ..
        } = self;
        let depths = look_up_prefixes(&mut scratch.depths, index, precise, request, n);
        // Written for every candidate before the chosen one's is read: no reset needed.
        let latency_features = &mut scratch.features;
        latency_features.resize(n, LatencyFeatures::default());
        let believed = &mut scratch.believed;
        believed.resize(n, 0);
        let s = &config.scoring;
        let stale_after = config.stale_after_ms;
        let mut candidates: Vec<(EndpointId, CandidateScore)> = Vec::with_capacity(n);
        for (i, slot) in slots.iter_mut().enumerate() {
            let Some(slot) = slot else { continue };
            let recorded = pool.recorded.is_some_and(|id| usize::from(id.0) == i);
            if !recorded && (slot.health != Health::Ready || !pool.eligible.allows(i)) {
                continue;
            }
            drain_backlog(slot, now_ms, slot.rates.prefill_tokens_per_ms);
            if measured {
                slot.backlog_tokens = slot.unconfirmed_tokens + slot.buffered_tokens;
            }
            // A load-only endpoint's prefix is not credited, unless a probe runs.
            let credited = !config.self_check.enabled || slot.check.credits_prefix(now_ms);
            let here = EndpointId(i as u16);
            let fresh = slot
                .metrics
                .filter(|_| now_ms.saturating_sub(slot.scraped_at_ms) <= stale_after);
            let candidate = Candidate {
                id: here,
                slot,
                fresh,
                now_ms,
            };
            let mut cached = cached_prefix(candidate, &depths, shape, precise, &config.precise);
            believed[i] = cached.tokens as u32;
            if !credited {
                // The endpoint does not deliver what the index believes: no prefix credit.
                cached.blocks = 0;
                cached.tokens = 0.0;
            }
            let terms = cost_terms(candidate, cached.tokens, shape, s);
            let steer = steering(
                candidate,
                &terms,
                shape,
                pool,
                &request.model,
                fleet,
                config,
            );
            latency_features[i] = steer.features;
            candidates.push((
                here,
                CandidateScore {
                    endpoint: slot.address.clone(),
                    cached_blocks: cached.blocks as u32,
                    cached_tokens: cached.tokens as u32,
                    precise: cached.precise,
                    uncached_tokens: terms.uncached_tokens as u32,
                    queue_ms: terms.queue_ms,
                    prefill_ms: terms.prefill_ms,
                    decode_ms: terms.decode_ms,
                    kv_ms: terms.kv_ms,
                    total_ms: terms.queue_ms
                        + s.prefill_weight * terms.prefill_ms
                        + terms.decode_ms
                        + terms.kv_ms
                        + steer.latency_ms
                        + steer.session_ms
                        + steer.cache_control_ms
                        + steer.lora_ms,
                    inflight: slot.inflight,
                    guarded: false,
                    predicted_ttft_ms: steer.predicted.ttft_ms,
                    predicted_tpot_ms: steer.predicted.tpot_ms,
                    latency_samples: slot.latency.samples(),
                    latency_ms: steer.latency_ms,
                    role: slot.role,
                    session_ms: steer.session_ms,
                    cache_control_ms: steer.cache_control_ms,
                    lora_ms: steer.lora_ms,
                },
            ));
        }
        if config.latency.enabled {
            cold_latency_from_warm(&mut candidates, config.latency.min_samples);
        }
        candidates
    }

    /// Stage 4: sets prefill-only candidates aside (never decode targets; they may prefill for
    /// the chosen one), applies the guard against piling onto one hot replica, orders the rest
    /// (unguarded first, then by cost; near-ties shuffled by the seed) into `scratch.keys`, and
    /// names the choice and its reason. `None`: no decode candidate at all.
    fn rank(
        &mut self,
        mut candidates: Vec<(EndpointId, CandidateScore)>,
        decision_id: u64,
        seed: u64,
    ) -> Option<Ranking> {
        let s = &self.config.scoring;
        let prefill_only = crate::disagg::split_prefill_only(&mut candidates, s.prefill_weight);
        if candidates.is_empty() {
            return None;
        }
        apply_guard(&mut candidates, s);
        // The order is worked out on small keys, and the candidates (large) are moved into it
        // once, at the end (`respond`).
        let RouteScratch {
            keys, short_keys, ..
        } = &mut self.scratch;
        cost_order(&candidates, keys, short_keys);
        let best = &candidates[key_position(keys[0])].1;
        let (best_guarded, best_cost) = (best.guarded, best.total_ms);
        let ties = keys
            .iter()
            .map(|&k| &candidates[key_position(k)].1)
            .take_while(|c| c.guarded == best_guarded && c.total_ms - best_cost <= s.tie_ms)
            .count();
        if ties > 1 {
            let pick = (splitmix64(seed ^ decision_id) % ties as u64) as usize;
            keys.swap(0, pick);
        }
        let any_guarded = candidates.iter().any(|(_, c)| c.guarded);
        let cheapest_guarded = keys
            .iter()
            .map(|&k| &candidates[key_position(k)].1)
            .min_by(|a, b| a.total_ms.total_cmp(&b.total_ms))
            .is_some_and(|c| c.guarded);
        if cheapest_guarded {
            self.stats.guarded += 1;
        }
        let chosen_at = key_position(keys[0]);
        let (chosen, chosen_score) = &candidates[chosen_at];
        let max_cached = candidates
            .iter()
            .map(|(_, c)| c.cached_blocks)
            .max()
            .unwrap_or(0);
        let reason = if cheapest_guarded && any_guarded {
            RouteReason::Guard
        } else if chosen_score.cached_blocks > 0 && chosen_score.cached_blocks == max_cached {
            RouteReason::Prefix
        } else {
            RouteReason::Load
        };
        Some(Ranking {
            chosen: *chosen,
            chosen_at,
            reason,
            candidates,
            prefill_only,
        })
    }

    /// Stage 5: the chosen endpoint now has this prefill queued and holds the prompt's blocks
    /// (backlog, in-flight KV, approximate and speculative indexes, the in-flight entry its
    /// outcome releases); its session remembers it; a long uncached prompt may get a prefill
    /// endpoint of its own ([`Router::pick_prefiller`]).
    fn account_choice(
        &mut self,
        request: &RouteRequest,
        shape: &RequestShape<'_>,
        session: &SessionAffinity<'_>,
        ranking: &Ranking,
        decision_id: u64,
        now_ms: u64,
    ) -> PrefillSite {
        let chosen = ranking.chosen;
        let chosen_score = ranking.chosen_score();
        if let Some(key) = session.key {
            self.fleet.sessions.count(session.remembered, chosen);
            let max_sessions = self.config.sessions.max_sessions;
            self.fleet
                .sessions
                .remember(key, chosen, now_ms, max_sessions);
        }
        if chosen_score.precise {
            self.stats.precise_decisions += 1;
        }
        let KvBlocks {
            hashes: all_blocks,
            block_tokens: block_kv_tokens,
        } = shape.kv_blocks;
        let step = kv_sample_blocks(block_kv_tokens);
        let kv_blocks: Box<[u64]> = kv_samples(all_blocks, step).copied().collect();
        let kv_block_tokens = block_kv_tokens * step as f64;
        let request_tokens = shape.tokens;
        let unhashed =
            (f64::from(request_tokens) - kv_blocks.len() as f64 * kv_block_tokens).max(0.0) as u32;
        let predicted_cached_tokens = request_tokens.saturating_sub(chosen_score.uncached_tokens);
        let believed_cached_tokens = self.scratch.believed[usize::from(chosen.0)];
        let aim = self.aim(
            &request.block_hashes,
            shape,
            ranking,
            predicted_cached_tokens,
        );
        let state = self.slots[usize::from(chosen.0)]
            .as_ref()
            .map_or(RoutingState::Exact, Slot::routing_state);
        let entry = InFlight {
            endpoint: chosen,
            predicted_cached_tokens,
            believed_cached_tokens,
            prompt_bytes: shape.prompt_bytes,
            kv_blocks,
            kv_block_tokens,
            kv_private_tokens: shape.output_tokens.saturating_add(unhashed),
            kv_output_tokens: shape.output_tokens,
            latency_features: self.scratch.features[usize::from(chosen.0)],
            remote_prefill: false,
            prefill_tokens: chosen_score.uncached_tokens,
            started_ms: now_ms,
            awaiting_first_token: request.stream,
            call_id: request.call_id,
            aim,
            pool: self
                .reuse_pools
                .key(&request.model, self.config.reuse.max_pools),
            precise: chosen_score.precise,
            state,
            first_token_block: request.token_block_hashes.first().copied(),
        };
        if let Some(slot) = self.slots[usize::from(chosen.0)].as_mut() {
            let prefill = f64::from(chosen_score.uncached_tokens);
            slot.backlog_tokens += prefill;
            let window = self.config.scoring.prefill_contention_window_ms;
            slot.prefill_inflow.add(prefill, now_ms, window);
            if request.stream {
                slot.unconfirmed_tokens += prefill;
            } else {
                slot.buffered_tokens += prefill;
            }
            slot.inflight += 1;
            slot.inflight_kv.add(&entry);
        }
        self.index.insert(chosen, &request.block_hashes, now_ms);
        if shape.precise {
            self.precise
                .speculative
                .insert(chosen, &request.token_block_hashes, now_ms);
            // The engine's hit refreshes these blocks in its LRU order; no event says so.
            self.precise
                .gpu
                .touch(chosen, &request.token_block_hashes, now_ms);
        }
        if let Some(call) = request.call_id {
            self.calls.insert(call, decision_id);
        }
        self.inflight.insert(decision_id, entry);
        self.track_inflight(decision_id, now_ms);
        let prefiller =
            self.pick_prefiller(request, chosen, chosen_score, &ranking.prefill_only, now_ms);
        match prefiller {
            Some(endpoint) => {
                if let Some(entry) = self.inflight.get_mut(&decision_id) {
                    entry.remote_prefill = true;
                    // The prefill endpoint does the work (`pick_prefiller` moved it there).
                    entry.awaiting_first_token = false;
                }
                PrefillSite::Remote(endpoint)
            }
            None => PrefillSite::Chosen,
        }
    }

    /// The fleet numbers' view of a decision ([`crate::reuse`]): the reuse the recent window
    /// offered for the prompt (remembering its blocks), what the chosen endpoint was credited
    /// with and believed to hold, and the most any candidate was.
    fn aim(
        &mut self,
        request_blocks: &[u64],
        shape: &RequestShape<'_>,
        ranking: &Ranking,
        aimed: u32,
    ) -> Aim {
        // The text blocks when the request has them (precise requests too), so the window
        // counts in one unit, the one it is sized in; else the token blocks.
        let (hashes, block_tokens) = if request_blocks.is_empty() {
            (shape.kv_blocks.hashes, shape.kv_blocks.block_tokens)
        } else {
            (request_blocks, shape.tokens_per_block)
        };
        let hittable_tokens = shape.tokens.saturating_sub(1);
        let hittable = (f64::from(hittable_tokens) / block_tokens.max(1.0)) as usize;
        let matched = self.reuse_window.observe(hashes, hittable);
        let available = ((matched as f64 * block_tokens) as u32).min(hittable_tokens);
        let believed = &self.scratch.believed;
        let believed_by = |id: EndpointId| believed.get(usize::from(id.0)).copied().unwrap_or(0);
        let chosen = ranking.chosen;
        let load_only = self.slots[usize::from(chosen.0)]
            .as_ref()
            .is_some_and(|s| s.check.load_only());
        Aim {
            available,
            aimed,
            believed: believed_by(chosen),
            best_credited: ranking
                .candidates
                .iter()
                .map(|(_, c)| c.cached_tokens)
                .max()
                .unwrap_or(0),
            best_believed: ranking
                .candidates
                .iter()
                .map(|(id, _)| believed_by(*id))
                .max()
                .unwrap_or(0),
            load_only,
            prompt_tokens: shape.tokens,
        }
    }

    /// Stage 6: the filter's answer (the chosen endpoint, then up to `fallbacks` more in cost
    /// order) and the explanation, every candidate's terms best first.
    fn respond(&self, decision_id: u64, ranking: Ranking, prefill: PrefillSite) -> Decision {
        let chosen = ranking.chosen_score();
        let (cached_blocks, cached_tokens) = (chosen.cached_blocks, chosen.cached_tokens);
        let keys = &self.scratch.keys;
        let endpoints = keys
            .iter()
            .take(1 + self.config.fallbacks)
            .map(|&k| ranking.candidates[key_position(k)].1.endpoint.to_string())
            .collect();
        Decision {
            response: RouteResponse {
                decision_id,
                endpoints,
                cached_blocks,
                cached_tokens,
                reason: ranking.reason,
                prefiller: match prefill {
                    PrefillSite::Chosen => None,
                    PrefillSite::Remote(endpoint) => Some(endpoint),
                },
                ..RouteResponse::default()
            },
            candidates: in_cost_order(ranking.candidates, keys, ranking.prefill_only),
        }
    }

    /// Sets `address`'s role in a disaggregated fleet (endpoints start as `both`).
    pub fn set_role(&mut self, address: &str, role: EndpointRole) {
        if let Some((_, slot)) = self.slot_mut(address) {
            slot.role = role;
        }
    }

    /// Disaggregation: when the prompt's uncached part on the chosen decode endpoint exceeds
    /// `pd.threshold_tokens`, the cheapest prefill endpoint (`prefill_only` is sorted) runs the
    /// prefill. Its queue gets that prefill and its index the prompt's blocks; the decode
    /// endpoint keeps the blocks (they arrive by KV transfer) but not the prefill work.
    fn pick_prefiller(
        &mut self,
        request: &RouteRequest,
        decode: EndpointId,
        decode_score: &CandidateScore,
        prefill_only: &[(EndpointId, CandidateScore)],
        now_ms: u64,
    ) -> Option<String> {
        if !self
            .config
            .pd
            .wants_remote_prefill(decode_score.uncached_tokens)
        {
            return None;
        }
        let (id, score) = prefill_only.first()?;
        if let Some(slot) = self.slots[usize::from(decode.0)].as_mut() {
            let moved = f64::from(decode_score.uncached_tokens);
            slot.backlog_tokens = (slot.backlog_tokens - moved).max(0.0);
            let measured = if request.stream {
                &mut slot.unconfirmed_tokens
            } else {
                &mut slot.buffered_tokens
            };
            *measured = (*measured - moved).max(0.0);
        }
        let slot = self.slots[usize::from(id.0)].as_mut()?;
        slot.backlog_tokens += f64::from(score.uncached_tokens);
        // No first token on the prefill endpoint tells when this is done: it is estimated.
        slot.buffered_tokens += f64::from(score.uncached_tokens);
        slot.prefill_picks += 1;
        self.index.insert(*id, &request.block_hashes, now_ms);
        if !request.token_block_hashes.is_empty() {
            self.precise
                .speculative
                .insert(*id, &request.token_block_hashes, now_ms);
        }
        self.stats.disaggregated += 1;
        Some(score.endpoint.to_string())
    }

    /// Takes one request's outcome: releases its in-flight load and records prediction accuracy.
    pub fn feedback(&mut self, outcome: &Outcome, now_ms: u64) {
        self.stats.outcomes += 1;
        if let Some(response_id) = outcome.response_id.as_deref()
            && (200..300).contains(&outcome.status)
            && let Some(served_by) = self.endpoint_id(&outcome.endpoint)
        {
            let max = self.config.responses.max_entries;
            self.fleet
                .responses
                .remember(response_id, served_by, now_ms, max);
        }
        let Some(entry) = self.inflight.remove(&outcome.decision_id) else {
            return;
        };
        if let Some(call) = entry.call_id {
            self.calls.remove(&call);
        }
        // No report can take longer than the time since the decision: a forged or confused
        // one that claims more is read as that long.
        let elapsed = now_ms.saturating_sub(entry.started_ms);
        let clamped;
        let outcome = if outcome.total_ms > elapsed || outcome.ttfb_ms.is_some_and(|t| t > elapsed)
        {
            self.stats.clamped_outcomes += 1;
            clamped = Outcome {
                total_ms: outcome.total_ms.min(elapsed),
                ttfb_ms: outcome.ttfb_ms.map(|t| t.min(elapsed)),
                ..outcome.clone()
            };
            &clamped
        } else {
            outcome
        };
        // Refused without a token generated (a 400 for a prompt too long, a 5xx before the
        // first token): the engine never prefilled it, so its prefill leaves the backlog now
        // instead of pricing the endpoint as busy until it would have drained.
        let refused =
            !(200..300).contains(&outcome.status) && outcome.completion_tokens.unwrap_or(0) == 0;
        if let Some(slot) = self.slots[usize::from(entry.endpoint.0)].as_mut() {
            slot.release(&entry);
            if refused {
                drain_backlog(slot, now_ms, slot.rates.prefill_tokens_per_ms);
                let refund = f64::from(entry.prefill_tokens);
                slot.backlog_tokens = (slot.backlog_tokens - refund).max(0.0);
                // A streamed one left the measured queue with `release`.
                if !entry.awaiting_first_token {
                    slot.buffered_tokens = (slot.buffered_tokens - refund).max(0.0);
                }
                // Nor did it take prefill time there: its part of the contention goes too.
                let window = self.config.scoring.prefill_contention_window_ms;
                slot.prefill_inflow
                    .remove(refund, entry.started_ms, now_ms, window);
            }
        }
        // Credit the endpoint that really served (Envoy may have used a fallback).
        let served_by = match self.by_address.get(outcome.endpoint.as_str()) {
            Some(&id) if id != entry.endpoint => {
                self.stats.fallbacks += 1;
                id
            }
            _ => entry.endpoint,
        };
        let mut noted = None;
        let mut reuse = None;
        let mut mismatch = None;
        if let Some(slot) = self.slots[usize::from(served_by.0)].as_mut() {
            let served = &mut slot.served;
            served.outcomes += 1;
            if served_by != entry.endpoint {
                served.fallbacks += 1;
            }
            if let (Some(prompt), Some(cached)) = (outcome.prompt_tokens, outcome.cached_tokens) {
                served.prompt_tokens += u64::from(prompt);
                served.cached_tokens += u64::from(cached.min(prompt));
                let counted = ReuseOutcome {
                    aim: entry.aim.in_engine_tokens(prompt),
                    prompt,
                    delivered: cached.min(prompt),
                    fallback: served_by != entry.endpoint,
                };
                slot.reuse.add(&counted);
                reuse = Some(counted);
            }
            // Where the index and the engine part, for `/debug/mismatch`: a served request
            // that delivered less than a belief worth checking (in the engine's tokens).
            let engine = match outcome.prompt_tokens {
                Some(prompt) => entry.aim.in_engine_tokens(prompt),
                None => entry.aim,
            };
            if served_by == entry.endpoint
                && (200..300).contains(&outcome.status)
                && let Some(delivered) = outcome.cached_tokens
                && entry.believed_cached_tokens >= self.config.self_check.min_believed_tokens.max(1)
                && delivered < engine.believed
            {
                let block = self.config.precise.block_tokens.max(1) as u32;
                mismatch = Some(MismatchRecord {
                    decision_id: outcome.decision_id,
                    endpoint: slot.address.to_string(),
                    model: String::new(),
                    state: entry.state,
                    precise: entry.precise,
                    prompt_tokens: outcome.prompt_tokens.unwrap_or(0),
                    predicted_tokens: engine.aimed,
                    believed_tokens: engine.believed,
                    delivered_tokens: delivered,
                    block_tokens: block,
                    believed_blocks: engine.believed / block,
                    parting_block: delivered / block,
                    at_ms: now_ms,
                });
            }
            // An engine that computed the prompt from its first block (it reported less than a
            // block cached) published that block before it answered: its event index is to
            // hold it as the router hashed it ([`EventHashCheck`]). A hit says nothing: the
            // block may have been stored before the index was last dropped; nor does a prompt
            // prefilled elsewhere (its KV came by transfer).
            let block_tokens = u32::try_from(self.config.precise.block_tokens).unwrap_or(u32::MAX);
            if served_by == entry.endpoint
                && !entry.remote_prefill
                && (200..300).contains(&outcome.status)
                && outcome.cached_tokens.is_some_and(|c| c < block_tokens)
                && let Some(hash) = entry.first_token_block
                && slot.events_whole()
            {
                slot.hashes.expect(hash, now_ms, &self.config.self_check);
            }
            // Believed against delivered: only for the endpoint the belief was about, and only
            // for a request the engine served.
            if served_by == entry.endpoint
                && (200..300).contains(&outcome.status)
                && let Some(delivered) = outcome.cached_tokens
                && let Some(change) = slot.check.observe(
                    entry.believed_cached_tokens,
                    delivered,
                    now_ms,
                    &self.config.self_check,
                )
            {
                noted = Some((slot.address.to_string(), change));
            }
            // The features describe the chosen endpoint: a fallback's outcome teaches nothing.
            if served_by == entry.endpoint
                && !entry.remote_prefill
                && let Some(observed) = Observation::from_outcome(
                    outcome.status,
                    outcome.ttfb_ms,
                    outcome.total_ms,
                    outcome.completion_tokens,
                )
            {
                slot.latency
                    .observe(&entry.latency_features, observed, &self.config.latency);
            }
        }
        if let Some((address, change)) = noted {
            self.note_state_change(address, change);
        }
        if let Some(counted) = reuse {
            self.reuse_pools.add(entry.pool, &counted);
        }
        if let Some(mut record) = mismatch {
            record.model = self.reuse_pools.name(entry.pool).to_string();
            self.mismatches.push(record);
        }

        if (200..300).contains(&outcome.status)
            && let Some(tokens) = outcome.prompt_tokens
        {
            self.token_ratio.observe(entry.prompt_bytes, tokens);
            if served_by == entry.endpoint {
                self.judge_bytes_per_token(served_by, entry.pool, entry.prompt_bytes, tokens);
            }
        }
        if let Some(actual) = outcome.cached_tokens {
            self.stats.predicted_cached_tokens += u64::from(entry.predicted_cached_tokens);
            self.stats.actual_cached_tokens += u64::from(actual);
        }
    }

    /// The first token of decision `decision_id`'s response was seen: its prefill is done, so
    /// it leaves its endpoint's measured queue. While such reports keep arriving (for any
    /// endpoint: an idle one has none to send), every endpoint's queue term is the prefill of
    /// its streamed requests still waiting for a first token, with no assumed rate (a rate off
    /// by 2x, as a prior is on other hardware, drains an estimate twice too fast or too slow);
    /// without them, the estimate drained at the endpoint's rate. A buffered request shows no first token before its end and is
    /// counted by the estimate only.
    pub fn first_token(&mut self, decision_id: u64, now_ms: u64) {
        self.stats.first_tokens += 1;
        self.first_token_at_ms = Some(now_ms);
        let Some(entry) = self.inflight.get_mut(&decision_id) else {
            return;
        };
        if !entry.awaiting_first_token {
            return;
        }
        entry.awaiting_first_token = false;
        if let Some(slot) = self.slots[usize::from(entry.endpoint.0)].as_mut() {
            slot.unconfirmed_tokens =
                (slot.unconfirmed_tokens - f64::from(entry.prefill_tokens)).max(0.0);
        }
    }

    /// The proxy that made route call `call_id` stopped waiting for it (it failed open): the
    /// decision taken for it holds no load here. Returns that decision's outcome (status 0, no
    /// token: its prefill is refunded), which the caller logs so copies release it too; `None`
    /// when the decision is not taken yet (it will not be, see [`Router::route`]) or is gone.
    pub fn withdraw(&mut self, call_id: u64, now_ms: u64) -> Option<Outcome> {
        self.stats.withdrawn += 1;
        let Some(&decision_id) = self.calls.get(&call_id) else {
            if self.withdrawn.len() >= MAX_WITHDRAWN {
                self.withdrawn.pop_front();
            }
            self.withdrawn.push_back((now_ms, call_id));
            return None;
        };
        let entry = self.inflight.get(&decision_id)?;
        let endpoint = self.slots[usize::from(entry.endpoint.0)]
            .as_ref()
            .map(|s| s.address.to_string())
            .unwrap_or_default();
        let outcome = Outcome {
            decision_id,
            endpoint,
            ..Outcome::default()
        };
        // Released as copies will release it: an outcome refused before any token.
        self.feedback(&outcome, now_ms);
        Some(outcome)
    }

    /// Counters since start.
    pub fn stats(&self) -> RouterStats {
        self.stats
    }

    /// Requests routed and not yet reported.
    pub fn inflight_len(&self) -> usize {
        self.inflight.len()
    }

    /// The index, read-only (sizes for metrics).
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// A view of every endpoint, for metrics and the fleet page.
    pub fn endpoints(&self, now_ms: u64) -> Vec<EndpointView> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i, s)))
            .map(|(i, s)| EndpointView {
                address: s.address.to_string(),
                health: s.health,
                stale: now_ms.saturating_sub(s.scraped_at_ms) > self.config.stale_after_ms,
                metrics: s.metrics,
                inflight: s.inflight,
                backlog_tokens: s.backlog_tokens,
                indexed_blocks: self.index.len_for(EndpointId(i as u16)),
                precise_blocks: self.precise.gpu.len_for(EndpointId(i as u16)),
                events_live: s.events_live,
                served: s.served,
                latency_errors: s.latency.errors(),
                latency_samples: s.latency.samples(),
                role: s.role,
                prefill_picks: s.prefill_picks,
                calibration: s.learned,
                routing_state: s.routing_state(),
                state_reason: s.state_reason(),
                delivered_share: s.check.delivered_share(),
                reuse: s.reuse,
            })
            .collect()
    }

    /// The fleet numbers per pool (the request's model), in the order pools were first seen
    /// ([`crate::reuse`]).
    pub fn pool_reuse(&self) -> Vec<(String, ReuseTotals)> {
        self.reuse_pools.totals()
    }

    /// The fleet numbers over every pool.
    pub fn fleet_reuse(&self) -> ReuseTotals {
        self.reuse_pools.fleet()
    }

    /// The recent outcomes that delivered least of what the index believed, worst first:
    /// `/debug/mismatch`.
    pub fn mismatches(&self) -> Vec<MismatchRecord> {
        self.mismatches.worst()
    }

    /// Blocks the reuse ceiling's window may remember now (`router.reuse`).
    pub fn reuse_window_blocks(&self) -> usize {
        self.reuse_window.capacity()
    }

    /// Fixes the size of the window the reuse ceiling is estimated over, whatever the fleet
    /// (0: off, as in a proxy's copy, whose fleet numbers nobody reads).
    pub fn set_reuse_window(&mut self, blocks: usize) {
        self.reuse_window_override = Some(blocks);
        self.reuse_window.set_capacity(blocks);
    }

    /// Sizes the reuse window to the fleet's KV capacity in the approximate index's blocks
    /// (`router.reuse`), unless overridden.
    fn resize_reuse_window(&mut self) {
        let blocks = match self.reuse_window_override {
            Some(blocks) => blocks,
            None => {
                // The endpoints' last scraped KV capacity, summed: read only when one changes.
                let tokens: u64 = self
                    .slots
                    .iter()
                    .flatten()
                    .filter_map(|slot| slot.metrics?.capacity_tokens)
                    .sum();
                let fleet = (tokens as f64 / self.tokens_per_block().max(1.0)) as usize;
                self.config.reuse.window_for(fleet)
            }
        };
        if blocks != self.reuse_window.capacity() {
            self.reuse_window.set_capacity(blocks);
        }
    }

    /// Keeps one endpoint state change for [`Router::take_state_changes`].
    fn note_state_change(&mut self, address: String, change: StateChange) {
        self.stats.state_changes += 1;
        if self.state_changes.len() >= MAX_STATE_CHANGES {
            self.state_changes.pop_front();
        }
        self.state_changes.push_back((address, change));
    }

    /// The endpoint state changes since the last call, oldest first, each with its endpoint's
    /// address: the caller logs and counts each once.
    pub fn take_state_changes(&mut self) -> Vec<(String, StateChange)> {
        self.state_changes.drain(..).collect()
    }

    /// What a local copy of this router needs of each endpoint (`sync`): its address, and its
    /// last scrape with that scrape's age, or none when the endpoint is unreachable.
    pub fn endpoint_snapshots(&self, now_ms: u64) -> Vec<crate::sync::EndpointSnapshot> {
        self.slots
            .iter()
            .flatten()
            .map(|s| s.snapshot(now_ms))
            .collect()
    }

    /// The endpoint table's version: it grows with every change a copy must see.
    pub fn table_version(&self) -> u64 {
        self.table.version
    }

    /// What changed in the endpoint table after version `since`: the endpoints whose snapshot
    /// changed (or that were added) and the addresses removed, to apply in that order. `None`
    /// when that cannot be told (a removal after `since` is no longer kept, or `since` is
    /// ahead of this table): the caller sends the whole table.
    pub fn endpoint_changes(
        &self,
        since: u64,
        now_ms: u64,
    ) -> Option<(Vec<crate::sync::EndpointSnapshot>, Vec<String>)> {
        if since < self.table.floor || since > self.table.version {
            return None;
        }
        let changed = self
            .slots
            .iter()
            .flatten()
            .filter(|s| s.version > since)
            .map(|s| s.snapshot(now_ms))
            .collect();
        let removed = self
            .table
            .removed
            .iter()
            .filter(|(version, _)| *version > since)
            .map(|(_, address)| address.to_string())
            .collect();
        Some((changed, removed))
    }

    /// Each endpoint's load as admission reads it, written into `out` (cleared first), so an
    /// admission decision per request costs no allocation per endpoint: no address string and
    /// no index counts, unlike [`Router::endpoints`]. `reference_tokens` is the uncached prompt
    /// size whose time to first token [`EndpointLoad::ttft_ms`] predicts (see
    /// `fairness::AdmissionConfig::ttft_reference_tokens`).
    pub fn endpoint_loads(&self, now_ms: u64, reference_tokens: u32, out: &mut Vec<EndpointLoad>) {
        out.clear();
        let s = &self.config.scoring;
        let learned = &self.config.latency;
        // The learned model starts at the analytic cost model's constants: while an endpoint is
        // cold (or learning is off) its TTFT is predicted with that prior.
        let analytic = EndpointLatencyModel::new(s, learned);
        let reference = f64::from(reference_tokens.max(1));
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(slot) = slot else { continue };
            let stale = now_ms.saturating_sub(slot.scraped_at_ms) > self.config.stale_after_ms;
            let model = if learned.enabled && slot.latency.samples() >= learned.min_samples {
                &slot.latency
            } else {
                &analytic
            };
            // The same queue and batch terms `route` scores, with the backlog drained to now.
            let backlog = slot.backlog_at(now_ms, slot.rates.prefill_tokens_per_ms);
            let fresh = slot.metrics.filter(|_| !stale);
            let (unknown_waiting, active) = slot.unseen_waiting_and_active(fresh);
            let loaded = LatencyFeatures {
                queue_tokens: backlog + f64::from(unknown_waiting) * s.unknown_request_tokens,
                uncached_tokens: reference,
                active: f64::from(active),
                kv_usage: fresh.map_or(0.0, |m| m.kv_usage),
            };
            let idle = LatencyFeatures {
                queue_tokens: 0.0,
                active: 0.0,
                kv_usage: 0.0,
                ..loaded
            };
            let ttft_ms = model.predict(&loaded).ttft_ms;
            let more = LatencyFeatures {
                queue_tokens: loaded.queue_tokens + 1000.0,
                ..loaded
            };
            let ms_per_queued_token = ((model.predict(&more).ttft_ms - ttft_ms) / 1000.0).max(0.0);
            out.push(EndpointLoad {
                id: EndpointId(i as u16),
                health: slot.health,
                stale,
                metrics: slot.metrics,
                inflight: slot.inflight,
                backlog_tokens: slot.backlog_tokens,
                queued_tokens: loaded.queue_tokens,
                ttft_ms,
                idle_ttft_ms: model.predict(&idle).ttft_ms,
                ms_per_queued_token,
            });
        }
    }
}

/// One endpoint's load for admission: what [`EndpointView`] carries for it, minus the address
/// and index sizes (admission runs per request), plus the router's TTFT prediction for a
/// reference request, which the TTFT-inflation bound of `fairness` compares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndpointLoad {
    /// The endpoint's slot.
    pub id: EndpointId,
    /// Health as the scraper last saw it.
    pub health: Health,
    /// Whether the last scrape is older than `stale_after_ms`.
    pub stale: bool,
    /// Last scraped metrics.
    pub metrics: Option<EndpointMetrics>,
    /// Router-side in-flight requests.
    pub inflight: u32,
    /// Undrained prefill tokens the router sent, as of its last decision (as [`EndpointView`]).
    pub backlog_tokens: f64,
    /// Prompt tokens queued ahead of a request routed there now: the backlog drained to now
    /// plus waiting requests the router did not send (the router's queue term).
    pub queued_tokens: f64,
    /// Predicted time to first token of a reference request routed there now (queue drained
    /// to now, unknown waiting requests, the running batch): the learned model once the
    /// endpoint is warm, the analytic cost model before.
    pub ttft_ms: f64,
    /// The same request's predicted TTFT on the idle endpoint: the baseline of the inflation.
    pub idle_ttft_ms: f64,
    /// Predicted TTFT added per prompt token queued ahead (how much one more admitted prompt
    /// would delay the reference request there).
    pub ms_per_queued_token: f64,
}

/// The learned model's adjustment of a candidate's cost: `blend × (learned − analytic)` for
/// the wait-and-prefill part (the endpoint-invariant overhead left out, so warm and cold
/// endpoints stay comparable) and for the weighted decode part. Zero while the endpoint has
/// fewer than `min_samples` outcomes or the model is disabled.
fn learned_correction(
    config: &LatencyConfig,
    samples: u32,
    predicted: &LatencyPrediction,
    analytic_ttft_ms: f64,
    weighted_output_tokens: f64,
    analytic_tpot_ms: f64,
) -> f64 {
    if !config.enabled || samples < config.min_samples {
        return 0.0;
    }
    let blend = config.blend.clamp(0.0, 1.0);
    let ttft = predicted.ttft_variable_ms - analytic_ttft_ms;
    let decode = weighted_output_tokens * (predicted.tpot_ms - analytic_tpot_ms);
    let correction = blend * (ttft + decode);
    if correction.is_finite() {
        correction
    } else {
        0.0
    }
}

/// Stage 3e: a candidate whose latency model is still cold (fewer than `min_samples`
/// outcomes) is scored with the warm candidates' median correction instead of none. Without
/// it, warm models that predict faster than the analytic prior beat every cold replica, the
/// cold one never gets the outcomes that would warm it, and a replica that joins an idle pool
/// stays unused (a rich-get-richer loop). The median stands for the pool's typical hardware; a
/// cold replica that differs learns its own correction once it is served.
fn cold_latency_from_warm(candidates: &mut [(EndpointId, CandidateScore)], min_samples: u32) {
    let mut warm: Vec<f64> = candidates
        .iter()
        .filter(|(_, c)| c.latency_samples >= min_samples)
        .map(|(_, c)| c.latency_ms)
        .collect();
    if warm.len() == candidates.len() {
        return;
    }
    let Some(median) = crate::self_check::median(&mut warm) else {
        return;
    };
    for (_, c) in candidates
        .iter_mut()
        .filter(|(_, c)| c.latency_samples < min_samples)
    {
        c.latency_ms = median;
        c.total_ms += median;
    }
}

/// Stage 3a: writes each index's matched prefix depth per endpoint slot into `buffers` (the
/// event-fed ones only for a precise request) and returns them as a view.
fn look_up_prefixes<'s>(
    buffers: &'s mut DepthBuffers,
    index: &PrefixIndex,
    precise: &PreciseIndexes,
    request: &RouteRequest,
    n: usize,
) -> PrefixDepths<'s> {
    let DepthBuffers {
        matched,
        gpu,
        spec,
        offload,
    } = buffers;
    let matched = zeroed(matched, n);
    record_depths(index, &request.block_hashes, matched);
    let is_precise = !request.token_block_hashes.is_empty();
    // Only precise requests read these (through `cached_prefix`).
    let per_endpoint = if is_precise { n } else { 0 };
    let gpu = zeroed(gpu, per_endpoint);
    let spec = zeroed(spec, per_endpoint);
    let offload = zeroed(offload, per_endpoint);
    if is_precise {
        record_depths(&precise.gpu, &request.token_block_hashes, gpu);
        record_depths(&precise.speculative, &request.token_block_hashes, spec);
        record_depths(&precise.offload, &request.token_block_hashes, offload);
    }
    PrefixDepths {
        approximate: matched,
        gpu,
        speculative: spec,
        offload,
    }
}

/// Stage 3b, per candidate: the prompt prefix `c` is believed to hold. A precise request on an
/// endpoint with a live event stream reads the event-fed indexes (GPU or speculative, then
/// offload tiers at their weight); any other reads the approximate index. The approximate index
/// evicts at decision time, as the queued prefills will; the event-fed one learns of evictions
/// only when they happen, after this request would be admitted, so its cached prefix is
/// discounted for the queue ahead ([`lost_before_admission`]).
fn cached_prefix(
    c: Candidate<'_>,
    depths: &PrefixDepths<'_>,
    shape: &RequestShape<'_>,
    indexes: &PreciseIndexes,
    config: &PreciseConfig,
) -> CachedPrefix {
    let i = usize::from(c.id.0);
    let (slot, block_tokens, hittable) = (c.slot, shape.block_tokens, shape.hittable_blocks);
    let precise = shape.precise && slot.precise_usable();
    if !precise {
        let tokens = (depths.approximate[i] as f64 * shape.tokens_per_block)
            .min(shape.prompt_tokens - 1.0)
            .max(0.0);
        return CachedPrefix {
            // The engine blocks the hit covers: the unit precise mode counts in.
            blocks: (tokens / block_tokens.max(1) as f64) as usize,
            tokens,
            precise,
        };
    }
    let gpu = depths.gpu[i];
    let on_gpu = gpu.max(depths.speculative[i]).min(hittable);
    let offloaded = depths.offload[i].min(hittable).saturating_sub(on_gpu);
    let tokens =
        (on_gpu * block_tokens) as f64 + config.offload_weight * (offloaded * block_tokens) as f64;
    let tokens = tokens.min(shape.prompt_tokens - 1.0).max(0.0);
    let tokens = if slot.backlog_tokens > 0.0 && gpu > 0 {
        let gpu_index = &indexes.gpu;
        let prefix = &shape.token_blocks[..gpu];
        // The prefix's least recently used block bounds what goes before it: a turn's new
        // blocks are stored after the history it re-used was touched. Sampled, as the
        // in-flight KV is.
        let older_blocks = kv_samples(prefix, 8)
            .chain(prefix.last())
            .filter_map(|&h| gpu_index.older_than(c.id, h))
            .min()
            .unwrap_or(0);
        let cache = CacheView {
            indexed_tokens: (gpu_index.len_for(c.id) * block_tokens) as f64,
            older_tokens: (older_blocks * block_tokens) as f64,
            full: indexes.evicting.contains(c.id),
        };
        // Only the GPU tier is evicted to make room; offloaded blocks stay.
        let at_risk = ((on_gpu * block_tokens) as f64).min(tokens);
        tokens - lost_before_admission(slot, cache, at_risk, shape.kv_blocks)
    } else {
        tokens
    };
    CachedPrefix {
        blocks: on_gpu,
        tokens,
        precise,
    }
}

/// Stage 3c, per candidate: the analytic estimate of how long the request would wait and
/// prefill on `c` with `cached_tokens` of it cached (see the module doc).
fn cost_terms(
    c: Candidate<'_>,
    cached_tokens: f64,
    shape: &RequestShape<'_>,
    s: &ScoringConfig,
) -> CostTerms {
    let slot = c.slot;
    let prompt_tokens = shape.prompt_tokens;
    let output_tokens = shape.output_tokens;
    let uncached = prompt_tokens - cached_tokens;
    let (unknown_waiting, active) = slot.unseen_waiting_and_active(c.fresh);
    let kv_usage = c.fresh.map_or(0.0, |m| m.kv_usage);
    let rates = &slot.rates;
    let queue_ms = (slot.backlog_tokens + f64::from(unknown_waiting) * s.unknown_request_tokens)
        / rates.prefill_tokens_per_ms;
    let prefill_ms = uncached / rates.prefill_tokens_per_ms;
    let itl_ms =
        rates.itl_ms_idle + (rates.itl_ms_full - rates.itl_ms_idle) * kv_usage.clamp(0.0, 1.0);
    let decode_ms = f64::from(active) * (s.decode_ms_per_seq + s.prefill_stall_weight * prefill_ms)
        + kv_usage * s.kv_decode_ms
        + s.decode_weight * f64::from(output_tokens) * itl_ms
        + prefill_contention_ms(c, uncached, output_tokens, s)
        + s.decode_occupancy_weight
            * if s.decode_occupancy_per_request {
                slot.inflight_kv.context_tokens()
            } else {
                slot.inflight_kv.prompt_tokens()
            }
            / rates.prefill_tokens_per_ms;
    // KV pressure from the scrape, or predicted from what the router itself has in flight
    // here plus this request (the scrape lags a burst; past 1.0 the request would wait for
    // memory, and the penalty keeps growing).
    let predicted_kv = match slot.metrics.and_then(|m| m.capacity_tokens) {
        Some(capacity) if capacity > 0 => {
            let capacity = capacity as f64;
            let upper = slot.inflight_kv.tokens + prompt_tokens + f64::from(output_tokens);
            if upper / capacity > s.kv_pressure_threshold {
                // Only near the limit is it worth the walk: the prompt's prefix that in-flight
                // requests already hold here takes no new memory.
                let KvBlocks {
                    hashes,
                    block_tokens,
                } = shape.kv_blocks;
                (upper - slot.inflight_kv.held_prefix_tokens(hashes, block_tokens)) / capacity
            } else {
                upper / capacity
            }
        }
        _ => 0.0,
    };
    let kv_pressure = kv_usage.max(predicted_kv);
    let kv_ms = if kv_pressure > s.kv_pressure_threshold && s.kv_pressure_threshold < 1.0 {
        s.kv_pressure_ms * (kv_pressure - s.kv_pressure_threshold) / (1.0 - s.kv_pressure_threshold)
    } else {
        0.0
    };
    CostTerms {
        uncached_tokens: uncached,
        active,
        kv_usage,
        itl_ms,
        queue_ms,
        prefill_ms,
        decode_ms,
        kv_ms,
    }
}

/// The decode time `c`'s prefill contention would cost this request, weighted (see
/// [`ScoringConfig::prefill_contention_weight`]).
fn prefill_contention_ms(
    c: Candidate<'_>,
    uncached_tokens: f64,
    output_tokens: u32,
    s: &ScoringConfig,
) -> f64 {
    if s.prefill_contention_weight <= 0.0 {
        return 0.0;
    }
    let slot = c.slot;
    let window = s.prefill_contention_window_ms.max(1.0);
    // With this request's own prefill: what its decode and every sequence there will run
    // beside once it is placed (a long miss costs most where prefill already flows).
    let inflow = slot.prefill_inflow.at(c.now_ms, window) + uncached_tokens;
    let rate = if slot.learned.prefill_tokens_per_ms > 0.0 {
        slot.learned.prefill_tokens_per_ms
    } else {
        slot.rates.prefill_tokens_per_ms
    };
    // Past 0.9 the replica is saturated with prefill: the factor stops at 9.
    let rho = (inflow / window / rate.max(1e-9)).min(0.9);
    let expected_output = f64::from(output_tokens.min(s.default_output_tokens));
    s.prefill_contention_weight * expected_output * slot.rates.itl_ms_idle * rho / (1.0 - rho)
}

/// A token count that decays exponentially with time: what was added `t` ms ago counts
/// `exp(-t / window)`.
#[derive(Debug, Clone, Copy, Default)]
struct DecayedTokens {
    tokens: f64,
    at_ms: u64,
}

impl DecayedTokens {
    /// What one token added at `from_ms` counts at `now_ms`.
    fn decay(from_ms: u64, now_ms: u64, window_ms: f64) -> f64 {
        let elapsed = now_ms.saturating_sub(from_ms) as f64;
        (-elapsed / window_ms.max(1.0)).exp()
    }

    /// The count as of `now_ms`.
    fn at(&self, now_ms: u64, window_ms: f64) -> f64 {
        self.tokens * Self::decay(self.at_ms, now_ms, window_ms)
    }

    /// Adds `tokens` at `now_ms` (an earlier time counts as the last one: clocks of copies may
    /// step back).
    fn add(&mut self, tokens: f64, now_ms: u64, window_ms: f64) {
        self.tokens = self.at(now_ms, window_ms) + tokens;
        self.at_ms = self.at_ms.max(now_ms);
    }

    /// Takes back `tokens` added at `added_ms`: what they still count at `now_ms`.
    fn remove(&mut self, tokens: f64, added_ms: u64, now_ms: u64, window_ms: f64) {
        let left = tokens * Self::decay(added_ms, now_ms, window_ms);
        self.tokens = (self.at(now_ms, window_ms) - left).max(0.0);
        self.at_ms = self.at_ms.max(now_ms);
    }
}

/// Stage 3d, per candidate: what moves `c`'s cost off its analytic terms: the session's
/// remembered replica (while healthy), the `cache_control`-marked prefix held there, a LoRA
/// adapter's cost, and the learned latency model's correction once it is warm.
fn steering(
    c: Candidate<'_>,
    terms: &CostTerms,
    shape: &RequestShape<'_>,
    pool: &CandidatePool<'_>,
    model: &str,
    fleet: &FleetState,
    config: &RouterConfig,
) -> Steering {
    let (s, sessions) = (&config.scoring, &config.sessions);
    let session_ms = if pool.session.remembered == Some(c.id)
        && sessions.healthy(c.fresh.map(|m| (m.kv_usage, m.waiting)))
    {
        -sessions.bonus_ms
    } else {
        0.0
    };
    let lora_ms = if pool.adapter {
        fleet.loras.cost_ms(c.id, model, &config.lora)
    } else {
        0.0
    };
    // The marked part of what is cached here: its prefill would be paid again by the turns
    // that follow it elsewhere.
    let held_marked = (shape.prompt_tokens - terms.uncached_tokens)
        .min(shape.marked_tokens)
        .max(0.0);
    let cache_control_ms = match config.cache_control.reuse_weight {
        w if w > 0.0 && held_marked > 0.0 => -w * held_marked / c.slot.rates.prefill_tokens_per_ms,
        _ => 0.0,
    };
    let features = LatencyFeatures {
        queue_tokens: terms.queue_ms * c.slot.rates.prefill_tokens_per_ms,
        uncached_tokens: terms.uncached_tokens,
        active: f64::from(terms.active),
        kv_usage: terms.kv_usage,
    };
    let predicted = c.slot.latency.predict(&features);
    let latency_ms = learned_correction(
        &config.latency,
        c.slot.latency.samples(),
        &predicted,
        terms.queue_ms + terms.prefill_ms + f64::from(terms.active) * s.decode_ms_per_seq,
        s.decode_weight * f64::from(shape.output_tokens),
        terms.itl_ms,
    );
    Steering {
        session_ms,
        cache_control_ms,
        lora_ms,
        latency_ms,
        predicted,
        features,
    }
}

/// Stage 4a: marks the candidates the guard skips (far more in flight than the least loaded
/// one, absolutely and relatively); a session's replica or a marked prefix's holder that the
/// guard skips is overloaded, so it loses its bonus.
fn apply_guard(candidates: &mut [(EndpointId, CandidateScore)], s: &ScoringConfig) {
    let min_inflight = candidates
        .iter()
        .map(|(_, c)| c.inflight)
        .min()
        .unwrap_or(0);
    for (_, c) in candidates.iter_mut() {
        c.guarded = c.inflight >= min_inflight + s.guard_abs
            && f64::from(c.inflight) >= s.guard_rel * f64::from(min_inflight.max(1));
        if c.guarded {
            c.total_ms -= c.session_ms + c.cache_control_ms;
            c.session_ms = 0.0;
            c.cache_control_ms = 0.0;
        }
    }
}

/// Writes each endpoint's matched prefix depth into `out` (ids beyond `out` are ignored).
fn record_depths(index: &PrefixIndex, hashes: &[u64], out: &mut [usize]) {
    index.matched_prefix(hashes, |id, depth| {
        if let Some(m) = out.get_mut(usize::from(id.0)) {
            *m = depth;
        }
    });
}

/// Writes into `keys` the candidates' order: unguarded first, then by total cost, stable, as
/// keys `key_position` reads a position from. The full key of a candidate is one integer
/// (guarded flag, cost in `f64::total_cmp` order, then the position, so an unstable sort gives
/// the stable order). Sorting 64 of those was a tenth of a decision in profiles, so they are
/// first sorted as `u64` (flag, top 55 bits of the cost, position), which is exact unless two
/// candidates share those 55 bits and differ below them; that is checked, and only then are
/// the full keys sorted. Candidates are large: they are moved once, after this.
fn cost_order(
    candidates: &[(EndpointId, CandidateScore)],
    keys: &mut Vec<u128>,
    short: &mut Vec<u64>,
) {
    keys.clear();
    keys.extend(candidates.iter().enumerate().map(|(i, (_, c))| {
        let bits = c.total_ms.to_bits();
        let ordered = if bits >> 63 == 1 {
            !bits
        } else {
            bits | 1 << 63
        };
        u128::from(c.guarded) << 127 | u128::from(ordered) << 63 | i as u128
    }));
    if keys.len() <= 256 {
        short.clear();
        short.extend(
            keys.iter()
                .enumerate()
                .map(|(i, k)| ((k >> 64) as u64 & !0xff) | i as u64),
        );
        short.sort_unstable();
        let position = |s: u64| (s & 0xff) as usize;
        let exact = short
            .windows(2)
            .all(|w| w[0] >> 8 != w[1] >> 8 || keys[position(w[0])] < keys[position(w[1])]);
        if exact {
            for (k, s) in keys.iter_mut().zip(short.iter()) {
                *k = position(*s) as u128;
            }
            return;
        }
    }
    keys.sort_unstable();
}

/// The candidate position a `cost_order` key carries.
fn key_position(key: u128) -> usize {
    (key & ((1 << 63) - 1)) as usize
}

#[cfg(test)]
mod cost_order_tests {
    use super::*;

    /// The order of the full keys, sorted directly.
    fn reference(candidates: &[(EndpointId, CandidateScore)]) -> Vec<usize> {
        let mut keys = Vec::new();
        let mut short = Vec::new();
        cost_order(candidates, &mut keys, &mut short);
        let mut full: Vec<(bool, u64, usize)> = candidates
            .iter()
            .enumerate()
            .map(|(i, (_, c))| {
                let bits = c.total_ms.to_bits();
                let ordered = if bits >> 63 == 1 {
                    !bits
                } else {
                    bits | 1 << 63
                };
                (c.guarded, ordered, i)
            })
            .collect();
        full.sort();
        let got: Vec<usize> = keys.iter().map(|&k| key_position(k)).collect();
        assert_eq!(
            got,
            full.iter().map(|f| f.2).collect::<Vec<_>>(),
            "{candidates:?}"
        );
        got
    }

    fn candidate(total_ms: f64, guarded: bool) -> (EndpointId, CandidateScore) {
        (
            EndpointId(0),
            CandidateScore {
                total_ms,
                guarded,
                ..CandidateScore::default()
            },
        )
    }

    #[test]
    fn short_keys_give_the_full_order_ties_and_near_ties_included() {
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for round in 0..500 {
            let n = 1 + round % 80;
            let candidates: Vec<_> = (0..n)
                .map(|_| {
                    x = splitmix64(x);
                    let base: f64 = [0.5, 12.0, -3.0, 1e9, 0.0][(x % 5) as usize];
                    // Exact ties, ties below the short key's 55 cost bits, and ordinary spread.
                    let cost = match (x >> 8) % 4 {
                        0 => base,
                        1 => f64::from_bits(base.to_bits() ^ ((x >> 20) & 0x1ff)),
                        2 => base + (x >> 40) as f64 / 1e3,
                        _ => -base,
                    };
                    candidate(cost, (x >> 4).is_multiple_of(7))
                })
                .collect();
            reference(&candidates);
        }
        assert_eq!(
            reference(&[
                candidate(2.0, true),
                candidate(2.0, false),
                candidate(1.0, false)
            ]),
            vec![2, 1, 0]
        );
    }
}

/// The candidates' scores in `keys` order (a permutation of their positions), then the
/// prefill-only ones: each score moves once into the returned vector.
fn in_cost_order(
    candidates: Vec<(EndpointId, CandidateScore)>,
    keys: &[u128],
    prefill_only: Vec<(EndpointId, CandidateScore)>,
) -> Vec<CandidateScore> {
    // Same element size as `candidates` (the option uses a niche), so this reuses its buffer.
    let mut taken: Vec<Option<(EndpointId, CandidateScore)>> =
        candidates.into_iter().map(Some).collect();
    let mut ordered = Vec::with_capacity(keys.len() + prefill_only.len());
    ordered.extend(
        keys.iter()
            .filter_map(|&k| taken[key_position(k)].take().map(|(_, c)| c)),
    );
    ordered.extend(prefill_only.into_iter().map(|(_, c)| c));
    ordered
}

/// What the router's indexes say about one endpoint's cache, for [`lost_before_admission`].
#[derive(Debug, Clone, Copy)]
struct CacheView {
    /// Tokens the index believes the endpoint caches.
    indexed_tokens: f64,
    /// Cached tokens last touched before the request's prefix (they are evicted first).
    older_tokens: f64,
    /// The engine has been evicting: no free blocks are left, whatever the index counts (it
    /// misses partly filled blocks and duplicates).
    full: bool,
}

/// Cached prompt tokens on `slot`'s GPU that the prefill queued ahead of this request will
/// evict before the engine admits it. A full cache makes room by evicting its least recently used
/// blocks that no running request pins; the queued prefills allocate `backlog_tokens`, which
/// first take free blocks, then the blocks touched before this prompt's prefix, then the
/// prefix itself (its part that in-flight requests pin is safe). Without this the router
/// promises a conversation's history on a replica whose queue will evict it, and the request
/// pays the queue and the full prefill: precise mode's live tail under contention.
fn lost_before_admission(
    slot: &Slot,
    cache: CacheView,
    gpu_cached_tokens: f64,
    kv_blocks: KvBlocks<'_>,
) -> f64 {
    let capacity = match slot.metrics.and_then(|m| m.capacity_tokens) {
        Some(c) if c > 0 => c as f64,
        _ => return 0.0,
    };
    let ahead = slot.backlog_tokens;
    // Pinned now: what in-flight requests hold, less what the queue has yet to allocate.
    let pinned = (slot.inflight_kv.tokens - ahead).max(0.0);
    let free = if cache.full {
        0.0
    } else {
        capacity - cache.indexed_tokens.max(pinned).min(capacity)
    };
    let reaching_prefix = ahead - free - cache.older_tokens;
    if reaching_prefix <= 0.0 {
        return 0.0;
    }
    let held = slot
        .inflight_kv
        .held_prefix_tokens(kv_blocks.hashes, kv_blocks.block_tokens);
    (gpu_cached_tokens - held).max(0.0).min(reaching_prefix)
}

/// How far (as a ratio) an endpoint's learned prefill rate may sit from the fleet's average and
/// still count as the same hardware, scored at the average.
const SAME_HARDWARE: f64 = 1.3;

/// The prior calibration starts each endpoint from: the configured scoring rates.
fn prior(s: &ScoringConfig) -> Prior {
    Prior {
        prefill_tokens_per_ms: s.prefill_tokens_per_ms,
        itl_ms_idle: s.itl_ms_idle,
        itl_ms_full: s.itl_ms_full,
    }
}

/// The replica drains queued prefill at its prefill rate: forget what it has done since.
fn drain_backlog(slot: &mut Slot, now_ms: u64, tokens_per_ms: f64) {
    let elapsed = now_ms.saturating_sub(slot.backlog_at_ms) as f64;
    slot.buffered_tokens = (slot.buffered_tokens - elapsed * tokens_per_ms).max(0.0);
    slot.backlog_tokens = slot.backlog_at(now_ms, tokens_per_ms);
    slot.backlog_at_ms = now_ms.max(slot.backlog_at_ms);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{block_hashes, model_seed};

    fn router(n: usize) -> Router {
        let mut r = Router::new(RouterConfig::default(), 1);
        for i in 0..n {
            r.upsert_endpoint(&format!("10.0.0.{i}:8000")).unwrap();
        }
        r
    }

    fn request(text: &str) -> RouteRequest {
        let hashes = block_hashes(model_seed("m"), text.as_bytes(), 256);
        RouteRequest {
            model: "m".into(),
            block_hashes: hashes,
            prompt_bytes: text.len() as u64,
            prompt_tokens: (text.len() / 4) as u32,
            ..Default::default()
        }
    }

    /// Asserts that one scoring term alone moves a request off its prefix holder: at `weight`
    /// (its default) the request leaves the holder, at 0 it stays. `pick` routes the scenario
    /// with the term at a weight (and any other term that would move it off) and returns
    /// (holder, chosen).
    fn term_moves_off_the_holder(weight: f64, pick: impl Fn(f64) -> (String, String)) {
        let (holder, chosen) = pick(weight);
        assert_ne!(
            chosen, holder,
            "the term at {weight} left the request on its holder"
        );
        let (holder, chosen) = pick(0.0);
        assert_eq!(
            chosen, holder,
            "without the term the request left its holder"
        );
    }

    #[test]
    fn second_turn_follows_first() {
        let mut r = router(4);
        let t1 = "system prompt ".repeat(200);
        let first = r.route(&request(&t1), 0, 7);
        let t2 = format!("{t1} and the next turn");
        // Much later, so the backlog has drained.
        let second = r.route(&request(&t2), 10_000, 8);
        assert_eq!(first.response.endpoints[0], second.response.endpoints[0]);
        assert_eq!(second.response.reason.as_str(), "prefix");
        assert!(second.response.cached_blocks > 0);
        assert_eq!(second.response.endpoints.len(), 3);
    }

    #[test]
    fn a_stored_response_pins_its_chain_to_the_replica_that_answered() {
        let mut r = router(4);
        let first = r.route(&request("tell me a story"), 0, 1);
        let served = first.response.endpoints[0].clone();
        r.feedback(
            &Outcome {
                decision_id: first.response.decision_id,
                endpoint: served.clone(),
                status: 200,
                response_id: Some("resp_1".into()),
                ..Outcome::default()
            },
            5,
        );
        // Short new input only: without the pin, load alone would choose.
        for (i, now) in [10u64, 20, 30].into_iter().enumerate() {
            let mut next = request(&format!("go on {i}"));
            next.previous_response_id = Some("resp_1".into());
            let d = r.route(&next, now, i as u64);
            assert_eq!(d.response.endpoints, vec![served.clone()], "no fallbacks");
            assert_eq!(d.response.reason, RouteReason::StoredResponse);
        }
        assert_eq!(r.stats().stored_response_pinned, 3);
        // A failed answer stores nothing.
        r.feedback(
            &Outcome {
                decision_id: 99,
                endpoint: "10.0.0.3:8000".into(),
                status: 500,
                response_id: Some("resp_2".into()),
                ..Outcome::default()
            },
            40,
        );
        let mut lost = request("x");
        lost.previous_response_id = Some("resp_2".into());
        assert_ne!(
            r.route(&lost, 50, 9).response.reason,
            RouteReason::StoredResponse
        );
        assert_eq!(r.stats().stored_response_unknown, 1);
    }

    #[test]
    fn a_stored_response_follows_the_proxys_hint_until_reported_and_not_a_gone_replica() {
        let mut r = router(3);
        let mut next = request("go on");
        next.previous_response_id = Some("resp_9".into());
        next.previous_response_endpoint = Some("10.0.0.2:8000".into());
        let d = r.route(&next, 0, 1);
        assert_eq!(d.response.endpoints, vec!["10.0.0.2:8000".to_string()]);
        // Its replica is removed: the id is forgotten and the request is routed as any other
        // (the replica it reaches answers 404, as vLLM does).
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                endpoint: "10.0.0.2:8000".into(),
                status: 200,
                response_id: Some("resp_10".into()),
                ..Outcome::default()
            },
            5,
        );
        r.remove_endpoint("10.0.0.2:8000");
        let mut after = request("go on");
        after.previous_response_id = Some("resp_10".into());
        let d = r.route(&after, 10, 2);
        assert_ne!(d.response.reason, RouteReason::StoredResponse);
        assert!(!d.response.endpoints.contains(&"10.0.0.2:8000".to_string()));
    }

    /// A streamed request for `text` (its first token is reported).
    fn streamed(text: &str) -> RouteRequest {
        RouteRequest {
            stream: true,
            ..request(text)
        }
    }

    /// The queue term `d` priced on `endpoint`.
    fn queue_on(d: &Decision, endpoint: &str) -> f64 {
        d.candidates
            .iter()
            .find(|c| c.endpoint.as_str() == endpoint)
            .map(|c| c.queue_ms)
            .unwrap()
    }

    // While first tokens are reported, a streamed request stays in its endpoint's queue until
    // its own first token, however long the assumed rate says its prefill should take, and
    // leaves it the moment the report comes.
    #[test]
    fn first_token_reports_measure_the_queue_instead_of_a_rate() {
        let mut r = router(2);
        let system = "a shared system prompt ".repeat(300);
        let first = r.route(&streamed(&system), 0, 1);
        let home = first.response.endpoints[0].clone();
        r.first_token(first.response.decision_id, 10);
        let second = r.route(
            &streamed(&format!("{system} and a long question ").repeat(3)),
            20,
            2,
        );
        assert_eq!(second.response.endpoints[0], home);
        // Long after the prior rate would have drained it: still queued, not yet started.
        let probe = r.route(&request("unrelated"), 5_000, 3);
        assert!(queue_on(&probe, &home) > 0.0, "{probe:?}");
        r.first_token(second.response.decision_id, 5_001);
        let probe = r.route(&request("unrelated too"), 5_002, 4);
        assert_eq!(queue_on(&probe, &home), 0.0);
        assert_eq!(r.stats().first_tokens, 2);
    }

    // An endpoint that was idle has sent no first token lately, yet the long miss it was just
    // given stays queued there until its own first token is reported, while reports arrive
    // from elsewhere: drained at the prior rate it would look empty long before the prefill
    // ends on slower hardware, and the next long misses would pile onto it.
    #[test]
    fn an_idle_endpoints_first_prefill_is_measured_while_others_report() {
        let mut r = router(2);
        let busy = r.route(&streamed(&"one conversation ".repeat(200)), 0, 1);
        r.first_token(busy.response.decision_id, 10);
        // 20,000 tokens: 4 s of queue at the prior rate, which would have drained them by 6 s.
        let long = r.route(&streamed(&"a long new document ".repeat(4_000)), 20, 2);
        let idle = long.response.endpoints[0].clone();
        assert_ne!(idle, busy.response.endpoints[0]);
        let probe = r.route(&request("unrelated"), 6_000, 3);
        assert!(queue_on(&probe, &idle) > 3_000.0, "{probe:?}");
        r.first_token(long.response.decision_id, 6_001);
        let probe = r.route(&request("unrelated too"), 6_002, 4);
        assert_eq!(queue_on(&probe, &idle), 0.0);
    }

    // A copy leaves only long placements by load to the control plane: never a hit, never a
    // short prompt, never a request with nowhere else to go, and it accounts for none of them.
    #[test]
    fn only_a_long_placement_by_load_among_several_is_deferred() {
        let long = "a long document nobody has sent before ".repeat(400);
        let threshold = 50.0;
        let mut alone = router(1);
        assert!(
            alone
                .route_or_defer(&request(&long), 0, 1, threshold)
                .is_some()
        );

        let mut r = router(4);
        assert!(r.route_or_defer(&request(&long), 0, 1, threshold).is_none());
        assert_eq!((r.stats().deferred, r.stats().decisions), (1, 0));
        assert_eq!(r.inflight_len(), 0, "a deferred request holds no load");
        let short = r.route_or_defer(&request("hi"), 0, 2, threshold);
        assert!(short.is_some_and(|d| !d.response.endpoints.is_empty()));
        let first = r.route(&request(&long), 0, 3);
        let again = r
            .route_or_defer(
                &request(&format!("{long} and a question")),
                10_000,
                4,
                threshold,
            )
            .expect("a hit is decided where it is");
        assert_eq!(again.response.endpoints[0], first.response.endpoints[0]);
    }

    #[test]
    fn distinct_prompts_spread_over_the_fleet() {
        let mut r = router(4);
        let mut used = std::collections::BTreeSet::new();
        for i in 0..8 {
            let d = r.route(&request(&format!("{i} conversation ").repeat(100)), 0, i);
            used.insert(d.response.endpoints[0].clone());
        }
        assert_eq!(used.len(), 4);
    }

    /// Routes turn 2 of a conversation whose 8,000-byte turn 1 is cached on one of two
    /// endpoints, once that holder reports `waiting` unknown requests queued: whether the holder
    /// kept it, and the decision. `marked`: turn 1's prefix carries `cache_control`.
    fn marked_probe(waiting: u32, marked: bool, reuse_weight: f64) -> (bool, Decision) {
        let mut config = RouterConfig::default();
        config.cache_control.reuse_weight = reuse_weight;
        let mut r = Router::new(config, 1);
        let idle = EndpointMetrics::default();
        for i in 0..2 {
            let a = format!("10.0.0.{i}:8000");
            r.upsert_endpoint(&a).unwrap();
            r.update_metrics(&a, idle, 0);
        }
        let t1 = "tool definitions and a system prompt ".repeat(216);
        let first = r.route(&request(&t1), 0, 1);
        let holder = first.response.endpoints[0].clone();
        r.feedback(
            &Outcome {
                decision_id: first.response.decision_id,
                endpoint: holder.clone(),
                status: 200,
                ..Default::default()
            },
            1_000,
        );
        let later = 60_000;
        for i in 0..2 {
            let a = format!("10.0.0.{i}:8000");
            let metrics = match a == holder {
                true => EndpointMetrics { waiting, ..idle },
                false => idle,
            };
            r.update_metrics(&a, metrics, later);
        }
        let mut turn2 = request(&format!("{t1} and the next question"));
        if marked {
            turn2.marked_blocks = (t1.len() / 256) as u32;
        }
        let d = r.route(&turn2, later + 10, 2);
        (d.response.endpoints[0] == holder, d)
    }

    /// The fewest queued requests on the holder that move the probe off it.
    fn spill_point(marked: bool, reuse_weight: f64) -> u32 {
        (0..400)
            .find(|&w| !marked_probe(w, marked, reuse_weight).0)
            .expect("a long enough queue moves any request")
    }

    #[test]
    fn a_marked_prefix_stays_on_its_holder_under_a_queue_that_moves_an_unmarked_one() {
        let reuse = 1.0;
        let (unmarked, marked) = (spill_point(false, reuse), spill_point(true, reuse));
        // Between the two points the holder keeps marked requests and loses unmarked ones.
        assert!(unmarked < marked, "unmarked {unmarked}, marked {marked}");
        assert!(marked_probe(unmarked, true, reuse).0);
        assert!(!marked_probe(unmarked, false, reuse).0);
        // The margin is bounded by what the marker is worth: `reuse_weight` x the marked
        // prefix's prefill, here in queued requests of `unknown_request_tokens` each.
        let (_, d) = marked_probe(0, true, reuse);
        let s = ScoringConfig::default();
        let holder = &d.candidates[0];
        assert!(holder.cached_tokens > 0);
        let marked_tokens = f64::from(holder.cached_tokens);
        assert!(
            (holder.cache_control_ms + reuse * marked_tokens / s.prefill_tokens_per_ms).abs()
                < 1e-6,
            "{holder:?}"
        );
        let margin = reuse * marked_tokens / s.unknown_request_tokens;
        let moved = f64::from(marked - unmarked);
        assert!((moved - margin).abs() <= 1.0, "{moved} against {margin}");
        // Off (the default), a marker changes nothing.
        let off = CacheControlConfig::default().reuse_weight;
        assert_eq!(spill_point(true, off), unmarked);
        // The endpoint holding nothing is credited nothing.
        assert!(d.candidates[1].cache_control_ms == 0.0);
    }

    #[test]
    fn the_configuration_copies_get_names_cache_control_only_when_on() {
        let off = serde_json::to_value(RouterConfig::default()).unwrap();
        assert!(off.get("cache_control").is_none(), "{off}");
        // Nor the reuse window's defaults (copies keep none): older copies still parse it.
        assert!(off.get("reuse").is_none(), "{off}");
        let mut config = RouterConfig::default();
        config.cache_control.reuse_weight = 1.0;
        let on = serde_json::to_string(&config).unwrap();
        assert_eq!(serde_json::from_str::<RouterConfig>(&on).unwrap(), config);
        assert_eq!(
            serde_json::from_value::<RouterConfig>(off).unwrap(),
            RouterConfig::default()
        );
    }

    #[test]
    fn a_forged_marked_count_marks_at_most_the_prompt() {
        let mut config = RouterConfig::default();
        config.cache_control.reuse_weight = 1.0;
        let mut r = Router::new(config, 1);
        r.upsert_endpoint("10.0.0.0:8000").unwrap();
        r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
        let text = "abc ".repeat(2_000);
        r.route(&request(&text), 0, 1);
        let mut again = request(&text);
        again.marked_blocks = u32::MAX;
        let d = r.route(&again, 60_000, 2);
        let c = &d.candidates[0];
        let prompt_tokens = (text.len() / 4) as f64;
        let rate = ScoringConfig::default().prefill_tokens_per_ms;
        assert!(c.cache_control_ms < 0.0);
        assert!(-c.cache_control_ms <= prompt_tokens / rate, "{c:?}");
    }

    #[test]
    fn busy_replica_is_avoided() {
        let mut r = router(2);
        r.update_metrics(
            "10.0.0.0:8000",
            EndpointMetrics {
                running: 50,
                waiting: 30,
                kv_usage: 0.95,
                capacity_tokens: None,
                counters: None,
                ..Default::default()
            },
            0,
        );
        r.update_metrics("10.0.0.1:8000", EndpointMetrics::default(), 0);
        let d = r.route(&request(&"x".repeat(1000)), 10, 1);
        assert_eq!(d.response.endpoints[0], "10.0.0.1:8000");
    }

    #[test]
    fn a_prefix_holder_busy_decoding_is_left_when_a_miss_elsewhere_stalls_no_one() {
        // The holder of a 4,200-token prefix runs 60 sequences: a 600-token suffix prefilled
        // there stalls each of them, which costs more than prefilling the whole prompt on the
        // idle replica. Without the stall term the hit wins regardless.
        let system = "shared system prompt ".repeat(800);
        let follow_up = format!("{system}{}", "question words ".repeat(160));
        let pick = |stall_weight: f64| {
            let mut r = router(2);
            r.config.scoring.prefill_contention_weight = 0.0;
            r.config.scoring.prefill_stall_weight = stall_weight;
            let holder = r.route(&request(&system), 0, 1).response.endpoints[0].clone();
            let busy = EndpointMetrics {
                running: 60,
                kv_usage: 0.3,
                ..EndpointMetrics::default()
            };
            for i in 0..2 {
                let address = format!("10.0.0.{i}:8000");
                let m = if address == holder {
                    busy
                } else {
                    EndpointMetrics::default()
                };
                r.update_metrics(&address, m, 60_000);
            }
            let chosen = r.route(&request(&follow_up), 60_000, 2).response.endpoints[0].clone();
            (holder, chosen)
        };
        term_moves_off_the_holder(ScoringConfig::default().prefill_stall_weight, pick);
    }

    // A control plane that restarts replays the shared stream before it has polled every
    // endpoint's models or scraped it: decisions for those endpoints are facts all the same,
    // and their prefixes must be in the index it serves from.
    #[test]
    fn recorded_decisions_count_whatever_this_router_knows_of_the_endpoint() {
        let mut r = router(3);
        let served = |id: &str| {
            vec![ServedModel {
                id: id.into(),
                parent: None,
            }]
        };
        // Endpoint 0 was polled and lists the model; 1 not yet polled; 2 lists another model
        // (this router's view is stale) and its metrics stopped answering.
        r.set_served_models("10.0.0.0:8000", served("m"));
        r.set_served_models("10.0.0.2:8000", served("other"));
        r.mark_unreachable("10.0.0.2:8000");
        for (k, endpoint) in ["10.0.0.1:8000", "10.0.0.2:8000"].into_iter().enumerate() {
            let text = format!("conversation {k} ").repeat(200);
            let req = request(&text);
            assert!(r.record_decision(&req, endpoint, 100 + k as u64, 10, 0));
            let id = r.endpoint_id(endpoint).unwrap();
            assert!(
                req.block_hashes.iter().all(|&h| r.index().holds(id, h)),
                "{endpoint}: prefix not indexed"
            );
            // The same report again is the same decision.
            assert!(!r.record_decision(&req, endpoint, 100 + k as u64, 11, 0));
        }
        // A model no endpoint lists, under `reject`, was still routed by whoever decided.
        r.config.models.unknown_model = crate::pools::UnknownModelPolicy::Reject;
        let mut unknown = request(&"an unlisted model ".repeat(200));
        unknown.model = "unlisted".into();
        assert!(r.record_decision(&unknown, "10.0.0.0:8000", 200, 12, 0));
    }

    // Twenty agents run on the replica holding the tool prompt they all share, each with 6,000
    // tokens of its own context in flight. A new agent's first turn hits that prompt there,
    // but joining them costs more than prefilling the prompt once on the idle replica: the
    // decode occupancy prices what their sequences hold. Without it the hit wins.
    #[test]
    fn a_new_session_leaves_a_prefix_holder_full_of_other_sessions_context() {
        let tools = "tool definitions shared by every agent ".repeat(400);
        let pick = |weight: f64| {
            let mut r = router(2);
            r.config.scoring.decode_occupancy_weight = 0.0;
            r.config.scoring.prefill_contention_weight = 0.0;
            let holder = r.route(&request(&tools), 0, 1).response.endpoints[0].clone();
            // Placed there earlier (when it held little), as another router's decisions are.
            for k in 0..20u64 {
                let context = format!("{tools} agent {k} {}", "tool output ".repeat(2_000));
                assert!(r.record_decision(&request(&context), &holder, 1_000 + k, 10 + k, 0));
            }
            r.config.scoring.decode_occupancy_weight = weight;
            let next = format!("{tools} a new agent's task");
            let chosen = r.route(&request(&next), 60_000, 99).response.endpoints[0].clone();
            (holder, chosen)
        };
        term_moves_off_the_holder(ScoringConfig::default().decode_occupancy_weight, pick);
    }

    // Four long prompts were just prefilled on the replica holding a conversation's context
    // (their first tokens are in: no queue is left), and they are still decoding there. The
    // conversation's next turn would decode in steps those prompts' prefill keeps stretching,
    // and on an idle replica it pays its context's prefill once: the contention term prices the
    // first above the second; without it the hit wins. Ten windows later nothing is left of it.
    #[test]
    fn a_turn_leaves_a_holder_that_is_absorbing_prefill() {
        // About 2,000 tokens of context, four prompts of about 1,000 tokens; all streamed, so
        // their first tokens take their prefill out of the measured queue.
        let context = "a conversation's long context ".repeat(270);
        let streamed = |text: &str| RouteRequest {
            stream: true,
            ..request(text)
        };
        let pick = |weight: f64| {
            let mut r = router(2);
            r.config.scoring.prefill_contention_weight = weight;
            let first = r.route(&streamed(&context), 0, 1).response;
            r.first_token(first.decision_id, 50);
            let holder = first.endpoints[0].clone();
            for k in 0..4u64 {
                let other = format!("another prompt {k} ").repeat(240);
                assert!(r.record_decision(&streamed(&other), &holder, 1_000 + k, 60_000, 0));
                r.first_token(1_000 + k, 60_050);
            }
            let next = format!("{context} the next question");
            let chosen = r.route(&streamed(&next), 60_100, 2).response.endpoints[0].clone();
            (holder, chosen)
        };
        term_moves_off_the_holder(ScoringConfig::default().prefill_contention_weight, pick);

        let mut r = router(1);
        let probe =
            |r: &mut Router, at: u64| r.route(&request("probe"), at, at).candidates[0].decode_ms;
        let idle = probe(&mut r, 0);
        r.route(&request(&"another prompt ".repeat(1_000)), 1_000, 1);
        let busy = probe(&mut r, 1_001);
        let window = ScoringConfig::default().prefill_contention_window_ms as u64;
        // The prompt's request is still in flight: its occupancy and running sequence remain.
        let later = probe(&mut r, 1_001 + 10 * window);
        assert!(busy > idle + 1_000.0, "{idle} {busy}");
        assert!(later < idle + 200.0, "{idle} {busy} {later}");
    }

    #[test]
    fn decayed_tokens_decay_with_the_window_and_add_at_the_latest_time() {
        let mut d = DecayedTokens::default();
        d.add(1_000.0, 100, 1_000.0);
        assert!((d.at(1_100, 1_000.0) - 1_000.0 / std::f64::consts::E).abs() < 1e-6);
        // A copy's clock stepping back adds at the latest time seen, nothing is lost.
        d.add(500.0, 50, 1_000.0);
        assert!((d.at(100, 1_000.0) - 1_500.0).abs() < 1e-6);
        // Taking back what was added leaves what came before, decayed.
        d.remove(500.0, 100, 600, 1_000.0);
        assert!((d.at(600, 1_000.0) - 1_000.0 * (-0.5f64).exp()).abs() < 1e-6);
    }

    // The occupancy counts a prefix its in-flight requests share once, and leaves their
    // expected output out.
    #[test]
    fn decode_occupancy_counts_a_shared_prefix_once_and_no_output() {
        let tools = "tool definitions shared by every agent ".repeat(400);
        let mut r = router(1);
        r.config.scoring.decode_occupancy_weight = 1.0;
        let mut alone = request(&format!("{tools} agent 0"));
        alone.max_output_tokens = Some(4_096);
        r.route(&alone, 0, 1);
        let one = r.route(&request("probe"), 60_000, 2).candidates[0].decode_ms;
        let mut second = request(&format!("{tools} agent 1"));
        second.max_output_tokens = Some(4_096);
        r.route(&second, 60_001, 3);
        let two = r.route(&request("probe too"), 120_000, 4).candidates[0].decode_ms;
        let tokens = |ms: f64| ms * ScoringConfig::default().prefill_tokens_per_ms;
        // Two requests, one shared prompt: the second adds far less than the first.
        assert!(tokens(one) > 3_500.0, "{one}");
        assert!(tokens(two) - tokens(one) < 1_000.0, "{one} {two}");
    }

    // Counted per request, the same two requests add their whole contexts each, and their
    // expected output still not; once answered they leave nothing behind.
    #[test]
    fn decode_occupancy_per_request_counts_every_context_whole() {
        let tools = "tool definitions shared by every agent ".repeat(400);
        let mut r = router(1);
        r.config.scoring.decode_occupancy_weight = 1.0;
        r.config.scoring.decode_occupancy_per_request = true;
        r.config.scoring.prefill_contention_weight = 0.0;
        let tokens = |ms: f64| ms * ScoringConfig::default().prefill_tokens_per_ms;
        let mut ids = Vec::new();
        let mut occupancy = Vec::new();
        for k in 0..2u64 {
            let mut agent = request(&format!("{tools} agent {k}"));
            agent.max_output_tokens = Some(4_096);
            let routed = r.route(&agent, k * 60_000, 1 + k).response;
            ids.push((routed.decision_id, routed.endpoints[0].clone()));
            let probe = r.route(&request("probe"), k * 60_000 + 1, 10 + k);
            occupancy.push(tokens(probe.candidates[0].decode_ms));
        }
        assert!(occupancy[0] > 3_500.0, "{occupancy:?}");
        assert!(occupancy[1] - occupancy[0] > 3_500.0, "{occupancy:?}");
        assert!(
            occupancy[1] < 2.5 * occupancy[0],
            "output counted: {occupancy:?}"
        );
        for (decision_id, endpoint) in ids {
            let done = Outcome {
                decision_id,
                endpoint,
                ..Default::default()
            };
            r.feedback(&done, 200_000);
        }
        let after = r.route(&request("probe"), 300_000, 20).candidates[0].decode_ms;
        assert!(tokens(after) < 100.0, "{after}");
    }

    /// The first endpoint's routing state and its reason.
    pub(super) fn first_state(r: &Router) -> (RoutingState, Option<StateReason>) {
        let e = &r.endpoints(0)[0];
        (e.routing_state, e.state_reason)
    }

    /// Asserts that the state changes noted since the last call are `endpoint` turning
    /// degraded and exact again, both for `reason`.
    fn assert_degraded_and_back(r: &mut Router, endpoint: &str, reason: StateReason, why: &str) {
        let changes: Vec<_> = r
            .take_state_changes()
            .into_iter()
            .map(|(e, c)| (e, c.to, c.reason))
            .collect();
        let expected = [
            (endpoint.to_string(), RoutingState::Degraded, reason),
            (endpoint.to_string(), RoutingState::Exact, reason),
        ];
        assert_eq!(changes, expected, "{why}");
    }

    /// `n` endpoints whose scrape reports `tokens` of KV capacity and no load.
    fn router_with_kv_capacity(n: usize, tokens: u64) -> Router {
        let mut r = router(n);
        let metrics = EndpointMetrics {
            capacity_tokens: Some(tokens),
            counters: None,
            ..EndpointMetrics::default()
        };
        for i in 0..n {
            r.update_metrics(&format!("10.0.0.{i}:8000"), metrics, 0);
        }
        r
    }

    #[test]
    fn in_flight_requests_hold_a_shared_prefix_once() {
        // 8,000 shared tokens and ~100 private ones each: twelve such requests in flight hold
        // about 9,500 tokens of a 12,000-token cache, so they all stay with their prefix (a
        // count per request, 12 x 8,100, would have spread them). Once answered, the same
        // burst fits again: nothing leaks.
        let mut r = router_with_kv_capacity(4, 12_000);
        let system = "a long shared system prompt ".repeat(1_150);
        let holder = r.route(&request(&system), 0, 1).response.endpoints[0].clone();
        for round in 0..2u64 {
            let mut ids = Vec::new();
            for k in 0..12u64 {
                let mut req = request(&format!("{system} question {k} {}", "why ".repeat(100)));
                req.max_output_tokens = Some(16);
                let now = 5_000 + round * 100_000 + k * 2_000;
                let d = r.route(&req, now, k);
                assert_eq!(
                    d.response.endpoints[0], holder,
                    "round {round}, request {k}"
                );
                ids.push(d.response.decision_id);
            }
            for decision_id in ids {
                r.feedback(
                    &Outcome {
                        decision_id,
                        ..Default::default()
                    },
                    50_000 + round * 100_000,
                );
            }
        }
    }

    #[test]
    fn a_burst_sharing_a_prefix_spreads_once_the_holders_kv_would_overflow() {
        // Each replica holds 12,000 KV tokens; the requests share a 525-token system prompt
        // cached on one replica and add about 2,000 tokens each. The scrape shows no load (it
        // lags the burst), and each prefill has drained before the next arrives: only the
        // router's own in-flight KV tells it that a sixth concurrent request cannot fit there
        // (525 + 6 x 2,000 > 12,000).
        let mut r = router_with_kv_capacity(4, 12_000);
        let system = "shared system prompt ".repeat(100);
        let holder = r.route(&request(&system), 0, 1).response.endpoints[0].clone();
        let mut placed = Vec::new();
        for k in 0..8u64 {
            let prompt = format!("{system} conversation {k} {}", "words ".repeat(1_300));
            let mut req = request(&prompt);
            req.max_output_tokens = Some(16);
            let now = 1_000 + k * 1_000;
            placed.push(r.route(&req, now, k).response.endpoints[0].clone());
        }
        let on_holder = placed.iter().filter(|e| **e == holder).count();
        assert!(on_holder >= 2, "the prefix still attracts: {placed:?}");
        assert!(
            on_holder <= 5,
            "at most what fits in 12,000 tokens: {placed:?}"
        );
    }

    // A request the engine refuses at once (a 400 for a prompt too long for the model) never
    // prefilled: its outcome takes its prefill back out of the endpoint's backlog, so one bad
    // request does not price the replica out for as long as a million tokens take to drain.
    #[test]
    fn a_refused_request_refunds_its_prefill_backlog() {
        let mut r = router(1);
        r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
        let huge = request(&"w".repeat(3_900_000));
        let d = r.route(&huge, 1, 1);
        let backlog = |r: &Router| r.endpoints(1)[0].backlog_tokens;
        assert!(backlog(&r) > 900_000.0, "{}", backlog(&r));
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                endpoint: "10.0.0.0:8000".into(),
                status: 400,
                ..Outcome::default()
            },
            1,
        );
        assert_eq!(backlog(&r), 0.0);
        // A served request's prefill drains with time as before: its outcome refunds nothing.
        let served = r.route(&request(&"w ".repeat(4_000)), 2, 1);
        let before = backlog(&r);
        r.feedback(
            &Outcome {
                decision_id: served.response.decision_id,
                endpoint: "10.0.0.0:8000".into(),
                status: 200,
                completion_tokens: Some(8),
                ..Outcome::default()
            },
            2,
        );
        assert_eq!(backlog(&r), before);
    }

    // Issue #18: an endpoint whose engine delivers none of the hits the index believes it holds
    // (prefix caching off, another chat template, a salt left out of the hash) goes load-only:
    // its prefix is no longer credited. When it delivers again, it is trusted again.
    #[test]
    fn an_endpoint_that_delivers_no_believed_hit_goes_load_only_until_it_does() {
        let mut r = router(1);
        r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
        let prompt = "the same long prompt ".repeat(200);
        let serve = |r: &mut Router, now: u64, delivered: Option<u32>| {
            let d = r.route(&request(&prompt), now, 1);
            r.feedback(
                &Outcome {
                    decision_id: d.response.decision_id,
                    endpoint: "10.0.0.0:8000".into(),
                    status: 200,
                    prompt_tokens: Some(1_000),
                    cached_tokens: Some(delivered.unwrap_or(d.response.cached_tokens)),
                    completion_tokens: Some(4),
                    ..Outcome::default()
                },
                now,
            );
            d.response
        };
        let first = serve(&mut r, 1, Some(0));
        assert_eq!(first.cached_tokens, 0, "a cold index believes nothing");
        let believed = serve(&mut r, 2, Some(0));
        assert_eq!(believed.reason, RouteReason::Prefix);
        assert!(believed.cached_tokens > 64, "{believed:?}");
        for now in 3..9 {
            serve(&mut r, now, Some(0));
        }
        assert!(
            r.take_state_changes().is_empty(),
            "7 outcomes are not enough"
        );
        serve(&mut r, 9, Some(0));
        let changes = r.take_state_changes();
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert_eq!(changes[0].0, "10.0.0.0:8000");
        assert_eq!(changes[0].1.to, RoutingState::LoadOnly);
        let view = &r.endpoints(9)[0];
        assert_eq!(view.routing_state, RoutingState::LoadOnly);
        assert_eq!(view.state_reason, Some(StateReason::Mismatch));
        // No credit now: the same prompt is routed by load, and costs its whole prefill.
        let unrewarded = serve(&mut r, 10, Some(0));
        assert_eq!(unrewarded.cached_tokens, 0);
        assert_eq!(unrewarded.reason, RouteReason::Load);
        // The engine serves its cache again: the belief is checked all along, and trusted
        // again once it is met.
        for now in 11..60 {
            serve(&mut r, now, Some(1_000));
        }
        let back = r.take_state_changes();
        assert_eq!(back.len(), 1, "{back:?}");
        assert_eq!(back[0].1.to, RoutingState::Exact);
        assert_eq!(r.endpoints(60)[0].routing_state, RoutingState::Exact);
        assert_eq!(serve(&mut r, 61, None).reason, RouteReason::Prefix);
        assert_eq!(r.stats().state_changes, 2);
    }

    // Issue #18: an endpoint with a KV-event stream that is not live is `degraded` (precise
    // requests are scored from the approximate index there), named so, and back to exact when
    // the stream is.
    #[test]
    fn an_endpoint_whose_event_stream_is_down_is_degraded_until_it_is_live() {
        let mut r = router(2);
        let state = |r: &Router, i: usize| {
            let e = &r.endpoints(0)[i];
            (e.routing_state, e.state_reason)
        };
        assert_eq!(
            state(&r, 0),
            (RoutingState::Exact, None),
            "no stream: exact"
        );
        r.set_event_stream("10.0.0.0:8000", false);
        assert_eq!(
            state(&r, 0),
            (RoutingState::Degraded, Some(StateReason::NoKvEvents))
        );
        assert_eq!(state(&r, 1), (RoutingState::Exact, None));
        r.set_event_stream("10.0.0.0:8000", true);
        assert_eq!(state(&r, 0), (RoutingState::Exact, None));
        let changes: Vec<_> = r
            .take_state_changes()
            .into_iter()
            .map(|(a, c)| (a, c.from, c.to, c.reason))
            .collect();
        assert_eq!(
            changes,
            [
                (
                    "10.0.0.0:8000".to_string(),
                    RoutingState::Exact,
                    RoutingState::Degraded,
                    StateReason::NoKvEvents
                ),
                (
                    "10.0.0.0:8000".to_string(),
                    RoutingState::Degraded,
                    RoutingState::Exact,
                    StateReason::NoKvEvents
                ),
            ]
        );
        // Reported again as it is: no change.
        r.set_event_stream("10.0.0.0:8000", true);
        assert!(r.take_state_changes().is_empty());
    }

    // Issue #18: an engine whose blocks are not the configured size publishes KV events for
    // blocks the router never hashes. It is `degraded` (reason block_size), its precise
    // requests are scored from the approximate index, and it is exact again once the sizes
    // match; each change is noted once.
    #[test]
    fn an_engine_with_another_block_size_is_degraded_until_its_blocks_match() {
        let mut r = router(2);
        let (a, b) = ("10.0.0.0:8000", "10.0.0.1:8000");
        let block_tokens = r.config().precise.block_tokens as u32;
        let scraped = |block_size| EndpointMetrics {
            block_size: Some(block_size),
            ..EndpointMetrics::default()
        };
        let state = first_state;
        for e in [a, b] {
            r.set_event_stream(e, true);
            r.update_metrics(e, scraped(block_tokens), 0);
        }
        assert_eq!(state(&r), (RoutingState::Exact, None));
        let scored_precisely = |r: &mut Router, now| scored_precisely(r, a, now);
        assert_eq!(scored_precisely(&mut r, 1), Some(true));
        r.update_metrics(a, scraped(2 * block_tokens), 2);
        r.update_metrics(a, scraped(2 * block_tokens), 3);
        assert_degraded_approximate(&mut r, a, StateReason::BlockSize, 4);
        r.update_metrics(a, scraped(block_tokens), 5);
        assert_exact_precise(&mut r, a, 6);
        assert_degraded_and_back(
            &mut r,
            a,
            StateReason::BlockSize,
            "one change each way, none for the repeated scrape",
        );
        // A stream going down while the blocks differ changes nothing the state says.
        r.update_metrics(a, scraped(2 * block_tokens), 7);
        r.set_event_stream(a, false);
        assert_eq!(
            state(&r),
            (RoutingState::Degraded, Some(StateReason::BlockSize))
        );
        assert_eq!(r.take_state_changes().len(), 1);
    }

    /// A router over `endpoints`, each with a live KV-event stream.
    fn router_with_live_streams(config: RouterConfig, endpoints: &[&str]) -> Router {
        let mut r = Router::new(config, 1);
        for e in endpoints {
            r.upsert_endpoint(e).unwrap();
            r.set_event_stream(e, true);
        }
        r
    }

    /// Endpoint `a`'s routing state and its reason.
    fn state_of(r: &Router, a: &str) -> (RoutingState, Option<StateReason>) {
        let views = r.endpoints(0);
        let v = views
            .iter()
            .find(|v| v.address == a)
            .expect("a known endpoint");
        (v.routing_state, v.state_reason)
    }

    /// Asserts that `a` is degraded for `reason` and that a precise request routed at `now`
    /// scores it from the approximate index.
    fn assert_degraded_approximate(r: &mut Router, a: &str, reason: StateReason, now: u64) {
        assert_eq!(state_of(r, a), (RoutingState::Degraded, Some(reason)));
        assert_eq!(
            scored_precisely(r, a, now),
            Some(false),
            "approximate while {reason:?}"
        );
    }

    /// Asserts that `a` is exact and that a precise request routed at `now` scores it from its
    /// event index.
    fn assert_exact_precise(r: &mut Router, a: &str, now: u64) {
        assert_eq!(state_of(r, a), (RoutingState::Exact, None));
        assert_eq!(scored_precisely(r, a, now), Some(true));
    }

    /// Whether a precise request of three token blocks routed at `now` scored `endpoint` from
    /// its event index (it does only while that index is trusted); `None` when `endpoint` was
    /// no candidate.
    fn scored_precisely(r: &mut Router, endpoint: &str, now: u64) -> Option<bool> {
        let probe = RouteRequest {
            model: "m".into(),
            token_block_hashes: vec![1, 2, 3],
            prompt_tokens: 3 * r.config().precise.block_tokens as u32 + 1,
            ..Default::default()
        };
        let d = r.route(&probe, now, 1);
        let c = d
            .candidates
            .iter()
            .find(|c| c.endpoint.as_str() == endpoint);
        c.map(|c| c.precise)
    }

    // Issue #18: a KV-event stream that lost batches no replay could fill (the caller dropped
    // the endpoint's precise state) is `degraded` (reason kv_event_gap) and scored from the
    // approximate index until `clean_batches_after_gap` batches in a row arrive in sequence;
    // a loss meanwhile starts the count again, and a new session forgets the gap.
    #[test]
    fn a_stream_that_lost_batches_is_degraded_until_it_runs_clean() {
        let mut config = RouterConfig::default();
        config.self_check.clean_batches_after_gap = 4;
        let (a, b) = ("10.0.0.0:8000", "10.0.0.1:8000");
        let mut r = router_with_live_streams(config, &[a, b]);
        let state = first_state;
        let scored_precisely = |r: &mut Router, now| scored_precisely(r, a, now);
        assert_eq!(scored_precisely(&mut r, 1), Some(true));
        r.note_event_batch_in_sequence(a);
        assert_eq!(state(&r), (RoutingState::Exact, None), "no gap: exact");

        r.note_event_gap(a);
        assert_degraded_approximate(&mut r, a, StateReason::KvEventGap, 2);
        for _ in 0..3 {
            r.note_event_batch_in_sequence(a);
        }
        r.note_event_gap(a);
        for _ in 0..3 {
            r.note_event_batch_in_sequence(a);
        }
        assert_eq!(
            state(&r),
            (RoutingState::Degraded, Some(StateReason::KvEventGap)),
            "still losing batches: the count started again"
        );
        r.note_event_batch_in_sequence(a);
        assert_exact_precise(&mut r, a, 3);
        assert_degraded_and_back(
            &mut r,
            a,
            StateReason::KvEventGap,
            "one change each way, none for the second loss",
        );

        // A session that ends and a new one that rebuilt the history: the old gap is gone.
        r.note_event_gap(a);
        r.set_event_stream(a, false);
        r.set_event_stream(a, true);
        assert_eq!(state(&r), (RoutingState::Exact, None));
    }

    // Issue #18: an endpoint whose KV events store only blocks of KV-cache groups the index
    // cannot use (a hybrid model's other groups) is `degraded` (reason event_groups) after
    // `unusable_group_batches` such batches in a row, and scored from the approximate index;
    // batches that store nothing say nothing, and one usable store ends it.
    #[test]
    fn events_of_unusable_kv_groups_only_degrade_until_a_usable_store() {
        let mut config = RouterConfig::default();
        config.self_check.unusable_group_batches = 3;
        let a = "10.0.0.0:8000";
        let mut r = router_with_live_streams(config, &[a]);
        let state = first_state;
        // A healthy hybrid stream: both kinds in one batch, or other groups alone now and then.
        r.note_event_groups(a, 1, 1);
        r.note_event_groups(a, 0, 1);
        r.note_event_groups(a, 0, 0);
        r.note_event_groups(a, 0, 1);
        assert_eq!(state(&r), (RoutingState::Exact, None));
        // Three batches in a row stored only other groups.
        r.note_event_groups(a, 0, 1);
        assert_degraded_approximate(&mut r, a, StateReason::EventGroups, 1);
        r.note_event_groups(a, 2, 0);
        assert_exact_precise(&mut r, a, 2);
        assert_degraded_and_back(&mut r, a, StateReason::EventGroups, "one change each way");
    }

    // Issue #18: an endpoint whose engine counts the router's canonical bytes in clearly more
    // tokens than the rest of its pool (another tokeniser behind the same model name) is
    // `degraded` (reason bytes_per_token) and scored from the approximate index; a shift of
    // the whole traffic moves every endpoint alike and says nothing; once it counts as the
    // others do again, it is trusted again.
    #[test]
    fn an_endpoint_that_counts_other_tokens_than_its_pool_is_degraded_until_it_agrees() {
        let endpoints = [
            "10.0.0.0:8000",
            "10.0.0.1:8000",
            "10.0.0.2:8000",
            "10.0.0.3:8000",
        ];
        let odd = endpoints[3];
        let mut r = router_with_live_streams(RouterConfig::default(), &endpoints);
        let mut now = 0;
        // Serves `n` requests wherever the router sends them; endpoint e counts a request's
        // bytes in `bytes / per_token(e)` tokens.
        let mut serve = |r: &mut Router, n: u64, per_token: &dyn Fn(&str) -> f64| {
            for i in 0..n {
                now += 1_000;
                let text = format!("request {now} {}", "words ".repeat(400));
                let d = r.route(&request(&text), now, i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                let chosen = d.candidates[0].endpoint.to_string();
                let tokens = (text.len() as f64 / per_token(&chosen)) as u32;
                r.feedback(
                    &Outcome {
                        decision_id: d.response.decision_id,
                        endpoint: chosen,
                        status: 200,
                        prompt_tokens: Some(tokens),
                        cached_tokens: Some(0),
                        ..Default::default()
                    },
                    now + 10,
                );
            }
            now
        };
        // English prose everywhere, then code (fewer bytes a token) everywhere: no verdict.
        serve(&mut r, 200, &|_| 4.0);
        serve(&mut r, 200, &|_| 2.5);
        assert!(
            r.take_state_changes().is_empty(),
            "a traffic shift is no drift"
        );
        // One endpoint's engine counts half again as many tokens.
        let now = serve(&mut r, 400, &|e| if e == odd { 1.6 } else { 2.5 });
        assert_degraded_approximate(&mut r, odd, StateReason::BytesPerToken, now + 1);
        for e in &endpoints[..3] {
            assert_eq!(state_of(&r, e), (RoutingState::Exact, None), "{e}");
        }
        // It counts as the others do again: trusted again.
        serve(&mut r, 800, &|_| 2.5);
        assert_eq!(state_of(&r, odd), (RoutingState::Exact, None));
        assert_degraded_and_back(
            &mut r,
            odd,
            StateReason::BytesPerToken,
            "one change each way",
        );
    }

    // The ceiling is one cache as large as the fleet's KV: the window follows the endpoints'
    // scraped capacity (bounded), so a prompt the fleet's caches could not all hold is not
    // counted available again.
    #[test]
    fn the_reuse_window_is_as_large_as_the_fleets_kv() {
        let mut r = router(2);
        assert_eq!(r.reuse_window_blocks(), crate::reuse::DEFAULT_WINDOW_BLOCKS);
        let per_block = r.tokens_per_block();
        let with_capacity = |blocks: f64| EndpointMetrics {
            capacity_tokens: Some((blocks * per_block) as u64),
            ..EndpointMetrics::default()
        };
        // Two endpoints of 12 blocks each: a window of 24.
        for i in 0..2 {
            r.update_metrics(&format!("10.0.0.{i}:8000"), with_capacity(12.0), 0);
        }
        assert_eq!(r.reuse_window_blocks(), 24);
        // Two prompts of 16 blocks each: the second pushes half the first out of the window.
        let (a, b) = ("a".repeat(16 * 256), "b".repeat(16 * 256));
        serve_reported(&mut r, &a, 1, |_| 0);
        serve_reported(&mut r, &b, 2, |_| 0);
        let before = r.fleet_reuse().available_tokens;
        serve_reported(&mut r, &a, 3, |_| 0);
        let again = r.fleet_reuse().available_tokens - before;
        assert_eq!(again, 0, "its first blocks were the least recently seen");
        // A larger fleet remembers both.
        r.update_metrics("10.0.0.0:8000", with_capacity(100.0), 4);
        assert_eq!(r.reuse_window_blocks(), 112);
        serve_reported(&mut r, &b, 5, |_| 0);
        serve_reported(&mut r, &a, 6, |_| 0);
        let seen = r.fleet_reuse().available_tokens - before;
        assert!(seen > 0, "{seen}");
        r.remove_endpoint("10.0.0.0:8000");
        assert_eq!(r.reuse_window_blocks(), 12);
    }

    /// Routes `text` at `now` and reports it served by its first endpoint, with as many prompt
    /// tokens as the router counted (4 bytes a token), of which `delivered(response)` from cache.
    fn serve_reported(
        r: &mut Router,
        text: &str,
        now: u64,
        delivered: impl Fn(&RouteResponse) -> u32,
    ) -> RouteResponse {
        let d = r.route(&request(text), now, 1);
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                endpoint: d.response.endpoints[0].clone(),
                status: 200,
                prompt_tokens: Some(text.len() as u32 / 4),
                cached_tokens: Some(delivered(&d.response)),
                completion_tokens: Some(4),
                ..Outcome::default()
            },
            now,
        );
        d.response
    }

    // Issue #18's four numbers: the reuse the traffic offered (a prompt seen before, wherever it
    // went), what the router aimed for, what the engine delivered, and the gap by reason.
    #[test]
    fn the_fleet_numbers_split_the_reuse_offered_by_what_became_of_it() {
        let mut r = router(2);
        for i in 0..2 {
            r.update_metrics(&format!("10.0.0.{i}:8000"), EndpointMetrics::default(), 0);
        }
        let prompt = "the same long prompt ".repeat(200);
        let first = serve_reported(&mut r, &prompt, 1, |_| 0);
        let cold = r.fleet_reuse();
        assert_eq!(
            (cold.outcomes, cold.available_tokens),
            (1, 0),
            "nothing seen before"
        );
        assert_eq!(cold.gap_tokens.total(), 0);

        // The second turn goes to the holder, which delivers half of what was aimed for: the
        // rest of the hit is lost to eviction.
        let second = serve_reported(&mut r, &prompt, 10_000, |d| d.cached_tokens / 2);
        assert_eq!(second.endpoints[0], first.endpoints[0]);
        assert_eq!(second.reason, RouteReason::Prefix);
        let warm = r.fleet_reuse();
        let available = warm.available_tokens;
        assert!(available > 0);
        let delivered = u64::from(second.cached_tokens / 2);
        assert_eq!(warm.delivered_tokens, delivered);
        assert_eq!(warm.aimed_tokens, u64::from(second.cached_tokens));
        assert_eq!(warm.gap_tokens.eviction, available - delivered);
        assert_eq!(warm.gap_tokens.total(), available - delivered);

        // The holder is swamped (a queue the router did not send): the third turn spills to the
        // other endpoint, and everything the window offered is lost to load.
        let busy = EndpointMetrics {
            waiting: 400,
            running: 64,
            ..EndpointMetrics::default()
        };
        r.update_metrics(&first.endpoints[0], busy, 20_000);
        let third = serve_reported(&mut r, &prompt, 20_000, |_| 0);
        assert_ne!(third.endpoints[0], first.endpoints[0]);
        let spilled = r.fleet_reuse();
        let offered = spilled.available_tokens - warm.available_tokens;
        assert_eq!(offered, available, "the same prompt offers the same reuse");
        assert_eq!(spilled.gap_tokens.load_spill, offered);
        assert_eq!(
            spilled.gap_tokens.total(),
            spilled.available_tokens - spilled.delivered_tokens
        );

        // Per pool and per endpoint, the same outcomes.
        let pools = r.pool_reuse();
        assert_eq!(pools.len(), 1);
        assert_eq!((pools[0].0.as_str(), pools[0].1), ("m", spilled));
        let mut by_endpoint = ReuseTotals::default();
        for e in r.endpoints(20_000) {
            by_endpoint.merge(&e.reuse);
        }
        assert_eq!(by_endpoint, spilled);

        // Where the second turn's belief and the engine parted: at the first block it did not
        // serve. The spilled turn believed nothing where it went, so it is not listed.
        let worst = r.mismatches();
        assert_eq!(worst.len(), 1, "{worst:?}");
        let m = &worst[0];
        assert_eq!(m.decision_id, second.decision_id);
        assert_eq!(m.delivered_tokens as u64, delivered);
        assert_eq!(m.parting_block, m.delivered_tokens / m.block_tokens);
        assert!(m.believed_blocks > m.parting_block, "{m:?}");
        assert_eq!(m.model, "m");
    }

    #[test]
    fn a_forged_prompt_size_prices_only_what_its_hashes_cover() {
        // One call claiming 4 GB of prompt with two block hashes: before the bound it put
        // a billion tokens in the replica's backlog (days of prefill).
        let mut r = router(1);
        r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
        let mut forged = request(&"w".repeat(600));
        forged.prompt_bytes = u64::from(u32::MAX);
        forged.prompt_tokens = u32::MAX;
        forged.max_output_tokens = Some(u32::MAX);
        r.route(&forged, 1, 1);
        let view = &r.endpoints(1)[0];
        // Two whole blocks and one partial: 768 bytes, 192 tokens at 4 bytes a token.
        assert!(view.backlog_tokens <= 192.0, "{}", view.backlog_tokens);
        // A precise request's tokens are bounded by its engine blocks the same way.
        let mut precise = request("x");
        precise.token_block_hashes = vec![1, 2];
        precise.prompt_tokens = u32::MAX;
        r.route(&precise, 2, 1);
        let view = &r.endpoints(2)[0];
        assert!(
            view.backlog_tokens <= 192.0 + 48.0,
            "{}",
            view.backlog_tokens
        );
    }

    #[test]
    fn reported_times_cannot_exceed_the_time_since_the_decision() {
        let mut r = router(1);
        r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
        let d = r.route(&request("hello"), 1_000, 1);
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                endpoint: "10.0.0.0:8000".into(),
                status: 200,
                ttfb_ms: Some(u64::MAX / 2),
                total_ms: u64::MAX / 2,
                completion_tokens: Some(4),
                ..Outcome::default()
            },
            1_050,
        );
        // Read as 50 ms, the time since the decision.
        assert_eq!(r.stats().clamped_outcomes, 1);
    }

    #[test]
    fn a_withdrawn_call_holds_no_load_whenever_it_is_decided() {
        let mut r = router(1);
        r.update_metrics("10.0.0.0:8000", EndpointMetrics::default(), 0);
        let load = |r: &Router| {
            let v = &r.endpoints(5)[0];
            (v.inflight, v.backlog_tokens)
        };
        // Withdrawn after its decision: released at once, and the outcome says where.
        let mut late = request(&"a ".repeat(2_000));
        late.call_id = Some(11);
        let d = r.route(&late, 1, 1);
        assert_eq!(load(&r).0, 1);
        let released = r.withdraw(11, 2).expect("the decision is live");
        assert_eq!(released.decision_id, d.response.decision_id);
        assert_eq!(released.endpoint, "10.0.0.0:8000");
        assert_eq!(load(&r), (0, 0.0));
        // Withdrawn while still queued (a stalled control plane): never taken.
        assert!(r.withdraw(12, 3).is_none());
        let mut queued = request(&"b ".repeat(2_000));
        queued.call_id = Some(12);
        let d = r.route(&queued, 4, 1);
        assert_eq!(d.response.reason, RouteReason::Withdrawn);
        assert!(d.response.endpoints.is_empty());
        assert_eq!(load(&r), (0, 0.0));
        // The tombstone is used up: the same id later is an ordinary call.
        assert!(!r.route(&queued, 5, 1).response.endpoints.is_empty());
        assert_eq!(r.stats().withdrawn, 2);
    }

    #[test]
    fn a_routed_miss_evicts_the_oldest_history_from_the_approximate_index() {
        // One replica of 12,000 KV tokens. A 3,000-token history is cached, then three other
        // 3,000-token prompts fill the cache behind it. A 6,000-token miss routed there will
        // make the engine evict its least recently used blocks: the history, which the index
        // stops promising at once. Touched last instead, the history is safe.
        let mut r = router_with_kv_capacity(1, 12_000);
        let text = |k: u64| format!("conversation {k} ").repeat(800);
        let answer = |r: &mut Router, d: Decision| {
            r.feedback(
                &Outcome {
                    decision_id: d.response.decision_id,
                    ..Default::default()
                },
                0,
            )
        };
        let ask = |r: &mut Router, prompt: &str, now: u64| {
            let mut req = request(prompt);
            req.max_output_tokens = Some(16);
            r.route(&req, now, 1)
        };
        for (k, now) in [(0, 1_000), (1, 2_000), (2, 3_000), (3, 4_000)] {
            let d = ask(&mut r, &text(k), now);
            answer(&mut r, d);
        }
        let follow_up = format!("{} and then?", text(0));
        let idle = ask(&mut r, &follow_up, 10_000);
        assert!(idle.candidates[0].cached_tokens > 2_500);
        answer(&mut r, idle);

        // The follow-up touched the history: ages it from the newest end again.
        for (k, now) in [(1, 11_000), (2, 12_000), (3, 13_000)] {
            let d = ask(&mut r, &text(k), now);
            answer(&mut r, d);
        }
        let miss = ask(&mut r, &"a long new document ".repeat(1_200), 20_000);
        let queued = ask(&mut r, &follow_up, 20_000);
        assert_eq!(queued.candidates[0].cached_tokens, 0, "{queued:?}");
        answer(&mut r, queued);
        answer(&mut r, miss);

        // Touched after everything else, it is the last to go.
        let refresh = ask(&mut r, &follow_up, 30_000);
        answer(&mut r, refresh);
        let _miss = ask(&mut r, &"another new document ".repeat(1_000), 40_000);
        let queued = ask(&mut r, &follow_up, 40_000);
        assert!(queued.candidates[0].cached_tokens > 2_500, "{queued:?}");
    }

    #[test]
    fn a_learned_ratio_counts_the_index_in_the_engines_tokens() {
        let mut r = Router::new(
            RouterConfig {
                learn_bytes_per_token: true,
                ..RouterConfig::default()
            },
            1,
        );
        r.upsert_endpoint("10.0.0.0:8000").unwrap();
        // Text at 8 bytes a token: 25,600 bytes are 100 blocks and 3,200 tokens.
        let text = "ab".repeat(12_800);
        let usage = |r: &mut Router, decision: &Decision, status: u16, prompt_tokens: u32| {
            let outcome = Outcome {
                decision_id: decision.response.decision_id,
                status,
                prompt_tokens: Some(prompt_tokens),
                ..Default::default()
            };
            r.feedback(&outcome, 1_000);
        };
        let first = r.route(&request(&text), 0, 1);
        assert!((r.bytes_per_token() - 4.0).abs() < 1e-9);
        usage(&mut r, &first, 200, 3_200);
        assert!((r.bytes_per_token() - 8.0).abs() < 1e-9);
        assert!((r.tokens_per_block() - 32.0).abs() < 1e-9);
        // The repeat is counted in the engine's tokens, not at the filter's 4 bytes a token.
        let again = r.route(&request(&text), 60_000, 2);
        let c = &again.candidates[0];
        assert_eq!(c.cached_tokens + c.uncached_tokens, 3_200, "{c:?}");
        assert!(c.cached_tokens >= 3_100, "{c:?}");
        // A failed response teaches nothing.
        usage(&mut r, &again, 500, 100);
        assert!((r.bytes_per_token() - 8.0).abs() < 1e-9);
    }

    #[test]
    fn unreachable_is_skipped_and_none_left_is_empty() {
        let mut r = router(1);
        r.mark_unreachable("10.0.0.0:8000");
        let d = r.route(&request("abc"), 0, 1);
        assert!(d.response.endpoints.is_empty());
        assert_eq!(r.stats().no_endpoint, 1);
    }

    #[test]
    fn feedback_releases_and_expiry_cleans() {
        let mut r = router(2);
        let d = r.route(&request(&"y".repeat(600)), 0, 1);
        assert_eq!(r.inflight_len(), 1);
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                cached_tokens: Some(0),
                ..Default::default()
            },
            5,
        );
        assert_eq!(r.inflight_len(), 0);
        r.route(&request(&"z".repeat(600)), 0, 1);
        r.expire(10_000_000);
        assert_eq!(r.inflight_len(), 0);
        assert!(r.endpoints(0).iter().all(|e| e.inflight == 0));
    }

    #[test]
    fn expiry_queue_stays_proportional_to_what_is_in_flight() {
        let mut r = router(2);
        let ttl = r.config().inflight_ttl_ms;
        for t in 0..10_000u64 {
            let d = r.route(&request(&"w".repeat(300)), t, t);
            if t % 2 == 0 {
                r.feedback(
                    &Outcome {
                        decision_id: d.response.decision_id,
                        ..Default::default()
                    },
                    t,
                );
            }
        }
        assert_eq!(r.inflight_len(), 5_000);
        assert!(r.inflight_order.len() <= 2 * r.inflight_len() + 1024);
        // Half of them were never answered: they expire once their TTL has passed, no earlier.
        r.expire(9_999 + ttl - 5_000);
        assert!(r.inflight_len() > 0 && r.inflight_len() < 5_000);
        r.expire(10_000 + ttl);
        assert_eq!(r.inflight_len(), 0);
        assert_eq!(r.stats().expired_inflight, 5_000);
        assert!(r.endpoints(0).iter().all(|e| e.inflight == 0));
    }

    #[test]
    fn guard_stops_hot_spotting() {
        let mut r = router(2);
        let shared = "same prefix ".repeat(200);
        let mut counts = HashMap::new();
        for i in 0..64 {
            let d = r.route(&request(&format!("{shared}{i}")), 0, i);
            *counts.entry(d.response.endpoints[0].clone()).or_insert(0) += 1;
        }
        assert_eq!(counts.len(), 2, "{counts:?}");
    }

    #[test]
    fn outcomes_are_credited_to_the_endpoint_that_served() {
        let mut r = router(2);
        let d = r.route(&request(&"w".repeat(600)), 0, 1);
        let chosen = d.response.endpoints[0].clone();
        let other = d.response.endpoints[1].clone();
        let outcome = |endpoint: &str, id| Outcome {
            decision_id: id,
            endpoint: endpoint.into(),
            prompt_tokens: Some(150),
            cached_tokens: Some(100),
            ..Default::default()
        };
        r.feedback(&outcome(&chosen, d.response.decision_id), 1);
        let d2 = r.route(&request(&"v".repeat(600)), 0, 2);
        let fallback = if d2.response.endpoints[0] == chosen {
            other
        } else {
            chosen.clone()
        };
        r.feedback(&outcome(&fallback, d2.response.decision_id), 2);
        let views = r.endpoints(2);
        let served = |a: &str| views.iter().find(|e| e.address == a).unwrap().served;
        let total: u64 = views.iter().map(|e| e.served.outcomes).sum();
        assert_eq!(total, 2);
        assert_eq!(served(&fallback).fallbacks, 1);
        assert_eq!(r.stats().fallbacks, 1);
        assert_eq!(
            (served(&chosen).prompt_tokens, served(&chosen).cached_tokens),
            if fallback == chosen {
                (300, 200)
            } else {
                (150, 100)
            }
        );
        assert_eq!(r.stats().precise_decisions, 0);
    }

    #[test]
    fn endpoint_limit_is_an_error() {
        let mut r = router(0);
        for i in 0..MAX_ENDPOINTS {
            r.upsert_endpoint(&format!("e{i}")).unwrap();
        }
        assert_eq!(
            r.upsert_endpoint("one-more"),
            Err(RouterError::TooManyEndpoints)
        );
        r.remove_endpoint("e3");
        assert!(r.upsert_endpoint("one-more").is_ok());
    }
}

#[cfg(test)]
mod precise_tests {
    use super::*;
    use crate::hash::{block_hashes, model_seed, token_block_hashes};
    use crate::precise::Medium;

    fn router() -> Router {
        let mut r = Router::new(RouterConfig::default(), 1);
        for a in ["a:1", "b:1"] {
            r.upsert_endpoint(a).unwrap();
            r.set_event_stream(a, true);
        }
        r
    }

    fn stored(tokens: &[u32], medium: Medium) -> KvEvent {
        stored_from(1000, tokens, medium)
    }

    /// A store of `tokens` at the prompt's start, named by engine hashes from `first_hash` on.
    fn stored_from(first_hash: u64, tokens: &[u32], medium: Medium) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: (0..tokens.len() as u64 / 16)
                .map(|i| first_hash + i)
                .collect(),
            parent_block_hash: None,
            token_ids: tokens.to_vec(),
            block_size: 16,
            lora_name: None,
            cache_salt: None,
            medium,
        }
    }

    /// A router whose `endpoint` reported `tokens` stored in `medium`.
    fn router_holding(endpoint: &str, tokens: &[u32], medium: Medium) -> Router {
        let mut r = router();
        r.apply_kv_event(endpoint, "m", &stored(tokens, medium), 0)
            .unwrap();
        r
    }

    fn request(tokens: &[u32]) -> RouteRequest {
        RouteRequest {
            model: "m".into(),
            prompt_tokens: tokens.len() as u32,
            token_block_hashes: token_block_hashes(model_seed("m"), tokens, 16),
            ..Default::default()
        }
    }

    #[test]
    fn events_decide_where_the_prefix_is() {
        let tokens: Vec<u32> = (0..321).collect();
        let mut r = router_holding("b:1", &tokens[..320], Medium::Gpu);
        let d = r.route(&request(&tokens), 10, 3);
        assert_eq!(d.response.endpoints[0], "b:1");
        let best = &d.candidates[0];
        assert!(best.precise);
        assert_eq!(best.cached_blocks, 20);
        assert_eq!(best.cached_tokens, 320);
        assert_eq!(r.stats().precise_decisions, 1);
    }

    #[test]
    fn the_response_predicts_cached_tokens_in_one_unit_whichever_index_scored() {
        // Precise: 20 engine blocks of 16 tokens on GPU.
        let tokens: Vec<u32> = (0..321).collect();
        let mut r = router_holding("b:1", &tokens[..320], Medium::Gpu);
        let precise = r.route(&request(&tokens), 10, 3);
        assert_eq!(
            (
                precise.response.cached_blocks,
                precise.response.cached_tokens
            ),
            (20, 320)
        );
        // Approximate: the same 320 tokens are 5 hash blocks of 256 bytes at 4 bytes a token,
        // and count as the same 20 engine blocks.
        let mut r = Router::new(RouterConfig::default(), 1);
        r.upsert_endpoint("a:1").unwrap();
        let text = "t".repeat(256 * 5);
        let hashes = block_hashes(model_seed("m"), text.as_bytes(), 256);
        r.index_mut().insert(EndpointId(0), &hashes, 0);
        let longer = format!("{text}{}", "u".repeat(64));
        let approximate = r.route(
            &RouteRequest {
                model: "m".into(),
                block_hashes: block_hashes(model_seed("m"), longer.as_bytes(), 256),
                prompt_bytes: longer.len() as u64,
                ..Default::default()
            },
            10,
            3,
        );
        assert!(!approximate.candidates[0].precise);
        assert_eq!(
            (
                approximate.response.cached_blocks,
                approximate.response.cached_tokens
            ),
            (20, 320)
        );
        for d in [&precise, &approximate] {
            assert_eq!(d.response.cached_tokens, d.candidates[0].cached_tokens);
        }
    }

    #[test]
    fn last_token_is_never_a_hit() {
        let tokens: Vec<u32> = (0..320).collect();
        let mut r = router_holding("a:1", &tokens, Medium::Gpu);
        let d = r.route(&request(&tokens), 10, 3);
        assert_eq!(
            d.candidates[0].cached_tokens, 304,
            "19 of 20 blocks: the 320th token is recomputed"
        );
    }

    #[test]
    fn down_stream_falls_back_to_approximate_and_drops_state() {
        let tokens: Vec<u32> = (0..160).collect();
        let mut r = router_holding("b:1", &tokens, Medium::Gpu);
        r.set_event_stream("b:1", false);
        let d = r.route(&request(&tokens), 10, 3);
        assert!(
            d.candidates
                .iter()
                .all(|c| !c.precise || c.cached_blocks == 0)
        );
        assert_eq!(
            r.endpoints(10)
                .iter()
                .map(|e| e.precise_blocks)
                .sum::<usize>(),
            0
        );
    }

    #[test]
    fn offload_counts_below_gpu_and_above_nothing() {
        let tokens: Vec<u32> = (0..161).collect();
        let mut r = router_holding("a:1", &tokens[..160], Medium::Cpu);
        let d = r.route(&request(&tokens), 10, 3);
        let a = d.candidates.iter().find(|c| c.endpoint == "a:1").unwrap();
        assert_eq!(a.cached_tokens, 80, "half credit for 160 offloaded tokens");
        assert_eq!(d.response.endpoints[0], "a:1");
    }

    #[test]
    fn speculative_entries_hold_a_burst_together_then_expire() {
        let mut r = router();
        let tokens: Vec<u32> = (0..800).collect();
        let first = r.route(&request(&tokens), 0, 1).response.endpoints[0].clone();
        // Much later than the backlog drain, still within the speculative TTL.
        let second = r.route(&request(&tokens), 1_500, 2);
        assert_eq!(second.response.endpoints[0], first);
        assert!(second.candidates[0].cached_blocks > 0);
        r.expire(10_000);
        let third = r.route(&request(&tokens), 10_000, 3);
        assert!(
            third
                .candidates
                .iter()
                .all(|c| c.cached_blocks == 0 || c.endpoint == first)
        );
    }

    #[test]
    fn a_queue_that_will_evict_a_history_takes_its_predicted_hit_away() {
        // One replica of 4,800 KV tokens, full: a 1,600-token history stored first, 3,200
        // other tokens after it. A 3,200-token miss queued ahead makes the engine evict its
        // least recently used blocks, the history among them, before the follow-up is
        // admitted; no event says so yet. Once a hit has refreshed the history, the same
        // queue evicts the other blocks first.
        let mut r = Router::new(RouterConfig::default(), 1);
        r.upsert_endpoint("a:1").unwrap();
        r.set_event_stream("a:1", true);
        let capacity = EndpointMetrics {
            capacity_tokens: Some(4_800),
            counters: None,
            ..EndpointMetrics::default()
        };
        r.update_metrics("a:1", capacity, 0);
        let history: Vec<u32> = (0..1_600).collect();
        let others: Vec<u32> = (50_000..53_200).collect();
        r.apply_kv_event("a:1", "m", &stored_from(1_000, &history, Medium::Gpu), 0)
            .unwrap();
        r.apply_kv_event("a:1", "m", &stored_from(5_000, &others, Medium::Gpu), 0)
            .unwrap();
        let follow_up: Vec<u32> = (0..1_700).collect();
        let miss: Vec<u32> = (90_000..93_200).collect();

        let queued_miss = r.route(&request(&miss), 100_000, 1);
        let queued = r.route(&request(&follow_up), 100_000, 2);
        assert_eq!(queued.candidates[0].cached_tokens, 0, "{queued:?}");
        let answer = |r: &mut Router, d: Decision| {
            let outcome = Outcome {
                decision_id: d.response.decision_id,
                ..Default::default()
            };
            r.feedback(&outcome, 200_000);
        };
        answer(&mut r, queued_miss);
        answer(&mut r, queued);

        // With no queue the history is all there; the hit refreshes it, so the 3,200 others
        // go first under the same queue.
        let idle = r.route(&request(&follow_up), 200_000, 3);
        assert_eq!(idle.candidates[0].cached_tokens, 1_600);
        answer(&mut r, idle);
        let _miss = r.route(&request(&miss), 300_000, 4);
        let queued = r.route(&request(&follow_up), 300_000, 5);
        assert_eq!(queued.candidates[0].cached_tokens, 1_600, "{queued:?}");
    }

    /// A store whose parent block was never seen.
    fn orphan_store() -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![7],
            parent_block_hash: Some(999),
            token_ids: (0..16).collect(),
            block_size: 16,
            lora_name: None,
            cache_salt: None,
            medium: Medium::Gpu,
        }
    }

    #[test]
    fn bad_event_drops_the_endpoint_state() {
        let tokens: Vec<u32> = (0..32).collect();
        let mut r = router_holding("a:1", &tokens, Medium::Gpu);
        let orphan = orphan_store();
        assert!(r.apply_kv_event("a:1", "m", &orphan, 0).is_err());
        assert_eq!(r.stats().kv_event_errors, 1);
        assert_eq!(r.endpoints(0)[0].precise_blocks, 0);
    }

    #[test]
    fn partial_history_skips_orphans_but_keeps_state() {
        let mut r = router();
        let tokens: Vec<u32> = (0..32).collect();
        r.apply_kv_event_partial("a:1", "m", &stored(&tokens, Medium::Gpu), 0)
            .unwrap();
        let orphan = orphan_store();
        assert_eq!(
            r.apply_kv_event_partial("a:1", "m", &orphan, 0),
            Err(ApplyError::UnknownParent(999))
        );
        assert_eq!(r.stats().kv_event_errors, 0);
        assert_eq!(r.endpoints(0)[0].precise_blocks, 2);
        let bad = KvEvent::BlockStored {
            block_hashes: vec![8],
            parent_block_hash: None,
            token_ids: (0..3).collect(),
            block_size: 16,
            lora_name: None,
            cache_salt: None,
            medium: Medium::Gpu,
        };
        assert!(r.apply_kv_event_partial("a:1", "m", &bad, 0).is_err());
        assert_eq!(
            r.endpoints(0)[0].precise_blocks,
            0,
            "other errors still drop"
        );
    }

    // Issue #18: an engine that hashes prompts otherwise than the router (a cache salt it
    // leaves out, another chat template, a LoRA adapter under another name) publishes blocks no
    // request of the router's matches, and neither side ever believes a hit there. Once the
    // first blocks of the requests it served are almost never in its event index, it is
    // `degraded` (reason hash_mismatch) and scored approximately; once they are again, exact.
    #[test]
    fn an_engine_whose_events_never_hold_the_routers_blocks_is_degraded_until_they_do() {
        let mut r = Router::new(RouterConfig::default(), 1);
        r.upsert_endpoint("a:1").unwrap();
        r.set_event_stream("a:1", true);
        let wait = r.config().self_check.confirm_after_ms;
        let samples = r.config().self_check.min_samples as u32;
        let state = super::tests::first_state;
        // Serves request `n` on a:1 at `now`; the engine publishes its prompt's blocks, as the
        // router tokenises them or (`agrees` false) as other tokens.
        let serve = |r: &mut Router, n: u32, now: u64, agrees: bool| {
            let tokens: Vec<u32> = (n * 1_000..n * 1_000 + 321).collect();
            let d = r.route(&request(&tokens), now, u64::from(n));
            assert_eq!(d.response.endpoints[0], "a:1");
            let published: Vec<u32> = if agrees {
                tokens[..320].to_vec()
            } else {
                tokens[..320].iter().map(|t| t + 500_000).collect()
            };
            let event = stored_from(u64::from(n) * 1_000, &published, Medium::Gpu);
            r.apply_kv_event("a:1", "m", &event, now).unwrap();
            r.feedback(
                &Outcome {
                    decision_id: d.response.decision_id,
                    endpoint: "a:1".into(),
                    status: 200,
                    cached_tokens: Some(0),
                    ..Outcome::default()
                },
                now + 1,
            );
            d.candidates[0].precise
        };
        assert!(serve(&mut r, 1, 10, false), "scored precisely");
        for n in 2..samples {
            serve(&mut r, n, 10, false);
        }
        r.expire(wait + 10);
        assert_eq!(
            state(&r),
            (RoutingState::Exact, None),
            "awaited, not looked up"
        );
        r.expire(wait + 11);
        assert_eq!(state(&r), (RoutingState::Exact, None), "too few verdicts");
        serve(&mut r, 100, 20, false);
        r.expire(wait + 21);
        assert_eq!(
            state(&r),
            (RoutingState::Degraded, Some(StateReason::HashMismatch))
        );
        assert!(
            !serve(&mut r, 101, 30, false),
            "scored from the approximate index"
        );

        // The engine hashes as the router does again: its served requests' blocks are held.
        for n in 200..200 + samples {
            serve(&mut r, n, 40, true);
        }
        r.expire(wait + 41);
        assert_eq!(state(&r), (RoutingState::Exact, None));
        assert!(serve(&mut r, 300, 50, true));
        let changes: Vec<_> = r
            .take_state_changes()
            .into_iter()
            .map(|(e, c)| (e, c.to, c.reason, c.delivered_share))
            .collect();
        assert_eq!(
            changes,
            [
                (
                    "a:1".to_string(),
                    RoutingState::Degraded,
                    StateReason::HashMismatch,
                    0.0
                ),
                (
                    "a:1".to_string(),
                    RoutingState::Exact,
                    StateReason::HashMismatch,
                    // Decided at the eighth lookup: request 101's block and seven held ones.
                    7.0 / 8.0
                ),
            ]
        );
        // A stream that is not whole says nothing: what was awaited is dropped unread.
        serve(&mut r, 400, 60, false);
        r.note_event_gap("a:1");
        r.expire(wait + 61);
        assert_eq!(
            r.endpoints(0)[0].state_reason,
            Some(StateReason::KvEventGap)
        );
    }
}

#[cfg(test)]
mod latency_tests {
    use super::*;
    use crate::hash::{block_hashes, model_seed};

    fn request(i: u64, bytes: usize) -> RouteRequest {
        let text = format!("{i} distinct prompt ").repeat(bytes / 20);
        RouteRequest {
            model: "m".into(),
            block_hashes: block_hashes(model_seed("m"), text.as_bytes(), 256),
            prompt_bytes: text.len() as u64,
            prompt_tokens: (text.len() / 4) as u32,
            max_output_tokens: Some(1),
            ..Default::default()
        }
    }

    /// `slow:1` prefills three times slower than the prior assumes, `fast:1` as assumed.
    fn observed_ttft(endpoint: &str, uncached: u32) -> u64 {
        let per_token = if endpoint == "slow:1" { 0.3 } else { 0.1 };
        (10.0 + f64::from(uncached) * per_token) as u64
    }

    /// Routes request `i` (2,000 to 8,000 bytes) at `now` with a seed that varies in every bit
    /// (so ties split evenly) and reports it served in `ttft(endpoint, uncached tokens)` ms;
    /// returns the chosen candidate.
    fn serve(r: &mut Router, i: u64, now: u64, ttft: impl Fn(&str, u32) -> u64) -> CandidateScore {
        let seed = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let d = r.route(&request(i, 2_000 + (i as usize % 7) * 1_000), now, seed);
        let chosen = d.candidates[0].clone();
        let ttft = ttft(&chosen.endpoint, chosen.uncached_tokens);
        r.feedback(
            &Outcome {
                decision_id: d.response.decision_id,
                endpoint: chosen.endpoint.to_string(),
                status: 200,
                ttfb_ms: Some(ttft),
                total_ms: ttft,
                completion_tokens: Some(1),
                ..Default::default()
            },
            now + ttft,
        );
        chosen
    }

    #[test]
    fn outcomes_teach_each_endpoint_its_own_latency() {
        let mut config = RouterConfig::default();
        config.scoring.prefill_tokens_per_ms = 10.0;
        let mut r = Router::new(config, 1);
        for a in ["slow:1", "fast:1"] {
            r.upsert_endpoint(a).unwrap();
        }
        let mut now = 0;
        for i in 0..200u64 {
            now += 60_000;
            let chosen = serve(&mut r, i, now, observed_ttft);
            assert!(chosen.predicted_ttft_ms > 0.0 && chosen.predicted_tpot_ms > 0.0);
        }
        let views = r.endpoints(now);
        let slow = views.iter().find(|e| e.address == "slow:1").unwrap();
        assert!(slow.latency_samples >= 32, "{views:?}");
        assert!(slow.latency_errors.ttft_error_ratio < 0.2, "{views:?}");
        // Once warm, the slow endpoint's learned TTFT is higher and it stops winning.
        let d = r.route(&request(999, 4_000), now + 60_000, 1);
        let by = |a: &str| d.candidates.iter().find(|c| c.endpoint == a).unwrap();
        let (slow, fast) = (by("slow:1"), by("fast:1"));
        let expected = observed_ttft("slow:1", slow.uncached_tokens) as f64;
        assert!(
            (slow.predicted_ttft_ms - expected).abs() / expected < 0.15,
            "{slow:?}"
        );
        assert!(
            slow.predicted_ttft_ms > 2.0 * fast.predicted_ttft_ms,
            "{d:?}"
        );
        assert!(slow.latency_ms > fast.latency_ms, "{d:?}");
        assert_eq!(d.response.endpoints[0], "fast:1");
    }

    // Two replicas warm up on an idle pool, each learning that it prefills twice as fast as
    // the prior assumes; then a third joins. Scored against a warm model's negative
    // correction with none of its own, it would never be chosen and never warm up; with the
    // warm replicas' median correction it takes its share at once.
    #[test]
    fn a_replica_that_joins_a_warm_idle_pool_gets_its_share() {
        let mut config = RouterConfig::default();
        config.scoring.prefill_tokens_per_ms = 10.0;
        let mut r = Router::new(config, 1);
        let mut now = 0;
        // Twice as fast as the prior's 0.1 ms a token.
        let fast = |_: &str, uncached: u32| (10.0 + f64::from(uncached) * 0.05) as u64;
        let mut serve_next = |r: &mut Router, i: u64| {
            now += 60_000;
            serve(r, i, now, fast).endpoint.to_string()
        };
        for a in ["a:1", "b:1"] {
            r.upsert_endpoint(a).unwrap();
        }
        for i in 0..120 {
            serve_next(&mut r, i);
        }
        r.upsert_endpoint("new:1").unwrap();
        let joined = (120..180)
            .filter(|&i| serve_next(&mut r, i) == "new:1")
            .count();
        assert!(
            (12..=30).contains(&joined),
            "the new replica got {joined} of 60 requests"
        );
        let views = r.endpoints(now);
        let new = views.iter().find(|e| e.address == "new:1").unwrap();
        assert!(new.latency_samples > 0, "{new:?}");
    }

    #[test]
    fn disabled_model_predicts_but_does_not_steer() {
        let config = RouterConfig {
            latency: LatencyConfig {
                enabled: false,
                ..LatencyConfig::default()
            },
            ..RouterConfig::default()
        };
        let mut r = Router::new(config, 1);
        r.upsert_endpoint("a:1").unwrap();
        for i in 0..50 {
            let d = r.route(&request(i, 1_000), i * 60_000, i);
            r.feedback(
                &Outcome {
                    decision_id: d.response.decision_id,
                    endpoint: "a:1".into(),
                    status: 200,
                    ttfb_ms: Some(500),
                    total_ms: 500,
                    completion_tokens: Some(1),
                    ..Default::default()
                },
                i * 60_000 + 500,
            );
        }
        let d = r.route(&request(77, 1_000), 10_000_000, 1);
        assert_eq!(d.candidates[0].latency_ms, 0.0);
        assert!(d.candidates[0].predicted_ttft_ms > 300.0, "{d:?}");
    }
}

#[cfg(test)]
mod disagg_tests {
    use super::*;
    use crate::hash::{block_hashes, model_seed};

    fn request(i: u64, tokens: usize) -> RouteRequest {
        let text = format!("{i} prompt ").repeat(tokens * 4 / 9 + 1);
        RouteRequest {
            model: "m".into(),
            block_hashes: block_hashes(model_seed("m"), text.as_bytes(), 256),
            prompt_bytes: text.len() as u64,
            prompt_tokens: tokens as u32,
            ..Default::default()
        }
    }

    fn fleet() -> Router {
        let mut r = Router::new(RouterConfig::default(), 1);
        for (a, role) in [
            ("p:1", EndpointRole::Prefill),
            ("d:1", EndpointRole::Decode),
            ("d:2", EndpointRole::Decode),
        ] {
            r.upsert_endpoint(a).unwrap();
            r.set_role(a, role);
        }
        r
    }

    #[test]
    fn long_uncached_prompts_get_a_prefill_endpoint_short_ones_do_not() {
        let mut r = fleet();
        let long = r.route(&request(1, 4_000), 0, 1);
        assert!(long.response.endpoints[0].starts_with("d:"), "{long:?}");
        assert!(!long.response.endpoints.contains(&"p:1".to_string()));
        assert_eq!(long.response.prefiller.as_deref(), Some("p:1"));
        let last = long.candidates.last().unwrap();
        assert_eq!(
            (last.endpoint.as_str(), last.role),
            ("p:1", EndpointRole::Prefill)
        );
        let short = r.route(&request(2, 200), 60_000, 2);
        assert_eq!(short.response.prefiller, None);
        assert_eq!(r.stats().disaggregated, 1);
        let views = r.endpoints(60_000);
        let p = views.iter().find(|e| e.address == "p:1").unwrap();
        assert_eq!((p.role, p.prefill_picks), (EndpointRole::Prefill, 1));
        // The prefill work is queued on the prefill endpoint, not on the decode endpoint.
        let d = views
            .iter()
            .find(|e| e.address == long.response.endpoints[0])
            .unwrap();
        assert!(
            p.backlog_tokens > 0.0 || d.backlog_tokens == 0.0,
            "{views:?}"
        );
    }

    #[test]
    fn a_prompt_cached_on_the_decode_endpoint_stays_there_whole() {
        let mut r = fleet();
        let first = r.route(&request(3, 4_000), 0, 1);
        let again = r.route(&request(3, 4_000), 60_000, 2);
        assert_eq!(again.response.endpoints[0], first.response.endpoints[0]);
        assert_eq!(again.response.prefiller, None, "{again:?}");
    }

    #[test]
    fn without_decode_endpoints_routing_fails_open_and_threshold_zero_disables() {
        let mut r = Router::new(RouterConfig::default(), 1);
        r.upsert_endpoint("p:1").unwrap();
        r.set_role("p:1", EndpointRole::Prefill);
        assert!(
            r.route(&request(1, 4_000), 0, 1)
                .response
                .endpoints
                .is_empty()
        );

        let mut r = fleet();
        r.config.pd.threshold_tokens = 0;
        assert_eq!(r.route(&request(1, 4_000), 0, 1).response.prefiller, None);
    }
}
