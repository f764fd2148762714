//! Where Envoy's CPU per request goes with the kvroute filter: the same 1 KB chat request, at
//! the max-rps run's concurrency (16), through Envoy configured as round robin, as kvroute's
//! Envoy with the wasm filter disabled (`HttpFilter.disabled`), with a proxy-wasm filter that
//! does nothing in its place (tests/noop-filter), and deciding in the proxy (`decision:
//! local`); and a path kvroute's filter passes through (`POST /tokenize`).
//!
//! `cargo run --release -p kvroute-bench --example envoy_cost -- [rounds] [seconds] [label]
//! [path] [workers] [stream_tokens]` after `make wasm build`. Prints Envoy's CPU µs per served
//! request and req/s per variant. `workers` is Envoy's worker count (2): with `decision: local`
//! each worker's VM applies every other VM's decisions, so the local path's CPU per request
//! grows with it. `label` and `path` keep only the variants whose label contains `label`, on
//! `path` (to run `perf record -p <Envoy pid>` beside one: the pid is printed on stderr).
//! `path` `idle` sends nothing and prints each Envoy's CPU over `seconds` as a share of a core
//! (with `decision: local` each worker syncs every 25 ms whether or not requests come).
//! `stream_tokens` above 0 streams that many tokens per request from a replica slowed fifty
//! times (`--speed 0.02`: a token every millisecond or two), so each token is its own body
//! chunk in Envoy, as a real engine's are: what a filter pays per chunk. With `KVROUTE_WASM_ALT` naming another
//! build of the filter, it runs as one more variant in the same rounds.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvroute_bench as bench;
use kvroute_harness::{Fleet, FleetConfig, RouterKind, Tools};
use serde_json::json;

/// The edit that keeps the wasm filter configured but off for every route (Envoy's
/// `HttpFilter.disabled`), so the rest of kvroute's Envoy configuration is measured alone.
const DISABLE_WASM: (&str, &str) = (
    "- name: envoy.filters.http.wasm\n            typed_config:",
    "- name: envoy.filters.http.wasm\n            disabled: true\n            typed_config:",
);

/// The row of kvroute as an Envoy dynamic module (`make envoy-module`), when it is built.
const MODULE: &str = "kvroute dynamic module";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(3);
    let seconds: u64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(4);
    let only = args.next().unwrap_or_default();
    let only_path = args.next().filter(|p| !p.is_empty());
    let workers: u32 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(2);
    let stream_tokens: u32 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(0);
    let tools = Tools::locate().context("envoy_cost needs the harness's tools")?;
    let disable = (DISABLE_WASM.0.to_string(), DISABLE_WASM.1.to_string());
    let mut variants = bench::envoy_variants(&tools.wasm)?;
    variants.insert(
        1,
        (
            "kvroute config, wasm off",
            RouterKind::Kvroute,
            Some(disable),
        ),
    );
    if kvroute_harness::locate_envoy_module().is_ok() {
        variants.push((MODULE, RouterKind::Kvroute, None));
    }
    let mut fleets = Vec::new();
    for (label, router, edit) in variants {
        if !label.contains(only.as_str()) {
            continue;
        }
        let mut cfg = FleetConfig::new(&format!("envoy-cost-{}", fleets.len()));
        cfg.replicas = 1;
        cfg.envoy_concurrency = workers;
        cfg.model = bench::MODEL.to_string();
        cfg.router = router;
        cfg.envoy_edits = edit.into_iter().collect();
        cfg.envoy_module = label == MODULE;
        cfg.plugin_config = json!({"decision": "local"});
        cfg.sim_args = bench::overhead_sim_args();
        if stream_tokens > 0 {
            cfg.sim_args
                .extend(["--speed".to_string(), "0.02".to_string()]);
        }
        fleets.push((label, Fleet::start(cfg, &tools).await?));
    }
    let bodies = Arc::new(
        (0..32)
            .map(|s| bench::chat_body(1_024, s, stream_tokens.max(1), stream_tokens > 0))
            .collect::<Vec<_>>(),
    );
    if only_path.as_deref() == Some("idle") {
        // No traffic: what each Envoy spends on its own (with `decision: local`, each worker's
        // sync every `sync_interval_ms`).
        for round in 0..rounds {
            for (label, fleet) in &fleets {
                let pid = fleet.envoy.process().pid();
                let before = bench::scale::cpu_seconds(pid)?;
                tokio::time::sleep(Duration::from_secs(seconds)).await;
                let used = bench::scale::cpu_seconds(pid)? - before;
                println!(
                    "round {round} idle {label:<26} Envoy {:>5.2} % of a core",
                    used * 100.0 / seconds as f64
                );
            }
        }
        return Ok(());
    }
    for round in 0..rounds {
        for path in ["/v1/chat/completions", "/tokenize"] {
            if only_path.as_deref().is_some_and(|p| p != path) {
                continue;
            }
            for (label, fleet) in &fleets {
                let url = format!("{}{path}", fleet.url());
                let pid = fleet.envoy.process().pid();
                eprintln!("[envoy_cost] Envoy pid {pid} runs {label} on {path}");
                let _ =
                    bench::http_load(&url, bodies.clone(), 16, Duration::from_secs(1), 50).await;
                let (r, [envoy]) = bench::http_load_cpu(
                    &url,
                    bodies.clone(),
                    16,
                    Duration::from_secs(seconds),
                    [Some(pid)],
                )
                .await;
                let envoy = envoy.context("Envoy's CPU time is unreadable")?;
                println!(
                    "round {round} {path:<22} {label:<26} Envoy {envoy:>6.1} µs/request {:>7.0} req/s errors {}",
                    r.rps, r.errors
                );
            }
        }
    }
    Ok(())
}
