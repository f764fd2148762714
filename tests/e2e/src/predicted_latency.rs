//! Predicted latency, end to end through a real Envoy: the control plane learns each replica's
//! time to first token from the filter's outcome reports, shows its prediction for every
//! candidate in `/debug/decisions/{id}`, converges on what the requests then measured, tells a
//! slow replica from a fast one, and exports its prediction error to Prometheus.
//!
//! Requests ask for one output token without streaming, so the client's wall time of a request
//! is its time to first token. The assertions compare predictions with the measured times of
//! the same requests (medians, loose bounds): nothing depends on how fast the machine is.

use std::time::{Duration, Instant};

use kvroute_harness::HttpClient;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde_json::{Value, json};

use crate::common;

/// Every test finishes within this, or fails.
const TEST_TIMEOUT: Duration = Duration::from_secs(150);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const MODEL: &str = "kvroute-latency-model";
const DECISION: &str = "x-kvroute-decision";
/// Requests sent one after another; the last `JUDGED` are compared with their predictions.
const REQUESTS: usize = 36;
const JUDGED: usize = 12;

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A one-token, unstreamed chat request whose prompt is `words` fresh words.
fn request(rng: &mut SmallRng, words: usize) -> Value {
    common::user_chat(MODEL, &kvroute_harness::loadgen::words(rng, words), 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predictions_are_explained_and_converge_on_measured_ttft() {
    let body = async {
        let fleet = common::start_configured("e2e-predicted-latency", 2, MODEL, |cfg| {
            cfg.plugin_config = json!({"allow_explain": true});
            // Replica 1 runs at a quarter of the profile's speed: four times slower prefill.
            cfg.per_replica_args = vec![vec![], vec!["--speed".into(), "0.25".into()]];
            cfg.control_plane_router = json!({"latency": {"min_samples": 6}});
        })
        .await;
        let client = HttpClient::new();
        let admin = common::cp_admin(&fleet);
        let slow = fleet.replicas[1].address.clone();
        let url = format!("{}/v1/chat/completions", fleet.url());
        let mut rng = SmallRng::seed_from_u64(11);

        // (predicted TTFT of the chosen candidate, measured TTFT, chosen endpoint)
        let mut seen: Vec<(f64, f64, String)> = Vec::new();
        let mut last_candidates = Vec::new();
        for i in 0..REQUESTS {
            let words = 300 + (i * 7919) % 1_700;
            let started = Instant::now();
            let resp = client
                .request(
                    "POST",
                    &url,
                    &[("x-kvroute-explain", "1")],
                    Some(request(&mut rng, words).to_string()),
                    REQUEST_TIMEOUT,
                )
                .await
                .unwrap_or_else(|e| panic!("{e} ({})", fleet.describe()));
            let measured_ms = started.elapsed().as_secs_f64() * 1e3;
            assert_eq!(resp.status, 200, "{} ({})", resp.body, fleet.describe());
            let decision = resp
                .header(DECISION)
                .unwrap_or_else(|| panic!("no {DECISION} in {:?}", resp.headers));
            let Some(id) = common::decision_id(decision).map(str::to_string) else {
                // The route call missed its deadline on a loaded machine: the filter failed
                // open, which is correct, and there is no decision to explain.
                assert!(decision.contains("fail_open"), "{decision}");
                continue;
            };
            let explained = client
                .get(&format!("{admin}/debug/decisions/{id}"), REQUEST_TIMEOUT)
                .await
                .unwrap();
            assert_eq!(explained.status, 200, "{}", explained.body);
            let explained: Value = serde_json::from_str(&explained.body).unwrap();
            let candidates = explained["candidates"].as_array().unwrap().clone();
            assert_eq!(candidates.len(), 2, "{explained:#}");
            for c in &candidates {
                for term in [
                    "predicted_ttft_ms",
                    "predicted_tpot_ms",
                    "latency_ms",
                    "latency_samples",
                ] {
                    assert!(c[term].is_number(), "{term} missing in {c:#}");
                }
                assert!(c["predicted_ttft_ms"].as_f64().unwrap() > 0.0, "{c:#}");
            }
            let chosen = &candidates[0];
            seen.push((
                chosen["predicted_ttft_ms"].as_f64().unwrap(),
                measured_ms,
                chosen["endpoint"].as_str().unwrap().to_string(),
            ));
            last_candidates = candidates;
        }
        assert!(seen.len() >= REQUESTS - 4, "too many fail-opens: {seen:?}");

        // Converged: the last requests' predictions are near what they measured.
        let judged = &seen[seen.len() - JUDGED..];
        let mut errors: Vec<f64> = judged
            .iter()
            .map(|(predicted, measured, _)| (predicted - measured).abs() / measured)
            .collect();
        let error = median(&mut errors);
        eprintln!(
            "TTFT prediction: median relative error {error:.3} over the last {JUDGED} requests"
        );
        for (p, m, e) in judged {
            eprintln!("  predicted {p:7.1} ms  measured {m:7.1} ms  on {e}");
        }
        assert!(error < 0.5, "predictions did not converge: {judged:?}");

        // Per endpoint: the slow replica is predicted slower for the same request, once it
        // has taught its model anything.
        let by = |address: &str| {
            last_candidates
                .iter()
                .find(|c| c["endpoint"] == address)
                .unwrap()
                .clone()
        };
        let slow_c = by(&slow);
        let fast_c = by(&fleet.replicas[0].address);
        if slow_c["latency_samples"].as_u64().unwrap() >= 3 {
            let (s, f) = (
                slow_c["predicted_ttft_ms"].as_f64().unwrap(),
                fast_c["predicted_ttft_ms"].as_f64().unwrap(),
            );
            assert!(s > 1.5 * f, "slow {slow_c:#} vs fast {fast_c:#}");
        }

        // Prometheus: samples and prediction error per endpoint.
        let metrics = client
            .get(&format!("{admin}/metrics"), REQUEST_TIMEOUT)
            .await
            .unwrap()
            .body;
        let samples =
            kvroute_harness::prometheus_sum(&metrics, "kvroute_endpoint_latency_samples_total");
        assert!(samples >= (REQUESTS / 2) as f64, "{metrics}");
        assert!(
            metrics.contains("kvroute_endpoint_ttft_prediction_error_ratio{endpoint="),
            "{metrics}"
        );
    };
    common::bounded(TEST_TIMEOUT, body).await;
}
