//! Endpoint Picker mode (issue #21) through real Envoy: `envoy-config/envoy-picker.yaml`'s
//! `ext_proc` filter (full-duplex streamed bodies, the Inference Extension's mode) against the
//! control plane's picker, with no wasm. The same behaviour as the filter's path: a turn follows
//! the turn before it to the replica holding its blocks, bad bodies are answered by a replica as
//! they would be without kvroute, each finished request leaves no load behind, and a picker
//! that is gone costs no request (FailOpen).

use std::time::{Duration, Instant};

use kvroute_harness::{Fleet, prometheus_sum};
use serde_json::json;

use crate::common::{self, Conversation, tools};

const MODEL: &str = "kvroute-picker-model";
const TEST_TIMEOUT: Duration = Duration::from_secs(150);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

fn picker_fleet(name: &str, replicas: usize) -> kvroute_harness::FleetConfig {
    let mut cfg = common::fleet_config(name, replicas, MODEL);
    cfg.picker = true;
    cfg
}

/// Waits until the control plane holds no request in flight: every stream's end reached it.
async fn inflight_drains(fleet: &Fleet) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let inflight = prometheus_sum(&common::cp_metrics(fleet).await, "kvroute_inflight");
        if inflight == 0.0 || Instant::now() > deadline {
            return inflight;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Multi-turn conversations through the picker: every turn after the first lands on the replica
/// that served the turn before, with its history cached; the picker reads the streamed answers,
/// so when they end nothing is left in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_sends_each_turn_where_the_last_one_was_served() {
    let tools = tools();
    common::bounded(
        "picker_sends_each_turn_where_the_last_one_was_served",
        TEST_TIMEOUT,
        async {
            let fleet = common::start_fleet(picker_fleet("e2e-picker-turns", 3), &tools).await;
            let client = fleet.client().clone();
            let (mut followed, mut later_turns) = (0, 0);
            let mut first_replicas = Vec::new();
            for seed in 0..6u64 {
                let mut c = Conversation::new(MODEL, 700 + seed, 400, 40);
                let first = c.turn(&client, &fleet, 8, &[]).await;
                let mut last = common::replica_of(&first, &fleet);
                first_replicas.push(last.clone());
                for _ in 0..2 {
                    let out = c.turn(&client, &fleet, 8, &[]).await;
                    later_turns += 1;
                    let replica = common::replica_of(&out, &fleet);
                    if replica == last && out.cached_tokens.unwrap_or(0) >= 400 {
                        followed += 1;
                    }
                    last = replica;
                }
            }
            first_replicas.sort();
            first_replicas.dedup();
            eprintln!(
                "picker: {followed}/{later_turns} later turns followed their cache; first turns \
                 on {} replicas",
                first_replicas.len()
            );
            assert_eq!(followed, later_turns, "turns that left their cache");
            assert!(
                first_replicas.len() >= 2,
                "new conversations all went to one replica: {first_replicas:?}"
            );
            let inflight = inflight_drains(&fleet).await;
            assert_eq!(inflight, 0.0, "in flight after every stream ended");
            let metrics = common::cp_metrics(&fleet).await;
            let decisions = prometheus_sum(&metrics, "kvroute_decisions_total");
            assert!(decisions >= 18.0, "decisions: {decisions}");
        },
    )
    .await;
}

/// What the filter's path does with bad input, the picker does too: a malformed body, a body
/// of the wrong shape and an unrouted path reach a replica, which answers them (400, 200); no
/// request gets a gateway error. Then the picker is killed: Envoy's FailOpen sends every
/// request on unrouted, and each is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_passes_bad_bodies_on_and_fails_open_when_gone() {
    let tools = tools();
    common::bounded(
        "picker_passes_bad_bodies_on_and_fails_open_when_gone",
        TEST_TIMEOUT,
        async {
            let mut fleet = common::start_fleet(picker_fleet("e2e-picker-bad", 2), &tools).await;
            let url = format!("{}/v1/chat/completions", fleet.url());
            let ct = [("content-type", "application/json")];
            for (case, body, want) in [
                ("malformed", "{\"model\": [[[".to_string(), 400),
                (
                    "messages a string",
                    json!({"model": MODEL, "messages": "hi"}).to_string(),
                    400,
                ),
                ("empty", String::new(), 400),
                (
                    "well formed",
                    common::user_chat(MODEL, "hello there", 4).to_string(),
                    200,
                ),
            ] {
                let r = fleet
                    .client()
                    .request("POST", &url, &ct, Some(body), REQUEST_TIMEOUT)
                    .await
                    .unwrap_or_else(|e| panic!("{case}: {e}"));
                assert_eq!(r.status, want, "{case}: {}", r.body);
                assert!(
                    r.header(kvroute_harness::REPLICA_HEADER).is_some(),
                    "{case}: not answered by a replica: {:?}",
                    r.headers
                );
            }
            let models = fleet
                .client()
                .get(&format!("{}/v1/models", fleet.url()), REQUEST_TIMEOUT)
                .await
                .expect("GET /v1/models");
            assert_eq!(models.status, 200, "{}", models.body);
            assert_eq!(inflight_drains(&fleet).await, 0.0);

            fleet.kill_control_plane();
            // Envoy's health check takes the dead picker out within a second (see
            // envoy-picker.yaml for why requests in that second may fail).
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            let mut statuses = Vec::new();
            for seed in 0..10 {
                let body = common::user_chat(MODEL, &common::words(seed, 30), 4);
                let r = fleet
                    .client()
                    .request("POST", &url, &ct, Some(body.to_string()), REQUEST_TIMEOUT)
                    .await
                    .map_or(0, |r| r.status);
                statuses.push(r);
            }
            assert!(
                statuses.iter().all(|s| *s == 200),
                "with the picker gone: {statuses:?}"
            );
        },
    )
    .await;
}
