//! `kvroute-bench`: performance of kvroute's parts and of the whole data path.
//!
//! Sections: the router in process and over HTTP (release control plane pinned to one core),
//! the filter natively and as the release `.wasm` in wasmtime, data-plane overhead through a
//! real Envoy (kvroute vs plain Envoy round robin vs direct) in front of `vllm-sim --profile
//! fast`, and routing quality on cold 8-replica fleets driven by this project's loadgen.
//! Writes `<target>/bench/summary.json` and SVG plots beside it; tables go to stdout.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use kvroute_tests::bench::{
    self, ControlPlaneFigures, FilterFigures, OverheadRow, P50P99, P99, QualityRow,
};
use kvroute_tests::fleet::report::line_chart_axes;
use kvroute_tests::harness::{
    self, Fleet, FleetConfig, HttpClient, ManagedProcess, RouterKind, Tools,
};
use kvroute_tests::loadgen::{self, Workload, percentile};
use kvroute_tests::wasm_host::FilterModule;
use serde_json::json;

/// Command line of `kvroute-bench`.
#[derive(Debug, Parser)]
#[command(
    name = "kvroute-bench",
    about = "Benchmark kvroute: router, filter, overhead, quality"
)]
struct Args {
    /// Output directory (default: `<target>/bench`).
    #[arg(long)]
    out_dir: Option<std::path::PathBuf>,
    /// Endpoints in the in-process and HTTP router benchmarks.
    #[arg(long, default_value_t = 64)]
    endpoints: usize,
    /// Indexed blocks in the in-process router benchmark.
    #[arg(long, default_value_t = 1_000_000)]
    blocks: usize,
    /// Seconds of each closed-loop HTTP run.
    #[arg(long, default_value_t = 4)]
    load_seconds: u64,
    /// Sequential samples per prompt size in the overhead runs.
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// Concurrency of the max-rps runs.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Simulated seconds per wall second in the quality runs.
    #[arg(long, default_value_t = 4.0)]
    speed: f64,
    /// Skip the Envoy overhead and quality sections (micro-benchmarks only).
    #[arg(long)]
    micro_only: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.endpoints == 0 || args.endpoints > 1000 || args.samples == 0 || args.concurrency == 0 {
        bail!("--endpoints must be 1..=1000, --samples and --concurrency at least 1");
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

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

async fn run(args: Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let out_dir = args
        .out_dir
        .clone()
        .unwrap_or_else(|| harness::target_dir().join("bench"));
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    let mut loads = vec![("start".to_string(), loadavg())];

    // 1. Router in process.
    eprintln!(
        "[router] {} endpoints, {} blocks ...",
        args.endpoints, args.blocks
    );
    let rb = bench::router_inprocess(args.endpoints, args.blocks, 200_000);
    loads.push(("router in-process".into(), loadavg()));
    eprintln!(
        "[router] {:.0} decisions/s, {:.1} bytes/block",
        rb.decisions_per_s, rb.bytes_per_block
    );

    // 2. Filter natively and in wasmtime.
    let tools =
        Tools::locate(None).context("kvroute-bench needs its tools (try `make setup build`)")?;
    let native_16k = bench::canon_native(16_384, 4_000)?;
    let native_200k = bench::canon_native(204_800, 400)?;
    let module = FilterModule::from_file(&tools.wasm)
        .with_context(|| format!("cannot load {}", tools.wasm.display()))?;
    let w16 = bench::filter_wasm(&module, 16_384, 2_000)?;
    let w200 = bench::filter_wasm(&module, 204_800, 200)?;
    loads.push(("filter".into(), loadavg()));
    let filter = FilterFigures {
        mb_per_s_16k: w16.mb_per_s,
        mb_per_s_200k: w200.mb_per_s,
        native_mb_per_s_16k: native_16k,
        native_mb_per_s_200k: native_200k,
        wasm_us_per_request_16k: w16.us_p50,
        wasm_us_per_request_200k: w200.us_p50,
        route_request_bytes_200k: w200.route_request_bytes,
    };
    eprintln!("[filter] {filter:?}");

    // 3. Router over HTTP, release binary pinned to core 0.
    let client = HttpClient::new();
    let (http_rps, http_p50, http_p99, http_errors) = http_decisions(
        &tools,
        &client,
        &out_dir,
        args.endpoints,
        args.load_seconds,
        args.concurrency,
    )
    .await?;
    loads.push(("router http".into(), loadavg()));
    let control_plane = ControlPlaneFigures {
        decisions_per_s_inprocess: rb.decisions_per_s,
        decisions_per_s_http: http_rps,
        bytes_per_block: rb.bytes_per_block,
        indexed_blocks: rb.blocks,
        endpoints: args.endpoints,
        http_latency_ms_p50: http_p50,
        http_latency_ms_p99: http_p99,
    };
    eprintln!(
        "[router-http] {http_rps:.0} decisions/s, p50 {http_p50:.2} ms, {http_errors} errors"
    );

    let mut overhead = Vec::new();
    let mut quality = Vec::new();
    if !args.micro_only {
        overhead = overhead_section(&args, &tools).await?;
        loads.push(("overhead".into(), loadavg()));
        quality = quality_section(&args, &tools, &out_dir).await?;
        loads.push(("quality".into(), loadavg()));
    }

    // Tables.
    println!(
        "\n== control plane ({} endpoints, {} indexed blocks) ==",
        args.endpoints, rb.blocks
    );
    println!(
        "in-process decisions/s   {:>12.0}",
        control_plane.decisions_per_s_inprocess
    );
    println!(
        "HTTP decisions/s (1 core){:>12.0}   p50 {:.2} ms  p99 {:.2} ms",
        http_rps, http_p50, http_p99
    );
    println!(
        "index bytes per block    {:>12.1}",
        control_plane.bytes_per_block
    );
    println!("\n== filter (canonicalise + hash) ==");
    println!("{:<22}{:>12}{:>12}", "", "16 KB", "200 KB");
    println!(
        "{:<22}{:>12.1}{:>12.1}",
        "native MB/s", native_16k, native_200k
    );
    println!(
        "{:<22}{:>12.1}{:>12.1}",
        "wasmtime MB/s", w16.mb_per_s, w200.mb_per_s
    );
    println!(
        "{:<22}{:>12.0}{:>12.0}",
        "wasmtime µs/request", w16.us_p50, w200.us_p50
    );
    if !overhead.is_empty() {
        println!("\n== data-plane overhead (upstream vllm-sim --profile fast, max_tokens 1) ==");
        println!(
            "{:<13}{:>9}{:>11}{:>11}{:>11}{:>11}{:>10}{:>7}",
            "router", "prompt", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms", "max rps", "err"
        );
        for r in &overhead {
            println!(
                "{:<13}{:>9}{:>11.2}{:>11.2}{:>11.2}{:>11.2}{:>10}{:>7}",
                r.router,
                r.prompt_bytes,
                r.latency_ms_p50,
                r.latency_ms_p99,
                r.added_ms_p50,
                r.added_ms_p99,
                r.max_rps.map_or("-".into(), |v| format!("{v:.0}")),
                r.errors
            );
        }
        write_overhead_chart(&out_dir, &overhead)?;
    }
    if !quality.is_empty() {
        println!(
            "\n== routing quality (8 cold vllm-sim replicas, speed {}, our loadgen) ==",
            args.speed
        );
        println!(
            "{:<13}{:<15}{:>10}{:>10}{:>10}{:>12}{:>9}{:>6}",
            "router", "workload", "TTFT p50", "TTFT p99", "ITL p99", "out tok/s", "hit", "err"
        );
        for q in &quality {
            println!(
                "{:<13}{:<15}{:>10.0}{:>10.0}{:>10.1}{:>12.0}{:>8.1}%{:>6}",
                q.router,
                q.workload,
                q.ttft_ms.p50,
                q.ttft_ms.p99,
                q.itl_ms.p99,
                q.output_tokens_per_s,
                q.prefix_hit_rate * 100.0,
                q.errors
            );
        }
    }
    println!("\nload average (1/5/15 min) by section: {loads:?}");

    let summary = json!({
        "overhead": overhead,
        "quality": quality,
        "filter": filter,
        "control_plane": control_plane,
        "environment": {
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "load_average": loads,
            "peers_measured": ["kvroute", "round-robin", "direct"],
            "peers_not_measured": ["sglang-router", "vllm-router"],
            "quality_load_generator": "kvroute-tests loadgen (aiperf not run)",
        },
        "took_s": started.elapsed().as_secs_f64(),
    });
    let path = out_dir.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    println!(
        "summary: {}  (took {:.0}s)",
        path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Starts the release control plane pinned to core 0 (when `taskset` exists) and drives
/// `POST /v1/route` with keep-alive connections.
async fn http_decisions(
    tools: &Tools,
    client: &HttpClient,
    out_dir: &std::path::Path,
    endpoints: usize,
    seconds: u64,
    concurrency: usize,
) -> anyhow::Result<(f64, f64, f64, usize)> {
    let api = harness::free_port()?;
    let admin = harness::free_port()?;
    // Endpoints nobody listens on: scrapes fail fast, so every decision is a full scoring pass
    // over endpoints without metrics (the router still scores the prefix index).
    let addrs: Vec<String> = (0..endpoints)
        .map(|i| format!("127.0.0.{}:9", i % 250 + 2))
        .collect();
    let yaml = harness::control_plane_yaml(api, admin, 1_000, &addrs, &json!({}))?;
    let cfg = out_dir.join("control-plane-bench.yaml");
    std::fs::write(&cfg, yaml)?;
    let pinned = Command::new("taskset").arg("-V").output().is_ok();
    let mut cmd = if pinned {
        let mut c = Command::new("taskset");
        c.arg("-c").arg("0").arg(&tools.control_plane);
        c
    } else {
        Command::new(&tools.control_plane)
    };
    cmd.arg("--config").arg(&cfg).env("RUST_LOG", "warn");
    let mut proc = ManagedProcess::spawn(
        "control-plane-bench",
        cmd,
        &out_dir.join("control-plane-bench.log"),
    )?;
    let health = format!("http://127.0.0.1:{api}/healthz");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(why) = proc.exited() {
            bail!("the control plane exited: {why}\n{}", proc.log_tail(20));
        }
        if client
            .get(&health, Duration::from_millis(500))
            .await
            .is_ok_and(|r| r.status == 200)
        {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "the control plane did not become ready\n{}",
                proc.log_tail(20)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let bodies = Arc::new(bench::route_bodies(512));
    let url = format!(
        "http://127.0.0.1:{api}{}",
        scorer_core::protocol::ROUTE_PATH
    );
    // Warm up, then measure.
    let _ = bench::http_load(
        &url,
        bodies.clone(),
        concurrency,
        Duration::from_millis(500),
        usize::MAX,
    )
    .await;
    let r = bench::http_load(
        &url,
        bodies,
        concurrency,
        Duration::from_secs(seconds),
        usize::MAX,
    )
    .await;
    proc.kill();
    Ok((r.rps, r.p(50.0), r.p(99.0), r.errors))
}

async fn overhead_section(args: &Args, tools: &Tools) -> anyhow::Result<Vec<OverheadRow>> {
    const SIZES: [usize; 3] = [1_024, 16_384, 204_800];
    let mut fleets = Vec::new();
    for router in [RouterKind::Kvroute, RouterKind::RoundRobin] {
        let mut cfg = FleetConfig::new(&format!("bench-overhead-{}", router.label()));
        cfg.replicas = 1;
        cfg.model = bench::MODEL.to_string();
        cfg.router = router;
        cfg.sim_args = vec![
            "--profile".into(),
            "fast".into(),
            "--max-num-seqs".into(),
            "256".into(),
        ];
        eprintln!(
            "[overhead] starting Envoy ({}) + 1 fast replica ...",
            router.label()
        );
        fleets.push((router.label().to_string(), Fleet::start(cfg, tools).await?));
    }
    let direct_url = fleets[0].1.replicas[0].url();
    let mut targets: Vec<(String, String)> = vec![("direct".into(), direct_url)];
    for (label, f) in &fleets {
        targets.push((label.clone(), f.url()));
    }
    let mut rows = Vec::new();
    for &size in &SIZES {
        let bodies = Arc::new(
            (0..32)
                .map(|s| bench::chat_body(size, s, 1, false))
                .collect::<Vec<_>>(),
        );
        let mut direct = (0.0, 0.0);
        for (label, base) in &targets {
            let url = format!("{base}/v1/chat/completions");
            let _ = bench::http_load(&url, bodies.clone(), 1, Duration::from_secs(2), 10).await;
            let seq = bench::http_load(
                &url,
                bodies.clone(),
                1,
                Duration::from_secs(30),
                args.samples,
            )
            .await;
            let (p50, p99) = (seq.p(50.0), seq.p(99.0));
            if label == "direct" {
                direct = (p50, p99);
            }
            let mut errors = seq.errors;
            let max_rps = if size == SIZES[0] {
                let r = bench::http_load(
                    &url,
                    bodies.clone(),
                    args.concurrency,
                    Duration::from_secs(args.load_seconds),
                    usize::MAX,
                )
                .await;
                errors += r.errors;
                Some(r.rps)
            } else {
                None
            };
            eprintln!(
                "[overhead] {label} {size} B: p50 {p50:.2} ms p99 {p99:.2} ms max_rps {max_rps:?} errors {errors}"
            );
            rows.push(OverheadRow {
                router: label.clone(),
                prompt_bytes: size,
                added_ms_p50: p50 - direct.0,
                added_ms_p99: p99 - direct.1,
                latency_ms_p50: p50,
                latency_ms_p99: p99,
                max_rps,
                errors,
            });
        }
    }
    drop(fleets);
    Ok(rows)
}

fn workloads() -> Vec<(&'static str, Workload)> {
    let base = Workload {
        model: "kvroute-demo-model".to_string(),
        request_timeout: Duration::from_secs(120),
        ..Workload::default()
    };
    vec![
        (
            "multi-turn",
            Workload {
                conversations: 16,
                turns: 3,
                system_prompt_words: 1_000,
                first_message_words: 800,
                followup_words: 60,
                max_tokens: 32,
                ..base.clone()
            },
        ),
        (
            "shared-prefix",
            Workload {
                conversations: 32,
                turns: 1,
                system_prompt_words: 3_000,
                first_message_words: 100,
                max_tokens: 32,
                seed: 11,
                ..base
            },
        ),
    ]
}

async fn quality_section(
    args: &Args,
    tools: &Tools,
    out_dir: &std::path::Path,
) -> anyhow::Result<Vec<QualityRow>> {
    let mut rows = Vec::new();
    let mut cdf_series = Vec::new();
    for (name, workload) in workloads() {
        for router in [RouterKind::Kvroute, RouterKind::RoundRobin] {
            let label = router.label();
            let mut cfg = FleetConfig::new(&format!("bench-quality-{label}"));
            cfg.replicas = 8;
            cfg.model = workload.model.clone();
            cfg.router = router;
            cfg.sim_args = vec!["--speed".into(), args.speed.to_string()];
            eprintln!("[quality] {name} via {label}: starting 8 cold replicas ...");
            let fleet = Fleet::start(cfg, tools).await?;
            let run = loadgen::run_workload(&fleet.url(), &workload, |_, _| {}).await;
            let (hits, queries) = fleet.prefix_cache_totals().await?;
            drop(fleet);
            let hit = if queries > 0.0 { hits / queries } else { 0.0 };
            let s = loadgen::summarize(label, &run, hit);
            let mut itl: Vec<f64> = run
                .records
                .iter()
                .filter(|r| r.error.is_none() && r.output_tokens > 1)
                .filter_map(|r| {
                    r.ttft_ms
                        .map(|t| (r.e2e_ms - t) / (r.output_tokens - 1) as f64)
                })
                .collect();
            itl.sort_by(f64::total_cmp);
            let mut ttft: Vec<f64> = run.records.iter().filter_map(|r| r.ttft_ms).collect();
            ttft.sort_by(f64::total_cmp);
            let n = ttft.len().max(1) as f64;
            cdf_series.push((
                format!("{label} {name}"),
                ttft.iter()
                    .enumerate()
                    .map(|(i, t)| (*t, (i + 1) as f64 / n))
                    .collect::<Vec<_>>(),
            ));
            eprintln!(
                "[quality] {name} via {label}: TTFT p50 {:.0} ms, hit {:.1}%",
                s.ttft_ms.p50,
                hit * 100.0
            );
            rows.push(QualityRow {
                router: label.to_string(),
                workload: name.to_string(),
                ttft_ms: P50P99 {
                    p50: s.ttft_ms.p50,
                    p99: s.ttft_ms.p99,
                },
                itl_ms: P99 {
                    p99: percentile(&itl, 99.0),
                },
                output_tokens_per_s: s.output_tokens_per_s,
                prefix_hit_rate: hit,
                requests: s.requests,
                errors: s.errors,
                load_generator: "kvroute-tests loadgen".into(),
            });
        }
    }
    let svg = line_chart_axes(
        "TTFT CDF (cold 8-replica fleets)",
        "TTFT ms",
        "fraction",
        &cdf_series,
        true,
        false,
    );
    std::fs::write(out_dir.join("quality-ttft-cdf.svg"), svg)?;
    Ok(rows)
}

fn write_overhead_chart(out_dir: &std::path::Path, rows: &[OverheadRow]) -> anyhow::Result<()> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows {
        let point = (r.prompt_bytes as f64 / 1024.0, r.latency_ms_p50);
        match series.iter_mut().find(|(l, _)| *l == r.router) {
            Some((_, pts)) => pts.push(point),
            None => series.push((r.router.clone(), vec![point])),
        }
    }
    let svg = line_chart_axes(
        "Latency p50 vs prompt size",
        "prompt KB",
        "p50 ms",
        &series,
        true,
        true,
    );
    std::fs::write(out_dir.join("overhead-latency.svg"), svg)?;
    Ok(())
}
