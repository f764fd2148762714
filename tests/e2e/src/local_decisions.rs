//! `decision: local` through real Envoy: each worker's VM decides on its own copy of the
//! routing state, synced with the control plane on its tick, with no call on the request path.
//!
//! Two Envoy workers mean two VMs, two copies: a conversation's turns are spread over both by
//! Envoy's connection balancing, so a turn can only follow its predecessor when the copy that
//! decides it has learnt the other's decision through the control plane.

use std::time::{Duration, Instant};

use kvroute_harness::{Fleet, HttpClient};
use serde_json::json;

use crate::common::{self, Conversation, replica_of};

const TEST_TIMEOUT: Duration = Duration::from_secs(120);
const MODEL: &str = "kvroute-e2e-local";

/// A fleet of `replicas` whose proxies decide locally (two Envoy workers, a sync every 50 ms),
/// returned once both workers' copies have synced: what both tests start from.
async fn start_local(name: &str, replicas: usize) -> Fleet {
    let fleet = common::start_configured(name, replicas, MODEL, |cfg| {
        cfg.plugin_config = json!({"decision": "local", "sync_interval_ms": 50});
        cfg.envoy_concurrency = 2;
    })
    .await;
    wait_synced(&fleet, 2.0).await;
    fleet
}

/// Waits until every VM of every Envoy has applied at least two syncs (a copy that has not
/// decides nothing locally).
pub(crate) async fn wait_synced(fleet: &Fleet, vms: f64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let applied = fleet.envoy_counter_all("kvroute_sync_applied").await;
        if applied >= vms * 2.0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {applied} syncs applied after 15 s ({})",
            fleet.describe()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Plays `conversations` (seeded from `first_seed`) for `turns` turns each, `pause` before
/// every follow-up: how many follow-ups landed on their predecessor's replica, of how many.
async fn follow_turns(
    fleet: &Fleet,
    client: &HttpClient,
    first_seed: u64,
    conversations: u64,
    turns: usize,
    pause: Duration,
) -> (usize, usize) {
    let (mut followed, mut follow_ups) = (0, 0);
    for c in 0..conversations {
        let mut conv = Conversation::new(MODEL, first_seed + c, 1_200, 150);
        let mut previous = replica_of(&conv.turn(client, fleet, 8, &[]).await, fleet);
        for _ in 1..turns {
            tokio::time::sleep(pause).await;
            let now = replica_of(&conv.turn(client, fleet, 8, &[]).await, fleet);
            follow_ups += 1;
            followed += usize::from(now == previous);
            previous = now;
        }
    }
    (followed, follow_ups)
}

// Turn N+1 lands where turn N was served, decided locally, for at least 95% of turns; and the
// follow-up decisions really were local.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_follow_their_cache_when_proxies_decide_locally() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = start_local("e2e-local", 4).await;
        let client = HttpClient::new();
        // A pause longer than a sync interval plus a round trip: the other copy has heard.
        let (followed, follow_ups) =
            follow_turns(&fleet, &client, 900, 8, 4, Duration::from_millis(150)).await;
        assert!(
            followed * 100 >= follow_ups * 95,
            "only {followed} of {follow_ups} turns followed their cache ({})",
            fleet.describe()
        );
        let routed = fleet.envoy_counter("kvroute_requests_routed").await;
        let local = fleet.envoy_counter("kvroute_decisions_local").await;
        eprintln!(
            "local decisions: {followed} of {follow_ups} turns followed their cache; \
             {local} of {routed} routed requests decided locally"
        );
        // Follow-up turns are hits, decided in the proxy; a conversation's first turn is a
        // miss the copies may leave to the control plane (`router.local.defer_above_ms`).
        let first_turns = 8.0;
        assert!(
            local >= (routed - first_turns) * 0.9 && local > 0.0,
            "{local} of {routed} routed requests were decided locally"
        );
    })
    .await;
}

