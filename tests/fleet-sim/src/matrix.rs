//! `fleet-sim matrix`: every policy on workloads x engine pools x loads x seeds, summarised per
//! cell as the mean over seeds with a 95% t-interval.
//!
//! - **Workloads**: shared-prefix, multi-turn, long-doc, a window of the shipped Mooncake trace,
//!   agentic (a growing tool-call loop forking subagents that share its context).
//! - **Pools**: `llama8b-h100` (the profile kvroute's old constants came from), the shipped
//!   profiles of other GPUs and models (`llama70b-h100-tp4`, `qwen32b-h200`, `llama8b-l4`),
//!   and a mixed pool of half `llama8b-h100`, half `llama8b-a100-40g`.
//! - **Loads** are set from the pool's capacity, not by hand. The workload's offered prompt
//!   tokens per second (later turns placed at their think time after the previous turn's
//!   arrival, as if service took no time) are first scaled to the pool's summed
//!   `prefill_tokens_per_s` (all of it, think and tool times included, as `--speedup` does);
//!   a round-robin pilot run at that rate measures round robin's hit rate `h`, and the final
//!   rate puts round robin's *uncached* prefill at a fraction of the capacity:
//!   [`MODERATE_LOAD`] (round robin is busy but keeps up) and [`SATURATING_LOAD`] (it cannot:
//!   with decode steps on top, its queues grow for the whole run). Prompts that fill the
//!   pool's `max_model_len` are refused by the engines and left out of the offered load.
//!   Closed-loop workloads (multi-turn, agentic: a turn waits for the previous one) keep their
//!   think and tool times; their sessions start at the rate that offers that load, and a
//!   higher load has proportionally more sessions over the same window, since a closed loop's
//!   load is its concurrency.
//! - **Tight-cache cells** shrink `llama8b-h100`'s cache to [`TIGHT_CACHE_TOKENS`] per replica,
//!   well under the working set, to test whether precise mode (which sees every eviction)
//!   earns its cost over approximate mode.
//! - **Seeds** are split: seeds [`TUNING_SEEDS`] are the tuning split (for choosing defaults),
//!   seeds [`REPORT_SEEDS`] the report split. The matrix reports on the report split unless
//!   told `--split tuning`; a default tuned on the report split would be reported on the data
//!   it was fit to. For generated workloads a seed draws the workload; for the Mooncake trace
//!   it picks which window of the trace is replayed.
//!
//! kvroute runs with scorer-core's `RouterConfig::default()` and no per-profile setting. The
//! oracle ([`crate::oracle`]) is the greedy exact-state limit; every policy's TTFT p50 is
//! reported as a ratio to it.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvroute_harness::TextTable;
use scorer_core::protocol::ApiKind;
use serde::Serialize;
use vllm_sim::{Profile, SimError};

use crate::des::{RunOptions, SimConfig, run_with};
use crate::policy::{self, TextModel};
use crate::report::PolicySummary;
use crate::workload::{
    Marking, Workload, WorkloadError, client_max_tokens, from_spec, read_mooncake,
};

/// Offered load (fraction of the pool's prefill capacity) where round robin is moderately busy.
pub const MODERATE_LOAD: f64 = 0.5;
/// Offered load where round robin saturates.
pub const SATURATING_LOAD: f64 = 1.2;
/// Per-replica KV cache of the tight-cache cells (tokens).
pub const TIGHT_CACHE_TOKENS: u64 = 60_000;
/// The tuning split of seeds.
pub const TUNING_SEEDS: [u64; 2] = [1, 2];
/// The report split of seeds (the default).
pub const REPORT_SEEDS: [u64; 5] = [3, 4, 5, 6, 7];

/// Policies of [`policy::POLICY_NAMES`] the matrix leaves out by default: random and
/// power-of-two add nothing least-request and round robin do not show, and kvroute-local is
/// kvroute's staleness study (`docs/BENCHMARKS.md`).
pub const MATRIX_SKIPS: &[&str] = &["random", "power-of-two", "kvroute-local"];

/// Policies the matrix compares by default: every policy but [`MATRIX_SKIPS`].
pub fn matrix_policies() -> Vec<String> {
    policy::POLICY_NAMES
        .iter()
        .filter(|p| !MATRIX_SKIPS.contains(p))
        .map(|p| p.to_string())
        .collect()
}

/// A workload of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MatrixWorkload {
    /// Groups sharing a long system prompt.
    SharedPrefix,
    /// Chat conversations repeating their history.
    MultiTurn,
    /// Questions over a few long documents mixed with short chats.
    LongDoc,
    /// A window of the shipped Mooncake trace.
    Mooncake,
    /// Tool-call loops with fan-out subagents.
    Agentic,
}

impl MatrixWorkload {
    /// Every workload, in table order.
    pub const ALL: [MatrixWorkload; 5] = [
        MatrixWorkload::SharedPrefix,
        MatrixWorkload::MultiTurn,
        MatrixWorkload::LongDoc,
        MatrixWorkload::Mooncake,
        MatrixWorkload::Agentic,
    ];

    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            MatrixWorkload::SharedPrefix => "shared-prefix",
            MatrixWorkload::MultiTurn => "multi-turn",
            MatrixWorkload::LongDoc => "long-doc",
            MatrixWorkload::Mooncake => "mooncake",
            MatrixWorkload::Agentic => "agentic",
        }
    }

    /// The generator spec for about `requests` requests (`None` for the trace). Arrival rates
    /// are placeholders: the matrix rescales arrivals to the cell's load.
    pub fn spec(self, requests: usize) -> Option<String> {
        let r = requests.max(10);
        match self {
            MatrixWorkload::SharedPrefix => Some(format!(
                "shared-prefix:groups={},prompts=5,system=6000,question=1200,output=400",
                r / 5
            )),
            MatrixWorkload::LongDoc => Some(format!(
                "long-doc:requests={r},docs=8,doc=12000,short=40,output=100"
            )),
            MatrixWorkload::MultiTurn | MatrixWorkload::Agentic => {
                self.session_spec(self.sessions_for(r)?, 1.0)
            }
            MatrixWorkload::Mooncake => None,
        }
    }

    /// Sessions (conversations, agents) of a closed-loop workload for about `requests`
    /// requests; `None` for open-loop workloads.
    pub fn sessions_for(self, requests: usize) -> Option<usize> {
        match self {
            MatrixWorkload::MultiTurn => Some((requests / 6).max(1)),
            // 10 main turns plus 2 forks of 3 subagents x 3 turns: 28 requests an agent.
            MatrixWorkload::Agentic => Some((requests / 28).max(1)),
            _ => None,
        }
    }

    /// The closed-loop generator spec of `sessions` sessions starting at `rps` a second.
    pub fn session_spec(self, sessions: usize, rps: f64) -> Option<String> {
        match self {
            MatrixWorkload::MultiTurn => Some(format!(
                "multi-turn:conversations={sessions},turns=6,system=2000,user=200,output=150,rps={rps}"
            )),
            MatrixWorkload::Agentic => Some(format!(
                "agentic:agents={sessions},steps=10,system=4000,task=300,tool=500,call=100,answer=400,fork_every=4,fanout=3,sub_steps=3,rps={rps}"
            )),
            _ => None,
        }
    }
}

