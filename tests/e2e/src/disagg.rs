//! Prefill/decode disaggregation, end to end through a real Envoy: one replica has the
//! `prefill` role, two have `decode`. A long uncached prompt goes to a decode replica with
//! `x-prefiller-host-port` naming the prefill replica; the decode replica's sidecar (vllm-sim's
//! model of llm-d's) runs the prefill there and decodes with the transferred KV. A short
//! prompt, or a prompt the decode replica already holds, is served by decode alone. The prefill
//! replica is never the decode target. The control plane counts it all in Prometheus.

use std::time::Duration;

use kvroute_harness::{Fleet, HttpClient};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde_json::{Value, json};

use crate::common;

/// Every test finishes within this, or fails.
const TEST_TIMEOUT: Duration = Duration::from_secs(150);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const MODEL: &str = "kvroute-disagg-model";
const DECISION: &str = "x-kvroute-decision";

fn chat(text: &str) -> Value {
    common::user_chat(MODEL, text, 4)
}

/// Sends `body` through Envoy with explain on; returns (serving replica, decision id).
async fn send(fleet: &Fleet, body: &Value) -> (String, Option<String>) {
    let resp = fleet.chat_explained(body, REQUEST_TIMEOUT).await;
    let replica = common::replica_header(&resp);
    let id = resp
        .header(DECISION)
        .and_then(common::decision_id)
        .map(str::to_string);
    (replica, id)
}

async fn json_get(client: &HttpClient, url: &str) -> Value {
    let resp = client.get(url, REQUEST_TIMEOUT).await.unwrap();
    assert_eq!(resp.status, 200, "{url}: {}", resp.body);
    serde_json::from_str(&resp.body).unwrap()
}

/// `(prefills served for others, remote prefills had)` of one replica, from `/sim/stats`.
async fn pd_stats(client: &HttpClient, replica: &str) -> (u64, u64) {
    let v = json_get(client, &format!("http://{replica}/sim/stats")).await;
    (
        v["pd"]["prefills_served"].as_u64().unwrap(),
        v["pd"]["remote_prefills"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_are_prefilled_remotely_short_ones_locally() {
    let body = async {
        let fleet = common::start_configured("e2e-disagg", 3, MODEL, |cfg| {
            cfg.plugin_config = json!({"allow_explain": true});
            cfg.endpoint_extra = vec![
                json!({"role": "prefill"}),
                json!({"role": "decode"}),
                json!({"role": "decode"}),
            ];
            cfg.control_plane_router = json!({"pd": {"threshold_tokens": 512}});
        })
        .await;
        let client = HttpClient::new();
        let admin = common::cp_admin(&fleet);
        let prefill = fleet.replicas[0].address.clone();
        let mut rng = SmallRng::seed_from_u64(3);

        // A long, uncached prompt: decode replica serves, prefill replica prefills.
        let long = chat(&kvroute_harness::loadgen::words(&mut rng, 3_000));
        let (served, id) = send(&fleet, &long).await;
        assert_ne!(
            served, prefill,
            "a prefill replica is never the decode target"
        );
        if let Some(id) = id {
            let d = json_get(&client, &format!("{admin}/debug/decisions/{id}")).await;
            assert_eq!(d["response"]["prefiller"], prefill.as_str(), "{d:#}");
            let roles: Vec<&str> = d["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["role"].as_str().unwrap())
                .collect();
            assert_eq!(roles, ["decode", "decode", "prefill"], "{d:#}");
        }
        assert_eq!(pd_stats(&client, &prefill).await.0, 1);
        assert_eq!(pd_stats(&client, &served).await.1, 1);

        // The same prompt again: the decode replica holds it now, so it serves alone.
        let (again, _) = send(&fleet, &long).await;
        assert_eq!(again, served);
        assert_eq!(pd_stats(&client, &prefill).await.0, 1, "no second prefill");

        // Short prompts never disaggregate, and never land on the prefill replica.
        for i in 0..6 {
            let short = chat(&format!("short question {i}?"));
            let (served, _) = send(&fleet, &short).await;
            assert_ne!(served, prefill);
        }
        assert_eq!(pd_stats(&client, &prefill).await.0, 1);

        // Prometheus: one disaggregated decision, one prefill pick on the prefill replica.
        let metrics = client
            .get(&format!("{admin}/metrics"), REQUEST_TIMEOUT)
            .await
            .unwrap()
            .body;
        let sum = |name: &str| kvroute_harness::prometheus_sum(&metrics, name);
        assert_eq!(
            sum("kvroute_disaggregated_decisions_total"),
            1.0,
            "{metrics}"
        );
        assert!(
            metrics.contains(&format!(
                "kvroute_endpoint_prefill_picks_total{{endpoint=\"{prefill}\"}} 1"
            )),
            "{metrics}"
        );
        assert!(
            metrics.contains(&format!(
                "kvroute_endpoint_role{{endpoint=\"{prefill}\",role=\"prefill\"}} 1"
            )),
            "{metrics}"
        );
    };
    common::bounded(TEST_TIMEOUT, body).await;
}
