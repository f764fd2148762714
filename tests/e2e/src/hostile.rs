//! Hostile and unlucky clients (issue #20), through a real Envoy and a real control plane: one
//! test per attack on the routing state, each asserting that other clients keep being served
//! within a stated bound while it runs and after it stops. The principle
//! (docs/RELIABILITY.md): no single client can change what other clients get beyond its own
//! fair share, and no state a client causes outlives what it pays for. Envoy's own limits
//! (slow bodies, HTTP/2 streams, memory) are `hostile_envoy`'s.

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use kvroute_harness::{Fleet, HttpResponse, prometheus_sum, prometheus_sum_with};
use serde_json::{Value, json};

use crate::common::{self, tools};

const TEST_TIMEOUT: Duration = Duration::from_secs(120);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
const MODEL: &str = "kvroute-hostile-model";
const TOKEN: &str = "hostile-suite-token";

/// Admission that sheds a standard request once every replica has `queue_limit` requests
/// waiting (scraped, plus routed ones the scrape has not seen): phantom load shows at once as
/// 429s for everyone.
fn admission(queue_limit: f64) -> Value {
    json!({
        "admission": {
            "queue_limit": queue_limit,
            "kv_limit": 1.0,
            "sheddable_at": 1.0,
            "standard_at": 1.0,
            "retry_after_s": 1,
        }
    })
}

async fn chat(fleet: &Fleet, seed: u64, headers: &[(&str, &str)]) -> HttpResponse {
    let body = common::user_chat(MODEL, &common::words(seed, 40), 4);
    common::chat_through(fleet, &body, headers, REQUEST_TIMEOUT).await
}

/// Statuses of `n` sequential chats with distinct prompts, and the replica that served each.
async fn sequential(fleet: &Fleet, first_seed: u64, n: u64) -> (HashMap<u16, u32>, Vec<String>) {
    let mut statuses = HashMap::new();
    let mut replicas = Vec::new();
    for seed in first_seed..first_seed + n {
        let r = chat(fleet, seed, &[]).await;
        *statuses.entry(r.status).or_insert(0) += 1;
        if r.status == 200 {
            replicas.push(common::replica_header(&r));
        }
    }
    (statuses, replicas)
}

fn signal(fleet: &Fleet, sig: &str) {
    let pid = fleet
        .control_plane
        .as_ref()
        .expect("kvroute topology")
        .process()
        .pid();
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

async fn cp_value(fleet: &Fleet, name: &str) -> f64 {
    prometheus_sum(&common::cp_metrics(fleet).await, name)
}

/// Whether the control plane's last scrape of every endpoint is fresh (`/debug/endpoints`).
async fn scrapes_fresh(fleet: &Fleet) -> bool {
    let body = common::cp_get(fleet, "/debug/endpoints").await;
    let views: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    views
        .as_array()
        .is_some_and(|v| !v.is_empty() && v.iter().all(|e| e["stale"] == false))
}

/// A fleet of `replicas` whose filter and control plane take `plugin` and `control_plane`
/// (each test here sets both: the defence it checks lives in one or the other).
async fn hostile_fleet(name: &str, replicas: usize, plugin: Value, control_plane: Value) -> Fleet {
    common::start_configured(name, replicas, MODEL, |cfg| {
        cfg.plugin_config = plugin;
        cfg.control_plane_extra = control_plane;
    })
    .await
}

/// Defect 1: a control plane stalled for 3 s (SIGSTOP) while a client sends 20 req/s. Every
/// request fails open after the filter's route timeout, and the control plane, resumed, works
/// through the route calls queued in its socket. Before the fix each became an in-flight entry
/// nobody would report, until `inflight_ttl_ms` (300 s): with admission on, 100% 429s with
/// every replica idle. Now the filter withdraws each call it gave up, and within a few seconds
/// of the resume nothing is in flight and every request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_control_plane_leaves_no_phantom_load() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = hostile_fleet(
            "e2e-hostile-stall",
            2,
            json!({"route_timeout_ms": 150}),
            admission(4.0),
        )
        .await;
        let (before, _) = sequential(&fleet, 1, 5).await;
        assert_eq!(before.get(&200), Some(&5), "{before:?}");

        signal(&fleet, "-STOP");
        let stalled = Instant::now();
        let mut sent = Vec::new();
        while stalled.elapsed() < Duration::from_secs(3) {
            let fleet = &fleet;
            let seed = 1_000 + sent.len() as u64;
            sent.push(async move { chat(fleet, seed, &[]).await.status });
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let during = futures_util::future::join_all(sent).await;
        signal(&fleet, "-CONT");
        let failed = during.iter().filter(|s| **s != 200).count();
        assert_eq!(failed, 0, "requests during the stall fail open: {during:?}");

        // The resumed control plane decides the queued calls, then hears their withdrawals
        // (the filter sends them again until one feedback call gets through). Its scrapes were
        // stalled too: until one lands after the resume every replica's metrics are stale,
        // which admission reads as full (docs/FEATURES.md), so the test waits for that as
        // well; it is not load the stall left behind.
        let deadline = Instant::now() + Duration::from_secs(20);
        let (inflight, fresh) = loop {
            let inflight = cp_value(&fleet, "kvroute_inflight").await;
            let fresh = scrapes_fresh(&fleet).await;
            if (inflight <= 2.0 && fresh) || Instant::now() > deadline {
                break (inflight, fresh);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert!(fresh, "no scrape landed after the resume");
        let withdrawn = cp_value(&fleet, "kvroute_withdrawn_decisions_total").await;
        eprintln!(
            "stall: {} requests failed open, {withdrawn} withdrawn, {inflight} in flight after",
            during.len()
        );
        assert!(inflight <= 2.0, "phantom in-flight entries: {inflight}");
        let (after, _) = sequential(&fleet, 2_000, 20).await;
        assert_eq!(after.get(&200), Some(&20), "after the stall: {after:?}");
    })
    .await;
}

