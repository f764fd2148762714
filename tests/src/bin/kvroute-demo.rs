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
use kvroute_tests::harness::{self, Fleet, FleetConfig, RouterKind, Tools};
use kvroute_tests::loadgen::{self, RunSummary, Workload};

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
    /// Concurrent conversations.
    #[arg(long, default_value_t = 32)]
    conversations: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Words (about tokens) of the shared system prompt.
    #[arg(long, default_value_t = 2000)]
    system_prompt_tokens: usize,
    /// Words of each conversation's first message.
    #[arg(long, default_value_t = 1000)]
    first_message_tokens: usize,
    /// Words of each follow-up message.
    #[arg(long, default_value_t = 60)]
    followup_tokens: usize,
    /// `max_tokens` per request.
    #[arg(long, default_value_t = 48)]
    max_tokens: u32,
    /// Simulated seconds per wall second of every replica (1 = real time).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Simulator profile (`llama8b-h100`, `fast`, or a YAML file).
    #[arg(long, default_value = "llama8b-h100")]
    profile: String,
    /// Seed of the workload text and of the replicas.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Pause between a conversation's turns, ms.
    #[arg(long, default_value_t = 100)]
    think_ms: u64,
    /// Output directory (default: `<target>/kvroute-demo`).
    #[arg(long)]
    out_dir: Option<std::path::PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.replicas == 0 || args.conversations == 0 || args.turns == 0 {
        bail!("--replicas, --conversations and --turns must be at least 1");
    }
    if !(args.speed.is_finite() && args.speed > 0.0) {
        bail!("--speed must be a positive number");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    rt.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let started = Instant::now();
    eprintln!("kvroute-demo: locating Envoy, vllm-sim, the control plane and the filter ...");
    let tools = Tools::locate(None).context("the demo needs its tools (try `make setup build`)")?;
    let workload = Workload {
        model: "kvroute-demo-model".to_string(),
        conversations: args.conversations,
        turns: args.turns,
        system_prompt_words: args.system_prompt_tokens,
        first_message_words: args.first_message_tokens,
        followup_words: args.followup_tokens,
        max_tokens: args.max_tokens,
        seed: args.seed,
        think_time: Duration::from_millis(args.think_ms),
        stagger: Duration::from_millis(30),
        request_timeout: Duration::from_secs(120),
    };
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
    let out_dir = args
        .out_dir
        .clone()
        .unwrap_or_else(|| harness::target_dir().join("kvroute-demo"));
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;

    let mut rows = Vec::new();
    for router in [RouterKind::Kvroute, RouterKind::RoundRobin] {
        let row = run_one(&args, &tools, &workload, router, &out_dir).await?;
        rows.push(row);
    }

    println!();
    print!("{}", loadgen::render_table(&rows));
    let summary = loadgen::DemoSummary { runs: rows.clone() };
    let summary_path = out_dir.join("summary.json");
    std::fs::write(&summary_path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("cannot write {}", summary_path.display()))?;
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
    println!(
        "summary: {}  (took {:.0}s)",
        summary_path.display(),
        started.elapsed().as_secs_f64()
    );
    let errors: usize = rows.iter().map(|r| r.errors).sum();
    if errors > 0 {
        bail!(
            "{errors} requests failed; see {} and the logs under {}",
            out_dir.display(),
            harness::target_dir().join("e2e-logs").display()
        );
    }
    Ok(())
}

async fn run_one(
    args: &Args,
    tools: &Tools,
    workload: &Workload,
    router: RouterKind,
    out_dir: &std::path::Path,
) -> anyhow::Result<RunSummary> {
    let label = router.label();
    let mut cfg = FleetConfig::new(&format!("demo-{label}"));
    cfg.replicas = args.replicas;
    cfg.model = workload.model.clone();
    cfg.router = router;
    cfg.seed = args.seed;
    cfg.sim_args = vec![
        "--speed".into(),
        args.speed.to_string(),
        "--profile".into(),
        args.profile.clone(),
    ];
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
    let tty = std::io::stderr().is_terminal();
    let label_owned = label.to_string();
    let progress = move |done: usize, total: usize| {
        if tty {
            eprint!("\r[{label_owned}] {done}/{total} requests");
            if done == total {
                eprintln!();
            }
            let _ = std::io::stderr().flush();
        } else if done.is_multiple_of(16) || done == total {
            eprintln!("[{label_owned}] {done}/{total} requests");
        }
    };
    eprintln!("[{label}] running {total} requests ...");
    let run = loadgen::run_workload(&fleet.url(), workload, progress).await;
    let (hits, queries) = fleet
        .prefix_cache_totals()
        .await
        .with_context(|| format!("cannot read the {label} replicas' metrics"))?;
    let hit_rate = if queries > 0.0 { hits / queries } else { 0.0 };
    let summary = loadgen::summarize(label, &run, hit_rate);
    let records_path = out_dir.join(format!("requests-{label}.json"));
    std::fs::write(&records_path, serde_json::to_string_pretty(&run.records)?)
        .with_context(|| format!("cannot write {}", records_path.display()))?;
    for r in run.records.iter().filter(|r| r.error.is_some()).take(3) {
        eprintln!(
            "[{label}] error (conversation {}, turn {}): {}",
            r.conversation,
            r.turn,
            r.error.as_deref().unwrap_or_default()
        );
    }
    eprintln!(
        "[{label}] done in {:.1}s: TTFT p50 {:.0} ms, prefix-cache hit rate {:.1}%",
        run.wall.as_secs_f64(),
        summary.ttft_ms.p50,
        hit_rate * 100.0
    );
    drop(fleet);
    Ok(summary)
}
