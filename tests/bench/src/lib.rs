//! Building blocks of `kvroute-bench`: in-process router and filter micro-benchmarks, a
//! keep-alive HTTP load client, and the `summary.json` shapes.
//!
//! Benchmarks read the clock (`Instant`); nothing here is used on the data path.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng as _};
use scorer_core::canon::canonicalize;
use scorer_core::hash::{DEFAULT_BLOCK_BYTES, block_hashes, model_seed};
use scorer_core::index::EndpointId;
use scorer_core::protocol::{ApiKind, Outcome, RouteRequest, RouteResponse};
use scorer_core::router::{EndpointMetrics, Router, RouterConfig};
use serde::Serialize;

use kvroute_harness::ManagedProcess;
use kvroute_harness::loadgen::{nearest_rank_index, percentile, words};
use proxy_wasm_host::{FilterAction, FilterModule, HostError};

pub mod aiperf;
pub mod bars;
pub mod filter_v8;
pub mod metrics_fleet;
pub mod peers;
pub mod scale;
pub mod tokenize;
pub mod vm_memory;

/// Model name used by every benchmark request.
pub const MODEL: &str = "kvroute-bench-model";

/// Errors of the benchmark building blocks.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The wasm host failed (module load, a trap, a protocol violation).
    #[error("wasm host: {0}")]
    Wasm(#[from] HostError),
    /// The filter did not behave as the benchmark expects (e.g. no route call).
    #[error("filter: {0}")]
    Filter(String),
    /// A body could not be canonicalised.
    #[error("canonicalise: {0}")]
    Canon(String),
    /// A process of the topology (Envoy's admin) could not be asked.
    #[error(transparent)]
    Harness(#[from] kvroute_harness::HarnessError),
}

/// One row of the data-plane overhead table.
#[derive(Debug, Clone, Serialize)]
pub struct OverheadRow {
    /// `kvroute`, `round-robin` (plain Envoy) or `direct`.
    pub router: String,
    /// Approximate canonical prompt size.
    pub prompt_bytes: usize,
    /// Median latency minus the direct median, ms.
    pub added_ms_p50: f64,
    /// 95 % interval of `added_ms_p50` ([`median_difference_interval`] against direct's
    /// samples); null for direct itself.
    pub added_ms_p50_ci95: Option<[f64; 2]>,
    /// p99 latency minus the direct p99, ms.
    pub added_ms_p99: f64,
    /// Raw median latency, ms.
    pub latency_ms_p50: f64,
    /// Raw p99 latency, ms.
    pub latency_ms_p99: f64,
    /// Closed-loop requests/s at the load client's concurrency (1 KB prompts only; else null):
    /// the median of `max_rps_rounds`.
    pub max_rps: Option<f64>,
    /// Each interleaved round's requests/s, in order (every row's round `i` ran close in time,
    /// so a ratio of two rows is fairest round by round); empty where `max_rps` is null.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub max_rps_rounds: Vec<f64>,
    /// Envoy's CPU time per request in the max-rps run, µs (rows with an Envoy; else null).
    pub envoy_cpu_us_per_request: Option<f64>,
    /// CPU time per request of the routing process beside or instead of Envoy in that run (the
    /// control plane, or the peer router), µs; null where there is none.
    pub router_cpu_us_per_request: Option<f64>,
    /// Failed requests in this row's runs.
    pub errors: usize,
}

/// Percentiles of a latency.
#[derive(Debug, Clone, Serialize)]
pub struct P50P99 {
    /// Median, ms.
    pub p50: f64,
    /// 99th percentile, ms.
    pub p99: f64,
}

/// 99th percentile only.
#[derive(Debug, Clone, Serialize)]
pub struct P99 {
    /// 99th percentile, ms.
    pub p99: f64,
}

/// One row of the routing-quality table.
#[derive(Debug, Clone, Serialize)]
pub struct QualityRow {
    /// Router label.
    pub router: String,
    /// Workload label.
    pub workload: String,
    /// Client-side time to first token.
    pub ttft_ms: P50P99,
    /// Per-request mean inter-token latency, p99 over requests.
    pub itl_ms: P99,
    /// Output tokens per wall second.
    pub output_tokens_per_s: f64,
    /// Replicas' own prefix-cache hit rate.
    pub prefix_hit_rate: f64,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Which load generator drove it.
    pub load_generator: String,
    /// aiperf's `--random-seed`: the same for every router's first run of a workload; further
    /// runs of the local path and the route call (issue #15's quality bar) use the next seeds.
    pub aiperf_seed: u64,
    /// Every successful request's TTFT, ms, sorted (for the plots and the quality bars'
    /// intervals; not in the summary).
    #[serde(skip)]
    pub ttft_samples_ms: Vec<f64>,
}

/// Filter throughput figures.
#[derive(Debug, Clone, Serialize)]
pub struct FilterFigures {
    /// Release wasm in wasmtime, 16 KB chat bodies, MB/s of body.
    pub mb_per_s_16k: f64,
    /// Release wasm in wasmtime, 200 KB chat bodies, MB/s of body.
    pub mb_per_s_200k: f64,
    /// Native canonicalise+hash, 16 KB.
    pub native_mb_per_s_16k: f64,
    /// Native canonicalise+hash, 200 KB.
    pub native_mb_per_s_200k: f64,
    /// Median wasm time per 16 KB request (headers+body+route answer), µs.
    pub wasm_us_per_request_16k: f64,
    /// Median wasm time per 200 KB request, µs.
    pub wasm_us_per_request_200k: f64,
    /// Route request JSON bytes the filter sends for a 200 KB body (its per-request state
    /// apart from the body Envoy buffers).
    pub route_request_bytes_200k: usize,
    /// Inside Envoy's V8: 16 KB bodies' bytes over the filter's own parse+hash time
    /// (`kvroute_hash_duration_us` sum), MB/s; `None` when the overhead section did not run.
    pub v8_mb_per_s_16k: Option<f64>,
    /// Inside Envoy's V8, 200 KB bodies, MB/s.
    pub v8_mb_per_s_200k: Option<f64>,
    /// Mean parse+hash time inside V8 per 16 KB body, µs.
    pub v8_us_per_body_16k: Option<f64>,
    /// Mean parse+hash time inside V8 per 200 KB body, µs.
    pub v8_us_per_body_200k: Option<f64>,
    /// Filter memory per in-flight request, 16 KB bodies (wasmtime linear-memory growth with
    /// many requests held paused on their route call, divided by their number), bytes.
    pub inflight_bytes_per_request_16k: f64,
    /// The same with 200 KB bodies, bytes.
    pub inflight_bytes_per_request_200k: f64,
    /// Requests held in flight in the memory measurement.
    pub inflight_requests: usize,
}

/// Control-plane throughput figures.
#[derive(Debug, Clone, Serialize)]
pub struct ControlPlaneFigures {
    /// `Router::route` + `feedback` per second, one thread.
    pub decisions_per_s_inprocess: f64,
    /// Another router's decisions recorded (`Router::record_decision` + `feedback`) per
    /// second, one thread: what a control plane, and each proxy copy, does for every request
    /// some other copy decided.
    pub decisions_per_s_recorded: f64,
    /// `POST /v1/route` per second against the release binary pinned to one core.
    pub decisions_per_s_http: f64,
    /// `PrefixIndex::approx_bytes / distinct_blocks` with the index filled.
    pub bytes_per_block: f64,
    /// Distinct blocks in the index during the in-process run.
    pub indexed_blocks: usize,
    /// Endpoints in the router.
    pub endpoints: usize,
    /// HTTP latency p50 at the load client's concurrency, ms.
    pub http_latency_ms_p50: f64,
    /// HTTP latency p99, ms.
    pub http_latency_ms_p99: f64,
}

/// The 95 % interval of `median(a) - median(b)` (nearest-rank medians, as [`LoadResult::p`]),
/// from `rounds` bootstrap resamples of each: requests drawn independently with replacement,
/// seeded so a run's figures repeat. Whether two rows' medians of 200 sequential samples differ
/// by more than the samples' own spread is the question issue #15's latency bars, a few
/// hundredths of a millisecond apart, turn on. Requests sent back to back share the machine's
/// state, so this understates the spread when the machine drifts within a block. `None` when
/// either side has no samples.
pub fn median_difference_interval(
    a: &[f64],
    b: &[f64],
    rounds: usize,
    seed: u64,
) -> Option<[f64; 2]> {
    bootstrap_interval(&[(a, b)], 50.0, rounds, seed, |x, y| x - y)
}

/// The 95 % interval of `a`'s `q`-th percentile over `b`'s, each pooled over paired runs
/// (`runs[i]` holds run `i`'s samples of both sides, from the same workload seed), from
/// `rounds` bootstrap resamples: runs drawn with replacement, then each drawn run's requests
/// on each side (one run: the requests alone, as [`median_difference_interval`]). Issue #15
/// asks the local path's TTFT p50 and p99 to stay within 5 % of the route call's; an aiperf p99
/// is one of the few slowest of a few hundred requests and a cold fleet's runs differ by more
/// than their requests do, so whether a ratio of 1.14 is the router or the run is this
/// question. `None` without runs or when a run has no samples on a side.
pub fn percentile_ratio_interval(
    runs: &[(&[f64], &[f64])],
    q: f64,
    rounds: usize,
    seed: u64,
) -> Option<[f64; 2]> {
    bootstrap_interval(runs, q, rounds, seed, |x, y| x / y)
}

/// `a`'s `q`-th percentile (nearest rank, as `percentile`) over the pooled samples of paired
/// runs, over `b`'s: the point [`percentile_ratio_interval`] brackets. `None` as there.
pub fn pooled_percentile_ratio(runs: &[(&[f64], &[f64])], q: f64) -> Option<f64> {
    let [a, b] = pooled_percentiles(runs, q)?;
    Some(a / b)
}

/// Each side's `q`-th percentile over every run's samples pooled. `None` as
/// [`percentile_ratio_interval`].
pub fn pooled_percentiles(runs: &[(&[f64], &[f64])], q: f64) -> Option<[f64; 2]> {
    if runs.is_empty() || runs.iter().any(|(a, b)| a.is_empty() || b.is_empty()) {
        return None;
    }
    let pooled = |samples: &mut dyn Iterator<Item = &[f64]>| {
        let mut all: Vec<f64> = samples.flatten().copied().collect();
        all.sort_unstable_by(f64::total_cmp);
        percentile(&all, q)
    };
    Some([
        pooled(&mut runs.iter().map(|r| r.0)),
        pooled(&mut runs.iter().map(|r| r.1)),
    ])
}

/// The 95 % interval of the ratio of two means over paired runs (`pairs[i]` = run `i`'s
/// figures), from `rounds` resamples of the runs: for a figure with one value a run (the
/// replicas' prefix hit rate). `None` with fewer than two runs, where nothing varies.
pub fn runs_mean_ratio_interval(
    pairs: &[(f64, f64)],
    rounds: usize,
    seed: u64,
) -> Option<[f64; 2]> {
    if pairs.len() < 2 || rounds == 0 {
        return None;
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut values: Vec<f64> = (0..rounds)
        .map(|_| {
            let (mut a, mut b) = (0.0, 0.0);
            for _ in 0..pairs.len() {
                let (x, y) = pairs[rng.random_range(0..pairs.len())];
                a += x;
                b += y;
            }
            a / b
        })
        .collect();
    values.sort_unstable_by(f64::total_cmp);
    Some([percentile(&values, 2.5), percentile(&values, 97.5)])
}

/// `combine(a's q-th percentile, b's)`, each pooled over paired runs, over `rounds` resamples
/// (runs with replacement, then requests within each drawn run), its 2.5th and 97.5th
/// percentiles.
fn bootstrap_interval(
    runs: &[(&[f64], &[f64])],
    q: f64,
    rounds: usize,
    seed: u64,
    combine: impl Fn(f64, f64) -> f64,
) -> Option<[f64; 2]> {
    if rounds == 0 || runs.is_empty() || runs.iter().any(|(a, b)| a.is_empty() || b.is_empty()) {
        return None;
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    // Nearest rank, as `percentile`.
    let rank_of = |pool: &mut Vec<f64>| {
        let at = nearest_rank_index(pool.len(), q);
        *pool.select_nth_unstable_by(at, f64::total_cmp).1
    };
    let (mut pa, mut pb) = (Vec::new(), Vec::new());
    let mut values: Vec<f64> = (0..rounds)
        .map(|_| {
            pa.clear();
            pb.clear();
            for _ in 0..runs.len() {
                // One run is always itself: the draws stay those of a plain bootstrap.
                let (a, b) = if runs.len() == 1 {
                    runs[0]
                } else {
                    runs[rng.random_range(0..runs.len())]
                };
                pa.extend((0..a.len()).map(|_| a[rng.random_range(0..a.len())]));
                pb.extend((0..b.len()).map(|_| b[rng.random_range(0..b.len())]));
            }
            combine(rank_of(&mut pa), rank_of(&mut pb))
        })
        .collect();
    values.sort_unstable_by(f64::total_cmp);
    Some([percentile(&values, 2.5), percentile(&values, 97.5)])
}

/// A chat-completions body of about `bytes` bytes of prompt; `seed` varies the text.
pub fn chat_body(bytes: usize, seed: u64, max_tokens: u32, stream: bool) -> String {
    let mut rng = SmallRng::seed_from_u64(seed);
    // Words average about 6.5 bytes with the separator.
    let text = words(&mut rng, bytes.div_ceil(7).max(1));
    serde_json::json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a benchmark."},
            {"role": "user", "content": text},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
    .to_string()
}

/// Result of the in-process router benchmark.
#[derive(Debug, Clone)]
pub struct RouterBench {
    /// Decisions (route + feedback) per second.
    pub decisions_per_s: f64,
    /// Index bytes per distinct block.
    pub bytes_per_block: f64,
    /// Distinct blocks indexed.
    pub blocks: usize,
}

impl RouterBench {
    /// These figures with the rate of `decisions` timed from `start` until now.
    fn timed(self, decisions: usize, start: Instant) -> Self {
        Self {
            decisions_per_s: decisions as f64 / start.elapsed().as_secs_f64().max(1e-9),
            ..self
        }
    }
}

/// The block hashes of the `i`-th measured request, `len` blocks: an even one extends a random
/// chain of `chains` by a random length (a partial prefix hit), the rest of it (and every odd
/// one) is fresh. The in-process and the HTTP benchmark measure the same mix this way.
fn mixed_hashes(rng: &mut SmallRng, chains: &[Vec<u64>], i: usize, len: usize) -> Vec<u64> {
    let mut hashes: Vec<u64> = if i.is_multiple_of(2) && !chains.is_empty() {
        let c = &chains[rng.random_range(0..chains.len())];
        c[..rng.random_range(1..=len)].to_vec()
    } else {
        Vec::new()
    };
    while hashes.len() < len {
        hashes.push(rng.random());
    }
    hashes
}

/// Blocks per prompt of the router benchmarks (in-process and HTTP): 64, i.e. 16 KB prompts.
const CHAIN: usize = 64;

/// The route request of one benchmark prompt of [`CHAIN`] blocks with these `hashes`, the
/// same in the in-process and the HTTP benchmark.
fn chain_request(hashes: Vec<u64>) -> RouteRequest {
    RouteRequest {
        model: MODEL.to_string(),
        block_hashes: hashes,
        prompt_bytes: (CHAIN * DEFAULT_BLOCK_BYTES) as u64,
        prompt_tokens: (CHAIN * DEFAULT_BLOCK_BYTES / 4) as u32,
        max_output_tokens: Some(64),
        ..RouteRequest::default()
    }
}

/// A router with `endpoints` endpoints and `blocks` distinct indexed blocks (chains of 64
/// blocks, i.e. 16 KB prompts), and 1,024 requests of 16 KB prompts to time against it, half
/// of them sharing a prefix with an indexed chain: what both in-process loops start from.
struct FilledRouter {
    router: Router,
    addresses: Vec<String>,
    requests: Vec<RouteRequest>,
    now: u64,
}

impl FilledRouter {
    fn new(endpoints: usize, blocks: usize) -> Self {
        let now = 1_000_000;
        let mut router = Router::new(RouterConfig::default(), 1);
        let mut ids = Vec::with_capacity(endpoints);
        let mut addresses = Vec::with_capacity(endpoints);
        for i in 0..endpoints {
            let address = format!("10.0.{}.{}:8000", i / 250, i % 250 + 1);
            let id = router
                .upsert_endpoint(&address)
                .unwrap_or(EndpointId(i as u16));
            router.update_metrics(
                &address,
                EndpointMetrics {
                    running: (i % 5) as u32,
                    waiting: 0,
                    kv_usage: 0.3,
                    capacity_tokens: Some(1_000_000),
                    counters: None,
                    ..Default::default()
                },
                now,
            );
            ids.push(id);
            addresses.push(address);
        }
        let mut rng = SmallRng::seed_from_u64(42);
        let mut chains: Vec<Vec<u64>> = Vec::with_capacity(blocks / CHAIN + 1);
        let mut filled = 0;
        while filled < blocks {
            let chain: Vec<u64> = (0..CHAIN).map(|_| rng.random()).collect();
            let id = ids[chains.len() % ids.len().max(1)];
            router.index_mut().insert(id, &chain, now);
            filled += CHAIN;
            chains.push(chain);
        }
        let requests = (0..1024)
            .map(|i| chain_request(mixed_hashes(&mut rng, &chains, i, CHAIN)))
            .collect();
        Self {
            router,
            addresses,
            requests,
            now,
        }
    }

    /// The index's figures as filled, before a timed loop adds to it
    /// ([`RouterBench::timed`] adds the loop's rate).
    fn figures(&self) -> RouterBench {
        let distinct = self.router.index().distinct_blocks();
        RouterBench {
            decisions_per_s: 0.0,
            bytes_per_block: self.router.index().approx_bytes() as f64 / distinct.max(1) as f64,
            blocks: distinct,
        }
    }

    /// Records `decisions` decisions of another router and their outcomes (the loop
    /// [`router_recorded`] times); returns how many the router took.
    fn record(&mut self, decisions: usize) -> usize {
        // Ids of another router's decisions (`sync`'s replica tags live in the high bits).
        const OTHER: u64 = 1 << 48;
        let mut recorded = 0;
        if self.addresses.is_empty() {
            return recorded;
        }
        for i in 0..decisions {
            let request = &self.requests[i % self.requests.len()];
            let endpoint = &self.addresses[i % self.addresses.len()];
            let decision_id = OTHER + i as u64;
            if self
                .router
                .record_decision(request, endpoint, decision_id, self.now, 0)
            {
                recorded += 1;
            }
            let outcome = Self::outcome(decision_id, endpoint.clone());
            self.router.feedback(&outcome, self.now);
        }
        recorded
    }

    /// The outcome report of decision `decision_id`, served on `endpoint`.
    fn outcome(decision_id: u64, endpoint: String) -> Outcome {
        Outcome {
            decision_id,
            endpoint,
            status: 200,
            total_ms: 10,
            ..Outcome::default()
        }
    }
}

/// Fills a router ([`FilledRouter`]), then times `decisions` routes of 16 KB prompts, each
/// followed by its outcome report.
pub fn router_inprocess(endpoints: usize, blocks: usize, decisions: usize) -> RouterBench {
    let mut filled = FilledRouter::new(endpoints, blocks);
    let (now, figures) = (filled.now, filled.figures());
    let start = Instant::now();
    for i in 0..decisions {
        let request = &filled.requests[i % filled.requests.len()];
        let d = filled.router.route(request, now, i as u64);
        let endpoint = d.response.endpoints.first().cloned().unwrap_or_default();
        let outcome = FilledRouter::outcome(d.response.decision_id, endpoint);
        filled.router.feedback(&outcome, now);
    }
    figures.timed(decisions, start)
}

/// Fills a router ([`FilledRouter`]), then times `decisions` decisions taken by another router
/// (a proxy's copy, a peer control plane) recorded into it (`Router::record_decision`), each
/// followed by its outcome: what a control plane, and every copy, does for each request some
/// other copy decided. The chosen endpoints take turns.
pub fn router_recorded(endpoints: usize, blocks: usize, decisions: usize) -> RouterBench {
    let mut filled = FilledRouter::new(endpoints, blocks);
    let figures = filled.figures();
    let start = Instant::now();
    filled.record(decisions);
    figures.timed(decisions, start)
}

/// Native canonicalise + block-hash throughput in MB/s over `iters` bodies of `bytes`.
pub fn canon_native(bytes: usize, iters: usize) -> Result<f64, BenchError> {
    let bodies: Vec<String> = (0..8).map(|s| chat_body(bytes, s, 16, false)).collect();
    let seed = model_seed(MODEL);
    let mut total = 0usize;
    let start = Instant::now();
    for i in 0..iters {
        let body = bodies[i % bodies.len()].as_bytes();
        let prompt =
            canonicalize(ApiKind::Chat, body).map_err(|e| BenchError::Canon(e.to_string()))?;
        let hashes = block_hashes(seed, &prompt.bytes, DEFAULT_BLOCK_BYTES);
        std::hint::black_box(hashes);
        total += body.len();
    }
    Ok(total as f64 / 1e6 / start.elapsed().as_secs_f64().max(1e-9))
}

/// Result of running the release filter in wasmtime.
#[derive(Debug, Clone)]
pub struct WasmBench {
    /// MB of body per second.
    pub mb_per_s: f64,
    /// Median µs per request.
    pub us_p50: f64,
    /// Size of the route call's JSON body.
    pub route_request_bytes: usize,
}

/// The filter in wasmtime as both wasm benchmarks run it: default config, the two clusters it
/// calls.
fn bench_host(module: &FilterModule) -> Result<proxy_wasm_host::FilterHost, BenchError> {
    let mut host = module.start(b"{}")?;
    host.set_clusters(&["kvroute_control_plane", "vllm"]);
    Ok(host)
}

/// The request headers of a `content_length`-byte chat completion, as the wasm benchmarks send
/// them.
fn chat_request_headers(content_length: &str) -> [(&'static str, &str); 5] {
    [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "bench"),
        ("content-type", "application/json"),
        ("content-length", content_length),
    ]
}

/// Pushes `iters` requests of `bytes` through the filter in wasmtime: headers, whole body,
/// an instant route answer, response headers, end of stream.
pub fn filter_wasm(
    module: &FilterModule,
    bytes: usize,
    iters: usize,
) -> Result<WasmBench, BenchError> {
    let mut host = bench_host(module)?;
    let bodies: Vec<String> = (0..8).map(|s| chat_body(bytes, s, 16, false)).collect();
    let answer = serde_json::to_vec(&RouteResponse {
        decision_id: 1,
        endpoints: vec!["127.0.0.1:8001".to_string()],
        cached_blocks: 0,
        reason: "prefix".into(),
        ..RouteResponse::default()
    })
    .map_err(|e| BenchError::Filter(e.to_string()))?;
    let mut times = Vec::with_capacity(iters);
    let mut route_request_bytes = 0;
    let mut total = 0usize;
    let start = Instant::now();
    for i in 0..iters {
        let body = bodies[i % bodies.len()].as_bytes();
        let len = body.len().to_string();
        let t = Instant::now();
        let ctx = host.new_stream()?;
        host.send_request_headers(ctx, &chat_request_headers(&len), false)?;
        let action = host.send_request_body(ctx, body, true)?;
        if action == FilterAction::Pause {
            let call = host
                .pending_http_calls()
                .first()
                .cloned()
                .ok_or_else(|| BenchError::Filter("paused without a route call".into()))?;
            route_request_bytes = call.body.len();
            host.respond_http_call(
                call.token,
                200,
                &[("content-type", "application/json")],
                &answer,
            )?;
        } else {
            return Err(BenchError::Filter(format!(
                "request of {bytes} bytes was not routed (action {action:?})"
            )));
        }
        host.send_response_headers(ctx, &[(":status", "200")], true)?;
        host.finish_stream(ctx)?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
        total += body.len();
        if i % 64 == 63 {
            host.advance_ms(300);
            host.tick()?;
        }
    }
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    times.sort_by(f64::total_cmp);
    Ok(WasmBench {
        mb_per_s: total as f64 / 1e6 / secs,
        us_p50: percentile(&times, 50.0),
        route_request_bytes,
    })
}

/// Filter memory per in-flight request: opens `in_flight` streams of `bytes`-byte chat bodies
/// in wasmtime and leaves each paused on its unanswered route call, then divides the growth
/// of the module's linear memory by their number (bytes per request). One request is run to
/// completion first, so buffers the allocator reuses (the body copy, the route JSON) are not
/// counted as per-request. Resolution is one 64 KiB wasm page over `in_flight`.
pub fn filter_inflight_memory(
    module: &FilterModule,
    bytes: usize,
    in_flight: usize,
) -> Result<f64, BenchError> {
    let mut host = bench_host(module)?;
    let body = chat_body(bytes, 1, 16, false);
    let len = body.len().to_string();
    let headers = chat_request_headers(&len);
    let open = |host: &mut proxy_wasm_host::FilterHost| -> Result<u32, BenchError> {
        let ctx = host.new_stream()?;
        host.send_request_headers(ctx, &headers, false)?;
        match host.send_request_body(ctx, body.as_bytes(), true)? {
            FilterAction::Pause => Ok(ctx),
            other => Err(BenchError::Filter(format!(
                "request of {bytes} bytes was not held for routing (action {other:?})"
            ))),
        }
    };
    // Warm-up: one full request, answered and finished.
    let ctx = open(&mut host)?;
    let token = host
        .pending_http_calls()
        .first()
        .map(|c| c.token)
        .ok_or_else(|| BenchError::Filter("paused without a route call".into()))?;
    host.respond_http_call(token, 503, &[], b"")?;
    host.send_response_headers(ctx, &[(":status", "200")], true)?;
    host.finish_stream(ctx)?;
    let before = host.memory_bytes();
    for _ in 0..in_flight {
        open(&mut host)?;
    }
    let after = host.memory_bytes();
    Ok(after.saturating_sub(before) as f64 / in_flight.max(1) as f64)
}

/// Result of a closed-loop HTTP load run.
#[derive(Debug, Clone)]
pub struct LoadResult {
    /// Sorted latencies of successful requests, ms.
    pub latencies_ms: Vec<f64>,
    /// Failed requests (non-2xx, transport errors, timeouts).
    pub errors: usize,
    /// Successful requests per second.
    pub rps: f64,
}

impl LoadResult {
    /// Latency percentile, ms.
    pub fn p(&self, p: f64) -> f64 {
        percentile(&self.latencies_ms, p)
    }
}

/// Closed loop: `concurrency` tasks POST `bodies` (round robin) to `url` over keep-alive
/// HTTP/1.1 connections until `duration` passes or each task has sent `max_per_task`.
pub async fn http_load(
    url: &str,
    bodies: Arc<Vec<String>>,
    concurrency: usize,
    duration: Duration,
    max_per_task: usize,
) -> LoadResult {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency)
        .build_http();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for t in 0..concurrency {
        let (client, bodies, stop, url) = (
            client.clone(),
            bodies.clone(),
            stop.clone(),
            url.to_string(),
        );
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0usize;
            let mut i = t;
            while !stop.load(Ordering::Relaxed) && lat.len() + errors < max_per_task {
                if start.elapsed() >= duration {
                    break;
                }
                let body = &bodies[i % bodies.len()];
                i += concurrency;
                match post_once(&client, &url, body).await {
                    Some(ms) => lat.push(ms),
                    None => errors += 1,
                }
            }
            (lat, errors)
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for t in tasks {
        if let Ok((l, e)) = t.await {
            latencies.extend(l);
            errors += e;
        } else {
            errors += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    latencies.sort_by(f64::total_cmp);
    LoadResult {
        rps: latencies.len() as f64 / secs,
        latencies_ms: latencies,
        errors,
    }
}

/// One JSON POST of `body` to `url` on `client`'s keep-alive connections: its latency in ms
/// to the last byte of the response, or `None` for a non-2xx answer, a transport error or no
/// answer within 10 s.
async fn post_once(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    body: &str,
) -> Option<f64> {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .ok()?;
    let t0 = Instant::now();
    let fut = async {
        let resp = client.request(req).await.ok()?;
        let ok = resp.status().is_success();
        let _ = resp.into_body().collect().await.ok()?;
        Some(ok)
    };
    match tokio::time::timeout(Duration::from_secs(10), fut).await {
        Ok(Some(true)) => Some(t0.elapsed().as_secs_f64() * 1e3),
        _ => None,
    }
}

/// Sequential samples of every URL in `urls`, interleaved in blocks: block by block, `block`
/// requests to each URL in turn (the order rotated each round), the first `warmup` of each
/// block not counted, one keep-alive client per URL, until each has `samples`. A slow or fast
/// phase of the machine then falls on every URL alike, so the differences between them in one
/// run are not its drift (the bars they are judged by are a few hundredths of a millisecond),
/// while within a block each URL runs warm, as one client's back-to-back requests do. One
/// [`LoadResult`] per URL, in order (`rps` is not a throughput here).
pub async fn interleaved_sequential(
    urls: &[String],
    bodies: &[String],
    block: usize,
    warmup: usize,
    samples: usize,
) -> Vec<LoadResult> {
    let clients: Vec<Client<HttpConnector, Full<Bytes>>> = urls
        .iter()
        .map(|_| {
            Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(1)
                .build_http()
        })
        .collect();
    let counted = block.saturating_sub(warmup).max(1);
    let mut latencies = vec![Vec::with_capacity(samples); urls.len()];
    let mut errors = vec![0usize; urls.len()];
    let start = Instant::now();
    let mut sent = 0usize;
    for round in 0..samples.div_ceil(counted) {
        for k in 0..urls.len() {
            let at = (round + k) % urls.len();
            for i in 0..warmup + counted.min(samples - round * counted) {
                let body = &bodies[(sent + i) % bodies.len().max(1)];
                let latency = post_once(&clients[at], &urls[at], body).await;
                if i < warmup {
                    continue;
                }
                match latency {
                    Some(ms) => latencies[at].push(ms),
                    None => errors[at] += 1,
                }
            }
        }
        sent += warmup + counted;
    }
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    latencies
        .into_iter()
        .zip(errors)
        .map(|(mut l, errors)| {
            l.sort_by(f64::total_cmp);
            LoadResult {
                rps: l.len() as f64 / secs,
                latencies_ms: l,
                errors,
            }
        })
        .collect()
}

/// [`http_load`] for at most `duration`, reading the CPU each of `pids` used meanwhile: the
/// max-rps figure and, per process, its CPU µs per served request (`None` for no pid or an
/// unreadable `/proc`).
pub async fn http_load_cpu<const N: usize>(
    url: &str,
    bodies: Arc<Vec<String>>,
    concurrency: usize,
    duration: Duration,
    pids: [Option<u32>; N],
) -> (LoadResult, [Option<f64>; N]) {
    let cpu = |pid: Option<u32>| pid.and_then(|p| scale::cpu_seconds(p).ok());
    let before = pids.map(cpu);
    let r = http_load(url, bodies, concurrency, duration, usize::MAX).await;
    let served = r.latencies_ms.len().max(1) as f64;
    let mut per_request = [None; N];
    for (i, slot) in per_request.iter_mut().enumerate() {
        if let (Some(before), Some(after)) = (before[i], cpu(pids[i])) {
            *slot = Some((after - before) * 1e6 / served);
        }
    }
    (r, per_request)
}

/// `vllm-sim` arguments of the overhead runs' one replica: instant answers, room for every
/// concurrent request.
pub fn overhead_sim_args() -> Vec<String> {
    ["--profile", "fast", "--max-num-seqs", "256"]
        .map(String::from)
        .to_vec()
}

/// An Envoy the examples measure side by side: its label, the router its fleet runs and the
/// edit to kvroute's Envoy configuration, if any.
pub type EnvoyVariant = (
    &'static str,
    kvroute_harness::RouterKind,
    Option<(String, String)>,
);

/// The Envoys the examples compare, in order: plain Envoy round robin, kvroute's Envoy with the
/// empty filter, kvroute's filter (the module at `wasm`), and, when `$KVROUTE_WASM_ALT` names
/// another build of the filter, that build too: two builds run in the same rounds, as the
/// machine's drift between two runs is larger than the differences they look for.
pub fn envoy_variants(wasm: &std::path::Path) -> anyhow::Result<Vec<EnvoyVariant>> {
    use kvroute_harness::RouterKind;
    let empty = empty_wasm_edit(wasm)
        .map_err(|p| anyhow::anyhow!("{} not built (make wasm)", p.display()))?;
    let mut variants = vec![
        ("round-robin", RouterKind::RoundRobin, None),
        ("empty wasm filter", RouterKind::Kvroute, Some(empty)),
        ("kvroute local", RouterKind::Kvroute, None),
    ];
    if let Some(alt) = std::env::var_os("KVROUTE_WASM_ALT").map(std::path::PathBuf::from) {
        anyhow::ensure!(
            alt.is_file(),
            "KVROUTE_WASM_ALT: {} is not a file",
            alt.display()
        );
        let edit = (wasm.display().to_string(), alt.display().to_string());
        variants.push(("kvroute local, alt", RouterKind::Kvroute, Some(edit)));
    }
    Ok(variants)
}

/// File name of the proxy-wasm filter that does nothing (`tests/noop-filter`), which `make
/// wasm` builds beside kvroute's.
pub const EMPTY_WASM_FILE: &str = "kvroute_noop_filter.wasm";

/// The Envoy edit that loads the empty filter in place of kvroute's module at `wasm` (a
/// [`kvroute_harness::FleetConfig::envoy_edits`] entry), or the empty filter's path when it
/// is not built.
pub fn empty_wasm_edit(wasm: &std::path::Path) -> Result<(String, String), std::path::PathBuf> {
    let empty = wasm.with_file_name(EMPTY_WASM_FILE);
    if empty.is_file() {
        Ok((wasm.display().to_string(), empty.display().to_string()))
    } else {
        Err(empty)
    }
}

/// Route-request bodies of 16 KB prompts (64 blocks), half sharing one of 64 prefixes.
pub fn route_bodies(n: usize) -> Vec<String> {
    let mut rng = SmallRng::seed_from_u64(9);
    let prefixes: Vec<Vec<u64>> = (0..64)
        .map(|_| (0..32).map(|_| rng.random()).collect())
        .collect();
    (0..n)
        .map(|i| {
            let mut hashes = if i % 2 == 0 {
                prefixes[i % prefixes.len()].clone()
            } else {
                Vec::new()
            };
            while hashes.len() < 64 {
                hashes.push(rng.random());
            }
            let req = RouteRequest {
                model: MODEL.to_string(),
                block_hashes: hashes,
                prompt_bytes: 16_384,
                prompt_tokens: 4_096,
                max_output_tokens: Some(64),
                ..RouteRequest::default()
            };
            serde_json::to_string(&req).unwrap_or_default()
        })
        .collect()
}

/// Route-request bodies for the HTTP benchmark with a filled index: `fill` holds about
/// `blocks / 64` requests of 64 fresh blocks each (16 KB prompts), which fill the index when
/// routed; `measure` holds `n` requests of which half extend one of those chains by a random
/// length (a partial prefix hit) and half are new, like the in-process benchmark.
pub fn filled_index_bodies(blocks: usize, n: usize) -> (Vec<String>, Vec<String>) {
    let mut rng = SmallRng::seed_from_u64(17);
    let body = |hashes: Vec<u64>| serde_json::to_string(&chain_request(hashes)).unwrap_or_default();
    let chains: Vec<Vec<u64>> = (0..blocks.div_ceil(CHAIN))
        .map(|_| (0..CHAIN).map(|_| rng.random()).collect())
        .collect();
    let measure = (0..n)
        .map(|i| body(mixed_hashes(&mut rng, &chains, i, CHAIN)))
        .collect();
    let fill = chains.into_iter().map(body).collect();
    (fill, measure)
}

/// Polls `ready` every `every` until it gives a value, while `process` runs. The drivers start
/// a process and wait for it to serve in several places; they fail alike when it exits
/// (`"{label} exited: {why}"` with its log tail) and with `late(process)` once `within` passes.
pub async fn wait_while_running<T>(
    process: &mut ManagedProcess,
    label: &str,
    within: Duration,
    every: Duration,
    mut ready: impl AsyncFnMut() -> Option<T>,
    late: impl FnOnce(&ManagedProcess) -> String,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(why) = process.exited() {
            anyhow::bail!("{label} exited: {why}\n{}", process.log_tail(20));
        }
        if let Some(value) = ready().await {
            return Ok(value);
        }
        if Instant::now() > deadline {
            anyhow::bail!("{}", late(process));
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_index_bodies_cover_the_requested_blocks() {
        let (fill, measure) = filled_index_bodies(640, 10);
        assert_eq!(fill.len(), 10);
        assert_eq!(measure.len(), 10);
        let first: RouteRequest = serde_json::from_str(&fill[0]).unwrap();
        assert_eq!(first.block_hashes.len(), 64);
        // Even measurement requests start with a filled chain's first block.
        let chains: Vec<RouteRequest> = fill
            .iter()
            .map(|b| serde_json::from_str(b).unwrap())
            .collect();
        let m0: RouteRequest = serde_json::from_str(&measure[0]).unwrap();
        assert!(
            chains
                .iter()
                .any(|c| c.block_hashes[0] == m0.block_hashes[0])
        );
    }

    #[test]
    fn a_median_difference_interval_holds_the_shift_and_only_it() {
        let base: Vec<f64> = (0..200).map(|i| 1.0 + f64::from(i % 17) * 0.01).collect();
        let shifted: Vec<f64> = base.iter().map(|v| v + 0.1).collect();
        let [lo, hi] = median_difference_interval(&shifted, &base, 1_000, 1).unwrap();
        assert!(lo <= 0.1 + 1e-9 && 0.1 - 1e-9 <= hi, "{lo}..{hi}");
        assert!(
            lo > 0.0,
            "a shift of 0.1 against a spread of 0.16 is resolved: {lo}"
        );
        let [lo, hi] = median_difference_interval(&base, &base, 1_000, 1).unwrap();
        assert!(lo <= 0.0 && 0.0 <= hi, "{lo}..{hi}");
        assert_eq!(median_difference_interval(&[], &base, 10, 1), None);
    }

    #[test]
    fn a_percentile_ratio_interval_holds_the_scale() {
        let base: Vec<f64> = (0..300).map(|i| 50.0 + f64::from(i % 101)).collect();
        let slower: Vec<f64> = base.iter().map(|v| v * 1.2).collect();
        let one = |a: &[f64], q| percentile_ratio_interval(&[(a, &base)], q, 1_000, 1);
        let [lo, hi] = one(&slower, 50.0).unwrap();
        assert!(lo <= 1.2 + 1e-9 && 1.2 - 1e-9 <= hi, "{lo}..{hi}");
        assert!(lo > 1.0, "a 20 % shift of the median is resolved: {lo}");
        let [lo50, hi50] = one(&base, 50.0).unwrap();
        let [lo99, hi99] = one(&base, 99.0).unwrap();
        assert!(lo50 <= 1.0 && 1.0 <= hi50 && lo99 <= 1.0 && 1.0 <= hi99);
        assert_eq!(
            percentile_ratio_interval(&[(&base, &[])], 99.0, 10, 1),
            None
        );
        assert_eq!(percentile_ratio_interval(&[], 99.0, 10, 1), None);
    }

    #[test]
    fn runs_that_disagree_widen_the_pooled_interval() {
        let base: Vec<f64> = (0..300).map(|i| 50.0 + f64::from(i % 101)).collect();
        let scaled = |k: f64| base.iter().map(|v| v * k).collect::<Vec<f64>>();
        let (slow, fast, same) = (scaled(1.3), scaled(0.8), scaled(1.0));
        // Two runs that agree: as tight as one run of twice the requests.
        let agree = [(&same[..], &base[..]), (&same[..], &base[..])];
        let [alo, ahi] = percentile_ratio_interval(&agree, 50.0, 1_000, 2).unwrap();
        // Two runs whose ratios are 1.3 and 0.8: the pooled point lies between them and the
        // interval spans most of the way from one to the other.
        let disagree = [(&slow[..], &base[..]), (&fast[..], &base[..])];
        let point = pooled_percentile_ratio(&disagree, 50.0).unwrap();
        assert!(point > 0.8 && point < 1.3, "{point}");
        let [dlo, dhi] = percentile_ratio_interval(&disagree, 50.0, 1_000, 2).unwrap();
        assert!(dlo <= point && point <= dhi, "{dlo}..{dhi} around {point}");
        assert!(
            dhi - dlo > 3.0 * (ahi - alo),
            "{dlo}..{dhi} against {alo}..{ahi}"
        );
        assert!(dlo < 0.9 && dhi > 1.2, "{dlo}..{dhi}");
        let [a, b] = pooled_percentiles(&agree, 50.0).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn a_mean_ratio_over_runs_needs_two_runs() {
        assert_eq!(runs_mean_ratio_interval(&[(0.9, 0.8)], 100, 1), None);
        let [lo, hi] =
            runs_mean_ratio_interval(&[(0.9, 0.8), (0.8, 0.8), (1.0, 0.8)], 500, 1).unwrap();
        assert!(
            lo >= 1.0 - 1e-9 && hi <= 1.25 + 1e-9 && lo < hi,
            "{lo}..{hi}"
        );
    }

    #[test]
    fn chat_body_is_about_the_requested_size() {
        let b = chat_body(16_384, 1, 8, false);
        assert!(b.len() > 14_000 && b.len() < 20_000, "{}", b.len());
    }

    #[test]
    fn the_recorded_loop_records_every_decision() {
        let mut filled = FilledRouter::new(8, 6_400);
        assert_eq!(filled.record(200), 200);
    }

    #[test]
    fn router_bench_fills_the_index() {
        let r = router_inprocess(8, 6_400, 200);
        assert!(r.blocks >= 6_400);
        assert!(r.decisions_per_s > 0.0 && r.bytes_per_block > 0.0);
    }

    #[test]
    fn native_canon_is_positive() {
        assert!(canon_native(16_384, 4).unwrap() > 0.0);
    }
}
