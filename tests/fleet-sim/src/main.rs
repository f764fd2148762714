//! `fleet-sim`: compare routing policies on a simulated vLLM fleet in virtual time.
//!
//! `fleet-sim compare --workload shared-prefix --replicas 8 --json out.json` prints a table,
//! writes the JSON summary and SVG plots (TTFT CDF; with `--sweep`, TTFT p50/p99 against load).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use fleet_sim::data_parallel;
use fleet_sim::des::{RunOptions, RunResult, SimConfig, run_with};
use fleet_sim::policy::{
    DEFAULT_TEXT_BYTES_PER_TOKEN, POLICY_NAMES, TextModel, build_with, check_policy,
    regroup_policy_specs,
};
use fleet_sim::report::{
    ForkSummary, PolicySummary, fork_table, line_chart, line_chart_axes, regret_table, table,
    ttft_cdf_series,
};
use fleet_sim::workload::{Workload, client_max_tokens, from_spec};
use scorer_core::router::RouterConfig;
use serde::Serialize;
use vllm_sim::Profile;

#[derive(Parser)]
#[command(
    name = "fleet-sim",
    about = "Discrete-event simulation of a vLLM fleet behind routing policies"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay one workload through every policy and compare.
    Compare(Box<CompareArgs>),
    /// List the policies.
    Policies,
    /// Two tenants (interactive + batch flood): interactive TTFT p99 alone, flooded without
    /// admission and flooded behind fair admission; prints a table, `--json` writes it.
    Fairness(Box<FairnessArgs>),
    /// Prefill/decode disaggregation: each workload colocated and disaggregated; prints TTFT
    /// p50/p99 and the ITL p99 of running streams, and when disaggregation helps.
    Disagg(Box<DisaggArgs>),
    /// Every policy on workloads x engine pools x loads x seeds (TTFT mean with 95%
    /// t-intervals, hit rate, tokens/s, kvroute against the best peer and the oracle); reports
    /// on the report split of seeds unless `--split tuning` or `--seeds`.
    Matrix(Box<MatrixArgs>),
}

#[derive(clap::Args)]
struct MatrixArgs {
    /// A few small cells (two workloads on two pools plus a tight-cache cell, 4 replicas).
    #[arg(long)]
    quick: bool,
    /// Which split of seeds to run: `report` (seeds 3-7, the default) or `tuning` (seeds 1-2,
    /// for choosing defaults; never report figures from it).
    #[arg(long, default_value = "report")]
    split: String,
    /// Explicit seeds instead of a split (comma-separated).
    #[arg(long, value_delimiter = ',')]
    seeds: Option<Vec<u64>>,
    /// Comma-separated policies (default: the matrix's peers, kvroute, kvroute-precise, oracle).
    #[arg(long, value_delimiter = ',')]
    policies: Option<Vec<String>>,
    /// Requests per workload (about; default 400, quick 200; tight-cache cells run 3x).
    #[arg(long)]
    requests: Option<usize>,
    /// Replicas per pool (default 8, quick 4).
    #[arg(long)]
    replicas: Option<usize>,
    /// Worker threads (default: the machine's parallelism).
    #[arg(long)]
    threads: Option<usize>,
    /// The Mooncake trace (default: the shipped one).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// kvroute router settings as YAML or JSON (`RouterConfig` fields), e.g.
    /// `{calibration: {enabled: true}}`, or a file holding them: one setting across every
    /// cell, never per profile.
    #[arg(long)]
    router_config: Option<String>,
    /// Only cells of these workloads (comma-separated names), e.g. `agentic`.
    #[arg(long, value_delimiter = ',')]
    workloads: Option<Vec<String>>,
    /// Also run these pools of profile files (comma-separated; `a.yaml+b.yaml` is a pool of
    /// half each): every workload at both loads, as the shipped pools. Your own GPUs' profiles
    /// (`tests/vllm-sim/profiles/` shows the format), or profiles kvroute was never tuned on.
    #[arg(long = "pool", value_delimiter = ',')]
    extra_pools: Vec<String>,
    /// Only cells of these pools (comma-separated names as the table prints them).
    #[arg(long, value_delimiter = ',')]
    pools: Option<Vec<String>>,
    /// Write every run's per-request records as CSV into this folder.
    #[arg(long)]
    records: Option<PathBuf>,
    /// The share of every cell's traffic that reaches the replicas without passing through the
    /// router (per session; see `compare --unseen-fraction`).
    #[arg(long, default_value_t = 0.0)]
    unseen_fraction: f64,
    /// Spell every stream's tokens in one of four text styles (see `compare --text-styles`).
    #[arg(long)]
    text_styles: bool,
    /// Also measure every decision's placement regret against the greedy oracle (how much
    /// later its first token comes than at the exact best replica) and print it for kvroute
    /// and each cell's best peer on TTFT p99; every policy's is in the JSON. Costs an oracle's
    /// probes per request.
    #[arg(long)]
    regret: bool,
}

