//! `kvroute-soak`: the demo topology (simulated vLLM fleet, control plane, real Envoy with the
//! filter) under mixed load at a fixed fraction of its measured capacity for a long time, to show
//! that nothing leaks and no request is lost.
//!
//! It first measures capacity (closed loop, every replica's batch kept full), then sends Poisson
//! arrivals at `--load-fraction` of it: multi-turn chats over a few tenants' shared system
//! prompts, one-off questions, a few long prompts, half of them streamed. Every `--sample-secs`
//! it records requests served and failed, the control plane's RSS and index size, and Envoy's
//! RSS, heap and V8 memory, into `samples.csv` and `summary.json` under `--out-dir`. The summary
//! gives the first, last and largest value of each series and its least-squares slope. The exit
//! status is non-zero when any request failed.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use kvroute_harness::loadgen::{self, words};
use kvroute_harness::{self as harness, Fleet, FleetConfig, HttpClient, RouterKind, Tools};
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};

/// Command line of `kvroute-soak`.
#[derive(Debug, Parser)]
#[command(
    name = "kvroute-soak",
    about = "Long mixed load through Envoy + kvroute at a fraction of capacity; samples memory"
)]
struct Args {
    /// Length of the soak after calibration, minutes.
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// Fraction of the measured capacity to offer.
    #[arg(long, default_value_t = 0.8)]
    load_fraction: f64,
    /// Offer this many requests per second instead of calibrating.
    #[arg(long)]
    rate: Option<f64>,
    /// Length of the capacity measurement, seconds.
    #[arg(long, default_value_t = 60)]
    calibrate_secs: u64,
    /// Sampling period, seconds.
    #[arg(long, default_value_t = 30)]
    sample_secs: u64,
    /// vLLM replicas.
    #[arg(long, default_value_t = 4)]
    replicas: usize,
    /// Largest batch of every replica (keeps capacity, and so the CPU the soak uses, modest).
    #[arg(long, default_value_t = 8)]
    max_num_seqs: u32,
    /// Simulated seconds per wall second of every replica.
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Simulator profile.
    #[arg(long, default_value = "llama8b-h100")]
    profile: String,
    /// `max_tokens` of a request (each request draws between half of it and all of it).
    #[arg(long, default_value_t = 48)]
    max_tokens: u32,
    /// Seed of the workload and the arrivals.
    #[arg(long, default_value_t = 11)]
    seed: u64,
    /// Output directory (default: `<target>/soak`).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Where the filter decides: `control-plane` (a route call per request) or `local` (the
    /// VM's synced copy, no call on the request path).
    #[arg(long, value_enum, default_value_t = Decision::ControlPlane)]
    decision: Decision,
}

/// The filter's `decision` setting, as the plugin configuration spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Decision {
    ControlPlane,
    Local,
}

impl Decision {
    fn as_str(self) -> &'static str {
        match self {
            Decision::ControlPlane => "control-plane",
            Decision::Local => "local",
        }
    }
}

/// Tenants, each with its own shared system prompt.
const TENANTS: usize = 4;
/// Words in a tenant's system prompt.
const SYSTEM_WORDS: usize = 1500;
/// Conversations kept open for a next turn; the oldest idle one is dropped beyond this.
const MAX_OPEN_CONVERSATIONS: usize = 256;
/// One request's limit, stream included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.replicas == 0 || args.max_num_seqs == 0 || args.sample_secs == 0 {
        bail!("--replicas, --max-num-seqs and --sample-secs must be at least 1");
    }
    harness::check_positive("--minutes", args.minutes)?;
    harness::check_positive("--load-fraction", args.load_fraction)?;
    harness::check_positive("--speed", args.speed)?;
    if let Some(rate) = args.rate {
        harness::check_positive("--rate", rate)?;
    }
    let rt = harness::driver_runtime()?;
    rt.block_on(run(args))
}

/// One open conversation.
#[derive(Debug)]
struct Conversation {
    history: Vec<Value>,
    turns_left: u32,
}

