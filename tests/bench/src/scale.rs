//! What one control plane spends per replica as the fleet grows (issue #15, point 5).
//!
//! Each row serves a vLLM 0.33-shaped `/metrics` payload (`fixtures/vllm-0.33-metrics.txt`,
//! 58 KB: every series vLLM registers by default, histograms and `_created` lines included;
//! `scripts/vllm_metrics_payload.py` writes it from vLLM's wheel) from `n` loopback listeners
//! in this process, points a release control plane at them with the default scrape interval,
//! and reads the control plane's own CPU time and RSS from `/proc` over a window, with its
//! scrape counters for how many scrapes that bought. It also syncs as proxy copies do, for the
//! bytes state sync costs: a copy naming no endpoint table (the whole table, which every tick
//! carried before deltas), then a copy syncing at the filter's default interval for [`STEADY_TICKS`] ticks (the steady delta), with
//! the fleet at rest and then with every scrape's numbers moving. No traffic is routed: this
//! is the fleet's standing cost, which grows with replicas. [`parse_cost`] times the parser
//! alone, in process.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use kvroute_harness::{self as harness, HttpClient, ManagedProcess, Tools};
use serde::Serialize;
use serde_json::json;

use crate::metrics_fleet::MetricsFleet;

/// The recorded-shape payload every listener serves.
pub const VLLM_PAYLOAD: &str = include_str!("../fixtures/vllm-0.33-metrics.txt");

/// One fleet size.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleRow {
    /// Scrape targets.
    pub endpoints: usize,
    /// The page scraped: `whole` (`/metrics`; the listeners do not serve `/metrics/`, so the
    /// control plane falls back to it, as it scraped before asking for its series) or
    /// `restricted` (`/metrics/?name[]=…`, only the series the router reads).
    pub page: &'static str,
    /// Bytes of one `/metrics` answer.
    pub payload_bytes: usize,
    /// The control plane's `scrape_interval_ms` (its default).
    pub scrape_interval_ms: u64,
    /// Successful scrapes per second over the window (`n` x 1000 / interval if it keeps up).
    pub scrapes_per_s: f64,
    /// Endpoints the control plane considered usable at the end (all of them if scrapes keep up).
    pub usable_endpoints: usize,
    /// Control-plane CPU over the window, in cores.
    pub cpu_cores: f64,
    /// CPU per successful scrape (fetch, parse, apply), milliseconds.
    pub cpu_ms_per_scrape: f64,
    /// Control-plane resident memory at the end, MiB.
    pub rss_mib: f64,
    /// `/v1/sync` answer to a synced copy naming no endpoint table (an older filter), which
    /// carries the whole table and the config: what every tick carried before deltas, bytes.
    pub sync_answer_bytes: usize,
    /// That answer at the default sync interval, per proxy copy (one per Envoy worker).
    pub sync_bytes_per_s_per_copy: f64,
    /// Mean answer to a copy syncing at the default interval and naming the table it holds,
    /// fleet at rest (same numbers every scrape: only the re-sends of unchanged scrapes), bytes.
    pub sync_delta_idle_bytes: f64,
    /// The same with every scrape's numbers moving (a busy fleet: each scrape is a change).
    pub sync_delta_busy_bytes: f64,
    /// Control-plane CPU per copy syncing at the default interval on the busy fleet, in cores:
    /// [`SYNC_COPIES`] copies sync at once for the window and the scraping's own CPU rate
    /// (`cpu_cores`) is taken off.
    pub sync_cpu_cores_per_copy: f64,
}

/// Copies syncing at once while the sync CPU is measured (4 Envoys x 4 workers).
pub const SYNC_COPIES: usize = 16;

/// In-process cost of reading one payload, µs (the median of several timed runs).
#[derive(Debug, Clone, Serialize)]
pub struct ParseCost {
    /// Bytes of the payload.
    pub payload_bytes: usize,
    /// The scraper before it read only its series: UTF-8 check, every line parsed and checked
    /// for the load metrics, and every line parsed again for the LoRA series.
    pub every_line_us: f64,
    /// The scrape path: one UTF-8 check, then only the lines of the series read (load
    /// metrics, then the LoRA series), every other line skipped after its name.
    pub scrape_path_us: f64,
}