#[derive(clap::Args)]
struct DisaggArgs {
    /// Comma-separated workloads: long-prompt, short-prompt, mix (default: all three).
    #[arg(long, value_delimiter = ',')]
    workload: Option<Vec<String>>,
    /// Replicas in the fleet (the same number in both modes).
    #[arg(long, default_value_t = 4)]
    replicas: usize,
    /// Of which prefill replicas in the disaggregated run.
    #[arg(long, default_value_t = 1)]
    prefill_replicas: usize,
    /// Requests per workload.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// Mean arrivals per second (Poisson).
    #[arg(long, default_value_t = 2.0)]
    rate: f64,
    /// The router's `pd.threshold_tokens`.
    #[arg(long, default_value_t = 1024)]
    threshold_tokens: u32,
    /// KV transfer bandwidth, GB/s.
    #[arg(long, default_value_t = 25.0)]
    kv_gbps: f64,
    /// Seed of arrivals, prompts and routing.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the JSON summary here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(clap::Args)]
struct FairnessArgs {
    /// Replicas in the fleet.
    #[arg(long, default_value_t = 4)]
    replicas: usize,
    /// Virtual seconds both tenants send.
    #[arg(long, default_value_t = 60.0)]
    duration_s: f64,
    /// Interactive requests per second.
    #[arg(long, default_value_t = 4.0)]
    interactive_rate: f64,
    /// Interactive prompt tokens.
    #[arg(long, default_value_t = 512)]
    interactive_prompt: u32,
    /// Batch requests per second (the flood).
    #[arg(long, default_value_t = 12.0)]
    batch_rate: f64,
    /// Batch prompt tokens.
    #[arg(long, default_value_t = 6000)]
    batch_prompt: u32,
    /// Admission settings as YAML or JSON (`admission:` fields of the control plane); default:
    /// the control plane's defaults plus `{max_ttft_inflation: 3}`.
    #[arg(long)]
    admission: Option<String>,
    /// Fail (exit 1) when the fair run's interactive TTFT p99 exceeds this multiple of the
    /// alone run's; default: the configured `max_ttft_inflation` (no check without one).
    #[arg(long)]
    max_ratio: Option<f64>,
    /// Seed of arrivals, routing and jitter.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Write the JSON summary here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(clap::Args)]
struct CompareArgs {
    /// A Mooncake `.jsonl` trace, or a generator: shared-prefix, multi-turn, long-doc,
    /// no-sharing, agentic (options as `name:key=value,...`; any generator takes
    /// `api=chat|completion|messages|responses`, agentic speaking messages unless told).
    #[arg(long)]
    workload: String,
    /// Replicas in the fleet.
    #[arg(long, default_value_t = 8)]
    replicas: usize,
    /// Comma-separated policies (default: all); `kvroute-local` takes options as
    /// `kvroute-local:proxies=4,workers=4,sync_ms=25,max_index_blocks=N`.
    #[arg(long, value_delimiter = ',')]
    policies: Option<Vec<String>>,
    /// Compress arrival times by this factor (2 = twice the load).
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Replay only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Seed of workload generators, policies and jitter.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Override the profile's per-replica KV capacity (tokens); the decode cost of a token's KV
    /// stays the profile's.
    #[arg(long)]
    kv_capacity_tokens: Option<u64>,
    /// Engine profile YAML (default: Llama-8B on H100).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Write the JSON summary here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Directory for SVG plots (default: next to --json, or target/fleet-sim).
    #[arg(long)]
    svg_dir: Option<PathBuf>,
    /// Also run these speedups and plot TTFT p50/p99 against load.
    #[arg(long, value_delimiter = ',')]
    sweep: Option<Vec<f64>>,
    /// kvroute router settings as YAML or JSON (`RouterConfig` fields, e.g.
    /// `{scoring: {guard_abs: 32}}`), or a file holding them, for sweeps of the scoring
    /// defaults.
    #[arg(long)]
    router_config: Option<String>,
    /// Metrics scrape interval of the simulated routers (virtual ms).
    #[arg(long, default_value_t = 100.0)]
    metrics_interval_ms: f64,
    /// Canonical text bytes per token of the workload, what kvroute's approximate filter sees
    /// (its router converts back with its own `bytes_per_token`, 4 by default). English prose
    /// is about 4; code less; Cyrillic or Greek text in UTF-8 more.
    #[arg(long, default_value_t = DEFAULT_TEXT_BYTES_PER_TOKEN, conflicts_with = "text_styles")]
    text_bytes_per_token: f64,
    /// Spell each stream (system prompt, document, message, answer) in one of four text
    /// styles, 2.7 to 5.6 bytes a token, 4 on average (`fleet_sim::workload::TEXT_STYLES`): the
    /// router's ratio is right on average and wrong for every document, as with real text.
    #[arg(long)]
    text_styles: bool,
    /// vLLM's `--data-parallel-size`: the replicas are servers of this many engines each
    /// (consecutive replicas). Routers that know ranks pick an engine; the others pick a
    /// server and its own balancer picks the rank (`fleet_sim::data_parallel`).
    #[arg(long, default_value_t = 1)]
    data_parallel_size: usize,
    /// The share of the traffic that reaches the replicas without passing through the router
    /// (another gateway, clients calling a replica directly), picked per session and placed by
    /// a hash of it. Their cache fills and evictions reach a precise router as KV events and an
    /// approximate one not at all. The figures cover the routed requests only.
    #[arg(long, default_value_t = 0.0)]
    unseen_fraction: f64,
    /// Write each policy's per-request records as CSV into this folder (`POLICY.csv`, the
    /// matrix's columns; `scripts/records-summary.py` reads them).
    #[arg(long)]
    records: Option<PathBuf>,
    /// Also measure every routed request's placement regret against the greedy oracle: how
    /// much later its first token comes where the policy sent it than at the exact best
    /// replica, given the fleet's exact state then. Prints a table (and adds `regret` to the
    /// JSON summary); costs an oracle's probes per request.
    #[arg(long)]
    regret: bool,
}

/// `--unseen-fraction`, checked.
fn unseen_fraction(f: f64) -> anyhow::Result<f64> {
    if !(0.0..1.0).contains(&f) {
        bail!("--unseen-fraction must be in [0, 1), not {f}");
    }
    Ok(f)
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

#[derive(Serialize)]
struct SweepPoint {
    speedup: f64,
    results: Vec<PolicySummary>,
}

#[derive(Serialize)]
struct Summary {
    workload: String,
    replicas: usize,
    speedup: f64,
    seed: u64,
    text_bytes_per_token: f64,
    /// `--text-styles`: the text's bytes per token vary by stream (4 on average).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    text_styles: bool,
    /// Engines per server (`--data-parallel-size`), when above 1.
    #[serde(skip_serializing_if = "is_one")]
    data_parallel_size: usize,
    results: Vec<PolicySummary>,
    /// Subagent fan-out per policy, for workloads with forks (`agentic`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    forks: Vec<ForkSummary>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    sweep: Vec<SweepPoint>,
}

/// `--router-config`: the settings inline, or the YAML or JSON file `arg` names.
fn router_config(arg: &str) -> anyhow::Result<RouterConfig> {
    let path = std::path::Path::new(arg);
    if path.is_file() {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--router-config: reading {}", path.display()))?;
        return serde_yaml_ng::from_str(&text)
            .with_context(|| format!("--router-config: {}", path.display()));
    }
    // Settings have a key; a bare word is a file that is not there.
    if !arg.contains(':') && !arg.contains('{') {
        bail!("--router-config: no file {arg} (inline settings look like `{{scoring: {{...}}}}`)");
    }
    serde_yaml_ng::from_str(arg).context("--router-config")
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Policies => {
            for p in POLICY_NAMES {
                println!("{p}");
            }
            Ok(())
        }
        Command::Compare(args) => compare(*args),
        Command::Fairness(args) => fairness(*args),
        Command::Disagg(args) => disagg(*args),
        Command::Matrix(args) => matrix(*args),
    }
}

fn matrix(args: MatrixArgs) -> anyhow::Result<()> {
    use fleet_sim::matrix::{MatrixSpec, REPORT_SEEDS, TUNING_SEEDS, run_matrix, table};
    let seeds = match (&args.seeds, args.split.as_str()) {
        (Some(seeds), _) => seeds.clone(),
        (None, "report") => REPORT_SEEDS.to_vec(),
        (None, "tuning") => TUNING_SEEDS.to_vec(),
        (None, other) => bail!("--split must be report or tuning, not {other:?}"),
    };
    if seeds.is_empty() {
        bail!("need at least one seed");
    }
    let mut spec = if args.quick {
        MatrixSpec::quick(seeds)
    } else {
        MatrixSpec::full(seeds)
    };
    for pool in &args.extra_pools {
        let pool =
            fleet_sim::matrix::Pool::from_files(pool).with_context(|| format!("--pool {pool}"))?;
        spec.add_pool(pool);
    }
    if let Some(p) = &args.policies {
        spec.policies = regroup_policy_specs(p);
    }
    if let Some(r) = args.requests {
        spec.requests = r.max(10);
    }
    if let Some(r) = args.replicas {
        if r == 0 || r > scorer_core::index::MAX_ENDPOINTS {
            bail!(
                "--replicas must be 1..={}",
                scorer_core::index::MAX_ENDPOINTS
            );
        }
        spec.replicas = r;
    }
    spec.threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get)
    });
    if let Some(t) = &args.trace {
        spec.trace = t.clone();
    }
    if let Some(arg) = &args.router_config {
        spec.router = router_config(arg)?;
    }
    if let Some(w) = &args.workloads {
        spec.cells
            .retain(|c| w.iter().any(|n| n == c.workload.name()));
    }
    if let Some(p) = &args.pools {
        spec.cells.retain(|c| p.contains(&c.pool.name));
    }
    if spec.cells.is_empty() {
        bail!("--workloads / --pools leave no cell");
    }
    spec.records_dir = args.records.clone();
    spec.unseen_fraction = unseen_fraction(args.unseen_fraction)?;
    spec.regret = args.regret;
    if args.text_styles {
        spec.text = TextModel::Styled;
    }
    eprintln!(
        "fleet-sim matrix: {} cells x {} seeds x {} policies on {} threads",
        spec.cells.len(),
        spec.seeds.len(),
        spec.policies.len(),
        spec.threads
    );
    let started = Instant::now();
    let report = run_matrix(&spec, &|done, total| {
        if done % 50 == 0 || done == total {
            eprintln!(
                "  {done}/{total} runs, {:.0}s",
                started.elapsed().as_secs_f64()
            );
        }
    })?;
    eprintln!("simulated in {:.1}s", started.elapsed().as_secs_f64());
    print!("{}", table(&report));
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

