//! Drives `Router::route` + `Router::feedback` in a loop over a filled index, for profilers
//! (`perf record`, `valgrind --tool=callgrind`): 64 endpoints, ~1M indexed blocks, 16 KB prompts
//! of 64 blocks, half of them sharing a prefix with an indexed chain. Prints decisions/s.
//!
//! `cargo run --release -p scorer-core --example route_loop -- [decisions] [blocks] [endpoints]`

use std::time::Instant;

use scorer_core::index::EndpointId;
use scorer_core::protocol::{Outcome, RouteRequest};
use scorer_core::router::{EndpointMetrics, Router, RouterConfig};

/// A tiny deterministic generator, so the example needs no dependency.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[expect(
    clippy::disallowed_methods,
    reason = "a profiling driver at the edge: it times the sans-IO core, which never reads a clock"
)]
fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let decisions = args.next().and_then(Result::ok).unwrap_or(200_000);
    let blocks = args.next().and_then(Result::ok).unwrap_or(1_000_000);
    let endpoints = args.next().and_then(Result::ok).unwrap_or(64);
    const CHAIN: usize = 64;
    let now = 1_000_000;
    let mut router = Router::new(RouterConfig::default(), 1);
    let mut ids = Vec::new();
    for i in 0..endpoints {
        let address = format!("10.0.{}.{}:8000", i / 250, i % 250 + 1);
        let id = router
            .upsert_endpoint(&address)
            .unwrap_or(EndpointId(i as u16));
        router.update_metrics(
            &address,
            EndpointMetrics {
                running: (i % 5) as u32,
                waiting: 0,
                kv_usage: 0.3,
                capacity_tokens: Some(1_000_000),
            },
            now,
        );
        ids.push(id);
    }
    let mut rng = SplitMix(42);
    let mut chains: Vec<Vec<u64>> = Vec::new();
    let mut filled = 0;
    while filled < blocks {
        let chain: Vec<u64> = (0..CHAIN).map(|_| rng.next()).collect();
        router
            .index_mut()
            .insert(ids[chains.len() % ids.len()], &chain, now);
        filled += CHAIN;
        chains.push(chain);
    }
    let requests: Vec<RouteRequest> = (0..1024)
        .map(|i| {
            let mut hashes: Vec<u64> = if i % 2 == 0 {
                let c = &chains[rng.below(chains.len() as u64) as usize];
                c[..1 + rng.below(CHAIN as u64) as usize].to_vec()
            } else {
                Vec::new()
            };
            while hashes.len() < CHAIN {
                hashes.push(rng.next());
            }
            RouteRequest {
                model: "m".into(),
                block_hashes: hashes,
                prompt_bytes: (CHAIN * 256) as u64,
                prompt_tokens: (CHAIN * 64) as u32,
                max_output_tokens: Some(64),
                ..RouteRequest::default()
            }
        })
        .collect();
    let start = Instant::now();
    for i in 0..decisions {
        let d = router.route(&requests[i % requests.len()], now, i as u64);
        let outcome = Outcome {
            decision_id: d.response.decision_id,
            endpoint: d.response.endpoints.first().cloned().unwrap_or_default(),
            status: 200,
            total_ms: 10,
            ..Outcome::default()
        };
        router.feedback(&outcome, now);
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{decisions} decisions over {} blocks, {endpoints} endpoints: {:.0} decisions/s ({:.2} us each)",
        router.index().distinct_blocks(),
        decisions as f64 / secs,
        secs * 1e6 / decisions as f64
    );
}