/// Defect 2: what one call to the route and feedback API can do. Without the shared secret
/// nothing is accepted. With it (a compromised or buggy proxy), one route call claiming a
/// 4-GB prompt prices its replica for no more than the blocks it hashed, instead of taking it
/// out of rotation for days; feedback over guessed (sequential) decision ids releases nothing
/// of other clients' in-flight load; a forged `ttfb_ms` is read as the time that really
/// passed. Through all of it, a client's requests keep spreading over both replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_api_call_cannot_take_a_replica_out_or_release_others_load() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = hostile_fleet(
            "e2e-hostile-api",
            2,
            json!({"auth_token": TOKEN, "route_timeout_ms": 5000}),
            json!({"auth_token": TOKEN}),
        )
        .await;
        let cp = fleet.control_plane.as_ref().unwrap();
        let api = format!("http://{}", cp.api_address);
        let post = |path: &str, body: Value, token: bool| {
            let url = format!("{api}{path}");
            let client = fleet.client().clone();
            async move {
                let headers: &[(&str, &str)] = if token {
                    &[("x-kvroute-token", TOKEN)]
                } else {
                    &[]
                };
                client
                    .request(
                        "POST",
                        &url,
                        headers,
                        Some(body.to_string()),
                        REQUEST_TIMEOUT,
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{url}: {e}"))
            }
        };
        // (Its `max_output_tokens` is left at the default: a claim of a huge output is
        // bounded by `router.max_request_tokens` only, see docs/RELIABILITY.md.)
        let forged = json!({"model": MODEL, "prompt_bytes": 4_294_967_295u64,
                                "prompt_tokens": 4_294_967_295u32, "block_hashes": [1, 2]});
        // No token: refused, 300 times over.
        for _ in 0..300 {
            assert_eq!(post("/v1/route", forged.clone(), false).await.status, 401);
        }
        assert_eq!(cp_value(&fleet, "kvroute_inflight").await, 0.0);
        // With the token: one forged call.
        let answer = post("/v1/route", forged, true).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let answer: Value = serde_json::from_str(&answer.body).unwrap();
        let victim = answer["endpoints"][0].as_str().unwrap().to_string();
        let views: Value =
            serde_json::from_str(&common::cp_get(&fleet, "/debug/endpoints").await).unwrap();
        let backlog = views
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["address"] == victim.as_str())
            .map(|v| v["backlog_tokens"].as_f64().unwrap())
            .unwrap();
        eprintln!("a forged 4-GB route call left {backlog} backlog tokens on {victim}");
        assert!(backlog < 1_000.0, "forged size priced: {backlog} tokens");

        // A real client's requests in flight, and feedback over every id near them.
        let slow = async {
            let body = common::user_chat(MODEL, &common::words(7, 40), 200);
            common::chat_through(&fleet, &body, &[], REQUEST_TIMEOUT).await
        };
        let flood = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let seen = cp_value(&fleet, "kvroute_inflight").await;
            let outcomes: Vec<Value> = (0..400u64)
                .map(|id| {
                    json!({"decision_id": id, "endpoint": victim, "status": 200,
                                     "ttfb_ms": 1u64 << 40, "total_ms": 1u64 << 40})
                })
                .collect();
            let r = post("/v1/feedback", json!({ "outcomes": outcomes }), true).await;
            assert_eq!(r.status, 204, "{}", r.body);
            (seen, cp_value(&fleet, "kvroute_inflight").await)
        };
        let (served, (before, after)) = tokio::join!(slow, flood);
        assert_eq!(served.status, 200, "{}", served.body);
        assert!(before >= 2.0, "the forged call and the real one: {before}");
        assert_eq!(after, before, "guessed ids released load");
        let refused = prometheus_sum_with(
            &common::cp_metrics(&fleet).await,
            "kvroute_rejected_requests_total",
            "reason=\"unknown_decision\"",
        );
        assert_eq!(refused, 400.0);

        // The attacked replica costs what one ordinary request in flight costs, not days
        // of prefill: sequential requests prefer the other replica (it has one request
        // fewer), but 12 at once spread over both.
        let burst = (0..12u64).map(|i| {
            let fleet = &fleet;
            async move {
                let body = common::user_chat(MODEL, &common::words(500 + i, 40), 60);
                common::chat_through(fleet, &body, &[], REQUEST_TIMEOUT).await
            }
        });
        let answers = futures_util::future::join_all(burst).await;
        assert!(answers.iter().all(|r| r.status == 200), "{answers:?}");
        let on_victim = answers
            .iter()
            .filter(|r| common::replica_header(r) == victim)
            .count();
        eprintln!("after the attack: {on_victim}/12 concurrent requests on the attacked replica");
        assert!(
            (3..=9).contains(&on_victim),
            "traffic steered: {on_victim}/12 on {victim}"
        );
    })
    .await;
}