/// An engine pool: one profile everywhere, or half one, half another.
#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    /// Name in tables.
    pub name: String,
    /// The profiles, in equal shares over the replicas ([`Pool::replica_profiles`]).
    pub profiles: Vec<Profile>,
}

impl Pool {
    /// A pool of the shipped profile `name`, or `a+b` for half of each.
    pub fn named(name: &str) -> Option<Pool> {
        let profiles = name
            .split('+')
            .map(Profile::named)
            .collect::<Option<Vec<_>>>()?;
        Some(Pool {
            name: name.to_string(),
            profiles,
        })
    }

    /// A pool of profile files: `a.yaml`, or `a.yaml+b.yaml` for half of each (a mixed pool),
    /// named by the profiles' own names as [`Pool::named`] names shipped ones. This is how a
    /// user puts their own GPUs into the matrix, and how kvroute is tried on profiles it was
    /// never tuned on.
    pub fn from_files(spec: &str) -> Result<Pool, SimError> {
        let profiles = spec
            .split('+')
            .map(|path| Profile::load(Path::new(path)))
            .collect::<Result<Vec<_>, _>>()?;
        let name = profiles
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join("+");
        Ok(Pool { name, profiles })
    }

    /// This pool with every cache at `tokens` (same per-token decode cost).
    pub fn with_cache(&self, tokens: u64) -> Pool {
        Pool {
            name: format!("{}@{}k", self.name, tokens / 1000),
            profiles: self
                .profiles
                .iter()
                .map(|p| p.clone().with_kv_capacity_tokens(tokens))
                .collect(),
        }
    }

    /// The profile of each of `replicas` replicas in `seed`'s run: the pool's profiles in
    /// equal shares, laid out over the replica indexes in an order drawn from the seed. The
    /// order a router lists its workers in (registration, discovery, pod IPs) says nothing of
    /// their hardware; with the profiles in blocks every seed, a policy that breaks ties
    /// towards the first worker (SGLang's `min_by_key`) would start on the same GPU in every
    /// run, the fast one when it is listed first.
    pub fn replica_profiles(&self, replicas: usize, seed: u64) -> Vec<Profile> {
        let mut profiles: Vec<Profile> = self.shares(replicas).cloned().collect();
        if self.profiles.len() > 1 {
            // Fisher-Yates, with a stream of its own: the workload's and the policies' draws
            // from the same seed stay as they were.
            let mut rng = crate::policy::SplitMix(seed ^ 0x9007_1a40);
            for i in (1..profiles.len()).rev() {
                profiles.swap(i, rng.below(i + 1));
            }
        }
        profiles
    }

    /// The profile of each of `replicas` replicas, the pool's profiles in equal shares, in
    /// blocks (the layout aside).
    fn shares(&self, replicas: usize) -> impl Iterator<Item = &Profile> {
        let k = self.profiles.len().max(1);
        (0..replicas).map(move |i| &self.profiles[(i * k / replicas.max(1)).min(k - 1)])
    }

    /// Summed prefill capacity of `replicas` replicas (tokens/s).
    pub fn prefill_capacity(&self, replicas: usize) -> f64 {
        self.shares(replicas).map(|p| p.prefill_tokens_per_s).sum()
    }

    /// The context every replica accepts: a shorter prompt is served, its output clamped.
    pub fn max_model_len(&self) -> u32 {
        self.profiles
            .iter()
            .map(|p| p.max_model_len)
            .min()
            .unwrap_or(0)
    }
}

/// The pools of the default matrix.
pub const MATRIX_POOLS: &[&str] = &[
    "llama8b-h100",
    "llama70b-h100-tp4",
    "qwen32b-h200",
    "llama8b-l4",
    "llama8b-h100+llama8b-a100-40g",
];

/// One cell: a workload on a pool at a load.
#[derive(Debug, Clone)]
pub struct Cell {
    /// The workload.
    pub workload: MatrixWorkload,
    /// The pool.
    pub pool: Pool,
    /// Offered load, a fraction of the pool's prefill capacity.
    pub load: f64,
    /// A tight-cache cell (caches under the working set); it runs [`TIGHT_SCALE`] times the
    /// requests, so the working set outgrows the caches.
    pub tight: bool,
}

/// Requests of a tight-cache cell over an ordinary one.
pub const TIGHT_SCALE: usize = 3;

