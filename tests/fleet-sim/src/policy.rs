//! Routing policies fleet-sim compares, each a faithful model of a published algorithm with its
//! published defaults (each policy's doc comment names its source), plus kvroute itself running scorer-core's
//! `Router` (the same code the control plane runs).
//!
//! A policy sees what a real router would: the request's tokens, its own in-flight accounting,
//! scraped replica metrics (refreshed on an interval, so they are stale like the real thing)
//! and, for policies that use them, the engines' KV events.

use hashbrown::HashMap;
use scorer_core::calibration::EngineCounters;
use scorer_core::hash::{model_seed, token_block_hashes};
use scorer_core::index::{EndpointId, PrefixIndex};
use scorer_core::pools::ServedModel;
use scorer_core::precise::{KvEvent, PreciseTracker};
use scorer_core::protocol::{ApiKind, FirstToken, Outcome, RouteRequest};
use scorer_core::reuse::ReuseTotals;
use scorer_core::router::{Decision, EndpointLoad, EndpointMetrics, Router, RouterConfig};
use scorer_core::sync::{DecisionRecord, LocalRouter, SyncEvent, SyncLog, serve_sync};

/// The model name every simulated replica serves.
pub const MODEL: &str = "sim-model";

/// Scraped view of one replica (vLLM `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaSnapshot {
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc`.
    pub kv_usage: f64,
    /// KV capacity in tokens.
    pub capacity_tokens: u64,
    /// Engine block size in tokens.
    pub block_size: u32,
    /// The engine's token budget per step (`--max-num-batched-tokens`, which Dynamo's workers
    /// publish in their runtime config).
    pub max_batched_tokens: u32,
    /// The counters online calibration reads (`vllm:prompt_tokens_total` and friends).
    pub counters: EngineCounters,
    /// The context length in the engine's `/v1/models` card (`max_model_len`; 0: not known),
    /// which a control plane polls beside the scrape.
    pub max_model_len: u32,
}

impl ReplicaSnapshot {
    /// What a scrape of an engine with these stats and this profile shows.
    pub fn of(stats: &vllm_sim::engine::EngineStats, profile: &vllm_sim::Profile) -> Self {
        Self {
            running: stats.num_running,
            waiting: stats.num_waiting,
            kv_usage: stats.kv_cache_usage,
            capacity_tokens: profile.kv_capacity_tokens,
            block_size: profile.block_size,
            max_batched_tokens: profile.max_num_batched_tokens,
            max_model_len: profile.max_model_len,
            counters: EngineCounters {
                prompt_tokens: stats.prompt_tokens as f64,
                prefix_cache_hit_tokens: stats.prefix_cache_hits as f64,
                prefill_computed_tokens: stats.prefill_computed_tokens as f64,
                prefill_seconds: stats.prefill_seconds,
                prefill_count: stats.requests_finished as f64,
                itl_seconds: stats.itl_seconds,
                itl_count: stats.itl_count as f64,
            },
        }
    }
}

/// A request as a router sees it.
#[derive(Debug, Clone, Copy)]
pub struct PolicyRequest<'a> {
    /// Workload index, unique per run.
    pub id: usize,
    /// Prompt token ids (what vllm-router's render endpoint or a tokenizer gives).
    pub tokens: &'a [u32],
    /// The client's `max_tokens`, when it sends one: a cap, never the length the answer will
    /// have (no real router knows that).
    pub max_tokens: Option<u32>,
    /// Conversation, when the workload has one.
    pub session: Option<u64>,
    /// Leading prompt tokens the client marked with `cache_control` (0: none); only kvroute
    /// reads it, as the peers ignore the marker.
    pub marked_tokens: u32,
    /// The API the request came in on (its path); only kvroute reads it.
    pub api: ApiKind,
}

/// What a finished request's response reported: the engine's cached tokens and, from its
/// `usage`, the output tokens (only kvroute reads them, as its proxy does; `None` where a
/// test finishes a request without them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Served {
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u32,
    /// `usage.completion_tokens`.
    pub output_tokens: Option<u32>,
}

/// A routing policy driven by fleet-sim's virtual clock.
pub trait Policy {
    /// Name in tables (the CLI name).
    fn name(&self) -> &str;
    /// Picks a replica index for `request` at `now_ms`.
    fn route(&mut self, request: &PolicyRequest<'_>, now_ms: f64) -> usize;
    /// A fresh scrape of every replica arrived.
    fn on_metrics(&mut self, _replicas: &[ReplicaSnapshot], _now_ms: f64) {}
    /// The request's first token was streamed.
    fn on_first_token(&mut self, _id: usize, _replica: usize, _now_ms: f64) {}
    /// The request finished; `served` is what its response reported.
    fn on_finish(&mut self, _id: usize, _replica: usize, _now_ms: f64, _served: Served) {}
    /// The engine refused the request before computing any of it (a prompt longer than the
    /// model's context): vLLM answers 400, which is all a real router sees. Policies that only
    /// count load treat it as finished.
    fn on_refused(&mut self, id: usize, replica: usize, now_ms: f64) {
        self.on_finish(id, replica, now_ms, Served::default());
    }
    /// KV events of one replica (only delivered when `wants_kv_events`).
    fn on_kv_events(&mut self, _replica: usize, _events: &[KvEvent], _now_ms: f64) {}
    /// Whether this policy consumes KV events.
    fn wants_kv_events(&self) -> bool {
        false
    }
    /// How often this policy's real router scrapes replica metrics (virtual ms); `None` takes
    /// the run's `metrics_interval_ms` (kvroute's control plane: 100 ms).
    fn metrics_interval_ms(&self) -> Option<f64> {
        None
    }
    /// Whether `request` waits in the router's own queue instead of being routed now (Dynamo's
    /// router queue); a held request is offered again, oldest first, after every engine step.
    fn holds_in_queue(&mut self, _request: &PolicyRequest<'_>, _now_ms: f64) -> bool {
        false
    }
    /// Routing on the engines' exact state (only the oracle): `None` routes with [`Policy::route`].
    fn route_exact(
        &mut self,
        _request: &PolicyRequest<'_>,
        _fleet: &ExactFleet<'_>,
        _now_ms: f64,
    ) -> Option<usize> {
        None
    }
    /// Cached tokens the policy predicted for request `id` on its replica, if it predicts any.
    fn predicted_cached_tokens(&self, _id: usize) -> Option<u32> {
        None
    }
    /// Share of its decisions taken in a proxy without asking the control plane, for a policy
    /// that decides in proxies.
    fn local_decision_fraction(&self) -> Option<f64> {
        None
    }
    /// Endpoint routing-state changes its self-check made (into load-only and back), for
    /// kvroute's policies: on a healthy simulated fleet any is a false alarm.
    fn routing_state_changes(&self) -> Option<u64> {
        None
    }
    /// The fleet numbers kvroute's router counted (reuse available, aimed for, delivered, the
    /// gap by reason; `scorer_core::reuse`), for kvroute's policies.
    fn reuse(&self) -> Option<ReuseTotals> {
        None
    }
    /// The router's load view of every replica, as the control plane's admission reads it
    /// (`Router::endpoint_loads`); `false` for policies without one (peers).
    fn endpoint_loads(
        &self,
        _now_ms: f64,
        _reference_tokens: u32,
        _out: &mut Vec<EndpointLoad>,
    ) -> bool {
        false
    }
}

/// The engines' exact state at a routing instant, for the oracle: each engine as of the end of
/// its step in flight, and when that step ends (`None`: the engine is idle and a new request
/// starts a step at once).
pub struct ExactFleet<'a> {
    /// The engines, by replica index.
    pub engines: &'a [vllm_sim::Engine],
    /// End of each engine's step in flight (virtual ms).
    pub busy_until_ms: &'a [Option<f64>],
}

/// Every policy name the CLI accepts, in table order.
pub const POLICY_NAMES: &[&str] = &[
    "round-robin",
    "random",
    "least-request",
    "power-of-two",
    "sglang-cache-aware",
    "sglang-legacy",
    "llmd",
    "llmd-optimized",
    "dynamo",
    "kvroute",
    "kvroute-precise",
    "kvroute-local",
    "oracle",
];

/// Checks a policy spec as the CLI takes it: a name of [`POLICY_NAMES`], options only for
/// `kvroute-local` (`kvroute-local:proxies=4,workers=4,sync_ms=25`); the error says what is
/// wrong, where [`build_with`] only says no.
pub fn check_policy(spec: &str) -> Result<(), String> {
    let (name, options) = spec.split_once(':').unwrap_or((spec, ""));
    if !POLICY_NAMES.contains(&name) {
        return Err(format!(
            "unknown policy {name:?}; known: {}",
            POLICY_NAMES.join(", ")
        ));
    }
    if name == "kvroute-local" {
        LocalSettings::parse(options).map(|_| ())
    } else if options.is_empty() {
        Ok(())
    } else {
        Err(format!("policy {name} takes no options"))
    }
}

/// Puts a comma-split policy list back together: a `key=value` piece without a `:` belongs to
/// the policy before it, so `kvroute,kvroute-local:proxies=2,sync_ms=10` stays two policies
/// although the CLI splits lists on commas.
pub fn regroup_policy_specs(pieces: &[String]) -> Vec<String> {
    let mut specs: Vec<String> = Vec::new();
    for piece in pieces {
        match specs.last_mut() {
            Some(last) if piece.contains('=') && !piece.contains(':') && last.contains(':') => {
                last.push(',');
                last.push_str(piece);
            }
            _ => specs.push(piece.clone()),
        }
    }
    specs
}

/// Canonical text bytes per token of fleet-sim's workloads unless told otherwise: the
/// router's default `bytes_per_token`, so approximate mode's estimate is right on average.
pub const DEFAULT_TEXT_BYTES_PER_TOKEN: f64 = 4.0;

/// What the workload's text looks like to a router that reads bytes, not tokens (kvroute's
/// approximate filter); every other policy reads token ids.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TextModel {
    /// Every token spells this many canonical bytes: approximate mode's picture is exact when
    /// the ratio is the router's.
    Uniform(f64),
    /// Each stream is one of [`crate::workload::TEXT_STYLES`] and its tokens spell 1 to 8 bytes
    /// ([`crate::workload::token_text`]): right on average, wrong for each document.
    Styled,
}

impl Default for TextModel {
    fn default() -> Self {
        TextModel::Uniform(DEFAULT_TEXT_BYTES_PER_TOKEN)
    }
}

/// Builds the policy called `name` for `replicas` replicas, with kvroute's scoring defaults.
pub fn build(name: &str, replicas: usize, seed: u64) -> Option<Box<dyn Policy>> {
    build_with(
        name,
        replicas,
        seed,
        &RouterConfig::default(),
        TextModel::default(),
    )
}

/// Builds the policy called `name` (a spec [`check_policy`] accepts); kvroute policies take
/// `kvroute` as their router config
/// (block sizes are set by the mode). `text` is how the workload's text spells its tokens:
/// the approximate filter sees bytes, not tokens.
pub fn build_with(
    name: &str,
    replicas: usize,
    seed: u64,
    kvroute: &RouterConfig,
    text: TextModel,
) -> Option<Box<dyn Policy>> {
    let (name, options) = name.split_once(':').unwrap_or((name, ""));
    if !options.is_empty() && name != "kvroute-local" {
        return None;
    }
    Some(match name {
        "round-robin" => Box::new(RoundRobin {
            next: 0,
            n: replicas,
        }),
        "random" => Box::new(RandomPick {
            rng: SplitMix(seed),
            n: replicas,
        }),
        "least-request" => Box::new(CountPolicy::new(
            "least-request",
            replicas,
            seed,
            least_request,
        )),
        "power-of-two" => Box::new(CountPolicy::new(
            "power-of-two",
            replicas,
            seed,
            power_of_two,
        )),
        "sglang-cache-aware" => Box::new(SglangCacheAware::new(replicas, seed, false)),
        "sglang-legacy" => Box::new(SglangCacheAware::new(replicas, seed, true)),
        "llmd" => Box::new(Llmd::new(replicas, seed)),
        "llmd-optimized" => Box::new(LlmdOptimized::new(replicas, seed)),
        "oracle" => Box::new(crate::oracle::Oracle::new(seed)),
        "dynamo" => Box::new(Dynamo::new(replicas, seed)),
        "kvroute" => Box::new(Kvroute::new(replicas, seed, false, kvroute.clone(), text)),
        "kvroute-precise" => Box::new(Kvroute::new(replicas, seed, true, kvroute.clone(), text)),
        "kvroute-local" => Box::new(KvrouteLocal::new(
            replicas,
            seed,
            LocalSettings::parse(options).ok()?,
            kvroute.clone(),
            text,
        )),
        _ => return None,
    })
}

/// splitmix64: a tiny seeded generator, so runs are deterministic.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);
impl SplitMix {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// Picks uniformly among the indices whose key equals the best (lowest) key.
fn argmin_random<K: PartialOrd + Copy>(keys: impl Iterator<Item = K>, rng: &mut SplitMix) -> usize {
    let keys: Vec<K> = keys.collect();
    let Some(best) = keys
        .iter()
        .copied()
        .reduce(|a, b| if b < a { b } else { a })
    else {
        return 0;
    };
    let ties: Vec<usize> = keys
        .iter()
        .enumerate()
        .filter(|(_, k)| **k == best)
        .map(|(i, _)| i)
        .collect();
    ties[rng.below(ties.len())]
}

/// Router-side in-flight request counts (every load-aware router keeps these).
#[derive(Debug, Clone)]
struct Load {
    inflight: Vec<u32>,
    at: HashMap<usize, usize>,
}
impl Load {
    fn new(n: usize) -> Self {
        Self {
            inflight: vec![0; n],
            at: HashMap::new(),
        }
    }
    fn add(&mut self, id: usize, replica: usize) {
        self.inflight[replica] += 1;
        self.at.insert(id, replica);
    }
    fn finish(&mut self, id: usize) {
        if let Some(r) = self.at.remove(&id) {
            self.inflight[r] = self.inflight[r].saturating_sub(1);
        }
    }
}

struct RoundRobin {
    next: usize,
    n: usize,
}
impl Policy for RoundRobin {
    fn name(&self) -> &str {
        "round-robin"
    }
    fn route(&mut self, _: &PolicyRequest<'_>, _: f64) -> usize {
        let r = self.next % self.n;
        self.next += 1;
        r
    }
}

struct RandomPick {
    rng: SplitMix,
    n: usize,
}
impl Policy for RandomPick {
    fn name(&self) -> &str {
        "random"
    }
    fn route(&mut self, _: &PolicyRequest<'_>, _: f64) -> usize {
        self.rng.below(self.n)
    }
}

/// A policy that picks from the router's own in-flight counts alone: least-request and
/// power-of-two differ only in `choose`.
struct CountPolicy {
    name: &'static str,
    load: Load,
    rng: SplitMix,
    choose: fn(&[u32], &mut SplitMix) -> usize,
}
impl CountPolicy {
    fn new(
        name: &'static str,
        n: usize,
        seed: u64,
        choose: fn(&[u32], &mut SplitMix) -> usize,
    ) -> Self {
        Self {
            name,
            load: Load::new(n),
            rng: SplitMix(seed),
            choose,
        }
    }
}
impl Policy for CountPolicy {
    fn name(&self) -> &str {
        self.name
    }
    fn route(&mut self, r: &PolicyRequest<'_>, _: f64) -> usize {
        let pick = (self.choose)(&self.load.inflight, &mut self.rng);
        self.load.add(r.id, pick);
        pick
    }
    fn on_finish(&mut self, id: usize, _: usize, _: f64, _: Served) {
        self.load.finish(id);
    }
}

/// Envoy's / the gateways' least-request: fewest router-tracked in-flight requests.
fn least_request(inflight: &[u32], rng: &mut SplitMix) -> usize {
    argmin_random(inflight.iter().copied(), rng)
}

/// Power of two choices (SGLang `power_of_two`, Ray Serve LLM default): two random replicas,
/// the less loaded wins.
fn power_of_two(inflight: &[u32], rng: &mut SplitMix) -> usize {
    let n = inflight.len();
    let a = rng.below(n);
    let mut b = rng.below(n);
    if n > 1 && a == b {
        b = (a + 1 + rng.below(n - 1)) % n;
    }
    if inflight[b] < inflight[a] { b } else { a }
}

/// A prefix index learned from routing history only (what SGLang's radix tree and llm-d's
/// approximate prefix producer keep): `grain`-token blocks, one LRU tenant per replica. Shared by
/// the SGLang and llm-d models, which differ only in grain, capacity and what they do with it.
struct HistoryIndex {
    index: PrefixIndex,
    grain: usize,
    /// Longest prefix (in blocks) a lookup matches; `usize::MAX` for no cap.
    max_blocks: usize,
}

impl HistoryIndex {
    fn new(grain: usize, max_blocks: usize) -> Self {
        Self {
            index: PrefixIndex::new(u64::MAX / 4),
            grain,
            max_blocks,
        }
    }

    /// Caps every replica's tenant at `blocks` entries (LRU beyond).
    fn set_capacity(&mut self, replicas: usize, blocks: usize) {
        for i in 0..replicas {
            self.index.set_capacity(EndpointId(i as u16), blocks);
        }
    }

    /// The request's block hashes (at most `max_blocks`).
    fn hashes(&self, tokens: &[u32]) -> Vec<u64> {
        let mut hashes = token_block_hashes(model_seed(MODEL), tokens, self.grain);
        hashes.truncate(self.max_blocks);
        hashes
    }

    /// Matched blocks per replica.
    fn matched(&self, hashes: &[u64], replicas: usize) -> Vec<usize> {
        let mut matched = vec![0usize; replicas];
        self.index
            .matched_prefix(hashes, |id, d| matched[usize::from(id.0)] = d);
        matched
    }

    /// Records that `hashes` went to `replica`.
    fn insert(&mut self, replica: usize, hashes: &[u64], now_ms: f64) {
        self.index
            .insert(EndpointId(replica as u16), hashes, now_ms as u64);
    }

    fn len_for(&self, replica: usize) -> usize {
        self.index.len_for(EndpointId(replica as u16))
    }
}

/// The first index with the lowest key: Rust's `Iterator::min_by_key`, which the SGLang /
/// Shepherd gateway uses, so its ties go to the first worker.
fn argmin_first<K: PartialOrd + Copy>(keys: impl Iterator<Item = K>) -> usize {
    let mut best: Option<(usize, K)> = None;
    for (i, k) in keys.enumerate() {
        if best.is_none_or(|(_, b)| k < b) {
            best = Some((i, k));
        }
    }
    best.map_or(0, |(i, _)| i)
}

/// SGLang's cache-aware router, now the Shepherd Model Gateway (SMG), with its CLI defaults
/// (`--cache-threshold 0.3`, `--balance-abs-threshold 64`, `--balance-rel-threshold 1.5`,
/// `--max-tree-size 2^26`). Follows `lightseekorg/smg:model_gateway/src/policies/cache_aware.rs`
/// (`select_worker_with_tokens` / `select_worker_with_text`, approximate tree, no KV events):
/// imbalanced (`max - min > abs` and `max > rel * min` of the router's in-flight counts) goes
/// to the least-loaded worker; otherwise a match rate above the threshold goes to the matching
/// worker, and a miss goes to the least-loaded worker (`min_by_key`, ties to the first).
/// `legacy` keeps the old rule (sgl-router before SMG): a miss goes to the worker with the
/// smallest tree, ties at random.
///
/// Where the model differs from the real gateway: its tree is over token ids at 16-token
/// granularity (the gRPC token tree is page aligned; the HTTP path matches characters), so
/// it sees a slightly coarser match; ties between equally deep tenants are broken at random
/// (the real tree returns one tenant); tree eviction is LRU per tenant at insert time instead
/// of a periodic sweep (it sees evictions sooner, at the same cap). Like the real router it
/// never sees the engines' evictions.
struct SglangCacheAware {
    load: Load,
    tree: HistoryIndex,
    rng: SplitMix,
    cache_threshold: f64,
    balance_abs: u32,
    balance_rel: f64,
    legacy: bool,
}
const SGLANG_GRAIN: usize = 16;
impl SglangCacheAware {
    fn new(n: usize, seed: u64, legacy: bool) -> Self {
        let mut tree = HistoryIndex::new(SGLANG_GRAIN, usize::MAX);
        tree.set_capacity(n, (1usize << 26) / SGLANG_GRAIN);
        Self {
            load: Load::new(n),
            tree,
            rng: SplitMix(seed),
            cache_threshold: 0.3,
            balance_abs: 64,
            balance_rel: 1.5,
            legacy,
        }
    }
}
impl Policy for SglangCacheAware {
    fn name(&self) -> &str {
        if self.legacy {
            "sglang-legacy"
        } else {
            "sglang-cache-aware"
        }
    }
    fn route(&mut self, r: &PolicyRequest<'_>, now_ms: f64) -> usize {
        let hashes = self.tree.hashes(r.tokens);
        let loads = &self.load.inflight;
        let (max_load, min_load) = (
            *loads.iter().max().unwrap_or(&0),
            *loads.iter().min().unwrap_or(&0),
        );
        let imbalanced = max_load.saturating_sub(min_load) > self.balance_abs
            && f64::from(max_load) > self.balance_rel * f64::from(min_load);
        let least_loaded = |rng: &mut SplitMix, legacy: bool| {
            if legacy {
                argmin_random(loads.iter().copied(), rng)
            } else {
                argmin_first(loads.iter().copied())
            }
        };
        let pick = if imbalanced {
            least_loaded(&mut self.rng, self.legacy)
        } else {
            let matched = self.tree.matched(&hashes, loads.len());
            let depth = matched.iter().copied().max().unwrap_or(0);
            let best: Vec<usize> = (0..matched.len())
                .filter(|&i| matched[i] == depth)
                .collect();
            let match_rate = (depth * SGLANG_GRAIN) as f64 / r.tokens.len().max(1) as f64;
            if match_rate > self.cache_threshold && depth > 0 {
                best[self.rng.below(best.len())]
            } else if self.legacy {
                // The tenant with the smallest tree has the most free (approximate) cache.
                let sizes = (0..loads.len()).map(|i| self.tree.len_for(i));
                argmin_random(sizes, &mut self.rng)
            } else {
                least_loaded(&mut self.rng, false)
            }
        };
        self.tree.insert(pick, &hashes, now_ms);
        self.load.add(r.id, pick);
        pick
    }
    fn on_finish(&mut self, id: usize, _: usize, _: f64, _: Served) {
        self.load.finish(id);
    }
}

/// The endpoint picker's metrics refresh (llm-d / GIE `--refresh-metrics-interval`, 50 ms).
const LLMD_SCRAPE_MS: f64 = 50.0;
/// llm-d's approximate prefix producer hashes 64-token blocks.
const LLMD_BLOCK: usize = 64;

/// Sizes an llm-d index from the first scrape: per-pod LRU of `num_gpu_blocks` of the engine's
/// blocks, counted in producer blocks (what `vllm:cache_config_info` tells the EPP).
fn size_llmd_index(index: &mut HistoryIndex, sized: &mut bool, replicas: &[ReplicaSnapshot]) {
    if *sized {
        return;
    }
    for (i, r) in replicas.iter().enumerate() {
        let blocks = r.capacity_tokens / LLMD_BLOCK as u64;
        index
            .index
            .set_capacity(EndpointId(i as u16), blocks as usize);
    }
    *sized = true;
}

/// llm-d's scheduler with the chart's default profile: approximate prefix-cache scorer
/// (weight 3), queue scorer (2), KV-cache utilisation scorer (2), max-score picker. Follows
/// `llm-d/llm-d-inference-scheduler` / GIE `config/charts/routerlib/templates/_config.yaml`
/// (the 3/2/2 `default-plugins.yaml`) and the scorers in
/// `pkg/epp/framework/plugins/scheduling/scorer/` (`queuedepth/queue.go`: min-max of waiting;
/// kv-cache: `1 - usage`; prefix: matched blocks over total blocks). The prefix producer
/// hashes 64-token blocks and learns the pick before the server sees the request; per-pod LRU
/// sized from `num_gpu_blocks`; queue and KV scores come from metrics scraped every 50 ms.
///
/// Where the model differs: it never sees the engines' evictions (neither does the real
/// approximate producer); a scrape is instantaneous (the real one has an HTTP round trip).
struct Llmd {
    index: HistoryIndex,
    snapshot: Vec<ReplicaSnapshot>,
    rng: SplitMix,
    sized: bool,
}
impl Llmd {
    fn new(n: usize, seed: u64) -> Self {
        Self {
            index: HistoryIndex::new(LLMD_BLOCK, usize::MAX),
            snapshot: vec![ReplicaSnapshot::default(); n],
            rng: SplitMix(seed),
            sized: false,
        }
    }
}
impl Policy for Llmd {
    fn name(&self) -> &str {
        "llmd"
    }
    fn metrics_interval_ms(&self) -> Option<f64> {
        Some(LLMD_SCRAPE_MS)
    }
    fn on_metrics(&mut self, replicas: &[ReplicaSnapshot], _: f64) {
        self.snapshot.copy_from_slice(replicas);
        size_llmd_index(&mut self.index, &mut self.sized, replicas);
    }
    fn route(&mut self, r: &PolicyRequest<'_>, now_ms: f64) -> usize {
        let hashes = self.index.hashes(r.tokens);
        let n = self.snapshot.len();
        let matched = self.index.matched(&hashes, n);
        let total = hashes.len().max(1) as f64;
        let (qmin, qmax) = self.snapshot.iter().fold((u32::MAX, 0), |(lo, hi), s| {
            (lo.min(s.waiting), hi.max(s.waiting))
        });
        let scores = (0..n).map(|i| {
            let s = &self.snapshot[i];
            let prefix = matched[i] as f64 / total;
            let queue = if qmax == qmin {
                1.0
            } else {
                f64::from(qmax - s.waiting) / f64::from(qmax - qmin)
            };
            let kv = 1.0 - s.kv_usage.clamp(0.0, 1.0);
            // Negated so argmin picks the max score.
            -(3.0 * prefix + 2.0 * queue + 2.0 * kv)
        });
        let pick = argmin_random(scores, &mut self.rng);
        self.index.insert(pick, &hashes, now_ms);
        pick
    }
}

/// llm-d's current recommended configuration, the optimized-baseline guide
/// (`llm-d/llm-d:guides/optimized-baseline/router/optimized-baseline.values.yaml`):
/// `approx-prefix-cache-producer` (64-token blocks, `maxPrefixTokensToMatch 40960`) and
/// `inflight-load-producer` feed a `prefix-cache-affinity-filter` (`affinityThreshold 0.80`,
/// `maxTokensInFlightPenalty 286720`, `maxTTFTPenaltyMs 0`) and one `token-load-scorer`
/// (`1 - min(1, inFlightTokens / 4194304)`), max-score picker with random ties. Endpoints whose
/// prefix score (matched over total blocks) reaches 0.80 are kept, or every endpoint if none
/// does; stickiness is broken when the best sticky endpoint carries more than 286,720 in-flight
/// tokens over the best other one. In-flight tokens are the uncached prompt part (as the
/// producer estimates it), added at the pick and released at the first streamed token.
///
/// Where the model differs: the TTFT gate is off in the guide (`maxTTFTPenaltyMs 0`) and here;
/// the producer's estimate of the uncached part uses the same history index, so like the real
/// one it never sees evictions; `outputRatio` output estimation is off (the guide's default).
struct LlmdOptimized {
    index: HistoryIndex,
    /// Router-side in-flight uncached prompt tokens per endpoint.
    inflight_tokens: Vec<u64>,
    /// Request id -> (endpoint, tokens it added).
    inflight: HashMap<usize, (usize, u64)>,
    rng: SplitMix,
    sized: bool,
}
const LLMD_AFFINITY_THRESHOLD: f64 = 0.80;
const LLMD_MAX_TOKENS_IN_FLIGHT_PENALTY: u64 = 286_720;
const LLMD_TOKEN_LOAD_THRESHOLD: f64 = 4_194_304.0;
const LLMD_MAX_PREFIX_TOKENS: usize = 40_960;
impl LlmdOptimized {
    fn new(n: usize, seed: u64) -> Self {
        Self {
            index: HistoryIndex::new(LLMD_BLOCK, LLMD_MAX_PREFIX_TOKENS / LLMD_BLOCK),
            inflight_tokens: vec![0; n],
            inflight: HashMap::new(),
            rng: SplitMix(seed),
            sized: false,
        }
    }
    fn release(&mut self, id: usize) {
        if let Some((endpoint, tokens)) = self.inflight.remove(&id) {
            self.inflight_tokens[endpoint] = self.inflight_tokens[endpoint].saturating_sub(tokens);
        }
    }
}
impl Policy for LlmdOptimized {
    fn name(&self) -> &str {
        "llmd-optimized"
    }
    fn metrics_interval_ms(&self) -> Option<f64> {
        Some(LLMD_SCRAPE_MS)
    }
    fn on_metrics(&mut self, replicas: &[ReplicaSnapshot], _: f64) {
        size_llmd_index(&mut self.index, &mut self.sized, replicas);
    }
    fn route(&mut self, r: &PolicyRequest<'_>, now_ms: f64) -> usize {
        let hashes = self.index.hashes(r.tokens);
        let n = self.inflight_tokens.len();
        let matched = self.index.matched(&hashes, n);
        let total = hashes.len().max(1) as f64;
        let sticky: Vec<usize> = (0..n)
            .filter(|&i| matched[i] as f64 / total >= LLMD_AFFINITY_THRESHOLD)
            .collect();
        let min_tokens = |set: &mut dyn Iterator<Item = usize>| {
            set.map(|i| self.inflight_tokens[i])
                .min()
                .unwrap_or(u64::MAX)
        };
        let keep_sticky = !sticky.is_empty() && {
            let best_sticky = min_tokens(&mut sticky.iter().copied());
            let best_other = min_tokens(&mut (0..n).filter(|i| !sticky.contains(i)));
            best_other == u64::MAX
                || best_sticky.saturating_sub(best_other) <= LLMD_MAX_TOKENS_IN_FLIGHT_PENALTY
        };
        let candidates: Vec<usize> = if keep_sticky {
            sticky
        } else {
            (0..n).collect()
        };
        let scores = candidates.iter().map(|&i| {
            let load = self.inflight_tokens[i] as f64 / LLMD_TOKEN_LOAD_THRESHOLD;
            -(1.0 - load.min(1.0))
        });
        let pick = candidates[argmin_random(scores, &mut self.rng)];
        let cached = (matched[pick] * LLMD_BLOCK).min(r.tokens.len());
        let uncached = (r.tokens.len() - cached) as u64;
        self.inflight_tokens[pick] += uncached;
        self.inflight.insert(r.id, (pick, uncached));
        self.index.insert(pick, &hashes, now_ms);
        pick
    }
    fn on_first_token(&mut self, id: usize, _: usize, _: f64) {
        self.release(id);
    }
    fn on_finish(&mut self, id: usize, _: usize, _: f64, _: Served) {
        self.release(id);
    }
}

/// Dynamo's router queue threshold: requests wait in the router while every worker's active
/// prefill tokens exceed this fraction of its `max_num_batched_tokens` (`KvRouterConfig`'s
/// default `router_queue_threshold: Some(4.0)`).
const DYNAMO_QUEUE_THRESHOLD: f64 = 4.0;

/// NVIDIA Dynamo's KV router with its defaults: KV events on (precise overlap), overlap credit
/// 1.0, prefill load scale 1.0, temperature 0 (argmin, random ties), active-block and
/// prefill-token tracking, the router queue (`router_queue_threshold` 4.0, FCFS). Follows
/// `ai-dynamo/dynamo:lib/kv-router/src/scheduling/selector/default.rs` (`worker_logit`; the
/// older `scheduling/selector.rs` has the same formula):
/// `logit = scale * max(raw_prefill_blocks - credit * overlap_blocks, 0) + decode_blocks`
/// (`prefill_load_scale`, `overlap_score_credit`), with
/// `raw_prefill_blocks = (active prefill tokens + isl) / block_size`
/// (fractional: the request's partial block counts by its tokens) and `decode_blocks` the
/// worker's distinct active complete blocks plus the request's complete blocks new to it (a
/// partial block has no hash and is not counted). Prefill tokens are released at the first
/// token, blocks at completion. The queue (`lib/kv-router/src/scheduling/queue.rs`, defaults in
/// `lib/kv-router/src/scheduling/config.rs`) holds a request while every worker is busy and
/// re-offers it, oldest first, when one frees.
///
/// Where the model differs: the queue threshold default has moved between releases (4.0 in
/// `KvRouterConfig::default()` and the Python binding; some frontend CLI docs say 2.0);
/// `decode_active_request_weight`, the overlap-credit decay and host/disk tiers are left at
/// zero / off; output blocks are not tracked (`router_track_output_blocks` is off by default);
/// KV events arrive at the end of the engine step that made them, with no NATS delay, so it
/// sees evictions a little sooner than the real router.
struct Dynamo {
    gpu: PrefixIndex,
    offload: PrefixIndex,
    tracker: PreciseTracker,
    block_size: usize,
    max_batched_tokens: f64,
    prefill_tokens: Vec<f64>,
    /// Per worker: refcounts of the blocks of its active requests.
    active_blocks: Vec<HashMap<u64, u32>>,
    active: HashMap<usize, DynamoSlot>,
    rng: SplitMix,
}

/// Dynamo's slot tracker entry for one request.
struct DynamoSlot {
    worker: usize,
    prefill_tokens: f64,
    hashes: Vec<u64>,
    prefill_pending: bool,
}

impl Dynamo {
    fn new(n: usize, seed: u64) -> Self {
        Self {
            gpu: PrefixIndex::new(u64::MAX / 4),
            offload: PrefixIndex::new(u64::MAX / 4),
            tracker: PreciseTracker::new(),
            block_size: 16,
            max_batched_tokens: 8192.0,
            prefill_tokens: vec![0.0; n],
            active_blocks: vec![HashMap::new(); n],
            active: HashMap::new(),
            rng: SplitMix(seed),
        }
    }
}
impl Policy for Dynamo {
    fn name(&self) -> &str {
        "dynamo"
    }
    fn wants_kv_events(&self) -> bool {
        true
    }
    fn on_metrics(&mut self, replicas: &[ReplicaSnapshot], _: f64) {
        if let Some(r) = replicas.first() {
            self.block_size = r.block_size.max(1) as usize;
            if r.max_batched_tokens > 0 {
                self.max_batched_tokens = f64::from(r.max_batched_tokens);
            }
        }
    }
    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], now_ms: f64) {
        let id = EndpointId(replica as u16);
        for e in events {
            if self
                .tracker
                .apply(
                    id,
                    MODEL,
                    e,
                    &mut self.gpu,
                    &mut self.offload,
                    now_ms as u64,
                )
                .is_err()
            {
                self.tracker.clear(id, &mut self.gpu, &mut self.offload);
            }
        }
    }
    fn holds_in_queue(&mut self, _: &PolicyRequest<'_>, _: f64) -> bool {
        let busy = DYNAMO_QUEUE_THRESHOLD * self.max_batched_tokens;
        self.prefill_tokens.iter().all(|&t| t > busy)
    }
    fn route(&mut self, r: &PolicyRequest<'_>, _: f64) -> usize {
        let bs = self.block_size as f64;
        let hashes = token_block_hashes(model_seed(MODEL), r.tokens, self.block_size);
        let n = self.prefill_tokens.len();
        let mut overlap = vec![0usize; n];
        self.gpu
            .matched_prefix(&hashes, |id, d| overlap[usize::from(id.0)] = d);
        let isl = r.tokens.len() as f64;
        let new_tokens = |w: usize| (isl - overlap[w] as f64 * bs).max(0.0);
        let costs = (0..n).map(|w| {
            let prefill = (self.prefill_tokens[w] + new_tokens(w)) / bs;
            let active = &self.active_blocks[w];
            let new_blocks = hashes.iter().filter(|h| !active.contains_key(*h)).count();
            prefill + (active.len() + new_blocks) as f64
        });
        let pick = argmin_random(costs, &mut self.rng);
        let added = new_tokens(pick);
        self.prefill_tokens[pick] += added;
        for h in &hashes {
            *self.active_blocks[pick].entry(*h).or_insert(0) += 1;
        }
        self.active.insert(
            r.id,
            DynamoSlot {
                worker: pick,
                prefill_tokens: added,
                hashes,
                prefill_pending: true,
            },
        );
        pick
    }
    fn on_first_token(&mut self, id: usize, _: usize, _: f64) {
        if let Some(slot) = self.active.get_mut(&id)
            && slot.prefill_pending
        {
            self.prefill_tokens[slot.worker] =
                (self.prefill_tokens[slot.worker] - slot.prefill_tokens).max(0.0);
            slot.prefill_pending = false;
        }
    }
    fn on_finish(&mut self, id: usize, replica: usize, now_ms: f64, _: Served) {
        self.on_first_token(id, replica, now_ms);
        if let Some(slot) = self.active.remove(&id) {
            let active = &mut self.active_blocks[slot.worker];
            for h in slot.hashes {
                if let hashbrown::hash_map::Entry::Occupied(mut e) = active.entry(h) {
                    *e.get_mut() -= 1;
                    if *e.get() == 0 {
                        e.remove();
                    }
                }
            }
        }
    }
}

/// kvroute: scorer-core's `Router`, the code the control plane runs, in approximate mode (index
/// learned from its own decisions) or precise mode (index fed by KV events, plus its decisions).
struct Kvroute {
    router: Router,
    precise: bool,
    /// Decision id, prompt tokens (the usage the engine reports) and routing time of each
    /// routed request.
    decisions: HashMap<usize, (u64, u32, u64)>,
    predicted: HashMap<usize, u32>,
    seed: SplitMix,
    addresses: Vec<String>,
    /// How the workload's text spells its tokens.
    text: TextModel,
    /// Tokens of text one approximate hash block (`block_bytes`) covers (uniform text).
    approx_block_tokens: usize,
    /// First-token reports on their way: (when the proxy's next feedback tick delivers it,
    /// decision id, the proxy's time from routing to the first token), in order.
    first_tokens: std::collections::VecDeque<(u64, u64, u64)>,
}
/// The filter's feedback tick (`feedback_interval_ms` default): a first-token report waits for
/// the next one, so the router hears of a first token up to this late.
const FEEDBACK_TICK_MS: u64 = 200;
/// Approximate mode hashes 256-byte blocks of canonical text, as the filter does.
const KVROUTE_APPROX_BLOCK_BYTES: usize = 256;
impl Kvroute {
    fn new(n: usize, seed: u64, precise: bool, base: RouterConfig, text: TextModel) -> Self {
        let config = RouterConfig {
            block_bytes: KVROUTE_APPROX_BLOCK_BYTES,
            ..base
        };
        // The filter cuts text, not tokens: a block holds however many tokens its bytes
        // encode, while the router converts it back with its configured `bytes_per_token`.
        let text = match text {
            TextModel::Uniform(r) if !(r.is_finite() && r > 0.0) => TextModel::default(),
            other => other,
        };
        let text_bytes_per_token = match text {
            TextModel::Uniform(r) => r,
            TextModel::Styled => DEFAULT_TEXT_BYTES_PER_TOKEN,
        };
        let approx_block_tokens =
            ((KVROUTE_APPROX_BLOCK_BYTES as f64 / text_bytes_per_token).round() as usize).max(1);
        let mut router = Router::new(config, 1);
        let addresses: Vec<String> = (0..n).map(|i| format!("replica-{i}")).collect();
        for a in &addresses {
            // At most MAX_ENDPOINTS replicas are simulated; the CLI checks.
            let _ = router.upsert_endpoint(a);
            // Approximate mode has no KV-event stream to lose: an endpoint marked as one
            // expected and down would be named `degraded` (no_kv_events) for the whole run.
            if precise {
                router.set_event_stream(a, true);
            }
        }
        Self {
            router,
            precise,
            decisions: HashMap::new(),
            predicted: HashMap::new(),
            seed: SplitMix(seed),
            addresses,
            text,
            approx_block_tokens,
            first_tokens: std::collections::VecDeque::new(),
        }
    }

    /// Hands the router the first-token reports whose feedback tick has come by `now_ms`.
    fn deliver_first_tokens(&mut self, now_ms: u64) {
        while let Some(&(due, decision_id, ttft_ms)) = self.first_tokens.front() {
            if due > now_ms {
                break;
            }
            self.first_tokens.pop_front();
            self.router.first_token(decision_id, due, Some(ttft_ms));
        }
    }

    /// Reports request `id`'s outcome: `served`, or refused unprefilled (`None`, vLLM's 400).
    fn report(&mut self, id: usize, replica: usize, now_ms: f64, served: Option<Served>) {
        self.deliver_first_tokens(now_ms as u64);
        if let Some((decision_id, prompt_tokens, _)) = self.decisions.remove(&id) {
            let outcome = proxy_outcome(
                decision_id,
                &self.addresses[replica],
                prompt_tokens,
                served.map(|s| s.cached_tokens),
                served.and_then(|s| s.output_tokens),
            );
            self.router.feedback(&outcome, now_ms as u64);
        }
    }

    /// The route call the filter would send for `r`: hashes of the text it sees, no tokens
    /// unless precise (shared with `kvroute-local`, so both policies see the same inputs).
    fn route_request(&self, r: &PolicyRequest<'_>) -> RouteRequest {
        let (block_hashes, prompt_bytes, marked_blocks) = match self.text {
            TextModel::Uniform(ratio) => (
                token_block_hashes(model_seed(MODEL), r.tokens, self.approx_block_tokens),
                (r.tokens.len() as f64 * ratio).round() as u64,
                // The filter marks the whole blocks inside the marked prefix.
                r.marked_tokens as usize / self.approx_block_tokens,
            ),
            TextModel::Styled => {
                // The filter's own hashing of the text the tokens spell, spelled once: the
                // marked prefix first, to know where it ends.
                let marked = (r.marked_tokens as usize).min(r.tokens.len());
                let (head, tail) = r.tokens.split_at(marked);
                let mut text = Vec::new();
                crate::workload::spell(head, &mut text);
                let marked_bytes = text.len();
                crate::workload::spell(tail, &mut text);
                (
                    scorer_core::hash::block_hashes(
                        model_seed(MODEL),
                        &text,
                        KVROUTE_APPROX_BLOCK_BYTES,
                    ),
                    text.len() as u64,
                    marked_bytes / KVROUTE_APPROX_BLOCK_BYTES,
                )
            }
        };
        RouteRequest {
            model: MODEL.into(),
            block_hashes,
            prompt_bytes,
            // Precise: the control plane's tokeniser's count; else the filter's estimate, 4
            // bytes a token (the router counts from the bytes).
            prompt_tokens: if self.precise {
                r.tokens.len() as u32
            } else {
                u32::try_from(prompt_bytes.div_ceil(4)).unwrap_or(u32::MAX)
            },
            marked_blocks: marked_blocks as u32,
            max_output_tokens: r.max_tokens,
            session: r.session.map(|s| s.to_string()),
            prompt_text: None,
            api: Some(r.api),
            cache_salt: None,
            tenant: None,
            criticality: None,
            previous_response_id: None,
            previous_response_endpoint: None,
            call_id: None,
            finished: Vec::new(),
            first_tokens: Vec::new(),
            // Every simulated client streams: its first token is seen when it is generated.
            stream: true,
            token_block_hashes: if self.precise {
                let block = self.router.config().precise.block_tokens;
                token_block_hashes(model_seed(MODEL), r.tokens, block)
            } else {
                Vec::new()
            },
        }
    }

    /// The replica a decision names; a refused decision falls back to a random replica, as
    /// the filter falls back to Envoy's own balancing.
    fn pick(&mut self, decision: &Decision) -> usize {
        decision
            .response
            .endpoints
            .first()
            .and_then(|a| self.addresses.iter().position(|x| x == a))
            .unwrap_or_else(|| self.seed.below(self.addresses.len()))
    }
}
impl Policy for Kvroute {
    fn name(&self) -> &str {
        if self.precise {
            "kvroute-precise"
        } else {
            "kvroute"
        }
    }
    fn wants_kv_events(&self) -> bool {
        self.precise
    }
    fn on_metrics(&mut self, replicas: &[ReplicaSnapshot], now_ms: f64) {
        for (a, s) in self.addresses.iter().zip(replicas) {
            let m = EndpointMetrics {
                running: s.running,
                waiting: s.waiting,
                kv_usage: s.kv_usage,
                capacity_tokens: Some(s.capacity_tokens),
                counters: Some(s.counters),
                ..Default::default()
            };
            self.router.update_metrics(a, m, now_ms as u64);
            if s.max_model_len > 0 {
                // The control plane's `/v1/models` poll (a no-op while the card is unchanged).
                let card = ServedModel {
                    id: MODEL.into(),
                    parent: None,
                    max_model_len: Some(s.max_model_len),
                };
                self.router.set_served_models(a, vec![card]);
            }
        }
    }
    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], now_ms: f64) {
        let address = &self.addresses[replica];
        for e in events {
            // A failed event drops that replica's precise state inside the router; it is scored
            // approximately until new stores rebuild it.
            let _ = self.router.apply_kv_event(address, MODEL, e, now_ms as u64);
        }
    }
    fn route(&mut self, r: &PolicyRequest<'_>, now_ms: f64) -> usize {
        self.deliver_first_tokens(now_ms as u64);
        let request = self.route_request(r);
        let decision = self
            .router
            .route(&request, now_ms as u64, self.seed.next_u64());
        let pick = self.pick(&decision);
        let cached = decision.candidates.first().map_or(0, |c| c.cached_tokens);
        self.decisions.insert(
            r.id,
            (
                decision.response.decision_id,
                r.tokens.len() as u32,
                now_ms as u64,
            ),
        );
        self.predicted.insert(r.id, cached);
        pick
    }
    fn on_first_token(&mut self, id: usize, _: usize, now_ms: f64) {
        if let Some(&(decision_id, _, decided_ms)) = self.decisions.get(&id) {
            let now = now_ms as u64;
            let due = (now / FEEDBACK_TICK_MS + 1) * FEEDBACK_TICK_MS;
            self.first_tokens
                .push_back((due, decision_id, now.saturating_sub(decided_ms)));
        }
    }
    fn on_finish(&mut self, id: usize, replica: usize, now_ms: f64, served: Served) {
        self.report(id, replica, now_ms, Some(served));
    }
    fn on_refused(&mut self, id: usize, replica: usize, now_ms: f64) {
        self.report(id, replica, now_ms, None);
    }
    fn predicted_cached_tokens(&self, id: usize) -> Option<u32> {
        self.predicted.get(&id).copied()
    }
    fn routing_state_changes(&self) -> Option<u64> {
        Some(self.router.stats().state_changes)
    }
    fn reuse(&self) -> Option<ReuseTotals> {
        Some(self.router.fleet_reuse())
    }
    fn endpoint_loads(
        &self,
        now_ms: f64,
        reference_tokens: u32,
        out: &mut Vec<EndpointLoad>,
    ) -> bool {
        self.router
            .endpoint_loads(now_ms as u64, reference_tokens, out);
        true
    }
}

/// Settings of `kvroute-local`, the filter deciding in the proxy (issue #15): how many copies
/// of the routing state decide, and how stale they get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalSettings {
    /// Envoy proxies behind the load balancer.
    pub proxies: usize,
    /// Worker threads per proxy; each runs its own filter VM, so its own copy.
    pub workers: usize,
    /// Virtual ms between one copy's sync calls (the filter's default,
    /// [`scorer_core::sync::DEFAULT_SYNC_INTERVAL_MS`]).
    pub sync_ms: u64,
    /// Each copy's bound on its prefix index over all endpoints (the filter's
    /// `max_index_blocks`; `None`, its default: each endpoint's KV capacity alone), to
    /// measure what a proxy's memory bound costs in hits.
    pub max_index_blocks: Option<u64>,
}

impl Default for LocalSettings {
    fn default() -> Self {
        LocalSettings {
            proxies: 4,
            workers: 4,
            sync_ms: scorer_core::sync::DEFAULT_SYNC_INTERVAL_MS,
            max_index_blocks: None,
        }
    }
}

impl LocalSettings {
    /// Reads `proxies=4,workers=4,sync_ms=25,max_index_blocks=N` (any subset, empty for the
    /// defaults), so a
    /// policy list can sweep the staleness without a flag per setting.
    pub fn parse(options: &str) -> Result<Self, String> {
        let mut settings = LocalSettings::default();
        for kv in options.split(',').filter(|s| !s.is_empty()) {
            let (key, value) = kv
                .split_once('=')
                .ok_or_else(|| format!("kvroute-local option {kv:?} is not key=value"))?;
            let number: u64 =
                value.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    format!("kvroute-local {key}={value:?}: need a positive integer")
                })?;
            match key {
                "proxies" => settings.proxies = number as usize,
                "workers" => settings.workers = number as usize,
                "sync_ms" => settings.sync_ms = number,
                "max_index_blocks" => settings.max_index_blocks = Some(number),
                _ => {
                    return Err(format!(
                        "unknown kvroute-local option {key:?} (proxies, workers, sync_ms, \
                         max_index_blocks)"
                    ));
                }
            }
        }
        if settings.proxies.saturating_mul(settings.workers) > MAX_LOCAL_COPIES {
            return Err(format!(
                "kvroute-local: at most {MAX_LOCAL_COPIES} copies (proxies x workers)"
            ));
        }
        Ok(settings)
    }

    /// The name in tables: `kvroute-local` plus the settings that differ from the defaults,
    /// so two settings compared in one run stay apart.
    pub fn name(&self) -> String {
        let defaults = LocalSettings::default();
        let mut options = Vec::new();
        if self.proxies != defaults.proxies {
            options.push(format!("proxies={}", self.proxies));
        }
        if self.workers != defaults.workers {
            options.push(format!("workers={}", self.workers));
        }
        if self.sync_ms != defaults.sync_ms {
            options.push(format!("sync_ms={}", self.sync_ms));
        }
        if let Some(max) = self.max_index_blocks {
            options.push(format!("max_index_blocks={max}"));
        }
        if options.is_empty() {
            "kvroute-local".into()
        } else {
            format!("kvroute-local:{}", options.join(","))
        }
    }
}

/// Most copies `kvroute-local` simulates (each is a whole `Router`).
pub const MAX_LOCAL_COPIES: usize = 1024;

/// Entries the simulated control plane's sync log holds: far more than a few intervals of
/// traffic, so no copy ever resets in these runs (resets are scorer-core's to test).
const LOCAL_LOG_CAPACITY: usize = 1 << 20;

/// Decisions and outcomes a copy queues between syncs before dropping the oldest.
const LOCAL_MAX_PENDING: usize = 1 << 16;

/// A copy whose last sync is older than this many intervals calls out instead (a missed
/// tick or two is tolerated, as the filter does); the simulated syncs never fail, so this
/// only matters before a copy's first sync.
const LOCAL_STALE_TICKS: u64 = 3;

/// Who took one decision in `kvroute-local`, so its outcome goes back there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decider {
    /// The control plane, on a callout from a copy that was not ready.
    Central,
    /// The copy at this index (`proxy * workers + worker`).
    Copy(usize),
}

/// One routed request of `kvroute-local`: who decided, the decision id, the prompt tokens.
#[derive(Debug, Clone, Copy)]
struct LocalDecision {
    decider: Decider,
    /// The copy the request landed on (it decided, or it made the route call).
    copy: usize,
    decision_id: u64,
    prompt_tokens: u32,
    /// When it was routed (the proxy's first-token report measures from here).
    routed_ms: u64,
}

/// kvroute deciding in the proxy (issue #15): `proxies x workers` copies of the routing state
/// ([`LocalRouter`]) decide on what they last synced, while the control plane's `Router` gets
/// the scraped metrics exactly as single-router `kvroute` does and keeps the [`SyncLog`] every
/// copy pulls from. Each copy syncs every `sync_ms` of virtual time, the copies' ticks spread
/// evenly over the interval. A request lands on a pseudo-random copy (a load balancer over
/// proxies, Envoy's connection spread over workers); a copy that has not synced yet calls the
/// control plane, whose decision is logged for the others. The simulator has no timer hook, so
/// ticks run lazily: before each request, outcome or scrape every tick due strictly before
/// `now` runs in time order (a tick at the same millisecond as an event comes after it), which
/// in virtual time is the same as running them on their timers. Syncs are instantaneous (no
/// round trip).
struct KvrouteLocal {
    settings: LocalSettings,
    name: String,
    /// The control plane: its router, the scraped metrics, the request shape and the seeds.
    central: Kvroute,
    log: SyncLog,
    copies: Vec<LocalRouter>,
    /// Ticks run so far over all copies; tick `m` is copy `m % copies` at `m * sync_ms / copies`.
    ticks: u64,
    placement: SplitMix,
    decisions: HashMap<usize, LocalDecision>,
    predicted: HashMap<usize, u32>,
    /// Decisions the control plane took because the chosen copy was not ready.
    callouts: u64,
}

impl KvrouteLocal {
    fn new(
        n: usize,
        seed: u64,
        settings: LocalSettings,
        base: RouterConfig,
        text: TextModel,
    ) -> Self {
        let copies = settings.proxies * settings.workers;
        KvrouteLocal {
            settings,
            name: settings.name(),
            central: Kvroute::new(n, seed, false, base, text),
            log: SyncLog::new(LOCAL_LOG_CAPACITY, 1),
            copies: (0..copies)
                .map(|_| {
                    LocalRouter::new(LOCAL_MAX_PENDING).with_max_index_blocks(
                        settings
                            .max_index_blocks
                            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
                    )
                })
                .collect(),
            ticks: 0,
            placement: SplitMix(seed ^ 0x10ca_1c09_1e5d_a7a5),
            decisions: HashMap::new(),
            predicted: HashMap::new(),
            callouts: 0,
        }
    }

    /// Virtual time of tick `m` (ms): copies take turns, `sync_ms / copies` apart.
    fn tick_ms(&self, m: u64) -> f64 {
        m as f64 * self.settings.sync_ms as f64 / self.copies.len() as f64
    }

    /// Runs every sync tick due strictly before `now_ms`, oldest first.
    fn catch_up(&mut self, now_ms: f64) {
        loop {
            let at = self.tick_ms(self.ticks);
            if at >= now_ms {
                break;
            }
            let index = (self.ticks % self.copies.len() as u64) as usize;
            let copy = &mut self.copies[index];
            let response = serve_sync(
                &mut self.log,
                &mut self.central.router,
                copy.sync_request(),
                at as u64,
            );
            copy.apply(response, at as u64);
            self.ticks += 1;
        }
    }

    /// Reports a request's outcome where its decision was taken: `served`, or refused
    /// unprefilled (`None`, vLLM's 400).
    fn report(&mut self, id: usize, replica: usize, now_ms: f64, served: Option<Served>) {
        self.catch_up(now_ms);
        let Some(decision) = self.decisions.remove(&id) else {
            return;
        };
        let outcome = proxy_outcome(
            decision.decision_id,
            &self.central.addresses[replica],
            decision.prompt_tokens,
            served.map(|s| s.cached_tokens),
            served.and_then(|s| s.output_tokens),
        );
        let at = now_ms as u64;
        match decision.decider {
            Decider::Copy(index) => self.copies[index].outcome(outcome, at),
            Decider::Central => {
                self.central.router.feedback(&outcome, at);
                self.log.push(SyncEvent::Outcome { origin: 0, outcome }, at);
            }
        }
    }
}

/// The outcome a proxy reports for a request of `prompt_tokens`: served with `cached` tokens
/// cached, or refused by vLLM before computing any of it (`None`: a 400, no usage).
fn proxy_outcome(
    decision_id: u64,
    endpoint: &str,
    prompt_tokens: u32,
    cached: Option<u32>,
    completion_tokens: Option<u32>,
) -> Outcome {
    match cached {
        Some(cached_tokens) => Outcome {
            decision_id,
            endpoint: endpoint.to_string(),
            status: 200,
            prompt_tokens: Some(prompt_tokens),
            cached_tokens: Some(cached_tokens),
            completion_tokens,
            ..Outcome::default()
        },
        None => Outcome {
            decision_id,
            endpoint: endpoint.to_string(),
            status: 400,
            ..Outcome::default()
        },
    }
}

impl Policy for KvrouteLocal {
    fn name(&self) -> &str {
        &self.name
    }
    fn on_metrics(&mut self, replicas: &[ReplicaSnapshot], now_ms: f64) {
        self.catch_up(now_ms);
        self.central.on_metrics(replicas, now_ms);
    }
    fn route(&mut self, r: &PolicyRequest<'_>, now_ms: f64) -> usize {
        self.catch_up(now_ms);
        let request = self.central.route_request(r);
        let at = now_ms as u64;
        let workers = self.settings.workers;
        let proxy = self.placement.below(self.settings.proxies);
        let worker = self.placement.below(workers);
        let index = proxy * workers + worker;
        let seed = self.central.seed.next_u64();
        let max_age = self.settings.sync_ms.saturating_mul(LOCAL_STALE_TICKS);
        let copy = &mut self.copies[index];
        let local = if copy.ready(at, max_age) {
            copy.route(&request, at, seed)
        } else {
            None
        };
        let (decider, decision) = match local {
            Some(decision) => (Decider::Copy(index), decision),
            None => {
                // The callout: the control plane decides, and logs it for every copy.
                self.callouts += 1;
                let decision = self.central.router.route(&request, at, seed);
                if let Some(endpoint) = decision.response.endpoints.first() {
                    // The proxy reads the answer: its copy applies it at once.
                    copy.adopt(&request, endpoint, decision.response.decision_id, at);
                    self.log.push(
                        SyncEvent::Decision {
                            origin: 0,
                            record: Box::new(DecisionRecord {
                                decision_id: decision.response.decision_id,
                                endpoint: endpoint.clone(),
                                request,
                                age_ms: 0,
                            }),
                        },
                        at,
                    );
                }
                (Decider::Central, decision)
            }
        };
        let pick = self.central.pick(&decision);
        let cached = decision.candidates.first().map_or(0, |c| c.cached_tokens);
        self.decisions.insert(
            r.id,
            LocalDecision {
                decider,
                copy: index,
                decision_id: decision.response.decision_id,
                prompt_tokens: r.tokens.len() as u32,
                routed_ms: now_ms as u64,
            },
        );
        self.predicted.insert(r.id, cached);
        pick
    }
    fn on_first_token(&mut self, id: usize, _: usize, now_ms: f64) {
        self.catch_up(now_ms);
        // The proxy's VM sees the first byte: its copy applies it at once, the rest of the
        // fleet hears of it through the next sync, as in the filter.
        if let Some(decision) = self.decisions.get(&id) {
            let first = FirstToken {
                decision_id: decision.decision_id,
                decision_tag: 0,
                ttft_ms: Some((now_ms as u64).saturating_sub(decision.routed_ms)),
            };
            self.copies[decision.copy].first_token(first, now_ms as u64);
        }
    }
    fn on_finish(&mut self, id: usize, replica: usize, now_ms: f64, served: Served) {
        self.report(id, replica, now_ms, Some(served));
    }
    fn on_refused(&mut self, id: usize, replica: usize, now_ms: f64) {
        self.report(id, replica, now_ms, None);
    }
    fn predicted_cached_tokens(&self, id: usize) -> Option<u32> {
        self.predicted.get(&id).copied()
    }
    fn local_decision_fraction(&self) -> Option<f64> {
        let local: u64 = self.copies.iter().map(LocalRouter::local_decisions).sum();
        let all = local + self.callouts;
        (all > 0).then(|| local as f64 / all as f64)
    }
    fn routing_state_changes(&self) -> Option<u64> {
        let copies: u64 = self
            .copies
            .iter()
            .filter_map(LocalRouter::router)
            .map(|r| r.stats().state_changes)
            .sum();
        Some(copies + self.central.router.stats().state_changes)
    }
    fn reuse(&self) -> Option<ReuseTotals> {
        // The control plane hears of every decision and outcome (the copies' reported ones too).
        Some(self.central.router.fleet_reuse())
    }
    fn endpoint_loads(
        &self,
        now_ms: f64,
        reference_tokens: u32,
        out: &mut Vec<EndpointLoad>,
    ) -> bool {
        // Admission stays in the control plane: its view is the central router's.
        self.central.endpoint_loads(now_ms, reference_tokens, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What approximate kvroute predicts cached for a prompt it routed once before.
    fn predicted_repeat(text_bytes_per_token: f64) -> u32 {
        let tokens: Vec<u32> = (1000..1640).collect();
        predicted_repeat_of(&tokens, TextModel::Uniform(text_bytes_per_token))
    }

    /// What approximate kvroute predicts cached for `tokens` routed once before.
    fn predicted_repeat_of(tokens: &[u32], text: TextModel) -> u32 {
        let mut policy = build_with("kvroute", 2, 1, &RouterConfig::default(), text)
            .expect("kvroute is a policy");
        for id in 0..2 {
            let request = PolicyRequest {
                id,
                tokens,
                max_tokens: None,
                session: None,
                marked_tokens: 0,
                api: ApiKind::Chat,
            };
            policy.route(&request, id as f64);
        }
        policy.predicted_cached_tokens(1).expect("kvroute predicts")
    }

    fn request(id: usize, tokens: &[u32]) -> PolicyRequest<'_> {
        PolicyRequest {
            id,
            tokens,
            max_tokens: None,
            session: None,
            marked_tokens: 0,
            api: ApiKind::Chat,
        }
    }

    // SMG sends a miss to the least-loaded worker (ties to the first); the legacy rule to the
    // smallest tree. Replica 0 has the big tree but nothing in flight.
    #[test]
    fn sglang_miss_goes_to_least_loaded_legacy_to_smallest_tree() {
        for (legacy, want) in [(false, 0), (true, 1)] {
            let mut p = SglangCacheAware::new(2, 1, legacy);
            let big: Vec<u32> = (0..3000).collect();
            let small: Vec<u32> = (10_000..10_100).collect();
            p.tree.insert(0, &p.tree.hashes(&big), 0.0);
            p.tree.insert(1, &p.tree.hashes(&small), 0.0);
            p.load.add(99, 1);
            let miss: Vec<u32> = (50_000..51_000).collect();
            assert_eq!(p.route(&request(1, &miss), 1.0), want, "legacy {legacy}");
        }
    }

    // The affinity filter keeps replicas holding >= 80% of the prompt unless they carry far
    // more in-flight tokens than the rest; the token-load scorer then picks the lightest.
    #[test]
    fn llmd_optimized_sticks_until_the_in_flight_penalty() {
        let mut p = LlmdOptimized::new(3, 1);
        let prompt: Vec<u32> = (0..6400).collect();
        let hashes = p.index.hashes(&prompt);
        p.index.insert(2, &hashes, 0.0);
        p.inflight_tokens = vec![0, 10, 200_000];
        assert_eq!(p.route(&request(1, &prompt), 1.0), 2);
        assert_eq!(
            p.inflight_tokens[2], 200_000,
            "a full hit adds no uncached tokens"
        );
        p.inflight_tokens[2] = 400_000;
        assert_eq!(p.route(&request(2, &prompt), 2.0), 0);
        p.on_first_token(2, 0, 3.0);
        assert_eq!(p.inflight_tokens[0], 0);
    }

    // Dynamo's partial block counts by its tokens in the prefill term and not at all in the
    // decode term; the router queue holds requests while every worker is busy.
    #[test]
    fn dynamo_counts_partial_blocks_as_prefill_only_and_queues() {
        let mut p = Dynamo::new(2, 1);
        let prompt: Vec<u32> = (0..40).collect(); // 2 complete blocks + 8 tokens
        assert!(!p.holds_in_queue(&request(1, &prompt), 0.0));
        let w = p.route(&request(1, &prompt), 0.0);
        assert_eq!(p.prefill_tokens[w], 40.0);
        assert_eq!(p.active_blocks[w].len(), 2);
        p.prefill_tokens = vec![40_000.0, 40_000.0];
        assert!(p.holds_in_queue(&request(2, &prompt), 1.0));
        p.prefill_tokens[1] = 0.0;
        assert!(!p.holds_in_queue(&request(2, &prompt), 1.0));
    }

    #[test]
    fn approximate_mode_counts_tokens_through_the_texts_bytes() {
        // 640 tokens of 4-byte text are 10 blocks of 256 bytes: the router's 4 bytes a token
        // is right. The same tokens spelled in 8 bytes each look twice as long to it.
        let right = predicted_repeat(4.0);
        let doubled = predicted_repeat(8.0);
        assert!((576..=640).contains(&right), "{right}");
        assert!(
            (2 * right - 128..=2 * right + 128).contains(&doubled),
            "{doubled} vs {right}"
        );
    }

    #[test]
    fn styled_text_is_counted_at_the_routers_ratio_not_its_own() {
        // The router counts 4 bytes a token: a stream of denser text (fewer bytes a token)
        // looks shorter to it than it is, a stream of sparser text longer.
        let mut seen = [false; 2];
        for stream in 0..32u64 {
            let mut tokens = Vec::new();
            crate::workload::push_stream(&mut tokens, stream, 2_000);
            let bytes = crate::workload::text_of(&tokens).len() as f64;
            let predicted = f64::from(predicted_repeat_of(&tokens, TextModel::Styled));
            // Whole 256-byte blocks of the text, at 4 bytes a token.
            let expected = (bytes / 256.0).floor() * 64.0;
            assert!(
                (predicted - expected).abs() <= 64.0,
                "{predicted} vs {expected}"
            );
            seen[usize::from(bytes > 4.0 * 2_000.0)] = true;
        }
        assert_eq!(seen, [true, true], "streams of both kinds");
    }
}

#[cfg(test)]
mod local_tests {
    use super::*;
    use crate::des::{SimConfig, run};
    use crate::workload::from_spec;

    fn snapshots(n: usize) -> Vec<ReplicaSnapshot> {
        vec![
            ReplicaSnapshot {
                capacity_tokens: 200_000,
                block_size: 16,
                ..ReplicaSnapshot::default()
            };
            n
        ]
    }

    fn local(replicas: usize, seed: u64, options: &str) -> KvrouteLocal {
        KvrouteLocal::new(
            replicas,
            seed,
            LocalSettings::parse(options).unwrap(),
            RouterConfig::default(),
            TextModel::default(),
        )
    }

    /// A prompt of `len` tokens unique to `group` (shared by every prompt of the group), plus
    /// `tail` tokens unique to `(group, member)`.
    fn prompt(group: u32, member: u32, len: u32, tail: u32) -> Vec<u32> {
        let mut tokens: Vec<u32> = (0..len).map(|i| group * 100_000 + i).collect();
        tokens.extend((0..tail).map(|i| 50_000_000 + group * 10_000 + member * 1_000 + i));
        tokens
    }

    #[test]
    fn settings_parse_name_and_regroup() {
        assert_eq!(LocalSettings::parse("").unwrap(), LocalSettings::default());
        let s = LocalSettings::parse("workers=2,sync_ms=10").unwrap();
        assert_eq!((s.proxies, s.workers, s.sync_ms), (4, 2, 10));
        assert_eq!(s.name(), "kvroute-local:workers=2,sync_ms=10");
        assert_eq!(LocalSettings::default().name(), "kvroute-local");
        assert!(LocalSettings::parse("sync_ms=0").is_err());
        assert!(LocalSettings::parse("threads=2").is_err());
        let bounded = LocalSettings::parse("max_index_blocks=4096").unwrap();
        assert_eq!(bounded.max_index_blocks, Some(4096));
        assert_eq!(bounded.name(), "kvroute-local:max_index_blocks=4096");
        assert!(check_policy("kvroute-local:proxies=2").is_ok());
        assert!(check_policy("kvroute:proxies=2").is_err());
        let pieces: Vec<String> = ["kvroute", "kvroute-local:proxies=2", "sync_ms=10", "llmd"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            regroup_policy_specs(&pieces),
            ["kvroute", "kvroute-local:proxies=2,sync_ms=10", "llmd"]
        );
        let built = build("kvroute-local:sync_ms=200", 2, 1).unwrap();
        assert_eq!(built.name(), "kvroute-local:sync_ms=200");
    }

    // The same seed replays the same run: placement, ticks and decisions are all seeded.
    #[test]
    fn deterministic_for_a_seed() {
        let workload = from_spec("multi-turn:conversations=6,turns=3,rps=4", 3).unwrap();
        let cfg = SimConfig {
            replicas: 4,
            profile: vllm_sim::Profile::llama8b_h100(),
            seed: 3,
            metrics_interval_ms: 100.0,
        };
        let once = |seed| {
            let mut policy = build("kvroute-local:proxies=2,workers=2", 4, seed).unwrap();
            run(&workload, policy.as_mut(), &cfg).unwrap().records
        };
        let (a, b) = (once(3), once(3));
        assert_eq!(a, b);
        let placements = |seed| {
            let mut p = local(4, seed, "");
            (0..32).map(|_| p.placement.below(16)).collect::<Vec<_>>()
        };
        assert_ne!(placements(3), placements(4), "the seed picks the copies");
    }

    // One copy that synced once and never again is a single router: it sees every decision
    // and outcome, so it decides exactly as `kvroute` does when the metrics do not change.
    #[test]
    fn one_copy_that_synced_once_is_a_single_router() {
        let n = 4;
        let mut single = Kvroute::new(n, 9, false, RouterConfig::default(), TextModel::default());
        // Ties break by seed and decision id; number the single router's decisions as the
        // copy's (replica tag 1, the log's first) so the two are comparable bit for bit.
        single.router = Router::new(
            single.router.config().clone(),
            (1 << scorer_core::sync::REPLICA_SHIFT) + 1,
        );
        for a in &single.addresses {
            single.router.upsert_endpoint(a).unwrap();
        }
        let mut copy = local(n, 9, "proxies=1,workers=1,sync_ms=1000000000");
        single.on_metrics(&snapshots(n), 0.0);
        copy.on_metrics(&snapshots(n), 0.0);
        let mut id = 0;
        for round in 0..4u32 {
            for group in 0..6u32 {
                let tokens = prompt(group, round, 1_500 + 200 * group, 300);
                let request = PolicyRequest {
                    id,
                    tokens: &tokens,
                    max_tokens: Some(64),
                    session: None,
                    marked_tokens: 0,
                    api: ApiKind::Chat,
                };
                let now = 1.0 + id as f64;
                let (a, b) = (single.route(&request, now), copy.route(&request, now));
                assert_eq!(a, b, "request {id}");
                assert_eq!(
                    single.predicted_cached_tokens(id),
                    copy.predicted_cached_tokens(id)
                );
                // Every other request finishes before the next one arrives.
                if id % 2 == 0 {
                    single.on_finish(id, a, now + 0.5, Served::default());
                    copy.on_finish(id, b, now + 0.5, Served::default());
                }
                id += 1;
            }
        }
        assert_eq!(copy.callouts, 0, "every decision was local");
        assert_eq!(copy.copies[0].local_decisions(), id as u64);
    }

    // With 16 copies a conversation's turns land on different copies, yet turn 2 follows turn 1
    // to its replica once turn 1's decision has been synced to the copy deciding turn 2.
    #[test]
    fn turn_two_follows_turn_one_after_a_sync() {
        let n = 8;
        let mut policy = local(n, 5, "proxies=4,workers=4,sync_ms=50");
        policy.on_metrics(&snapshots(n), 0.0);
        let mut now = 200.0;
        let mut other_copy = 0;
        for conversation in 0..24u32 {
            let turn1 = prompt(conversation, 0, 2_000, 0);
            let mut turn2 = turn1.clone();
            turn2.extend(prompt(1_000 + conversation, 0, 0, 300));
            let (id1, id2) = (2 * conversation as usize, 2 * conversation as usize + 1);
            let session = Some(u64::from(conversation));
            let first = policy.route(
                &PolicyRequest {
                    id: id1,
                    tokens: &turn1,
                    max_tokens: None,
                    session,
                    marked_tokens: 0,
                    api: ApiKind::Chat,
                },
                now,
            );
            let first_by = policy.decisions[&id1].decider;
            policy.on_finish(id1, first, now + 20.0, Served::default());
            // Two intervals: turn 1's copy has pushed its decision and every copy has pulled it.
            now += 2.0 * 50.0 + 21.0;
            let second = policy.route(
                &PolicyRequest {
                    id: id2,
                    tokens: &turn2,
                    max_tokens: None,
                    session,
                    marked_tokens: 0,
                    api: ApiKind::Chat,
                },
                now,
            );
            assert_eq!(second, first, "conversation {conversation}");
            assert!(policy.predicted_cached_tokens(id2).unwrap() > 0);
            let second_by = policy.decisions[&id2].decider;
            assert!(
                matches!(second_by, Decider::Copy(_)),
                "a hit is decided locally"
            );
            if second_by != first_by {
                other_copy += 1;
            }
            policy.on_finish(id2, second, now + 20.0, Served::default());
            now += 30.0;
        }
        // Only first turns (2,000-token misses) may have gone to the control plane.
        assert!(policy.callouts <= 24, "{} callouts", policy.callouts);
        assert!(other_copy >= 12, "turns mostly decided apart: {other_copy}");
    }
}