/// Times both ways of reading [`VLLM_PAYLOAD`].
pub fn parse_cost() -> anyhow::Result<ParseCost> {
    use vllm_wire::prom::{parse_vllm_metrics_bytes, samples, samples_named, scrape_vllm_metrics};
    const LORA: [&str; 1] = ["vllm:lora_requests_info"];
    let body = VLLM_PAYLOAD.as_bytes();
    let time = |f: &dyn Fn() -> anyhow::Result<usize>| -> anyhow::Result<f64> {
        const ITERS: u32 = 400;
        let mut runs = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            let mut sink = 0;
            for _ in 0..ITERS {
                sink += std::hint::black_box(f()?);
            }
            std::hint::black_box(sink);
            runs.push(t.elapsed().as_secs_f64() * 1e6 / f64::from(ITERS));
        }
        runs.sort_by(f64::total_cmp);
        Ok(runs[runs.len() / 2])
    };
    let every_line_us = time(&|| {
        let m = parse_vllm_metrics_bytes(body)?;
        let text = std::str::from_utf8(body)?;
        let lora = samples(text)
            .filter_map(Result::ok)
            .filter(|s| s.name == LORA[0])
            .count();
        Ok(m.running as usize + lora)
    })?;
    let scrape_path_us = time(&|| {
        let text = std::str::from_utf8(body)?;
        let m = scrape_vllm_metrics(text)?;
        let lora = samples_named(text, &LORA).filter_map(Result::ok).count();
        Ok(m.running as usize + lora)
    })?;
    Ok(ParseCost {
        payload_bytes: body.len(),
        every_line_us,
        scrape_path_us,
    })
}

/// Default scrape interval (`control-plane/src/config.rs`).
const SCRAPE_INTERVAL_MS: u64 = 100;
/// Default sync interval of a locally deciding copy (the filter's `sync_interval_ms`).
const SYNC_INTERVAL_MS: f64 = scorer_core::sync::DEFAULT_SYNC_INTERVAL_MS as f64;

