//! Where a sequential request's time goes inside Envoy, with and without the kvroute filter:
//! Envoy's own access log stamps each request's stages (`%COMMON_DURATION%` from the first
//! request byte to each later point), so the latency kvroute adds over plain Envoy is split into
//! the request side (body in, filters, decision, until the request is upstream), the upstream's
//! answer, the response side, and the client-side remainder outside Envoy's timeline (the
//! loopback and whatever the worker does after the response, before it reads the next request).
//!
//! `cargo run --release -p kvroute-bench --example envoy_timing -- [samples] [bytes...]` after
//! `make wasm build` (defaults: 400 samples, 1024 and 16384 bytes). Variants: plain Envoy round
//! robin, kvroute's Envoy with the empty proxy-wasm filter (tests/noop-filter), and kvroute
//! deciding in the proxy (`decision: local`), all on 2 workers and one `fast` replica,
//! interleaved as `make bench` interleaves its rows. With `KVROUTE_WASM_ALT` naming another
//! build of the filter, that build runs as a fourth variant in the same run.

use std::path::{Path, PathBuf};

use anyhow::Context;
use kvroute_bench as bench;
use kvroute_harness::{Fleet, FleetConfig, Tools};
use serde_json::json;

/// The stamps logged, each as ns from the request's first byte (`DS_RX_BEG`), in this order.
const POINTS: [&str; 7] = [
    "DS_RX_END",
    "US_TX_BEG",
    "US_TX_END",
    "US_RX_BEG",
    "US_RX_END",
    "DS_TX_BEG",
    "DS_TX_END",
];

/// The edit that adds a file access log with [`POINTS`] to the HTTP connection manager.
fn access_log_edit(path: &Path) -> (String, String) {
    let fields: Vec<String> = POINTS
        .iter()
        .map(|p| format!("%COMMON_DURATION(DS_RX_BEG:{p}:ns)%"))
        .collect();
    let anchor = "          stat_prefix: kvroute\n";
    let log = format!(
        "{anchor}          access_log:\n          - name: envoy.access_loggers.file\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n              path: {}\n              log_format:\n                text_format_source:\n                  inline_string: \"{} %RESPONSE_CODE%\\n\"\n",
        path.display(),
        fields.join(" ")
    );
    (anchor.to_string(), log)
}

/// One access-log line's stamps in µs (`None` for a stamp Envoy did not take).
fn parse_line(line: &str) -> Option<[Option<f64>; POINTS.len()]> {
    let mut out = [None; POINTS.len()];
    let mut fields = line.split_whitespace();
    for slot in &mut out {
        *slot = fields.next()?.parse::<f64>().ok().map(|ns| ns / 1e3);
    }
    Some(out)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let samples: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(400);
    let mut sizes: Vec<usize> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    if sizes.is_empty() {
        sizes = vec![1_024, 16_384];
    }
    let tools = Tools::locate().context("envoy_timing needs the harness's tools")?;
    let dir = std::env::temp_dir().join(format!("kvroute-envoy-timing-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let variants = bench::envoy_variants(&tools.wasm)?;
    let mut fleets: Vec<(&str, Fleet, PathBuf)> = Vec::new();
    for (i, (label, router, edit)) in variants.into_iter().enumerate() {
        let log = dir.join(format!("access-{i}.log"));
        let mut cfg = FleetConfig::new(&format!("envoy-timing-{i}"));
        cfg.replicas = 1;
        cfg.model = bench::MODEL.to_string();
        cfg.router = router;
        cfg.envoy_edits = edit.into_iter().chain([access_log_edit(&log)]).collect();
        cfg.plugin_config = json!({"decision": "local"});
        cfg.sim_args = bench::overhead_sim_args();
        fleets.push((label, Fleet::start(cfg, &tools).await?, log));
    }
    let urls: Vec<String> = fleets
        .iter()
        .map(|(_, f, _)| format!("{}/v1/chat/completions", f.url()))
        .collect();
    for size in sizes {
        let bodies: Vec<String> = (0..32)
            .map(|s| bench::chat_body(size, s, 1, false))
            .collect();
        // Each log's lines so far, skipped when it is read.
        let mut skip = Vec::new();
        for (_, _, log) in &fleets {
            skip.push(
                std::fs::read_to_string(log)
                    .unwrap_or_default()
                    .lines()
                    .count(),
            );
        }
        let results = bench::interleaved_sequential(&urls, &bodies, 25, 5, samples).await;
        // Envoy flushes its access logs every 10 s (`--file-flush-interval-msec`).
        tokio::time::sleep(std::time::Duration::from_millis(11_000)).await;
        println!("\n{size} B, {samples} sequential requests per variant, medians in µs");
        println!(
            "{:<18} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9}",
            "variant", "client", "envoy", "req side", "upstream", "resp", "outside", "logged"
        );
        let mut timelines = Vec::new();
        for (((label, _, log), result), skip) in fleets.iter().zip(&results).zip(skip) {
            let text = std::fs::read_to_string(log)?;
            let rows: Vec<[Option<f64>; POINTS.len()]> =
                text.lines().skip(skip).filter_map(parse_line).collect();
            // The median of the lines that have the stamps (NaN with none: a missing log).
            let col = |f: &dyn Fn(&[Option<f64>; POINTS.len()]) -> Option<f64>| {
                bench::bars::median(rows.iter().map(f)).unwrap_or(f64::NAN)
            };
            let at = |name: &str| POINTS.iter().position(|p| *p == name).expect("a stamp");
            let (us_tx_end, us_rx_beg, ds_tx_end) =
                (at("US_TX_END"), at("US_RX_BEG"), at("DS_TX_END"));
            let total = col(&|r| r[ds_tx_end]);
            let request_side = col(&|r| r[us_tx_end]);
            let upstream = col(&|r| Some(r[us_rx_beg]? - r[us_tx_end]?));
            let response = col(&|r| Some(r[ds_tx_end]? - r[us_rx_beg]?));
            let client = result.p(50.0) * 1e3;
            println!(
                "{label:<18} {client:>8.1} {total:>8.1} {request_side:>8.1} {upstream:>8.1} {response:>8.1} {:>8.1} {:>9}",
                client - total,
                rows.len()
            );
            timelines.push((
                label,
                (0..POINTS.len())
                    .map(|i| col(&|r| r[i]))
                    .collect::<Vec<_>>(),
            ));
        }
        println!("\nmedian µs from the request's first byte to each of Envoy's stamps");
        print!("{:<18}", "variant");
        for p in POINTS {
            print!(" {p:>9}");
        }
        println!();
        for (label, stamps) in timelines {
            print!("{label:<18}");
            for s in stamps {
                print!(" {s:>9.1}");
            }
            println!();
        }
    }
    println!(
        "\nclient: the client's p50 to the last response byte; envoy: first request byte to last \
         response byte; req side: to the request's last byte upstream; upstream: from there to \
         the response's first byte; resp: from there to the last byte downstream; outside: \
         client minus envoy (loopback, and what the worker does between requests)."
    );
    Ok(())
}
