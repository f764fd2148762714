//! End-to-end tests of the control plane over real sockets, against fake vLLM `/metrics` servers.
//!
//! Everything binds 127.0.0.1 on OS-chosen ports, and every wait has a deadline.

// An integration test: its helpers may unwrap (the product's ban is for product code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State as AxumState;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use bytes::Bytes;
use control_plane::ControlPlane;
use control_plane::config::{Config, EndpointConfig};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::oneshot;

const DEADLINE: Duration = Duration::from_secs(5);

/// What a fake replica's `/metrics` currently answers.
#[derive(Debug, Clone)]
struct FakeBehaviour {
    status: u16,
    body: String,
    delay: Duration,
}

/// A tiny vLLM stand-in that only serves `/metrics`.
struct FakeVllm {
    addr: SocketAddr,
    behaviour: Arc<Mutex<FakeBehaviour>>,
}

fn vllm_metrics(running: u32, waiting: u32, kv: f64) -> String {
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {kv}\n\
         # TYPE vllm:time_to_first_token_seconds histogram\n\
         vllm:time_to_first_token_seconds_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"m\"}} 3.0\n\
         vllm:time_to_first_token_seconds_sum{{engine=\"0\",model_name=\"m\"}} NaN\n\
         vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"2048\"}} 1.0\n"
    )
}

impl FakeVllm {
    async fn start(body: String) -> Self {
        let behaviour = Arc::new(Mutex::new(FakeBehaviour {
            status: 200,
            body,
            delay: Duration::ZERO,
        }));
        let app = axum::Router::new()
            .route("/metrics", axum::routing::get(fake_metrics))
            .with_state(behaviour.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { addr, behaviour }
    }

    fn set(&self, f: impl FnOnce(&mut FakeBehaviour)) {
        f(&mut self.behaviour.lock());
    }
}

async fn fake_metrics(
    AxumState(b): AxumState<Arc<Mutex<FakeBehaviour>>>,
) -> axum::response::Response {
    let b = b.lock().clone();
    if !b.delay.is_zero() {
        tokio::time::sleep(b.delay).await;
    }
    (StatusCode::from_u16(b.status).unwrap(), b.body).into_response()
}

/// A port nothing listens on (bound, then released).
async fn closed_port() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

/// A running control plane; stops when dropped.
struct Running {
    api: SocketAddr,
    admin: SocketAddr,
    _stop: oneshot::Sender<()>,
}

fn test_config(endpoints: &[SocketAddr]) -> Config {
    Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        scrape_interval_ms: 20,
        scrape_timeout_ms: 200,
        endpoints: endpoints
            .iter()
            .map(|a| EndpointConfig {
                address: a.to_string(),
                ..Default::default()
            })
            .collect(),
        ..Config::default()
    }
}

async fn start(config: Config) -> Running {
    let cp = ControlPlane::bind(config).await.unwrap();
    let (api, admin) = (cp.api_addr(), cp.admin_addr());
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(cp.run(async move {
        let _ = stopped.await;
    }));
    Running {
        api,
        admin,
        _stop: stop,
    }
}

