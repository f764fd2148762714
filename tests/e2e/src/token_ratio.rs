//! `router.learn_bytes_per_token`, end to end through a real Envoy: the filter reports each
//! response's `usage.prompt_tokens`, and the control plane learns how many canonical bytes the
//! traffic spends per token (`kvroute_bytes_per_token`), instead of assuming 4.

use std::time::Duration;

use kvroute_harness::prometheus_sample;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde_json::{Value, json};

use crate::common;

const TEST_TIMEOUT: Duration = Duration::from_secs(90);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const MODEL: &str = "kvroute-ratio-model";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_learns_the_traffics_bytes_per_token() {
    let run = async {
        let fleet = common::start_configured("token-ratio", 2, MODEL, |cfg| {
            cfg.control_plane_router = json!({"learn_bytes_per_token": true});
        })
        .await;
        let before = common::cp_metrics(&fleet).await;
        assert_eq!(
            prometheus_sample(&before, "kvroute_bytes_per_token"),
            Some(4.0)
        );

        let client = fleet.client();
        let mut rng = SmallRng::seed_from_u64(9);
        let (mut content_bytes, mut prompt_tokens) = (0u64, 0u64);
        for _ in 0..3 {
            let text = kvroute_harness::loadgen::words(&mut rng, 1_500);
            let body = common::user_chat(MODEL, &text, 4);
            let resp = common::chat_ok(client, &fleet, &body, &[], REQUEST_TIMEOUT).await;
            let reply: Value = serde_json::from_str(&resp.body).expect("a JSON completion");
            content_bytes += text.len() as u64;
            prompt_tokens += reply["usage"]["prompt_tokens"]
                .as_u64()
                .expect("usage.prompt_tokens");
        }
        // The canonical prompt adds a few bytes of role and framing to the content.
        let expected = content_bytes as f64 / prompt_tokens as f64;
        let text =
            common::wait_cp_metrics(&fleet, "a learned ratio", Duration::from_secs(20), |t| {
                prometheus_sample(t, "kvroute_bytes_per_token").is_some_and(|v| v != 4.0)
            })
            .await;
        let learned = prometheus_sample(&text, "kvroute_bytes_per_token").unwrap();
        assert!(
            (learned - expected).abs() / expected < 0.05,
            "learned {learned:.3} bytes a token, the content alone gives {expected:.3}"
        );
    };
    common::bounded(TEST_TIMEOUT, run).await;
}
