//! Drives the RELEASE build of the proxy-wasm filter through the wasmtime test host
//! (`proxy_wasm_host`): whole requests, route answers good and bad, feedback ticks.
//!
//! The module is `target/wasm32-unknown-unknown/release/kvroute_filter.wasm`, built by `make
//! test-artifacts`; set `KVROUTE_WASM=/path/to/module.wasm` to test another build.

use std::sync::OnceLock;

use proxy_wasm_host::{FilterAction, FilterHost, FilterModule, HostError, HttpCall};
use scorer_core::canon::canonicalize;
use scorer_core::hash::{DEFAULT_BLOCK_BYTES, block_hashes, model_seed};
use scorer_core::protocol::{ApiKind, FeedbackBatch, RouteRequest, RouteResponse};

const CLUSTER: &str = "kvroute_control_plane";
const DEST: &str = "x-gateway-destination-endpoint";
const SECRET: &str = "the secret prompt words must never leave the proxy";
fn module() -> &'static FilterModule {
    static MODULE: OnceLock<FilterModule> = OnceLock::new();
    MODULE.get_or_init(|| {
        let path = kvroute_harness::locate_wasm().unwrap_or_else(|e| panic!("{e}"));
        FilterModule::from_file(&path).unwrap_or_else(|e| panic!("load {}: {e}", path.display()))
    })
}

fn start(config: &str) -> FilterHost {
    let mut host = module().start(config.as_bytes()).expect("filter starts");
    host.set_clusters(&[CLUSTER]);
    host
}

fn chat_body(turn: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "qwen",
        "stream": true,
        "messages": [
            {"role": "system", "content": SECRET.repeat(20)},
            {"role": "user", "content": turn}
        ]
    }))
    .expect("json")
}

const CHAT_HEADERS: &[(&str, &str)] = &[
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    (":authority", "gateway"),
    ("content-type", "application/json"),
    ("x-gateway-destination-endpoint", "6.6.6.6:666"),
    ("x-prefiller-host-port", "6.6.6.6:667"),
];

/// Sends headers and the body in two chunks; returns the stream and its route call.
fn send_chat(host: &mut FilterHost, body: &[u8]) -> (u32, HttpCall) {
    let id = host.new_stream().expect("stream");
    assert_eq!(
        host.send_request_headers(id, CHAT_HEADERS, false)
            .expect("headers"),
        FilterAction::Pause
    );
    let (a, b) = body.split_at(body.len() / 2);
    assert_eq!(
        host.send_request_body(id, a, false).expect("body"),
        FilterAction::Pause
    );
    assert_eq!(
        host.send_request_body(id, b, true).expect("body"),
        FilterAction::Pause
    );
    assert!(
        !host.request_released(id).expect("stream"),
        "held while routing"
    );
    let calls = host.pending_http_calls();
    assert_eq!(calls.len(), 1, "one route call");
    (id, calls[0].clone())
}

fn route_answer(endpoints: &[&str]) -> Vec<u8> {
    serde_json::to_vec(&RouteResponse {
        decision_id: 77,
        endpoints: endpoints.iter().map(|e| (*e).to_owned()).collect(),
        cached_blocks: 3,
        reason: "prefix".into(),
        ..RouteResponse::default()
    })
    .expect("json")
}

/// Ticks the root context and asserts that the tick starts no HTTP call (`why` says why).
fn assert_quiet_tick(host: &mut FilterHost, why: &str) {
    host.tick().expect("tick");
    assert!(host.pending_http_calls().is_empty(), "{why}");
}

fn metric(host: &FilterHost, name: &str) -> i64 {
    host.metric(name).map_or(0, |m| m.value)
}

#[test]
fn module_imports_only_the_proxy_wasm_abi() {
    let imports = module().imports();
    assert!(!imports.is_empty());
    for (module, name) in &imports {
        assert_eq!(module, "env", "import {module}.{name} is not from env");
        assert!(
            name.starts_with("proxy_"),
            "import env.{name} is not a proxy-wasm hostcall"
        );
    }
    assert!(!imports.iter().any(|(m, _)| m.contains("wasi")));
    let exports = module().exports();
    for export in [
        "proxy_abi_version_0_2_1",
        "malloc",
        "proxy_on_request_headers",
        "proxy_on_http_call_response",
    ] {
        assert!(
            exports.iter().any(|e| e == export),
            "missing export {export}"
        );
    }
}

