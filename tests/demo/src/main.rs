//! `kvroute-demo`: the same multi-turn chat workload through Envoy + kvroute and through Envoy
//! round robin, each on a fresh (cold) fleet of simulated vLLM replicas, compared in one table.
//!
//! Writes `target/kvroute-demo/summary.json` (and per-request records beside it). Times are
//! wall-clock milliseconds measured at the client; the prefix-cache hit rate is the replicas'
//! own `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`, summed over the fleet.

use std::io::{IsTerminal as _, Write as _};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use kvroute_demo::precise_compare::{self, CompareConfig, Mode, ModeSummary};
use kvroute_harness::loadgen::{self, RunSummary, Workload};
use kvroute_harness::{self as harness, Fleet, FleetConfig, RouterKind, Tools};

/// Command line of `kvroute-demo`.
#[derive(Debug, Parser)]
#[command(
    name = "kvroute-demo",
    about = "Compare kvroute with round robin on a simulated vLLM fleet behind a real Envoy"
)]
struct Args {
    /// vLLM replicas per fleet.
    #[arg(long, default_value_t = 4)]
    replicas: usize,
    /// Conversations [default: 32; with --compare: 36].
    #[arg(long)]
    conversations: Option<usize>,
    /// Turns per conversation [default: 4; with --compare: 12].
    #[arg(long)]
    turns: Option<usize>,
    /// Words (about tokens) of the shared system prompt [default: 2000; with --compare: 500].
    #[arg(long)]
    system_prompt_tokens: Option<usize>,
    /// Words of each conversation's first message [default: 1000; with --compare: 2000].
    #[arg(long)]
    first_message_tokens: Option<usize>,
    /// Words of each follow-up message [default: 60; with --compare: 100].
    #[arg(long)]
    followup_tokens: Option<usize>,
    /// `max_tokens` per request [default: 48; with --compare: 16].
    #[arg(long)]
    max_tokens: Option<u32>,
    /// Simulated seconds per wall second of every replica (1 = real time).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Simulator profile (`llama8b-h100`, `fast`, or a YAML file).
    #[arg(long, default_value = "llama8b-h100")]
    profile: String,
    /// Seed of the workload text and of the replicas.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Pause between a conversation's turns, ms [default: 100; with --compare: 2000].
    #[arg(long)]
    think_ms: Option<u64>,
    /// Delay between the starts of consecutive conversations, ms [default: 30; with --compare:
    /// 2500].
    #[arg(long)]
    stagger_ms: Option<u64>,
    /// Compare kvroute's modes instead of kvroute with round robin, e.g.
    /// `--compare approximate,precise` (`approximate-learned` is approximate with
    /// `router.learn_bytes_per_token` on): each mode on the same cold fleet configuration, with
    /// KV events on and caches smaller than the workload's working set
    /// (`--kv-capacity-tokens`). Writes `<target>/kvroute-demo-precise/summary.json`.
    #[arg(long, value_delimiter = ',')]
    compare: Vec<String>,
    /// KV cache capacity of every replica in `--compare` runs, tokens.
    #[arg(long, default_value_t = 12_000)]
    kv_capacity_tokens: u64,
    /// The filter's route-call deadline in `--compare` runs, ms (precise routes tokenise first).
    #[arg(long, default_value_t = 1_000)]
    route_timeout_ms: u64,
    /// Run the agent workload instead: `--conversations` agents (default 8), each a
    /// `--turns`-turn (default 10) Responses API chain that sends only `previous_response_id`
    /// and a tool's output, on replicas that store responses; kvroute against round robin,
    /// with the chain failure rate (404s) and TTFT. Writes
    /// `<target>/kvroute-demo-agent/summary.json`.
    #[arg(long, conflicts_with = "compare")]
    agent: bool,
    /// Output directory (default: `<target>/kvroute-demo`).
    #[arg(long)]
    out_dir: Option<std::path::PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let modes = args
        .compare
        .iter()
        .map(|m| Mode::parse(m))
        .collect::<Result<Vec<Mode>, _>>()?;
    let workload = workload(&args, !modes.is_empty());
    if args.replicas == 0 || workload.conversations == 0 || workload.turns == 0 {
        bail!("--replicas, --conversations and --turns must be at least 1");
    }
    if !modes.is_empty() && args.kv_capacity_tokens == 0 {
        bail!("--kv-capacity-tokens must be at least 1");
    }
    harness::check_positive("--speed", args.speed)?;
    let rt = harness::driver_runtime()?;
    if args.agent {
        rt.block_on(run_agents(args))
    } else if modes.is_empty() {
        rt.block_on(run(args, workload))
    } else {
        rt.block_on(run_compare(args, workload, modes))
    }
}