/// What the matrix runs.
#[derive(Debug, Clone)]
pub struct MatrixSpec {
    /// The cells.
    pub cells: Vec<Cell>,
    /// Seeds every cell runs.
    pub seeds: Vec<u64>,
    /// Policies every cell runs.
    pub policies: Vec<String>,
    /// Replicas per pool.
    pub replicas: usize,
    /// Requests per workload (about).
    pub requests: usize,
    /// The Mooncake trace.
    pub trace: PathBuf,
    /// Worker threads.
    pub threads: usize,
    /// kvroute's router settings (scorer-core's defaults unless `--router-config`).
    pub router: scorer_core::router::RouterConfig,
    /// Where to write every run's per-request records (CSV, one file per cell, seed and
    /// policy), for looking at what a policy did request by request; `None` writes nothing.
    pub records_dir: Option<PathBuf>,
    /// The share of each cell's traffic that bypasses the router
    /// ([`RunOptions::unseen_fraction`]); 0 in the default matrix.
    pub unseen_fraction: f64,
    /// Measure every decision's placement regret against the greedy oracle
    /// ([`RunOptions::regret`]); off in the default matrix (it costs an oracle's probes).
    pub regret: bool,
    /// How the text spells its tokens to kvroute's approximate filter (uniform 4 bytes a token
    /// in the default matrix; `--text-styles` for [`TextModel::Styled`]).
    pub text: TextModel,
}

/// The shipped Mooncake trace.
pub fn default_trace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/mooncake_synthetic_trace.jsonl")
}

impl MatrixSpec {
    /// The default matrix: every workload on every pool at both loads, plus tight-cache cells.
    pub fn full(seeds: Vec<u64>) -> Self {
        let mut spec = Self {
            cells: Vec::new(),
            seeds,
            policies: matrix_policies(),
            replicas: 8,
            requests: 400,
            trace: default_trace(),
            threads: 2,
            router: scorer_core::router::RouterConfig::default(),
            records_dir: None,
            unseen_fraction: 0.0,
            regret: false,
            text: TextModel::default(),
        };
        for pool in MATRIX_POOLS {
            spec.add_pool(Pool::named(pool).expect("matrix pools are shipped profiles"));
        }
        spec.cells.extend(tight_cells(&[
            MatrixWorkload::SharedPrefix,
            MatrixWorkload::Mooncake,
            MatrixWorkload::Agentic,
        ]));
        spec
    }

    /// A few small cells (finishes in well under two minutes on two cores).
    pub fn quick(seeds: Vec<u64>) -> Self {
        let mut cells = Vec::new();
        for pool in ["llama8b-h100", "llama8b-l4"] {
            let pool = Pool::named(pool).expect("shipped profile");
            for workload in [MatrixWorkload::SharedPrefix, MatrixWorkload::Agentic] {
                cells.push(Cell {
                    workload,
                    pool: pool.clone(),
                    load: SATURATING_LOAD,
                    tight: false,
                });
            }
        }
        cells.extend(tight_cells(&[MatrixWorkload::Mooncake]));
        Self {
            cells,
            seeds,
            policies: matrix_policies(),
            replicas: 4,
            requests: 200,
            trace: default_trace(),
            threads: 2,
            router: scorer_core::router::RouterConfig::default(),
            records_dir: None,
            unseen_fraction: 0.0,
            regret: false,
            text: TextModel::default(),
        }
    }

    /// Adds `pool`'s cells: every workload at both loads, as a shipped pool has.
    pub fn add_pool(&mut self, pool: Pool) {
        for workload in MatrixWorkload::ALL {
            for load in [MODERATE_LOAD, SATURATING_LOAD] {
                self.cells.push(Cell {
                    workload,
                    pool: pool.clone(),
                    load,
                    tight: false,
                });
            }
        }
    }
}

fn tight_cells(workloads: &[MatrixWorkload]) -> Vec<Cell> {
    let pool = Pool::named("llama8b-h100")
        .expect("shipped profile")
        .with_cache(TIGHT_CACHE_TOKENS);
    workloads
        .iter()
        .map(|&workload| Cell {
            workload,
            pool: pool.clone(),
            load: MODERATE_LOAD,
            tight: true,
        })
        .collect()
}

/// Errors of a matrix run.
#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    /// A workload could not be built.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// A simulation failed.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// A policy name is unknown.
    #[error("unknown policy {0:?}")]
    Policy(String),
}

/// Each request's arrival as if service took no time: later turns at their think time after
/// their previous turn's arrival.
fn offered_arrivals(w: &Workload) -> Vec<f64> {
    let mut at = vec![0.0; w.requests.len()];
    for i in 0..w.requests.len() {
        at[i] = match w.depends_on(i) {
            Some(p) => at[p] + w.requests[i].arrival_ms,
            None => w.requests[i].arrival_ms,
        };
    }
    at
}

/// Offered prompt tokens per second of `w`, every token counted as uncached.
pub fn offered_tokens_per_s(w: &Workload) -> f64 {
    let at = offered_arrivals(w);
    let first = at.iter().copied().fold(f64::INFINITY, f64::min);
    let last = at.iter().copied().fold(0.0, f64::max);
    let span_s = ((last - first) / 1000.0).max(1e-3);
    let tokens: f64 = (0..w.requests.len())
        .map(|i| f64::from(w.prompt_len(i)))
        .sum();
    tokens / span_s
}

/// Round robin's prefix hit rate on `w` (the load pilot).
fn pilot_hit_rate(
    cell: &Cell,
    seed: u64,
    w: &Workload,
    max_tokens: Option<u32>,
    replicas: usize,
) -> Result<f64, MatrixError> {
    let (cfg, options) = sim_setup(cell, seed, max_tokens, replicas);
    let mut rr = policy::build("round-robin", replicas, seed)
        .ok_or_else(|| MatrixError::Policy("round-robin".into()))?;
    let run = run_with(w, rr.as_mut(), &cfg, &options)?;
    Ok(PolicySummary::of(&run).prefix_hit_rate)
}

/// The simulation settings of `cell` for `seed`.
fn sim_setup(
    cell: &Cell,
    seed: u64,
    max_tokens: Option<u32>,
    replicas: usize,
) -> (SimConfig, RunOptions) {
    let profiles = cell.pool.replica_profiles(replicas, seed);
    let cfg = SimConfig {
        replicas,
        profile: profiles[0].clone(),
        seed,
        metrics_interval_ms: 100.0,
    };
    let options = RunOptions {
        max_tokens,
        replica_profiles: if cell.pool.profiles.len() > 1 {
            profiles
        } else {
            Vec::new()
        },
        ..RunOptions::default()
    };
    (cfg, options)
}

