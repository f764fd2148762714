//! The route API: JSON bodies of `POST /v1/route` and `POST /v1/feedback` (raw bytes, or
//! well-formed documents with arbitrary values) deserialised into `scorer_core::protocol` types
//! and applied to a `Router`, interleaved with metrics updates, unreachable endpoints,
//! endpoint churn and expiry. Invariants: every answer names only known endpoints, without
//! duplicates, at most `1 + fallbacks` of them; decision ids increase; every candidate cost is
//! a number (never NaN); the in-flight table never holds more than the decisions made.

use std::collections::BTreeSet;

use arbitrary::Arbitrary;
use scorer_core::protocol::{FeedbackBatch, FirstToken, Outcome, RouteReason, RouteRequest};
use scorer_core::router::{EndpointMetrics, Router, RouterConfig};

#[derive(Arbitrary, Debug)]
enum Body {
    Raw(Vec<u8>),
    Doc {
        model: String,
        /// Small hash domain so requests share prefixes.
        hashes: Vec<u8>,
        prompt_bytes: u64,
        prompt_tokens: u32,
        max_output_tokens: Option<u32>,
        session: Option<String>,
        token_hashes: Vec<u8>,
        /// A stored response the request continues (small domain, so some are known).
        previous_response: Option<u8>,
        previous_endpoint: Option<u8>,
        /// Streamed: held in the measured queue until its first token.
        stream: bool,
    },
}

#[derive(Arbitrary, Debug)]
enum Feedback {
    Raw(Vec<u8>),
    LastDecision {
        back: u8,
        endpoint: u8,
        status: u16,
        ttfb_ms: Option<u32>,
        total_ms: u32,
        prompt_tokens: Option<u32>,
        cached_tokens: Option<u32>,
        response: Option<u8>,
    },
}

#[derive(Arbitrary, Debug)]
enum Event {
    Route(Body, u16),
    Metrics {
        endpoint: u8,
        running: u16,
        waiting: u16,
        kv: u16,
        capacity: Option<u32>,
    },
    Unreachable(u8),
    Feedback(Feedback),
    Expire(u32),
    Add(u8),
    Remove(u8),
}

#[derive(Arbitrary, Debug)]
struct Input {
    fallbacks: u8,
    block_bytes: u8,
    events: Vec<Event>,
}

fn address(i: u8) -> String {
    format!("10.0.{}.{}:8000", i / 16, i % 16)
}

fn request_bytes(body: &Body) -> Vec<u8> {
    match body {
        Body::Raw(b) => b.clone(),
        Body::Doc {
            model,
            hashes,
            prompt_bytes,
            prompt_tokens,
            max_output_tokens,
            session,
            token_hashes,
            previous_response,
            previous_endpoint,
            stream,
        } => serde_json::to_vec(&serde_json::json!({
            "model": model,
            "block_hashes": hashes.iter().map(|h| u64::from(*h) * 0x9e37_79b9_7f4a_7c15).collect::<Vec<_>>(),
            "prompt_bytes": prompt_bytes,
            "prompt_tokens": prompt_tokens,
            "max_output_tokens": max_output_tokens,
            "session": session,
            "token_block_hashes": token_hashes.iter().map(|h| u64::from(*h)).collect::<Vec<_>>(),
            "previous_response_id": previous_response.map(|r| format!("resp_{}", r % 16)),
            "previous_response_endpoint": previous_endpoint.map(|e| address(e % 8)),
            "stream": stream,
        }))
        .unwrap_or_default(),
    }
}