/// What kind of request an arrival is (reported per kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Opens a conversation on a tenant's system prompt.
    NewChat,
    /// The next turn of an open conversation (its history is the prefix).
    NextTurn,
    /// A prompt of several thousand tokens.
    Long,
    /// One question without a system prompt.
    OneOff,
}

/// The mixed workload: hands out request bodies and takes back answers.
struct Mix {
    rng: SmallRng,
    tenants: Vec<String>,
    idle: VecDeque<Conversation>,
    model: String,
    max_tokens: u32,
    serial: u64,
}

impl Mix {
    fn new(seed: u64, model: &str, max_tokens: u32) -> Mix {
        let mut rng = SmallRng::seed_from_u64(seed);
        let tenants = (0..TENANTS)
            .map(|t| {
                format!(
                    "You are the assistant of tenant {t}. House rules and manual: {}",
                    words(&mut rng, SYSTEM_WORDS)
                )
            })
            .collect();
        Mix {
            rng,
            tenants,
            idle: VecDeque::new(),
            model: model.to_string(),
            max_tokens,
            serial: 0,
        }
    }

    /// The next request: its kind, its conversation (when it continues one) and its body.
    fn next(&mut self) -> (Kind, Option<Conversation>, Value) {
        self.serial += 1;
        let n = self.serial;
        let roll: f64 = self.rng.random();
        let (kind, mut conv) = if roll < 0.5 && !self.idle.is_empty() {
            let i = self.rng.random_range(0..self.idle.len());
            let mut c = self.idle.remove(i).expect("index in range");
            let q = format!("Follow-up {n}: {}?", words(&mut self.rng, 40));
            c.history.push(json!({"role": "user", "content": q}));
            (Kind::NextTurn, c)
        } else if roll < 0.55 {
            let tenant = self.rng.random_range(0..TENANTS);
            let len = self.rng.random_range(4000..7000);
            let doc = words(&mut self.rng, len);
            let history = vec![
                json!({"role": "system", "content": self.tenants[tenant]}),
                json!({"role": "user", "content": format!("Request {n}: summarise {doc}")}),
            ];
            let turns_left = 1;
            (
                Kind::Long,
                Conversation {
                    history,
                    turns_left,
                },
            )
        } else if roll < 0.65 {
            let q = format!("Question {n}: {}?", words(&mut self.rng, 80));
            let history = vec![json!({"role": "user", "content": q})];
            (
                Kind::OneOff,
                Conversation {
                    history,
                    turns_left: 0,
                },
            )
        } else {
            let tenant = self.rng.random_range(0..TENANTS);
            let len = self.rng.random_range(200..600);
            let msg = format!("Conversation {n}: {}", words(&mut self.rng, len));
            let history = vec![
                json!({"role": "system", "content": self.tenants[tenant]}),
                json!({"role": "user", "content": msg}),
            ];
            let turns_left = self.rng.random_range(2..6);
            (
                Kind::NewChat,
                Conversation {
                    history,
                    turns_left,
                },
            )
        };
        conv.turns_left = conv.turns_left.saturating_sub(1);
        let stream = self.rng.random_bool(0.5);
        let max_tokens = self
            .rng
            .random_range(self.max_tokens.div_ceil(2)..=self.max_tokens);
        let mut body = json!({
            "model": self.model,
            "messages": conv.history,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        });
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let keep = (conv.turns_left > 0).then_some(conv);
        (kind, keep, body)
    }

    /// Puts a conversation back with the assistant's answer, ready for its next turn.
    fn give_back(&mut self, mut conv: Conversation, answer: String) {
        conv.history
            .push(json!({"role": "assistant", "content": answer}));
        self.idle.push_back(conv);
        while self.idle.len() > MAX_OPEN_CONVERSATIONS {
            self.idle.pop_front();
        }
    }
}