#[test]
fn routed_request_gets_the_header_and_feedback_reports_usage() {
    let mut host = start("");
    assert_eq!(host.tick_period_ms(), 200);
    let body = chat_body("hello");
    let (id, call) = send_chat(&mut host, &body);

    assert_eq!(call.upstream, CLUSTER);
    assert_eq!(call.header(":method"), Some("POST"));
    assert_eq!(call.header(":path"), Some("/v1/route"));
    assert_eq!(call.header(":authority"), Some("kvroute-control-plane"));
    assert_eq!(call.header("content-type"), Some("application/json"));
    assert_eq!(call.header("x-kvroute-token"), None);
    assert_eq!(call.timeout_ms, 50);
    let request: RouteRequest = serde_json::from_slice(&call.body).expect("RouteRequest JSON");
    assert_eq!(request.model, "qwen");
    // The wasm build hashes exactly like native scorer-core (what the control plane assumes).
    let prompt = canonicalize(ApiKind::Chat, &body).expect("canonical");
    let expected = block_hashes(model_seed("qwen"), &prompt.bytes, DEFAULT_BLOCK_BYTES);
    assert_eq!(expected.len(), 3);
    assert_eq!(request.block_hashes, expected);
    assert_eq!(request.prompt_bytes, prompt.bytes.len() as u64);
    assert!(request.prompt_tokens > 0);
    let sent = String::from_utf8_lossy(&call.body);
    assert!(
        !sent.contains("secret prompt"),
        "prompt text leaked into the route call: {sent}"
    );

    host.advance_ms(4);
    host.respond_http_call(
        call.token,
        200,
        &[],
        &route_answer(&["10.0.0.7:8000", "10.0.0.8:8000"]),
    )
    .expect("answer");
    assert!(host.request_released(id).expect("stream"));
    assert_eq!(host.request_resumes(id).expect("stream"), 1);
    assert_eq!(
        host.upstream_request_header(id, DEST)
            .expect("stream")
            .as_deref(),
        Some("10.0.0.7:8000,10.0.0.8:8000")
    );
    assert_eq!(
        host.upstream_request_header(id, "x-prefiller-host-port")
            .expect("stream"),
        None
    );
    assert_eq!(
        host.upstream_request_body(id).expect("stream"),
        body,
        "body forwarded unchanged"
    );
    assert_eq!(metric(&host, "kvroute_requests_routed"), 1);
    assert_eq!(
        host.metric("kvroute_route_latency_ms")
            .map(|m| m.samples.clone()),
        Some(vec![4])
    );

    host.set_property(&["upstream", "address"], b"10.0.0.7:8000");
    host.advance_ms(20);
    host.send_response_headers(
        id,
        &[(":status", "200"), ("content-type", "text/event-stream")],
        false,
    )
    .expect("response headers");
    for chunk in [
        &b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n"[..],
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":321,\"completion_tokens\":5,",
        b"\"prompt_tokens_details\":{\"cached_tokens\":256}}}\n\ndata: [DONE]\n\n",
    ] {
        assert_eq!(
            host.send_response_body(id, chunk, false).expect("body"),
            FilterAction::Continue
        );
        host.advance_ms(10);
    }
    host.send_response_body(id, b"", true).expect("end");
    host.finish_stream(id).expect("finish");

    host.tick().expect("tick");
    let calls = host.pending_http_calls().to_vec();
    assert_eq!(calls.len(), 1, "one feedback call");
    let feedback = &calls[0];
    assert_eq!(feedback.header(":path"), Some("/v1/feedback"));
    assert_eq!(feedback.upstream, CLUSTER);
    let batch: FeedbackBatch = serde_json::from_slice(&feedback.body).expect("FeedbackBatch JSON");
    assert_eq!(batch.outcomes.len(), 1);
    let outcome = &batch.outcomes[0];
    assert_eq!(outcome.decision_id, 77);
    assert_eq!(outcome.endpoint, "10.0.0.7:8000");
    assert_eq!(outcome.status, 200);
    assert_eq!(outcome.ttfb_ms, Some(20));
    assert_eq!(outcome.total_ms, 50);
    assert_eq!(outcome.prompt_tokens, Some(321));
    assert_eq!(outcome.completion_tokens, Some(5));
    assert_eq!(outcome.cached_tokens, Some(256));

    host.tick().expect("tick");
    assert_eq!(
        host.pending_http_calls().len(),
        1,
        "no second call while one is outstanding"
    );
    host.respond_http_call(feedback.token, 200, &[], b"{}")
        .expect("answer feedback");
    assert_eq!(metric(&host, "kvroute_feedback_sent"), 1);
    assert_quiet_tick(&mut host, "nothing left to flush");
}