fn run(input: Input) {
    let config = RouterConfig {
        fallbacks: usize::from(input.fallbacks % 8),
        block_bytes: usize::from(input.block_bytes.max(1)),
        ..RouterConfig::default()
    };
    let max_answer = 1 + config.fallbacks;
    let mut router = Router::new(config, 1_000);
    let mut known: BTreeSet<String> = BTreeSet::new();
    for i in 0..4 {
        router
            .upsert_endpoint(&address(i))
            .expect("four endpoints fit");
        known.insert(address(i));
    }
    let mut now: u64 = 0;
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut decisions: Vec<u64> = Vec::new();
    for event in input.events.iter().take(128) {
        now += 1;
        match event {
            Event::Route(body, dt) => {
                now += u64::from(*dt);
                let Ok(request) = serde_json::from_slice::<RouteRequest>(&request_bytes(body))
                else {
                    continue;
                };
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let decision = router.route(&request, now, seed);
                let endpoints = &decision.response.endpoints;
                assert!(endpoints.len() <= max_answer, "{endpoints:?}");
                let unique: BTreeSet<&String> = endpoints.iter().collect();
                assert_eq!(unique.len(), endpoints.len(), "duplicates in {endpoints:?}");
                for e in endpoints {
                    assert!(known.contains(e), "unknown endpoint {e} in {endpoints:?}");
                }
                for c in &decision.candidates {
                    assert!(!c.total_ms.is_nan(), "NaN cost: {c:?}");
                }
                // A stored response's replica is the only one that can answer: no fallbacks.
                if decision.response.reason == RouteReason::StoredResponse {
                    assert_eq!(endpoints.len(), 1, "{endpoints:?}");
                    assert!(request.previous_response_id.is_some());
                }
                if let Some(last) = decisions.last() {
                    assert!(
                        decision.response.decision_id > *last,
                        "decision ids went back"
                    );
                }
                decisions.push(decision.response.decision_id);
            }
            Event::Metrics {
                endpoint,
                running,
                waiting,
                kv,
                capacity,
            } => {
                // What the control plane's parser can produce: finite, 0..=1 usage.
                let metrics = EndpointMetrics {
                    running: u32::from(*running),
                    waiting: u32::from(*waiting),
                    kv_usage: f64::from(*kv) / f64::from(u16::MAX),
                    capacity_tokens: capacity.map(u64::from),
                    counters: None,
                    ..Default::default()
                };
                router.update_metrics(&address(*endpoint % 8), metrics, now);
            }
            Event::Unreachable(i) => router.mark_unreachable(&address(*i % 8)),
            Event::Feedback(feedback) => {
                let bytes = match feedback {
                    Feedback::Raw(b) => b.clone(),
                    Feedback::LastDecision {
                        back,
                        endpoint,
                        status,
                        ttfb_ms,
                        total_ms,
                        prompt_tokens,
                        cached_tokens,
                        response,
                    } => {
                        let id = decisions
                            .len()
                            .checked_sub(1 + usize::from(*back) % 4)
                            .map_or(7, |i| decisions[i]);
                        serde_json::to_vec(&FeedbackBatch {
                            outcomes: vec![Outcome {
                                decision_id: id,
                                endpoint: address(*endpoint % 8),
                                status: *status,
                                ttfb_ms: ttfb_ms.map(u64::from),
                                total_ms: u64::from(*total_ms),
                                prompt_tokens: *prompt_tokens,
                                completion_tokens: None,
                                cached_tokens: *cached_tokens,
                                response_id: response.map(|r| format!("resp_{}", r % 16)),
                                decision_tag: 0,
                            }],
                            // Withdraw the call ids the route requests may have carried.
                            withdrawn: vec![u64::from(*back) % 4],
                            // A first token for a decision near the one just ended.
                            first_tokens: vec![FirstToken {
                                decision_id: id.wrapping_add(u64::from(*back % 3)),
                                decision_tag: 0,
                                ttft_ms: Some(u64::from(*total_ms)),
                            }],
                        })
                        .unwrap_or_default()
                    }
                };
                if let Ok(batch) = serde_json::from_slice::<FeedbackBatch>(&bytes) {
                    for first in &batch.first_tokens {
                        router.first_token(first.decision_id, now, first.ttft_ms);
                    }
                    for outcome in &batch.outcomes {
                        router.feedback(outcome, now);
                    }
                    for call in &batch.withdrawn {
                        router.withdraw(*call, now);
                    }
                }
            }
            Event::Expire(dt) => {
                now += u64::from(*dt);
                router.expire(now);
            }
            Event::Add(i) => {
                let a = address(*i % 8);
                if router.upsert_endpoint(&a).is_ok() {
                    known.insert(a);
                }
            }
            Event::Remove(i) => {
                let a = address(*i % 8);
                router.remove_endpoint(&a);
                known.remove(&a);
            }
        }
        assert!(router.inflight_len() <= decisions.len());
    }
    let _ = router.stats();
    let _ = router.endpoints(now);
}

/// The target's body: the input its bytes build (`crate::structured`), and what it must satisfy.
pub fn check(data: &[u8]) {
    crate::structured(data, run);
}
