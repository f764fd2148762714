//! Replicas added and removed under load, through a REAL Envoy 1.40 running the kvroute wasm
//! filter (issue 8, faults).
//!
//! The fleet uses file discovery on both sides (`FleetConfig::file_discovery`): Envoy's `vllm`
//! cluster follows an EDS file (envoy-config/envoy-file-discovery.yaml) and the control plane
//! follows `discovery: {file: ...}`. Clients keep sending chat requests (multi-turn
//! conversations, several at once) while two replicas are added and one is removed gracefully:
//! taken out of both files, drained, and only then stopped. Every request must succeed, the
//! new replicas must serve routed traffic, and the removed one must get nothing after removal.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvroute_harness::{Fleet, FleetConfig, HttpClient, REPLICA_HEADER, prometheus_sum};
use parking_lot::Mutex;
use serde_json::{Value, json};

use crate::common::tools;

const MODEL: &str = "kvroute-scaling-model";
/// One request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest wait for Envoy or the control plane to follow a file change.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Concurrent clients.
const CLIENTS: usize = 4;
/// Turns per conversation.
const TURNS: usize = 3;

/// What the clients saw.
#[derive(Default)]
struct Observed {
    /// Answers per serving replica (the simulator's `x-vllm-sim-replica` header), with the time
    /// each request was sent.
    served: Vec<(Instant, String)>,
    /// Every failed request: status or transport error.
    failures: Vec<String>,
}

/// One client: conversations of [`TURNS`] turns until `stop`.
async fn client_loop(
    url: String,
    id: usize,
    stop: Arc<AtomicBool>,
    observed: Arc<Mutex<Observed>>,
) {
    let client = HttpClient::new();
    let mut conversation = 0usize;
    while !stop.load(Ordering::Relaxed) {
        conversation += 1;
        let system = format!(
            "You are assistant {id}. {}",
            "Answer briefly and precisely. ".repeat(20)
        );
        let mut messages = vec![json!({"role": "system", "content": system})];
        for turn in 0..TURNS {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let question = format!(
                "client {id} conversation {conversation} turn {turn}: how do fleets scale?"
            );
            messages.push(json!({"role": "user", "content": question}));
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8});
            let sent = Instant::now();
            let resp = client
                .request(
                    "POST",
                    &format!("{url}/v1/chat/completions"),
                    &[("content-type", "application/json")],
                    Some(body.to_string()),
                    REQUEST_TIMEOUT,
                )
                .await;
            match resp {
                Ok(r) if r.status == 200 => {
                    let replica = r.header(REPLICA_HEADER).unwrap_or("?").to_string();
                    let answer = serde_json::from_str::<Value>(&r.body)
                        .ok()
                        .and_then(|v| {
                            v["choices"][0]["message"]["content"]
                                .as_str()
                                .map(str::to_string)
                        })
                        .unwrap_or_default();
                    observed.lock().served.push((sent, replica));
                    messages.push(json!({"role": "assistant", "content": answer}));
                }
                Ok(r) => observed
                    .lock()
                    .failures
                    .push(format!("status {}: {}", r.status, r.body)),
                Err(e) => observed.lock().failures.push(e.to_string()),
            }
        }
    }
}

/// `cluster.vllm.membership_total` from Envoy's admin stats.
async fn envoy_membership(fleet: &Fleet) -> Option<u64> {
    let text = fleet
        .envoy_stats("cluster.vllm.membership_total")
        .await
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("cluster.vllm.membership_total: "))
        .and_then(|v| v.trim().parse().ok())
}

