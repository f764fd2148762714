//! Drives the filter's per-request work natively, as the dynamic module runs it on an Envoy
//! worker with `decision: local`, for profilers (`perf record`, `valgrind --tool=callgrind`):
//! request headers, the body read, parsed, hashed and decided on the shared state, the response
//! headers, a non-streamed answer with `usage`, and the outcome queued; every 25 ms of requests
//! (the sync period) the tick's sync call is answered by the control plane's side of the
//! protocol, as `filter/src/root.rs`'s tests do. No Envoy: what is left of a request's cost in
//! Envoy is Envoy's own (`envoy_cost`).
//!
//! `cargo run --release -p kvroute-bench --example request_loop -- [requests] [prompt_bytes]
//! [endpoints]`. Prints the filter's µs per request, and apart from it the control plane's
//! share of serving the syncs (another process in a real deployment).

use std::sync::Arc;
use std::time::Instant;

use kvroute_filter::config::{DecisionMode, FilterConfig};
use kvroute_filter::machine::{BodyStep, Effect, RequestMachine};
use kvroute_filter::root::RootState;
use scorer_core::router::{EndpointMetrics, Router, RouterConfig};
use scorer_core::sync::{SyncLog, SyncRequest, serve_sync};

/// Requests between two sync ticks: about 25 ms of the max-rps run's rate.
const REQUESTS_PER_TICK: usize = 250;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let requests = args.next().transpose()?.unwrap_or(200_000);
    let prompt_bytes = args.next().transpose()?.unwrap_or(1_024);
    let endpoints = args.next().transpose()?.unwrap_or(8);

    let mut router = Router::new(RouterConfig::default(), 1);
    let addresses: Vec<String> = (0..endpoints).map(|i| format!("10.0.0.{i}:8000")).collect();
    for address in &addresses {
        router.upsert_endpoint(address)?;
        router.update_metrics(address, EndpointMetrics::default(), 0);
    }
    let mut log = SyncLog::new(10_000, 5);
    let config = Arc::new(FilterConfig {
        decision: DecisionMode::Local,
        ..FilterConfig::default()
    });
    let mut root = RootState::new((*config).clone());
    root.seed_calls(1);

    let bodies: Vec<String> = (0..64)
        .map(|s| kvroute_bench::chat_body(prompt_bytes, s, 16, false))
        .collect();
    let answer = br#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok ok ok ok"},"finish_reason":"length"}],"usage":{"prompt_tokens":256,"completion_tokens":16,"total_tokens":272,"prompt_tokens_details":{"cached_tokens":128}}}"#;
    let headers: Vec<(&str, &[u8])> = vec![
        (":method", b"POST"),
        (":path", b"/v1/chat/completions"),
        (":authority", b"kvroute"),
        ("content-type", b"application/json"),
        ("user-agent", b"bench"),
    ];

    let started = Instant::now();
    // The control plane's side of each sync, timed apart: it runs in another process.
    let mut control_plane = std::time::Duration::ZERO;
    let mut now_ms = 0;
    let mut routed = 0usize;
    for i in 0..requests {
        if i % REQUESTS_PER_TICK == 0 {
            now_ms += 25;
            if let Some(call) = root.on_tick(now_ms) {
                let serving = Instant::now();
                let request: SyncRequest = serde_json::from_slice(&call.body)?;
                let compact = request.compact_hashes;
                let sync = serve_sync(&mut log, &mut router, request, now_ms);
                let body = scorer_core::sync::to_json(&sync, compact)?;
                control_plane += serving.elapsed();
                root.on_sync_response(Some(200), &body, now_ms);
            }
        }
        let body = bodies[i % bodies.len()].as_bytes();
        let mut machine = RequestMachine::new(Arc::clone(&config));
        request_headers(&mut machine, &headers, now_ms);
        routed += request_body(&mut machine, &mut root, body, now_ms);
        response(&mut machine, answer, &addresses[i % endpoints], now_ms);
        done(&mut machine, &mut root, now_ms);
    }
    let filter = started.elapsed().saturating_sub(control_plane);
    let per_request = |d: std::time::Duration| d.as_secs_f64() * 1e6 / requests as f64;
    println!(
        "{requests} requests of {prompt_bytes} bytes over {endpoints} endpoints: filter {:.2} us \
         each, control plane's sync serving {:.2} us a request ({routed} routed, {} decided \
         locally)",
        per_request(filter),
        per_request(control_plane),
        root.stats().decided_locally,
    );
    Ok(())
}

// One function per hook, never inlined, so a profile splits the request's cost by phase.

#[inline(never)]
fn request_headers(machine: &mut RequestMachine, headers: &[(&str, &[u8])], now_ms: u64) {
    let _ = machine.on_request_headers_with(headers.iter().copied(), false, now_ms, |_| None);
}

/// The body read, parsed, hashed and decided; 1 when the request was given a destination.
#[inline(never)]
fn request_body(
    machine: &mut RequestMachine,
    root: &mut RootState,
    body: &[u8],
    now_ms: u64,
) -> usize {
    let mut routed = 0;
    if let BodyStep::ReadBody(_) = machine.on_request_body(body.len(), true) {
        let step = machine.on_body_complete_with(
            body,
            now_ms,
            || Some(0),
            |request| root.decide_or_prepare(request, now_ms, || 0),
        );
        for effect in step.effects {
            match effect {
                Effect::Count(counter) => {
                    root.count(counter);
                }
                Effect::SetRequestHeader { .. } => routed += 1,
                _ => {}
            }
        }
    }
    routed
}

#[inline(never)]
fn response(machine: &mut RequestMachine, answer: &[u8], upstream: &str, now_ms: u64) {
    let _ = machine.decision_header();
    if machine.wants_response_body() {
        let _ = machine.on_response_body(answer, now_ms);
    }
    let wants = machine.wants_response_info();
    machine.on_response_headers(
        wants.status.then_some(200),
        wants.upstream.then_some(upstream),
    );
}

#[inline(never)]
fn done(machine: &mut RequestMachine, root: &mut RootState, now_ms: u64) {
    if let Some(outcome) = machine.on_done(now_ms) {
        let _ = root.push_outcome(outcome, now_ms);
    }
}