/// The cell's workload for `seed`, at the cell's load, and the client's `max_tokens`.
fn cell_workload(
    cell: &Cell,
    seed: u64,
    spec: &MatrixSpec,
    trace: &Workload,
    replicas: usize,
) -> Result<(Workload, Option<u32>, f64), MatrixError> {
    let requests = if cell.tight {
        spec.requests * TIGHT_SCALE
    } else {
        spec.requests
    };
    if let Some(sessions) = cell.workload.sessions_for(requests) {
        return closed_loop_workload(cell, seed, sessions, replicas);
    }
    let (mut w, max_tokens) = match cell.workload.spec(requests) {
        Some(s) => (from_spec(&s, seed)?, client_max_tokens(&s)?),
        None => {
            // A seed picks a window of the trace (windows of different seeds do not overlap
            // until the trace runs out).
            let n = requests.min(trace.requests.len());
            let windows = (trace.requests.len() / n.max(1)).max(1);
            let start = (seed as usize % windows) * n;
            let mut requests = trace.requests[start..start + n].to_vec();
            let t0 = requests.first().map_or(0.0, |r| r.arrival_ms);
            for r in &mut requests {
                r.arrival_ms -= t0;
            }
            (
                Workload {
                    cache_control: Marking::None,
                    api: ApiKind::Chat,
                    name: "mooncake".into(),
                    requests,
                },
                None,
            )
        }
    };
    // Requests no replica accepts are left out of the offered load (the engines refuse them).
    let limit = cell.pool.max_model_len();
    let fits = (0..w.requests.len())
        .filter(|&i| w.prompt_len(i) < limit)
        .count() as f64
        / w.requests.len().max(1) as f64;
    let capacity = cell.pool.prefill_capacity(replicas) / fits.max(1e-3);
    // First every prompt token counted as uncached fills the capacity; a round-robin pilot at
    // that rate measures how much round robin still hits, and the final rate puts round
    // robin's uncached prefill at `load` of the capacity.
    w.speed_up(capacity / offered_tokens_per_s(&w).max(1e-9));
    let pilot_hit = pilot_hit_rate(cell, seed, &w, max_tokens, replicas)?;
    w.speed_up(cell.load / (1.0 - pilot_hit).max(0.05));
    Ok((w, max_tokens, pilot_hit))
}

/// A closed-loop cell's workload: a turn waits for the previous one, so compressing arrivals
/// cannot raise the load past what its sessions' concurrency allows. Think and tool times stay
/// as generated; sessions start at the rate whose prompt tokens (round robin's uncached share,
/// from a pilot) are `load` of the capacity, and there are more sessions at a higher load (the
/// moderate load's session count times `load / MODERATE_LOAD`: the same window of time).
fn closed_loop_workload(
    cell: &Cell,
    seed: u64,
    sessions: usize,
    replicas: usize,
) -> Result<(Workload, Option<u32>, f64), MatrixError> {
    let build = |sessions: usize, rps: f64| -> Result<(Workload, Option<u32>), MatrixError> {
        let spec = cell
            .workload
            .session_spec(sessions, rps)
            .ok_or_else(|| MatrixError::Policy(cell.workload.name().into()))?;
        Ok((from_spec(&spec, seed)?, client_max_tokens(&spec)?))
    };
    let (w, _) = build(sessions, 1.0)?;
    let per_session: f64 = (0..w.requests.len())
        .map(|i| f64::from(w.prompt_len(i)))
        .sum::<f64>()
        / sessions as f64;
    let capacity = cell.pool.prefill_capacity(replicas);
    let (pilot, max_tokens) = build(sessions, capacity / per_session.max(1.0))?;
    let hit = pilot_hit_rate(cell, seed, &pilot, max_tokens, replicas)?;
    let rps = cell.load * capacity / ((1.0 - hit).max(0.05) * per_session.max(1.0));
    let scaled = ((sessions as f64 * cell.load / MODERATE_LOAD).round() as usize).max(1);
    let (w, max_tokens) = build(scaled, rps)?;
    Ok((w, max_tokens, hit))
}

/// Mean and 95% half-width (Student's t) of a sample.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Interval {
    /// Mean over seeds.
    pub mean: f64,
    /// Half-width of the 95% confidence interval (0 for fewer than two values).
    pub half: f64,
}

/// Two-sided 97.5% quantiles of Student's t for 1..=30 degrees of freedom.
const T975: [f64; 30] = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
];

impl Interval {
    /// The interval of `values`.
    pub fn of(values: &[f64]) -> Self {
        let n = values.len();
        if n == 0 {
            return Self::default();
        }
        let mean = values.iter().sum::<f64>() / n as f64;
        if n < 2 {
            return Self { mean, half: 0.0 };
        }
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        let t = T975.get(n - 2).copied().unwrap_or(1.96);
        Self {
            mean,
            half: t * (var / n as f64).sqrt(),
        }
    }

    /// Whether this interval reaches down to (or below) `other`'s upper end: "at or below
    /// within the interval".
    pub fn at_or_below(&self, other: &Interval) -> bool {
        self.mean - self.half <= other.mean + other.half
    }
}

/// One policy in one cell.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyCell {
    /// The policy.
    pub policy: String,
    /// TTFT p50 (ms) over seeds.
    pub ttft_p50_ms: Interval,
    /// TTFT p90 (ms).
    pub ttft_p90_ms: Interval,
    /// TTFT p99 (ms).
    pub ttft_p99_ms: Interval,
    /// End-to-end p50 (ms).
    pub e2e_p50_ms: Interval,
    /// Prefix-cache hit rate (tokens).
    pub prefix_hit_rate: Interval,
    /// Output tokens per second over the makespan.
    pub output_tokens_per_s: Interval,
    /// Requests the engines refused, mean over seeds.
    pub rejected: f64,
    /// TTFT p50 over the oracle's (mean over mean), when the oracle ran.
    pub p50_vs_oracle: Option<f64>,
    /// Per-seed summaries.
    pub seeds: Vec<PolicySummary>,
}