/// One HTTP/1 request with a deadline; returns status and body text.
async fn http(
    method: &str,
    url: String,
    headers: &[(&str, &str)],
    body: Option<String>,
) -> (u16, String) {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let mut req = Request::builder().method(method).uri(&url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .unwrap();
    let fut = async {
        let resp = client.request(req).await.unwrap();
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    };
    tokio::time::timeout(DEADLINE, fut)
        .await
        .unwrap_or_else(|_| panic!("{method} {url} timed out"))
}

async fn get_json(url: String) -> Value {
    let (status, body) = http("GET", url, &[], None).await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// POSTs `req` to the API port's `path`: the status and the body as JSON (or as a string).
async fn post_api(r: &Running, path: &str, req: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
    let (status, body) = http(
        "POST",
        format!("http://{}{path}", r.api),
        headers,
        Some(req.to_string()),
    )
    .await;
    (
        status,
        serde_json::from_str(&body).unwrap_or(Value::String(body)),
    )
}

/// A one-endpoint config with small request limits (4 block hashes, and these), for the
/// bad-input tests.
fn small_limits(addr: SocketAddr, max_body_bytes: usize, max_feedback_outcomes: usize) -> Config {
    Config {
        max_block_hashes: 4,
        max_body_bytes,
        max_feedback_outcomes,
        ..test_config(&[addr])
    }
}

async fn post_route(r: &Running, req: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
    post_api(r, "/v1/route", req, headers).await
}

/// Polls `check` until it returns true or the deadline passes.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < DEADLINE {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for: {what}");
}

async fn endpoint_view(r: &Running, addr: SocketAddr) -> Value {
    let all = get_json(format!("http://{}/debug/endpoints", r.admin)).await;
    all.as_array()
        .unwrap()
        .iter()
        .find(|e| e["address"] == addr.to_string())
        .cloned()
        .unwrap()
}

/// Waits until the control plane has scraped each of `addrs` once: before that it routes by
/// nothing but the endpoint list.
async fn first_scrapes(r: &Running, addrs: &[SocketAddr]) {
    for &addr in addrs {
        eventually("first scrape", || async {
            !endpoint_view(r, addr).await["metrics"].is_null()
        })
        .await;
    }
}

async fn metrics_text(r: &Running) -> String {
    let (status, body) = http("GET", format!("http://{}/metrics", r.admin), &[], None).await;
    assert_eq!(status, 200);
    body
}

/// Asserts that one scrape of `/metrics` holds every line in `needles`, printing the scrape
/// when one is missing.
async fn assert_metrics(r: &Running, needles: &[&str]) {
    let text = metrics_text(r).await;
    for needle in needles {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

fn route_request(blocks: std::ops::Range<u64>) -> Value {
    let hashes: Vec<u64> = blocks.collect();
    json!({ "model": "m", "block_hashes": hashes, "prompt_bytes": hashes.len() * 256, "prompt_tokens": hashes.len() * 64 })
}

#[tokio::test]
async fn routes_follow_the_prefix_and_decisions_are_explained() {
    let a = FakeVllm::start(vllm_metrics(1, 0, 0.1)).await;
    let b = FakeVllm::start(vllm_metrics(1, 0, 0.1)).await;
    let r = start(test_config(&[a.addr, b.addr])).await;
    first_scrapes(&r, &[a.addr, b.addr]).await;
    let view = endpoint_view(&r, a.addr).await;
    assert_eq!(view["metrics"]["capacity_tokens"], 2048 * 16);
    assert_eq!(view["health"], "ready");

    let (status, first) = post_route(&r, &route_request(1..21), &[]).await;
    assert_eq!(status, 200, "{first}");
    let endpoints = first["endpoints"].as_array().unwrap();
    assert_eq!(endpoints.len(), 2);
    // A longer prompt with the same prefix follows the first once its prefill has drained.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, second) = post_route(&r, &route_request(1..30), &[]).await;
    assert_eq!(second["endpoints"][0], first["endpoints"][0], "{second}");
    assert_eq!(second["reason"], "prefix");
    // 20 hash blocks of 256 bytes, 1,280 tokens: 80 engine blocks of 16 tokens.
    assert_eq!(second["cached_blocks"], 80);

    let id = second["decision_id"].as_u64().unwrap();
    let explained = get_json(format!("http://{}/debug/decisions/{id}", r.admin)).await;
    // The tag is the asking proxy's alone: the explain page does not show it.
    let mut untagged = second.clone();
    assert!(untagged["decision_tag"].as_u64().is_some_and(|t| t != 0));
    untagged.as_object_mut().unwrap().remove("decision_tag");
    assert_eq!(explained["response"], untagged);
    assert_eq!(explained["candidates"].as_array().unwrap().len(), 2);
    assert_eq!(explained["candidates"][0]["cached_blocks"], 80);
    let recent = get_json(format!("http://{}/debug/decisions?limit=1", r.admin)).await;
    assert_eq!(recent[0]["decision_id"], id);

    let (status, _) = http(
        "GET",
        format!("http://{}/debug/decisions/{}", r.admin, id + 1000),
        &[],
        None,
    )
    .await;
    assert_eq!(status, 404);
    let (status, body) = http(
        "GET",
        format!("http://{}/debug/decisions/abc", r.admin),
        &[],
        None,
    )
    .await;
    assert_eq!(status, 400, "{body}");
}

#[tokio::test]
async fn auth_token_guards_both_posts() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(Config {
        auth_token: Some("s3cret".into()),
        ..test_config(&[a.addr])
    })
    .await;
    let req = route_request(0..4);
    let (status, body) = post_route(&r, &req, &[]).await;
    assert_eq!(status, 401);
    assert!(
        body["error"].as_str().unwrap().contains("x-kvroute-token"),
        "{body}"
    );
    assert_eq!(
        post_route(&r, &req, &[("x-kvroute-token", "wrong")])
            .await
            .0,
        401
    );
    let (status, routed) = post_route(&r, &req, &[("x-kvroute-token", "s3cret")]).await;
    assert_eq!(status, 200);

    let batch = json!({ "outcomes": [{ "decision_id": routed["decision_id"], "decision_tag": routed["decision_tag"], "status": 200, "total_ms": 5 }] });
    let url = format!("http://{}/v1/feedback", r.api);
    assert_eq!(
        http("POST", url.clone(), &[], Some(batch.to_string()))
            .await
            .0,
        401
    );
    assert_eq!(
        http(
            "POST",
            url,
            &[("x-kvroute-token", "s3cret")],
            Some(batch.to_string())
        )
        .await
        .0,
        204
    );
    // Health checks need no token.
    assert_eq!(
        http("GET", format!("http://{}/healthz", r.api), &[], None).await,
        (200, "ok".into())
    );
    assert_eq!(
        http("GET", format!("http://{}/healthz", r.admin), &[], None).await,
        (200, "ok".into())
    );
    assert_metrics(
        &r,
        &["kvroute_rejected_requests_total{path=\"/v1/feedback\",reason=\"unauthorized\"} 1"],
    )
    .await;
}

#[tokio::test]
async fn feedback_releases_inflight_load() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(test_config(&[a.addr])).await;
    let (_, routed) = post_route(&r, &route_request(0..8), &[]).await;
    assert_eq!(endpoint_view(&r, a.addr).await["inflight"], 1);
    let batch = json!({ "outcomes": [{
        "decision_id": routed["decision_id"], "decision_tag": routed["decision_tag"],
        "endpoint": a.addr.to_string(), "status": 200, "ttfb_ms": 12, "total_ms": 40, "prompt_tokens": 512, "completion_tokens": 16, "cached_tokens": 0
    }] });
    let (status, body) = http(
        "POST",
        format!("http://{}/v1/feedback", r.api),
        &[],
        Some(batch.to_string()),
    )
    .await;
    assert_eq!(status, 204, "{body}");
    assert_eq!(endpoint_view(&r, a.addr).await["inflight"], 0);
    assert_metrics(
        &r,
        &[
            "kvroute_feedback_outcomes_total 1",
            "kvroute_inflight 0",
            "kvroute_actual_cached_tokens_total 0",
        ],
    )
    .await;
}

#[tokio::test]
async fn bad_input_gets_a_clear_json_error() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(small_limits(a.addr, 1024, 1)).await;
    let route = format!("http://{}/v1/route", r.api);

    let (status, body) = http("POST", route.clone(), &[], Some("{not json".into())).await;
    assert_eq!(status, 400);
    assert!(body.contains("invalid JSON body"), "{body}");
    let (status, body) = http(
        "POST",
        route.clone(),
        &[],
        Some(r#"{"block_hashes":[1]}"#.into()),
    )
    .await;
    assert_eq!(status, 400, "model is required: {body}");
    let (status, body) = http(
        "POST",
        route.clone(),
        &[],
        Some(r#"{"model":"m","block_hashes":[-1]}"#.into()),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = post_route(&r, &route_request(0..5), &[]).await;
    assert_eq!(status, 400);
    assert!(
        body["error"].as_str().unwrap().contains("at most 4"),
        "{body}"
    );
    let (status, body) = http(
        "POST",
        route,
        &[],
        Some(format!("{{\"model\":\"{}\"}}", "x".repeat(2000))),
    )
    .await;
    assert_eq!(status, 413);
    assert!(body.contains("exceeds 1024 bytes"), "{body}");

    let batch = json!({ "outcomes": [{ "decision_id": 1 }, { "decision_id": 2 }] });
    let (status, body) = http(
        "POST",
        format!("http://{}/v1/feedback", r.api),
        &[],
        Some(batch.to_string()),
    )
    .await;
    assert_eq!(status, 400);
    assert!(body.contains("at most 1"), "{body}");
    let (status, body) = http("GET", format!("http://{}/v1/nothing", r.api), &[], None).await;
    assert_eq!(status, 404, "{body}");
    // The service is still fine.
    assert_eq!(post_route(&r, &route_request(0..2), &[]).await.0, 200);
}

#[tokio::test]
async fn any_criticality_header_value_routes_and_a_non_string_is_a_clear_400() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(test_config(&[a.addr])).await;
    // Levels in any case, llm-d priorities, objective names nobody configured, newer values:
    // the route call never fails on them (an unknown name gets the default level).
    for value in [
        "sheddable",
        "Critical",
        "-1",
        "batch",
        "from-the-future",
        "",
    ] {
        let mut req = route_request(0..2);
        req["criticality"] = json!(value);
        let (status, body) = post_route(&r, &req, &[]).await;
        assert_eq!(status, 200, "{value:?}: {body}");
    }
    let mut req = route_request(0..2);
    req["criticality"] = json!(1);
    let (status, body) = post_route(&r, &req, &[]).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("criticality header value"),
        "{body}"
    );
}

#[tokio::test]
async fn dead_and_slow_endpoints_are_dropped_without_stalling_the_others() {
    let healthy = FakeVllm::start(vllm_metrics(2, 0, 0.2)).await;
    let slow = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    slow.set(|b| b.delay = Duration::from_secs(3));
    let dead = closed_port().await;
    let config = Config {
        scrape_interval_ms: 20,
        scrape_timeout_ms: 100,
        unreachable_after_failures: 2,
        ..test_config(&[healthy.addr, slow.addr, dead])
    };
    let r = start(config).await;
    for addr in [slow.addr, dead] {
        eventually("unreachable", || async {
            endpoint_view(&r, addr).await["health"] == "unreachable"
        })
        .await;
    }
    // The healthy endpoint kept being scraped at its own pace meanwhile.
    let ok_scrapes = |text: &str| -> u64 {
        let needle = format!(
            "kvroute_scrapes_total{{endpoint=\"{}\",result=\"ok\"}} ",
            healthy.addr
        );
        text.lines()
            .find_map(|l| l.strip_prefix(&needle))
            .map_or(0, |v| v.parse().unwrap())
    };
    let before = ok_scrapes(&metrics_text(&r).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let text = metrics_text(&r).await;
    assert!(
        ok_scrapes(&text) >= before + 8,
        "healthy scrapes stalled: {before} -> {}",
        ok_scrapes(&text)
    );
    assert!(text.contains(&format!("kvroute_endpoint_up{{endpoint=\"{dead}\"}} 0")));
    // On a starved CI core a refused connect can outlast the 100 ms timeout and count as one;
    // the endpoints keep being scraped, so each kind shows up once the core frees.
    for (addr, result) in [(slow.addr, "timeout"), (dead, "connect")] {
        let needle = format!("kvroute_scrapes_total{{endpoint=\"{addr}\",result=\"{result}\"}}");
        eventually(&needle, || async {
            metrics_text(&r).await.contains(&needle)
        })
        .await;
    }

    let scrapes = get_json(format!("http://{}/debug/scrapes", r.admin)).await;
    let status_of = |addr: String| {
        scrapes
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["address"] == addr)
            .cloned()
            .unwrap()
    };
    let slow_status = status_of(slow.addr.to_string());
    assert!(
        slow_status["last_error"]
            .as_str()
            .unwrap()
            .contains("timed out"),
        "{slow_status}"
    );
    assert!(slow_status["consecutive_failures"].as_u64().unwrap() >= 2);
    // The dead one's last error says why, once a scrape of it was not starved into a timeout.
    eventually(
        "dead endpoint's last error is the refused connect",
        || async {
            let scrapes = get_json(format!("http://{}/debug/scrapes", r.admin)).await;
            scrapes.as_array().unwrap().iter().any(|s| {
                s["address"] == dead.to_string()
                    && s["last_error"].as_str().unwrap_or("").contains("refused")
            })
        },
    )
    .await;
    let healthy_status = status_of(healthy.addr.to_string());
    assert_eq!(healthy_status["last_error"], Value::Null);
    assert!(
        healthy_status["successes"].as_u64().unwrap() >= 8,
        "{healthy_status}"
    );

    for i in 0..5 {
        let (_, routed) = post_route(&r, &route_request(i * 100..i * 100 + 3), &[]).await;
        assert_eq!(
            routed["endpoints"],
            json!([healthy.addr.to_string()]),
            "{routed}"
        );
    }

    // The slow one recovers.
    slow.set(|b| b.delay = Duration::ZERO);
    eventually("recovery", || async {
        endpoint_view(&r, slow.addr).await["health"] == "ready"
    })
    .await;

    // With every endpoint gone, routing answers an empty list (the filter fails open).
    healthy.set(|b| b.status = 503);
    slow.set(|b| b.body = "<html>not metrics</html>".into());
    for addr in [healthy.addr, slow.addr] {
        eventually("all down", || async {
            endpoint_view(&r, addr).await["health"] == "unreachable"
        })
        .await;
    }
    let (status, routed) = post_route(&r, &route_request(0..3), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(routed["endpoints"], json!([]));
    assert_eq!(routed["reason"], "no_endpoint");
    let scrapes =
        |addr, result| format!("kvroute_scrapes_total{{endpoint=\"{addr}\",result=\"{result}\"}}");
    assert_metrics(
        &r,
        &[
            "kvroute_no_endpoint_decisions_total 1",
            &scrapes(slow.addr, "parse"),
            &scrapes(healthy.addr, "status"),
        ],
    )
    .await;
}

#[tokio::test]
async fn stale_metrics_are_flagged_but_the_endpoint_stays_usable() {
    let a = FakeVllm::start(vllm_metrics(3, 1, 0.5)).await;
    let mut config = Config {
        unreachable_after_failures: 1_000_000,
        ..test_config(&[a.addr])
    };
    config.router.stale_after_ms = 300;
    let r = start(config).await;
    first_scrapes(&r, &[a.addr]).await;
    assert_eq!(endpoint_view(&r, a.addr).await["stale"], false);
    a.set(|b| b.status = 500);
    eventually("stale", || async {
        endpoint_view(&r, a.addr).await["stale"] == true
    })
    .await;
    let view = endpoint_view(&r, a.addr).await;
    assert_eq!(view["health"], "ready");
    assert_eq!(view["metrics"]["running"], 3);
    let stale = format!("kvroute_endpoint_stale{{endpoint=\"{}\"}} 1", a.addr);
    assert_metrics(&r, &[&stale]).await;
    let (_, routed) = post_route(&r, &route_request(0..3), &[]).await;
    assert_eq!(routed["endpoints"], json!([a.addr.to_string()]));
}

#[tokio::test]
async fn metrics_exposition_reports_load_and_decisions() {
    let a = FakeVllm::start(vllm_metrics(7, 2, 0.25)).await;
    let r = start(test_config(&[a.addr])).await;
    first_scrapes(&r, &[a.addr]).await;
    post_route(&r, &route_request(0..10), &[]).await;
    let (status, text) = http("GET", format!("http://{}/metrics", r.admin), &[], None).await;
    assert_eq!(status, 200);
    let e = a.addr;
    for needle in [
        "kvroute_decisions_total{reason=\"load\"} 1".to_string(),
        "kvroute_route_duration_seconds_count 1".into(),
        format!("kvroute_endpoint_running{{endpoint=\"{e}\"}} 7"),
        format!("kvroute_endpoint_waiting{{endpoint=\"{e}\"}} 2"),
        format!("kvroute_endpoint_kv_usage{{endpoint=\"{e}\"}} 0.25"),
        format!("kvroute_endpoint_capacity_tokens{{endpoint=\"{e}\"}} 32768"),
        format!("kvroute_endpoint_inflight{{endpoint=\"{e}\"}} 1"),
        format!("kvroute_endpoint_indexed_blocks{{endpoint=\"{e}\"}} 10"),
        format!("kvroute_endpoint_backlog_tokens{{endpoint=\"{e}\"}}"),
        "kvroute_index_blocks 10".into(),
        "kvroute_index_bytes ".into(),
        "kvroute_predicted_cached_tokens_total 0".into(),
        "# EOF".into(),
    ] {
        assert!(text.contains(&needle), "missing {needle:?} in\n{text}");
    }
}

// Issue #18: a turn whose engine delivers less than the index believed is listed on
// `/debug/mismatch` with where the two views part, and counted in the fleet numbers.
#[tokio::test]
async fn a_shortfall_is_listed_on_debug_mismatch_and_counted_in_the_fleet_numbers() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(test_config(&[a.addr])).await;
    first_scrapes(&r, &[a.addr]).await;
    let report = |routed: &Value, prompt: u64, cached: u64| {
        json!({ "outcomes": [{
            "decision_id": routed["decision_id"], "decision_tag": routed["decision_tag"],
            "endpoint": a.addr.to_string(), "status": 200, "total_ms": 1,
            "prompt_tokens": prompt, "completion_tokens": 4, "cached_tokens": cached
        }] })
        .to_string()
    };
    let feedback = format!("http://{}/v1/feedback", r.api);
    let (_, first) = post_route(&r, &route_request(1..21), &[]).await;
    http(
        "POST",
        feedback.clone(),
        &[],
        Some(report(&first, 20 * 64, 0)),
    )
    .await;
    assert_eq!(
        get_json(format!("http://{}/debug/mismatch", r.admin)).await,
        json!([]),
        "a cold index believed nothing"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second_request = route_request(1..30);
    let (_, second) = post_route(&r, &second_request, &[]).await;
    let believed = second["cached_tokens"].as_u64().unwrap();
    let prompt = second_request["prompt_tokens"].as_u64().unwrap();
    let delivered = believed / 4;
    let (status, body) = http(
        "POST",
        feedback,
        &[],
        Some(report(&second, prompt, delivered)),
    )
    .await;
    assert_eq!(status, 204, "{body}");

    let listed = get_json(format!("http://{}/debug/mismatch", r.admin)).await;
    let m = &listed[0];
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(m["decision_id"], second["decision_id"]);
    assert_eq!(m["endpoint"], a.addr.to_string());
    assert_eq!(
        (m["model"].as_str(), m["state"].as_str()),
        (Some("m"), Some("exact"))
    );
    assert_eq!(m["believed_tokens"].as_u64(), Some(believed));
    assert_eq!(m["delivered_tokens"].as_u64(), Some(delivered));
    let block = m["block_tokens"].as_u64().unwrap();
    assert_eq!(m["believed_blocks"].as_u64(), Some(believed / block));
    assert_eq!(m["parting_block"].as_u64(), Some(delivered / block));

    let text = metrics_text(&r).await;
    let pool = |name: &str| format!("kvroute_pool_{name}_total{{pool=\"m\"}} ");
    for needle in [
        format!("{}{}", pool("served_prompt_tokens"), 20 * 64 + prompt),
        format!("{}{delivered}\n", pool("served_cached_tokens")),
        format!("{}{believed}\n", pool("reuse_aimed_tokens")),
        pool("reuse_available_tokens"),
        "kvroute_pool_reuse_gap_tokens_total{pool=\"m\",reason=\"eviction\"} ".into(),
    ] {
        assert!(text.contains(&needle), "missing {needle:?} in\n{text}");
    }
}

#[tokio::test]
async fn bind_refuses_an_invalid_config() {
    let err = ControlPlane::bind(test_config(&[])).await.unwrap_err();
    assert_eq!(err.to_string(), "no endpoints configured");
    let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = Config {
        listen: taken.local_addr().unwrap(),
        ..test_config(&[closed_port().await])
    };
    let err = ControlPlane::bind(config).await.unwrap_err();
    assert!(
        err.to_string().starts_with("cannot listen on 127.0.0.1:"),
        "{err}"
    );
}

/// A free port for the binary's config (bound and released; the OS rarely reuses it at once).
async fn free_port() -> u16 {
    closed_port().await.port()
}

#[cfg(unix)]
#[tokio::test]
async fn binary_serves_and_exits_cleanly_on_sigterm() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let (api, admin) = (free_port().await, free_port().await);
    let dir = std::env::temp_dir().join(format!("kvroute-cp-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.yaml");
    std::fs::write(
        &path,
        format!(
            "listen: 127.0.0.1:{api}\nadmin_listen: 127.0.0.1:{admin}\nauth_token: null\nscrape_interval_ms: 100\n\
             endpoints:\n  - address: {}\nrouter: {{}}\n",
            a.addr
        ),
    )
    .unwrap();
    let exe = env!("CARGO_BIN_EXE_kvroute-control-plane");
    let mut child = tokio::process::Command::new(exe)
        .args(["--config", path.to_str().unwrap(), "--log", "warn"])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    eventually("binary healthz", || async {
        let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        let uri = format!("http://127.0.0.1:{admin}/healthz");
        let req = Request::get(uri).body(Full::new(Bytes::new())).unwrap();
        matches!(tokio::time::timeout(Duration::from_millis(500), client.request(req)).await, Ok(Ok(resp)) if resp.status() == 200)
    })
    .await;
    let body = route_request(0..3).to_string();
    let (status, _) = http(
        "POST",
        format!("http://127.0.0.1:{api}/v1/route"),
        &[],
        Some(body),
    )
    .await;
    assert_eq!(status, 200);

    let pid = child.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(DEADLINE, child.wait())
        .await
        .expect("no exit after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");

    // A bad config is refused with a message naming the problem.
    std::fs::write(&path, "endpoints:\n  - address: not-an-address\n").unwrap();
    let out = tokio::time::timeout(
        DEADLINE,
        tokio::process::Command::new(exe)
            .args(["--config", path.to_str().unwrap()])
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is not ip:port"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

async fn post_sync(r: &Running, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
    post_api(r, "/v1/sync", body, headers).await
}

/// The string `field` of every object in the JSON array `list`.
fn strs<'a>(list: &'a Value, field: &str) -> Vec<&'a str> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|e| e[field].as_str().unwrap())
        .collect()
}

/// A proxy's first sync: no tag yet, nothing seen.
async fn join(r: &Running) -> (u64, u64) {
    let (status, joined) = post_sync(r, &json!({}), &[]).await;
    assert_eq!(status, 200, "{joined}");
    (
        joined["replica"].as_u64().unwrap(),
        joined["next"].as_u64().unwrap(),
    )
}

#[tokio::test]
async fn a_new_proxy_gets_a_tag_the_endpoints_and_the_config() {
    let a = FakeVllm::start(vllm_metrics(1, 0, 0.1)).await;
    let b = FakeVllm::start(vllm_metrics(1, 0, 0.1)).await;
    let mut config = test_config(&[a.addr, b.addr]);
    config.router.fallbacks = 1;
    let r = start(config).await;
    first_scrapes(&r, &[a.addr, b.addr]).await;
    let (status, first) = post_sync(&r, &json!({}), &[]).await;
    assert_eq!(status, 200, "{first}");
    let tag = first["replica"].as_u64().unwrap();
    assert!(tag > 0, "{first}");
    assert_eq!(first["reset"], false);
    assert_eq!(first["events"], json!([]));
    let mut addresses: Vec<&str> = strs(&first["endpoints"], "address");
    addresses.sort_unstable();
    let mut expected = [a.addr.to_string(), b.addr.to_string()];
    expected.sort_unstable();
    assert_eq!(addresses, expected);
    assert_eq!(
        first["endpoints"][0]["metrics"]["capacity_tokens"],
        2048 * 16
    );
    assert_eq!(
        first["config"]["fallbacks"], 1,
        "the configured router config"
    );
    // A second proxy gets another tag; the first keeps its own.
    let (_, second) = post_sync(&r, &json!({}), &[]).await;
    assert_ne!(second["replica"], first["replica"]);
    let (_, again) = post_sync(&r, &json!({ "replica": tag, "since": first["next"] }), &[]).await;
    assert_eq!(again["replica"], tag);
    assert_metrics(
        &r,
        &["kvroute_sync_calls_total 3", "kvroute_sync_log_entries 0"],
    )
    .await;
    // A copy naming the endpoint table it holds gets only what changed since, and no config.
    let cursor = json!({
        "replica": tag, "since": first["next"],
        "table": first["table"], "table_version": first["table_version"],
    });
    let (_, delta) = post_sync(&r, &cursor, &[]).await;
    assert_eq!(delta["delta"], true, "{delta}");
    assert!(delta.get("config").is_none(), "{delta}");
    assert_metrics(&r, &["kvroute_sync_full_tables_total 3"]).await;
}

#[tokio::test]
async fn a_proxys_decision_reaches_other_proxies_and_loads_the_control_plane() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let b = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(test_config(&[a.addr, b.addr])).await;
    first_scrapes(&r, &[a.addr, b.addr]).await;
    let (proxy_a, next_a) = join(&r).await;
    let (proxy_b, next_b) = join(&r).await;
    let decision_id = (proxy_a << 40) + 1;
    let mut request = route_request(1..21);
    request["prompt_text"] = json!("{\"prompt\":\"private words\"}");
    let record =
        json!({ "decision_id": decision_id, "endpoint": b.addr.to_string(), "request": request });
    let (status, answer) = post_sync(
        &r,
        &json!({ "replica": proxy_a, "since": next_a, "decisions": [record] }),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["events"],
        json!([]),
        "a proxy's own entries are not echoed"
    );

    // The control plane accounts for it as its own in-flight load...
    assert_eq!(endpoint_view(&r, b.addr).await["inflight"], 1);
    assert_eq!(endpoint_view(&r, a.addr).await["inflight"], 0);
    // ...and the other proxy learns of it, without the prompt text.
    let (status, seen) = post_sync(&r, &json!({ "replica": proxy_b, "since": next_b }), &[]).await;
    assert_eq!(status, 200, "{seen}");
    assert!(!seen.to_string().contains("private words"), "{seen}");
    let events = seen["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{seen}");
    assert_eq!(events[0]["kind"], "decision");
    assert_eq!(events[0]["origin"], proxy_a);
    assert_eq!(events[0]["record"]["decision_id"], decision_id);
    assert_eq!(events[0]["record"]["endpoint"], b.addr.to_string());
    let next_b = seen["next"].as_u64().unwrap();

    // The prefix it sent there steers the control plane's own route calls once its prefill
    // has drained.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, routed) = post_route(&r, &route_request(1..30), &[]).await;
    assert_eq!(status, 200, "{routed}");
    assert_eq!(routed["endpoints"][0], b.addr.to_string(), "{routed}");
    assert_eq!(routed["cached_blocks"], 80, "{routed}");

    // Its outcome, reported via sync, releases the load and reaches proxy B too.
    let outcome = json!({ "decision_id": decision_id, "endpoint": b.addr.to_string(), "status": 200, "ttfb_ms": 10, "total_ms": 30 });
    let (status, _) = post_sync(
        &r,
        &json!({ "replica": proxy_a, "since": answer["next"], "outcomes": [outcome] }),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let view = endpoint_view(&r, b.addr).await;
    assert_eq!(
        view["inflight"], 1,
        "only the route call's decision is left: {view}"
    );
    let (_, seen) = post_sync(&r, &json!({ "replica": proxy_b, "since": next_b }), &[]).await;
    let kinds: Vec<&str> = strs(&seen["events"], "kind");
    assert_eq!(kinds, ["decision", "outcome"], "{seen}");
    assert_metrics(
        &r,
        &[
            "kvroute_sync_decisions_total 1",
            "kvroute_feedback_outcomes_total 1",
            "kvroute_sync_log_entries 3",
        ],
    )
    .await;
}

// A current filter sends its decisions' block hashes in base64 once told the control plane
// reads them; they are read as arrays are, and go out in base64 only to copies that ask.
#[tokio::test]
async fn hash_lists_in_base64_go_only_to_copies_that_read_them() {
    use base64::Engine as _;
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(test_config(&[a.addr])).await;
    first_scrapes(&r, &[a.addr]).await;
    let (status, hello) = post_sync(&r, &json!({ "compact_hashes": true }), &[]).await;
    assert_eq!(status, 200, "{hello}");
    assert_eq!(
        hello["compact_hashes"], true,
        "the control plane says it reads base64"
    );
    let proxy_a = hello["replica"].as_u64().unwrap();
    let (current, next_current) = join(&r).await;
    let (older, next_older) = join(&r).await;
    let bytes: Vec<u8> = (1..5u64).flat_map(u64::to_le_bytes).collect();
    let base64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    let mut request = route_request(1..5);
    request["block_hashes"] = json!(base64);
    let record = json!({ "decision_id": (proxy_a << 40) + 1, "endpoint": a.addr.to_string(), "request": request });
    let report = json!({ "replica": proxy_a, "since": hello["next"], "decisions": [record], "compact_hashes": true });
    let (status, answer) = post_sync(&r, &report, &[]).await;
    assert_eq!(status, 200, "{answer}");
    let hashes_seen =
        |answer: &Value| answer["events"][0]["record"]["request"]["block_hashes"].clone();
    let cursor = json!({ "replica": current, "since": next_current, "compact_hashes": true });
    let (_, seen) = post_sync(&r, &cursor, &[]).await;
    assert_eq!(hashes_seen(&seen), json!(base64), "{seen}");
    let (_, seen) = post_sync(&r, &json!({ "replica": older, "since": next_older }), &[]).await;
    assert_eq!(hashes_seen(&seen), json!([1, 2, 3, 4]), "{seen}");
    // A list that is not whole hashes is refused, not half-read.
    let mut bad = route_request(1..2);
    bad["block_hashes"] = json!("AAAA");
    let record = json!({ "decision_id": (proxy_a << 40) + 2, "endpoint": a.addr.to_string(), "request": bad });
    let (status, _) = post_sync(
        &r,
        &json!({ "replica": proxy_a, "decisions": [record] }),
        &[],
    )
    .await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn route_call_decisions_and_feedback_appear_in_the_next_sync() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(test_config(&[a.addr])).await;
    let (proxy, next) = join(&r).await;
    let mut req = route_request(0..4);
    req["prompt_text"] = json!("{\"prompt\":\"keep me here\"}");
    req["api"] = json!("completion");
    let (status, routed) = post_route(&r, &req, &[]).await;
    assert_eq!(status, 200, "{routed}");
    let batch = json!({ "outcomes": [{ "decision_id": routed["decision_id"], "decision_tag": routed["decision_tag"], "endpoint": a.addr.to_string(), "status": 200, "total_ms": 5 }] });
    let (status, _) = http(
        "POST",
        format!("http://{}/v1/feedback", r.api),
        &[],
        Some(batch.to_string()),
    )
    .await;
    assert_eq!(status, 204);

    let (status, seen) = post_sync(&r, &json!({ "replica": proxy, "since": next }), &[]).await;
    assert_eq!(status, 200, "{seen}");
    assert!(!seen.to_string().contains("keep me here"), "{seen}");
    let events = seen["events"].as_array().unwrap();
    assert_eq!(events.len(), 2, "{seen}");
    assert_eq!(events[0]["kind"], "decision");
    assert_eq!(events[0]["origin"], 0);
    assert_eq!(events[0]["record"]["decision_id"], routed["decision_id"]);
    assert_eq!(events[0]["record"]["endpoint"], routed["endpoints"][0]);
    assert_eq!(
        events[0]["record"]["request"]["block_hashes"],
        json!([0, 1, 2, 3])
    );
    assert!(events[0]["record"]["request"].get("prompt_text").is_none());
    assert_eq!(events[1]["kind"], "outcome");
    assert_eq!(events[1]["origin"], 0);
    assert_eq!(events[1]["outcome"]["decision_id"], routed["decision_id"]);
    assert_eq!(seen["next"], next + 2);
}

#[tokio::test]
async fn a_proxy_behind_the_log_or_from_another_generation_starts_over() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let mut config = test_config(&[a.addr]);
    config.sync.log_entries = 2;
    let r = start(config).await;
    let (proxy, next) = join(&r).await;
    for i in 0..3 {
        assert_eq!(
            post_route(&r, &route_request(i * 10..i * 10 + 2), &[])
                .await
                .0,
            200
        );
    }
    let (_, behind) = post_sync(&r, &json!({ "replica": proxy, "since": next }), &[]).await;
    assert_eq!(behind["reset"], true, "{behind}");
    assert_eq!(behind["events"].as_array().unwrap().len(), 2);
    // A `since` this log never issued: a copy of the control plane's previous incarnation.
    let (_, stale) = post_sync(&r, &json!({ "replica": proxy, "since": 1_000_000 }), &[]).await;
    assert_ne!(stale["replica"], proxy, "{stale}");
    assert_eq!(stale["events"].as_array().unwrap().len(), 2);
    assert_metrics(
        &r,
        &["kvroute_sync_resets_total 2", "kvroute_sync_log_entries 2"],
    )
    .await;
}

#[tokio::test]
async fn bad_sync_bodies_get_a_clear_400() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(small_limits(a.addr, 4096, 2)).await;
    let url = format!("http://{}/v1/sync", r.api);
    let ep = a.addr.to_string();
    let decision =
        |id: Value| json!({ "decision_id": id, "endpoint": ep, "request": { "model": "m" } });
    let cases: Vec<(&str, String, &str)> = vec![
        ("not JSON", "{not json".into(), "invalid JSON body"),
        ("a string", "\"sync\"".into(), "invalid JSON body"),
        ("since as text", r#"{"since":"soon"}"#.into(), "invalid JSON body"),
        ("decisions not a list", r#"{"decisions":{}}"#.into(), "invalid JSON body"),
        (
            "a decision without a request",
            json!({ "decisions": [{ "decision_id": 1, "endpoint": ep }] }).to_string(),
            "invalid JSON body",
        ),
        ("since past u64", r#"{"since":1e30}"#.into(), "invalid JSON body"),
        ("since past u64, as an integer", r#"{"since":18446744073709551616}"#.into(), "invalid JSON body"),
        ("a negative since", r#"{"since":-1}"#.into(), "invalid JSON body"),
        ("replica past u32", r#"{"replica":4294967296}"#.into(), "invalid JSON body"),
        ("replica 0", r#"{"replica":0}"#.into(), "replica 0"),
        (
            "a negative decision id",
            json!({ "decisions": [decision(json!(-1))] }).to_string(),
            "invalid JSON body",
        ),
        (
            "prompt_tokens past u32",
            json!({ "decisions": [{ "decision_id": 1, "endpoint": ep, "request": { "model": "m", "prompt_tokens": 4294967296u64 } }] }).to_string(),
            "invalid JSON body",
        ),
        (
            "an outcome status past u16",
            json!({ "outcomes": [{ "decision_id": 1, "status": 70000 }] }).to_string(),
            "invalid JSON body",
        ),
        (
            "too many decisions",
            json!({ "decisions": [decision(json!(1)), decision(json!(2)), decision(json!(3))] }).to_string(),
            "3 decisions in one sync, at most 2",
        ),
        (
            "too many outcomes",
            json!({ "outcomes": [{ "decision_id": 1 }, { "decision_id": 2 }, { "decision_id": 3 }] }).to_string(),
            "3 outcomes in one sync, at most 2",
        ),
        (
            "too many block hashes",
            json!({ "decisions": [{ "decision_id": 1, "endpoint": ep, "request": { "model": "m", "block_hashes": [1, 2, 3, 4, 5] } }] }).to_string(),
            "decisions[0].request: 5 block_hashes, at most 4",
        ),
    ];
    for (what, body, message) in cases {
        let (status, text) = http("POST", url.clone(), &[], Some(body)).await;
        assert_eq!(status, 400, "{what}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert!(
            error["error"].as_str().unwrap().contains(message),
            "{what}: {text}"
        );
    }
    let (status, text) = http(
        "POST",
        url.clone(),
        &[],
        Some(format!("{{\"decisions\":[{}]}}", "1,".repeat(3000))),
    )
    .await;
    assert_eq!(status, 413, "{text}");

    // Huge values that are valid numbers are accepted and harm nothing.
    let max = u64::MAX;
    let huge = json!({
        "replica": u32::MAX,
        "since": max,
        "decisions": [{ "decision_id": max, "endpoint": ep, "request": {
            "model": "m", "block_hashes": [max, 0], "prompt_bytes": max, "prompt_tokens": u32::MAX,
            "max_output_tokens": u32::MAX } },
            { "decision_id": 7, "endpoint": "not an endpoint", "request": { "model": "m" } }],
        "outcomes": [{ "decision_id": max, "endpoint": ep, "status": 200, "ttfb_ms": max,
            "total_ms": max, "prompt_tokens": u32::MAX, "completion_tokens": u32::MAX,
            "cached_tokens": u32::MAX }]
    });
    let (status, answer) = post_sync(&r, &huge, &[]).await;
    assert_eq!(status, 200, "{answer}");
    // The service is still fine.
    assert_eq!(post_route(&r, &route_request(0..2), &[]).await.0, 200);
    assert_eq!(post_sync(&r, &json!({}), &[]).await.0, 200);
    assert_metrics(
        &r,
        &["kvroute_rejected_requests_total{path=\"/v1/sync\",reason=\"bad_json\"}"],
    )
    .await;
}

#[tokio::test]
async fn auth_token_guards_sync() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(Config {
        auth_token: Some("s3cret".into()),
        ..test_config(&[a.addr])
    })
    .await;
    let (status, body) = post_sync(&r, &json!({}), &[]).await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("x-kvroute-token"),
        "{body}"
    );
    assert_eq!(
        post_sync(&r, &json!({}), &[("x-kvroute-token", "wrong")])
            .await
            .0,
        401
    );
    // Refused before the body is read: a bad body without the token is still a 401.
    let (status, _) = http(
        "POST",
        format!("http://{}/v1/sync", r.api),
        &[],
        Some("{not json".into()),
    )
    .await;
    assert_eq!(status, 401);
    let (status, joined) = post_sync(&r, &json!({}), &[("x-kvroute-token", "s3cret")]).await;
    assert_eq!(status, 200, "{joined}");
    assert!(joined["replica"].as_u64().unwrap() > 0);
    assert_metrics(
        &r,
        &[
            "kvroute_rejected_requests_total{path=\"/v1/sync\",reason=\"unauthorized\"} 3",
            "kvroute_sync_calls_total 1",
        ],
    )
    .await;
}

/// Issue #20, defect 2: decision ids are sequential; an outcome naming one without the tag the
/// route call was answered with releases nothing, so nobody can free other users' in-flight
/// accounting (or rate their replicas) by counting ids.
#[tokio::test]
async fn outcomes_without_their_decisions_tag_release_nothing() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(test_config(&[a.addr])).await;
    let (_, routed) = post_route(&r, &route_request(0..8), &[]).await;
    let id = routed["decision_id"].as_u64().unwrap();
    let tag = routed["decision_tag"].as_u64().unwrap();
    assert_ne!(tag, 0);
    let feedback = |outcome: Value| {
        let url = format!("http://{}/v1/feedback", r.api);
        async move {
            let batch = json!({ "outcomes": [outcome] }).to_string();
            http("POST", url, &[], Some(batch)).await.0
        }
    };
    // Guessed: no tag, a wrong tag, the neighbour's id with this tag.
    for forged in [
        json!({ "decision_id": id, "status": 200, "total_ms": 5 }),
        json!({ "decision_id": id, "decision_tag": tag ^ 1, "status": 200, "total_ms": 5 }),
        json!({ "decision_id": id + 1, "decision_tag": tag, "status": 200, "total_ms": 5 }),
    ] {
        assert_eq!(feedback(forged).await, 204);
        assert_eq!(endpoint_view(&r, a.addr).await["inflight"], 1);
    }
    assert_metrics(
        &r,
        &["kvroute_rejected_requests_total{path=\"/v1/feedback\",reason=\"unknown_decision\"} 3"],
    )
    .await;
    let real = json!({ "decision_id": id, "decision_tag": tag, "status": 200, "total_ms": 5 });
    assert_eq!(feedback(real).await, 204);
    assert_eq!(endpoint_view(&r, a.addr).await["inflight"], 0);
}

/// A streamed response's first token takes its prefill out of the endpoint's measured queue:
/// reported in a feedback batch or on the next route call, with its decision's tag (a forged
/// one changes nothing), and passed on to locally deciding proxies through the sync log.
#[tokio::test]
async fn first_tokens_empty_the_measured_queue() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(test_config(&[a.addr])).await;
    let copy = post_sync(&r, &json!({}), &[]).await.1;
    let streamed = |blocks: std::ops::Range<u64>| {
        let mut request = route_request(blocks);
        request["stream"] = json!(true);
        request
    };
    let (_, routed) = post_route(&r, &streamed(0..40), &[]).await;
    let (id, tag) = (
        routed["decision_id"].as_u64().unwrap(),
        routed["decision_tag"].as_u64().unwrap(),
    );
    let feedback = |batch: Value| {
        let url = format!("http://{}/v1/feedback", r.api);
        async move { http("POST", url, &[], Some(batch.to_string())).await.0 }
    };
    let forged =
        json!({ "outcomes": [], "first_tokens": [{ "decision_id": id, "decision_tag": tag ^ 1 }] });
    assert_eq!(feedback(forged).await, 204);
    let real =
        json!({ "outcomes": [], "first_tokens": [{ "decision_id": id, "decision_tag": tag }] });
    assert_eq!(feedback(real).await, 204);
    // The measured queue holds a second streamed request until its own first token, which
    // rides on the next route call.
    let (_, second) = post_route(&r, &streamed(100..140), &[]).await;
    let queued = endpoint_view(&r, a.addr).await["backlog_tokens"]
        .as_f64()
        .unwrap();
    assert!(queued > 0.0);
    let mut next = route_request(200..201);
    next["first_tokens"] = json!([{
        "decision_id": second["decision_id"],
        "decision_tag": second["decision_tag"],
    }]);
    post_route(&r, &next, &[]).await;
    let view = endpoint_view(&r, a.addr).await;
    assert!(
        view["backlog_tokens"].as_f64().unwrap() < queued,
        "{view} (was {queued})"
    );
    assert_metrics(
        &r,
        &[
            "kvroute_first_tokens_total 2",
            "kvroute_rejected_requests_total{path=\"/v1/feedback\",reason=\"unknown_decision\"} 1",
        ],
    )
    .await;
    let pulled = post_sync(
        &r,
        &json!({ "replica": copy["replica"], "since": copy["next"], "log": copy["log"] }),
        &[],
    )
    .await
    .1;
    let firsts = pulled["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "first_token")
        .count();
    assert_eq!(firsts, 2, "{pulled}");
}

/// Issue #20, defect 1: a route call the proxy stopped waiting for is withdrawn, whether the
/// control plane decided it already or decides it later (a stalled control plane works through
/// its queue after the proxies failed open).
#[tokio::test]
async fn withdrawn_route_calls_hold_no_load() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(test_config(&[a.addr])).await;
    let feedback = |batch: Value| {
        let url = format!("http://{}/v1/feedback", r.api);
        async move { http("POST", url, &[], Some(batch.to_string())).await.0 }
    };
    let mut late = route_request(0..40);
    late["call_id"] = json!(7);
    let (_, routed) = post_route(&r, &late, &[]).await;
    assert!(!routed["endpoints"].as_array().unwrap().is_empty());
    let view = endpoint_view(&r, a.addr).await;
    assert_eq!(view["inflight"], 1);
    assert!(view["backlog_tokens"].as_f64().unwrap() > 0.0, "{view}");
    assert_eq!(
        feedback(json!({ "outcomes": [], "withdrawn": [7] })).await,
        204
    );
    let view = endpoint_view(&r, a.addr).await;
    assert_eq!(view["inflight"], 0, "{view}");
    assert_eq!(view["backlog_tokens"], 0.0, "{view}");
    // Withdrawn before the call is served: it is not decided.
    assert_eq!(
        feedback(json!({ "outcomes": [], "withdrawn": [8] })).await,
        204
    );
    let mut queued = route_request(100..140);
    queued["call_id"] = json!(8);
    let (_, answer) = post_route(&r, &queued, &[]).await;
    assert_eq!(answer["reason"], "withdrawn", "{answer}");
    assert_eq!(endpoint_view(&r, a.addr).await["inflight"], 0);
    assert_metrics(&r, &["kvroute_withdrawn_decisions_total 2"]).await;
}

/// Issue #20, defect 4: a route call carries the outcomes its proxy had queued, applied before
/// the decision, so a client's finished requests do not count as waiting until the next flush.
#[tokio::test]
async fn a_route_call_reports_the_requests_that_finished_before_it() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(test_config(&[a.addr])).await;
    let (_, first) = post_route(&r, &route_request(0..8), &[]).await;
    assert_eq!(endpoint_view(&r, a.addr).await["inflight"], 1);
    let mut next = route_request(50..58);
    next["finished"] = json!([{
        "decision_id": first["decision_id"], "decision_tag": first["decision_tag"],
        "endpoint": a.addr.to_string(), "status": 200, "total_ms": 1, "completion_tokens": 3
    }]);
    let (status, second) = post_route(&r, &next, &[]).await;
    assert_eq!(status, 200, "{second}");
    // The first is released, only the second is in flight.
    assert_eq!(endpoint_view(&r, a.addr).await["inflight"], 1);
}

/// Issue #20, defect 6: with `admin_token` the admin port's pages need it (bearer, or Basic
/// for a browser); probes and scrapers keep `/healthz` and `/metrics`. Secrets can come from
/// files (a mounted Kubernetes Secret).
#[tokio::test]
async fn admin_pages_need_the_admin_token_and_secrets_come_from_files() {
    let dir = std::env::temp_dir().join(format!("kvroute-secrets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("api"), "api-secret\n").unwrap();
    std::fs::write(dir.join("admin"), " admin-secret \n").unwrap();
    let mut config = test_config(&[]);
    config.endpoints = vec![control_plane::config::EndpointConfig {
        address: "127.0.0.1:9".into(),
        ..Default::default()
    }];
    config.auth_token_file = Some(dir.join("api"));
    config.admin_token_file = Some(dir.join("admin"));
    config.read_secrets().unwrap();
    assert_eq!(config.auth_token.as_deref(), Some("api-secret"));
    let r = start(config).await;
    let page = format!("http://{}/debug/endpoints", r.admin);
    assert_eq!(http("GET", page.clone(), &[], None).await.0, 401);
    let wrong = [("authorization", "Bearer nope")];
    assert_eq!(http("GET", page.clone(), &wrong, None).await.0, 401);
    let bearer = [("authorization", "Bearer admin-secret")];
    assert_eq!(http("GET", page.clone(), &bearer, None).await.0, 200);
    // "ops:admin-secret"
    let basic = [("authorization", "Basic b3BzOmFkbWluLXNlY3JldA==")];
    assert_eq!(http("GET", page, &basic, None).await.0, 200);
    let fleet = format!("http://{}/fleet", r.admin);
    assert_eq!(http("GET", fleet, &[], None).await.0, 401);
    for open in ["/healthz", "/metrics"] {
        let url = format!("http://{}{open}", r.admin);
        assert_eq!(http("GET", url, &[], None).await.0, 200, "{open}");
    }
    let (status, _) = post_route(&r, &route_request(0..2), &[]).await;
    assert_eq!(status, 401);
    let (status, _) = post_route(
        &r,
        &route_request(0..2),
        &[("x-kvroute-token", "api-secret")],
    )
    .await;
    assert_eq!(status, 200);
    // Both ways at once is a configuration error.
    let mut both = test_config(&[]);
    both.auth_token = Some("x".into());
    both.auth_token_file = Some(dir.join("api"));
    assert!(both.validate().is_err());
    std::fs::remove_dir_all(&dir).ok();
}

// A client can send a chain's next turn the moment the answer arrives, through another proxy,
// before the proxy that served it has reported the response id: the route call waits for that
// report (up to `stored_response_wait_ms`) instead of placing the turn without its response.
#[tokio::test]
async fn a_route_call_naming_an_unreported_response_waits_for_its_report() {
    let a = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let b = FakeVllm::start(vllm_metrics(0, 0, 0.0)).await;
    let r = start(Config {
        // Far longer than the report takes here, so the test does not race the clock.
        stored_response_wait_ms: 5_000,
        ..test_config(&[a.addr, b.addr])
    })
    .await;
    first_scrapes(&r, &[a.addr, b.addr]).await;
    let (_, first) = post_route(&r, &route_request(0..8), &[]).await;
    let served_by = first["endpoints"][0].as_str().unwrap().to_string();
    let next = json!({ "model": "m", "previous_response_id": "resp_late", "max_output_tokens": 0 });
    let waiting = post_route(&r, &next, &[]);
    let report = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let batch = json!({ "outcomes": [{
            "decision_id": first["decision_id"], "decision_tag": first["decision_tag"],
            "endpoint": served_by, "status": 200, "response_id": "resp_late"
        }] });
        http(
            "POST",
            format!("http://{}/v1/feedback", r.api),
            &[],
            Some(batch.to_string()),
        )
        .await
    };
    let ((status, answer), (fed, _)) = tokio::join!(waiting, report);
    assert_eq!((status, fed), (200, 204), "{answer}");
    assert_eq!(answer["endpoints"][0], served_by.as_str(), "{answer}");
    assert_eq!(answer["reason"], "stored_response", "{answer}");
    assert_metrics(
        &r,
        &["kvroute_stored_response_waits_total{reason=\"reported\"} 1"],
    )
    .await;
}
