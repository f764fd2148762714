//! `kvroute analyze` (also installed as `kvroute-analyze`): measure a workload before deploying
//! kvroute.
//!
//! `kvroute analyze trace.jsonl --replicas 4 --kv-capacity-tokens 200000` prints the share of
//! prompt tokens reusable with perfect routing (an infinite cache shared by the fleet), then the
//! prefix-cache hit rate and TTFT of round robin and kvroute on the simulated fleet (fleet-sim's
//! engine), and writes an SVG chart. Progress goes to stderr, the table to stdout.

use std::path::PathBuf;
use std::time::Instant;

use crate::analyze::{self, FleetOptions, InputFormat, OpenAiOptions};
use anyhow::{Context as _, bail};
use clap::Parser;
use serde::Serialize;
use vllm_sim::Profile;

/// Command line of `kvroute analyze` / `kvroute-analyze`.
#[derive(Debug, Parser)]
#[command(
    name = "kvroute-analyze",
    about = "Prefix-sharing potential of a workload, and what round robin and kvroute make of it \
             on a simulated vLLM fleet"
)]
pub struct AnalyzeArgs {
    /// A Mooncake trace (.jsonl), a JSONL of request bodies (bare chat or completions, or
    /// `{"timestamp": ms, "path": "/v1/messages", "body": {...}}`), or a fleet-sim generator
    /// spec such as
    /// `multi-turn:conversations=32`.
    pub input: String,
    /// Input format.
    #[arg(long, default_value = "auto", value_parser = ["auto", "mooncake", "openai"])]
    pub format: String,
    /// Fleet sizes to simulate, e.g. `4` or `2,4,8`.
    #[arg(long, value_delimiter = ',', default_value = "4")]
    pub replicas: Vec<usize>,
    /// KV-cache capacity of each replica in tokens (default: the profile's).
    #[arg(long)]
    pub kv_capacity_tokens: Option<u64>,
    /// Engine profile YAML (default: Llama-3.1-8B on one H100).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Policies to compare (fleet-sim names).
    #[arg(long, value_delimiter = ',', default_value = "round-robin,kvroute")]
    pub policies: Vec<String>,
    /// Only analyse the potential; simulate no fleet.
    #[arg(long)]
    pub no_sim: bool,
    /// Analyse only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Compress arrival times by this factor (2 = twice the load).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Arrival rate of OpenAI bodies without a timestamp (requests per second, Poisson).
    #[arg(long, default_value_t = 4.0)]
    pub rps: f64,
    /// Output tokens of an OpenAI body without `max_tokens`.
    #[arg(long, default_value_t = 256)]
    pub default_output_tokens: u32,
    /// Tokens per KV block for the sharing analysis (vLLM `block_size`).
    #[arg(long, default_value_t = 16)]
    pub block_tokens: u32,
    /// Seed of arrival times, policies and engine jitter.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where to write the SVG chart (several fleet sizes add `<stem>-hit-rate.svg`).
    #[arg(long, default_value = "target/kvroute-analyze/analysis.svg")]
    pub svg: PathBuf,
    /// Also write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report<'a> {
    workload: &'a str,
    sharing: &'a analyze::Sharing,
    fleets: &'a [analyze::FleetRow],
}

/// Runs the analysis: progress to stderr, the table to stdout, charts and JSON to files.
pub fn run(args: AnalyzeArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    if !(args.speedup.is_finite() && args.speedup > 0.0) {
        bail!("--speedup must be a positive number");
    }
    if args.block_tokens == 0 {
        bail!("--block-tokens must be at least 1");
    }
    let format: InputFormat = args.format.parse()?;
    let openai = OpenAiOptions {
        rps: args.rps,
        default_output_tokens: args.default_output_tokens,
        seed: args.seed,
    };
    eprintln!("kvroute-analyze: reading {} ...", args.input);
    let mut workload = analyze::load_workload(&args.input, format, &openai)?;
    if let Some(n) = args.limit {
        workload.truncate(n);
    }
    workload.speed_up(args.speedup);
    eprintln!("  {} requests", workload.requests.len());

    eprintln!(
        "prefix-sharing potential ({}-token blocks) ...",
        args.block_tokens
    );
    let mut shown = 0;
    let sharing = analyze::prefix_sharing(&workload, args.block_tokens, |done, total| {
        let tenth = done * 10 / total.max(1);
        if tenth > shown {
            shown = tenth;
            eprintln!("  {done}/{total} requests");
        }
    });

    let (rows, runs) = if args.no_sim {
        (Vec::new(), Vec::new())
    } else {
        let mut profile = match &args.profile {
            Some(p) => Profile::load(p).with_context(|| format!("profile {}", p.display()))?,
            None => Profile::llama8b_h100(),
        };
        if let Some(c) = args.kv_capacity_tokens {
            profile = profile.with_kv_capacity_tokens(c);
            profile.validate().context("--kv-capacity-tokens")?;
        }
        let fleet = FleetOptions {
            replicas: args.replicas.clone(),
            policies: args.policies.clone(),
            profile,
            seed: args.seed,
            metrics_interval_ms: 100.0,
        };
        fleet.validate()?;
        analyze::simulate(&workload, &fleet, |line| eprintln!("{line}"))?
    };

    println!();
    print!(
        "{}",
        analyze::render_report(&workload.name, &sharing, &rows)
    );

    if !runs.is_empty() {
        if let Some(dir) = args.svg.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let stem = args
            .svg
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "analysis".into());
        for (suffix, svg) in analyze::charts(&workload.name, &sharing, &rows, &runs) {
            let path = args.svg.with_file_name(format!("{stem}{suffix}.svg"));
            std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
    }
    if let Some(json) = &args.json {
        if let Some(dir) = json.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let report = Report {
            workload: &workload.name,
            sharing: &sharing,
            fleets: &rows,
        };
        std::fs::write(json, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", json.display()))?;
        eprintln!("wrote {}", json.display());
    }
    eprintln!("took {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}