/// kvroute against the peers in one cell.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// The peer with the lowest TTFT p50.
    pub best_peer_p50: String,
    /// kvroute's TTFT p50 over that peer's.
    pub p50_ratio: f64,
    /// kvroute's p50 at or below the best peer's within the intervals.
    pub p50_ok: bool,
    /// The peer with the lowest TTFT p99.
    pub best_peer_p99: String,
    /// kvroute's TTFT p99 over that peer's.
    pub p99_ratio: f64,
    /// kvroute's p99 at or below the best peer's within the intervals.
    pub p99_ok: bool,
    /// kvroute's TTFT p50 over the oracle's.
    pub p50_vs_oracle: Option<f64>,
    /// Precise over approximate kvroute: TTFT p90 ratio and hit rates (when both ran).
    pub precise_p90_ratio: Option<f64>,
    /// Hit rate of kvroute-precise minus kvroute's.
    pub precise_hit_gain: Option<f64>,
}

/// One cell's results.
#[derive(Debug, Clone, Serialize)]
pub struct CellReport {
    /// The workload.
    pub workload: String,
    /// The pool.
    pub pool: String,
    /// Offered load (fraction of prefill capacity).
    pub load: f64,
    /// A tight-cache cell.
    pub tight: bool,
    /// Every policy.
    pub policies: Vec<PolicyCell>,
    /// kvroute against the peers, when kvroute and a peer ran.
    pub verdict: Option<Verdict>,
}

/// The whole matrix.
#[derive(Debug, Clone, Serialize)]
pub struct MatrixReport {
    /// Seeds every cell ran.
    pub seeds: Vec<u64>,
    /// Replicas per pool.
    pub replicas: usize,
    /// Requests per workload (about).
    pub requests: usize,
    /// The cells.
    pub cells: Vec<CellReport>,
}

/// Whether `name` is a peer (not kvroute's, not the oracle).
fn is_peer(name: &str) -> bool {
    !name.starts_with("kvroute") && name != "oracle"
}

fn summarise(cell: &Cell, policies: &[String], runs: Vec<Vec<PolicySummary>>) -> CellReport {
    let interval = |runs: &[PolicySummary], f: &dyn Fn(&PolicySummary) -> f64| -> Interval {
        Interval::of(&runs.iter().map(f).collect::<Vec<_>>())
    };
    let mut cells: Vec<PolicyCell> = policies
        .iter()
        .zip(runs)
        .map(|(name, runs)| PolicyCell {
            policy: name.clone(),
            ttft_p50_ms: interval(&runs, &|s| s.ttft_ms.p50),
            ttft_p90_ms: interval(&runs, &|s| s.ttft_ms.p90),
            ttft_p99_ms: interval(&runs, &|s| s.ttft_ms.p99),
            e2e_p50_ms: interval(&runs, &|s| s.e2e_ms.p50),
            prefix_hit_rate: interval(&runs, &|s| s.prefix_hit_rate),
            output_tokens_per_s: interval(&runs, &|s| s.output_tokens_per_s),
            rejected: runs.iter().map(|s| s.rejected as f64).sum::<f64>()
                / runs.len().max(1) as f64,
            p50_vs_oracle: None,
            seeds: runs,
        })
        .collect();
    let oracle = cells
        .iter()
        .find(|c| c.policy == "oracle")
        .map(|c| c.ttft_p50_ms.mean);
    for c in &mut cells {
        c.p50_vs_oracle = oracle.filter(|o| *o > 0.0).map(|o| c.ttft_p50_ms.mean / o);
    }
    let find = |name: &str| cells.iter().find(|c| c.policy == name);
    let best_peer = |f: &dyn Fn(&PolicyCell) -> f64| {
        cells
            .iter()
            .filter(|c| is_peer(&c.policy))
            .min_by(|a, b| f(a).total_cmp(&f(b)))
    };
    let verdict = find("kvroute").and_then(|k| {
        let p50 = best_peer(&|c| c.ttft_p50_ms.mean)?;
        let p99 = best_peer(&|c| c.ttft_p99_ms.mean)?;
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        let precise = find("kvroute-precise");
        Some(Verdict {
            best_peer_p50: p50.policy.clone(),
            p50_ratio: ratio(k.ttft_p50_ms.mean, p50.ttft_p50_ms.mean),
            p50_ok: k.ttft_p50_ms.at_or_below(&p50.ttft_p50_ms),
            best_peer_p99: p99.policy.clone(),
            p99_ratio: ratio(k.ttft_p99_ms.mean, p99.ttft_p99_ms.mean),
            p99_ok: k.ttft_p99_ms.at_or_below(&p99.ttft_p99_ms),
            p50_vs_oracle: k.p50_vs_oracle,
            precise_p90_ratio: precise.map(|p| ratio(p.ttft_p90_ms.mean, k.ttft_p90_ms.mean)),
            precise_hit_gain: precise.map(|p| p.prefix_hit_rate.mean - k.prefix_hit_rate.mean),
        })
    });
    CellReport {
        workload: cell.workload.name().into(),
        pool: cell.pool.name.clone(),
        load: cell.load,
        tight: cell.tight,
        policies: cells,
        verdict,
    }
}