/// The control plane's endpoint addresses (`/debug/endpoints`), sorted.
async fn control_plane_endpoints(fleet: &Fleet) -> Vec<String> {
    let Some(cp) = &fleet.control_plane else {
        return Vec::new();
    };
    let url = format!("http://{}/debug/endpoints", cp.admin_address);
    let Ok(resp) = fleet.client().get(&url, Duration::from_secs(5)).await else {
        return Vec::new();
    };
    let list: Vec<Value> = serde_json::from_str(&resp.body).unwrap_or_default();
    let mut out: Vec<String> = list
        .iter()
        .filter_map(|e| e["address"].as_str().map(str::to_string))
        .collect();
    out.sort();
    out
}

/// Waits until Envoy's `vllm` cluster has `want.len()` hosts and the control plane lists
/// exactly `want`.
/// Publishes `replicas` as the fleet's membership and waits until Envoy and the control plane
/// both route to exactly them.
async fn publish_and_converge(fleet: &mut Fleet, replicas: &[String]) {
    fleet
        .publish_replicas(replicas)
        .unwrap_or_else(|e| panic!("{e}"));
    wait_converged(fleet, replicas).await;
}

async fn wait_converged(fleet: &Fleet, want: &[String]) {
    let mut want = want.to_vec();
    want.sort();
    let started = Instant::now();
    loop {
        let envoy = envoy_membership(fleet).await;
        let cp = control_plane_endpoints(fleet).await;
        if envoy == Some(want.len() as u64) && cp == want {
            return;
        }
        assert!(
            started.elapsed() < CONVERGE_TIMEOUT,
            "not converged to {want:?} within {CONVERGE_TIMEOUT:?}: envoy membership {envoy:?}, \
             control plane {cp:?}; {}",
            fleet.describe()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How often each replica was kvroute's first choice in the control plane's recent decisions.
async fn kvroute_first_choices(fleet: &Fleet) -> BTreeMap<String, usize> {
    let cp = fleet.control_plane.as_ref().expect("kvroute topology");
    let url = format!("http://{}/debug/decisions?limit=1000", cp.admin_address);
    let resp = fleet
        .client()
        .get(&url, Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let decisions: Vec<Value> =
        serde_json::from_str(&resp.body).unwrap_or_else(|e| panic!("{url}: {e}: {}", resp.body));
    let mut counts = BTreeMap::new();
    for d in &decisions {
        if let Some(first) = d["endpoints"][0].as_str() {
            *counts.entry(first.to_string()).or_insert(0) += 1;
        }
    }
    counts
}

/// `(requests finished, requests running or waiting)` from a replica's `/metrics`.
async fn replica_counts(fleet: &Fleet, address: &str) -> (f64, f64) {
    let replica = fleet
        .replicas
        .iter()
        .find(|r| r.address == address)
        .expect("a replica of the fleet");
    let text = fleet
        .replica_metrics(replica)
        .await
        .unwrap_or_else(|e| panic!("metrics of {address}: {e}"));
    (
        prometheus_sum(&text, "vllm:request_success_total"),
        prometheus_sum(&text, "vllm:num_requests_running")
            + prometheus_sum(&text, "vllm:num_requests_waiting"),
    )
}

fn served_by(observed: &Mutex<Observed>, since: Instant) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for (sent, replica) in &observed.lock().served {
        if *sent >= since {
            *counts.entry(replica.clone()).or_insert(0) += 1;
        }
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_added_and_removed_under_load() {
    let tools = tools();
    let t0 = Instant::now();
    let phase = |what: &str| {
        let at = t0.elapsed().as_secs_f64();
        println!("e2e_scaling: {what} at {at:.1} s");
    };
    let mut cfg = FleetConfig::new("e2e-scaling");
    cfg.replicas = 2;
    cfg.model = MODEL.into();
    cfg.file_discovery = true;
    cfg.sim_args = vec!["--speed".into(), "4".into()];
    // Generous: a loaded 2-core machine must not turn slow route calls into fail-open noise.
    cfg.plugin_config = json!({"route_timeout_ms": 2000});
    let mut fleet = Fleet::start(cfg, &tools)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let initial = fleet.replica_addresses();
    wait_converged(&fleet, &initial).await;
    phase("fleet of 2 up");

    let stop = Arc::new(AtomicBool::new(false));
    let observed = Arc::new(Mutex::new(Observed::default()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|id| tokio::spawn(client_loop(fleet.url(), id, stop.clone(), observed.clone())))
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;

    // (a) Two replicas join under load.
    let c = fleet
        .start_replica(&tools)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let d = fleet
        .start_replica(&tools)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let grown = vec![initial[0].clone(), initial[1].clone(), c.clone(), d.clone()];
    let added_at = Instant::now();
    publish_and_converge(&mut fleet, &grown).await;
    phase("2 replicas added and seen by Envoy and the control plane");
    let started = Instant::now();
    loop {
        let counts = served_by(&observed, added_at);
        if counts.get(&c).copied().unwrap_or(0) >= 3 && counts.get(&d).copied().unwrap_or(0) >= 3 {
            break;
        }
        assert!(
            started.elapsed() < CONVERGE_TIMEOUT,
            "added replicas got too little traffic: {counts:?}; {}",
            fleet.describe()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for added in [&c, &d] {
        let (finished, _) = replica_counts(&fleet, added).await;
        assert!(finished >= 3.0, "{added} finished only {finished} requests");
    }
    // kvroute itself chose them (not only Envoy's round-robin fallback).
    let chosen = kvroute_first_choices(&fleet).await;
    for added in [&c, &d] {
        assert!(
            chosen.get(added).copied().unwrap_or(0) > 0,
            "kvroute never chose {added}: {chosen:?}"
        );
    }
    phase("added replicas served traffic chosen by kvroute");

    // (b) One original replica leaves gracefully: out of both files, drained, then stopped.
    let leaving = initial[1].clone();
    let shrunk = vec![initial[0].clone(), c.clone(), d.clone()];
    publish_and_converge(&mut fleet, &shrunk).await;
    phase("1 replica removed from Envoy and the control plane");
    // Requests already sent to it finish; then nothing may arrive any more.
    let started = Instant::now();
    let drained_at = loop {
        let (_, busy) = replica_counts(&fleet, &leaving).await;
        if busy == 0.0 {
            break Instant::now();
        }
        assert!(
            started.elapsed() < CONVERGE_TIMEOUT,
            "{leaving} never drained"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (finished_at_drain, _) = replica_counts(&fleet, &leaving).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (finished_later, busy_later) = replica_counts(&fleet, &leaving).await;
    assert_eq!(
        (finished_later, busy_later),
        (finished_at_drain, 0.0),
        "{leaving} received requests after it was removed"
    );
    let after_removal = served_by(&observed, drained_at);
    assert!(
        !after_removal.contains_key(&leaving),
        "{leaving} served requests sent after removal: {after_removal:?}"
    );
    phase("removed replica drained, idle for 3 s");
    fleet.stop_replica(&leaving);
    tokio::time::sleep(Duration::from_secs(2)).await;

    stop.store(true, Ordering::Relaxed);
    for client in clients {
        tokio::time::timeout(REQUEST_TIMEOUT * 2, client)
            .await
            .expect("client finished")
            .expect("client task");
    }
    phase("load stopped");
    let observed = observed.lock();
    let total = observed.served.len();
    let mut by_replica: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, r) in &observed.served {
        *by_replica.entry(r.as_str()).or_insert(0) += 1;
    }
    println!(
        "e2e_scaling: {total} requests answered, {} failed; per replica {by_replica:?}; \
         added {c} and {d}, removed {leaving}; after removal {after_removal:?}",
        observed.failures.len()
    );
    assert!(
        observed.failures.is_empty(),
        "{} of {} requests failed: {:?}; {}",
        observed.failures.len(),
        total + observed.failures.len(),
        &observed.failures[..observed.failures.len().min(5)],
        fleet.describe()
    );
    assert!(total >= 20, "too few requests to show anything: {total}");
}
