//! `kvroute-bench`: performance of kvroute's parts and of the whole data path.
//!
//! Sections: the router in process and over HTTP (release control plane pinned to one core,
//! index filled with 1M blocks), the filter natively, as the release `.wasm` in wasmtime and
//! inside Envoy's V8 (from its own hashing-time histogram), filter memory per in-flight
//! request, data-plane overhead (kvroute, plain Envoy round robin, sglang-router and
//! vllm-router standalone and each behind plain Envoy, all against direct) in front of
//! `vllm-sim --profile fast`, and routing quality on cold 8-replica fleets driven by aiperf
//! through each router in turn.
//! Writes `<target>/bench/summary.json` and SVG plots beside it; tables go to stdout.
//! Peers and aiperf come from `.venv-bench` (`make bench-setup`).

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use fleet_sim::report::line_chart_axes;
use kvroute_bench::aiperf::{AiperfFigures, AiperfRun, AiperfWorkload};
use kvroute_bench::bars::{
    BOOTSTRAP_ROUNDS, QualityBar, QualityRuns, median, quality_bars, verdict,
};
use kvroute_bench::metrics_fleet::MetricsFleet;
use kvroute_bench::peers::{self, Peer, PeerRouter};
use kvroute_bench::{
    self as bench, ControlPlaneFigures, FilterFigures, OverheadRow, P50P99, P99, QualityRow,
};
use kvroute_harness::{
    self as harness, Fleet, FleetConfig, HttpClient, ManagedProcess, RouterKind, Tools,
};
use proxy_wasm_host::FilterModule;
use serde_json::json;

/// Command line of `kvroute-bench`.
#[derive(Debug, Parser)]
#[command(
    name = "kvroute-bench",
    about = "Benchmark kvroute: router, filter, overhead and quality against peer routers"
)]
struct Args {
    /// Output directory (default: `<target>/bench`).
    #[arg(long)]
    out_dir: Option<std::path::PathBuf>,
    /// Endpoints in the in-process and HTTP router benchmarks.
    #[arg(long, default_value_t = 64)]
    endpoints: usize,
    /// Indexed blocks in the in-process and HTTP router benchmarks.
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
    #[arg(long, default_value_t = 2.0)]
    speed: f64,
    /// Scales the quality workloads' request counts (1 = the documented runs).
    #[arg(long, default_value_t = 1.0)]
    quality_scale: f64,
    /// Runs of the local path and the route call on each quality workload (aiperf seeds 7, 8,
    /// ...): the first is the table's, issue #15's quality bars pool them all. A cold fleet's
    /// runs differ by more than a 5 % bar, so one run cannot settle it.
    #[arg(long, default_value_t = 3)]
    quality_runs: usize,
    /// Skip the Envoy overhead and quality sections (micro-benchmarks only).
    #[arg(long)]
    micro_only: bool,
    /// Skip the peer routers (sglang-router, vllm-router; standalone and behind Envoy) in both
    /// sections.
    #[arg(long)]
    no_peers: bool,
    /// Skip the quality section.
    #[arg(long)]
    no_quality: bool,
    /// Run only the quality section (prints its table; writes `quality-summary.json`).
    #[arg(long)]
    quality_only: bool,
    /// Fleet sizes of the scale section (one control plane scraping a vLLM-shaped payload
    /// from that many endpoints); `--scale 0` skips it.
    #[arg(long, value_delimiter = ',', default_value = "64,256")]
    scale: Vec<usize>,
    /// Run only the scale section (prints its tables; writes `scale-summary.json`).
    #[arg(long)]
    scale_only: bool,
    /// Fleet sizes of the scale section's proxy-VM memory figure (the release filter in
    /// wasmtime with `decision: local`, its index filled past its bound); `--vm-memory 0`
    /// skips it. At most `scorer_core::index::MAX_ENDPOINTS` (256) each.
    #[arg(long, value_delimiter = ',', default_value = "8,64,256")]
    vm_memory: Vec<usize>,
    /// The filter's `max_index_blocks` for the VM-memory figure's second set of rows (the
    /// first runs without it: each endpoint's KV capacity bounds the index); 0 skips them.
    /// 32,768 keeps 16 workers' VMs over 64 replicas to a few hundred MB.
    #[arg(long, default_value_t = 32_768)]
    vm_max_index_blocks: usize,
    /// Record the control plane with `perf record -g` during the HTTP decisions run
    /// (`<out>/control-plane-http.perf.data`; read it with `perf report -i`).
    #[arg(long)]
    perf: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.endpoints == 0
        || args.endpoints > 1000
        || args.samples == 0
        || args.concurrency == 0
        || args.quality_runs == 0
    {
        bail!(
            "--endpoints must be 1..=1000, --samples, --concurrency and --quality-runs at least 1"
        );
    }
    harness::check_positive("--speed", args.speed)?;
    harness::check_positive("--quality-scale", args.quality_scale)?;
    let rt = harness::driver_runtime()?;
    rt.block_on(run(args))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn command_version(program: &std::path::Path, arg: &str) -> String {
    Command::new(program)
        .arg(arg)
        .output()
        .ok()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stdout).to_string()
                + &String::from_utf8_lossy(&o.stderr);
            text.lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .unwrap_or_else(|| "unknown".into())
}

