//! The filter's per-request work with `decision: local`, natively and by stage: headers, body
//! (parse, hash, decide), response, outcome, and the tick's sync call (built, answered by
//! scorer-core's control-plane side, applied), amortised per request at a given request rate.
//!
//! `cargo run --release -p filter --example request_path -- [requests] [requests_per_tick]
//! [workers] [body_bytes] [endpoints] [capacity_tokens]`
//!
//! Requests alternate over `workers` VMs, each syncing once per `requests_per_tick` requests,
//! so each applies the others' decisions as Envoy's workers do. The fleet has `endpoints`
//! replicas (1), all idle: with more, every decision and every applied one weighs each. No
//! request is deferred to the control plane (`local.defer_above_ms: 0`). With
//! `capacity_tokens` (as `make bench`'s `fast` replica reports: 490000) each replica's index
//! is bounded as its KV cache is, and a body cycle larger than it evicts on every request;
//! without, nothing is ever evicted.
//!
//! A profiling aid for the wasm filter's CPU in Envoy: run it under `perf record` to see which
//! functions a request costs. V8 runs the same code some 1.5-3x slower.

use std::time::{Duration, Instant};

use kvroute_filter::config::{DecisionMode, FilterConfig};
use kvroute_filter::machine::BodyStep;
use kvroute_filter::root::RootState;
use scorer_core::router::{EndpointMetrics, Router, RouterConfig};
use scorer_core::sync::{SyncLog, SyncRequest, serve_sync};

fn body(seed: u64, bytes: usize) -> Vec<u8> {
    // `bytes` of words, distinct per seed, as the bench's chat bodies.
    let mut words = String::new();
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while words.len() < bytes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        words.push_str(["alpha ", "beta ", "gamma ", "delta ", "kappa "][(x % 5) as usize]);
    }
    serde_json::to_vec(&serde_json::json!({
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": words}],
    }))
    .unwrap_or_default()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let requests: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let per_tick: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(75);
    let workers: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let bytes: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1_000);
    let endpoints: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1).max(1);
    let metrics = EndpointMetrics {
        capacity_tokens: args.next().and_then(|a| a.parse().ok()),
        ..EndpointMetrics::default()
    };
    let mut roots: Vec<RootState> = (0..workers)
        .map(|_| {
            RootState::new(FilterConfig {
                decision: DecisionMode::Local,
                ..FilterConfig::default()
            })
        })
        .collect();
    // Every request is decided in a copy: none is left to the control plane, which here
    // answers no route call (a lone endpoint never defers anyway).
    let mut config = RouterConfig::default();
    config.local.defer_above_ms = 0.0;
    let mut router = Router::new(config, 1);
    let addresses: Vec<String> = (0..endpoints)
        .map(|i| format!("127.0.{}.{}:8000", i / 250, i % 250 + 1))
        .collect();
    for address in &addresses {
        let _ = router.upsert_endpoint(address);
        router.update_metrics(address, metrics, 0);
    }
    let mut log = SyncLog::new(65_536, 5);
    let bodies: Vec<Vec<u8>> = (0..32).map(|s| body(s, bytes)).collect();
    let response = br#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"length"}],"usage":{"prompt_tokens":200,"total_tokens":201,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":192}}}"#;
    let headers: Vec<(&str, &[u8])> = vec![
        (":authority", b"127.0.0.1:10000"),
        (":path", b"/v1/chat/completions"),
        (":method", b"POST"),
        (":scheme", b"http"),
        ("content-type", b"application/json"),
        ("content-length", b"1100"),
        ("x-forwarded-proto", b"http"),
        ("x-request-id", b"8a7c2f0e-3a1b-4c9d-9e8f-0a1b2c3d4e5f"),
    ];
    let mut spent = [Duration::ZERO; 5];
    let mut sync_bytes = 0usize;
    let mut now_ms = 0u64;
    let start = Instant::now();
    for i in 0..requests {
        let root = &mut roots[(i % workers as u64) as usize];
        if i % per_tick < workers as u64 {
            // The tick: the VM builds its sync call, the control plane answers, the VM applies.
            let t = Instant::now();
            let call = root.on_tick(now_ms);
            spent[3] += t.elapsed();
            if let Some(call) = call {
                let Ok(request) = serde_json::from_slice::<SyncRequest>(&call.body) else {
                    continue;
                };
                sync_bytes += call.body.len();
                for address in &addresses {
                    router.update_metrics(address, metrics, now_ms);
                }
                // Answered as the control plane does: hash lists in base64 when the VM reads them.
                let compact = request.compact_hashes;
                let answer = serve_sync(&mut log, &mut router, request, now_ms);
                let answer = scorer_core::sync::to_json(&answer, compact).unwrap_or_default();
                sync_bytes += answer.len();
                let t = Instant::now();
                root.on_sync_response(Some(200), &answer, now_ms);
                spent[4] += t.elapsed();
            }
            if i % per_tick == workers as u64 - 1 {
                now_ms += 25;
            }
        }
        let t = Instant::now();
        let mut machine = root.new_request();
        let _ = machine.on_request_headers_with(headers.iter().copied(), false, now_ms, |_| None);
        spent[0] += t.elapsed();
        let t = Instant::now();
        let body = &bodies[(i % 32) as usize];
        if let BodyStep::ReadBody(_) = machine.on_request_body(body.len(), true) {
            let _ = machine.on_body_complete_with(
                body,
                now_ms,
                || None,
                |request| root.decide_or_prepare(request, now_ms, || i),
            );
        }
        spent[1] += t.elapsed();
        let t = Instant::now();
        // Served where it was sent (no upstream address: the decision's endpoint).
        machine.on_response_headers(Some(200), None);
        let _ = machine.on_response_body(response, now_ms);
        if let Some(outcome) = machine.on_done(now_ms) {
            root.push_outcome(outcome, now_ms);
        }
        spent[2] += t.elapsed();
    }
    let total = start.elapsed();
    let per = |d: Duration| d.as_secs_f64() * 1e6 / requests as f64;
    println!(
        "{requests} requests, a tick every {per_tick}: {:.2} µs/request in all",
        per(total)
    );
    for (name, d) in [
        "headers",
        "body: parse, hash, decide",
        "response and outcome",
        "tick: build the sync call",
        "tick: apply the answer",
    ]
    .iter()
    .zip(spent)
    {
        println!("  {name:<28} {:.2} µs/request", per(d));
    }
    println!(
        "  sync bytes (both ways)       {:.0} B/request",
        sync_bytes as f64 / requests as f64
    );
}
