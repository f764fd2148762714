//! The filter's parse and hash time inside Envoy's V8, alone: one Envoy with the release
//! filter deciding locally in front of one fast replica, sequential 1, 16 and 200 KB chat
//! bodies, and the mean of the filter's own `kvroute_hash_duration_us` histogram over them
//! (the `make bench` figure, without the rest of the bench).
//!
//! `cargo run --release -p kvroute-bench --example v8_hash` after `make wasm build`
//! (`$KVROUTE_WASM` names another module to compare).
//!
//! The local decision's time instead of parse and hash: build the filter with its
//! `time-decision` feature, in a target directory of its own so the shipped module stays as it
//! is, and name that module (the MB/s column then means nothing):
//!
//! ```sh
//! cargo build --release -p filter --target wasm32-unknown-unknown --features time-decision \
//!     --target-dir target/time-decision
//! KVROUTE_WASM=target/time-decision/wasm32-unknown-unknown/release/kvroute_filter.wasm \
//!     cargo run --release -p kvroute-bench --example v8_hash
//! ```

use anyhow::Context;
use kvroute_bench as bench;
use kvroute_harness::{Fleet, FleetConfig, Tools};
use serde_json::json;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let tools = Tools::locate().context("v8_hash needs the harness's tools")?;
    let mut cfg = FleetConfig::new("v8-hash");
    cfg.replicas = 1;
    cfg.model = bench::MODEL.to_string();
    cfg.plugin_config = json!({"decision": "local"});
    cfg.sim_args = ["--profile", "fast"].map(String::from).to_vec();
    let fleet = Fleet::start(cfg, &tools).await?;
    let sizes = [(1_024, 2_000), (16_384, 600), (204_800, 200)];
    let figures = bench::filter_v8::parse_in_v8(
        fleet.client(),
        &fleet.envoy.admin_address,
        &fleet.url(),
        &sizes,
    )
    .await?;
    for ((bytes, _), v) in sizes.iter().zip(figures) {
        match v {
            Some(v) => println!(
                "{bytes} B: {:.1} µs per body, {:.0} MB/s ({} bodies)",
                v.us_per_body, v.mb_per_s, v.bodies
            ),
            None => println!("{bytes} B: no body was timed"),
        }
    }
    Ok(())
}
