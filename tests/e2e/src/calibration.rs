//! Online calibration, end to end through a real Envoy: two replicas of one pool run the same
//! engine profile at different speeds, and within a minute of traffic the control plane has
//! learned each one's prefill rate and idle time per output token from its `/metrics` alone
//! (`vllm:request_prefill_time_seconds`, `vllm:request_prefill_kv_computed_tokens`,
//! `vllm:inter_token_latency_seconds`), to within 10% of what the profile and speed make them.
//!
//! The simulator's histograms are in wall seconds, as vLLM's are, so a replica at `--speed s`
//! prefills `s` times the profile's tokens per wall second.

use std::time::{Duration, Instant};

use kvroute_harness::HttpClient;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

use crate::common;

const TEST_TIMEOUT: Duration = Duration::from_secs(150);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const MODEL: &str = "kvroute-calibration-model";
/// How long the traffic may run before the rates must be learned.
const LEARNING_BUDGET: Duration = Duration::from_secs(60);
/// `llama8b-h100.yaml`, the simulator's default profile: prefill tokens per ms and the idle
/// decode step, ms. Only the test knows them; the router starts from its generic prior.
const PROFILE_PREFILL_TOKENS_PER_MS: f64 = 10.0;
const PROFILE_DECODE_STEP_MS: f64 = 4.8;
/// Replica speeds (simulated seconds per wall second).
const SPEEDS: [f64; 2] = [1.0, 0.4];

/// Each endpoint's `calibration` from `/debug/endpoints`, in replica order.
async fn calibrations(fleet: &kvroute_harness::Fleet, client: &HttpClient) -> Vec<Value> {
    let url = format!("{}/debug/endpoints", common::cp_admin(fleet));
    let body = client.get(&url, REQUEST_TIMEOUT).await.unwrap().body;
    let list: Vec<Value> = serde_json::from_str(&body).unwrap();
    fleet
        .replicas
        .iter()
        .map(|r| {
            list.iter()
                .find(|e| e["address"] == r.address.as_str())
                .map(|e| e["calibration"].clone())
                .unwrap_or_else(|| panic!("{} not in {body}", r.address))
        })
        .collect()
}

/// `(learned, expected)` prefill rate and idle ITL of replica `i`, relative errors.
fn errors(c: &Value, i: usize) -> (f64, f64) {
    let rate = c["prefill_tokens_per_ms"].as_f64().unwrap();
    let itl = c["itl_ms_idle"].as_f64().unwrap();
    let want_rate = PROFILE_PREFILL_TOKENS_PER_MS * SPEEDS[i];
    let want_itl = PROFILE_DECODE_STEP_MS / SPEEDS[i];
    (
        (rate - want_rate).abs() / want_rate,
        (itl - want_itl).abs() / want_itl,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_learns_each_replica_s_rates_from_its_metrics_within_a_minute() {
    let body = async {
        let fleet = common::start_configured("e2e-calibration", 2, MODEL, |cfg| {
            cfg.per_replica_args = SPEEDS
                .iter()
                .map(|s| vec!["--speed".to_string(), s.to_string()])
                .collect();
        })
        .await;
        let client = HttpClient::new();
        let before = calibrations(&fleet, &client).await;
        for c in &before {
            assert_eq!(c["prefill_evidence_points"], 0, "a cold start: {c}");
        }

        // One client through Envoy and one straight at the slow replica (the router rightly
        // prefers the fast one, and calibration reads the engines' counters whoever sent the
        // work): fresh prompts of random length (no cache hits), 48 output tokens each.
        // Prefills that share an engine step each take longer than alone, so a client per
        // replica keeps this a measurement of the rate, not of the overlap (see
        // `scorer_core::calibration`).
        let via_envoy = format!("{}/v1/chat/completions", fleet.url());
        let direct = format!("http://{}/v1/chat/completions", fleet.replicas[1].address);
        let started = Instant::now();
        let mut learned = None;
        let mut round = 0u64;
        let mut rng = SmallRng::seed_from_u64(5);
        while started.elapsed() < LEARNING_BUDGET {
            let mut batch = Vec::new();
            for url in [&via_envoy, &direct] {
                let words = rng.random_range(100..1_500);
                let body =
                    common::user_chat(MODEL, &kvroute_harness::loadgen::words(&mut rng, words), 48);
                let client = client.clone();
                let url = url.clone();
                batch.push(tokio::spawn(async move {
                    client
                        .request("POST", &url, &[], Some(body.to_string()), REQUEST_TIMEOUT)
                        .await
                }));
            }
            for r in batch {
                let resp = r.await.unwrap().unwrap();
                assert_eq!(resp.status, 200, "{}", resp.body);
            }
            round += 1;
            let now = calibrations(&fleet, &client).await;
            let ok = now.iter().enumerate().all(|(i, c)| {
                let (rate, itl) = errors(c, i);
                c["prefill_evidence_points"].as_u64().unwrap_or(0) >= 8 && rate < 0.1 && itl < 0.1
            });
            if ok {
                learned = Some((started.elapsed(), now));
                break;
            }
        }
        let last = calibrations(&fleet, &client).await;
        for (i, c) in last.iter().enumerate() {
            let (rate, itl) = errors(c, i);
            eprintln!(
                "replica {i} at speed {}: prefill {:.2} tokens/ms (want {:.2}, error {:.1}%), idle ITL {:.2} ms (want {:.2}, error {:.1}%), {} points",
                SPEEDS[i],
                c["prefill_tokens_per_ms"].as_f64().unwrap(),
                PROFILE_PREFILL_TOKENS_PER_MS * SPEEDS[i],
                rate * 100.0,
                c["itl_ms_idle"].as_f64().unwrap(),
                PROFILE_DECODE_STEP_MS / SPEEDS[i],
                itl * 100.0,
                c["prefill_evidence_points"],
            );
        }
        let (took, _) = learned.unwrap_or_else(|| {
            panic!("rates not within 10% after {LEARNING_BUDGET:?}: {last:#?} ({round} rounds)")
        });
        eprintln!("learned both replicas' rates in {took:.1?} ({round} rounds of 2 requests)");

        // The learned rates are on /metrics too, per endpoint, in Prometheus' base units.
        let metrics = common::cp_get(&fleet, "/metrics").await;
        for r in &fleet.replicas {
            let needle = format!(
                "kvroute_endpoint_prefill_tokens_per_second{{endpoint=\"{}\"}}",
                r.address
            );
            assert!(metrics.contains(&needle), "{needle} missing");
        }
    };
    common::bounded(TEST_TIMEOUT, body).await;
}
