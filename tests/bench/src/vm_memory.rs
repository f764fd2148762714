//! Memory of one proxy VM deciding locally (issue #15, "bounded memory"): the release filter in
//! wasmtime with `decision: local`, synced with a fleet of `n` endpoints and its prefix index
//! filled past its bound through sync answers, as another router's decisions would fill it on
//! a busy fleet. The figure is the module's linear memory: what one Envoy worker's VM holds for
//! the filter (wasm memory never shrinks, so it is also the VM's peak). The same answers are
//! applied to a native [`LocalRouter`] beside it, which says what the index holds.
//!
//! What bounds the copy: each endpoint's share of the index is at most its KV capacity in
//! blocks and, with the filter's `max_index_blocks`, that bound divided by the endpoints
//! (`Router::set_max_index_blocks`), least recently used evicted first; every entry expires
//! `index_ttl_ms` after its last touch; in-flight entries end with their outcome or after
//! `inflight_ttl_ms`; reports wait for the next sync up to `max_pending_reports`.

use std::time::Instant;

use proxy_wasm_host::FilterModule;
use scorer_core::protocol::{Outcome, RouteRequest};
use scorer_core::router::{EndpointMetrics, Router, RouterConfig};
use scorer_core::sync::{
    DecisionRecord, LocalRouter, SYNC_PATH, SyncEvent, SyncLog, SyncRequest, serve_sync,
};
use serde::Serialize;

use crate::BenchError;

/// One fleet size.
#[derive(Debug, Clone, Serialize)]
pub struct VmMemoryRow {
    /// Endpoints in the control plane's table.
    pub endpoints: usize,
    /// KV capacity each endpoint reports, tokens.
    pub capacity_tokens: u64,
    /// The filter's `max_index_blocks` (0: each endpoint's KV capacity alone).
    pub max_index_blocks: usize,
    /// The index's bound per endpoint: its KV capacity in 256-byte blocks, or its share of
    /// `max_index_blocks` when that is lower.
    pub bound_blocks_per_endpoint: usize,
    /// Distinct prompt blocks other routers' decisions sent each endpoint (past the KV bound).
    pub filled_blocks_per_endpoint: usize,
    /// Distinct blocks the copy's index holds at the end (the native twin's count).
    pub index_blocks: usize,
    /// The index's own estimate of its heap bytes (native twin).
    pub index_bytes_native: usize,
    /// Linear memory of a fresh `decision: local` VM before its first sync, bytes.
    pub empty_vm_bytes: usize,
    /// Linear memory once synced and filled, bytes.
    pub vm_bytes: usize,
    /// Wall time of the fill, seconds (wasmtime in the test host is unoptimised).
    pub fill_seconds: f64,
}

/// Prompt blocks per reported decision (a 64 KB prompt).
const BLOCKS_PER_DECISION: usize = 256;
/// Decisions (each with its outcome) per sync answer: 4,096 blocks, an answer of about 90 KB.
const DECISIONS_PER_TICK: usize = 16;
/// The sync interval the host clock advances by per tick (the filter's default).
const TICK_MS: u64 = 50;

