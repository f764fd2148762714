//! Endpoint Picker mode (issue #21) through real Envoy: `envoy-config/envoy-picker.yaml`'s
//! `ext_proc` filter (full-duplex streamed bodies, the Inference Extension's mode) against the
//! control plane's picker, with no wasm. The same behaviour as the filter's path: a turn follows
//! the turn before it to the replica holding its blocks, bad bodies are answered by a replica as
//! they would be without kvroute, each finished request leaves no load behind, and a picker
//! that is gone costs no request (FailOpen).

use std::time::{Duration, Instant};

use kvroute_harness::{Fleet, prometheus_sum};
use serde_json::json;

use crate::common::{self, Conversation};

const MODEL: &str = "kvroute-picker-model";
const TEST_TIMEOUT: Duration = Duration::from_secs(150);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// A fleet of `replicas` behind Envoy's `ext_proc` and the control plane's picker, with
/// `configure`'s settings on top ([`common::start_configured`]).
async fn start_picker(
    name: &str,
    replicas: usize,
    configure: impl FnOnce(&mut kvroute_harness::FleetConfig),
) -> Fleet {
    common::start_configured(name, replicas, MODEL, |cfg| {
        common::Form::Picker.apply(cfg);
        configure(cfg);
    })
    .await
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

/// Waits until the control plane knows every replica of `fleet`, which it learns only from its
/// discovery (a file, or an API server), within 20 s.
async fn wait_discovered(fleet: &Fleet) {
    let replicas = fleet.replica_addresses();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let endpoints = common::cp_get(fleet, "/debug/endpoints").await;
        let known = replicas
            .iter()
            .filter(|a| endpoints.contains(a.as_str()))
            .count();
        if known == replicas.len() || Instant::now() > deadline {
            assert_eq!(known, replicas.len(), "discovered: {endpoints}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Multi-turn conversations through the picker: every turn after the first lands on the replica
/// that served the turn before, with its history cached; the picker reads the streamed answers,
/// so when they end nothing is left in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_sends_each_turn_where_the_last_one_was_served() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = start_picker("e2e-picker-turns", 3, |cfg| {
            cfg.plugin_config = json!({"allow_explain": true});
        })
        .await;
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
        // The explain header, as the filter adds it.
        let body = common::user_chat(MODEL, &common::words(77, 200), 4);
        let explained = common::chat_ok(
            fleet.client(),
            &fleet,
            &body,
            &[("x-kvroute-explain", "1")],
            REQUEST_TIMEOUT,
        )
        .await;
        let decision = explained
            .header("x-kvroute-decision")
            .unwrap_or_else(|| panic!("no explain header: {:?}", explained.headers));
        assert!(decision.contains("reason="), "{decision}");
        let inflight = inflight_drains(&fleet).await;
        assert_eq!(inflight, 0.0, "in flight after every stream ended");
        let metrics = common::cp_metrics(&fleet).await;
        let decisions = prometheus_sum(&metrics, "kvroute_decisions_total");
        assert!(decisions >= 18.0, "decisions: {decisions}");
    })
    .await;
}

/// What the filter's path does with bad input, the picker does too: a malformed body, a body
/// of the wrong shape and an unrouted path reach a replica, which answers them (400, 200); no
/// request gets a gateway error. Then the picker is killed: Envoy's FailOpen sends every
/// request on unrouted, and each is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_passes_bad_bodies_on_and_fails_open_when_gone() {
    common::bounded(TEST_TIMEOUT, async {
        let mut fleet = start_picker("e2e-picker-bad", 2, |_| {}).await;
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
    })
    .await;
}

/// A request the control plane refuses (admission: a prompt over its tenant's limit) is
/// answered by the gateway itself, through the picker's `ImmediateResponse`: the same status and
/// OpenAI-style error the wasm filter sends, and no replica sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_refusals_are_answered_by_the_gateway() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = start_picker("e2e-picker-refusal", 1, |cfg| {
            cfg.control_plane_extra = json!({
                "admission": {
                    "queue_limit": 100.0,
                    "kv_limit": 1.0,
                    "default_tenant": {"max_prompt_bytes": 2000},
                }
            });
        })
        .await;
        let long = common::user_chat(MODEL, &common::words(5, 1_000), 4);
        let r = common::chat_through(&fleet, &long, &[], REQUEST_TIMEOUT).await;
        assert_eq!(r.status, 413, "{}", r.body);
        assert!(
            r.header(kvroute_harness::REPLICA_HEADER).is_none(),
            "a refused request reached a replica: {:?}",
            r.headers
        );
        let error: serde_json::Value =
            serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body));
        assert!(error["error"]["message"].is_string(), "{error}");
        let short = common::user_chat(MODEL, "a short one", 4);
        let r = common::chat_through(&fleet, &short, &[], REQUEST_TIMEOUT).await;
        assert_eq!(r.status, 200, "{}", r.body);
    })
    .await;
}

