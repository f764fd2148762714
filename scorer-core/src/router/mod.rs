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

use crate::affinity::SessionStats;
use crate::calibration::{
    Calibrated, EndpointCalibration, EngineCounters, Prior, ShownPrefill, decayed_slowdown,
    slowdown,
};
use crate::disagg::EndpointRole;
use crate::index::{Claim, EndpointId, EndpointSet, MAX_ENDPOINTS, PrefixIndex};
use crate::latency::{
    EndpointLatencyModel, LatencyConfig, LatencyFeatures, LatencyPrediction, Observation,
    PredictionErrors,
};
use crate::lora::LoraState;
use crate::pools::{Eligibility, FleetState, PoolStats, ServedModel};
use crate::precise::{ApplyError, KvEvent, PreciseTracker};
use crate::protocol::{Outcome, Reject, RouteReason, RouteRequest, RouteResponse};
use crate::reuse::{
    Aim, MismatchLog, MismatchRecord, PoolKey, PoolTotals, ReuseOutcome, ReuseTotals, ReuseWindow,
};
use crate::self_check::{
    EndpointCheck, EventGapCheck, EventGroupCheck, EventHashCheck, RoutingState, SelfCheckConfig,
    StateChange, StateReason, TokenRatioCheck,
};
use crate::token_ratio::TokenRatio;

mod config;
mod cost;
#[cfg(test)]
mod disagg_tests;
#[cfg(test)]
mod latency_tests;
#[cfg(test)]
mod precise_tests;
#[cfg(test)]
mod tests;

pub use config::{
    CacheControlConfig, LEARNED_OUTPUT_MIN_SAMPLES, PreciseConfig, RouterConfig, ScoringConfig,
    StoredResponsesConfig,
};
use cost::*;

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

/// Free KV within this share of the most a near-tie has counts as the most: replicas of one
/// kind, idle, tie exactly, and a few blocks of difference say nothing.
const ROOMIEST_SHARE: f64 = 0.99;

/// Which of the near-tied candidates `tied` (their keys, cheapest first) takes the request:
/// one of those with the most free KV ([`Slot::free_kv_tokens`]), drawn by `seed`; a
/// candidate whose capacity is unknown is among them. A new context lives longest where the
/// most KV is free, and the cost terms cannot tell such replicas apart: idle ones cost the
/// same whatever their GPU. In a pool of two GPU generations the idle replicas a new
/// conversation may start on tie (a replica that has shown no rate is priced at its pool's
/// mean slowdown), and the draw put it on the smaller-memory, slower GPU half the time.
fn roomiest_tie(
    slots: &[Option<Slot>],
    candidates: &[(EndpointId, CandidateScore)],
    tied: &[u128],
    seed: u64,
    (now_ms, stale_after): (u64, u64),
) -> usize {
    // Two passes over a handful of candidates, no allocation: this runs on every near-tie.
    let free = |k: u128| {
        let id = candidates[key_position(k)].0;
        slots[usize::from(id.0)]
            .as_ref()
            .and_then(|slot| slot.free_kv_tokens(now_ms, stale_after))
    };
    let most = tied.iter().filter_map(|&k| free(k)).fold(0.0f64, f64::max);
    let roomy = |k: u128| free(k).is_none_or(|f| f >= most * ROOMIEST_SHARE);
    let count = tied.iter().filter(|&&k| roomy(k)).count();
    if count == 0 {
        return 0;
    }
    let pick = (splitmix64(seed) % count as u64) as usize;
    tied.iter()
        .enumerate()
        .filter(|&(_, &k)| roomy(k))
        .nth(pick)
        .map_or(0, |(i, _)| i)
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
    /// pool (approximate requests): when it clearly does not it is `degraded` (reason
    /// `bytes_per_token`) and scored from the approximate index.
    bytes_per_token: TokenRatioCheck,
    /// The same for precise requests, in the router's own token count of each prompt rather
    /// than its bytes: the ratio is about 1 whatever the text's language, so it stays with its
    /// pool's when cache-aware routing gives one endpoint the Cyrillic documents and another
    /// the code, which moves byte ratios apart with no tokeniser at fault.
    token_count: TokenRatioCheck,
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
    /// ... and the rates scoring uses: `learned` with `calibration.enabled`, else the prior,
    /// its prefill rate `base_prefill_tokens_per_ms` divided by `slowdown` until calibration
    /// has learned the endpoint's own ([`Slot::price_prefill`]).
    rates: Calibrated,
    /// The prefill rate of `rates` before any slowdown.
    base_prefill_tokens_per_ms: f64,
    /// The prefill rates its streamed first tokens showed ([`ShownPrefill`]) ...
    shown_prefill: ShownPrefill,
    /// ... and how many times slower than its pool's typical endpoint that was when it last
    /// showed one (1 unless at least [`crate::calibration::SLOWER_HARDWARE`]; see
    /// [`Router::first_token`]), decaying since ([`decayed_slowdown`]) ...
    slowdown: f64,
    /// ... it was judged: when it last showed a rate, or, for an endpoint that has shown none
    /// in a pool where others have, when theirs were last judged.
    judged_ms: u64,
    /// Prefill, decode or both (disaggregated serving).
    role: EndpointRole,
    /// Times it was picked as a request's prefill endpoint.
    prefill_picks: u64,
    /// The endpoint table's version when what copies see of this slot last changed
    /// ([`Router::endpoint_changes`]).
    version: u64,
    /// The scrape time copies were last sent (the refresh rule in `note_scrape`).
    sent_scrape_ms: u64,
    /// Precise decisions here that credited speculative blocks, as (when, decision id), oldest
    /// first: while one's prefill is not seen to run, the blocks credited since stay
    /// ([`Router::expire`]). Answered ones leave from the front, lazily.
    speculative_pending: VecDeque<(u64, u64)>,
}

impl Slot {
    /// Whether scoring uses the rates calibration learned from this endpoint's own counters
    /// (then no first-token slowdown applies: they already are its hardware's).
    fn owns_rates(&self, calibrating: bool) -> bool {
        calibrating && self.learned.is_learned()
    }

    /// Sets the prefill rate scoring uses: the base rate, divided by the slowdown as it counts
    /// at `now_ms` unless calibration owns the endpoint's rates.
    fn price_prefill(&mut self, now_ms: u64, calibrating: bool) {
        let slowdown = if self.owns_rates(calibrating) {
            1.0
        } else {
            self.slowdown_at(now_ms)
        };
        self.rates.prefill_tokens_per_ms = self.base_prefill_tokens_per_ms / slowdown;
    }

