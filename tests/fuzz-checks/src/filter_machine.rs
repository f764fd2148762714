//! The filter's per-request state machine (`RequestMachine`) and root outcome queue
//! (`RootState`) fed arbitrary sequences of host callbacks: headers, body sizes, bodies,
//! trailers, route answers (well-formed, garbage, reset), response chunks and stream ends, in
//! any order and any number of times. The host glue executes whatever comes back, so besides
//! "never panics" every effect must make sense:
//! - only the routing headers are removed, only the destination header is set, once, with a
//!   plausible `ip:port` list, and only after a route call;
//! - at most one route call per request, whose body is a `RouteRequest` without the prompt;
//! - a resume only after a route call, at most once; routed and failed open never both;
//! - at most one outcome per request, only for routed requests;
//! - the outcome queue stays bounded and every feedback batch is a valid `FeedbackBatch`.

use arbitrary::Arbitrary;
use kvroute_filter::config::{FilterConfig, RouteMode};
use kvroute_filter::machine::{
    BodyStep, Counter, DECISION_HEADER, EXPLAIN_HEADER, Effect, FailKind, LOCAL_REPLY_HEADER,
    PREFILLER_HEADER, RequestMachine, Step,
};
use kvroute_filter::root::RootState;
use scorer_core::protocol::{FeedbackBatch, Reject, RouteRequest, RouteResponse};