#[test]
fn every_bad_route_answer_fails_open() {
    let mut host = start("");
    type Answer = fn(&mut FilterHost, u32) -> Result<(), HostError>;
    let answers: [(&str, Answer); 6] = [
        ("timeout", |h, t| h.time_out_http_call(t)),
        ("reset", |h, t| h.reset_http_call(t)),
        ("status", |h, t| h.respond_http_call(t, 500, &[], b"oops")),
        ("bad_response", |h, t| {
            h.respond_http_call(t, 200, &[], b"<html>garbage</html>")
        }),
        ("no_endpoint", |h, t| {
            h.respond_http_call(t, 200, &[], &route_answer(&[]))
        }),
        ("timeout", |h, t| h.time_out_http_call(t)),
    ];
    let mut call_ids = Vec::new();
    for (i, (kind, answer)) in answers.iter().enumerate() {
        let body = chat_body(kind);
        let (id, call) = send_chat(&mut host, &body);
        let request: RouteRequest = serde_json::from_slice(&call.body).expect("RouteRequest");
        call_ids.extend(request.call_id);
        answer(&mut host, call.token).expect("answer");
        assert!(
            host.request_released(id).expect("stream"),
            "{kind}: request must be released"
        );
        assert_eq!(
            host.upstream_request_header(id, DEST).expect("stream"),
            None,
            "{kind}: no destination"
        );
        assert_eq!(
            host.upstream_request_body(id).expect("stream"),
            body,
            "{kind}: body forwarded"
        );
        assert_eq!(metric(&host, "kvroute_fail_open"), i as i64 + 1);
        host.send_response_headers(id, &[(":status", "200")], false)
            .expect("headers");
        host.send_response_body(id, b"{\"usage\":{\"prompt_tokens\":1}}", true)
            .expect("body");
        host.finish_stream(id).expect("finish");
    }
    let timeout_logs = host
        .logs()
        .iter()
        .filter(|l| l.message.contains("failed open (timeout)"))
        .count();
    assert_eq!(
        timeout_logs,
        1,
        "each failure kind is logged once: {:?}",
        host.logs()
    );
    assert_eq!(metric(&host, "kvroute_requests_routed"), 0);
    // Unrouted requests report no outcome; the route calls given up are withdrawn, so a
    // decision the control plane took late holds no load (issue #20).
    host.tick().expect("tick");
    let calls = host.pending_http_calls().to_vec();
    assert_eq!(calls.len(), 1, "one feedback call: {calls:?}");
    let batch: FeedbackBatch = serde_json::from_slice(&calls[0].body).expect("FeedbackBatch");
    assert!(batch.outcomes.is_empty(), "outcomes: {:?}", batch.outcomes);
    assert!(!batch.withdrawn.is_empty(), "nothing withdrawn");
    for withdrawn in &batch.withdrawn {
        assert!(
            call_ids.contains(withdrawn),
            "withdrew unknown call {withdrawn}"
        );
    }
    host.respond_http_call(calls[0].token, 204, &[], b"")
        .expect("feedback answer");
    assert_quiet_tick(
        &mut host,
        "nothing left to report once the withdrawals landed",
    );
}