/// The picker with no endpoint list of its own: the control plane learns the replicas from its
/// discovery (a file here, as an InferencePool's pods would come from the API server), and
/// conversations still follow their cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_routes_replicas_it_only_discovered() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = start_picker("e2e-picker-discovery", 2, |cfg| {
            cfg.file_discovery = true;
        })
        .await;
        let client = fleet.client().clone();
        // Discovery reads its file on a short period: wait until both replicas are routed.
        wait_discovered(&fleet).await;
        let mut followed = 0;
        for seed in 0..3u64 {
            let mut c = Conversation::new(MODEL, 900 + seed, 400, 40);
            let first = c.turn(&client, &fleet, 8, &[]).await;
            let second = c.turn(&client, &fleet, 8, &[]).await;
            if common::replica_of(&first, &fleet) == common::replica_of(&second, &fleet)
                && second.cached_tokens.unwrap_or(0) >= 400
            {
                followed += 1;
            }
        }
        assert_eq!(followed, 3, "second turns that left their cache");
    })
    .await;
}

/// Precise mode through the picker: the filter configuration's precise routes make the picker
/// tokenise the prompt (the replicas' render API) and score on the engines' KV events, as the
/// route call does for the wasm filter; turn 2 lands where turn 1's blocks are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_routes_precise_requests_on_the_engines_blocks() {
    common::bounded(TEST_TIMEOUT, async {
        let fleet = start_picker("e2e-picker-precise", 3, |cfg| {
            cfg.sim_args = vec!["--speed".into(), "5".into()];
            cfg.kv_events = true;
            cfg.control_plane_extra = common::remote_tokenizer();
            cfg.control_plane_router = common::precise_router(300);
            cfg.plugin_config = json!({
                "routes": [
                    {"path": "/v1/chat/completions", "api": "chat", "mode": "precise"},
                    {"path": "/v1/completions", "api": "completion", "mode": "precise"}
                ]
            });
        })
        .await;
        common::wait_events_live(&fleet, Duration::from_secs(10)).await;
        let client = fleet.client().clone();
        let mut followed = 0;
        for seed in 0..3u64 {
            let mut c = Conversation::new(MODEL, 1_100 + seed, 600, 60);
            let first = c.turn(&client, &fleet, 8, &[]).await;
            // The engine's events must reach the index before the next turn is scored.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let second = c.turn(&client, &fleet, 8, &[]).await;
            if common::replica_of(&first, &fleet) == common::replica_of(&second, &fleet)
                && second.cached_tokens.unwrap_or(0) >= 500
            {
                followed += 1;
            }
        }
        let metrics = common::cp_metrics(&fleet).await;
        let precise = prometheus_sum(&metrics, "kvroute_precise_routes_total");
        eprintln!("picker precise: {followed}/3 second turns followed; {precise} precise routes");
        assert_eq!(followed, 3, "second turns that left their cache");
        assert!(precise >= 6.0, "precise routes counted: {precise}");
    })
    .await;
}

/// An InferencePool-only configuration: the control plane has no endpoint list and no file,
/// only `discovery.kubernetes.inference_pool`. It reads the pool (selector, target port) and its
/// pods from an API server (the test's own, serving one InferencePool and three Ready pods at
/// their pod IPs on the pool's one target port), and the picker routes them through real Envoy
/// the way a gateway's InferencePool backend would ask it: second turns follow their cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_routes_an_inference_pool_read_from_the_api_server() {
    common::bounded(TEST_TIMEOUT, async {
        let port = kvroute_harness::free_port().expect("a free port");
        let pod_ips: Vec<String> = (0..3).map(kvroute_harness::pod_ip).collect();
        let api = FakeApiServer::start(api_objects(port, &pod_ips)).await;
        let fleet = start_picker("e2e-picker-pool", 3, |cfg| {
            cfg.pod_port = Some(port);
            cfg.discovery = Some(json!({"kubernetes": {
                "api_server": api.url,
                "namespace": POOL_NAMESPACE,
                "token_file": null,
                "ca_file": null,
                "model": MODEL,
                "inference_pool": {"name": POOL_NAME}
            }}));
        })
        .await;
        let client = fleet.client().clone();
        wait_discovered(&fleet).await;
        let mut followed = 0;
        let mut first_replicas = Vec::new();
        for seed in 0..4u64 {
            let mut c = Conversation::new(MODEL, 950 + seed, 400, 40);
            let first = c.turn(&client, &fleet, 8, &[]).await;
            let second = c.turn(&client, &fleet, 8, &[]).await;
            let replica = common::replica_of(&first, &fleet);
            if replica == common::replica_of(&second, &fleet)
                && second.cached_tokens.unwrap_or(0) >= 400
            {
                followed += 1;
            }
            first_replicas.push(replica);
        }
        first_replicas.sort();
        first_replicas.dedup();
        assert_eq!(followed, 4, "second turns that left their cache");
        assert!(
            first_replicas.len() >= 2,
            "new conversations all went to one pod: {first_replicas:?}"
        );
        let asked = api.requests();
        for what in ["/inferencepools/", "/pods?labelSelector="] {
            assert!(
                asked.iter().any(|p| p.contains(what)),
                "the control plane never asked for {what}: {asked:?}"
            );
        }
    })
    .await;
}