#[derive(Arbitrary, Debug)]
enum Name {
    Method,
    Path,
    ContentType,
    ContentLength,
    ContentEncoding,
    Session,
    Destination,
    Prefiller,
    Explain,
    Decision,
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum Val {
    Post,
    Get,
    ChatPath,
    CompletionPath,
    ResponsesPath,
    StoredResponsePath,
    CancelPath,
    MessagesPath,
    LoadPath,
    Json,
    Len(u32),
    One,
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum BodyKind {
    Raw(Vec<u8>),
    Chat {
        model: String,
        messages: Vec<(String, String)>,
        max_tokens: Option<u32>,
        user: Option<String>,
    },
    Completion {
        model: Option<String>,
        prompt: String,
    },
}

#[derive(Arbitrary, Debug)]
enum Answer {
    Raw(Vec<u8>),
    Endpoints(u64, Vec<String>),
    Good(u64, u8),
    /// A well-formed answer with a prefiller (P/D) or a refusal (admission, unknown model).
    Extended(u64, u8, Option<String>, Option<(u16, String, Option<u32>)>),
}

#[derive(Arbitrary, Debug)]
enum Event {
    Headers(Vec<(Name, Val)>, bool),
    Body(u32, bool),
    Trailers,
    BodyReadFailed,
    /// With `Some(step)`, the timed variant whose clock advances `step` ns a call.
    BodyComplete(BodyKind, Option<u32>),
    Dispatched,
    DispatchFailed,
    RouteResponse(Option<u16>, Answer),
    RouteFailure(u8),
    ResponseHeaders(Option<u16>, Option<String>),
    ResponseBody(Vec<u8>),
    Done,
    Tick(u16),
    FeedbackResponse(Option<u16>),
    FeedbackDispatchFailed,
    NewRequest,
}

#[derive(Arbitrary, Debug)]
struct Input {
    small_limits: bool,
    precise: bool,
    explain: bool,
    block_bytes: u8,
    events: Vec<Event>,
}

/// What the fuzzer has seen one request do so far.
#[derive(Default)]
struct Seen {
    dispatched: bool,
    header_set: bool,
    resumed: bool,
    routed: bool,
    failed_open: bool,
    outcome: bool,
    first_token: bool,
}

fn header_name(n: &Name) -> String {
    match n {
        Name::Method => ":method".into(),
        Name::Path => ":path".into(),
        Name::ContentType => "content-type".into(),
        Name::ContentLength => "content-length".into(),
        Name::ContentEncoding => "content-encoding".into(),
        Name::Session => "x-session-id".into(),
        Name::Destination => "x-gateway-destination-endpoint".into(),
        Name::Prefiller => PREFILLER_HEADER.into(),
        Name::Explain => EXPLAIN_HEADER.into(),
        Name::Decision => DECISION_HEADER.into(),
        Name::Other(s) => s.clone(),
    }
}

fn header_value(v: &Val) -> Vec<u8> {
    match v {
        Val::Post => b"POST".to_vec(),
        Val::Get => b"GET".to_vec(),
        Val::ChatPath => b"/v1/chat/completions".to_vec(),
        Val::CompletionPath => b"/v1/completions?x=1".to_vec(),
        Val::ResponsesPath => b"/v1/responses".to_vec(),
        Val::StoredResponsePath => b"/v1/responses/resp_1f".to_vec(),
        Val::CancelPath => b"/v1/responses/resp_1f/cancel".to_vec(),
        Val::MessagesPath => b"/v1/messages".to_vec(),
        Val::LoadPath => b"/v1/embeddings".to_vec(),
        Val::Json => b"application/json; charset=utf-8".to_vec(),
        Val::Len(n) => n.to_string().into_bytes(),
        Val::One => b"1".to_vec(),
        Val::Raw(b) => b.clone(),
    }
}

fn body_bytes(kind: &BodyKind) -> Vec<u8> {
    match kind {
        BodyKind::Raw(b) => b.clone(),
        BodyKind::Chat {
            model,
            messages,
            max_tokens,
            user,
        } => serde_json::to_vec(&serde_json::json!({
            "model": model,
            "messages": messages.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect::<Vec<_>>(),
            "max_tokens": max_tokens,
            "user": user,
        }))
        .unwrap_or_default(),
        BodyKind::Completion { model, prompt } => {
            serde_json::to_vec(&serde_json::json!({"model": model, "prompt": prompt}))
                .unwrap_or_default()
        }
    }
}

fn answer_bytes(a: &Answer) -> Vec<u8> {
    match a {
        Answer::Raw(b) => b.clone(),
        Answer::Endpoints(id, endpoints) => serde_json::to_vec(&RouteResponse {
            decision_id: *id,
            endpoints: endpoints.clone(),
            cached_blocks: 0,
            reason: "fuzz".into(),
            ..RouteResponse::default()
        })
        .unwrap_or_default(),
        Answer::Good(id, n) => serde_json::to_vec(&RouteResponse {
            decision_id: *id,
            endpoints: (0..*n % 4).map(|i| format!("10.0.0.{i}:8000")).collect(),
            cached_blocks: 1,
            reason: "prefix".into(),
            ..RouteResponse::default()
        })
        .unwrap_or_default(),
        Answer::Extended(id, n, prefiller, reject) => serde_json::to_vec(&RouteResponse {
            decision_id: *id,
            endpoints: (0..*n % 4).map(|i| format!("10.0.0.{i}:8000")).collect(),
            cached_blocks: 1,
            reason: "prefix".into(),
            prefiller: prefiller.clone(),
            reject: reject.as_ref().map(|(status, message, retry)| Reject {
                status: *status,
                message: message.clone(),
                error_type: "fuzz".into(),
                retry_after_s: *retry,
            }),
            ..RouteResponse::default()
        })
        .unwrap_or_default(),
    }
}

fn check_step(step: &Step, seen: &mut Seen, config: &FilterConfig, root: &mut RootState) {
    let precise = config.routes.iter().any(|r| r.mode == RouteMode::Precise);
    for effect in &step.effects {
        match effect {
            Effect::RemoveRequestHeader(name) => {
                // Routing headers always; tenant and criticality unless an authority sets them.
                let identity = name.eq_ignore_ascii_case(&config.tenant_header)
                    || name.eq_ignore_ascii_case(&config.criticality_header)
                    || name == kvroute_filter::machine::LLMD_FAIRNESS_HEADER
                    || name == kvroute_filter::machine::LLMD_OBJECTIVE_HEADER;
                assert!(
                    name == &config.destination_header
                        || name == PREFILLER_HEADER
                        || name == DECISION_HEADER
                        || name == LOCAL_REPLY_HEADER
                        || (identity
                            && config.identity_headers
                                != kvroute_filter::config::IdentityHeaders::Trusted),
                    "removed an unrelated header {name:?}"
                );
            }
            Effect::SetRequestHeader { name, value }
                if name == PREFILLER_HEADER || name == LOCAL_REPLY_HEADER =>
            {
                assert!(seen.dispatched, "{name} set without a route call");
                assert!(!value.is_empty());
            }
            Effect::SetRequestHeader { name, value } => {
                assert_eq!(name, &config.destination_header);
                assert!(seen.dispatched, "destination set without a route call");
                assert!(!seen.header_set, "destination set twice");
                seen.header_set = true;
                assert!(!value.is_empty());
                for endpoint in value.split(',') {
                    assert!(endpoint.contains(':'), "bad endpoint {endpoint:?}");
                    assert!(
                        endpoint.bytes().all(|b| b.is_ascii_graphic()),
                        "bad endpoint {endpoint:?}"
                    );
                }
            }
            Effect::DispatchRoute { body } => {
                assert!(!seen.dispatched, "two route calls for one request");
                seen.dispatched = true;
                let req: RouteRequest =
                    serde_json::from_slice(body).expect("the route call is a RouteRequest");
                if !precise {
                    assert!(
                        req.prompt_text.is_none(),
                        "approximate mode sent the prompt"
                    );
                }
                assert_eq!(
                    req.block_hashes.len() as u64,
                    req.prompt_bytes / config.block_bytes as u64
                );
            }
            Effect::ResumeRequest => {
                assert!(seen.dispatched, "resumed a request that was never sent out");
                assert!(!seen.resumed, "resumed twice");
                seen.resumed = true;
            }
            Effect::Count(counter) => {
                match counter {
                    Counter::Routed => {
                        assert!(!seen.routed && !seen.failed_open);
                        seen.routed = true;
                    }
                    Counter::FailOpen(_) => {
                        assert!(!seen.routed && !seen.failed_open);
                        seen.failed_open = true;
                    }
                    Counter::Skipped(_) => {}
                    // Only the local decider counts it, after `Routed`; no decider here.
                    Counter::DecidedLocally => assert!(seen.routed),
                    Counter::Rejected(status) => {
                        assert!((400..600).contains(status), "bad reject status {status}");
                        assert!(!seen.routed && !seen.failed_open);
                    }
                }
                root.count(*counter);
            }
            Effect::SendLocalResponse { status, body, .. } => {
                assert!(
                    seen.dispatched,
                    "answered a request that was never sent out"
                );
                assert!((400..600).contains(status), "bad local status {status}");
                serde_json::from_slice::<serde_json::Value>(body).expect("the error is JSON");
            }
            // A route call given up (timeout, reset, bad answer) is withdrawn: only after one
            // was made.
            Effect::Withdraw(_) => assert!(seen.dispatched, "withdrew a call never made"),
            Effect::Adopt { .. } => assert!(seen.dispatched, "adopted a call never made"),
            Effect::RouteLatencyMs(_) | Effect::HashMicros(_) => {}
        }
    }
}

fn run(input: Input) {
    let mut config = FilterConfig::default();
    if input.small_limits {
        config.max_body_bytes = 64;
        config.max_queued_outcomes = 3;
    }
    config.block_bytes = usize::from(input.block_bytes.max(1));
    config.allow_explain = input.explain;
    if input.precise {
        for rule in &mut config.routes {
            rule.mode = RouteMode::Precise;
        }
    }
    let mut root = RootState::new(config.clone());
    let mut machine: RequestMachine = root.new_request();
    let mut seen = Seen::default();
    let mut now: u64 = 0;
    for event in input.events.iter().take(256) {
        now += 1;
        match event {
            Event::Headers(pairs, eos) => {
                let owned: Vec<(String, Vec<u8>)> = pairs
                    .iter()
                    .map(|(n, v)| (header_name(n), header_value(v)))
                    .collect();
                let step = machine.on_request_headers(
                    owned.iter().map(|(n, v)| (n.as_str(), v.as_slice())),
                    *eos,
                );
                check_step(&step, &mut seen, &config, &mut root);
            }
            Event::Body(size, eos) => {
                if let BodyStep::Step(step) = machine.on_request_body(*size as usize, *eos) {
                    check_step(&step, &mut seen, &config, &mut root);
                }
            }
            Event::Trailers => {
                if let BodyStep::Step(step) = machine.on_request_trailers() {
                    check_step(&step, &mut seen, &config, &mut root);
                }
            }
            Event::BodyReadFailed => {
                let step = machine.on_body_read_failed();
                check_step(&step, &mut seen, &config, &mut root);
            }
            Event::BodyComplete(kind, timed) => {
                let body = body_bytes(kind);
                let step = match timed {
                    None => machine.on_body_complete(&body, now),
                    Some(tick) => {
                        let mut clock = u64::from(*tick);
                        machine.on_body_complete_timed(&body, now, || {
                            clock = clock.wrapping_add(u64::from(*tick));
                            (clock % 7 != 0).then_some(clock)
                        })
                    }
                };
                check_step(&step, &mut seen, &config, &mut root);
            }
            Event::Dispatched => machine.on_dispatched(),
            Event::DispatchFailed => {
                let step = machine.on_dispatch_failed();
                check_step(&step, &mut seen, &config, &mut root);
            }
            Event::RouteResponse(status, answer) => {
                let step = machine.on_route_response(*status, &answer_bytes(answer), now);
                check_step(&step, &mut seen, &config, &mut root);
            }
            Event::RouteFailure(k) => {
                let kind = FailKind::ALL[usize::from(*k) % FailKind::ALL.len()];
                let step = machine.on_route_failure(kind);
                check_step(&step, &mut seen, &config, &mut root);
            }
            Event::ResponseHeaders(status, upstream) => {
                machine.on_response_headers(*status, upstream.as_deref());
                if let Some(value) = machine.decision_header() {
                    assert!(config.allow_explain, "explain header without allow_explain");
                    assert!(
                        value.bytes().all(|b| b == b' ' || b.is_ascii_graphic()),
                        "explain header is not a valid header value: {value:?}"
                    );
                }
            }
            Event::ResponseBody(chunk) => {
                if let Some(first) = machine.on_response_body(chunk, now) {
                    assert!(seen.routed, "first token of an unrouted request");
                    assert!(!seen.first_token, "two first tokens for one request");
                    seen.first_token = true;
                    root.push_first_token(first, now);
                }
            }
            Event::Done => {
                if let Some(outcome) = machine.on_done(now) {
                    assert!(
                        seen.routed && seen.header_set,
                        "outcome for an unrouted request"
                    );
                    assert!(!seen.outcome, "two outcomes for one request");
                    seen.outcome = true;
                    root.push_outcome(outcome, now);
                    assert!(root.queued() <= config.max_queued_outcomes);
                }
            }
            Event::Tick(dt) => {
                now += u64::from(*dt);
                if let Some(call) = root.on_tick(now) {
                    let batch: FeedbackBatch =
                        serde_json::from_slice(&call.body).expect("feedback is a FeedbackBatch");
                    assert_eq!(batch.outcomes.len(), call.outcomes);
                    assert!(
                        call.outcomes > 0
                            || !batch.first_tokens.is_empty()
                            || !batch.withdrawn.is_empty()
                    );
                }
            }
            Event::FeedbackResponse(status) => {
                root.on_feedback_response(*status);
            }
            Event::FeedbackDispatchFailed => root.on_feedback_dispatch_failed(),
            Event::NewRequest => {
                machine = root.new_request();
                seen = Seen::default();
            }
        }
    }
    let stats = root.stats();
    assert!(stats.body_parse_errors <= stats.fail_open);
}

/// The target's body: the input its bytes build (`crate::structured`), and what it must satisfy.
pub fn check(data: &[u8]) {
    crate::structured(data, run);
}