/// `ratio` formatted for a table cell, `-` when undefined.
fn ratio(num: f64, den: f64) -> String {
    if den > 0.0 && num.is_finite() {
        format!("{:.2}x", num / den)
    } else {
        "-".into()
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let out_dir = harness::output_dir(args.out_dir.as_deref(), "bench")?;
    let mut loads = vec![("start".to_string(), loadavg())];
    let mut skipped: Vec<String> = Vec::new();
    if args.scale_only {
        let tools = Tools::locate().context("kvroute-bench needs its tools")?;
        let client = HttpClient::new();
        let scale = scale_section(&args, &tools, &client, &out_dir, &mut skipped).await;
        print_scale(&scale);
        loads.push(("scale".into(), loadavg()));
        let path = out_dir.join("scale-summary.json");
        let summary = json!({
            "scale": scale.rows, "scale_parse": scale.parse, "vm_memory": scale.vm_memory,
            "load_average": loads, "not_measured": skipped,
        });
        harness::write_json(&path, &summary)?;
        println!("summary: {}", path.display());
        return Ok(());
    }
    if args.quality_only {
        let tools = Tools::locate().context("kvroute-bench needs its tools")?;
        let quality = quality_section(&args, &tools, &out_dir, &mut skipped).await?;
        print_quality(&quality.table, args.speed);
        let quality_bars = quality_bars(&quality);
        print_quality_bars(&quality_bars);
        loads.push(("quality".into(), loadavg()));
        println!("not measured: {skipped:?}\nload average: {loads:?}");
        let path = out_dir.join("quality-summary.json");
        let summary = json!({"quality": quality.table, "quality_repeats": quality.repeats,
            "quality_bars": quality_bars, "load_average": loads, "not_measured": skipped});
        harness::write_json(&path, &summary)?;
        println!(
            "summary: {}  (took {:.0}s)",
            path.display(),
            started.elapsed().as_secs_f64()
        );
        return Ok(());
    }

    // 1. Router in process.
    eprintln!(
        "[router] {} endpoints, {} blocks ...",
        args.endpoints, args.blocks
    );
    let rb = bench::router_inprocess(args.endpoints, args.blocks, 200_000);
    let recorded = bench::router_recorded(args.endpoints, args.blocks, 200_000);
    loads.push(("router in-process".into(), loadavg()));
    eprintln!(
        "[router] {:.0} decisions/s, {:.0} recorded/s, {:.1} bytes/block",
        rb.decisions_per_s, recorded.decisions_per_s, rb.bytes_per_block
    );

    // 2. Filter natively and in wasmtime; memory per in-flight request.
    let located = Instant::now();
    let tools =
        Tools::locate().context("kvroute-bench needs its tools (try `make setup build`)")?;
    // Locating may build a stale control plane or filter (waiting on cargo's lock behind other
    // builds); that time is reported apart from the benchmark's own.
    let tools_s = located.elapsed().as_secs_f64();
    eprintln!("[tools] located in {tools_s:.0} s");
    let native_16k = bench::canon_native(16_384, 4_000)?;
    let native_200k = bench::canon_native(204_800, 400)?;
    let module = FilterModule::from_file(&tools.wasm)
        .with_context(|| format!("cannot load {}", tools.wasm.display()))?;
    let w16 = bench::filter_wasm(&module, 16_384, 2_000)?;
    let w200 = bench::filter_wasm(&module, 204_800, 200)?;
    const IN_FLIGHT: usize = 1_024;
    let mem16 = bench::filter_inflight_memory(&module, 16_384, IN_FLIGHT)?;
    let mem200 = bench::filter_inflight_memory(&module, 204_800, IN_FLIGHT)?;
    loads.push(("filter".into(), loadavg()));
    let mut filter = FilterFigures {
        mb_per_s_16k: w16.mb_per_s,
        mb_per_s_200k: w200.mb_per_s,
        native_mb_per_s_16k: native_16k,
        native_mb_per_s_200k: native_200k,
        wasm_us_per_request_16k: w16.us_p50,
        wasm_us_per_request_200k: w200.us_p50,
        route_request_bytes_200k: w200.route_request_bytes,
        v8_mb_per_s_16k: None,
        v8_mb_per_s_200k: None,
        v8_us_per_body_16k: None,
        v8_us_per_body_200k: None,
        inflight_bytes_per_request_16k: mem16,
        inflight_bytes_per_request_200k: mem200,
        inflight_requests: IN_FLIGHT,
    };
    eprintln!("[filter] {filter:?}");

    // 3. Router over HTTP with a filled index, release binary pinned to one core.
    let client = HttpClient::new();
    let http = http_decisions(&tools, &client, &out_dir, &args).await?;
    loads.push(("router http".into(), loadavg()));
    let control_plane = ControlPlaneFigures {
        decisions_per_s_inprocess: rb.decisions_per_s,
        decisions_per_s_recorded: recorded.decisions_per_s,
        decisions_per_s_http: http.rps,
        bytes_per_block: rb.bytes_per_block,
        indexed_blocks: rb.blocks,
        endpoints: args.endpoints,
        http_latency_ms_p50: http.p50,
        http_latency_ms_p99: http.p99,
    };
    eprintln!(
        "[router-http] {:.0} decisions/s, p50 {:.2} ms, {} errors, {} blocks indexed",
        http.rps, http.p50, http.errors, http.index_blocks
    );

    // Tokenisation cost of precise routes (one-replica fleets, measured by the control plane).
    eprintln!("[tokenize] hf and remote backends, multi-turn and cold ...");
    let tokenize_config = kvroute_bench::tokenize::TokenizeBenchConfig::default();
    let tokenize = match kvroute_bench::tokenize::run(&tools, &tokenize_config, &out_dir).await {
        Ok(rows) => rows,
        Err(e) => {
            skipped.push(format!("tokenize: {e}"));
            Vec::new()
        }
    };
    loads.push(("tokenize".into(), loadavg()));

    // What one control plane spends per scraped replica (issue #15, point 5).
    let scale = scale_section(&args, &tools, &client, &out_dir, &mut skipped).await;
    loads.push(("scale".into(), loadavg()));

    let mut overhead = Vec::new();
    let mut crowded = Vec::new();
    let mut local_decision_fraction = None;
    let mut module_local_decision_fraction = None;
    let mut latency_bars = Vec::new();
    let mut quality = QualityRuns::default();
    if !args.micro_only {
        let measured = overhead_section(&args, &tools, &mut skipped).await?;
        overhead = measured.rows;
        crowded = measured.crowded;
        local_decision_fraction = measured.local_decision_fraction;
        module_local_decision_fraction = measured.module_local_decision_fraction;
        latency_bars = measured.latency_bars;
        if let Some(v8) = measured.v8 {
            filter.v8_mb_per_s_16k = v8.mb_per_s_16k;
            filter.v8_mb_per_s_200k = v8.mb_per_s_200k;
            filter.v8_us_per_body_16k = v8.us_16k;
            filter.v8_us_per_body_200k = v8.us_200k;
        }
        loads.push(("overhead".into(), loadavg()));
        if !args.no_quality {
            quality = quality_section(&args, &tools, &out_dir, &mut skipped).await?;
            loads.push(("quality".into(), loadavg()));
        }
    }

    // Tables.
    println!(
        "\n== control plane ({} endpoints, {} indexed blocks) ==",
        args.endpoints, rb.blocks
    );
    println!(
        "in-process decisions/s (1 thread)   {:>10.0}   target 100,000  {}",
        control_plane.decisions_per_s_inprocess,
        ratio(control_plane.decisions_per_s_inprocess, 100_000.0)
    );
    println!(
        "recorded decisions/s (1 thread)     {:>10.0}   another router's, applied (no target)",
        control_plane.decisions_per_s_recorded
    );
    println!(
        "HTTP decisions/s (1 core, {:>7} blocks) {:>6.0}   target  20,000  {}   p50 {:.2} ms  p99 {:.2} ms  errors {}",
        http.index_blocks,
        http.rps,
        ratio(http.rps, 20_000.0),
        http.p50,
        http.p99,
        http.errors
    );
    println!(
        "index bytes per block (in process)  {:>10.1}   over HTTP {:.1}",
        control_plane.bytes_per_block, http.bytes_per_block
    );
    println!("\n== filter (canonicalise + hash) ==  target 500 MB/s");
    println!("{:<34}{:>12}{:>12}", "", "16 KB", "200 KB");
    println!(
        "{:<34}{:>12.1}{:>12.1}",
        "native MB/s", native_16k, native_200k
    );
    println!(
        "{:<34}{:>12.1}{:>12.1}",
        "wasmtime MB/s (whole request)", w16.mb_per_s, w200.mb_per_s
    );
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    println!(
        "{:<34}{:>12}{:>12}",
        "Envoy V8 MB/s (parse+hash)",
        opt(filter.v8_mb_per_s_16k),
        opt(filter.v8_mb_per_s_200k)
    );
    println!(
        "{:<34}{:>12.0}{:>12.0}",
        "wasmtime µs/request", w16.us_p50, w200.us_p50
    );
    println!(
        "{:<34}{:>12}{:>12}",
        "Envoy V8 µs/body (parse+hash)",
        opt(filter.v8_us_per_body_16k),
        opt(filter.v8_us_per_body_200k)
    );
    println!(
        "{:<34}{:>12.0}{:>12.0}",
        format!("wasm bytes per in-flight request ({IN_FLIGHT} held)"),
        mem16,
        mem200
    );
    if !tokenize.is_empty() {
        println!("\n== precise-mode tokenisation per request (control plane metrics) ==");
        print!("{}", kvroute_bench::tokenize::render_table(&tokenize));
    }
    if !overhead.is_empty() {
        println!("\n== data-plane overhead (upstream vllm-sim --profile fast, max_tokens 1) ==");
        let envoy = overhead
            .iter()
            .find(|r| r.router == "round-robin" && r.max_rps.is_some());
        let envoy_rps = envoy.and_then(|r| r.max_rps).unwrap_or(0.0);
        let envoy_rounds = envoy.map_or(&[][..], |r| &r.max_rps_rounds[..]);
        println!(
            "{:<21}{:>9}{:>9}{:>9}{:>9}{:>13}{:>9}{:>9}{:>14}{:>11}{:>12}{:>6}",
            "router",
            "prompt",
            "p50 ms",
            "p99 ms",
            "+p50",
            "+p50 95%",
            "+p99",
            "max rps",
            "rps/Envoy RR",
            "Envoy µs/r",
            "router µs/r",
            "err"
        );
        let us = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
        for r in &overhead {
            println!(
                "{:<21}{:>9}{:>9.2}{:>9.2}{:>9.2}{:>13}{:>9.2}{:>9}{:>14}{:>11}{:>12}{:>6}",
                r.router,
                r.prompt_bytes,
                r.latency_ms_p50,
                r.latency_ms_p99,
                r.added_ms_p50,
                r.added_ms_p50_ci95
                    .map_or("-".into(), |[lo, hi]| format!("{lo:.2}..{hi:.2}")),
                r.added_ms_p99,
                r.max_rps.map_or("-".into(), |v| format!("{v:.0}")),
                r.max_rps
                    .map_or("-".into(), |v| format!("{:.0}%", 100.0 * v / envoy_rps)),
                us(r.envoy_cpu_us_per_request),
                us(r.router_cpu_us_per_request),
                r.errors
            );
        }
        println!(
            "(CPU µs/request: user+system time of Envoy and of the control plane or peer router \
             during the max-rps run, over the requests it served)"
        );
        for (name, fraction) in [
            (LOCAL, local_decision_fraction),
            (MODULE, module_local_decision_fraction),
        ] {
            if let Some(fraction) = fraction {
                println!(
                    "{name}: {:.1}% of routed requests decided in the proxy (no route call)",
                    100.0 * fraction
                );
            }
        }
        for name in [LOCAL, MODULE] {
            let Some(row) = overhead
                .iter()
                .find(|r| r.router == name && r.max_rps.is_some())
            else {
                continue;
            };
            let rps = row.max_rps.unwrap_or(0.0);
            if envoy_rps > 0.0 {
                let share = rps / envoy_rps;
                // Round by round (each round runs every row close in time): how far the
                // machine's drift moves the ratio the bar is judged on.
                let rounds: Vec<String> = row
                    .max_rps_rounds
                    .iter()
                    .zip(envoy_rounds)
                    .map(|(ours, envoy)| format!("{:.0}", 100.0 * ours / envoy))
                    .collect();
                println!(
                    "issue #15 bar, max req/s at 1 KB: {name} {:.0}% of plain Envoy's (round by \
                     round {}%), at least {:.0}%: {}",
                    100.0 * share,
                    rounds.join(", "),
                    100.0 * MAX_RPS_BAR,
                    if share >= MAX_RPS_BAR {
                        "met"
                    } else {
                        "missed"
                    }
                );
            }
        }
        for b in &latency_bars {
            let interval = b.ci95.map_or(String::new(), |[lo, hi]| {
                format!(" (95% interval {lo:+.2}..{hi:+.2})")
            });
            let verdict = verdict(b.ms, b.ci95, b.bar_ms);
            println!(
                "issue #15 bar at {} B: {} minus {} p50 {:+.2} ms{interval}, at most {:+.2}: {verdict}",
                b.prompt_bytes, b.router, b.against, b.ms, b.bar_ms
            );
        }
        write_overhead_chart(&out_dir, &overhead)?;
    }
    if !crowded.is_empty() {
        println!(
            "\n== {CROWDED_CONCURRENCY} concurrent clients, {} KB prompts (closed loop) ==",
            CROWDED_BYTES / 1024
        );
        let direct = crowded
            .iter()
            .find(|r| r.router == "direct")
            .map_or(0.0, |r| r.latency_ms_p50);
        println!(
            "{:<21}{:>9}{:>9}{:>9}{:>9}{:>6}",
            "router", "p50 ms", "p99 ms", "+p50", "rps", "err"
        );
        for r in &crowded {
            println!(
                "{:<21}{:>9.1}{:>9.1}{:>9.1}{:>9.0}{:>6}",
                r.router,
                r.latency_ms_p50,
                r.latency_ms_p99,
                r.latency_ms_p50 - direct,
                r.rps,
                r.errors
            );
        }
    }
    let quality_bars = quality_bars(&quality);
    if !quality.table.is_empty() {
        print_quality(&quality.table, args.speed);
        print_quality_bars(&quality_bars);
    }
    print_scale(&scale);
    if !skipped.is_empty() {
        println!("\nnot measured:");
        for s in &skipped {
            println!("  {s}");
        }
    }
    println!("\nload average (1/5/15 min) by section: {loads:?}");

    let venv = peers::bench_venv();
    let summary = json!({
        "overhead": overhead,
        "crowded": crowded,
        "local_decision_fraction": local_decision_fraction,
        "module_local_decision_fraction": module_local_decision_fraction,
        "latency_bars": latency_bars,
        "quality": quality.table,
        "quality_repeats": quality.repeats,
        "quality_bars": quality_bars,
        "scale": scale.rows,
        "scale_parse": scale.parse,
        "vm_memory": scale.vm_memory,
        "filter": filter,
        "control_plane": control_plane,
        "tokenize": {
            "rows": tokenize,
            "config": tokenize_config,
            "hf_tokenizer": kvroute_bench::tokenize::HF_TOKENIZER,
        },
        "control_plane_http": {
            "decisions_per_s": http.rps,
            "latency_ms_p50": http.p50,
            "latency_ms_p99": http.p99,
            "errors": http.errors,
            "indexed_blocks": http.index_blocks,
            "bytes_per_block": http.bytes_per_block,
            "pinned_core": http.pinned_core,
            "concurrency": args.concurrency,
        },
        "environment": {
            "cpu_model": cpu_model(),
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "load_average": loads,
            "envoy": command_version(&tools.envoy, "--version"),
            "sglang_router": format!("{} (PyPI, cache_aware)", Peer::Sglang.version()),
            "vllm_router": format!("{} (PyPI, cache_aware)", Peer::Vllm.version()),
            "aiperf": command_version(&venv.join("bin").join("aiperf"), "--version"),
            "quality_load_generator": "aiperf 0.13.0",
            "not_measured": skipped,
        },
        "took_s": started.elapsed().as_secs_f64(),
        "tools_build_s": tools_s,
    });
    let path = out_dir.join("summary.json");
    harness::write_json(&path, &summary)?;
    println!(
        "summary: {}  (took {:.0}s, of which {tools_s:.0}s locating/building tools)",
        path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// What the HTTP decisions/s run measured.
struct HttpFigures {
    rps: f64,
    p50: f64,
    p99: f64,
    errors: usize,
    index_blocks: u64,
    bytes_per_block: f64,
    pinned_core: Option<u32>,
}

/// Starts the release control plane pinned to core 1 (when `taskset` exists) over
/// `args.endpoints` endpoints that answer vLLM metrics, fills its index with `args.blocks`
/// blocks through `POST /v1/route` itself (every routed prompt's blocks are indexed on the
/// chosen endpoint, as in production), then drives route calls over keep-alive connections.
async fn http_decisions(
    tools: &Tools,
    client: &HttpClient,
    out_dir: &std::path::Path,
    args: &Args,
) -> anyhow::Result<HttpFigures> {
    // Real vLLM-format metrics from one simulator with a KV cache large enough that the index
    // capacity (derived from it) holds the filled blocks.
    let metrics_text = {
        let port = harness::free_port()?;
        let mut cmd = Command::new(&tools.vllm_sim);
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--profile", "fast", "--model", bench::MODEL])
            .args(["--kv-capacity-tokens", "8000000"]);
        let mut sim = ManagedProcess::spawn_logged_in("vllm-sim-metrics", cmd, out_dir)?;
        let url = format!("http://127.0.0.1:{port}/metrics");
        let text = bench::wait_while_running(
            &mut sim,
            "vllm-sim",
            Duration::from_secs(20),
            Duration::from_millis(50),
            async || match client.get(&url, Duration::from_millis(500)).await {
                Ok(r) if r.status == 200 => Some(r.body),
                _ => None,
            },
            |sim| format!("vllm-sim did not serve /metrics\n{}", sim.log_tail(20)),
        )
        .await?;
        sim.kill();
        text
    };
    let fleet = MetricsFleet::start(args.endpoints, metrics_text)
        .await
        .context("cannot bind the metrics listeners")?;
    let api = harness::free_port()?;
    let admin = harness::free_port()?;
    let yaml = harness::control_plane_yaml(api, admin, 1_000, &fleet.addresses, &json!({}))?;
    let cfg = out_dir.join("control-plane-bench.yaml");
    std::fs::write(&cfg, yaml)?;
    // Core 1, when there are two cores and `taskset`. The load client is left unpinned
    // (pinning it to core 0 showed no clear effect; docs/BENCHMARKS.md).
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pinned_core =
        (cpus >= 2 && Command::new("taskset").arg("-V").output().is_ok()).then_some(1u32);
    let mut cmd = match pinned_core {
        Some(core) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(core.to_string()).arg(&tools.control_plane);
            c
        }
        None => Command::new(&tools.control_plane),
    };
    cmd.arg("--config").arg(&cfg).env("RUST_LOG", "warn");
    let mut proc = ManagedProcess::spawn_logged_in("control-plane-bench", cmd, out_dir)?;
    let admin_metrics = format!("http://127.0.0.1:{admin}/metrics");
    let gauge = async |name: &str| -> f64 {
        client
            .get(&admin_metrics, Duration::from_secs(5))
            .await
            .map(|r| harness::prometheus_sum(&r.body, name))
            .unwrap_or(0.0)
    };
    // Ready once every endpoint has been scraped.
    bench::wait_while_running(
        &mut proc,
        "the control plane",
        Duration::from_secs(30),
        Duration::from_millis(100),
        async || (gauge("kvroute_endpoint_up").await >= args.endpoints as f64).then_some(()),
        |proc| {
            format!(
                "the control plane did not see {} endpoints up\n{}",
                args.endpoints,
                proc.log_tail(20)
            )
        },
    )
    .await?;
    let url = format!(
        "http://127.0.0.1:{api}{}",
        scorer_core::protocol::ROUTE_PATH
    );
    let (fill, measure) = bench::filled_index_bodies(args.blocks, 1_024);
    eprintln!(
        "[router-http] filling the index: {} route calls of 64 new blocks ...",
        fill.len()
    );
    let per_task = fill.len().div_ceil(args.concurrency);
    let filled = bench::http_load(
        &url,
        Arc::new(fill),
        args.concurrency,
        Duration::from_secs(300),
        per_task,
    )
    .await;
    if filled.errors > 0 {
        eprintln!("[router-http] {} fill calls failed", filled.errors);
    }
    let index_blocks = gauge("kvroute_index_blocks").await as u64;
    let index_bytes = gauge("kvroute_index_bytes").await;
    let measure = Arc::new(measure);
    let _ = bench::http_load(
        &url,
        measure.clone(),
        args.concurrency,
        Duration::from_millis(500),
        usize::MAX,
    )
    .await;
    let perf = if args.perf {
        let data = out_dir.join("control-plane-http.perf.data");
        let mut c = Command::new("perf");
        c.args(["record", "-F", "999", "-g", "-o"])
            .arg(&data)
            .args(["-p", &proc.pid().to_string(), "--", "sleep"])
            .arg(args.load_seconds.to_string());
        Some(ManagedProcess::spawn_logged_in("perf-record", c, out_dir)?)
    } else {
        None
    };
    let r = bench::http_load(
        &url,
        measure,
        args.concurrency,
        Duration::from_secs(args.load_seconds),
        usize::MAX,
    )
    .await;
    if let Some(mut p) = perf {
        // perf stops by itself after `sleep`; give it time to write its file.
        let deadline = Instant::now() + Duration::from_secs(30);
        while p.exited().is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    proc.kill();
    drop(fleet);
    Ok(HttpFigures {
        rps: r.rps,
        p50: r.p(50.0),
        p99: r.p(99.0),
        errors: r.errors,
        index_blocks,
        bytes_per_block: index_bytes / (index_blocks.max(1) as f64),
        pinned_core,
    })
}

/// A router under test in the overhead section.
struct Target {
    label: String,
    url: String,
    /// Envoy admin address of a kvroute Envoy (for the filter's hashing-time histogram).
    kvroute_admin: Option<String>,
    /// Envoy's pid, when the row goes through one.
    envoy_pid: Option<u32>,
    /// The control plane's or the peer router's pid, when the row has one.
    router_pid: Option<u32>,
}

/// Parse+hash throughput inside Envoy's V8.
struct V8Figures {
    mb_per_s_16k: Option<f64>,
    mb_per_s_200k: Option<f64>,
    us_16k: Option<f64>,
    us_200k: Option<f64>,
}

/// The overhead row of kvroute deciding in the proxy with the wasm filter (`decision: local`).
const LOCAL: &str = "kvroute-local";
/// The overhead row of kvroute's Envoy with a proxy-wasm filter that does nothing.
const EMPTY_WASM: &str = "envoy+empty-wasm";
/// The overhead row of kvroute deciding in the proxy as an Envoy dynamic module
/// (`filter/envoy-module`, `make envoy-module`) instead of the wasm filter.
const MODULE: &str = "kvroute-module";
/// Issue #15's bar on max req/s at 1 KB: at least this share of plain Envoy's.
const MAX_RPS_BAR: f64 = 0.90;

/// Prompt size and concurrency of the crowded overhead run.
const CROWDED_BYTES: usize = 204_800;
const CROWDED_CONCURRENCY: usize = 150;

/// One router under many concurrent big prompts.
#[derive(Debug, Clone, serde::Serialize)]
struct CrowdedRow {
    router: String,
    prompt_bytes: usize,
    concurrency: usize,
    latency_ms_p50: f64,
    latency_ms_p99: f64,
    rps: f64,
    errors: usize,
}

/// What the overhead section measured.
struct Overhead {
    rows: Vec<OverheadRow>,
    /// Every router at [`CROWDED_CONCURRENCY`] clients with [`CROWDED_BYTES`] prompts.
    crowded: Vec<CrowdedRow>,
    v8: Option<V8Figures>,
    /// Of the requests the `kvroute-local` row routed, the share its VMs decided locally.
    local_decision_fraction: Option<f64>,
    /// The same for the `kvroute-module` row.
    module_local_decision_fraction: Option<f64>,
    /// The local path's p50 against plain Envoy's and the peers' behind Envoy: what issue
    /// #15's latency bars compare.
    latency_bars: Vec<LatencyBar>,
}

fn print_quality_bars(bars: &[QualityBar]) {
    for b in bars {
        let interval = b.ci95.map_or(String::new(), |[lo, hi]| {
            format!(" (95% interval {lo:.2}..{hi:.2})")
        });
        let what = match b.figure {
            "prefix_hit_rate" => format!(
                "route call's prefix hit rate {:.1}% over kvroute-local's {:.1}%",
                b.route_call * 100.0,
                b.local * 100.0
            ),
            figure => format!(
                "kvroute-local {} {:.0} ms over the route call's {:.0}",
                figure.trim_start_matches("ttft_ms_").replace('p', "TTFT p"),
                b.local,
                b.route_call
            ),
        };
        let runs = if b.per_run.len() > 1 {
            let each: Vec<String> = b.per_run.iter().map(|r| format!("{r:.2}")).collect();
            format!(
                " [{} runs pooled, aiperf seeds {:?}; each run {}]",
                b.per_run.len(),
                b.seeds,
                each.join(", ")
            )
        } else {
            String::new()
        };
        println!(
            "issue #15 quality bar, {}: {what}: {:.2}{interval}, at most {:.2}: {}{runs}",
            b.workload,
            b.ratio,
            b.at_most,
            verdict(b.ratio, b.ci95, b.at_most)
        );
    }
}

/// One of issue #15's latency bars in this run: a local path's p50 minus `against`'s at one
/// prompt size, with its 95 % interval; the bar is met when that is at most `bar_ms`.
#[derive(Debug, Clone, serde::Serialize)]
struct LatencyBar {
    /// The row measured: `kvroute-local` (the wasm filter) or `kvroute-module`.
    router: String,
    prompt_bytes: usize,
    /// The row compared with (`round-robin` is plain Envoy).
    against: String,
    /// `router`'s p50 minus `against`'s, ms.
    ms: f64,
    /// Its 95 % interval (bootstrap over both rows' samples).
    ci95: Option<[f64; 2]>,
    /// The most the bar allows, ms.
    bar_ms: f64,
}

/// The fleet of overhead row `label`: Envoy (as `edit` sets it up) over one `fast` replica.
fn overhead_config(label: &str, edit: impl FnOnce(&mut FleetConfig)) -> FleetConfig {
    let mut cfg = FleetConfig::new(&format!("bench-overhead-{label}"));
    cfg.replicas = 1;
    cfg.model = bench::MODEL.to_string();
    cfg.sim_args = bench::overhead_sim_args();
    edit(&mut cfg);
    eprintln!("[overhead] starting Envoy ({label}) + 1 fast replica ...");
    cfg
}

async fn overhead_section(
    args: &Args,
    tools: &Tools,
    skipped: &mut Vec<String>,
) -> anyhow::Result<Overhead> {
    const SIZES: [usize; 3] = [1_024, 16_384, 204_800];
    const PICKER: &str = "kvroute-picker";
    let mut fleets = Vec::new();
    // kvroute with the route call, kvroute deciding in the proxy (`decision: local`), kvroute
    // as an Endpoint Picker behind Envoy's ext_proc (no wasm), and plain Envoy round robin,
    // each on the same Envoy worker count.
    for (label, router, local, picker) in [
        ("kvroute", RouterKind::Kvroute, false, false),
        (LOCAL, RouterKind::Kvroute, true, false),
        (PICKER, RouterKind::Kvroute, false, true),
        ("round-robin", RouterKind::RoundRobin, false, false),
    ] {
        let cfg = overhead_config(label, |cfg| {
            cfg.router = router;
            cfg.picker = picker;
            if local {
                cfg.plugin_config = json!({"decision": "local"});
            }
        });
        fleets.push((label.to_string(), Fleet::start(cfg, tools).await?));
    }
    // kvroute's Envoy with a proxy-wasm filter that does nothing in place of kvroute's: what
    // the wasm filter machinery alone costs per request (tests/noop-filter, built by `make
    // wasm` beside the filter).
    match bench::empty_wasm_edit(&tools.wasm) {
        Ok(edit) => {
            let cfg = overhead_config(EMPTY_WASM, |cfg| cfg.envoy_edits = vec![edit]);
            fleets.push((EMPTY_WASM.to_string(), Fleet::start(cfg, tools).await?));
        }
        Err(empty) => skipped.push(format!(
            "overhead via {EMPTY_WASM}: {} not built (make wasm)",
            empty.display()
        )),
    }
    // The same local decisions as kvroute-local, native in Envoy through its dynamic-module
    // ABI (one routing copy per Envoy process instead of one per worker's VM).
    match kvroute_harness::locate_envoy_module() {
        Ok(_) => {
            let cfg = overhead_config(MODULE, |cfg| {
                cfg.plugin_config = json!({"decision": "local"});
                cfg.envoy_module = true;
            });
            fleets.push((MODULE.to_string(), Fleet::start(cfg, tools).await?));
        }
        Err(e) => skipped.push(format!("overhead via {MODULE}: {e} (make envoy-module)")),
    }
    let client = fleets[0].1.client().clone();
    let upstream = fleets[0].1.replicas[0].address.clone();
    let mut targets = vec![Target {
        label: "direct".into(),
        url: format!("http://{upstream}"),
        kvroute_admin: None,
        envoy_pid: None,
        router_pid: None,
    }];
    for (label, f) in &fleets {
        // The empty filter's control plane is started but never asked.
        let kvroute = label != EMPTY_WASM;
        targets.push(Target {
            label: label.clone(),
            url: f.url(),
            kvroute_admin: f
                .control_plane
                .as_ref()
                .filter(|_| kvroute)
                .map(|_| f.envoy.admin_address.clone()),
            envoy_pid: Some(f.envoy.process().pid()),
            router_pid: f
                .control_plane
                .as_ref()
                .filter(|_| kvroute)
                .map(|c| c.process().pid()),
        });
    }
    // Peers in front of the very replica "direct" measures.
    let mut peer_routers = Vec::new();
    if !args.no_peers {
        for peer in Peer::ALL {
            eprintln!(
                "[overhead] starting {} in front of {upstream} ...",
                peer.label()
            );
            match PeerRouter::start(
                peer,
                std::slice::from_ref(&upstream),
                &fleets[0].1.log_dir,
                &client,
            )
            .await
            {
                Ok(p) => {
                    targets.push(Target {
                        label: peer.label().into(),
                        url: p.url.clone(),
                        kvroute_admin: None,
                        envoy_pid: None,
                        router_pid: Some(p.pid()),
                    });
                    peer_routers.push(p);
                }
                Err(e) => {
                    eprintln!("[overhead] {} not measured: {e}", peer.label());
                    skipped.push(format!("overhead via {}: {e}", peer.label()));
                }
            }
        }
    }
    // What an Envoy or Istio user would run instead of kvroute: plain Envoy (round robin, same
    // worker count as every other row) whose only upstream is the peer router above, which
    // fronts the very replica "direct" measures. No replicas of their own.
    let mut envoy_peers = Vec::new();
    for p in &peer_routers {
        let label = format!("envoy+{}", p.peer.label());
        let address = p.url.strip_prefix("http://").unwrap_or(&p.url).to_string();
        let mut cfg = FleetConfig::new(&format!("bench-overhead-{label}"));
        cfg.replicas = 0;
        cfg.router = RouterKind::RoundRobin;
        cfg.envoy_upstreams = Some(vec![address.clone()]);
        eprintln!(
            "[overhead] starting Envoy in front of {} at {address} ...",
            p.peer.label()
        );
        match Fleet::start(cfg, tools).await {
            Ok(f) => {
                targets.push(Target {
                    label: label.clone(),
                    url: f.url(),
                    kvroute_admin: None,
                    envoy_pid: Some(f.envoy.process().pid()),
                    router_pid: Some(p.pid()),
                });
                envoy_peers.push(f);
            }
            Err(e) => {
                eprintln!("[overhead] {label} not measured: {e}");
                skipped.push(format!("overhead via {label}: {e}"));
            }
        }
    }
    let mut rows = Vec::new();
    let mut latency_bars = Vec::new();
    for &size in &SIZES {
        let bodies = Arc::new(
            (0..32)
                .map(|s| bench::chat_body(size, s, 1, false))
                .collect::<Vec<_>>(),
        );
        let mut direct = (0.0, 0.0);
        // Every row's sequential samples interleaved in blocks of 25 (the first 5 of each not
        // counted), so the machine's drift during the run falls on all of them alike.
        let urls: Vec<String> = targets
            .iter()
            .map(|t| format!("{}/v1/chat/completions", t.url))
            .collect();
        let sequential = bench::interleaved_sequential(&urls, &bodies, 25, 5, args.samples).await;
        let loads = if size == SIZES[0] {
            max_rps_rounds(&targets, &urls, &bodies, args).await
        } else {
            vec![None; targets.len()]
        };
        let row = |label: &str| {
            targets
                .iter()
                .position(|t| t.label == label)
                .map(|i| &sequential[i])
        };
        // Every row's interval is taken against direct's samples.
        let direct_samples: &[f64] = row("direct").map_or(&[], |d| &d.latencies_ms);
        // Issue #15's latency bars: over plain Envoy at most 0.10 ms at 1 and 16 KB, and below
        // both peers behind Envoy at every size.
        let against: &[(&str, f64)] = if size < SIZES[SIZES.len() - 1] {
            &[
                ("round-robin", 0.10),
                ("envoy+sglang-router", 0.0),
                ("envoy+vllm-router", 0.0),
            ]
        } else {
            &[("envoy+sglang-router", 0.0), ("envoy+vllm-router", 0.0)]
        };
        for (name, local) in [LOCAL, MODULE]
            .into_iter()
            .filter_map(|name| Some((name, row(name)?)))
        {
            for &(other, bar_ms) in against {
                let Some(theirs) = row(other) else {
                    continue;
                };
                latency_bars.push(LatencyBar {
                    router: name.to_string(),
                    prompt_bytes: size,
                    against: other.to_string(),
                    ms: local.p(50.0) - theirs.p(50.0),
                    ci95: bench::median_difference_interval(
                        &local.latencies_ms,
                        &theirs.latencies_ms,
                        BOOTSTRAP_ROUNDS,
                        7,
                    ),
                    bar_ms,
                });
            }
        }
        for ((t, seq), load) in targets.iter().zip(&sequential).zip(loads) {
            let (p50, p99) = (seq.p(50.0), seq.p(99.0));
            let added_ms_p50_ci95 = if t.label == "direct" {
                direct = (p50, p99);
                None
            } else {
                bench::median_difference_interval(
                    &seq.latencies_ms,
                    direct_samples,
                    BOOTSTRAP_ROUNDS,
                    7,
                )
            };
            let mut errors = seq.errors;
            let (mut envoy_cpu, mut router_cpu) = (None, None);
            let max_rps_rounds = load.map_or(Vec::new(), |load| load.rounds.to_vec());
            let max_rps = load.map(|load| {
                errors += load.errors;
                (envoy_cpu, router_cpu) = (load.envoy_cpu, load.router_cpu);
                load.rps
            });
            eprintln!(
                "[overhead] {} {size} B: p50 {p50:.2} ms p99 {p99:.2} ms max_rps {max_rps:?} \
                 CPU µs/request Envoy {envoy_cpu:?} router {router_cpu:?} errors {errors}",
                t.label
            );
            rows.push(OverheadRow {
                router: t.label.clone(),
                prompt_bytes: size,
                added_ms_p50: p50 - direct.0,
                added_ms_p50_ci95,
                added_ms_p99: p99 - direct.1,
                latency_ms_p50: p50,
                latency_ms_p99: p99,
                max_rps,
                max_rps_rounds,
                envoy_cpu_us_per_request: envoy_cpu,
                router_cpu_us_per_request: router_cpu,
                errors,
            });
        }
    }
    // Many clients with big prompts at once: what each form adds when requests queue (the
    // Inference Extension's picker path is reported to add over a second of TTFT at 220 KB
    // and concurrency 150).
    let mut crowded = Vec::new();
    {
        let bodies = Arc::new(
            (0..64)
                .map(|s| bench::chat_body(CROWDED_BYTES, s + 1_000, 1, false))
                .collect::<Vec<_>>(),
        );
        for t in &targets {
            let url = format!("{}/v1/chat/completions", t.url);
            let r = bench::http_load(
                &url,
                bodies.clone(),
                CROWDED_CONCURRENCY,
                Duration::from_secs(args.load_seconds),
                usize::MAX,
            )
            .await;
            eprintln!(
                "[overhead] {} {CROWDED_BYTES} B x {CROWDED_CONCURRENCY}: p50 {:.1} ms p99 {:.1} ms rps {:.0} errors {}",
                t.label,
                r.p(50.0),
                r.p(99.0),
                r.rps,
                r.errors
            );
            crowded.push(CrowdedRow {
                router: t.label.clone(),
                prompt_bytes: CROWDED_BYTES,
                concurrency: CROWDED_CONCURRENCY,
                latency_ms_p50: r.p(50.0),
                latency_ms_p99: r.p(99.0),
                rps: r.rps,
                errors: r.errors,
            });
        }
    }
    drop(envoy_peers);
    drop(peer_routers);
    let mut local_decision_fractions = Vec::new();
    for (label, fleet) in fleets.iter().filter(|(l, _)| l == LOCAL || l == MODULE) {
        let routed = fleet.envoy_counter("kvroute_requests_routed").await;
        let local = fleet.envoy_counter("kvroute_decisions_local").await;
        if routed > 0.0 {
            local_decision_fractions.push((label.clone(), local / routed));
        }
    }
    let fraction_of = |name: &str| {
        local_decision_fractions
            .iter()
            .find(|(l, _)| l == name)
            .map(|(_, f)| *f)
    };
    let (local_decision_fraction, module_local_decision_fraction) =
        (fraction_of(LOCAL), fraction_of(MODULE));
    // The filter's own parse+hash time inside V8, from Envoy's histogram of it.
    let v8 = match targets.iter().find(|t| t.kvroute_admin.is_some()) {
        Some(t) => {
            let admin = t.kvroute_admin.clone().unwrap_or_default();
            match v8_figures(&client, &admin, &t.url).await {
                Ok(v) => Some(v),
                Err(e) => {
                    skipped.push(format!("filter throughput inside V8: {e}"));
                    None
                }
            }
        }
        None => None,
    };
    drop(fleets);
    Ok(Overhead {
        rows,
        crowded,
        v8,
        local_decision_fraction,
        module_local_decision_fraction,
        latency_bars,
    })
}

/// Sends 16 KB and then 200 KB bodies through kvroute's Envoy and divides their bytes by the
/// hashing time the filter recorded for them ([`kvroute_bench::filter_v8::parse_in_v8`]).
async fn v8_figures(client: &HttpClient, admin: &str, base: &str) -> anyhow::Result<V8Figures> {
    let sizes = [(16_384usize, 300usize), (204_800, 100)];
    let out = kvroute_bench::filter_v8::parse_in_v8(client, admin, base, &sizes).await?;
    for v in out.iter().flatten() {
        eprintln!(
            "[filter-v8] {} B: {} bodies, {:.1} µs each, {:.0} MB/s",
            v.bytes, v.bodies, v.us_per_body, v.mb_per_s
        );
    }
    let figure = |i: usize| out.get(i).copied().flatten();
    Ok(V8Figures {
        mb_per_s_16k: figure(0).map(|v| v.mb_per_s),
        us_16k: figure(0).map(|v| v.us_per_body),
        mb_per_s_200k: figure(1).map(|v| v.mb_per_s),
        us_200k: figure(1).map(|v| v.us_per_body),
    })
}

/// The aiperf workloads: `(name, workload, concurrency, output tokens)`.
fn quality_workloads(scale: f64) -> Vec<(&'static str, AiperfWorkload, usize, usize)> {
    let scaled = |n: usize| ((n as f64 * scale).round() as usize).max(1);
    vec![
        (
            "shared-prefix",
            AiperfWorkload::SharedPrefix {
                groups: 64,
                prefix_tokens: 8_000,
                question_tokens: 64,
                requests: scaled(512),
            },
            32,
            64,
        ),
        (
            "multi-turn",
            AiperfWorkload::MultiTurn {
                sessions: scaled(32),
                turns: 6,
                system_prompt_tokens: 200,
                message_tokens: 400,
            },
            32,
            32,
        ),
    ]
}

/// Who routes a quality run.
#[derive(Debug, Clone, Copy)]
enum QualityRouter {
    Envoy(RouterKind),
    /// kvroute deciding in the proxy (`decision: local`), against the route call of
    /// `Envoy(RouterKind::Kvroute)` on the same workload (issue #15's quality bar).
    KvrouteLocal,
    /// The same local decisions by kvroute's Envoy dynamic module (`filter/envoy-module`),
    /// on the table's seed only.
    KvrouteModule,
    Peer(Peer),
}

impl QualityRouter {
    fn label(self) -> &'static str {
        match self {
            QualityRouter::Envoy(k) => k.label(),
            QualityRouter::KvrouteLocal => LOCAL,
            QualityRouter::KvrouteModule => MODULE,
            QualityRouter::Peer(p) => p.label(),
        }
    }
}

/// aiperf's seed for every router's first run of a workload (the quality table's rows).
const QUALITY_SEED: u64 = 7;

async fn quality_section(
    args: &Args,
    tools: &Tools,
    out_dir: &std::path::Path,
    skipped: &mut Vec<String>,
) -> anyhow::Result<QualityRuns> {
    let mut routers = vec![
        QualityRouter::Envoy(RouterKind::Kvroute),
        QualityRouter::KvrouteLocal,
    ];
    match kvroute_harness::locate_envoy_module() {
        Ok(_) => routers.push(QualityRouter::KvrouteModule),
        Err(e) => skipped.push(format!("quality via {MODULE}: {e} (make envoy-module)")),
    }
    routers.push(QualityRouter::Envoy(RouterKind::RoundRobin));
    if !args.no_peers {
        routers.extend(Peer::ALL.map(QualityRouter::Peer));
    }
    let mut runs = QualityRuns::default();
    let mut cdf_series = Vec::new();
    for (name, workload, concurrency, output_tokens) in quality_workloads(args.quality_scale) {
        let run = |router, seed| QualityRun {
            router,
            name,
            workload: workload.clone(),
            concurrency,
            output_tokens,
            seed,
        };
        for &router in &routers {
            let Some(row) = run(router, QUALITY_SEED)
                .measure(args, tools, out_dir, skipped)
                .await?
            else {
                continue;
            };
            let n = row.ttft_samples_ms.len().max(1) as f64;
            cdf_series.push((
                format!("{} {name}", row.router),
                row.ttft_samples_ms
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (*t, (i + 1) as f64 / n))
                    .collect::<Vec<_>>(),
            ));
            runs.table.push(row);
        }
        // The pair again on the next seeds, the order alternated so a drifting machine falls
        // on both alike.
        let pair = [
            QualityRouter::Envoy(RouterKind::Kvroute),
            QualityRouter::KvrouteLocal,
        ];
        for repeat in 1..args.quality_runs {
            let seed = QUALITY_SEED + repeat as u64;
            let order = if repeat % 2 == 1 {
                [pair[1], pair[0]]
            } else {
                pair
            };
            for router in order {
                if let Some(row) = run(router, seed)
                    .measure(args, tools, out_dir, skipped)
                    .await?
                {
                    runs.repeats.push(row);
                }
            }
        }
    }
    if !cdf_series.is_empty() {
        let svg = line_chart_axes(
            "TTFT CDF (aiperf, cold 8-replica fleets)",
            "TTFT ms",
            "fraction",
            &cdf_series,
            true,
            false,
        );
        std::fs::write(out_dir.join("quality-ttft-cdf.svg"), svg)?;
    }
    Ok(runs)
}

/// One aiperf run of a quality workload on a cold 8-replica fleet.
struct QualityRun {
    router: QualityRouter,
    name: &'static str,
    workload: AiperfWorkload,
    concurrency: usize,
    output_tokens: usize,
    seed: u64,
}

impl QualityRun {
    /// Starts the fleet (and the peer), runs aiperf, reads the replicas' hit rate. `None` (and
    /// a line in `skipped`) when the peer would not start or aiperf failed.
    async fn measure(
        self,
        args: &Args,
        tools: &Tools,
        out_dir: &std::path::Path,
        skipped: &mut Vec<String>,
    ) -> anyhow::Result<Option<QualityRow>> {
        let (name, router) = (self.name, self.router);
        let label = router.label();
        let mut cfg = FleetConfig::new(&format!("bench-quality-{label}"));
        cfg.replicas = 8;
        cfg.model = bench::MODEL.to_string();
        cfg.router = match router {
            QualityRouter::Envoy(k) => k,
            QualityRouter::KvrouteLocal => {
                cfg.plugin_config = json!({"decision": "local"});
                RouterKind::Kvroute
            }
            QualityRouter::KvrouteModule => {
                cfg.plugin_config = json!({"decision": "local"});
                cfg.envoy_module = true;
                RouterKind::Kvroute
            }
            // Peers stand in front of the replicas themselves; the fleet's Envoy is idle.
            QualityRouter::Peer(_) => RouterKind::RoundRobin,
        };
        cfg.sim_args = vec!["--speed".into(), args.speed.to_string()];
        let seed = self.seed;
        eprintln!(
            "[quality] {name} via {label} (aiperf seed {seed}): starting 8 cold replicas ..."
        );
        let fleet = Fleet::start(cfg, tools).await?;
        let peer = match router {
            QualityRouter::Peer(p) => {
                match PeerRouter::start(
                    p,
                    &fleet.replica_addresses(),
                    &fleet.log_dir,
                    fleet.client(),
                )
                .await
                {
                    Ok(r) => Some(r),
                    Err(e) => {
                        skipped.push(format!("quality {name} via {label}: {e}"));
                        return Ok(None);
                    }
                }
            }
            QualityRouter::Envoy(_)
            | QualityRouter::KvrouteLocal
            | QualityRouter::KvrouteModule => None,
        };
        let url = peer.as_ref().map_or_else(|| fleet.url(), |p| p.url.clone());
        // The table's runs keep the directories they always had.
        let dir = if seed == QUALITY_SEED {
            format!("{name}-{label}")
        } else {
            format!("{name}-{label}-seed{seed}")
        };
        let run = AiperfRun {
            url,
            model: bench::MODEL.to_string(),
            workload: self.workload,
            concurrency: self.concurrency,
            output_tokens: self.output_tokens,
            seed,
            artifact_dir: out_dir.join("aiperf").join(dir),
            timeout: Duration::from_secs(300),
        };
        let t0 = Instant::now();
        let result = tokio::task::spawn_blocking(move || run.run()).await?;
        let figures: AiperfFigures = match result {
            Ok(f) => f,
            Err(e) => {
                eprintln!("[quality] {name} via {label}: aiperf failed: {e}");
                skipped.push(format!("quality {name} via {label} (seed {seed}): {e}"));
                return Ok(None);
            }
        };
        let (hits, queries) = fleet.prefix_cache_totals().await?;
        drop(peer);
        drop(fleet);
        let hit = if queries > 0.0 { hits / queries } else { 0.0 };
        eprintln!(
            "[quality] {name} via {label} (seed {seed}): TTFT p50 {:.0} ms p99 {:.0} ms, {:.0} tok/s, hit {:.1}%, {} ok / {} errors ({:.0} s)",
            figures.ttft_ms_p50,
            figures.ttft_ms_p99,
            figures.output_tokens_per_s,
            hit * 100.0,
            figures.completed,
            figures.errors,
            t0.elapsed().as_secs_f64()
        );
        Ok(Some(QualityRow {
            router: label.to_string(),
            workload: name.to_string(),
            ttft_ms: P50P99 {
                p50: figures.ttft_ms_p50,
                p99: figures.ttft_ms_p99,
            },
            itl_ms: P99 {
                p99: figures.itl_ms_p99,
            },
            output_tokens_per_s: figures.output_tokens_per_s,
            prefix_hit_rate: hit,
            requests: figures.completed + figures.errors,
            errors: figures.errors,
            load_generator: "aiperf 0.13.0".into(),
            aiperf_seed: seed,
            ttft_samples_ms: figures.ttft_samples_ms,
        }))
    }
}

/// Prints the quality table with ratios to round robin side by side.
fn print_quality(quality: &[QualityRow], speed: f64) {
    println!(
        "\n== routing quality (aiperf, 8 cold vllm-sim replicas each, default profile, speed {speed}) =="
    );
    println!(
        "{:<15}{:<14}{:>9}{:>9}{:>8}{:>10}{:>7}{:>10}{:>9}{:>9}{:>6}",
        "router",
        "workload",
        "TTFT p50",
        "TTFT p99",
        "ITL p99",
        "out tok/s",
        "hit",
        "tok/s÷RR",
        "p50 RR÷",
        "p99 RR÷",
        "err"
    );
    for q in quality {
        let rr = quality
            .iter()
            .find(|b| b.router == "round-robin" && b.workload == q.workload);
        let (tput, p50, p99) = rr.map_or(("-".into(), "-".into(), "-".into()), |b| {
            (
                ratio(q.output_tokens_per_s, b.output_tokens_per_s),
                ratio(b.ttft_ms.p50, q.ttft_ms.p50),
                ratio(b.ttft_ms.p99, q.ttft_ms.p99),
            )
        });
        println!(
            "{:<15}{:<14}{:>9.0}{:>9.0}{:>8.1}{:>10.0}{:>6.1}%{:>10}{:>9}{:>9}{:>6}",
            q.router,
            q.workload,
            q.ttft_ms.p50,
            q.ttft_ms.p99,
            q.itl_ms.p99,
            q.output_tokens_per_s,
            q.prefix_hit_rate * 100.0,
            tput,
            p50,
            p99,
            q.errors
        );
    }
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

/// The scale section's figures: the control plane per fleet size, the parser alone, and one
/// locally deciding proxy VM's memory per fleet size.
struct ScaleFigures {
    rows: Vec<kvroute_bench::scale::ScaleRow>,
    parse: Option<kvroute_bench::scale::ParseCost>,
    vm_memory: Vec<kvroute_bench::vm_memory::VmMemoryRow>,
}

/// KV capacity of the VM-memory figure's endpoints: the payload's `vllm:cache_config_info`
/// (29,127 blocks of 16 tokens, Llama-3.1-8B on one 80 GB GPU).
const VM_MEMORY_CAPACITY_TOKENS: u64 = 29_127 * 16;

/// The scale section: each part skipped (and said so) when its sizes are empty or it fails.
async fn scale_section(
    args: &Args,
    tools: &Tools,
    client: &HttpClient,
    out_dir: &std::path::Path,
    skipped: &mut Vec<String>,
) -> ScaleFigures {
    let mut figures = ScaleFigures {
        rows: Vec::new(),
        parse: None,
        vm_memory: Vec::new(),
    };
    if args.scale.iter().any(|&n| n > 0) {
        match kvroute_bench::scale::parse_cost() {
            Ok(parse) => figures.parse = Some(parse),
            Err(e) => skipped.push(format!("scale parse cost: {e:#}")),
        }
        eprintln!(
            "[scale] one control plane scraping {:?} endpoints ...",
            args.scale
        );
        let window = Duration::from_secs(10);
        match kvroute_bench::scale::run(tools, client, out_dir, &args.scale, window).await {
            Ok(rows) => figures.rows = rows,
            Err(e) => skipped.push(format!("scale: {e:#}")),
        }
    }
    let sizes: Vec<usize> = args.vm_memory.iter().copied().filter(|&n| n > 0).collect();
    if !sizes.is_empty() {
        eprintln!("[scale] proxy VM memory (decision: local) over {sizes:?} endpoints ...");
        let module = FilterModule::from_file(&tools.wasm);
        let bounds = [0, args.vm_max_index_blocks];
        let runs = bounds
            .iter()
            .enumerate()
            .filter(|&(i, &b)| i == 0 || b > 0)
            .flat_map(|(_, &b)| sizes.iter().map(move |&n| (n, b)));
        for (n, bound) in runs {
            let row = module.as_ref().map_err(|e| e.to_string()).and_then(|m| {
                kvroute_bench::vm_memory::vm_memory(m, n, VM_MEMORY_CAPACITY_TOKENS, 1.25, bound)
                    .map_err(|e| e.to_string())
            });
            match row {
                Ok(row) => {
                    eprintln!("[scale] {row:?}");
                    figures.vm_memory.push(row);
                }
                Err(e) => skipped.push(format!("vm memory ({n} endpoints): {e}")),
            }
        }
    }
    figures
}

fn print_scale(figures: &ScaleFigures) {
    if let Some(p) = &figures.parse {
        println!(
            "\n== reading one vLLM 0.33-shaped /metrics payload ({} B), in process ==\n\
             every line (load metrics, then again for LoRA): {:.1} us; \
             the scrape path (only the series read): {:.1} us",
            p.payload_bytes, p.every_line_us, p.scrape_path_us
        );
    }
    let rows = &figures.rows;
    if !rows.is_empty() {
        println!(
            "\n== control plane at scale (vLLM 0.33-shaped /metrics, scraped every {} ms; no traffic) ==",
            rows[0].scrape_interval_ms
        );
        println!(
            "{:>10} {:>11} {:>8} {:>10} {:>8} {:>10} {:>12} {:>9} {:>14} {:>12} {:>12} {:>14}",
            "endpoints",
            "page",
            "page B",
            "scrapes/s",
            "usable",
            "CPU cores",
            "CPU ms/scrape",
            "RSS MiB",
            "whole table B",
            "delta B rest",
            "delta B busy",
            "sync CPU/copy"
        );
        for r in rows {
            println!(
                "{:>10} {:>11} {:>8} {:>10.0} {:>8} {:>10.3} {:>12.3} {:>9.1} {:>14} {:>12.0} {:>12.0} {:>14.4}",
                r.endpoints,
                r.page,
                r.payload_bytes,
                r.scrapes_per_s,
                r.usable_endpoints,
                r.cpu_cores,
                r.cpu_ms_per_scrape,
                r.rss_mib,
                r.sync_answer_bytes,
                r.sync_delta_idle_bytes,
                r.sync_delta_busy_bytes,
                r.sync_cpu_cores_per_copy
            );
        }
        let tick_ms = scorer_core::sync::DEFAULT_SYNC_INTERVAL_MS;
        println!(
            "(sync answers per {tick_ms} ms tick: the whole table, what every tick carried before \
             deltas and what a copy naming no table still gets; the mean steady delta over {} \
             ticks, fleet at rest and with every scrape's numbers moving; the control plane's \
             CPU per copy syncing on the busy fleet, in cores, from {} copies at once)",
            kvroute_bench::scale::STEADY_TICKS,
            kvroute_bench::scale::SYNC_COPIES
        );
        let largest = rows.iter().map(|r| r.endpoints).max().unwrap_or(0);
        for last in rows.iter().filter(|r| r.endpoints == largest) {
            let replicas = 1_000;
            let (cores, [whole, rest, busy]) = kvroute_bench::scale::extrapolate(last, replicas);
            println!(
                "{replicas:>10} (scaled from {} endpoints, {} page): {cores:.2} cores scraping \
                 every {} ms, {:.2} at 1 s; sync per copy at {tick_ms} ms: whole tables {:.2} MB/s, \
                 deltas {:.2} MB/s at rest, {:.2} MB/s busy, costing {:.3} cores per copy",
                last.endpoints,
                last.page,
                last.scrape_interval_ms,
                cores * last.scrape_interval_ms as f64 / 1_000.0,
                whole / 1e6,
                rest / 1e6,
                busy / 1e6,
                kvroute_bench::scale::sync_cores_per_copy(last, replicas)
            );
        }
    }
    if !figures.vm_memory.is_empty() {
        println!(
            "\n== one proxy VM deciding locally (release .wasm in wasmtime; index filled to 1.25x \
             each endpoint's KV capacity of {} tokens) ==",
            VM_MEMORY_CAPACITY_TOKENS
        );
        println!(
            "{:>10} {:>16} {:>14} {:>13} {:>12} {:>12} {:>12} {:>14}",
            "endpoints",
            "max_index_blocks",
            "bound blk/ep",
            "index blocks",
            "index MB",
            "empty VM MB",
            "VM MB",
            "16 workers MB"
        );
        for r in &figures.vm_memory {
            println!(
                "{:>10} {:>16} {:>14} {:>13} {:>12.1} {:>12.1} {:>12.1} {:>14.0}",
                r.endpoints,
                r.max_index_blocks,
                r.bound_blocks_per_endpoint,
                r.index_blocks,
                r.index_bytes_native as f64 / 1e6,
                r.empty_vm_bytes as f64 / 1e6,
                r.vm_bytes as f64 / 1e6,
                16.0 * r.vm_bytes as f64 / 1e6
            );
        }
        println!(
            "(512 endpoints: one router holds at most {} (scorer_core::index::MAX_ENDPOINTS), so \
             512 replicas are two pools, each its own route and control plane: two copies per \
             worker, twice the 256 row if both pools are busy)",
            scorer_core::index::MAX_ENDPOINTS
        );
    }
}

/// Rounds of the max-rps run: every target once a round, in turn, and each target's median
/// round reported. A single run of a few seconds per target, one target after another, moved
/// the local path's share of plain Envoy's req/s between 72 and 89 % over runs of the same
/// data path, as the machine's load drifted between the two rows.
const MAX_RPS_ROUNDS: usize = 3;

/// One target's max-rps run: req/s, each process's CPU per request, errors.
#[derive(Debug, Clone, Copy)]
struct Run {
    rps: f64,
    envoy_cpu: Option<f64>,
    router_cpu: Option<f64>,
    errors: usize,
}

/// One target's figure over [`MAX_RPS_ROUNDS`] runs: the median of each, every round's
/// errors, and each round's req/s in order.
#[derive(Debug, Clone, Copy)]
struct MaxRps {
    rps: f64,
    rounds: [f64; MAX_RPS_ROUNDS],
    envoy_cpu: Option<f64>,
    router_cpu: Option<f64>,
    errors: usize,
}

/// Runs [`MAX_RPS_ROUNDS`] closed-loop runs of `args.load_seconds` per target, interleaved
/// (round 1 over every target, then round 2, ...), so a drift in the machine's load falls on
/// every row alike.
async fn max_rps_rounds(
    targets: &[Target],
    urls: &[String],
    bodies: &Arc<Vec<String>>,
    args: &Args,
) -> Vec<Option<MaxRps>> {
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); targets.len()];
    for round in 0..MAX_RPS_ROUNDS {
        for (i, (t, url)) in targets.iter().zip(urls).enumerate() {
            let (r, [envoy, router]) = bench::http_load_cpu(
                url,
                bodies.clone(),
                args.concurrency,
                Duration::from_secs(args.load_seconds),
                [t.envoy_pid, t.router_pid],
            )
            .await;
            eprintln!(
                "[overhead] max rps round {round} {}: {:.0} req/s, Envoy {envoy:?} µs/request",
                t.label, r.rps
            );
            runs[i].push(Run {
                rps: r.rps,
                envoy_cpu: envoy,
                router_cpu: router,
                errors: r.errors,
            });
        }
    }
    runs.into_iter()
        .map(|rounds| {
            Some(MaxRps {
                rps: median(rounds.iter().map(|r| Some(r.rps)))?,
                rounds: std::array::from_fn(|i| rounds[i].rps),
                envoy_cpu: median(rounds.iter().map(|r| r.envoy_cpu)),
                router_cpu: median(rounds.iter().map(|r| r.router_cpu)),
                errors: rounds.iter().map(|r| r.errors).sum(),
            })
        })
        .collect()
}