/// Counters shared by the request tasks and the sampler.
#[derive(Default)]
struct Counters {
    ok: AtomicU64,
    failed: AtomicU64,
    in_flight: AtomicU64,
    by_kind: [AtomicU64; 4],
    streamed: AtomicU64,
    /// End-to-end latencies (ms) of the current sampling period.
    latencies: Mutex<Vec<f64>>,
    /// The first few errors, for the report.
    errors: Mutex<Vec<String>>,
}

/// Sends one request of the mix and records its outcome.
async fn one_request(
    client: HttpClient,
    url: String,
    mix: Arc<Mutex<Mix>>,
    counters: Arc<Counters>,
) {
    let (kind, conv, body) = mix.lock().next();
    let stream = body["stream"].as_bool().unwrap_or(false);
    counters.in_flight.fetch_add(1, Ordering::Relaxed);
    let started = Instant::now();
    let result: Result<String, String> = if stream {
        loadgen::stream_chat(&client, &url, &body, &[], REQUEST_TIMEOUT)
            .await
            .map(|o| o.text)
            .map_err(|e| e.to_string())
    } else {
        match client
            .post_json(
                &format!("{url}/v1/chat/completions"),
                &body,
                REQUEST_TIMEOUT,
            )
            .await
        {
            Ok(r) if r.status == 200 => serde_json::from_str::<Value>(&r.body)
                .ok()
                .and_then(|v| {
                    v.pointer("/choices/0/message/content")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                })
                .ok_or_else(|| format!("200 without a message: {:.200}", r.body)),
            Ok(r) => Err(format!("status {}: {:.200}", r.status, r.body)),
            Err(e) => Err(e.to_string()),
        }
    };
    counters.in_flight.fetch_sub(1, Ordering::Relaxed);
    match result {
        Ok(answer) => {
            counters.ok.fetch_add(1, Ordering::Relaxed);
            counters.by_kind[kind as usize].fetch_add(1, Ordering::Relaxed);
            if stream {
                counters.streamed.fetch_add(1, Ordering::Relaxed);
            }
            counters
                .latencies
                .lock()
                .push(started.elapsed().as_secs_f64() * 1000.0);
            if let Some(conv) = conv {
                mix.lock().give_back(conv, answer);
            }
        }
        Err(e) => {
            counters.failed.fetch_add(1, Ordering::Relaxed);
            let mut errors = counters.errors.lock();
            if errors.len() < 20 {
                errors.push(format!("{kind:?} stream={stream}: {e}"));
            }
        }
    }
}

/// One row of `samples.csv`.
#[derive(Debug, Clone, Serialize)]
struct Sample {
    /// Seconds since the soak (not the calibration) started.
    t_s: f64,
    ok: u64,
    failed: u64,
    in_flight: u64,
    /// Requests per second served in the period.
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    cp_rss_kb: u64,
    cp_index_blocks: f64,
    cp_inflight: f64,
    envoy_rss_kb: u64,
    /// tcmalloc's allocated bytes (Envoy admin `/memory`).
    envoy_heap_allocated: u64,
    /// Size of the filter's wasm linear memories, summed over Envoy's VMs (what they grew to).
    wasm_memory_kb: u64,
    /// The resident part of those memories.
    wasm_memory_rss_kb: u64,
    /// `wasm.envoy.wasm.runtime.v8.active` (VMs alive).
    wasm_vms_active: f64,
}

const SERIES: &[&str] = &[
    "cp_rss_kb",
    "cp_index_blocks",
    "envoy_rss_kb",
    "envoy_heap_allocated",
    "wasm_memory_kb",
    "wasm_memory_rss_kb",
    "wasm_vms_active",
    "rps",
    "p99_ms",
];