/// Measures each fleet size in `sizes` over `window`.
pub async fn run(
    tools: &Tools,
    client: &HttpClient,
    out_dir: &Path,
    sizes: &[usize],
    window: Duration,
) -> anyhow::Result<Vec<ScaleRow>> {
    let mut rows = Vec::new();
    let restricted_bytes =
        vllm_wire::prom::restrict_page(VLLM_PAYLOAD, &vllm_wire::prom::SCRAPED_SERIES).len();
    let pages = [
        ("whole", VLLM_PAYLOAD.len()),
        ("restricted", restricted_bytes),
    ];
    for (&n, (page, payload_bytes)) in sizes.iter().flat_map(|n| pages.iter().map(move |p| (n, p)))
    {
        let fleet = MetricsFleet::start_serving(n, VLLM_PAYLOAD.to_string(), *page == "restricted")
            .await
            .context("cannot bind the metrics listeners")?;
        let api = harness::free_port()?;
        let admin = harness::free_port()?;
        let yaml = harness::control_plane_yaml(
            api,
            admin,
            SCRAPE_INTERVAL_MS,
            &fleet.addresses,
            &json!({}),
        )?;
        let cfg = out_dir.join(format!("control-plane-scale-{n}.yaml"));
        std::fs::write(&cfg, yaml)?;
        let mut cmd = Command::new(&tools.control_plane);
        cmd.arg("--config").arg(&cfg).env("RUST_LOG", "warn");
        let mut proc =
            ManagedProcess::spawn_logged_in(&format!("control-plane-scale-{n}"), cmd, out_dir)?;
        let metrics_url = format!("http://127.0.0.1:{admin}/metrics");
        let scrapes_ok = async || -> anyhow::Result<f64> {
            let text = client.get(&metrics_url, Duration::from_secs(5)).await?.body;
            Ok(harness::prometheus_sum_with(
                &text,
                "kvroute_scrapes_total",
                "result=\"ok\"",
            ))
        };
        // Warm-up: every endpoint scraped a few times.
        crate::wait_while_running(
            &mut proc,
            "control plane",
            Duration::from_secs(20),
            Duration::from_millis(200),
            async || (scrapes_ok().await.unwrap_or(0.0) >= 3.0 * n as f64).then_some(()),
            |_| format!("the control plane did not scrape {n} endpoints 3 times in 20 s"),
        )
        .await?;
        let (cpu0, scrapes0, t0) = (
            cpu_seconds(proc.pid())?,
            scrapes_ok().await?,
            Instant::now(),
        );
        tokio::time::sleep(window).await;
        let (cpu1, scrapes1) = (cpu_seconds(proc.pid())?, scrapes_ok().await?);
        let elapsed = t0.elapsed().as_secs_f64();
        let cpu_s = cpu1 - cpu0;
        let scrapes = scrapes1 - scrapes0;
        let rss_mib = rss_kib(proc.pid())? / 1024.0;
        let endpoints: serde_json::Value = serde_json::from_str(
            &client
                .get(
                    &format!("http://127.0.0.1:{admin}/debug/endpoints"),
                    Duration::from_secs(5),
                )
                .await?
                .body,
        )
        .context("/debug/endpoints is not JSON")?;
        let usable = endpoints
            .as_array()
            .or_else(|| endpoints["endpoints"].as_array())
            .map_or(0, |a| {
                a.iter()
                    .filter(|e| e["health"].as_str().is_some_and(|h| h == "ready"))
                    .count()
            });
        // A fresh copy's first sync, then a synced copy's tick naming no table (nothing new in
        // the log): the whole table, as every tick carried it before deltas.
        let sync_url = format!("http://127.0.0.1:{api}/v1/sync");
        let (first, _) = sync(client, &sync_url, &json!({})).await?;
        let tick = json!({
            "replica": first["replica"], "since": first["next"], "log": first["log"],
        });
        let tick = client
            .post_json(&sync_url, &tick, Duration::from_secs(5))
            .await?;
        let idle = steady_sync_bytes(client, &sync_url, &first).await?;
        fleet.set_changing(true);
        // Every endpoint scraped with moving numbers before the copy starts counting.
        tokio::time::sleep(Duration::from_millis(3 * SCRAPE_INTERVAL_MS)).await;
        let busy = steady_sync_bytes(client, &sync_url, &first).await?;
        let sync_cpu = copies_sync_cpu(client, &sync_url, &proc, window / 2).await?;
        let sync_cpu_cores_per_copy = ((sync_cpu - cpu_s / elapsed) / SYNC_COPIES as f64).max(0.0);
        proc.kill();
        drop(fleet);
        let row = ScaleRow {
            endpoints: n,
            page,
            payload_bytes: *payload_bytes,
            scrape_interval_ms: SCRAPE_INTERVAL_MS,
            scrapes_per_s: scrapes / elapsed,
            usable_endpoints: usable,
            cpu_cores: cpu_s / elapsed,
            cpu_ms_per_scrape: if scrapes > 0.0 {
                cpu_s * 1e3 / scrapes
            } else {
                f64::NAN
            },
            rss_mib,
            sync_answer_bytes: tick.body.len(),
            sync_bytes_per_s_per_copy: tick.body.len() as f64 * 1e3 / SYNC_INTERVAL_MS,
            sync_delta_idle_bytes: idle,
            sync_delta_busy_bytes: busy,
            sync_cpu_cores_per_copy,
        };
        eprintln!("[scale] {row:?}");
        rows.push(row);
    }
    Ok(rows)
}

/// One `/v1/sync` call's answer as JSON, and its size on the wire.
async fn sync(
    client: &HttpClient,
    url: &str,
    body: &serde_json::Value,
) -> anyhow::Result<(serde_json::Value, usize)> {
    let answer = client.post_json(url, body, Duration::from_secs(5)).await?;
    if answer.status != 200 {
        bail!("/v1/sync answered {}: {}", answer.status, answer.body);
    }
    let json = serde_json::from_str(&answer.body).context("sync answer is not JSON")?;
    Ok((json, answer.body.len()))
}

/// The control plane's CPU, in cores, while [`SYNC_COPIES`] fresh copies each sync every
/// [`SYNC_INTERVAL_MS`] for `window` (scraping goes on meanwhile).
async fn copies_sync_cpu(
    client: &HttpClient,
    url: &str,
    proc: &ManagedProcess,
    window: Duration,
) -> anyhow::Result<f64> {
    let mut firsts = Vec::with_capacity(SYNC_COPIES);
    for _ in 0..SYNC_COPIES {
        firsts.push(sync(client, url, &json!({})).await?.0);
    }
    let (cpu0, t0) = (cpu_seconds(proc.pid())?, Instant::now());
    let mut copies = tokio::task::JoinSet::new();
    for first in firsts {
        let (client, url) = (client.clone(), url.to_owned());
        copies.spawn(async move {
            let mut last = first.clone();
            let mut tick = tokio::time::interval(Duration::from_millis(SYNC_INTERVAL_MS as u64));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while t0.elapsed() < window {
                tick.tick().await;
                let cursor = synced_cursor(&first, &last);
                last = sync(&client, &url, &cursor).await?.0;
            }
            anyhow::Ok(())
        });
    }
    while let Some(copy) = copies.join_next().await {
        copy??;
    }
    Ok((cpu_seconds(proc.pid())? - cpu0) / t0.elapsed().as_secs_f64())
}