/// The workload of the flags, with the defaults of the demo or of `--compare`. The compare
/// defaults are a chat service: conversations start one after another (2.5 s apart) and each
/// lives for 12 turns, so the caches must keep the live ones (about 11 at a time, ~36,000
/// tokens) while the workload's prompts total ~143,000 tokens, three times the fleet's KV
/// capacity (4 x 12,000 tokens). Short answers keep few requests in flight, so replicas evict
/// idle conversations rather than preempt running ones.
fn workload(args: &Args, compare: bool) -> Workload {
    let pick =
        |v: Option<usize>, demo: usize, cmp: usize| v.unwrap_or(if compare { cmp } else { demo });
    Workload {
        model: "kvroute-demo-model".to_string(),
        conversations: pick(args.conversations, 32, 36),
        turns: pick(args.turns, 4, 12),
        system_prompt_words: pick(args.system_prompt_tokens, 2000, 500),
        first_message_words: pick(args.first_message_tokens, 1000, 2000),
        followup_words: pick(args.followup_tokens, 60, 100),
        max_tokens: args.max_tokens.unwrap_or(if compare { 16 } else { 48 }),
        seed: args.seed,
        think_time: Duration::from_millis(args.think_ms.unwrap_or(if compare {
            2000
        } else {
            100
        })),
        stagger: Duration::from_millis(args.stagger_ms.unwrap_or(if compare { 2500 } else { 30 })),
        request_timeout: Duration::from_secs(120),
    }
}

async fn run(args: Args, workload: Workload) -> anyhow::Result<()> {
    let started = Instant::now();
    eprintln!("kvroute-demo: locating Envoy, vllm-sim, the control plane and the filter ...");
    let tools = Tools::locate().context("the demo needs its tools (try `make setup build`)")?;
    eprintln!(
        "workload: {} conversations x {} turns, shared system prompt ~{} tokens, first message ~{} \
         tokens, follow-ups ~{} tokens, max_tokens {}; {} replicas at speed {}",
        workload.conversations,
        workload.turns,
        workload.system_prompt_words,
        workload.first_message_words,
        workload.followup_words,
        workload.max_tokens,
        args.replicas,
        args.speed
    );
    let out_dir = harness::output_dir(args.out_dir.as_deref(), "kvroute-demo")?;

    let mut rows = Vec::new();
    for router in [RouterKind::Kvroute, RouterKind::RoundRobin] {
        let row = run_one(&args, &tools, &workload, router, &out_dir).await?;
        rows.push(row);
    }

    println!();
    print!("{}", loadgen::render_table(&rows));
    let summary = loadgen::DemoSummary { runs: rows.clone() };
    let summary_path = out_dir.join("summary.json");
    harness::write_json(&summary_path, &summary)?;
    println!();
    if let [kv, rr] = rows.as_slice() {
        let ratio = if rr.ttft_ms.p50 > 0.0 {
            kv.ttft_ms.p50 / rr.ttft_ms.p50
        } else {
            f64::NAN
        };
        let met = ratio <= 0.5 && kv.errors == 0 && rr.errors == 0;
        println!(
            "kvroute TTFT p50 is {:.2}x round robin's (target <= 0.50, zero errors): {}",
            ratio,
            if met { "met" } else { "NOT met" }
        );
    }
    let errors: usize = rows.iter().map(|r| r.errors).sum();
    finish(&summary_path, started, errors, &out_dir)
}