fn disagg(args: DisaggArgs) -> anyhow::Result<()> {
    use fleet_sim::disagg::{DisaggScenario, DisaggWorkload, compare, table};
    let workloads = match &args.workload {
        None => DisaggWorkload::ALL.to_vec(),
        Some(names) => names
            .iter()
            .map(|n| {
                DisaggWorkload::parse(n).with_context(|| {
                    format!("unknown workload {n:?} (long-prompt, short-prompt, mix)")
                })
            })
            .collect::<anyhow::Result<_>>()?,
    };
    if args.replicas < 2
        || args.replicas > scorer_core::index::MAX_ENDPOINTS
        || args.prefill_replicas == 0
        || args.prefill_replicas >= args.replicas
    {
        bail!("need 2..=256 replicas and 1..replicas prefill replicas");
    }
    if !(args.rate.is_finite() && args.rate > 0.0 && args.kv_gbps.is_finite() && args.kv_gbps > 0.0)
    {
        bail!("--rate and --kv-gbps must be positive");
    }
    let scenario = DisaggScenario {
        replicas: args.replicas,
        prefill_replicas: args.prefill_replicas,
        requests: args.requests.max(1),
        rate: args.rate,
        threshold_tokens: args.threshold_tokens,
        kv_gbps: args.kv_gbps,
        seed: args.seed,
        ..DisaggScenario::default()
    };
    let started = Instant::now();
    let results = workloads
        .into_iter()
        .map(|w| compare(w, &scenario))
        .collect::<Result<Vec<_>, _>>()?;
    eprintln!("simulated in {:.1}s", started.elapsed().as_secs_f64());
    print!("{}", table(&results));
    if let Some(path) = &args.json {
        let summary = serde_json::json!({"scenario": scenario, "results": results});
        std::fs::write(path, serde_json::to_string_pretty(&summary)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn fairness(args: FairnessArgs) -> anyhow::Result<()> {
    use fleet_sim::fairness::{Scenario, compare, table};
    if args.replicas == 0 || args.replicas > scorer_core::index::MAX_ENDPOINTS {
        bail!(
            "--replicas must be between 1 and {}",
            scorer_core::index::MAX_ENDPOINTS
        );
    }
    let admission: scorer_core::fairness::AdmissionConfig = match &args.admission {
        Some(text) => serde_yaml_ng::from_str(text).context("--admission")?,
        None => fleet_sim::fairness::benchmark_admission(),
    };
    admission.validate()?;
    let scenario = Scenario {
        replicas: args.replicas,
        seed: args.seed,
        duration_ms: args.duration_s * 1000.0,
        interactive_rate: args.interactive_rate,
        interactive_prompt: args.interactive_prompt,
        batch_rate: args.batch_rate,
        batch_prompt: args.batch_prompt,
        admission,
        ..Scenario::default()
    };
    let started = Instant::now();
    let report = compare(&scenario)?;
    eprintln!("simulated in {:.1}s", started.elapsed().as_secs_f64());
    print!("{}", table(&report));
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(max) = args.max_ratio.or(report.max_ttft_inflation)
        && report.ttft_p99_ratio_fair > max
    {
        bail!(
            "interactive TTFT p99 with fair admission is {:.2}x alone, above {max}x",
            report.ttft_p99_ratio_fair
        );
    }
    Ok(())
}

fn run_all(
    args: &CompareArgs,
    policies: &[String],
    cfg: &SimConfig,
    router: &RouterConfig,
    speedup: f64,
) -> anyhow::Result<(Workload, Vec<RunResult>)> {
    let mut workload = from_spec(&args.workload, args.seed)?;
    if let Some(n) = args.limit {
        workload.truncate(n);
    }
    workload.speed_up(speedup);
    let options = RunOptions {
        max_tokens: client_max_tokens(&args.workload)?,
        unseen_fraction: unseen_fraction(args.unseen_fraction)?,
        regret: args.regret,
        ..RunOptions::default()
    };
    let mut runs = Vec::new();
    for name in policies {
        let ranks = args.data_parallel_size;
        let blind = ranks > 1 && !data_parallel::is_rank_aware(name);
        let endpoints = if blind {
            cfg.replicas / ranks
        } else {
            cfg.replicas
        };
        let mut policy = build_with(
            name,
            endpoints,
            args.seed,
            router,
            if args.text_styles {
                TextModel::Styled
            } else {
                TextModel::Uniform(args.text_bytes_per_token)
            },
        )
        .with_context(|| format!("unknown policy {name}"))?;
        if blind {
            policy = Box::new(data_parallel::RankBlind::new(policy, cfg.replicas, ranks));
        }
        eprint!("  {name:<20} speedup {speedup:<5} ... ");
        std::io::stderr().flush().ok();
        let started = Instant::now();
        let result = run_with(&workload, policy.as_mut(), cfg, &options)?;
        eprintln!(
            "{} requests in {:.1}s",
            result.records.len(),
            started.elapsed().as_secs_f64()
        );
        runs.push(result);
    }
    Ok((workload, runs))
}

fn compare(args: CompareArgs) -> anyhow::Result<()> {
    if args.replicas == 0 || args.replicas > scorer_core::index::MAX_ENDPOINTS {
        bail!(
            "--replicas must be 1..={}",
            scorer_core::index::MAX_ENDPOINTS
        );
    }
    if !args.speedup.is_finite() || args.speedup <= 0.0 {
        bail!("--speedup must be > 0");
    }
    if args.data_parallel_size == 0 || !args.replicas.is_multiple_of(args.data_parallel_size) {
        bail!("--data-parallel-size must be at least 1 and divide --replicas");
    }
    if !args.text_bytes_per_token.is_finite() || args.text_bytes_per_token <= 0.0 {
        bail!("--text-bytes-per-token must be > 0");
    }
    let mut profile = match &args.profile {
        Some(p) => Profile::load(p)?,
        None => Profile::llama8b_h100(),
    };
    if let Some(t) = args.kv_capacity_tokens {
        profile = profile.with_kv_capacity_tokens(t);
        profile.validate()?;
    }
    let policies: Vec<String> = match &args.policies {
        Some(pieces) => regroup_policy_specs(pieces),
        None => POLICY_NAMES.iter().map(|s| s.to_string()).collect(),
    };
    for p in &policies {
        if let Err(e) = check_policy(p) {
            bail!("{e}");
        }
    }
    let router = match &args.router_config {
        Some(arg) => router_config(arg)?,
        None => RouterConfig::default(),
    };
    let cfg = SimConfig {
        replicas: args.replicas,
        profile,
        seed: args.seed,
        metrics_interval_ms: args.metrics_interval_ms,
    };
    eprintln!("fleet-sim: {} on {} replicas", args.workload, args.replicas);
    let (workload, runs) = run_all(&args, &policies, &cfg, &router, args.speedup)?;
    if let Some(dir) = &args.records {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (name, run) in policies.iter().zip(&runs) {
            let file = dir.join(format!("{}.csv", name.replace([':', ',', '='], "_")));
            std::fs::write(&file, fleet_sim::matrix::records_csv(&workload, run))
                .with_context(|| format!("writing {}", file.display()))?;
        }
    }
    let results: Vec<PolicySummary> = runs.iter().map(PolicySummary::of).collect();
    println!("{}", table(&results));
    if args.regret {
        println!("{}", regret_table(&results));
    }
    let forks: Vec<ForkSummary> = runs
        .iter()
        .filter_map(|r| ForkSummary::of(&workload, r))
        .collect();
    if !forks.is_empty() {
        println!("{}", fork_table(&forks));
    }
    println!(
        "busiest replica's share of requests: {}",
        results
            .iter()
            .map(|r| format!("{} {:.0}%", r.policy, r.busiest_replica_share * 100.0))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let changes: Vec<String> = results
        .iter()
        .filter_map(|r| Some(format!("{} {}", r.policy, r.routing_state_changes?)))
        .collect();
    if !changes.is_empty() {
        println!(
            "self-check: endpoint routing-state changes {}",
            changes.join(", ")
        );
    }
    for r in &results {
        if let Some(local) = r.local_decision_fraction {
            println!(
                "{}: {:.1}% of decisions taken in a proxy (the rest by the control plane)",
                r.policy,
                local * 100.0
            );
        }
    }

    let svg_dir = args.svg_dir.clone().unwrap_or_else(|| match &args.json {
        Some(j) => j.parent().map(PathBuf::from).unwrap_or_default(),
        None => PathBuf::from("target/fleet-sim"),
    });
    let svg_dir = if svg_dir.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        svg_dir
    };
    std::fs::create_dir_all(&svg_dir).with_context(|| format!("creating {}", svg_dir.display()))?;
    let cdf = line_chart_axes(
        &format!("TTFT CDF: {}", args.workload),
        "TTFT (ms, log)",
        "fraction of requests",
        &ttft_cdf_series(&runs),
        true,
        false,
    );
    let cdf_path = svg_dir.join("ttft_cdf.svg");
    std::fs::write(&cdf_path, cdf)?;
    eprintln!("wrote {}", cdf_path.display());

    let mut sweep = Vec::new();
    if let Some(speedups) = &args.sweep {
        for &s in speedups {
            let (_, runs) = run_all(&args, &policies, &cfg, &router, s)?;
            sweep.push(SweepPoint {
                speedup: s,
                results: runs.iter().map(PolicySummary::of).collect(),
            });
        }
        let mut series = Vec::new();
        for (i, p) in policies.iter().enumerate() {
            let p50 = sweep
                .iter()
                .map(|pt| (pt.speedup, pt.results[i].ttft_ms.p50.max(0.1)))
                .collect();
            let p99 = sweep
                .iter()
                .map(|pt| (pt.speedup, pt.results[i].ttft_ms.p99.max(0.1)))
                .collect();
            series.push((format!("{p} p50"), p50));
            series.push((format!("{p} p99"), p99));
        }
        let chart = line_chart(
            "TTFT against load",
            "arrival-rate speedup",
            "TTFT (ms)",
            &series,
            true,
        );
        let path = svg_dir.join("ttft_vs_load.svg");
        std::fs::write(&path, chart)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(json) = &args.json {
        let summary = Summary {
            workload: args.workload.clone(),
            replicas: args.replicas,
            data_parallel_size: args.data_parallel_size,
            speedup: args.speedup,
            seed: args.seed,
            text_bytes_per_token: args.text_bytes_per_token,
            text_styles: args.text_styles,
            results,
            forks,
            sweep,
        };
        write_json(json, &summary)?;
    }
    Ok(())
}

/// Writes `value` as pretty JSON to `path`, creating its folder, and says so on stderr.
fn write_json(path: &std::path::Path, value: &impl serde::Serialize) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_string_pretty(value)?)
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
