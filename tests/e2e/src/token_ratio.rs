//! `router.learn_bytes_per_token`, end to end through a real Envoy: the filter reports each
//! response's `usage.prompt_tokens`, and the control plane learns how many canonical bytes the
//! traffic spends per token (`kvroute_bytes_per_token`), instead of assuming 4.

use std::time::Duration;

use kvroute_harness::{Fleet, FleetConfig, prometheus_sample};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde_json::{Value, json};

use crate::common::tools;

const TEST_TIMEOUT: Duration = Duration::from_secs(90);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const MODEL: &str = "kvroute-ratio-model";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_learns_the_traffics_bytes_per_token() {
    let tools = tools();
    let run = async {
        let mut cfg = FleetConfig::new("token-ratio");
        cfg.replicas = 2;
        cfg.model = MODEL.to_string();
        cfg.envoy_concurrency = 1;
        cfg.control_plane_router = json!({"learn_bytes_per_token": true});
        let fleet = Fleet::start(cfg, &tools)
            .await
            .unwrap_or_else(|e| panic!("starting the fleet: {e}"));
        let before = fleet
            .control_plane_metrics()
            .await
            .expect("kvroute has a control plane")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            prometheus_sample(&before, "kvroute_bytes_per_token"),
            Some(4.0)
        );

        let client = fleet.client();
        let url = format!("{}/v1/chat/completions", fleet.url());
        let mut rng = SmallRng::seed_from_u64(9);
        let (mut content_bytes, mut prompt_tokens) = (0u64, 0u64);
        for _ in 0..3 {
            let text = kvroute_harness::loadgen::words(&mut rng, 1_500);
            let body = json!({"model": MODEL, "max_tokens": 4,
                              "messages": [{"role": "user", "content": text}]});
            let resp = client
                .request("POST", &url, &[], Some(body.to_string()), REQUEST_TIMEOUT)
                .await
                .unwrap_or_else(|e| panic!("{e} ({})", fleet.describe()));
            assert_eq!(resp.status, 200, "{}", resp.body);
            let reply: Value = serde_json::from_str(&resp.body).expect("a JSON completion");
            content_bytes += text.len() as u64;
            prompt_tokens += reply["usage"]["prompt_tokens"]
                .as_u64()
                .expect("usage.prompt_tokens");
        }
        // The canonical prompt adds a few bytes of role and framing to the content.
        let expected = content_bytes as f64 / prompt_tokens as f64;
        let text = fleet
            .wait_for_control_plane_metrics("a learned ratio", Duration::from_secs(20), |t| {
                prometheus_sample(t, "kvroute_bytes_per_token").is_some_and(|v| v != 4.0)
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let learned = prometheus_sample(&text, "kvroute_bytes_per_token").unwrap();
        assert!(
            (learned - expected).abs() / expected < 0.05,
            "learned {learned:.3} bytes a token, the content alone gives {expected:.3}"
        );
    };
    tokio::time::timeout(TEST_TIMEOUT, run)
        .await
        .expect("the test finished in time");
}