    /// Its slowdown as it counts at `now_ms`, decayed since it last showed a rate.
    fn slowdown_at(&self, now_ms: u64) -> f64 {
        if self.slowdown == 1.0 {
            return 1.0;
        }
        decayed_slowdown(self.slowdown, now_ms.saturating_sub(self.judged_ms))
    }

    /// Prefill tokens still queued at `now_ms`: the backlog drained at `tokens_per_ms` since
    /// the last decision.
    fn backlog_at(&self, now_ms: u64, tokens_per_ms: f64) -> f64 {
        let elapsed = now_ms.saturating_sub(self.backlog_at_ms) as f64;
        (self.backlog_tokens - elapsed * tokens_per_ms).max(0.0)
    }

    /// KV tokens free for a new context: the capacity less what the scrape shows in use and
    /// what the router's in-flight requests hold, when the capacity is known. A scrape older
    /// than `stale_after` ms shows nothing in use (as the cost terms read it); the capacity,
    /// which does not change, is still its.
    fn free_kv_tokens(&self, now_ms: u64, stale_after: u64) -> Option<f64> {
        let capacity = self.kv_capacity_tokens()?;
        let usage = self
            .fresh_metrics(now_ms, stale_after)
            .map_or(0.0, |m| m.kv_usage);
        Some((capacity - (usage * capacity).max(self.inflight_kv.tokens)).max(0.0))
    }

    /// Whether its last scrape is older than `stale_after` ms: then no load is read from it.
    fn stale(&self, now_ms: u64, stale_after: u64) -> bool {
        now_ms.saturating_sub(self.scraped_at_ms) > stale_after
    }

    /// The last scrape, unless it is [`Slot::stale`].
    fn fresh_metrics(&self, now_ms: u64, stale_after: u64) -> Option<&EndpointMetrics> {
        self.metrics
            .as_ref()
            .filter(|_| !self.stale(now_ms, stale_after))
    }

    /// The replica's KV capacity in tokens, when its scrape says (a capacity of 0 says
    /// nothing).
    fn kv_capacity_tokens(&self) -> Option<f64> {
        self.metrics
            .and_then(|m| m.capacity_tokens)
            .filter(|&c| c > 0)
            .map(|c| c as f64)
    }