#[test]
fn unparseable_body_and_unknown_cluster_fail_open_inside_the_body_callback() {
    let mut host = start("");
    let id = host.new_stream().expect("stream");
    assert_eq!(
        host.send_request_headers(id, CHAT_HEADERS, false)
            .expect("headers"),
        FilterAction::Pause
    );
    assert_eq!(
        host.send_request_body(id, b"{\"messages\": nope", true)
            .expect("body"),
        FilterAction::Continue
    );
    assert!(host.pending_http_calls().is_empty());
    assert!(host.request_released(id).expect("stream"));
    assert_eq!(
        host.upstream_request_header(id, DEST).expect("stream"),
        None
    );
    assert_eq!(metric(&host, "kvroute_body_parse_errors"), 1);

    let mut host = start(r#"{"control_plane_cluster":"not_configured_in_envoy"}"#);
    let id = host.new_stream().expect("stream");
    host.send_request_headers(id, CHAT_HEADERS, false)
        .expect("headers");
    assert_eq!(
        host.send_request_body(id, &chat_body("x"), true)
            .expect("body"),
        FilterAction::Continue
    );
    assert!(host.request_released(id).expect("stream"));
    assert_eq!(
        host.upstream_request_header(id, DEST).expect("stream"),
        None
    );
    assert_eq!(metric(&host, "kvroute_fail_open"), 1);
}

#[test]
fn other_requests_pass_through_with_routing_headers_stripped() {
    let mut host = start(r#"{"max_body_bytes":1000}"#);
    let cases: [&[(&str, &str)]; 3] = [
        &[
            (":method", "GET"),
            (":path", "/v1/models"),
            (DEST, "6.6.6.6:1"),
        ],
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-length", "5000"),
            (DEST, "6.6.6.6:1"),
        ],
        &[
            (":method", "POST"),
            (":path", "/v1/completions"),
            ("content-encoding", "gzip"),
            (DEST, "6.6.6.6:1"),
        ],
    ];
    for headers in cases {
        let id = host.new_stream().expect("stream");
        assert_eq!(
            host.send_request_headers(id, headers, false)
                .expect("headers"),
            FilterAction::Continue
        );
        assert!(host.request_released(id).expect("stream"));
        assert_eq!(
            host.upstream_request_header(id, DEST).expect("stream"),
            None,
            "{headers:?}"
        );
        host.finish_stream(id).expect("finish");
    }
    assert!(host.pending_http_calls().is_empty());
    assert_eq!(metric(&host, "kvroute_requests_skipped"), 2);

    // A body that grows past the limit while buffering is released unrouted.
    let id = host.new_stream().expect("stream");
    host.send_request_headers(id, CHAT_HEADERS, false)
        .expect("headers");
    assert_eq!(
        host.send_request_body(id, &[b' '; 600], false)
            .expect("body"),
        FilterAction::Pause
    );
    assert_eq!(
        host.send_request_body(id, &[b' '; 600], false)
            .expect("body"),
        FilterAction::Continue
    );
    assert!(host.request_released(id).expect("stream"));
    assert_eq!(host.upstream_request_body(id).expect("stream").len(), 1200);
}

#[test]
fn config_token_and_timeouts_reach_the_call() {
    let mut host = start(
        r#"{"auth_token":"s3cret","route_timeout_ms":25,"control_plane_authority":"cp.local",
            "feedback_interval_ms":1000}"#,
    );
    assert_eq!(host.tick_period_ms(), 1000);
    let (_, call) = send_chat(&mut host, &chat_body("x"));
    assert_eq!(call.header("x-kvroute-token"), Some("s3cret"));
    assert_eq!(call.header(":authority"), Some("cp.local"));
    assert_eq!(call.timeout_ms, 25);
}

#[test]
fn bad_plugin_config_is_rejected() {
    for bad in [r#"{"block_bytes":0}"#, "{", r#"{"route_timeout":5}"#] {
        assert!(
            matches!(
                module().start(bad.as_bytes()),
                Err(HostError::ConfigureRejected)
            ),
            "{bad} must be rejected"
        );
    }
}