/// Defect 4: a client that never has more than one request in flight, sending as fast as it
/// can, with a feedback flush only every second. Before the fix, the outcomes waiting for the
/// flush counted as requests still waiting at their replicas, and admission (4 waiting per
/// replica = full) shed most of them. Now each route call carries the outcomes its proxy has
/// queued, and none is shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequential_client_is_never_shed_for_its_own_finished_requests() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = hostile_fleet(
            "e2e-hostile-lag",
            2,
            json!({"feedback_interval_ms": 1000, "route_timeout_ms": 5000}),
            admission(4.0),
        )
        .await;
        let started = Instant::now();
        let (statuses, _) = sequential(&fleet, 1, 100).await;
        let rate = 100.0 / started.elapsed().as_secs_f64();
        eprintln!("sequential client at {rate:.0} req/s: {statuses:?}");
        assert_eq!(statuses.get(&200), Some(&100), "{statuses:?}");
    })
    .await;
}

/// Defect 5: a client naming a tenant or a criticality in a header gets nothing for it unless
/// an authority in front of the filter sets them (`identity_headers: trusted`): here every
/// tenant but `vip` may send at most 2,000 prompt bytes, and a client claiming `vip` (kvroute's
/// header or llm-d's) is still refused with 413; the header does not reach the replica either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_claim_another_tenant() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = hostile_fleet(
            "e2e-hostile-tenant",
            1,
            json!({"route_timeout_ms": 5000}),
            json!({
                "admission": {
                    "queue_limit": 100.0,
                    "kv_limit": 1.0,
                    "default_tenant": {"max_prompt_bytes": 2000},
                    "tenants": {"vip": {"weight": 1.0}},
                }
            }),
        )
        .await;
        let body = common::user_chat(MODEL, &common::words(3, 1_000), 4);
        for header in ["x-kvroute-tenant", "x-llm-d-inference-fairness-id"] {
            let r = common::chat_through(
                &fleet,
                &body,
                &[(header, "vip"), ("x-kvroute-criticality", "critical")],
                REQUEST_TIMEOUT,
            )
            .await;
            assert_eq!(r.status, 413, "{header}: {}", r.body);
        }
        // A short prompt passes, whatever it claims.
        let short = common::user_chat(MODEL, &common::words(4, 20), 4);
        let claimed = [("x-kvroute-tenant", "vip")];
        common::chat_ok(fleet.client(), &fleet, &short, &claimed, REQUEST_TIMEOUT).await;
    })
    .await;
}

/// Defect 7: a 3.9 MB prompt the replica refuses at once (400: longer than its context) used
/// to leave its whole estimated prefill, about a million tokens, in the replica's backlog until
/// it would have drained, so the router steered everyone else away from an idle replica. Now
/// the outcome of a request refused without a generated token refunds it: within a few
/// seconds no backlog is left, and ordinary requests keep spreading over both replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_the_replica_refuses_leaves_no_backlog() {
    let tools = tools();
    common::bounded(TEST_TIMEOUT, async {
        let cfg = common::fleet_config("e2e-hostile-refused", 2, MODEL);
        let fleet = common::start_fleet(cfg, &tools).await;
        let huge = common::user_chat(MODEL, &"refused ".repeat(480_000), 4);
        let r = common::chat_through(&fleet, &huge, &[], REQUEST_TIMEOUT).await;
        assert_eq!(r.status, 400, "the replica must refuse it: {}", r.body);
        let backlog = |text: &str| -> f64 {
            let views: Value = serde_json::from_str(text).unwrap_or_default();
            views
                .as_array()
                .map(|a| a.iter().filter_map(|v| v["backlog_tokens"].as_f64()).sum())
                .unwrap_or(f64::MAX)
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        let left = loop {
            let left = backlog(&common::cp_get(&fleet, "/debug/endpoints").await);
            if left < 1_000.0 || Instant::now() > deadline {
                break left;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        eprintln!("a refused 3.9 MB prompt left {left} backlog tokens");
        assert!(left < 1_000.0, "backlog left by a refused prompt: {left}");
        // Concurrent ordinary requests use both replicas.
        let results =
            futures_util::future::join_all((0..8u64).map(|seed| chat(&fleet, 3_000 + seed, &[])))
                .await;
        let mut replicas: Vec<String> = results
            .iter()
            .filter(|r| r.status == 200)
            .map(common::replica_header)
            .collect();
        assert_eq!(replicas.len(), 8, "ordinary requests after the refusal");
        replicas.sort();
        replicas.dedup();
        assert_eq!(replicas.len(), 2, "one replica was avoided: {replicas:?}");
    })
    .await;
}
