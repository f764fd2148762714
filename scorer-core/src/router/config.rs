//! The router's configuration: the scoring weights and the sections beside them.

use serde::{Deserialize, Serialize};

use crate::affinity::SessionConfig;
use crate::calibration::CalibrationConfig;
use crate::disagg::PdConfig;
use crate::latency::LatencyConfig;
use crate::lora::LoraConfig;
use crate::pools::ModelsConfig;
use crate::protocol::ApiKind;
use crate::reuse::ReuseConfig;
use crate::self_check::SelfCheckConfig;

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
    /// Weight of the decode estimate (expected output tokens x time per token) in the cost
    /// of a chat or completion request (and of a route call that names no API): 0 scores
    /// time to first token only, 1 scores time to the last token. The expected output is
    /// `max_tokens` capped at `default_output_tokens`, as in the prefill contention: a
    /// client's cap is not its length.
    pub decode_weight: f64,
    /// The same weight for the agent APIs, `/v1/messages` and `/v1/responses`: an agent acts
    /// on a whole answer (a tool call is useless until its last token), so these are scored
    /// to the last token by default. Chosen on fleet-sim's tuning split (seeds 1-2, agentic
    /// cells): end to end against the fastest peer 1.42 -> 1.00 and TTFT against the best
    /// peer 1.084 / 1.275 -> 0.846 / 1.224 at 1, where 2 and 3 lost cells; subagent bursts
    /// spread instead of piling on the replica holding their context (docs/BENCHMARKS.md).
    /// Left out of the serialized form at its default, so a filter built before it still
    /// accepts the copy's configuration.
    #[serde(skip_serializing_if = "is_default_agent_decode_weight")]
    pub agent_decode_weight: f64,
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
    /// Costs within this many ms of the best count as a tie, which goes to the tied replica
    /// with the most free KV (the seed draws among equals).
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
    /// cannot tell). The idle time per token is the configured `itl_ms_idle`, with or without
    /// calibration: a replica's learned step time under prefill load already includes that
    /// prefill (read, it cost the tuning split's TTFT p99 geomean 1.183 -> 1.449 with learned
    /// rates). The expected output is `max_tokens` capped at `default_output_tokens`: a
    /// client's cap is not its length. 0 turns it off. Left out of the serialized form at its
    /// default, so a filter built before it still accepts the copy's configuration.
    #[serde(skip_serializing_if = "is_default_contention_weight")]
    pub prefill_contention_weight: f64,
    /// Time constant of the decayed sum of uncached prompt tokens routed to each replica,
    /// ms: how far back the prefill contention looks (about the life of a short request).
    #[serde(skip_serializing_if = "is_default_contention_window")]
    pub prefill_contention_window_ms: f64,
    /// A request scored to its first token (chat, completions) is not sent where its own wait
    /// (the queue ahead plus its prefill there) is more than this many times the soonest
    /// start any candidate offers it, while a candidate within that bound is usable: such a
    /// candidate is ordered after the rest, as a guarded one is. The load terms price what a
    /// placement costs other requests (the decodes a long prefill stalls, the sessions
    /// crowding a replica), and uncapped they could park one request behind tens of seconds
    /// of other prefills to spare them: the cost of the TTFT tail. The agent APIs are left
    /// out (their cost is the whole answer's, which a crowded replica does lengthen). A ratio,
    /// not a time, so it holds on any hardware. 0 turns it off. Left out of the serialized
    /// form at its default, so a filter built before it still accepts the copy's
    /// configuration.
    #[serde(skip_serializing_if = "is_default_wait_cap")]
    pub wait_cap: f64,
    /// A request scored to its last token (the agent APIs) prices its own decode at the mean
    /// output such requests have had (from the usage their outcomes report, once
    /// [`LEARNED_OUTPUT_MIN_SAMPLES`] have), capped by its `max_tokens`, instead of at
    /// `default_output_tokens`: an agent's turns are mostly short tool calls, and its client's
    /// cap (tens of thousands for Anthropic's API) says nothing of their length. Priced at the
    /// default, a move off the replica holding the context read a decode saving several
    /// times too large. Requests scored to their first token keep the default (there the
    /// output only weighs the prefill contention, tuned with it). Left out of the serialized
    /// form at its default, so a filter built before it still accepts the copy's
    /// configuration.
    #[serde(skip_serializing_if = "is_default_learn_agent_output")]
    pub learn_agent_output: bool,
}