    /// Waiting requests the router did not send, and the batch a new request joins: the queue
    /// and batch terms scoring and admission share. `fresh` is the scrape when not stale.
    fn unseen_waiting_and_active(&self, fresh: Option<&EndpointMetrics>) -> (u32, u32) {
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
        } else if self.events_expected && self.counts_otherwise() {
            // Only an endpoint with a KV-event index to distrust is degraded for this: without
            // one, its cache hits are the text's and no tokeniser can break them.
            (RoutingState::Degraded, Some(StateReason::BytesPerToken))
        } else {
            (RoutingState::Exact, None)
        }
    }

    /// Whether its KV-event index may score precise requests: a live stream of blocks of the
    /// configured size that lost no batch since it last ran clean, and holds the blocks the
    /// router hashes.
    fn precise_usable(&self) -> bool {
        self.events_whole() && !self.hashes.mismatched() && !self.counts_otherwise()
    }

    /// Whether its engine counts prompts in other tokens than its pool, by either check.
    fn counts_otherwise(&self) -> bool {
        self.bytes_per_token.drifted() || self.token_count.drifted()
    }

    /// The check that learns from prompts counted as `counted` counts them.
    fn count_check(&self, counted: Counted) -> &TokenRatioCheck {
        match counted {
            Counted::Bytes(_) => &self.bytes_per_token,
            Counted::Tokens(_) => &self.token_count,
        }
    }

    /// [`Slot::count_check`], to teach or judge.
    fn count_check_mut(&mut self, counted: Counted) -> &mut TokenRatioCheck {
        match counted {
            Counted::Bytes(_) => &mut self.bytes_per_token,
            Counted::Tokens(_) => &mut self.token_count,
        }
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

    /// What a copy needs of this endpoint ([`Router::endpoint_snapshots`]), with the models
    /// it serves when they are known.
    fn snapshot(
        &self,
        now_ms: u64,
        models: Option<&[ServedModel]>,
    ) -> crate::sync::EndpointSnapshot {
        crate::sync::EndpointSnapshot {
            address: self.address.to_string(),
            usable: self.health == Health::Ready,
            metrics: self.metrics.filter(|_| self.health == Health::Ready),
            metrics_age_ms: now_ms.saturating_sub(self.scraped_at_ms),
            models: models.map(<[ServedModel]>::to_vec),
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

/// Whether an engine whose context is `limit` tokens refuses a prompt of `tokens` asking for
/// `max_output` tokens: vLLM 0.33 refuses a prompt that leaves no room for one output token
/// and an output budget above the whole context, and clamps a smaller budget to what is left
/// (`get_max_tokens`, `vllm/entrypoints/serve/utils/api_utils.py`). No known limit: it fits.
fn exceeds_context(limit: Option<u32>, tokens: u32, max_output: Option<u32>) -> bool {
    limit.is_some_and(|limit| tokens >= limit || max_output.is_some_and(|m| m > limit))
}

/// `request` as the router accounts for one every engine refuses: no prompt, so it is routed
/// by load and its blocks are credited to no endpoint (they will not be cached anywhere).
fn without_prompt(request: &RouteRequest) -> RouteRequest {
    RouteRequest {
        block_hashes: Vec::new(),
        token_block_hashes: Vec::new(),
        prompt_bytes: 0,
        prompt_tokens: 0,
        marked_blocks: 0,
        prompt_text: None,
        ..request.clone()
    }
}

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
    /// When it was decided, here or (a decision recorded from another router) by its
    /// `age_ms` before it was heard of: no reported time may exceed the time since.
    started_ms: u64,
    /// Its prefill is in its endpoint's `unconfirmed_tokens` until its first token is reported.
    awaiting_first_token: bool,
    /// The time to its first token, when that was a sample of its endpoint's prefill rate
    /// ([`ShownPrefill`]): the outcome, which says what the prefill really was, reads it again.
    shown_after_ms: Option<u64>,
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
    /// The blocks the decision newly credited to its endpoint in the approximate index, taken
    /// back if the engine refuses the request unprefilled ([`PrefixIndex::unclaim`]).
    claim: Option<Claim>,
    /// The same in the speculative index (precise requests).
    speculative_claim: Option<Claim>,
    /// A precise request's token-block hashes, touched in the GPU index when it ends: vLLM
    /// frees a finished request's blocks to the recently used end of its free queue (tail
    /// first), so they outlive the blocks touched while it ran, whatever their events' age.
    prompt_blocks: Box<[u64]>,
    /// Scored to its last token: its usage teaches [`Router::agent_output`].
    scored_to_last_token: bool,
    /// A precise request's prompt tokens as the router's tokeniser counted them, checked
    /// against the engine's count ([`Slot::token_count`]); `None` for approximate requests,
    /// whose bytes are checked instead.
    counted_tokens: Option<u32>,
}

/// What the router counted a served prompt in, for the endpoint's token-count checks.
#[derive(Debug, Clone, Copy)]
enum Counted {
    /// Canonical bytes (approximate requests).
    Bytes(u64),
    /// The router's own tokens (precise requests).
    Tokens(u32),
}

/// A running mean of the output tokens requests have had: the plain mean over the first
/// hundred, then an exponential one (weight 1 %), so it follows a workload that changes.
#[derive(Debug, Clone, Copy, Default)]
struct OutputLength {
    mean: f64,
    samples: u32,
}

impl OutputLength {
    fn observe(&mut self, tokens: u32) {
        self.samples = self.samples.saturating_add(1);
        let weight = (1.0 / f64::from(self.samples)).max(0.01);
        self.mean += weight * (f64::from(tokens) - self.mean);
    }

    /// The mean, once `min_samples` have been seen.
    fn mean(&self, min_samples: u32) -> Option<f64> {
        (self.samples >= min_samples).then_some(self.mean)
    }
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
    /// Set when this request's wait here is past `scoring.wait_cap` times the soonest start
    /// another candidate offers it: ordered after the rest, as a guarded one is.
    #[serde(default)]
    pub capped: bool,
    /// Session-affinity bonus (negative) of the session's remembered, healthy replica.
    #[serde(default)]
    pub session_ms: f64,
    /// A session's first request: the decode-side load here charged again for the later
    /// turns that will follow its cache here ([`crate::affinity::SessionConfig::start_turns`]).
    #[serde(default)]
    pub session_start_ms: f64,
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

impl CandidateScore {
    /// This request's own wait here: the queue ahead plus its prefill.
    pub fn wait_ms(&self) -> f64 {
        self.queue_ms + self.prefill_ms
    }

    /// Ordered after the candidates that are not: guarded, or past the wait cap.
    pub fn set_aside(&self) -> bool {
        self.guarded || self.capped
    }
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
    /// Decisions where the guard or the wait cap skipped the cheapest candidate.
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
    /// How many times slower than its pool's typical endpoint scoring prices its prefill, from
    /// what its first tokens showed (1: not slower; [`Router::first_token`]).
    #[serde(default = "one")]
    pub prefill_slowdown: f64,
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
    /// The output lengths requests scored to their last token have had
    /// ([`ScoringConfig::learn_agent_output`]).
    agent_output: OutputLength,
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

/// Serde's default of a ratio that means "no change".
fn one() -> f64 {
    1.0
}

/// Appends `entry` (when, decision id) to a queue in time order whose answered decisions leave
/// lazily from the front; past `bound` entries it drops every one `live` no longer holds, so
/// a queue whose front stays live cannot grow without end.
fn push_compacting(
    queue: &mut VecDeque<(u64, u64)>,
    entry: (u64, u64),
    bound: usize,
    live: impl Fn(u64) -> bool,
) {
    queue.push_back(entry);
    if queue.len() > bound {
        queue.retain(|&(_, id)| live(id));
    }
}

/// The prefill tokens a streamed request's first token times, when it is a sample of its
/// endpoint's rate ([`ShownPrefill`]): only a prefill (`own` tokens) that had the endpoint
/// (almost) to itself shows it; behind a queue (`queued`) the time is mostly the queue's, which
/// the router may not know in full.
fn sampled_prefill(own: f64, queued: f64) -> Option<f64> {
    (queued <= 0.1 * own).then_some(own + queued)
}

/// Whether in-flight decision `decision_id` credited speculative blocks whose prefill has not
/// been seen to run ([`Router::expire`] keeps them).
fn awaits_prefill(inflight: &HashMap<u64, InFlight>, decision_id: u64) -> bool {
    inflight
        .get(&decision_id)
        .is_some_and(|e| e.speculative_claim.is_some())
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
    /// A precise request that no endpoint's event-fed indexes hold any of, while the
    /// approximate index (the routing history) places some of it on an endpoint whose events
    /// are used: [`cached_prefix`] scores it on the history everywhere.
    history_only: bool,
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
    /// `max_tokens`, or `scoring.default_output_tokens`: the most KV its answer can take.
    output_tokens: u32,
    /// The output the decode terms price: `output_tokens` capped at
    /// `scoring.default_output_tokens` (a client's cap is not its length; an Anthropic client
    /// must send one, often tens of thousands).
    expected_output_tokens: f64,
    /// `scoring.decode_weight_for` the request's API.
    decode_weight: f64,
    /// The prefill contention's weight for this request: `scoring.prefill_contention_weight`,
    /// or `local.first_token_contention_weight` for one scored to its first token that a copy
    /// decides beside other routers ([`Router::route_or_defer`]).
    contention_weight: f64,
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

impl RequestShape<'_> {
    /// Scored to its last token (`decode_weight` > 0; by default the agent APIs): its cost
    /// prices its own decode, turn by turn.
    fn scored_to_last_token(&self) -> bool {
        self.decode_weight > 0.0
    }
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

/// A request's session and the replica that session remembers.
#[derive(Debug, Clone, Copy, Default)]
struct SessionAffinity<'r> {
    /// The session key (`None`: the request names no session).
    key: Option<&'r str>,
    /// Where the session went last, within `sessions.ttl_ms`.
    remembered: Option<EndpointId>,
    /// Later turns this request's placement is charged for (0: no session, a session already
    /// placed, or `sessions.start_turns` 0): `sessions.start_turns` times the share of recent
    /// sessions that came back ([`crate::affinity::SessionTable::return_share`]).
    start_turns: f64,
}

impl SessionAffinity<'_> {
    /// The request starts a session: it names one the router has not seen within the TTL.
    fn starts(&self) -> bool {
        self.key.is_some() && self.remembered.is_none()
    }
}

/// One usable endpoint while it is scored.
#[derive(Debug, Clone, Copy)]
struct Candidate<'s> {
    id: EndpointId,
    slot: &'s Slot,
    /// Its scrape, unless stale (borrowed: a candidate is passed by value to every term).
    fresh: Option<&'s EndpointMetrics>,
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
    /// The part of `decode_ms` that is prefill flowing in beside the decode
    /// ([`prefill_contention_ms`]).
    contention_ms: f64,
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
            agent_output: OutputLength::default(),
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

    /// The output an agent request without a lower `max_tokens` is expected to have, tokens:
    /// the mean agent requests have had once learned, else `scoring.default_output_tokens`
    /// ([`ScoringConfig::learn_agent_output`]); what `/metrics` shows.
    pub fn agent_output_tokens(&self) -> f64 {
        let scoring = &self.config.scoring;
        scoring
            .learn_agent_output
            .then(|| self.agent_output.mean(LEARNED_OUTPUT_MIN_SAMPLES))
            .flatten()
            .unwrap_or(f64::from(scoring.default_output_tokens))
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
            token_count: TokenRatioCheck::default(),
            served: ServedTotals::default(),
            reuse: ReuseTotals::default(),
            latency: EndpointLatencyModel::new(&self.config.scoring, &self.config.latency),
            calibration: EndpointCalibration::default(),
            learned: Calibrated::from_prior(prior(&self.config.scoring)),
            rates: Calibrated::from_prior(prior(&self.config.scoring)),
            base_prefill_tokens_per_ms: Calibrated::from_prior(prior(&self.config.scoring))
                .prefill_tokens_per_ms,
            shown_prefill: ShownPrefill::default(),
            slowdown: 1.0,
            judged_ms: 0,
            role: EndpointRole::Both,
            prefill_picks: 0,
            version: self.table.next(),
            sent_scrape_ms: 0,
            speculative_pending: VecDeque::new(),
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
        slot.base_prefill_tokens_per_ms = slot.rates.prefill_tokens_per_ms;
        slot.price_prefill(now_ms, calibration.enabled);
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

    /// Teaches endpoint `id` that a prompt the router counted as `counted` was `tokens`
    /// tokens there, then compares its learned ratio with the rest of its pool's
    /// ([`TokenRatioCheck`]; every 8th outcome, as the ratios move slowly).
    fn judge_token_count(&mut self, id: EndpointId, pool: PoolKey, counted: Counted, tokens: u32) {
        let Some(slot) = self.slots[usize::from(id.0)].as_mut() else {
            return;
        };
        let units = match counted {
            Counted::Bytes(bytes) => bytes,
            Counted::Tokens(own) => u64::from(own),
        };
        slot.count_check_mut(counted).observe(units, tokens);
        let check = &self.config.self_check;
        if !check.enabled
            || slot.count_check(counted).ratio(check).is_none()
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
            .filter_map(|(_, s)| s.as_ref()?.count_check(counted).ratio(check))
            .collect();
        let Some(slot) = self.slots[usize::from(id.0)].as_mut() else {
            return;
        };
        let was = slot.state_and_reason();
        slot.count_check_mut(counted)
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
        self.replace_catalogue(address, Some(models));
    }

    /// Forgets what `address` serves (its catalogue is not known any more): a copy mirrors a
    /// control plane that has not polled the endpoint since it came back.
    pub fn forget_served_models(&mut self, address: &str) {
        self.replace_catalogue(address, None);
    }

    /// Makes `models` (`None`: not known) `address`'s catalogue. Copies route on the catalogue
    /// too, so a change is a change of the endpoint's snapshot.
    fn replace_catalogue(&mut self, address: &str, models: Option<Vec<ServedModel>>) {
        let Some(id) = self.endpoint_id(address) else {
            return;
        };
        if self.fleet.catalog.models(id) == models.as_deref() {
            return;
        }
        if let Some(slot) = self.slots[usize::from(id.0)].as_mut() {
            slot.version = self.table.next();
        }
        match models {
            Some(models) => self.fleet.catalog.set(id, models),
            None => self.fleet.catalog.clear(id),
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

    /// The learned share of recent sessions that came back soon, which scales the
    /// session-start charge ([`crate::affinity::SessionTable::return_share`]).
    pub fn session_return_share(&self) -> f64 {
        self.fleet.sessions.return_share()
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
        // A routed prompt's speculative blocks stand until its prefill is seen to run (its
        // first token, or its end): its events cannot come sooner, however long its queue.
        let (inflight, slots) = (&self.inflight, &mut self.slots);
        self.precise.speculative.expire_before(now_ms, |id| {
            let Some(slot) = slots.get_mut(usize::from(id.0)).and_then(Option::as_mut) else {
                return u64::MAX;
            };
            let pending = &mut slot.speculative_pending;
            while let Some(&(at, decision_id)) = pending.front() {
                if awaits_prefill(inflight, decision_id) {
                    return at;
                }
                pending.pop_front();
            }
            u64::MAX
        });
    }

    /// Remembers a precise decision whose speculative blocks wait for its prefill, dropping
    /// answered ones when they outnumber what is in flight there.
    fn track_speculative(&mut self, id: EndpointId, decision_id: u64, now_ms: u64) {
        let Some(slot) = self.slots[usize::from(id.0)].as_mut() else {
            return;
        };
        let live = &self.inflight;
        push_compacting(
            &mut slot.speculative_pending,
            (now_ms, decision_id),
            2 * slot.inflight as usize + 64,
            |d| awaits_prefill(live, d),
        );
    }

    /// Remembers a new in-flight entry for expiry, dropping answered ones from the queue when
    /// they outnumber the live ones (memory stays proportional to what is really in flight).
    fn track_inflight(&mut self, decision_id: u64, now_ms: u64) {
        let live = &self.inflight;
        push_compacting(
            &mut self.inflight_order,
            (now_ms, decision_id),
            2 * live.len() + 1024,
            |id| live.contains_key(&id),
        );
    }

    /// Chooses endpoints for `request`. Never fails: with no usable endpoint the list is empty
    /// and the filter lets Envoy's fallback policy pick.
    ///
    /// A decision runs as named stages, each with a typed result, so each question is answered
    /// in one place: `Router::shape_request` (what the request needs wherever it goes),
    /// `Router::select_pool` (who may serve it, and its session's replica),
    /// `Router::score_candidates` (each candidate's cached prefix, cost terms and steering),
    /// `Router::rank` (guard, order, tie-break and the reason), `Router::account_choice`
    /// (the chosen endpoint's load, indexes, session and prefill endpoint), then
    /// `Router::respond`.
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
    /// the chosen one) whose own prefill is predicted to take at least `defer_above_ms`, or
    /// the first request of a session (a session key the router has not seen within the
    /// session TTL) with more than one candidate. Such a request is where the other routers'
    /// unseen decisions matter most (each copy sees the same stale loads and would send its
    /// long misses, or the forks of one subagent burst, to the same replica), and where a
    /// route call's fraction of a millisecond is least: the caller asks the control plane,
    /// which sees every such request. `defer_above_ms` at or below 0 defers nothing. Either
    /// way a request scored to its first token is scored with
    /// `local.first_token_contention_weight` ([`crate::sync::LocalConfig`]).
    pub fn route_or_defer(
        &mut self,
        request: &RouteRequest,
        now_ms: u64,
        seed: u64,
        defer_above_ms: f64,
    ) -> Option<Decision> {
        self.decide(request, now_ms, seed, Some(defer_above_ms))
    }

    /// [`Router::route`] (`defer_above_ms` `None`) and [`Router::route_or_defer`] (`Some`: a
    /// copy deciding beside other routers) in one.
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

        let beside_others = defer_above_ms.is_some();
        let shape = self.shape_request(request, beside_others);
        let mut pool = match self.select_pool(request, now_ms) {
            Ok(pool) => pool,
            Err(reject) => return Some(rejected(decision_id, reject)),
        };
        let refused;
        let (request, shape) = if self.fit_context(request, shape.tokens, &mut pool) {
            (request, shape)
        } else {
            refused = without_prompt(request);
            (&refused, self.shape_request(&refused, beside_others))
        };
        let candidates = self.score_candidates(request, &shape, &pool, now_ms);
        let stored = self.stored_response_endpoint(request, now_ms);
        let Some(mut ranking) = self.rank(
            candidates,
            decision_id,
            seed,
            now_ms,
            !shape.scored_to_last_token(),
        ) else {
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
        // A session's first request is left to the control plane too, whatever it costs: it
        // decides where the session's later turns go, and copies between syncs cannot see each
        // other's new sessions (a subagent burst is a burst of them, each copy sending its
        // forks to the replica that looked lightest before the others' forks landed there).
        if let Some(threshold) = defer_above_ms
            && threshold > 0.0
            && !pinned
            && ranking.candidates.len() > 1
            && (pool.session.starts()
                || ranking.reason != RouteReason::Prefix
                    && ranking.chosen_score().prefill_ms >= threshold)
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
        let shape = self.shape_request(request, false);
        let mut pool = self
            .select_pool(request, now_ms)
            .unwrap_or_else(|_| CandidatePool {
                eligible: Eligibility::Only(Vec::new()),
                adapter: self.fleet.is_adapter(&request.model),
                session: SessionAffinity::default(),
                recorded: None,
            });
        pool.recorded = Some(chosen);
        let limit = self.fleet.catalog.context_limit(chosen, &request.model);
        let refused;
        let (request, shape) = if exceeds_context(limit, shape.tokens, request.max_output_tokens) {
            refused = without_prompt(request);
            (&refused, self.shape_request(&refused, false))
        } else {
            (request, shape)
        };
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
        if age_ms > 0 {
            // Timed from when it was taken, not from when this router heard of it: a copy
            // often hears of a decision in the same sync as its first token or its outcome,
            // and timed from then a one-second prefill reads as instant (the rate a first token
            // shows, and an outcome clamped to the time since the decision). Expiry still
            // counts from now.
            if let Some(entry) = self.inflight.get_mut(&decision_id) {
                entry.started_ms = now_ms.saturating_sub(age_ms);
            }
            if let Some(slot) = self.slots[usize::from(chosen.0)].as_mut() {
                let done = (age_ms as f64 * slot.rates.prefill_tokens_per_ms).min(uncached);
                slot.backlog_tokens = (slot.backlog_tokens - done).max(0.0);
                // A streamed decision's first token, if it came, is in the log after it.
                if !request.stream {
                    slot.buffered_tokens = (slot.buffered_tokens - done).max(0.0);
                }
            }
        }
        true
    }

    /// Stage 1: what serving `request` involves on any endpoint: its prompt in tokens, the
    /// blocks a hit can cover, and the blocks its KV will hold once admitted. `beside_others`:
    /// a copy deciding while other routers decide ([`Router::route_or_defer`]).
    fn shape_request<'r>(
        &self,
        request: &'r RouteRequest,
        beside_others: bool,
    ) -> RequestShape<'r> {
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
        let scoring = &self.config.scoring;
        let output_tokens = request
            .max_output_tokens
            .unwrap_or(scoring.default_output_tokens)
            .min(max_tokens);
        let decode_weight = scoring.decode_weight_for(request.api);
        let mut shape = RequestShape {
            precise,
            tokens,
            prompt_bytes,
            prompt_tokens: f64::from(tokens.max(1)),
            marked_tokens,
            output_tokens,
            expected_output_tokens: f64::from(output_tokens)
                .min(self.expected_output(decode_weight)),
            decode_weight,
            contention_weight: scoring.prefill_contention_weight,
            tokens_per_block,
            block_tokens,
            // vLLM recomputes at least the last prompt token, so only blocks of the first n-1 count.
            hittable_blocks: (tokens.saturating_sub(1) as usize) / block_tokens,
            token_blocks: &request.token_block_hashes,
            kv_blocks,
        };
        // A copy beside other routers sees their prefill up to one sync late (see
        // `LocalConfig::first_token_contention_weight`).
        if beside_others && !shape.scored_to_last_token() {
            shape.contention_weight = self.config.local.first_token_contention_weight;
        }
        shape
    }

    /// The output the decode terms expect of a request with `decode_weight` before its
    /// `max_tokens` caps it: `scoring.default_output_tokens`, or for one scored to its last
    /// token (`decode_weight` > 0) the mean such requests have had
    /// ([`ScoringConfig::learn_agent_output`]).
    fn expected_output(&self, decode_weight: f64) -> f64 {
        if decode_weight > 0.0 {
            self.agent_output_tokens()
        } else {
            f64::from(self.config.scoring.default_output_tokens)
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
        let key = request.session.as_deref().filter(|k| !k.is_empty());
        let remembered = key.and_then(|k| self.fleet.sessions.lookup(k, now_ms, sessions.ttl_ms));
        let mut session = SessionAffinity {
            key,
            remembered,
            start_turns: 0.0,
        };
        if session.starts() {
            session.start_turns =
                sessions.start_turns.max(0.0) * self.fleet.sessions.return_share();
        }
        Ok(CandidatePool {
            eligible,
            adapter: self.fleet.is_adapter(&request.model),
            session,
            recorded: None,
        })
    }

    /// Stage 2b: keeps `pool` to the usable endpoints whose context (`max_model_len` in their
    /// `/v1/models` card) holds a prompt of `tokens` and the output budget asked for. Returns
    /// false when none does: the engine will refuse the request wherever it goes, so the
    /// caller routes it with no prompt (by load, crediting nothing to any index).
    fn fit_context(
        &mut self,
        request: &RouteRequest,
        tokens: u32,
        pool: &mut CandidatePool,
    ) -> bool {
        let catalog = &self.fleet.catalog;
        if catalog.is_empty() {
            return true;
        }
        let fits = |i: usize| {
            let limit = catalog.context_limit(EndpointId(i as u16), &request.model);
            !exceeds_context(limit, tokens, request.max_output_tokens)
        };
        let usable = |i: usize, slot: &Option<Slot>| {
            slot.as_ref().is_some_and(|s| s.health == Health::Ready) && pool.eligible.allows(i)
        };
        let (mut any_fit, mut any_short) = (false, false);
        for (i, slot) in self.slots.iter().enumerate() {
            if usable(i, slot) {
                let fit = fits(i);
                any_fit |= fit;
                any_short |= !fit;
            }
        }
        if !any_short {
            return true;
        }
        if !any_fit {
            self.fleet.stats.context_exceeded += 1;
            return false;
        }
        let only = (0..self.slots.len())
            .map(|i| usable(i, &self.slots[i]) && fits(i))
            .collect();
        pool.eligible = Eligibility::Only(only);
        self.fleet.stats.context_narrowed += 1;
        true
    }

    /// Stage 3: every usable endpoint of `pool` as a scored candidate, in slot order: its
    /// cached prefix ([`cached_prefix`]), the analytic cost terms ([`cost_terms`]) and what
    /// steers them ([`steering`]: session bonus, LoRA cost, the learned latency correction).
    /// Drains each candidate's backlog to `now_ms` and records its latency features. For a
    /// recorded decision (`pool.recorded`) only the chosen endpoint gets its terms; the others
    /// carry their cached prefix alone.
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
        let depths = look_up_prefixes(&mut scratch.depths, index, precise, request, n, |i| {
            slots[i].as_ref().is_some_and(Slot::precise_usable)
        });
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
            let slot = &*slot;
            let fresh = slot.fresh_metrics(now_ms, stale_after);
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
            let held = CandidateScore {
                endpoint: slot.address.clone(),
                cached_blocks: cached.blocks as u32,
                cached_tokens: cached.tokens as u32,
                precise: cached.precise,
                ..CandidateScore::default()
            };
            if pool.recorded.is_some_and(|chosen| chosen != here) {
                // Recording another router's decision reads the chosen endpoint's terms
                // (`account_choice`) and only the others' cached prefix (the fleet numbers'
                // best credit): their cost terms would be thrown away, and with every copy
                // applying every other copy's decisions they were most of the work.
                candidates.push((here, held));
                continue;
            }
            let terms = cost_terms(candidate, cached.tokens, shape, s);
            let session_start_ms = session_start_ms(candidate, shape, pool.session.start_turns, s);
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
                        + steer.lora_ms
                        + session_start_ms,
                    inflight: slot.inflight,
                    guarded: false,
                    predicted_ttft_ms: steer.predicted.ttft_ms,
                    predicted_tpot_ms: steer.predicted.tpot_ms,
                    latency_samples: slot.latency.samples(),
                    latency_ms: steer.latency_ms,
                    role: slot.role,
                    session_ms: steer.session_ms,
                    session_start_ms,
                    cache_control_ms: steer.cache_control_ms,
                    lora_ms: steer.lora_ms,
                    ..held
                },
            ));
        }
        // A recorded decision's candidates are not ranked.
        if config.latency.enabled && pool.recorded.is_none() {
            cold_latency_from_warm(&mut candidates, config.latency.min_samples);
        }
        candidates
    }

    /// Stage 4: sets prefill-only candidates aside (never decode targets; they may prefill for
    /// the chosen one), applies the guard against piling onto one hot replica and, for a
    /// request scored to its first token (`first_token`), the wait cap; orders the rest (those
    /// neither guarded nor capped first, then by cost; a near-tie to the one with the most free
    /// KV, the seed drawing among equals, [`roomiest_tie`]) into `scratch.keys`, and names the
    /// choice and its reason. `None`: no decode candidate at all. `now_ms` tells a fresh
    /// scrape from a stale one.
    fn rank(
        &mut self,
        mut candidates: Vec<(EndpointId, CandidateScore)>,
        decision_id: u64,
        seed: u64,
        now_ms: u64,
        first_token: bool,
    ) -> Option<Ranking> {
        let s = &self.config.scoring;
        let prefill_only = crate::disagg::split_prefill_only(&mut candidates, s.prefill_weight);
        if candidates.is_empty() {
            return None;
        }
        apply_guard(&mut candidates, s);
        if first_token {
            apply_wait_cap(&mut candidates, s);
        }
        // The order is worked out on small keys, and the candidates (large) are moved into it
        // once, at the end (`respond`).
        let RouteScratch {
            keys, short_keys, ..
        } = &mut self.scratch;
        cost_order(&candidates, keys, short_keys);
        let best = &candidates[key_position(keys[0])].1;
        let (best_aside, best_cost) = (best.set_aside(), best.total_ms);
        let ties = keys
            .iter()
            .map(|&k| &candidates[key_position(k)].1)
            .take_while(|c| c.set_aside() == best_aside && c.total_ms - best_cost <= s.tie_ms)
            .count();
        if ties > 1 {
            let pick = roomiest_tie(
                &self.slots,
                &candidates,
                &keys[..ties],
                seed ^ decision_id,
                (now_ms, self.config.stale_after_ms),
            );
            keys.swap(0, pick);
        }
        // The guard or the wait cap skipped the cheapest candidate.
        let cheapest_set_aside = keys
            .iter()
            .map(|&k| &candidates[key_position(k)].1)
            .min_by(|a, b| a.total_ms.total_cmp(&b.total_ms))
            .is_some_and(CandidateScore::set_aside);
        if cheapest_set_aside {
            self.stats.guarded += 1;
        }
        let chosen_at = key_position(keys[0]);
        let (chosen, chosen_score) = &candidates[chosen_at];
        let max_cached = candidates
            .iter()
            .map(|(_, c)| c.cached_blocks)
            .max()
            .unwrap_or(0);
        let reason = if cheapest_set_aside {
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
            let sessions = &self.config.sessions;
            let (ttl, soon, max) = (
                sessions.ttl_ms,
                sessions.return_within_ms,
                sessions.max_sessions,
            );
            self.fleet
                .sessions
                .remember_session(key, chosen, now_ms, ttl, soon, max);
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
        let mut entry = InFlight {
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
            shown_after_ms: None,
            call_id: request.call_id,
            aim,
            pool: self
                .reuse_pools
                .key(&request.model, self.config.reuse.max_pools),
            precise: chosen_score.precise,
            state,
            first_token_block: request.token_block_hashes.first().copied(),
            claim: None,
            speculative_claim: None,
            prompt_blocks: request.token_block_hashes.as_slice().into(),
            scored_to_last_token: shape.scored_to_last_token(),
            counted_tokens: shape.precise.then_some(shape.tokens),
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
        // Scoring matched this deep (the same call filled the buffer): the blocks after it are
        // the ones this decision credits.
        let held = |depths: &[usize]| depths.get(usize::from(chosen.0)).copied().unwrap_or(0);
        entry.claim = self
            .index
            .insert(chosen, &request.block_hashes, now_ms)
            .claim_after(held(&self.scratch.depths.matched));
        if shape.precise {
            entry.speculative_claim = self
                .precise
                .speculative
                .insert(chosen, &request.token_block_hashes, now_ms)
                .claim_after(held(&self.scratch.depths.spec));
            // The engine's hit refreshes these blocks in its LRU order; no event says so.
            self.precise
                .gpu
                .touch(chosen, &request.token_block_hashes, now_ms);
        }
        if let Some(call) = request.call_id {
            self.calls.insert(call, decision_id);
        }
        let speculative = entry.speculative_claim.is_some();
        self.inflight.insert(decision_id, entry);
        self.track_inflight(decision_id, now_ms);
        if speculative {
            self.track_speculative(chosen, decision_id, now_ms);
        }
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
            let (ttl, max) = (
                self.config.responses.ttl_ms,
                self.config.responses.max_entries,
            );
            self.fleet
                .responses
                .remember(response_id, served_by, now_ms, ttl, max);
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
        // An HTTP error before any token: the engine cached nothing for it, so the prefix the
        // decision credited is taken back. (A reset stream, status 0, may have been dropped
        // mid-prefill, after vLLM cached the blocks it had scheduled: its credit stays.)
        if refused && (400..600).contains(&outcome.status) {
            if let Some(claim) = entry.claim {
                self.index.unclaim(entry.endpoint, claim);
            }
            if let Some(claim) = entry.speculative_claim {
                self.precise.speculative.unclaim(entry.endpoint, claim);
            }
        }
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
        // The engine freed its blocks just now, to the recently used end of its free queue.
        if !refused && !entry.prompt_blocks.is_empty() {
            self.precise
                .gpu
                .touch(served_by, &entry.prompt_blocks, now_ms);
        }
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

        if entry.scored_to_last_token
            && (200..300).contains(&outcome.status)
            && let Some(tokens) = outcome.completion_tokens
        {
            self.agent_output.observe(tokens);
        }
        if (200..300).contains(&outcome.status)
            && let Some(tokens) = outcome.prompt_tokens
        {
            self.token_ratio.observe(entry.prompt_bytes, tokens);
            if served_by == entry.endpoint {
                let counted = match entry.counted_tokens {
                    Some(own) => Counted::Tokens(own),
                    None => Counted::Bytes(entry.prompt_bytes),
                };
                self.judge_token_count(served_by, entry.pool, counted, tokens);
            }
        }
        if let Some(actual) = outcome.cached_tokens {
            self.stats.predicted_cached_tokens += u64::from(entry.predicted_cached_tokens);
            self.stats.actual_cached_tokens += u64::from(actual);
        }
        self.correct_shown_prefill(&entry, outcome, served_by, now_ms);
    }

    /// Reads the sample decision `entry`'s first token gave of its endpoint's prefill rate
    /// again with what its outcome says the prefill was: the prompt's tokens less those the
    /// engine had cached, where the router's count was its own estimate. A prompt the router
    /// believed a miss that the engine served from cache read the endpoint many times faster
    /// than it is, and in a pool of a few replicas that one sample made the others read twice
    /// as slow as the median; now it lasts until its answer ends. A sample from a request
    /// another endpoint served (Envoy's fallback) is forgotten. An outcome without usage
    /// changes nothing.
    fn correct_shown_prefill(
        &mut self,
        entry: &InFlight,
        outcome: &Outcome,
        served_by: EndpointId,
        now_ms: u64,
    ) {
        let Some(elapsed) = entry.shown_after_ms else {
            return;
        };
        let own = match (outcome.prompt_tokens, outcome.cached_tokens) {
            _ if served_by != entry.endpoint => None,
            (Some(prompt), Some(cached)) => Some(f64::from(prompt.saturating_sub(cached))),
            _ => return,
        };
        let tokens = own.and_then(|own| sampled_prefill(own, entry.latency_features.queue_tokens));
        let Some(slot) = self.slots[usize::from(entry.endpoint.0)].as_mut() else {
            return;
        };
        if slot
            .shown_prefill
            .correct(outcome.decision_id, tokens, elapsed as f64)
        {
            self.rescale_slow_endpoints(now_ms);
        }
    }

    /// The first token of decision `decision_id`'s response was seen: its prefill is done, so
    /// it leaves its endpoint's measured queue. While such reports keep arriving (for any
    /// endpoint: an idle one has none to send), every endpoint's queue term is the prefill of
    /// its streamed requests still waiting for a first token, with no assumed rate (a rate off
    /// by 2x, as a prior is on other hardware, drains an estimate twice too fast or too slow);
    /// without them, the estimate drained at the endpoint's rate. A buffered request shows no
    /// first token before its end and is counted by the estimate only.
    ///
    /// `ttft_ms` is the proxy's own time from routing to the first token
    /// ([`crate::protocol::FirstToken::ttft_ms`]): the prefill rate the endpoint showed is read
    /// from it rather than from when the report arrived, which a feedback tick or a failover to
    /// another control plane delays by up to seconds (`None`: an older proxy's report).
    pub fn first_token(&mut self, decision_id: u64, now_ms: u64, ttft_ms: Option<u64>) {
        self.stats.first_tokens += 1;
        self.first_token_at_ms = Some(now_ms);
        let Some(entry) = self.inflight.get_mut(&decision_id) else {
            return;
        };
        // Its prefill ran: from here the events speak for its blocks, and the speculative ones
        // expire as usual.
        entry.speculative_claim = None;
        if !entry.awaiting_first_token {
            return;
        }
        entry.awaiting_first_token = false;
        let mut shown = false;
        if let Some(slot) = self.slots[usize::from(entry.endpoint.0)].as_mut() {
            slot.unconfirmed_tokens =
                (slot.unconfirmed_tokens - f64::from(entry.prefill_tokens)).max(0.0);
            if self.config.calibration.first_tokens
                && !entry.remote_prefill
                && let Some(tokens) = sampled_prefill(
                    f64::from(entry.prefill_tokens),
                    entry.latency_features.queue_tokens,
                )
            {
                // The proxy's own time when it sent one: the time since the decision as this
                // router counts it falls short of it by however late the router heard of the
                // decision, a sync interval or more for a copy, which for a short prefill
                // reads as twice its rate.
                let elapsed = ttft_ms.unwrap_or_else(|| now_ms.saturating_sub(entry.started_ms));
                shown = slot
                    .shown_prefill
                    .observe(tokens, elapsed as f64, now_ms, decision_id);
                if shown {
                    entry.shown_after_ms = Some(elapsed);
                }
            }
        }
        if shown {
            self.rescale_slow_endpoints(now_ms);
        }
    }

    /// Scores each endpoint whose first tokens show its prefill at least
    /// [`crate::calibration::SLOWER_HARDWARE`] times slower than the median endpoint's (of those
    /// that have shown one) at the prior divided by that ratio, until calibration has learned
    /// its own rates, and each endpoint that has shown none at the mean of the shown ones'
    /// slowdowns. A pool of two GPU generations is then told apart within the first long
    /// prompt each serves, instead of a finished request's minute later on the slow ones. Every
    /// endpoint counts toward one median, whatever model it serves.
    fn rescale_slow_endpoints(&mut self, now_ms: u64) {
        let mut shown: Vec<f64> = self
            .slots
            .iter()
            .flatten()
            .filter_map(|s| s.shown_prefill.fastest())
            .collect();
        // Fewer than two shown (a sample forgotten): no endpoint is slower than the others.
        let typical = match shown.len() {
            0 | 1 => None,
            _ => crate::self_check::median(&mut shown),
        };
        let calibrating = self.config.calibration.enabled;
        // Each endpoint's slowdown, if it has shown a rate and the pool a typical one.
        let judged: Vec<Option<f64>> = self
            .slots
            .iter()
            .flatten()
            .map(|s| Some(slowdown(s.shown_prefill.fastest()?, typical?)))
            .collect();
        // An endpoint that has shown no rate yet may be of either kind: it is priced at the
        // mean of the shown endpoints' slowdowns (1 in a pool of one kind), so that in a pool
        // of two GPU generations a cold replica is not taken for the fast kind.
        let (sum, count) = judged
            .iter()
            .flatten()
            .fold((0.0, 0u32), |(sum, n), slowdown| (sum + slowdown, n + 1));
        let unshown = if count == 0 {
            1.0
        } else {
            sum / f64::from(count)
        };
        for (slot, judged) in self.slots.iter_mut().flatten().zip(judged) {
            let (new, judged_ms) = match judged {
                Some(slowdown) => (slowdown, slot.shown_prefill.last_shown_ms()),
                None => (unshown, now_ms),
            };
            if new == slot.slowdown && judged_ms == slot.judged_ms {
                continue;
            }
            slot.slowdown = new;
            slot.judged_ms = judged_ms;
            slot.price_prefill(now_ms, calibrating);
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
                stale: s.stale(now_ms, self.config.stale_after_ms),
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
                prefill_slowdown: s.slowdown_at(now_ms),
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

    /// What a local copy of this router needs of each endpoint (`sync`): its address, its last
    /// scrape with that scrape's age (none when the endpoint is unreachable), and its catalogue
    /// when known.
    pub fn endpoint_snapshots(&self, now_ms: u64) -> Vec<crate::sync::EndpointSnapshot> {
        self.snapshots_where(now_ms, |_| true)
    }

    /// The snapshots of the endpoints `pick` selects, in slot order.
    fn snapshots_where(
        &self,
        now_ms: u64,
        pick: impl Fn(&Slot) -> bool,
    ) -> Vec<crate::sync::EndpointSnapshot> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.as_ref().filter(|s| pick(s))?)))
            .map(|(i, s)| {
                let models = self.fleet.catalog.models(EndpointId(i as u16));
                s.snapshot(now_ms, models)
            })
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
        let changed = self.snapshots_where(now_ms, |s| s.version > since);
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
            let stale = slot.stale(now_ms, self.config.stale_after_ms);
            let model = if learned.enabled && slot.latency.samples() >= learned.min_samples {
                &slot.latency
            } else {
                &analytic
            };
            // The same queue and batch terms `route` scores, with the backlog drained to now.
            let backlog = slot.backlog_at(now_ms, slot.rates.prefill_tokens_per_ms);
            let fresh = slot.metrics.as_ref().filter(|_| !stale);
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