// The same routing as an Envoy dynamic module (filter/envoy-module): one copy for the process,
// shared by both workers, so a turn follows its predecessor whichever worker takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dynamic_module_decides_locally_and_turns_follow_their_cache() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = common::start_configured("e2e-local-module", 4, MODEL, |cfg| {
            cfg.plugin_config = json!({"decision": "local", "sync_interval_ms": 50});
            cfg.envoy_concurrency = 2;
            cfg.envoy_module = true;
        })
        .await;
        // One copy per process.
        wait_synced(&fleet, 1.0).await;
        let client = HttpClient::new();
        // No pause: both workers decide on the one copy.
        let (followed, follow_ups) = follow_turns(&fleet, &client, 700, 8, 4, Duration::ZERO).await;
        let routed = fleet.envoy_counter("kvroute_requests_routed").await;
        let local = fleet.envoy_counter("kvroute_decisions_local").await;
        eprintln!(
            "dynamic module: {followed} of {follow_ups} turns followed their cache; \
             {local} of {routed} routed requests decided locally"
        );
        assert!(
            followed * 100 >= follow_ups * 95,
            "only {followed} of {follow_ups} turns followed their cache ({})",
            fleet.describe()
        );
        let first_turns = 8.0;
        assert!(
            local >= (routed - first_turns) * 0.9 && local > 0.0,
            "{local} of {routed} routed requests were decided locally ({})",
            fleet.describe()
        );
        // The response side: every streamed turn's first token and outcome reach the control
        // plane in the module's syncs.
        fleet
            .wait_for_control_plane_metrics(
                "32 first tokens and outcomes",
                Duration::from_secs(10),
                |m| {
                    kvroute_harness::prometheus_sum(m, "kvroute_first_tokens_total") >= 32.0
                        && kvroute_harness::prometheus_sum(m, "kvroute_feedback_outcomes_total")
                            >= 32.0
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e} ({})", fleet.describe()));
    })
    .await;
}

// The module's route call (`decision: control-plane`, as precise routes and a stale copy use):
// each request waits for the control plane's answer, then goes where it says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dynamic_module_asks_the_control_plane_when_told_to() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = common::start_configured("e2e-module-route-call", 3, MODEL, |cfg| {
            cfg.plugin_config = json!({"decision": "control-plane"});
            cfg.envoy_concurrency = 2;
            cfg.envoy_module = true;
            cfg.control_plane_router = json!({"models": {"unknown_model": "reject"}});
            cfg.control_plane_extra = json!({"models_interval_ms": 200});
        })
        .await;
        let client = HttpClient::new();
        let (followed, follow_ups) = follow_turns(&fleet, &client, 600, 4, 3, Duration::ZERO).await;
        let routed = fleet.envoy_counter("kvroute_requests_routed").await;
        let local = fleet.envoy_counter("kvroute_decisions_local").await;
        let fail_open = fleet.envoy_counter("kvroute_fail_open").await;
        assert_eq!(
            followed,
            follow_ups,
            "turns left their cache ({})",
            fleet.describe()
        );
        assert_eq!(
            (routed, local, fail_open),
            (12.0, 0.0, 0.0),
            "every request routed by the control plane's answer ({})",
            fleet.describe()
        );
        // A refusal is answered by the module itself (Envoy's local reply), in OpenAI's
        // error shape: a model nobody serves, once the control plane has read the catalogues.
        let body = common::user_chat("gpt-9", "hello there", 4);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let resp = loop {
            let resp = common::post_chat(
                &client,
                &fleet.url(),
                &body,
                &[],
                Duration::from_secs(10),
                &fleet,
            )
            .await;
            // vLLM's own 404 until then (`NotFoundError`).
            if !resp.body.contains("NotFoundError") || std::time::Instant::now() > deadline {
                break resp;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(resp.status, 404, "{} ({})", resp.body, fleet.describe());
        let err: serde_json::Value =
            serde_json::from_str(&resp.body).unwrap_or_else(|e| panic!("{e}: {:?}", resp.body));
        assert_eq!(err["error"]["type"], "model_not_found", "{err:#}");
        assert_eq!(
            fleet.envoy_counter("kvroute_requests_rejected").await,
            1.0,
            "the module counted the refusal"
        );
    })
    .await;
}

// With the control plane gone, copies go stale, requests ask the control plane, fail open and
// are served all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_control_plane_under_local_decisions_loses_no_request() {
    common::bounded(TEST_TIMEOUT, async {
        let mut fleet = start_local("e2e-local-kill", 3).await;
        let client = HttpClient::new();
        let mut conv = Conversation::new(MODEL, 990, 400, 40);
        for _ in 0..4 {
            conv.turn(&client, &fleet, 8, &[]).await;
        }
        fleet.kill_control_plane();
        // Through the stale window and past it: every request is served.
        for _ in 0..12 {
            conv.turn(&client, &fleet, 8, &[]).await;
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        let fail_open = fleet.envoy_counter("kvroute_fail_open").await;
        assert!(fail_open >= 1.0, "no request took the fail-open path");
    })
    .await;
}