/// Runs the matrix on `spec.threads` threads; `progress` hears about each finished run.
pub fn run_matrix(
    spec: &MatrixSpec,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<MatrixReport, MatrixError> {
    for p in &spec.policies {
        policy::check_policy(p).map_err(|_| MatrixError::Policy(p.clone()))?;
    }
    let needs_trace = spec
        .cells
        .iter()
        .any(|c| c.workload == MatrixWorkload::Mooncake);
    let trace = if needs_trace {
        read_mooncake(&spec.trace)?
    } else {
        Workload {
            cache_control: Marking::None,
            api: ApiKind::Chat,
            name: "none".into(),
            requests: Vec::new(),
        }
    };
    // Jobs: (cell, seed); every policy of a job replays the same workload.
    let jobs: Vec<(usize, usize)> = (0..spec.cells.len())
        .flat_map(|c| (0..spec.seeds.len()).map(move |s| (c, s)))
        .collect();
    let total = jobs.len() * spec.policies.len();
    let results: Mutex<Vec<Option<JobResult>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..spec.threads.max(1) {
            scope.spawn(|| {
                loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(c, s)) = jobs.get(j) else {
                        break;
                    };
                    let out = run_job(spec, &spec.cells[c], spec.seeds[s], &trace, &|| {
                        progress(done.fetch_add(1, Ordering::Relaxed) + 1, total)
                    });
                    if let Ok(mut r) = results.lock() {
                        r[j] = Some(out);
                    }
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_default();
    let mut cells = Vec::new();
    for (c, cell) in spec.cells.iter().enumerate() {
        let mut per_policy: Vec<Vec<PolicySummary>> = vec![Vec::new(); spec.policies.len()];
        for s in 0..spec.seeds.len() {
            let j = c * spec.seeds.len() + s;
            let runs = results[j].take().unwrap_or_else(|| Ok(Vec::new()))?;
            for (p, run) in runs.into_iter().enumerate() {
                per_policy[p].push(run);
            }
        }
        cells.push(summarise(cell, &spec.policies, per_policy));
    }
    Ok(MatrixReport {
        seeds: spec.seeds.clone(),
        replicas: spec.replicas,
        requests: spec.requests,
        cells,
    })
}

/// One (cell, seed)'s summaries, one per policy.
type JobResult = Result<Vec<PolicySummary>, MatrixError>;

fn run_job(
    spec: &MatrixSpec,
    cell: &Cell,
    seed: u64,
    trace: &Workload,
    tick: &dyn Fn(),
) -> Result<Vec<PolicySummary>, MatrixError> {
    let replicas = spec.replicas;
    let (workload, max_tokens, _) = cell_workload(cell, seed, spec, trace, replicas)?;
    let (cfg, mut options) = sim_setup(cell, seed, max_tokens, replicas);
    options.unseen_fraction = spec.unseen_fraction;
    options.regret = spec.regret;
    let mut out = Vec::with_capacity(spec.policies.len());
    for name in &spec.policies {
        // kvroute: scorer-core's defaults (or `--router-config`), no per-profile setting.
        let mut p = policy::build_with(name, replicas, seed, &spec.router, spec.text)
            .ok_or_else(|| MatrixError::Policy(name.clone()))?;
        let run = run_with(&workload, p.as_mut(), &cfg, &options)?;
        if let Some(dir) = &spec.records_dir {
            let file = format!(
                "{}_{}_{}{}_s{seed}_{name}.csv",
                cell.workload.name(),
                cell.pool.name,
                cell.load,
                if cell.tight { "_tight" } else { "" },
            );
            // Analysis output only: a failed write loses the file, not the run.
            let _ = std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(dir.join(file), records_csv(&workload, &run)));
        }
        out.push(PolicySummary::of(&run));
        tick();
    }
    Ok(out)
}

/// One run's requests as CSV: when each arrived, got its first token and finished, where it
/// went, its prompt, cached and output tokens, its session and the request it continues.
pub fn records_csv(workload: &Workload, run: &crate::des::RunResult) -> String {
    use std::fmt::Write;
    let mut s = String::from(
        "id,arrival_ms,first_token_ms,finish_ms,replica,prompt_tokens,cached_tokens,output_tokens,session,depends_on,predicted_cached_tokens,regret_ms\n",
    );
    let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.1}"));
    for (i, r) in run.records.iter().enumerate() {
        let _ = writeln!(
            s,
            "{i},{:.1},{},{},{},{},{},{},{},{},{},{}",
            r.arrival_ms,
            opt(r.first_token_ms),
            opt(r.finish_ms),
            r.replica,
            r.prompt_tokens,
            r.cached_tokens,
            r.output_tokens,
            workload.requests[i]
                .session
                .map_or(String::new(), |v| v.to_string()),
            workload
                .depends_on(i)
                .map_or(String::new(), |v| v.to_string()),
            r.predicted_cached_tokens
                .map_or(String::new(), |v| v.to_string()),
            opt(r.regret_ms),
        );
    }
    s
}

fn fmt_iv(i: &Interval) -> String {
    if i.mean >= 100.0 {
        format!("{:.0}±{:.0}", i.mean, i.half)
    } else {
        format!("{:.1}±{:.1}", i.mean, i.half)
    }
}

/// The printed table: one row per cell and policy, then kvroute's verdict per cell.
pub fn table(report: &MatrixReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "seeds {:?}, {} replicas, ~{} requests per workload; TTFT in ms, mean ± 95% t-interval over seeds",
        report.seeds, report.replicas, report.requests
    );
    let policies: Vec<(&CellReport, &PolicyCell)> = report
        .cells
        .iter()
        .flat_map(|c| c.policies.iter().map(move |p| (c, p)))
        .collect();
    let or_dash = |r: Option<f64>, digits: usize| r.map_or("-".into(), |r| format!("{r:.digits$}"));
    s.push_str(
        &cell_table::<PolicyCell>()
            .left("policy", 18, |(_, p)| p.policy.clone())
            .right("TTFT p50", 13, |(_, p)| fmt_iv(&p.ttft_p50_ms))
            .right("TTFT p90", 13, |(_, p)| fmt_iv(&p.ttft_p90_ms))
            .right("TTFT p99", 13, |(_, p)| fmt_iv(&p.ttft_p99_ms))
            .right("hit rate", 11, |(_, p)| {
                let hit = &p.prefix_hit_rate;
                format!("{:.3}±{:.3}", hit.mean, hit.half)
            })
            .right("out tok/s", 9, |(_, p)| {
                format!("{:.0}", p.output_tokens_per_s.mean)
            })
            .right("rej", 6, |(_, p)| format!("{:.1}", p.rejected))
            .right("p50/orcl", 8, |(_, p)| or_dash(p.p50_vs_oracle, 2))
            .render(&policies),
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "kvroute (RouterConfig::default()) against the best peer per cell (ok = at or below within the intervals)"
    );
    let verdicts: Vec<(&CellReport, &Verdict)> = report
        .cells
        .iter()
        .filter_map(|c| Some((c, c.verdict.as_ref()?)))
        .collect();
    // A ratio and its mark share the ratio's column, so the mark runs one past the header.
    let marked =
        |ratio: f64, ok: bool| format!("{ratio:>5.2} {:<4}", if ok { "ok" } else { "LOSS" });
    s.push_str(
        &cell_table::<Verdict>()
            .left("best peer p50", 20, |(_, v)| v.best_peer_p50.clone())
            .right("kv/peer", 9, |(_, v)| marked(v.p50_ratio, v.p50_ok))
            .left("best peer p99", 20, |(_, v)| v.best_peer_p99.clone())
            .right("kv/peer", 9, |(_, v)| marked(v.p99_ratio, v.p99_ok))
            .right("kv/orcl", 8, |(_, v)| or_dash(v.p50_vs_oracle, 2))
            .right("precise p90/", 13, |(_, v)| or_dash(v.precise_p90_ratio, 3))
            .right("precise hit-", 13, |(_, v)| {
                v.precise_hit_gain
                    .map_or("-".into(), |r| format!("{r:+.4}"))
            })
            .render(&verdicts),
    );
    // The simulated engines deliver every hit they hold, so any change is a false alarm.
    let (mut changes, mut runs) = (0u64, 0usize);
    for summary in report
        .cells
        .iter()
        .flat_map(|c| &c.policies)
        .flat_map(|p| &p.seeds)
    {
        if let Some(n) = summary.routing_state_changes {
            changes += n;
            runs += 1;
        }
    }
    if runs > 0 {
        let _ = writeln!(
            s,
            "self-check: {changes} endpoint routing-state changes over {runs} kvroute runs"
        );
    }
    let owned = regret_rows(report);
    let regret: Vec<(&CellReport, &RegretRow)> = owned.iter().map(|(c, r)| (*c, r)).collect();
    if !regret.is_empty() {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "placement regret against the greedy oracle, kvroute and the best peer on TTFT p99 (means over seeds)"
        );
        s.push_str(
            &cell_table::<RegretRow>()
                .left("policy", 18, |(_, r)| r.policy.clone())
                .right("off best", 9, |(_, r)| {
                    format!("{:.1}%", r.off_best * 100.0)
                })
                .right("mean ms", 8, |(_, r)| format!("{:.1}", r.mean_ms))
                .right("of ttft tail", 12, |(_, r)| {
                    format!("{:.0}%", r.tail * 100.0)
                })
                .render(&regret),
        );
    }
    s
}