/// The next sync request of a copy whose first answer was `first` and whose latest is `last`:
/// the log position it reached and the table version it holds.
fn synced_cursor(first: &serde_json::Value, last: &serde_json::Value) -> serde_json::Value {
    json!({
        "replica": first["replica"], "since": last["next"], "log": last["log"],
        "table": last["table"], "table_version": last["table_version"],
    })
}

/// Ticks a copy syncs over in [`steady_sync_bytes`] (one second at the default interval).
pub const STEADY_TICKS: usize = 40;

/// Mean answer bytes of a copy that got `first` (its whole table) and then syncs every
/// [`SYNC_INTERVAL_MS`], naming the table version each answer brought it to.
async fn steady_sync_bytes(
    client: &HttpClient,
    url: &str,
    first: &serde_json::Value,
) -> anyhow::Result<f64> {
    let mut last = first.clone();
    let mut bytes = 0;
    for _ in 0..STEADY_TICKS {
        tokio::time::sleep(Duration::from_millis(SYNC_INTERVAL_MS as u64)).await;
        let cursor = synced_cursor(first, &last);
        // A control plane from before deltas answers every tick with the whole table: that is
        // its steady state, and measured as such.
        let (answer, size) = sync(client, url, &cursor).await?;
        bytes += size;
        last = answer;
    }
    Ok(bytes as f64 / STEADY_TICKS as f64)
}

/// The row's figures scaled to `replicas` at the row's per-scrape cost and the default
/// interval: what one control plane would need for them (the router itself holds at most
/// `scorer_core::index::MAX_ENDPOINTS` endpoints, so a larger fleet is several pools). Cores
/// scraping, then sync bytes per second per copy: whole tables, steady deltas at rest, busy.
/// A busy copy's sync CPU grows with the endpoints that change: [`sync_cores_per_copy`].
pub fn extrapolate(row: &ScaleRow, replicas: usize) -> (f64, [f64; 3]) {
    let scrapes_per_s = replicas as f64 * 1e3 / row.scrape_interval_ms as f64;
    let cores = scrapes_per_s * row.cpu_ms_per_scrape / 1e3;
    let per_s =
        |bytes: f64| bytes * 1e3 / SYNC_INTERVAL_MS / row.endpoints as f64 * replicas as f64;
    let sync = [
        per_s(row.sync_answer_bytes as f64),
        per_s(row.sync_delta_idle_bytes),
        per_s(row.sync_delta_busy_bytes),
    ];
    (cores, sync)
}

/// The row's busy-fleet sync CPU per copy scaled to `replicas`, in cores.
pub fn sync_cores_per_copy(row: &ScaleRow, replicas: usize) -> f64 {
    row.sync_cpu_cores_per_copy / row.endpoints as f64 * replicas as f64
}

fn clock_ticks_per_second() -> anyhow::Result<f64> {
    let out = Command::new("getconf").arg("CLK_TCK").output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .parse()
        .with_context(|| format!("getconf CLK_TCK printed {text:?}"))
}

/// CPU seconds (user + system, all threads) `pid` has used so far: what a process costs per
/// request, read before and after a load run.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    let ticks = match TICKS.get() {
        Some(&t) => t,
        None => {
            let t = clock_ticks_per_second()?;
            *TICKS.get_or_init(|| t)
        }
    };
    Ok(cpu_ticks(pid)? as f64 / ticks)
}

/// utime + stime of `pid`, in clock ticks (`/proc/<pid>/stat` fields 14 and 15).
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name is in parentheses and may hold spaces: count fields after it.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("unreadable /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .context("short /proc stat")?
            .parse()
            .context("bad /proc stat field")
    };
    // After the name: state is field 3, so utime (14) and stime (15) are at 11 and 12.
    Ok(field(11)? + field(12)?)
}

fn rss_kib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS")
}