const POOL_NAMESPACE: &str = "llm";
const POOL_NAME: &str = "vllm-llama3";

/// The API objects the fake API server answers with: the InferencePool (selector
/// `app=vllm-llama3`, one target port) and its pods, Running and Ready at `pod_ips`.
fn api_objects(port: u16, pod_ips: &[String]) -> ApiObjects {
    let pool = json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": POOL_NAME, "namespace": POOL_NAMESPACE, "resourceVersion": "7"},
        "spec": {
            "selector": {"matchLabels": {"app": POOL_NAME}},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": "kvroute-control-plane", "port": {"number": 9004},
                "failureMode": "FailOpen"}
        }
    });
    let items: Vec<serde_json::Value> = pod_ips
        .iter()
        .enumerate()
        .map(|(i, ip)| {
            json!({
                "metadata": {"name": format!("{POOL_NAME}-{i}"), "namespace": POOL_NAMESPACE,
                    "labels": {"app": POOL_NAME}, "resourceVersion": format!("{}", 10 + i)},
                "status": {"phase": "Running", "podIP": ip,
                    "conditions": [{"type": "Ready", "status": "True"}]}
            })
        })
        .collect();
    let pods = json!({"apiVersion": "v1", "kind": "PodList",
        "metadata": {"resourceVersion": "20"}, "items": items});
    ApiObjects {
        pool: pool.to_string(),
        pods: pods.to_string(),
    }
}

/// What [`FakeApiServer`] serves.
#[derive(Clone)]
struct ApiObjects {
    pool: String,
    pods: String,
}

/// As much of a Kubernetes API server as the control plane's InferencePool discovery reads:
/// `GET` the pool, list its pods, and watch them (the watch is held open with no event, as
/// for a pool that does not change). Plain HTTP/1.1 on 127.0.0.1, one request per connection
/// (the discovery's client opens one for each). Every path asked is recorded.
struct FakeApiServer {
    url: String,
    asked: std::sync::Arc<parking_lot::Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeApiServer {
    async fn start(objects: ApiObjects) -> FakeApiServer {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake API server");
        let url = format!("http://{}", listener.local_addr().expect("its address"));
        let asked = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let log = asked.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (objects, log) = (objects.clone(), log.clone());
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65_536 {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&head);
                    let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
                    log.lock().push(path.clone());
                    let pods = format!("/api/v1/namespaces/{POOL_NAMESPACE}/pods?");
                    let pool = format!(
                        "/apis/inference.networking.k8s.io/v1/namespaces/{POOL_NAMESPACE}/inferencepools/{POOL_NAME}"
                    );
                    if path.starts_with(&pods) && path.contains("watch=1") {
                        let _ = conn
                            .write_all(
                                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                                  transfer-encoding: chunked\r\n\r\n",
                            )
                            .await;
                        // No change to report; the discovery renews the watch on its own.
                        tokio::time::sleep(Duration::from_secs(600)).await;
                        return;
                    }
                    let (status, body) = if path.starts_with(&pods) {
                        ("200 OK", objects.pods)
                    } else if path == pool {
                        ("200 OK", objects.pool)
                    } else {
                        (
                            "404 Not Found",
                            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                "reason": "NotFound", "code": 404})
                            .to_string(),
                        )
                    };
                    let answer = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = conn.write_all(answer.as_bytes()).await;
                });
            }
        });
        FakeApiServer { url, asked, task }
    }

    /// Every path asked so far.
    fn requests(&self) -> Vec<String> {
        self.asked.lock().clone()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