/// Fills a `decision: local` VM over `endpoints` endpoints of `capacity_tokens` KV each to
/// `fill` times each endpoint's KV capacity in blocks, under the filter setting
/// `max_index_blocks` (0: none), and reads its memory.
pub fn vm_memory(
    module: &FilterModule,
    endpoints: usize,
    capacity_tokens: u64,
    fill: f64,
    max_index_blocks: usize,
) -> Result<VmMemoryRow, BenchError> {
    let fail = |what: String| BenchError::Filter(what);
    // A copy nobody sends requests rests after `max_state_age_ms` and syncs once per that
    // (`RootState::tick_period_ms`); this VM stands for one on a busy fleet, which syncs every
    // tick, so no request is sent and the age bound outlasts the fill (a day of host clock).
    let plugin = format!(
        r#"{{"decision":"local","max_index_blocks":{max_index_blocks},"max_state_age_ms":{}}}"#,
        24 * 3_600_000
    );
    let mut host = module.start(plugin.as_bytes())?;
    host.set_clusters(&["kvroute_control_plane", "vllm"]);
    let empty_vm_bytes = host.memory_bytes();

    // The control plane: a router over the fleet, scraped on every tick, and its log.
    let config = RouterConfig::default();
    let tokens_per_block = (config.block_bytes as f64 / config.bytes_per_token).max(1.0);
    let bound = (capacity_tokens as f64 / tokens_per_block) as usize;
    let mut hub = Router::new(config, 1);
    let addresses: Vec<String> = (0..endpoints)
        .map(|i| format!("10.{}.{}.{}:8000", (i >> 16) & 255, (i >> 8) & 255, i & 255))
        .collect();
    for address in &addresses {
        hub.upsert_endpoint(address)
            .map_err(|e| fail(format!("{endpoints} endpoints: {e}")))?;
    }
    let metrics = EndpointMetrics {
        capacity_tokens: Some(capacity_tokens),
        ..EndpointMetrics::default()
    };
    let mut log = SyncLog::new(65_536, 1);
    let mut twin = LocalRouter::new(4096)
        .with_max_index_blocks((max_index_blocks > 0).then_some(max_index_blocks));

    let per_endpoint = (bound as f64 * fill).ceil() as usize;
    let decisions = (endpoints * per_endpoint).div_ceil(BLOCKS_PER_DECISION);
    let mut hash: u64 = 0x5eed_0fb1_0cab;
    let mut next_hash = move || {
        // splitmix64: distinct, well-spread block hashes.
        hash = hash.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = hash;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let started = Instant::now();
    let mut now = 1_000u64;
    let mut sent = 0usize;
    // Until every decision is out, then a few ticks more so the last answers land.
    let ticks = decisions.div_ceil(DECISIONS_PER_TICK) + 3;
    for _ in 0..ticks {
        for address in &addresses {
            hub.update_metrics(address, metrics, now);
        }
        host.tick()?;
        let call = host
            .pending_http_calls()
            .iter()
            .find(|c| c.header(":path") == Some(SYNC_PATH))
            .cloned()
            .ok_or_else(|| fail("the VM made no sync call on its tick".into()))?;
        let request: SyncRequest =
            serde_json::from_slice(&call.body).map_err(|e| fail(format!("sync request: {e}")))?;
        let twin_request = twin.sync_request();
        // Another router's decisions on this tick, each with its outcome (the requests ended),
        // round robin over the endpoints.
        for _ in 0..DECISIONS_PER_TICK.min(decisions - sent) {
            let endpoint = addresses[sent % endpoints].clone();
            let decision_id = (1 << 50) + sent as u64;
            let request = RouteRequest {
                model: "m".into(),
                block_hashes: (0..BLOCKS_PER_DECISION).map(|_| next_hash()).collect(),
                prompt_bytes: (BLOCKS_PER_DECISION * 256) as u64,
                prompt_tokens: (BLOCKS_PER_DECISION * 64) as u32,
                ..RouteRequest::default()
            };
            let record = DecisionRecord {
                decision_id,
                endpoint: endpoint.clone(),
                request,
                age_ms: 0,
            };
            log.push(
                SyncEvent::Decision {
                    origin: 0,
                    record: Box::new(record),
                },
                now,
            );
            let outcome = Outcome {
                decision_id,
                endpoint,
                status: 200,
                ..Outcome::default()
            };
            log.push(SyncEvent::Outcome { origin: 0, outcome }, now);
            sent += 1;
        }
        let answer = serve_sync(&mut log, &mut hub, request, now);
        let body = serde_json::to_vec(&answer).map_err(|e| fail(e.to_string()))?;
        host.respond_http_call(
            call.token,
            200,
            &[("content-type", "application/json")],
            &body,
        )?;
        let twin_answer = serve_sync(&mut log, &mut hub, twin_request, now);
        twin.apply(twin_answer, now);
        host.advance_ms(TICK_MS);
        now += TICK_MS;
    }
    let fill_seconds = started.elapsed().as_secs_f64();
    let copy = twin
        .router()
        .ok_or_else(|| fail("the native twin never synced".into()))?;
    Ok(VmMemoryRow {
        endpoints,
        capacity_tokens,
        max_index_blocks,
        bound_blocks_per_endpoint: if max_index_blocks > 0 {
            bound.min(max_index_blocks / endpoints.max(1))
        } else {
            bound
        },
        filled_blocks_per_endpoint: per_endpoint,
        index_blocks: copy.index().distinct_blocks(),
        index_bytes_native: copy.index().approx_bytes(),
        empty_vm_bytes,
        vm_bytes: host.memory_bytes(),
        fill_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scale section's VM-memory rows ran only in `make bench`, and a filter change (copies
    /// resting when no request comes) left every row "the VM made no sync call on its tick"
    /// until a bench run showed it: a small fleet through the same path here.
    #[test]
    fn a_small_fleet_fills_the_vm_past_its_bound() {
        let path = kvroute_harness::locate_wasm().expect("the release filter is built");
        let module = FilterModule::from_file(&path).expect("the filter loads");
        // 8 endpoints of 655,360 tokens: 10,240 blocks each, filled to 15,360 by 480 decisions
        // over 30 ticks of 50 ms, longer than the copy's default second without a request.
        let row = vm_memory(&module, 8, 655_360, 1.5, 0).expect("the fill runs");
        assert_eq!(row.bound_blocks_per_endpoint, 10_240);
        assert_eq!(row.filled_blocks_per_endpoint, 15_360);
        assert!(
            row.index_blocks <= 8 * 10_240 && row.index_blocks >= 8 * 9_000,
            "the copy holds about its bound: {}",
            row.index_blocks
        );
        assert!(row.vm_bytes > row.empty_vm_bytes, "{row:?}");
    }
}