fn series_value(s: &Sample, name: &str) -> f64 {
    match name {
        "cp_rss_kb" => s.cp_rss_kb as f64,
        "cp_index_blocks" => s.cp_index_blocks,
        "envoy_rss_kb" => s.envoy_rss_kb as f64,
        "envoy_heap_allocated" => s.envoy_heap_allocated as f64,
        "wasm_memory_kb" => s.wasm_memory_kb as f64,
        "wasm_memory_rss_kb" => s.wasm_memory_rss_kb as f64,
        "wasm_vms_active" => s.wasm_vms_active,
        "rps" => s.rps,
        "p99_ms" => s.p99_ms,
        _ => f64::NAN,
    }
}

/// First, last and largest value of one series, and how it trends.
#[derive(Debug, Clone, Serialize)]
struct SeriesSummary {
    name: String,
    first: f64,
    last: f64,
    max: f64,
    /// Least-squares slope over the samples after the first fifth of the run, per hour.
    slope_per_hour: f64,
    /// That slope as a fraction of the series' mean over the same samples, per hour.
    relative_slope_per_hour: f64,
}

fn summarize_series(samples: &[Sample], name: &str) -> SeriesSummary {
    // Rates and latencies describe the period before a sample; the one at t = 0 has none.
    let per_period = matches!(name, "rps" | "p99_ms");
    let values: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| !(per_period && s.t_s == 0.0))
        .map(|s| (s.t_s, series_value(s, name)))
        .collect();
    let first = values.first().map_or(f64::NAN, |v| v.1);
    let last = values.last().map_or(f64::NAN, |v| v.1);
    let max = values.iter().map(|v| v.1).fold(f64::NAN, f64::max);
    let end = values.last().map_or(0.0, |v| v.0);
    let tail: Vec<(f64, f64)> = values
        .iter()
        .copied()
        .filter(|(t, _)| *t >= end * 0.2)
        .collect();
    let slope = least_squares_slope(&tail) * 3600.0;
    let mean = tail.iter().map(|v| v.1).sum::<f64>() / tail.len().max(1) as f64;
    SeriesSummary {
        name: name.to_string(),
        first,
        last,
        max,
        slope_per_hour: slope,
        relative_slope_per_hour: if mean.abs() > 0.0 { slope / mean } else { 0.0 },
    }
}

/// Slope of the least-squares line through `(x, y)` points (0 with fewer than two).
fn least_squares_slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx > 0.0 { sxy / sxx } else { 0.0 }
}

/// `VmRSS` of a process, in kB (0 when it cannot be read).
fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// Envoy's wasm linear memories: `(size, resident)` in kB, summed over its VMs.
///
/// V8 maps each wasm memory as a read-write region directly followed by a PROT_NONE guard
/// reservation of several GiB (`/proc/<pid>/smaps`), so the read-write mapping just before a
/// guard of at least 4 GiB is one VM's linear memory: its size is what the module has grown
/// to, its `Rss` what it touched.
fn wasm_memory_kb(pid: u32) -> (u64, u64) {
    let Ok(smaps) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else {
        return (0, 0);
    };
    parse_wasm_memories(&smaps)
}

/// One `/proc/<pid>/smaps` entry.
#[derive(Debug, Default, Clone)]
struct Mapping {
    start: u64,
    end: u64,
    perms: String,
    rss_kb: u64,
}

fn parse_wasm_memories(smaps: &str) -> (u64, u64) {
    let mut mappings: Vec<Mapping> = Vec::new();
    for line in smaps.lines() {
        let mut parts = line.split_whitespace();
        let first = parts.next().unwrap_or_default();
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            mappings.push(Mapping {
                start,
                end,
                perms: parts.next().unwrap_or_default().to_string(),
                rss_kb: 0,
            });
        } else if first == "Rss:"
            && let Some(m) = mappings.last_mut()
        {
            m.rss_kb = parts.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        }
    }
    let guard_min = 4u64 << 30;
    let (mut size, mut rss) = (0, 0);
    for pair in mappings.windows(2) {
        let (memory, guard) = (&pair[0], &pair[1]);
        if memory.perms.starts_with("rw")
            && guard.perms.starts_with("---")
            && guard.start == memory.end
            && guard.end - guard.start >= guard_min
        {
            size += (memory.end - memory.start) / 1024;
            rss += memory.rss_kb;
        }
    }
    (size, rss)
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    loadgen::percentile(&v, p)
}