/// One policy's placement regret in a cell, averaged over its seeds.
struct RegretRow {
    policy: String,
    /// Share of decisions off the exact best.
    off_best: f64,
    /// Mean regret (ms).
    mean_ms: f64,
    /// Share of the TTFT tail that is regret.
    tail: f64,
}

/// kvroute's and the best p99 peer's regret per cell, where the runs measured it.
fn regret_rows(report: &MatrixReport) -> Vec<(&CellReport, RegretRow)> {
    let mut rows = Vec::new();
    for cell in &report.cells {
        let peer = cell.verdict.as_ref().map(|v| v.best_peer_p99.as_str());
        for p in &cell.policies {
            if p.policy != "kvroute" && Some(p.policy.as_str()) != peer {
                continue;
            }
            let seeds: Vec<_> = p.seeds.iter().filter_map(|s| s.regret).collect();
            if seeds.is_empty() {
                continue;
            }
            let mean = |f: &dyn Fn(&crate::report::RegretSummary) -> f64| {
                seeds.iter().map(f).sum::<f64>() / seeds.len() as f64
            };
            rows.push((
                cell,
                RegretRow {
                    policy: p.policy.clone(),
                    off_best: mean(&|r| r.off_best_share),
                    mean_ms: mean(&|r| r.mean_ms),
                    tail: mean(&|r| r.tail_share),
                },
            ));
        }
    }
    rows
}

/// A table of one row per cell and `T` (a policy's figures, a verdict), opening with the
/// cell's workload, pool and load columns.
fn cell_table<'r, T>() -> TextTable<'r, (&'r CellReport, &'r T)> {
    TextTable::new()
        .left("workload", 14, |(c, _): &(&CellReport, &T)| {
            c.workload.clone()
        })
        .left("pool", 32, |(c, _)| c.pool.clone())
        .right("load", 4, |(c, _)| format!("{:.1}", c.load))
}

#[cfg(test)]
mod tests {
    use super::*;