/// Outcomes with usage a request scored to its last token needs seen before the mean output
/// replaces `default_output_tokens` for it ([`ScoringConfig::learn_agent_output`]).
pub const LEARNED_OUTPUT_MIN_SAMPLES: u32 = 20;

/// The default `learn_agent_output`. Chosen on fleet-sim's tuning split (seeds 1-2): TTFT p50
/// / p99 geomeans against the best peer 0.862 / 1.048 -> 0.852 / 1.037, loss cells 4 -> 3,
/// end to end 0.954 -> 0.956; docs/BENCHMARKS.md.
const LEARN_AGENT_OUTPUT: bool = true;

fn is_default_learn_agent_output(b: &bool) -> bool {
    *b == LEARN_AGENT_OUTPUT
}

/// The default `wait_cap`. Chosen on fleet-sim's tuning split (seeds 1-2): TTFT p50 / p99
/// geomeans against the best peer and the end-to-end geomean were 0.864 / 1.084 / 0.960
/// without the cap, 0.890 / 1.045 / 0.980 at 2.5, 0.873 / 1.044 / 0.971 at 3 and 0.862 /
/// 1.048 / 0.954 at 4; docs/BENCHMARKS.md.
const WAIT_CAP: f64 = 4.0;

fn is_default_wait_cap(w: &f64) -> bool {
    *w == WAIT_CAP
}

/// The default `prefill_contention_weight`. Chosen on fleet-sim's tuning split (seeds 1-2):
/// TTFT geomean against the best peer p50 / p99 was 0.961 / 1.180 without the term, 0.909 /
/// 1.136 at 0.5 and 0.915 / 1.142 at 1.0 (window 1 s), 0.916 / 1.162 at 0.25 (window 2 s);
/// see docs/BENCHMARKS.md.
const CONTENTION_WEIGHT: f64 = 0.5;
/// The default `prefill_contention_window_ms`, chosen with the weight: at 0.5, a 0.5 s window
/// gave 0.961 / 1.178, 1 s 0.909 / 1.136, 2 s 0.916 / 1.181 and 4 s 0.917 / 1.161.
const CONTENTION_WINDOW_MS: f64 = 1000.0;

/// The default `agent_decode_weight`: time to the last token, what an agent waits for.
const AGENT_DECODE_WEIGHT: f64 = 1.0;

fn is_default_agent_decode_weight(w: &f64) -> bool {
    *w == AGENT_DECODE_WEIGHT
}

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
            agent_decode_weight: AGENT_DECODE_WEIGHT,
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
            wait_cap: WAIT_CAP,
            learn_agent_output: LEARN_AGENT_OUTPUT,
        }
    }
}

impl ScoringConfig {
    /// The decode weight for a request of `api`: `agent_decode_weight` for the agent APIs,
    /// `decode_weight` for the rest (a route call that names no API included).
    pub fn decode_weight_for(&self, api: Option<ApiKind>) -> f64 {
        match api {
            Some(ApiKind::Messages | ApiKind::Responses) => self.agent_decode_weight,
            Some(ApiKind::Chat | ApiKind::Completion) | None => self.decode_weight,
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
    /// How long an approximate index entry lives without a touch. vLLM keeps a block until
    /// its memory is needed, however old, and each endpoint's index is already bounded by its
    /// KV capacity, least recently used first: the TTL only bounds how long a belief outlives
    /// what the router cannot see (traffic that bypasses it, an endpoint that stops
    /// reporting). Default 10 minutes (chosen on the tuning split: 2 minutes forgot prefixes a
    /// Mooncake window reuses minutes later that the engines still held).
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
    /// How long a routed request's blocks count as present on its endpoint, unconfirmed by
    /// events, once its prefill is seen to run (its first token, or its end): a burst with one
    /// prefix does not scatter before the first events land. Until then they stay, however
    /// long the queue ahead of it: no event can come sooner.
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
            index_ttl_ms: 600_000,
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
