//! The filter's parse and hash time inside Envoy's V8, alone: one Envoy with the release
//! filter deciding locally in front of one fast replica, sequential 1, 16 and 200 KB chat
//! bodies, and the mean of the filter's own `kvroute_hash_duration_us` histogram over them
//! (the `make bench` figure, without the rest of the bench).
//!
//! `cargo run --release -p kvroute-bench --example v8_hash` after `make wasm build`
//! (`$KVROUTE_WASM` names another module to compare).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvroute_bench as bench;
use kvroute_harness::{self as harness, Fleet, FleetConfig, HttpClient, Tools};
use serde_json::json;

/// Envoy merges histograms into its admin view on each stats flush (every 5 s).
const FLUSH: Duration = Duration::from_millis(5_500);

/// `(sum µs, count)` of the hashing histogram in Envoy's Prometheus output.
async fn histogram(client: &HttpClient, admin: &str) -> anyhow::Result<(f64, f64)> {
    let url = format!("http://{admin}/stats/prometheus");
    let body = client.get(&url, Duration::from_secs(5)).await?.body;
    Ok((
        harness::prometheus_sum(&body, "kvroute_hash_duration_us_sum"),
        harness::prometheus_sum(&body, "kvroute_hash_duration_us_count"),
    ))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let tools = Tools::locate().context("v8_hash needs the harness's tools")?;
    let mut cfg = FleetConfig::new("v8-hash");
    cfg.replicas = 1;
    cfg.model = bench::MODEL.to_string();
    cfg.plugin_config = json!({"decision": "local"});
    cfg.sim_args = ["--profile", "fast"].map(String::from).to_vec();
    let fleet = Fleet::start(cfg, &tools).await?;
    let client = fleet.client().clone();
    let admin = fleet.envoy.admin_address.clone();
    let url = format!("{}/v1/chat/completions", fleet.url());
    for (size, n) in [(1_024usize, 2_000usize), (16_384, 600), (204_800, 200)] {
        let bodies: Vec<String> = (0..16)
            .map(|s| bench::chat_body(size, 100 + s, 1, false))
            .collect();
        let mean_len = bodies.iter().map(String::len).sum::<usize>() as f64 / bodies.len() as f64;
        // Settle: the count must stay put across a flush so earlier bodies are not counted.
        let mut before = histogram(&client, &admin).await?;
        for _ in 0..4 {
            tokio::time::sleep(FLUSH).await;
            let now = histogram(&client, &admin).await?;
            if now.1 == before.1 {
                break;
            }
            before = now;
        }
        let r = bench::http_load(&url, Arc::new(bodies), 1, Duration::from_secs(60), n).await;
        let sent = (r.latencies_ms.len() + r.errors) as f64;
        let mut after = before;
        for _ in 0..6 {
            tokio::time::sleep(FLUSH).await;
            after = histogram(&client, &admin).await?;
            if after.1 - before.1 >= sent {
                break;
            }
        }
        let bodies = after.1 - before.1;
        anyhow::ensure!(bodies > 0.0, "no body was timed at {size} B");
        let us = (after.0 - before.0) / bodies;
        println!(
            "{size} B: {us:.1} µs per body, {:.0} MB/s ({bodies} bodies)",
            mean_len / us
        );
    }
    Ok(())
}