#[test]
fn client_gone_before_the_answer_leaves_nothing_behind() {
    let mut host = start("");
    let (id, call) = send_chat(&mut host, &chat_body("bye"));
    host.finish_stream(id).expect("finish");
    assert!(
        host.pending_http_calls().is_empty(),
        "the host cancels the stream's call"
    );
    assert!(matches!(
        host.respond_http_call(call.token, 200, &[], b"{}"),
        Err(HostError::UnknownToken(_))
    ));
    assert_quiet_tick(&mut host, "no outcome for an unrouted request");
}

#[test]
fn feedback_failure_drops_the_batch_and_later_batches_flow() {
    let mut host = start("");
    for round in 0..2 {
        let (id, call) = send_chat(&mut host, &chat_body("again"));
        host.respond_http_call(call.token, 200, &[], &route_answer(&["10.0.0.1:8000"]))
            .expect("answer");
        host.send_response_headers(id, &[(":status", "200")], false)
            .expect("headers");
        host.send_response_body(id, b"{}", true).expect("body");
        host.finish_stream(id).expect("finish");
        host.tick().expect("tick");
        let feedback = host.pending_http_calls()[0].clone();
        let batch: FeedbackBatch = serde_json::from_slice(&feedback.body).expect("batch");
        assert_eq!(batch.outcomes.len(), 1, "round {round}");
        if round == 0 {
            host.reset_http_call(feedback.token).expect("reset");
        } else {
            host.respond_http_call(feedback.token, 200, &[], b"")
                .expect("ok");
        }
    }
    assert_eq!(metric(&host, "kvroute_feedback_failed"), 1);
    assert_eq!(metric(&host, "kvroute_feedback_sent"), 1);
}

#[test]
fn trailers_end_the_body_and_the_request_is_routed() {
    let mut host = start("");
    let id = host.new_stream().expect("stream");
    host.send_request_headers(id, CHAT_HEADERS, false)
        .expect("headers");
    let body = chat_body("with trailers");
    assert_eq!(
        host.send_request_body(id, &body, false).expect("body"),
        FilterAction::Pause
    );
    assert_eq!(
        host.send_request_trailers(id, &[("x-trailer", "1")])
            .expect("trailers"),
        FilterAction::Pause
    );
    let call = host.pending_http_calls()[0].clone();
    host.respond_http_call(call.token, 200, &[], &route_answer(&["10.0.0.9:8000"]))
        .expect("answer");
    assert_eq!(
        host.upstream_request_header(id, DEST)
            .expect("stream")
            .as_deref(),
        Some("10.0.0.9:8000")
    );
    assert_eq!(host.upstream_request_body(id).expect("stream"), body);
}

#[test]
fn a_reject_is_answered_locally_with_an_openai_error_and_never_goes_upstream() {
    let mut host = start("{}");
    let (id, call) = send_chat(&mut host, &chat_body("hello"));
    let answer = serde_json::to_vec(&RouteResponse {
        reject: Some(scorer_core::protocol::Reject {
            status: 429,
            message: "the fleet is saturated".into(),
            error_type: "rate_limit_exceeded".into(),
            retry_after_s: Some(3),
        }),
        ..RouteResponse::default()
    })
    .expect("json");
    host.respond_http_call(call.token, 200, &[], &answer)
        .expect("route answer");
    let local = host.local_responses();
    assert_eq!(local.len(), 1, "{local:?}");
    assert_eq!(local[0].status, 429);
    let header = |n: &str| {
        local[0]
            .headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(header("content-type"), Some("application/json"));
    assert_eq!(header("retry-after"), Some("3"));
    let body: serde_json::Value = serde_json::from_slice(&local[0].body).expect("JSON error");
    assert_eq!(body["error"]["type"], "rate_limit_exceeded", "{body}");
    assert_eq!(body["error"]["message"], "the fleet is saturated");
    assert_eq!(body["error"]["code"], 429);
    assert_eq!(host.request_resumes(id).expect("stream"), 0);
    assert_eq!(
        host.metric("kvroute_requests_rejected").map(|m| m.value),
        Some(1)
    );
}