    // `--pool a.yaml+b.yaml`: a pool named by its profiles as a shipped one is, with every
    // workload at both loads; a file that is not there is an error naming it.
    #[test]
    fn a_pool_of_profile_files_is_named_by_its_profiles() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../vllm-sim/profiles");
        let spec = format!(
            "{}+{}",
            dir.join("llama8b-h100.yaml").display(),
            dir.join("llama8b-l4.yaml").display()
        );
        let pool = Pool::from_files(&spec).unwrap();
        assert_eq!(pool.name, "llama8b-h100+llama8b-l4");
        assert_eq!(pool.profiles.len(), 2);
        let mut matrix = MatrixSpec::quick(vec![1]);
        let before = matrix.cells.len();
        matrix.add_pool(pool);
        assert_eq!(matrix.cells.len(), before + 2 * MatrixWorkload::ALL.len());
        let missing = Pool::from_files("no/such/profile.yaml").unwrap_err();
        assert!(
            missing.to_string().contains("no/such/profile.yaml"),
            "{missing}"
        );
    }

    #[test]
    fn interval_is_the_t_interval_of_the_mean() {
        let i = Interval::of(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(i.mean, 3.0);
        // s = sqrt(2.5), t(0.975, 4) = 2.776.
        let want = 2.776 * (2.5f64 / 5.0).sqrt();
        assert!((i.half - want).abs() < 1e-9, "{}", i.half);
        assert_eq!(Interval::of(&[7.0]).half, 0.0);
        assert_eq!(Interval::of(&[]), Interval::default());
        // Two values: t(0.975, 1) = 12.706.
        let two = Interval::of(&[1.0, 3.0]);
        assert!((two.half - 12.706 * (2.0f64 / 2.0).sqrt()).abs() < 1e-9);
        assert!(
            Interval {
                mean: 10.0,
                half: 1.0
            }
            .at_or_below(&Interval {
                mean: 8.5,
                half: 0.5
            })
        );
        assert!(
            !Interval {
                mean: 10.0,
                half: 0.5
            }
            .at_or_below(&Interval {
                mean: 8.5,
                half: 0.5
            })
        );
    }

    #[test]
    fn a_mixed_pool_s_hardware_sits_at_other_indexes_in_other_seeds() {
        let pool = Pool::named("llama8b-h100+llama8b-a100-40g").unwrap();
        let layout = |seed| -> Vec<String> {
            pool.replica_profiles(8, seed)
                .into_iter()
                .map(|p| p.name)
                .collect()
        };
        assert_eq!(layout(3), layout(3), "a seed's layout is reproducible");
        let first: Vec<String> = (1..=7).map(|seed| layout(seed)[0].clone()).collect();
        assert!(
            first.iter().any(|n| n == "llama8b-h100") && first.iter().any(|n| n != "llama8b-h100"),
            "the first worker is not always the same GPU: {first:?}"
        );
        let one = Pool::named("llama8b-h100").unwrap();
        assert!(
            one.replica_profiles(8, 3)
                .iter()
                .all(|p| p.name == "llama8b-h100")
        );
    }

    #[test]
    fn loads_come_from_the_pools_capacity() {
        let pool = Pool::named("llama8b-h100+llama8b-a100-40g").unwrap();
        let profiles = pool.replica_profiles(4, 3);
        let h100 = profiles.iter().filter(|p| p.name == "llama8b-h100").count();
        assert_eq!(h100, 2, "half of each");
        assert_eq!(pool.prefill_capacity(4), 2.0 * 10_000.0 + 2.0 * 3_150.0);
        let cell = Cell {
            workload: MatrixWorkload::SharedPrefix,
            pool,
            load: 0.5,
            tight: false,
        };
        let spec = MatrixSpec::quick(vec![3]);
        let empty = Workload {
            cache_control: Marking::None,
            api: ApiKind::Chat,
            name: "none".into(),
            requests: Vec::new(),
        };
        let (w, cap, hit) = cell_workload(&cell, 3, &spec, &empty, 4).unwrap();
        assert_eq!(cap, Some(2048));
        assert!(hit > 0.0 && hit < 1.0, "{hit}");
        // Round robin's uncached prefill is the load's share of the capacity.
        let uncached = offered_tokens_per_s(&w) * (1.0 - hit);
        assert!(
            (uncached / (0.5 * 26_300.0) - 1.0).abs() < 1e-6,
            "{uncached}"
        );
    }

    // A closed loop's load is its concurrency: a higher load starts more sessions, faster.
    #[test]
    fn closed_loop_loads_scale_the_sessions() {
        let pool = Pool::named("llama8b-h100").unwrap();
        let cell = |load| Cell {
            workload: MatrixWorkload::MultiTurn,
            pool: pool.clone(),
            load,
            tight: false,
        };
        let mut spec = MatrixSpec::quick(vec![3]);
        spec.requests = 60;
        let empty = Workload {
            cache_control: Marking::None,
            api: ApiKind::Chat,
            name: "none".into(),
            requests: Vec::new(),
        };
        let (moderate, cap, _) = cell_workload(&cell(MODERATE_LOAD), 3, &spec, &empty, 4).unwrap();
        let (saturating, _, _) =
            cell_workload(&cell(SATURATING_LOAD), 3, &spec, &empty, 4).unwrap();
        assert_eq!(cap, None, "chat clients send no max_tokens");
        let sessions =
            |w: &Workload| w.requests.iter().filter_map(|r| r.session).max().unwrap() + 1;
        assert_eq!(sessions(&moderate), 10);
        assert_eq!(sessions(&saturating), 24);
        // Think times are kept (0.5x-1.5x of 2 s).
        assert!(
            moderate
                .requests
                .iter()
                .enumerate()
                .filter(|(i, _)| moderate.depends_on(*i).is_some())
                .all(|(_, r)| (1000.0..=3000.0).contains(&r.arrival_ms))
        );
    }

    #[test]
    fn seeds_are_split_and_the_quick_matrix_is_small() {
        assert!(TUNING_SEEDS.iter().all(|s| !REPORT_SEEDS.contains(s)));
        assert!(REPORT_SEEDS.len() >= 5);
        let quick = MatrixSpec::quick(REPORT_SEEDS.to_vec());
        assert!(quick.cells.len() <= 6 && quick.cells.iter().any(|c| c.tight));
        let full = MatrixSpec::full(REPORT_SEEDS.to_vec());
        for w in MatrixWorkload::ALL {
            assert!(full.cells.iter().any(|c| c.workload == w));
        }
        assert!(full.cells.iter().any(|c| c.pool.profiles.len() == 2));
    }

    // A tiny matrix end to end: every policy reports, kvroute gets a verdict.
    #[test]
    fn a_tiny_matrix_runs() {
        let mut spec = MatrixSpec::quick(vec![3, 4]);
        spec.cells.truncate(1);
        spec.requests = 20;
        spec.replicas = 2;
        spec.policies = ["round-robin", "kvroute", "oracle"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let report = run_matrix(&spec, &|_, _| {}).unwrap();
        let cell = &report.cells[0];
        assert_eq!(cell.policies.len(), 3);
        assert!(cell.policies.iter().all(|p| p.seeds.len() == 2));
        let v = cell.verdict.as_ref().unwrap();
        assert_eq!(v.best_peer_p50, "round-robin");
        assert!(cell.policies[2].p50_vs_oracle == Some(1.0));
        assert!(table(&report).contains("kvroute"));
    }
}