async fn take_sample(
    fleet: &Fleet,
    counters: &Counters,
    t_s: f64,
    period_s: f64,
) -> anyhow::Result<Sample> {
    let client = fleet.client();
    let cp = fleet
        .control_plane
        .as_ref()
        .context("the soak topology has a control plane")?;
    let cp_metrics = client
        .get(
            &format!("http://{}/metrics", cp.admin_address),
            Duration::from_secs(10),
        )
        .await
        .map(|r| r.body)
        .unwrap_or_default();
    let memory: Value = client
        .get(
            &format!("http://{}/memory", fleet.envoy.admin_address),
            Duration::from_secs(10),
        )
        .await
        .ok()
        .and_then(|r| serde_json::from_str(&r.body).ok())
        .unwrap_or(Value::Null);
    let as_u64 = |v: &Value| {
        v.as_str()
            .and_then(|s| s.parse().ok())
            .or_else(|| v.as_u64())
            .unwrap_or(0)
    };
    let wasm_stats = fleet.envoy_stats("wasm").await.unwrap_or_default();
    let wasm_vms_active = wasm_stats
        .lines()
        .find_map(|l| l.strip_prefix("wasm.envoy.wasm.runtime.v8.active: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(f64::NAN);
    let (wasm_memory_kb, wasm_memory_rss_kb) = wasm_memory_kb(fleet.envoy.process().pid());
    let latencies = std::mem::take(&mut *counters.latencies.lock());
    let served = latencies.len() as f64;
    Ok(Sample {
        t_s,
        ok: counters.ok.load(Ordering::Relaxed),
        failed: counters.failed.load(Ordering::Relaxed),
        in_flight: counters.in_flight.load(Ordering::Relaxed),
        rps: served / period_s.max(1e-9),
        p50_ms: percentile(latencies.clone(), 0.5),
        p99_ms: percentile(latencies, 0.99),
        cp_rss_kb: rss_kb(cp.process().pid()),
        cp_index_blocks: harness::prometheus_sum(&cp_metrics, "kvroute_index_blocks"),
        cp_inflight: harness::prometheus_sum(&cp_metrics, "kvroute_inflight"),
        envoy_rss_kb: rss_kb(fleet.envoy.process().pid()),
        envoy_heap_allocated: as_u64(&memory["allocated"]),
        wasm_memory_kb,
        wasm_memory_rss_kb,
        wasm_vms_active,
    })
}

fn csv(samples: &[Sample]) -> String {
    let mut out = String::from(
        "t_s,ok,failed,in_flight,rps,p50_ms,p99_ms,cp_rss_kb,cp_index_blocks,cp_inflight,\
         envoy_rss_kb,envoy_heap_allocated,wasm_memory_kb,wasm_memory_rss_kb,wasm_vms_active\n",
    );
    for s in samples {
        let _ = writeln!(
            out,
            "{:.1},{},{},{},{:.2},{:.1},{:.1},{},{},{},{},{},{},{},{}",
            s.t_s,
            s.ok,
            s.failed,
            s.in_flight,
            s.rps,
            s.p50_ms,
            s.p99_ms,
            s.cp_rss_kb,
            s.cp_index_blocks,
            s.cp_inflight,
            s.envoy_rss_kb,
            s.envoy_heap_allocated,
            s.wasm_memory_kb,
            s.wasm_memory_rss_kb,
            s.wasm_vms_active
        );
    }
    out
}

/// What `summary.json` holds.
#[derive(Debug, Serialize)]
struct SoakSummary {
    decision: Decision,
    /// Routed requests the proxy decided itself (no route call), with `--decision local`.
    local_decision_fraction: Option<f64>,
    replicas: usize,
    max_num_seqs: u32,
    speed: f64,
    profile: String,
    capacity_rps: Option<f64>,
    offered_rps: f64,
    minutes: f64,
    ok: u64,
    failed: u64,
    /// Served requests by kind: new chat, next turn, long prompt, one-off.
    served_by_kind: [u64; 4],
    streamed: u64,
    max_in_flight: u64,
    errors: Vec<String>,
    series: Vec<SeriesSummary>,
    samples: Vec<Sample>,
}

/// Closed loop with every replica's batch kept full; served requests per second over the last
/// two thirds of the window.
async fn calibrate(
    url: &str,
    mix: &Arc<Mutex<Mix>>,
    secs: u64,
    workers: usize,
) -> anyhow::Result<f64> {
    let counters = Arc::new(Counters::default());
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..workers {
        let (client, url, mix, counters) = (
            HttpClient::new(),
            url.to_string(),
            mix.clone(),
            counters.clone(),
        );
        tasks.spawn(async move {
            while Instant::now() < deadline {
                one_request(client.clone(), url.clone(), mix.clone(), counters.clone()).await;
            }
        });
    }
    tokio::time::sleep(Duration::from_secs(secs / 3)).await;
    let ok_at_third = counters.ok.load(Ordering::Relaxed);
    let third = Instant::now();
    tokio::time::sleep(deadline.saturating_duration_since(Instant::now())).await;
    let served = counters.ok.load(Ordering::Relaxed) - ok_at_third;
    let window = third.elapsed().as_secs_f64();
    while tasks.join_next().await.is_some() {}
    let failed = counters.failed.load(Ordering::Relaxed);
    if failed > 0 {
        bail!(
            "{failed} requests failed during calibration: {:?}",
            counters.errors.lock()
        );
    }
    if served == 0 {
        bail!("no request was served during calibration");
    }
    Ok(served as f64 / window)
}

async fn run(args: Args) -> anyhow::Result<()> {
    let out_dir = harness::output_dir(args.out_dir.as_deref(), "soak")?;
    let tools = Tools::locate().context("the soak needs its tools (try `make setup build`)")?;
    let mut cfg = FleetConfig::new("soak");
    cfg.replicas = args.replicas;
    cfg.router = RouterKind::Kvroute;
    cfg.seed = args.seed;
    cfg.plugin_config = json!({"decision": args.decision.as_str()});
    cfg.sim_args = vec![
        "--speed".into(),
        args.speed.to_string(),
        "--profile".into(),
        args.profile.clone(),
        "--max-num-seqs".into(),
        args.max_num_seqs.to_string(),
    ];
    let fleet = Fleet::start(cfg, &tools)
        .await
        .context("cannot start the soak topology")?;
    eprintln!("soak: topology up ({})", fleet.describe());
    let url = fleet.url();
    let mix = Arc::new(Mutex::new(Mix::new(
        args.seed,
        &fleet.config.model,
        args.max_tokens,
    )));

    let (capacity, offered) = match args.rate {
        Some(rate) => (None, rate),
        None => {
            let workers = args.replicas * args.max_num_seqs as usize * 2;
            eprintln!(
                "soak: measuring capacity for {} s with {workers} closed-loop clients ...",
                args.calibrate_secs
            );
            let cap = calibrate(&url, &mix, args.calibrate_secs.max(3), workers).await?;
            eprintln!(
                "soak: capacity {cap:.2} req/s; offering {:.2} req/s",
                cap * args.load_fraction
            );
            (Some(cap), cap * args.load_fraction)
        }
    };

    let counters = Arc::new(Counters::default());
    let total = Duration::from_secs_f64(args.minutes * 60.0);
    let started = Instant::now();
    let sample_period = Duration::from_secs(args.sample_secs);
    let mut next_sample = started + sample_period;
    let mut samples = vec![take_sample(&fleet, &counters, 0.0, 1.0).await?];
    counters.latencies.lock().clear();
    let mut last_sample_at = started;
    // A sample at the soak's current time over the period since the previous one.
    let sample_since = async |previous: Instant| {
        let t_s = started.elapsed().as_secs_f64();
        take_sample(&fleet, &counters, t_s, previous.elapsed().as_secs_f64()).await
    };
    let mut arrivals = SmallRng::seed_from_u64(args.seed ^ 0x5eed);
    let mut next_arrival = started;
    let client = HttpClient::new();
    let mut max_in_flight = 0;
    let csv_path = out_dir.join("samples.csv");
    while started.elapsed() < total {
        let now = Instant::now();
        if now >= next_sample {
            let s = sample_since(last_sample_at).await?;
            last_sample_at = Instant::now();
            eprintln!(
                "soak t={:>5.0}s ok={} failed={} in_flight={} rps={:.2} p99={:.0}ms cp_rss={}kB \
                 index={} envoy_rss={}kB heap={} wasm_mem={}kB (rss {}kB)",
                s.t_s,
                s.ok,
                s.failed,
                s.in_flight,
                s.rps,
                s.p99_ms,
                s.cp_rss_kb,
                s.cp_index_blocks,
                s.envoy_rss_kb,
                s.envoy_heap_allocated,
                s.wasm_memory_kb,
                s.wasm_memory_rss_kb
            );
            samples.push(s);
            std::fs::write(&csv_path, csv(&samples))
                .with_context(|| format!("cannot write {}", csv_path.display()))?;
            next_sample += sample_period;
            continue;
        }
        if now >= next_arrival {
            tokio::spawn(one_request(
                client.clone(),
                url.clone(),
                mix.clone(),
                counters.clone(),
            ));
            max_in_flight = max_in_flight.max(counters.in_flight.load(Ordering::Relaxed));
            // Poisson arrivals: exponential gaps with mean 1/offered.
            let u: f64 = arrivals.random_range(f64::EPSILON..1.0);
            next_arrival += Duration::from_secs_f64(-u.ln() / offered);
            continue;
        }
        let wake = next_arrival.min(next_sample);
        tokio::time::sleep(wake.saturating_duration_since(now)).await;
    }
    // Let the requests already sent finish.
    let drain_deadline = Instant::now() + REQUEST_TIMEOUT + Duration::from_secs(10);
    while counters.in_flight.load(Ordering::Relaxed) > 0 && Instant::now() < drain_deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let last = sample_since(last_sample_at).await?;
    samples.push(last);
    std::fs::write(&csv_path, csv(&samples))
        .with_context(|| format!("cannot write {}", csv_path.display()))?;

    let series: Vec<SeriesSummary> = SERIES
        .iter()
        .map(|n| summarize_series(&samples, n))
        .collect();
    let local_decision_fraction = match args.decision {
        Decision::Local => {
            let routed = fleet.envoy_counter("kvroute_requests_routed").await;
            let local = fleet.envoy_counter("kvroute_decisions_local").await;
            (routed > 0.0).then(|| local / routed)
        }
        Decision::ControlPlane => None,
    };
    let summary = SoakSummary {
        decision: args.decision,
        local_decision_fraction,
        replicas: args.replicas,
        max_num_seqs: args.max_num_seqs,
        speed: args.speed,
        profile: args.profile.clone(),
        capacity_rps: capacity,
        offered_rps: offered,
        minutes: args.minutes,
        ok: counters.ok.load(Ordering::Relaxed),
        failed: counters.failed.load(Ordering::Relaxed),
        served_by_kind: std::array::from_fn(|i| counters.by_kind[i].load(Ordering::Relaxed)),
        streamed: counters.streamed.load(Ordering::Relaxed),
        max_in_flight,
        errors: counters.errors.lock().clone(),
        series,
        samples,
    };
    let summary_path = out_dir.join("summary.json");
    harness::write_json(&summary_path, &summary)?;
    print!("{}", render_summary(&summary, &out_dir));
    if let Some(status) = check_processes(&fleet) {
        bail!("{status}; logs in {}", fleet.log_dir.display());
    }
    if summary.failed > 0 {
        bail!(
            "{} of {} requests failed: {:?}",
            summary.failed,
            summary.failed + summary.ok,
            summary.errors
        );
    }
    Ok(())
}

/// Which process, if any, is no longer running.
fn check_processes(fleet: &Fleet) -> Option<String> {
    let dead = |pid: u32| !Path::new(&format!("/proc/{pid}")).exists();
    if dead(fleet.envoy.process().pid()) {
        return Some("Envoy exited during the soak".into());
    }
    if fleet
        .control_plane
        .as_ref()
        .is_some_and(|cp| dead(cp.process().pid()))
    {
        return Some("the control plane exited during the soak".into());
    }
    None
}

fn render_summary(s: &SoakSummary, out_dir: &Path) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nkvroute soak: {} min, decision {}{}, {} replicas (max_num_seqs {}, speed {}, {}), capacity {}, offered {:.2} req/s",
        s.minutes,
        s.decision.as_str(),
        s.local_decision_fraction.map_or(String::new(), |f| format!(
            " ({:.1}% of routed requests decided in the proxy)",
            f * 100.0
        )),
        s.replicas,
        s.max_num_seqs,
        s.speed,
        s.profile,
        s.capacity_rps
            .map_or("not measured".to_string(), |c| format!("{c:.2} req/s")),
        s.offered_rps
    );
    let _ = writeln!(
        out,
        "requests: {} ok, {} failed; new chats {}, next turns {}, long prompts {}, one-offs {}; \
         {} streamed; at most {} in flight",
        s.ok,
        s.failed,
        s.served_by_kind[0],
        s.served_by_kind[1],
        s.served_by_kind[2],
        s.served_by_kind[3],
        s.streamed,
        s.max_in_flight
    );
    let _ = writeln!(
        out,
        "{:<22} {:>14} {:>14} {:>14} {:>16} {:>10}",
        "series", "first", "last", "max", "slope/hour", "rel/hour"
    );
    for r in &s.series {
        let _ = writeln!(
            out,
            "{:<22} {:>14.1} {:>14.1} {:>14.1} {:>16.1} {:>9.1}%",
            r.name,
            r.first,
            r.last,
            r.max,
            r.slope_per_hour,
            r.relative_slope_per_hour * 100.0
        );
    }
    let _ = writeln!(
        out,
        "samples: {}  summary: {}",
        out_dir.join("samples.csv").display(),
        out_dir.join("summary.json").display()
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line_and_of_a_flat_series() {
        let line: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 3.0 * i as f64 + 1.0)).collect();
        assert!((least_squares_slope(&line) - 3.0).abs() < 1e-9);
        let flat: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 5.0)).collect();
        assert_eq!(least_squares_slope(&flat), 0.0);
        assert_eq!(least_squares_slope(&[(1.0, 2.0)]), 0.0);
    }

    #[test]
    fn wasm_memories_are_the_rw_mappings_before_large_guards() {
        // Two wasm memories as V8 maps them: each rw mapping is followed by its guard region.
        let smaps = include_str!("../../fixtures/smaps-wasm-guards.txt");
        assert_eq!(parse_wasm_memories(smaps), (1280, 228));
        assert_eq!(parse_wasm_memories(""), (0, 0));
    }

    #[test]
    fn the_mix_continues_conversations_and_bounds_open_ones() {
        let mut mix = Mix::new(1, "m", 16);
        let mut kinds = [0usize; 4];
        for _ in 0..2000 {
            let (kind, conv, body) = mix.next();
            kinds[kind as usize] += 1;
            assert!(body["messages"].as_array().is_some_and(|m| !m.is_empty()));
            if let Some(c) = conv {
                mix.give_back(c, "answer".into());
            }
            assert!(mix.idle.len() <= MAX_OPEN_CONVERSATIONS);
        }
        assert!(kinds.iter().all(|&k| k > 0), "every kind occurs: {kinds:?}");
    }
}