/// `--agent`: the agent workload on a cold kvroute fleet and a cold round-robin fleet, both
/// storing responses as `VLLM_ENABLE_RESPONSES_API_STORE=1` vLLM does.
async fn run_agents(args: Args) -> anyhow::Result<()> {
    use kvroute_demo::agent::{self, AgentConfig, Streamed};
    let started = Instant::now();
    let tools = Tools::locate().context("the demo needs its tools (try `make setup build`)")?;
    let config = AgentConfig {
        model: "kvroute-demo-model".to_string(),
        agents: args.conversations.unwrap_or(8),
        turns: args.turns.unwrap_or(10),
        task_words: args.first_message_tokens.unwrap_or(1500),
        tool_output_words: args.followup_tokens.unwrap_or(150),
        max_output_tokens: args.max_tokens.unwrap_or(32),
        streamed: Streamed::All,
        think_time: Duration::from_millis(args.think_ms.unwrap_or(200)),
        stagger: Duration::from_millis(args.stagger_ms.unwrap_or(300)),
        max_attempts: 8,
        seed: args.seed,
        request_timeout: Duration::from_secs(120),
    };
    eprintln!(
        "agents: {} chains x {} turns (task ~{} tokens, tool output ~{} tokens, {} output tokens, \
         {} ms tool time), only previous_response_id links the turns; a 404 is retried up to {} \
         times; {} replicas at speed {}",
        config.agents,
        config.turns,
        config.task_words,
        config.tool_output_words,
        config.max_output_tokens,
        config.think_time.as_millis(),
        config.max_attempts,
        args.replicas,
        args.speed
    );
    let out_dir = harness::output_dir(args.out_dir.as_deref(), "kvroute-demo-agent")?;
    let mut rows = Vec::new();
    for router in [RouterKind::Kvroute, RouterKind::RoundRobin] {
        let label = router.label();
        let mut cfg = fleet_config(&args, "demo-agent", &config.model, router);
        cfg.sim_args.push("--enable-responses-store".into());
        let fleet = Fleet::start(cfg, &tools)
            .await
            .with_context(|| format!("cannot start the {label} fleet"))?;
        eprintln!("[{label}] running {} chains ...", config.agents);
        let records = agent::run_agents(&fleet.url(), &config).await;
        harness::write_json(&out_dir.join(format!("turns-{label}.json")), &records)?;
        let row = agent::summarize(label, &config, &records);
        eprintln!(
            "[{label}] {} of {} turns, {:.1}% of attempts lost their chain",
            row.turns_ok,
            row.turns_planned,
            row.chain_failure_rate * 100.0
        );
        rows.push(row);
        drop(fleet);
    }
    println!();
    print!("{}", agent::render_table(&rows));
    let summary_path = out_dir.join("summary.json");
    harness::write_json(
        &summary_path,
        &serde_json::json!({"config": config, "runs": rows}),
    )?;
    // Round robin is expected to lose links; only kvroute's broken chains fail the demo.
    let broken = rows
        .iter()
        .filter(|r| r.router == RouterKind::Kvroute.label())
        .map(|r| r.turns_planned - r.turns_ok)
        .sum();
    finish(&summary_path, started, broken, &out_dir)
}

/// Where a run ends, both kinds alike: names the summary and the time taken, and fails when
/// any of its `errors` requests failed (pointing at the results and the fleets' logs).
fn finish(
    summary_path: &std::path::Path,
    started: Instant,
    errors: usize,
    out_dir: &std::path::Path,
) -> anyhow::Result<()> {
    println!(
        "summary: {}  (took {:.0}s)",
        summary_path.display(),
        started.elapsed().as_secs_f64()
    );
    if errors > 0 {
        bail!(
            "{errors} requests failed; see {} and the logs under {}",
            out_dir.display(),
            harness::target_dir().join("e2e-logs").display()
        );
    }
    Ok(())
}

/// The fleet a demo run starts for `router`: the flags' replicas, seed, speed and profile.
fn fleet_config(args: &Args, name: &str, model: &str, router: RouterKind) -> FleetConfig {
    let mut cfg = FleetConfig::new(&format!("{name}-{}", router.label()));
    cfg.replicas = args.replicas;
    cfg.model = model.to_string();
    cfg.router = router;
    cfg.seed = args.seed;
    cfg.sim_args = vec![
        "--speed".into(),
        args.speed.to_string(),
        "--profile".into(),
        args.profile.clone(),
    ];
    cfg
}

async fn run_one(
    args: &Args,
    tools: &Tools,
    workload: &Workload,
    router: RouterKind,
    out_dir: &std::path::Path,
) -> anyhow::Result<RunSummary> {
    let label = router.label();
    let cfg = fleet_config(args, "demo", &workload.model, router);
    eprintln!(
        "[{label}] starting {} cold replicas, Envoy{} ...",
        args.replicas,
        {
            if router == RouterKind::Kvroute {
                ", the control plane"
            } else {
                ""
            }
        }
    );
    let fleet = Fleet::start(cfg, tools)
        .await
        .with_context(|| format!("cannot start the {label} fleet"))?;
    eprintln!("[{label}] ready at {} ({})", fleet.url(), fleet.describe());
    let total = workload.total_requests();
    let progress = progress_printer(label);
    eprintln!("[{label}] running {total} requests ...");
    let run = loadgen::run_workload(&fleet.url(), workload, progress).await;
    let (hits, queries) = fleet
        .prefix_cache_totals()
        .await
        .with_context(|| format!("cannot read the {label} replicas' metrics"))?;
    let hit_rate = if queries > 0.0 { hits / queries } else { 0.0 };
    let mut summary = loadgen::summarize(label, &run, hit_rate);
    if let Some(cp) = fleet.control_planes().first() {
        let url = format!("http://{}/metrics", cp.admin_address);
        let text = fleet
            .client()
            .get(&url, std::time::Duration::from_secs(5))
            .await
            .map(|r| r.body)
            .with_context(|| format!("cannot read the control plane's metrics at {url}"))?;
        summary.fleet_numbers = loadgen::FleetNumbers::from_metrics(&text);
    }
    write_records(out_dir, label, &run)?;
    eprintln!(
        "[{label}] done in {:.1}s: TTFT p50 {:.0} ms, prefix-cache hit rate {:.1}%",
        run.wall.as_secs_f64(),
        summary.ttft_ms.p50,
        hit_rate * 100.0
    );
    if let Some(n) = &summary.fleet_numbers {
        let gap: Vec<String> = n
            .gap
            .iter()
            .filter(|(_, share)| **share > 0.0)
            .map(|(reason, share)| format!("{reason} {:.1}%", share * 100.0))
            .collect();
        eprintln!(
            "[{label}] prefix reuse, share of prompt tokens: available {:.1}%, aimed {:.1}%, \
             delivered {:.1}%; gap: {}",
            n.available * 100.0,
            n.aimed * 100.0,
            n.delivered * 100.0,
            if gap.is_empty() {
                "none".to_string()
            } else {
                gap.join(", ")
            }
        );
    }
    drop(fleet);
    Ok(summary)
}

/// Writes one run's per-request records to `<out_dir>/requests-<label>.json` and prints its
/// first few errors (the demo and `--compare` keep the same files).
fn write_records(
    out_dir: &std::path::Path,
    label: &str,
    run: &loadgen::RunResult,
) -> anyhow::Result<()> {
    let records_path = out_dir.join(format!("requests-{label}.json"));
    harness::write_json(&records_path, &run.records)?;
    for r in run.records.iter().filter(|r| r.error.is_some()).take(3) {
        eprintln!(
            "[{label}] error (conversation {}, turn {}): {}",
            r.conversation,
            r.turn,
            r.error.as_deref().unwrap_or_default()
        );
    }
    Ok(())
}

/// `--compare`: every mode on its own cold fleet of the same configuration, one table.
async fn run_compare(args: Args, workload: Workload, modes: Vec<Mode>) -> anyhow::Result<()> {
    let started = Instant::now();
    eprintln!("kvroute-demo: locating Envoy, vllm-sim, the control plane and the filter ...");
    let tools = Tools::locate().context("the demo needs its tools (try `make setup build`)")?;
    let mut config = CompareConfig {
        replicas: args.replicas,
        kv_capacity_tokens: args.kv_capacity_tokens,
        speed: args.speed,
        profile: args.profile.clone(),
        seed: args.seed,
        route_timeout_ms: args.route_timeout_ms,
        warmup: Some(kvroute_demo::precise_compare::default_warmup(&workload)),
        workload,
        decisions_dump: None,
    };
    let w = &config.workload;
    eprintln!(
        "workload: {} conversations x {} turns, shared system prompt ~{} tokens, first message ~{} \
         tokens, follow-ups ~{} tokens, max_tokens {}, think time {} ms; {} replicas with {} KV \
         tokens each (fleet {}), speed {}",
        w.conversations,
        w.turns,
        w.system_prompt_words,
        w.first_message_words,
        w.followup_words,
        w.max_tokens,
        w.think_time.as_millis(),
        config.replicas,
        config.kv_capacity_tokens,
        config.replicas as u64 * config.kv_capacity_tokens,
        config.speed
    );
    let out_dir = harness::output_dir(args.out_dir.as_deref(), "kvroute-demo-precise")?;
    config.decisions_dump = Some(out_dir.join("decisions"));

    let mut rows: Vec<ModeSummary> = Vec::new();
    for mode in modes {
        let label = mode.label();
        eprintln!(
            "[{label}] starting {} cold replicas, the control plane, Envoy ...",
            config.replicas
        );
        let progress = progress_printer(label);
        let (row, run) = precise_compare::run_mode(&tools, &config, mode, progress)
            .await
            .with_context(|| format!("the {label} run failed"))?;
        write_records(&out_dir, label, &run)?;
        eprintln!(
            "[{label}] done in {:.1}s: TTFT p90 {:.0} ms, hit rate {:.1}%, working set {} tokens \
             (fleet KV capacity {})",
            run.wall.as_secs_f64(),
            row.run.ttft_ms.p90,
            row.run.prefix_cache_hit_rate * 100.0,
            row.working_set_tokens,
            row.fleet_kv_capacity_tokens
        );
        rows.push(row);
    }

    println!();
    print!("{}", precise_compare::render_table(&rows));
    let summary = precise_compare::CompareSummary {
        config: config.to_json(),
        runs: rows.clone(),
    };
    let summary_path = out_dir.join("summary.json");
    harness::write_json(&summary_path, &summary)?;
    println!();
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    let precise = rows.iter().find(|r| r.mode == "precise");
    let approximate = rows.iter().filter(|r| r.mode != "precise");
    for (a, p) in approximate.filter_map(|a| precise.map(|p| (a, p))) {
        let other = &a.mode;
        println!(
            "precise TTFT p90 {:.0} ms vs {other} {:.0} ms: {}",
            p.run.ttft_ms.p90,
            a.run.ttft_ms.p90,
            verdict(p.run.ttft_ms.p90 < a.run.ttft_ms.p90)
        );
        println!(
            "precise prefix hit rate {:.1}% vs {other} {:.1}%: {}",
            p.run.prefix_cache_hit_rate * 100.0,
            a.run.prefix_cache_hit_rate * 100.0,
            verdict(p.run.prefix_cache_hit_rate > a.run.prefix_cache_hit_rate)
        );
    }
    if let Some(p) = precise {
        println!(
            "precise predicted cached tokens within 5% of the engines' ({:+.2}%): {}",
            p.prediction_error * 100.0,
            verdict(p.prediction_error.abs() <= 0.05)
        );
    }
    let errors: usize = rows.iter().map(|r| r.run.errors).sum();
    finish(&summary_path, started, errors, &out_dir)
}

/// Prints `[label] done/total requests` (in place on a terminal, every 16 otherwise).
fn progress_printer(label: &str) -> impl Fn(usize, usize) + Send + Sync + 'static {
    let tty = std::io::stderr().is_terminal();
    let label = label.to_string();
    move |done: usize, total: usize| {
        if tty {
            eprint!("\r[{label}] {done}/{total} requests");
            if done == total {
                eprintln!();
            }
            let _ = std::io::stderr().flush();
        } else if done.is_multiple_of(16) || done == total {
            eprintln!("[{label}] {done}/{total} requests");
        }
    }
}
