//! The per-request state machine, free of proxy-wasm so it runs in native unit tests.
//!
//! The host glue ([`crate::host`] on wasm32) feeds it callbacks and the time, and executes the
//! [`Effect`]s it returns. The life of a routed request:
//!
//! ```text
//! headers ──Pause──▶ body… (Pause until end_of_stream) ──ReadBody──▶ body complete
//!   ──DispatchRoute──▶ route answer ──SetRequestHeader + ResumeRequest──▶ response… ──▶ done
//! ```
//!
//! Every error on the way fails open: the request is released without a destination header and
//! Envoy's fallback load balancer picks the endpoint.

use std::collections::BTreeMap;
use std::sync::Arc;

use scorer_core::address::split_rank;
use scorer_core::canon::{self, CanonError};
use scorer_core::hash::{block_hashes, request_seed};
use scorer_core::protocol::{
    ApiKind, FirstToken, Outcome, Reject, RequestedCriticality, RouteRequest, RouteResponse,
};

use crate::config::{FilterConfig, IdentityHeaders, RouteMode};
use crate::response_id::ResponseIdScanner;
use crate::usage::UsageScanner;

/// Default header a client may use to name its session (takes precedence over the body's
/// `user`); `session_header` in the configuration changes it.
pub const SESSION_HEADER: &str = "x-session-id";
/// Session headers coding agents send, read after the configured one, in this order: Claude
/// Code's (since 2.1.86), then Codex's (`session-id`; older builds and other clients spell it
/// `session_id`). After them come the body's keys ([`canon::CanonicalPrompt::session_hint`]).
pub const AGENT_SESSION_HEADERS: [&str; 3] =
    ["x-claude-code-session-id", "session-id", "session_id"];
/// Disaggregated-prefill header that only the router may set; clients' copies are removed.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// vLLM's data-parallel rank header (`vllm/entrypoints/generate/base/serving.py`): the engine
/// of a `--data-parallel-size` server that runs the request. Set when the chosen endpoint is a
/// rank (`ip:port#dp<rank>`); only the router may set it, so clients' copies are removed.
pub const DATA_PARALLEL_RANK_HEADER: &str = "x-data-parallel-rank";
/// Request header asking for the explain header (`1`); honoured only with `allow_explain`.
pub const EXPLAIN_HEADER: &str = "x-kvroute-explain";
/// Response header explaining the routing decision; a client-sent copy is always removed.
pub const DECISION_HEADER: &str = "x-kvroute-decision";
/// Longest `reason` copied from the control plane into the explain header.
const MAX_REASON_BYTES: usize = 32;
/// Longest session key forwarded to the control plane.
const MAX_SESSION_BYTES: usize = 256;
/// llm-d's tenant (flow) header, accepted when the configured tenant header is absent.
pub const LLMD_FAIRNESS_HEADER: &str = "x-llm-d-inference-fairness-id";
/// llm-d's objective header, accepted when the configured criticality header is absent; the
/// control plane maps its value (a criticality name, an integer priority or an objective name).
pub const LLMD_OBJECTIVE_HEADER: &str = "x-llm-d-inference-objective";
/// Request header the filter sets on a request it answers itself, so an Envoy
/// `local_reply_config` can pass its OpenAI error body through unchanged; clients' copies are
/// removed.
pub const LOCAL_REPLY_HEADER: &str = "x-kvroute-local-reply";
/// Longest tenant or criticality value forwarded to the control plane.
const MAX_TENANT_BYTES: usize = 128;

/// What the host returns from the current callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Let the stream continue.
    Continue,
    /// Hold the stream (headers stay mutable, body keeps buffering).
    Pause,
}

/// Why a request was let through without asking the control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// Not a POST.
    NotPost,
    /// A compressed body cannot be read.
    ContentEncoding,
    /// `content-type` is set and is not JSON.
    NotJson,
    /// `content-length` is above `max_body_bytes`.
    TooLarge,
    /// The request has no body.
    NoBody,
}

impl SkipReason {
    /// Stable snake_case name (the explain header's `skip=`).
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::NotPost => "not_post",
            SkipReason::ContentEncoding => "content_encoding",
            SkipReason::NotJson => "not_json",
            SkipReason::TooLarge => "too_large",
            SkipReason::NoBody => "no_body",
        }
    }
}

/// Why a request that should have been routed was released unrouted (fail open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailKind {
    /// The body grew past `max_body_bytes` while buffering.
    BodyTooLarge,
    /// The host could not hand over the buffered body.
    BodyRead,
    /// The body is not a valid request for its API.
    BodyParse,
    /// The route call could not be started (unknown cluster, host failure).
    Dispatch,
    /// The route call timed out (Envoy answers a callout timeout with 504).
    Timeout,
    /// The route call was reset: no response headers at all.
    Reset,
    /// The control plane answered with a non-2xx status.
    Status,
    /// The route answer is not a valid `RouteResponse`.
    BadResponse,
    /// The control plane had no endpoint to offer.
    NoEndpoint,
}

impl FailKind {
    /// Whether the control plane did not answer the route call usefully (it may be down),
    /// as opposed to a bad request body or an answer with no endpoint.
    pub fn is_route_call(self) -> bool {
        matches!(
            self,
            FailKind::Dispatch
                | FailKind::Timeout
                | FailKind::Reset
                | FailKind::Status
                | FailKind::BadResponse
        )
    }

    /// Every kind, for per-kind bookkeeping.
    pub const ALL: [FailKind; 9] = [
        FailKind::BodyTooLarge,
        FailKind::BodyRead,
        FailKind::BodyParse,
        FailKind::Dispatch,
        FailKind::Timeout,
        FailKind::Reset,
        FailKind::Status,
        FailKind::BadResponse,
        FailKind::NoEndpoint,
    ];

    /// Stable snake_case name for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            FailKind::BodyTooLarge => "body_too_large",
            FailKind::BodyRead => "body_read",
            FailKind::BodyParse => "body_parse",
            FailKind::Dispatch => "dispatch",
            FailKind::Timeout => "timeout",
            FailKind::Reset => "reset",
            FailKind::Status => "status",
            FailKind::BadResponse => "bad_response",
            FailKind::NoEndpoint => "no_endpoint",
        }
    }

    /// Position in [`FailKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Something the host should count (and, for failures, log once per kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// A destination header was set from the control plane's answer.
    Routed,
    /// An inference request was let through without routing.
    Skipped(SkipReason),
    /// A request failed open.
    FailOpen(FailKind),
    /// The control plane refused the request and the filter answered it locally with this
    /// status (404 unknown model, 413 too large for the tenant, 429 shed under saturation).
    Rejected(u16),
    /// The destination was decided by the VM's own copy of the routing state (`decision:
    /// local`), with no call; counted besides [`Counter::Routed`].
    DecidedLocally,
}

/// A side effect for the host to carry out, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Remove a request header.
    RemoveRequestHeader(String),
    /// Set (replace) a request header.
    SetRequestHeader {
        /// Lowercase header name.
        name: String,
        /// Header value.
        value: String,
    },
    /// POST this JSON `RouteRequest` to the control plane's route path; the host then reports
    /// [`RequestMachine::on_dispatched`] or [`RequestMachine::on_dispatch_failed`].
    DispatchRoute {
        /// Serialized `RouteRequest` (hashes and numbers only).
        body: Vec<u8>,
    },
    /// Resume the paused request (after an asynchronous route answer).
    ResumeRequest,
    /// Bump a counter.
    Count(Counter),
    /// Record the route call's round trip.
    RouteLatencyMs(u64),
    /// Record how long canonicalising and hashing the prompt took (host clock, microseconds).
    HashMicros(u64),
    /// The route call with this [`RouteRequest::call_id`] was given up (the request failed
    /// open): tell the control plane, in the next feedback batch, that its decision holds no
    /// load.
    Withdraw(u64),
    /// The route call with this id was answered with `endpoint` under `decision_id`: the
    /// VM's copy of the routing state (`decision: local`) accounts for it at once.
    Adopt {
        /// The call's [`RouteRequest::call_id`].
        call_id: u64,
        /// The control plane's decision id.
        decision_id: u64,
        /// The endpoint chosen.
        endpoint: String,
    },
    /// Answer the paused request locally (an OpenAI-style error) instead of sending it upstream.
    SendLocalResponse {
        /// HTTP status.
        status: u16,
        /// Response headers (lowercase names).
        headers: Vec<(String, String)>,
        /// JSON body `{"error":{"message","type","code"}}`.
        body: Vec<u8>,
    },
}

/// The host's instructions for one callback: what to return and what to do first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Value to return from the callback.
    pub action: Action,
    /// Effects to execute before returning, in order.
    pub effects: Vec<Effect>,
}

impl Step {
    fn go(effects: Vec<Effect>) -> Self {
        Step {
            action: Action::Continue,
            effects,
        }
    }

    fn hold(effects: Vec<Effect>) -> Self {
        Step {
            action: Action::Pause,
            effects,
        }
    }
}

/// Answer to a request body callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyStep {
    /// Return this step.
    Step(Step),
    /// The body is complete: read `len` buffered bytes from offset 0 and pass them to
    /// [`RequestMachine::on_body_complete`] (or report [`RequestMachine::on_body_read_failed`]).
    ReadBody(usize),
}

/// What a held request is routed on.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// The body's prompt, canonicalised for its API.
    Prompt(ApiKind),
    /// Only the body's `model`, by load (a `load` route).
    Load,
    /// The stored response its path names (`GET {responses}/{id}`, `POST .../{id}/cancel`);
    /// a body, if any, is not read.
    StoredResponse(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// Waiting for request headers.
    Start,
    /// Not ours to route; nothing more to do.
    Passthrough,
    /// Paused, buffering the body.
    Buffering(Target),
    /// The route request was handed to the host for dispatch.
    Dispatching { started_ms: u64 },
    /// Waiting for the control plane's answer.
    AwaitingRoute { started_ms: u64 },
    /// The request went upstream (routed or failed open).
    Released,
}

#[derive(Debug, Clone)]
struct Routed {
    decision_id: u64,
    decision_tag: u64,
    endpoint: String,
    routed_ms: u64,
}

/// One HTTP request's routing state.
#[derive(Debug)]
pub struct RequestMachine {
    config: Arc<FilterConfig>,
    phase: Phase,
    mode: RouteMode,
    session: Option<String>,
    /// Where `session` came from: 0 the configured header, then [`AGENT_SESSION_HEADERS`]
    /// (a better-ranked header wins whatever the order they arrive in).
    session_rank: usize,
    /// Reads the response id of a Responses request, for the outcome report.
    response_id: Option<ResponseIdScanner>,
    /// Tenant from the configured header (or llm-d's), for admission and fair sharing.
    tenant: Option<String>,
    /// Whether `tenant` came from the configured header (which wins over llm-d's).
    tenant_primary: bool,
    /// Criticality from the configured header (or llm-d's objective): a level, or a name only
    /// the control plane's objectives map.
    criticality: Option<RequestedCriticality>,
    /// Whether `criticality` came from the configured header (which wins over llm-d's).
    criticality_primary: bool,
    routed: Option<Routed>,
    /// The id of the route call made for this request, to withdraw it if it is given up.
    call_id: Option<u64>,
    status: u16,
    upstream: Option<String>,
    first_byte_ms: Option<u64>,
    usage: UsageScanner,
    finished: bool,
    /// The client asked for the explain header and the configuration allows it.
    explain: bool,
    /// The explain header's value, once the request's fate is known.
    decision: Option<String>,
    /// The client asked for a streamed response: its first body byte is its first token.
    streamed: bool,
}

impl RequestMachine {
    /// A fresh machine for a new request.
    pub fn new(config: Arc<FilterConfig>) -> Self {
        RequestMachine {
            config,
            phase: Phase::Start,
            mode: RouteMode::Approximate,
            session: None,
            session_rank: usize::MAX,
            response_id: None,
            tenant: None,
            tenant_primary: false,
            criticality: None,
            criticality_primary: false,
            routed: None,
            call_id: None,
            status: 0,
            upstream: None,
            first_byte_ms: None,
            usage: UsageScanner::default(),
            finished: false,
            explain: false,
            decision: None,
            streamed: false,
        }
    }

    /// Request headers arrived. Strips routing headers a client must not set, then decides
    /// whether to hold the request for routing. (A bodiless request naming a stored response is
    /// routed from here: see [`RequestMachine::on_request_headers_with`].)
    pub fn on_request_headers<'a, I>(&mut self, headers: I, end_of_stream: bool) -> Step
    where
        I: IntoIterator<Item = (&'a str, &'a [u8])>,
    {
        self.on_request_headers_with(headers, end_of_stream, 0, |_| None)
    }

    /// [`RequestMachine::on_request_headers`] at `now_ms` with the local decider of
    /// [`RequestMachine::on_body_complete_with`]: a `GET {responses}/{id}` (or a bodiless
    /// `cancel`) has nothing to wait for and is routed at once.
    pub fn on_request_headers_with<'a, I>(
        &mut self,
        headers: I,
        end_of_stream: bool,
        now_ms: u64,
        decide: impl FnMut(&mut RouteRequest) -> Option<RouteResponse>,
    ) -> Step
    where
        I: IntoIterator<Item = (&'a str, &'a [u8])>,
    {
        if self.phase != Phase::Start {
            return Step::go(Vec::new());
        }
        self.phase = Phase::Passthrough;
        let mut effects = Vec::new();
        let mut method = None;
        let mut path = None;
        let mut content_encoding = None;
        let mut content_type = None;
        let mut content_length = None;
        let trusted = self.config.identity_headers == IdentityHeaders::Trusted;
        for (name, value) in headers {
            let is = |n: &str| name.eq_ignore_ascii_case(n);
            let identity = || {
                is(&self.config.tenant_header)
                    || is(LLMD_FAIRNESS_HEADER)
                    || is(&self.config.criticality_header)
                    || is(LLMD_OBJECTIVE_HEADER)
            };
            if is(&self.config.destination_header)
                || is(PREFILLER_HEADER)
                || is(DATA_PARALLEL_RANK_HEADER)
                || is(DECISION_HEADER)
                || is(LOCAL_REPLY_HEADER)
                || (!trusted && identity())
            {
                let name = name.to_ascii_lowercase();
                if !effects.contains(&Effect::RemoveRequestHeader(name.clone())) {
                    effects.push(Effect::RemoveRequestHeader(name));
                }
            } else if is(":method") {
                method = Some(value);
            } else if is(":path") {
                path = Some(value);
            } else if is("content-encoding") {
                content_encoding = Some(value);
            } else if is("content-type") {
                content_type = Some(value);
            } else if is("content-length") {
                content_length = Some(value);
            } else if is(EXPLAIN_HEADER) {
                self.explain = self.config.allow_explain && value.trim_ascii() == b"1";
            } else if is(&self.config.tenant_header) && !value.is_empty() {
                self.tenant = Some(header_text(value, MAX_TENANT_BYTES));
                self.tenant_primary = true;
            } else if is(LLMD_FAIRNESS_HEADER) && !value.is_empty() && !self.tenant_primary {
                self.tenant = Some(header_text(value, MAX_TENANT_BYTES));
            } else if is(&self.config.criticality_header) && !value.is_empty() {
                self.criticality = Some(RequestedCriticality::from_header(&header_text(
                    value,
                    MAX_TENANT_BYTES,
                )));
                self.criticality_primary = true;
            } else if is(LLMD_OBJECTIVE_HEADER) && !value.is_empty() && !self.criticality_primary {
                self.criticality = Some(RequestedCriticality::from_header(&header_text(
                    value,
                    MAX_TENANT_BYTES,
                )));
            } else if !value.trim_ascii().is_empty()
                && let Some(rank) = std::iter::once(self.config.session_header.as_str())
                    .chain(AGENT_SESSION_HEADERS)
                    .position(is)
                && rank < self.session_rank
            {
                self.session = Some(header_text(value, MAX_SESSION_BYTES));
                self.session_rank = rank;
            }
        }
        let path = path.and_then(|p| std::str::from_utf8(p).ok());
        if let Some(stored) = path.and_then(|p| self.config.stored_response_path(p)) {
            let wanted: &[u8] = if stored.cancel { b"POST" } else { b"GET" };
            if method != Some(wanted) {
                return Step::go(effects);
            }
            let target = Target::StoredResponse(stored.id.to_string());
            self.mode = RouteMode::Load;
            if end_of_stream || content_length.and_then(parse_len) == Some(0) {
                let request = self.stored_response_request(stored.id);
                let mut step = self.decide_or_dispatch(request, now_ms, None, decide);
                step.effects.splice(0..0, effects);
                return step;
            }
            self.phase = Phase::Buffering(target);
            return Step::hold(effects);
        }
        let Some((target, mode)) = path.and_then(|p| self.config.route_for_path(p)).map(|r| {
            let target = match (r.mode, r.api) {
                (RouteMode::Load, _) | (_, None) => Target::Load,
                (_, Some(api)) => Target::Prompt(api),
            };
            (target, r.mode)
        }) else {
            return Step::go(effects);
        };
        self.mode = mode;
        let skip = if method != Some(b"POST".as_slice()) {
            Some(SkipReason::NotPost)
        } else if content_encoding
            .is_some_and(|v| !v.trim_ascii().eq_ignore_ascii_case(b"identity"))
        {
            Some(SkipReason::ContentEncoding)
        } else if content_type.is_some_and(|v| !is_json(v)) {
            Some(SkipReason::NotJson)
        } else if content_length
            .is_some_and(|v| parse_len(v).is_none_or(|n| n > self.config.max_body_bytes))
        {
            Some(SkipReason::TooLarge)
        } else if end_of_stream || content_length.and_then(parse_len) == Some(0) {
            Some(SkipReason::NoBody)
        } else {
            None
        };
        if let Some(reason) = skip {
            if self.explain {
                self.decision = Some(format!("reason=skipped; skip={}", reason.as_str()));
            }
            effects.push(Effect::Count(Counter::Skipped(reason)));
            return Step::go(effects);
        }
        self.phase = Phase::Buffering(target);
        Step::hold(effects)
    }

    /// A request body chunk arrived; `body_size` is everything buffered so far.
    pub fn on_request_body(&mut self, body_size: usize, end_of_stream: bool) -> BodyStep {
        let Phase::Buffering(_) = self.phase else {
            return BodyStep::Step(Step::go(Vec::new()));
        };
        if body_size > self.config.max_body_bytes {
            return BodyStep::Step(self.fail_open(FailKind::BodyTooLarge, false));
        }
        if end_of_stream {
            BodyStep::ReadBody(body_size)
        } else {
            BodyStep::Step(Step::hold(Vec::new()))
        }
    }

    /// Request trailers arrived: the body ended without an `end_of_stream` body callback.
    /// Returns [`BodyStep::ReadBody`] with an upper bound when the body is being buffered.
    pub fn on_request_trailers(&mut self) -> BodyStep {
        match self.phase {
            Phase::Buffering(_) => BodyStep::ReadBody(self.config.max_body_bytes.saturating_add(1)),
            _ => BodyStep::Step(Step::go(Vec::new())),
        }
    }

    /// The host could not read the buffered body.
    pub fn on_body_read_failed(&mut self) -> Step {
        match self.phase {
            Phase::Buffering(_) => self.fail_open(FailKind::BodyRead, false),
            _ => Step::go(Vec::new()),
        }
    }

    /// The whole body: canonicalise and hash it and ask the host to dispatch the route call.
    pub fn on_body_complete(&mut self, body: &[u8], now_ms: u64) -> Step {
        self.on_body_complete_timed(body, now_ms, || None)
    }

    /// [`RequestMachine::on_body_complete`], timing the prompt's canonicalisation and hashing
    /// with `clock_ns` (the host clock in nanoseconds, `None` when unreadable). A routable
    /// prompt's step then starts with [`Effect::HashMicros`].
    pub fn on_body_complete_timed(
        &mut self,
        body: &[u8],
        now_ms: u64,
        clock_ns: impl FnMut() -> Option<u64>,
    ) -> Step {
        self.on_body_complete_with(body, now_ms, clock_ns, |_| None)
    }

    /// [`RequestMachine::on_body_complete_timed`] with a local decider (`decision: local`): an
    /// approximate request is offered to `decide` first, and routed at once on a usable answer
    /// (an endpoint list, no refusal) without any call; otherwise (no answer, a refusal or no
    /// endpoint, or a precise request) the control plane is asked as usual, so its answer decides
    /// and its refusals reach the client as they always did.
    pub fn on_body_complete_with(
        &mut self,
        body: &[u8],
        now_ms: u64,
        mut clock_ns: impl FnMut() -> Option<u64>,
        decide: impl FnMut(&mut RouteRequest) -> Option<RouteResponse>,
    ) -> Step {
        let Phase::Buffering(target) = &self.phase else {
            return Step::go(Vec::new());
        };
        let target = target.clone();
        if body.len() > self.config.max_body_bytes {
            return self.fail_open(FailKind::BodyTooLarge, false);
        }
        let started = clock_ns();
        let request = match &target {
            Target::Prompt(api) => self.route_request(*api, body),
            Target::Load => load_request(body),
            Target::StoredResponse(id) => Ok(self.stored_response_request(id)),
        };
        let elapsed = match (started, clock_ns()) {
            (Some(a), Some(b)) => Some(Effect::HashMicros(b.saturating_sub(a) / 1_000)),
            _ => None,
        };
        let Ok(request) = request else {
            return self.fail_open(FailKind::BodyParse, false);
        };
        if target == Target::Prompt(ApiKind::Responses) {
            self.response_id = Some(ResponseIdScanner::default());
        }
        #[cfg(not(feature = "time-decision"))]
        return self.decide_or_dispatch(request, now_ms, elapsed, decide);
        #[cfg(feature = "time-decision")]
        return self.decide_or_dispatch_timed(request, now_ms, elapsed, clock_ns, decide);
    }

    /// [`RequestMachine::decide_or_dispatch`], with the step's [`Effect::HashMicros`] holding
    /// the local decision's time instead of parse and hash (the `time-decision` feature: how
    /// long a decision takes inside the proxy's VM, where native timings do not carry over).
    #[cfg(feature = "time-decision")]
    fn decide_or_dispatch_timed(
        &mut self,
        request: RouteRequest,
        now_ms: u64,
        elapsed: Option<Effect>,
        mut clock_ns: impl FnMut() -> Option<u64>,
        mut decide: impl FnMut(&mut RouteRequest) -> Option<RouteResponse>,
    ) -> Step {
        let mut micros = 0;
        let mut step = self.decide_or_dispatch(request, now_ms, elapsed, |r| {
            let started = clock_ns();
            let answer = decide(r);
            if let (Some(a), Some(b)) = (started, clock_ns()) {
                micros = b.saturating_sub(a) / 1_000;
            }
            answer
        });
        for effect in &mut step.effects {
            if let Effect::HashMicros(us) = effect {
                *us = micros;
            }
        }
        step
    }

    /// Routes `request` on the local decider's answer when it has a usable one (an endpoint
    /// list, no refusal; never for a precise request, which the control plane tokenises), or
    /// hands the route call to the host. The decider may first add what the VM knows
    /// (`previous_response_endpoint`). Works from the headers or the body callback alike.
    fn decide_or_dispatch(
        &mut self,
        mut request: RouteRequest,
        now_ms: u64,
        elapsed: Option<Effect>,
        mut decide: impl FnMut(&mut RouteRequest) -> Option<RouteResponse>,
    ) -> Step {
        self.streamed = request.stream;
        // The headers' keys complete what a request's body did not name (a load route's and a
        // stored response's requests name none).
        if request.session.is_none() {
            request.session = self.session.clone();
        }
        if request.tenant.is_none() {
            request.tenant = self.tenant.clone();
        }
        if request.criticality.is_none() {
            request.criticality = self.criticality.clone();
        }
        // The decider sees every request (it readies a route call: its id, queued outcomes);
        // its answer is used only where a copy may decide.
        let answer = decide(&mut request);
        if self.mode != RouteMode::Precise
            && let Some(answer) = answer.filter(|r| {
                r.reject.is_none()
                    && !r.endpoints.is_empty()
                    && r.endpoints.iter().all(|e| is_endpoint(e))
            })
        {
            let mut step = self.route_to(answer, now_ms, false);
            step.effects.splice(0..0, elapsed);
            step.effects.push(Effect::Count(Counter::DecidedLocally));
            return step;
        }
        self.call_id = request.call_id;
        match serde_json::to_vec(&request) {
            Ok(body) => {
                self.phase = Phase::Dispatching { started_ms: now_ms };
                let mut effects: Vec<Effect> = elapsed.into_iter().collect();
                effects.push(Effect::DispatchRoute { body });
                Step::hold(effects)
            }
            Err(_) => self.fail_open(FailKind::BodyParse, false),
        }
    }

    /// The route request of a request naming a stored response by its path: no prompt, no
    /// model (vLLM finds the response by id alone).
    fn stored_response_request(&self, id: &str) -> RouteRequest {
        RouteRequest {
            previous_response_id: Some(id.to_string()),
            max_output_tokens: Some(0),
            ..RouteRequest::default()
        }
    }

    /// Sends the request to the answer's endpoints (the first, then the fallbacks): sets the
    /// destination (and prefiller) headers, remembers the decision for the outcome report.
    /// `resume` when the request is paused outside a callback (an asynchronous answer).
    fn route_to(&mut self, r: RouteResponse, now_ms: u64, resume: bool) -> Step {
        // The proxy routes to servers; a data-parallel rank travels in vLLM's own header.
        let mut servers: Vec<&str> = Vec::with_capacity(r.endpoints.len());
        for e in &r.endpoints {
            let (server, _) = split_rank(e);
            if !servers.contains(&server) {
                servers.push(server);
            }
        }
        let value = servers.join(",");
        let rank = r.endpoints.first().and_then(|e| split_rank(e).1);
        if self.explain {
            self.decision = Some(format!(
                "id={}; reason={}; endpoint={}; cached_blocks={}",
                r.decision_id,
                header_token(r.reason.as_str()),
                r.endpoints[0],
                r.cached_blocks
            ));
        }
        self.routed = Some(Routed {
            decision_id: r.decision_id,
            decision_tag: r.decision_tag,
            endpoint: r.endpoints.into_iter().next().unwrap_or_default(),
            routed_ms: now_ms,
        });
        self.phase = Phase::Released;
        let mut effects = vec![Effect::SetRequestHeader {
            name: self.config.destination_header.clone(),
            value,
        }];
        if let Some(rank) = rank {
            effects.push(Effect::SetRequestHeader {
                name: DATA_PARALLEL_RANK_HEADER.into(),
                value: rank.to_string(),
            });
        }
        if let Some(prefiller) = r.prefiller.filter(|p| is_endpoint(p)) {
            // The P/D sidecar connects to a server: a data-parallel rank's name is cut to it
            // (the sidecar's protocol has no rank; that server's balancer picks one).
            effects.push(Effect::SetRequestHeader {
                name: PREFILLER_HEADER.into(),
                value: split_rank(&prefiller).0.to_string(),
            });
        }
        if resume {
            effects.push(Effect::ResumeRequest);
        }
        effects.push(Effect::Count(Counter::Routed));
        Step::go(effects)
    }

    fn route_request(&self, api: ApiKind, body: &[u8]) -> Result<RouteRequest, CanonError> {
        let prompt = canon::canonicalize(api, body)?;
        // vLLM keys cached blocks by the cache salt too: salted hashes predict only the hits
        // the engine will give.
        let block_hashes = block_hashes(
            request_seed(&prompt.model, prompt.cache_salt.as_deref()),
            &prompt.bytes,
            self.config.block_bytes,
        );
        let prompt_tokens = prompt.estimated_tokens();
        let session = self.session.clone().or_else(|| {
            prompt
                .session_hint
                .as_ref()
                .map(|u| truncate(u, MAX_SESSION_BYTES))
        });
        // Approximate routes never send the prompt (nor the salt, which their hashes already
        // hold); precise ones send its fields and salt so the control plane can tokenise and
        // seed it like the engine will.
        let (prompt_text, api, cache_salt) = match self.mode {
            RouteMode::Approximate | RouteMode::Load => (None, None, None),
            RouteMode::Precise => (
                Some(prompt_fields(api, body)?),
                Some(api),
                prompt.cache_salt,
            ),
        };
        // Only whole blocks lie inside the marked prefix.
        let marked_blocks =
            u32::try_from(prompt.marked_bytes / self.config.block_bytes.max(1)).unwrap_or(u32::MAX);
        Ok(RouteRequest {
            prompt_bytes: prompt.bytes.len() as u64,
            model: prompt.model,
            marked_blocks,
            block_hashes,
            prompt_tokens,
            max_output_tokens: prompt.max_output_tokens,
            session,
            prompt_text,
            api,
            cache_salt,
            token_block_hashes: Vec::new(),
            tenant: self.tenant.clone(),
            criticality: self.criticality.clone(),
            previous_response_id: prompt.previous_response_id,
            previous_response_endpoint: None,
            // The root context sets these when it makes the call.
            call_id: None,
            finished: Vec::new(),
            first_tokens: Vec::new(),
            stream: prompt.stream,
        })
    }

    /// The host started the route call; the answer comes later.
    pub fn on_dispatched(&mut self) {
        if let Phase::Dispatching { started_ms } = self.phase {
            self.phase = Phase::AwaitingRoute { started_ms };
        }
    }

    /// The host could not start the route call (still inside the body callback, so the
    /// returned step continues the stream directly instead of resuming it).
    pub fn on_dispatch_failed(&mut self) -> Step {
        match self.phase {
            Phase::Dispatching { .. } => self.fail_open(FailKind::Dispatch, false),
            _ => Step::go(Vec::new()),
        }
    }

    /// The control plane answered. `status` is `None` when the call was reset (no headers).
    pub fn on_route_response(&mut self, status: Option<u16>, body: &[u8], now_ms: u64) -> Step {
        let Phase::AwaitingRoute { started_ms } = self.phase else {
            return Step::go(Vec::new());
        };
        let latency = Effect::RouteLatencyMs(now_ms.saturating_sub(started_ms));
        let kind = match status {
            None => FailKind::Reset,
            Some(504) => FailKind::Timeout,
            Some(s) if !(200..300).contains(&s) => FailKind::Status,
            Some(_) => match serde_json::from_slice::<RouteResponse>(body) {
                Err(_) => FailKind::BadResponse,
                Ok(RouteResponse {
                    reject: Some(reject),
                    ..
                }) if (400..600).contains(&reject.status) => {
                    return self.reject(&reject, latency);
                }
                Ok(r) if r.reject.is_some() => FailKind::BadResponse,
                Ok(r) if r.endpoints.is_empty() => FailKind::NoEndpoint,
                Ok(r) if !r.endpoints.iter().all(|e| is_endpoint(e)) => FailKind::BadResponse,
                Ok(r) => {
                    let adopt = self.call_id.map(|call_id| Effect::Adopt {
                        call_id,
                        decision_id: r.decision_id,
                        endpoint: r.endpoints[0].clone(),
                    });
                    let mut step = self.route_to(r, now_ms, true);
                    step.effects.insert(0, latency);
                    step.effects.extend(adopt);
                    return step;
                }
            },
        };
        let mut step = self.fail_open(kind, true);
        step.effects.insert(0, latency);
        // No answer in time, or one unusable: the control plane may have decided it (or will,
        // once it works through its queue), and that decision must not hold load there.
        if matches!(
            kind,
            FailKind::Timeout | FailKind::Reset | FailKind::BadResponse
        ) {
            step.effects.extend(self.call_id.map(Effect::Withdraw));
        }
        step
    }

    /// Answers the request locally with the control plane's refusal; it never goes upstream and
    /// produces no outcome report.
    fn reject(&mut self, reject: &Reject, latency: Effect) -> Step {
        self.phase = Phase::Released;
        if self.explain {
            self.decision = Some(format!(
                "reason=rejected; status={}; type={}",
                reject.status,
                header_token(reject.error_type.as_str())
            ));
        }
        let mut headers = vec![("content-type".to_string(), "application/json".to_string())];
        if let Some(seconds) = reject.retry_after_s {
            headers.push(("retry-after".to_string(), seconds.to_string()));
        }
        if let Some(decision) = &self.decision {
            headers.push((DECISION_HEADER.to_string(), decision.clone()));
        }
        let body = serde_json::json!({
            "error": {
                "message": reject.message,
                "type": reject.error_type,
                "code": reject.status,
            }
        });
        Step::go(vec![
            latency,
            Effect::SetRequestHeader {
                name: LOCAL_REPLY_HEADER.into(),
                value: "1".into(),
            },
            Effect::SendLocalResponse {
                status: reject.status,
                headers,
                body: body.to_string().into_bytes(),
            },
            Effect::Count(Counter::Rejected(reject.status)),
        ])
    }

    /// The route call failed in a way the host detected itself (e.g. unreadable answer).
    pub fn on_route_failure(&mut self, kind: FailKind) -> Step {
        match self.phase {
            Phase::AwaitingRoute { .. } => {
                let mut step = self.fail_open(kind, true);
                step.effects.extend(self.call_id.map(Effect::Withdraw));
                step
            }
            _ => Step::go(Vec::new()),
        }
    }

    /// Releases the request unrouted. `resume` is true when the request is paused outside of
    /// a callback (after an asynchronous answer) and must be resumed explicitly.
    fn fail_open(&mut self, kind: FailKind, resume: bool) -> Step {
        self.phase = Phase::Released;
        if self.explain {
            self.decision = Some(format!("reason=fail_open; error={}", kind.as_str()));
        }
        let mut effects = Vec::with_capacity(2);
        if resume {
            effects.push(Effect::ResumeRequest);
        }
        effects.push(Effect::Count(Counter::FailOpen(kind)));
        Step::go(effects)
    }

    /// Whether the host must read the status with the response headers: only a streamed
    /// response's first chunk needs it (to report its first token). Everything else about the
    /// response is read once the client has it ([`RequestMachine::wants_response_info`]), off
    /// the response's path.
    pub fn wants_status_early(&self) -> bool {
        self.wants_response_body() && self.streamed && self.status == 0
    }

    /// Whether the host should read the response's status and upstream address before
    /// [`RequestMachine::on_done`]: a routed request not yet finished. `status` is false when
    /// the status is already known.
    pub fn wants_response_info(&self) -> ResponseInfo {
        ResponseInfo {
            upstream: self.wants_response_body(),
            status: self.wants_response_body() && self.status == 0,
        }
    }

    /// The response's status and the `ip:port` that served, when known (read with the headers
    /// or once the stream is done).
    pub fn on_response_headers(&mut self, status: Option<u16>, upstream: Option<&str>) {
        if let Some(status) = status {
            self.status = status;
        }
        if let Some(upstream) = upstream.filter(|u| !u.is_empty()) {
            self.upstream = Some(truncate(upstream, 128));
        }
    }

    /// The `x-kvroute-decision` value to add to the response, when the client asked for it, the
    /// configuration allows it and the request was an inference request.
    pub fn decision_header(&self) -> Option<&str> {
        self.decision.as_deref()
    }

    /// Whether the host should pass response body chunks (only routed requests are reported).
    pub fn wants_response_body(&self) -> bool {
        self.routed.is_some() && !self.finished
    }

    /// One response body chunk (not cumulative). Returns the first-token report to queue when
    /// this is the first chunk of a successful streamed response (vLLM sends its first event
    /// once the prompt is prefilled), so the router's queue for the endpoint is measured.
    pub fn on_response_body(&mut self, chunk: &[u8], now_ms: u64) -> Option<FirstToken> {
        if !self.wants_response_body() {
            return None;
        }
        let mut first = None;
        if !chunk.is_empty() && self.first_byte_ms.is_none() {
            self.first_byte_ms = Some(now_ms);
            if self.streamed && (200..300).contains(&self.status) {
                first = self.routed.as_ref().map(|routed| FirstToken {
                    decision_id: routed.decision_id,
                    decision_tag: routed.decision_tag,
                    ttft_ms: Some(now_ms.saturating_sub(routed.routed_ms)),
                });
            }
        }
        self.usage.feed(chunk);
        if let Some(scanner) = &mut self.response_id {
            scanner.feed(chunk);
        }
        first
    }

    /// The stream ended (completed or reset). Returns the outcome of a routed request, once.
    pub fn on_done(&mut self, now_ms: u64) -> Option<Outcome> {
        if self.finished {
            return None;
        }
        self.finished = true;
        let routed = self.routed.as_ref()?;
        let usage = self.usage.usage().unwrap_or_default();
        Some(Outcome {
            decision_id: routed.decision_id,
            // Where it was served: the proxy's upstream when known (a fallback may have taken
            // it elsewhere), the decision's endpoint when that is the same server (the
            // upstream address carries no data-parallel rank).
            endpoint: match &self.upstream {
                Some(u) if u != split_rank(&routed.endpoint).0 => u.clone(),
                _ => routed.endpoint.clone(),
            },
            status: self.status,
            ttfb_ms: self
                .first_byte_ms
                .map(|t| t.saturating_sub(routed.routed_ms)),
            total_ms: now_ms.saturating_sub(routed.routed_ms),
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            cached_tokens: usage.cached_tokens,
            response_id: self
                .response_id
                .as_ref()
                .and_then(ResponseIdScanner::id)
                .filter(|_| (200..300).contains(&self.status))
                .map(str::to_string),
            decision_tag: routed.decision_tag,
        })
    }
}

/// What [`RequestMachine::wants_response_info`] asks the host to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseInfo {
    /// The upstream address that served.
    pub upstream: bool,
    /// The response's status code.
    pub status: bool,
}

/// A `load` route's request: the body's `model` and its size in tokens, no prefix.
fn load_request(body: &[u8]) -> Result<RouteRequest, CanonError> {
    #[derive(serde::Deserialize)]
    struct ModelOnly<'a> {
        #[serde(borrow, default)]
        model: Option<std::borrow::Cow<'a, str>>,
    }
    let parsed: ModelOnly<'_> =
        serde_json::from_slice(body).map_err(|e| CanonError::InvalidBody(e.to_string()))?;
    Ok(RouteRequest {
        model: parsed.model.map(|m| m.into_owned()).unwrap_or_default(),
        // No canonical prompt (its bytes are what the hashes cover): the size goes as an
        // estimate of tokens, 4 bytes each.
        prompt_bytes: 0,
        prompt_tokens: u32::try_from(body.len().div_ceil(4)).unwrap_or(u32::MAX),
        max_output_tokens: Some(0),
        ..RouteRequest::default()
    })
}

/// The fields of `body` that decide its prompt tokens, as a JSON object; values are copied
/// verbatim (no re-serialisation of large message lists).
fn prompt_fields(api: ApiKind, body: &[u8]) -> Result<String, CanonError> {
    let map: BTreeMap<String, &serde_json::value::RawValue> =
        serde_json::from_slice(body).map_err(|e| CanonError::InvalidBody(e.to_string()))?;
    let fields = api.prompt_fields();
    let mut out = String::with_capacity(body.len() + 2);
    out.push('{');
    for field in fields {
        if let Some(value) = map.get(*field) {
            if out.len() > 1 {
                out.push(',');
            }
            out.push('"');
            out.push_str(field);
            out.push_str("\":");
            out.push_str(value.get());
        }
    }
    out.push('}');
    Ok(out)
}

fn is_json(content_type: &[u8]) -> bool {
    let essence = content_type
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    essence.eq_ignore_ascii_case(b"application/json")
        || (essence.len() > 5 && essence[essence.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

fn parse_len(value: &[u8]) -> Option<usize> {
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}

/// A header value as trimmed text of at most `max` bytes (invalid UTF-8 replaced).
fn header_text(value: &[u8], max: usize) -> String {
    truncate(String::from_utf8_lossy(value.trim_ascii()).as_ref(), max)
}

fn truncate(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// `reason` reduced to a safe header token: `[a-z0-9_:.-]`, at most [`MAX_REASON_BYTES`].
fn header_token(reason: &str) -> String {
    let token: String = reason
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "_:.-".contains(*c))
        .take(MAX_REASON_BYTES)
        .collect::<String>()
        .to_ascii_lowercase();
    if token.is_empty() {
        "unknown".into()
    } else {
        token
    }
}

/// A plausible `host:port` for a header value: visible ASCII, no separators.
fn is_endpoint(e: &str) -> bool {
    !e.is_empty()
        && e.len() <= 128
        && e.contains(':')
        && e.bytes().all(|b| b.is_ascii_graphic() && b != b',')
}

#[cfg(test)]
mod tests {
    use super::*;
    use scorer_core::hash::{DEFAULT_BLOCK_BYTES, model_seed};

    const CHAT: &str = "/v1/chat/completions";

    fn machine() -> RequestMachine {
        machine_with(|_| {})
    }

    /// A machine on the default configuration as `edit` changes it.
    fn machine_with(edit: impl FnOnce(&mut FilterConfig)) -> RequestMachine {
        let mut config = FilterConfig::default();
        edit(&mut config);
        RequestMachine::new(Arc::new(config))
    }

    /// A machine that believes the tenant and criticality headers (an authority sets them).
    fn trusted_machine() -> RequestMachine {
        machine_with(|c| c.identity_headers = IdentityHeaders::Trusted)
    }

    /// A machine whose chat route is precise (it sends prompt fields).
    fn precise_machine() -> RequestMachine {
        let config = FilterConfig::from_json(
            br#"{"routes":[{"path":"/v1/chat/completions","api":"chat","mode":"precise"}]}"#,
        )
        .unwrap();
        RequestMachine::new(Arc::new(config))
    }

    fn headers<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Iterator<Item = (&'a str, &'a [u8])> {
        pairs.iter().map(|(k, v)| (*k, v.as_bytes()))
    }

    fn post(path: &str) -> Vec<(&str, &str)> {
        vec![
            (":method", "POST"),
            (":path", path),
            ("content-type", "application/json"),
        ]
    }

    fn chat_body(text: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "model": "m", "user": "u1", "max_tokens": 9,
            "messages": [{"role": "user", "content": text}]
        }))
        .unwrap()
    }

    /// Drives a machine to the point where the route call is dispatched; returns the request.
    fn to_dispatch(m: &mut RequestMachine, extra: &[(&str, &str)], body: &[u8]) -> RouteRequest {
        to_dispatch_at(m, CHAT, extra, body)
    }

    /// [`to_dispatch`] for a request on `path`.
    fn to_dispatch_at(
        m: &mut RequestMachine,
        path: &str,
        extra: &[(&str, &str)],
        body: &[u8],
    ) -> RouteRequest {
        let mut h = post(path);
        h.extend_from_slice(extra);
        assert_eq!(
            m.on_request_headers(headers(&h), false).action,
            Action::Pause
        );
        assert_eq!(
            m.on_request_body(body.len() / 2, false),
            BodyStep::Step(Step::hold(vec![]))
        );
        assert_eq!(
            m.on_request_body(body.len(), true),
            BodyStep::ReadBody(body.len())
        );
        let step = m.on_body_complete(body, 100);
        assert_eq!(step.action, Action::Pause);
        let [Effect::DispatchRoute { body }] = step.effects.as_slice() else {
            panic!("{step:?}")
        };
        m.on_dispatched();
        serde_json::from_slice(body).unwrap()
    }

    fn answer(endpoints: &[&str]) -> Vec<u8> {
        serde_json::to_vec(&RouteResponse {
            decision_id: 42,
            endpoints: endpoints.iter().map(|e| e.to_string()).collect(),
            cached_blocks: 1,
            reason: "prefix".into(),
            ..RouteResponse::default()
        })
        .unwrap()
    }

    /// The route request a step dispatches.
    fn dispatched(step: &Step) -> RouteRequest {
        let Some(Effect::DispatchRoute { body }) = step
            .effects
            .iter()
            .find(|e| matches!(e, Effect::DispatchRoute { .. }))
        else {
            panic!("no route call: {step:?}")
        };
        serde_json::from_slice(body).unwrap()
    }

    #[test]
    fn agent_session_headers_rank_below_the_configured_one_in_any_order() {
        let body = chat_body("hi");
        let req = to_dispatch(
            &mut machine(),
            &[
                ("session_id", "codex-old"),
                ("x-claude-code-session-id", "cc"),
            ],
            &body,
        );
        assert_eq!(req.session.as_deref(), Some("cc"));
        let req = to_dispatch(
            &mut machine(),
            &[("x-claude-code-session-id", "cc"), ("x-session-id", "mine")],
            &body,
        );
        assert_eq!(req.session.as_deref(), Some("mine"));
        let req = to_dispatch(&mut machine(), &[("session-id", "codex")], &body);
        assert_eq!(req.session.as_deref(), Some("codex"));
        // Blank headers do not count; the body's key does.
        let req = to_dispatch(&mut machine(), &[("session-id", "  ")], &body);
        assert_eq!(req.session.as_deref(), Some("u1"));
    }

    #[test]
    fn a_cache_control_marker_sends_the_whole_blocks_before_it() {
        let system = "s".repeat(3 * DEFAULT_BLOCK_BYTES);
        let body = |marked: bool| {
            let marker = if marked {
                r#","cache_control":{"type":"ephemeral"}"#
            } else {
                ""
            };
            format!(
                r#"{{"model":"m","max_tokens":4,"system":[{{"type":"text","text":"{system}"{marker}}}],
                "messages":[{{"role":"user","content":"{}"}}]}}"#,
                "q".repeat(2 * DEFAULT_BLOCK_BYTES)
            )
        };
        let marked = to_dispatch_at(&mut machine(), "/v1/messages", &[], body(true).as_bytes());
        let plain = to_dispatch_at(&mut machine(), "/v1/messages", &[], body(false).as_bytes());
        // The system prompt fills three blocks and a few bytes: the marker covers three; the
        // question after it is not marked.
        assert_eq!(marked.marked_blocks, 3);
        assert!(marked.block_hashes.len() > 3);
        assert_eq!(plain.marked_blocks, 0);
        assert_eq!(marked.block_hashes, plain.block_hashes);
    }

    #[test]
    fn a_responses_chain_names_its_previous_response_and_reports_its_own() {
        let mut m = machine();
        let body = br#"{"model":"m","input":"next","previous_response_id":"resp_a","prompt_cache_key":"pk"}"#;
        let req = to_dispatch_at(&mut m, "/v1/responses", &[], body);
        assert_eq!(req.previous_response_id.as_deref(), Some("resp_a"));
        assert_eq!(req.session.as_deref(), Some("pk"));
        assert!(req.prompt_bytes > 0);
        m.on_route_response(Some(200), &answer(&["10.0.0.1:8000"]), 110);
        m.on_response_headers(Some(200), Some("10.0.0.1:8000"));
        m.on_response_body(
            b"event: response.created\ndata: {\"response\":{\"id\":\"resp_",
            120,
        );
        m.on_response_body(b"b7\",\"usage\":null}}\n\n", 121);
        m.on_response_body(
            br#"data: {"response":{"usage":{"input_tokens":90,"input_tokens_details":{"cached_tokens":64},"output_tokens":4}}}"#,
            130,
        );
        let outcome = m.on_done(140).unwrap();
        assert_eq!(outcome.response_id.as_deref(), Some("resp_b7"));
        assert_eq!(
            (
                outcome.prompt_tokens,
                outcome.cached_tokens,
                outcome.completion_tokens
            ),
            (Some(90), Some(64), Some(4))
        );
        // A failed answer stored nothing.
        let mut m = machine();
        to_dispatch_at(&mut m, "/v1/responses", &[], br#"{"input":"x"}"#);
        m.on_route_response(Some(200), &answer(&["10.0.0.1:8000"]), 110);
        m.on_response_headers(Some(404), Some("10.0.0.1:8000"));
        m.on_response_body(br#"{"id":"resp_c"}"#, 120);
        assert_eq!(m.on_done(130).unwrap().response_id, None);
    }

    #[test]
    fn reading_or_cancelling_a_stored_response_is_routed_from_the_headers() {
        let get = [(":method", "GET"), (":path", "/v1/responses/resp_x1")];
        let mut m = machine();
        let step = m.on_request_headers(headers(&get), true);
        assert_eq!(step.action, Action::Pause);
        let req = dispatched(&step);
        assert_eq!(req.previous_response_id.as_deref(), Some("resp_x1"));
        assert!(req.block_hashes.is_empty() && req.model.is_empty());
        m.on_dispatched();
        let step = m.on_route_response(Some(200), &answer(&["10.0.0.2:8000"]), 5);
        assert!(step.effects.contains(&Effect::ResumeRequest));
        // A cancel with a body waits for it, then ignores it.
        let mut m = machine();
        let cancel = post("/v1/responses/resp_x1/cancel");
        assert_eq!(
            m.on_request_headers(headers(&cancel), false).action,
            Action::Pause
        );
        assert_eq!(m.on_request_body(2, true), BodyStep::ReadBody(2));
        let req = dispatched(&m.on_body_complete(b"{}", 9));
        assert_eq!(req.previous_response_id.as_deref(), Some("resp_x1"));
        // Local decisions route it without a call.
        let mut m = machine();
        let step = m.on_request_headers_with(headers(&get), true, 0, |r| {
            assert_eq!(r.previous_response_id.as_deref(), Some("resp_x1"));
            serde_json::from_slice(&answer(&["10.0.0.3:8000"])).ok()
        });
        assert_eq!(step.action, Action::Continue);
        // Other methods pass through, untouched.
        for other in [
            vec![(":method", "DELETE"), (":path", "/v1/responses/resp_x1")],
            vec![(":method", "POST"), (":path", "/v1/responses/resp_x1")],
            vec![
                (":method", "GET"),
                (":path", "/v1/responses/resp_x1/cancel"),
            ],
        ] {
            let step = machine().on_request_headers(headers(&other), true);
            assert_eq!(step, Step::go(vec![]), "{other:?}");
        }
    }

    #[test]
    fn load_routes_send_the_model_and_size_only() {
        let body = br#"{"model":"e5","input":["a long text to embed"]}"#;
        let mut m = trusted_machine();
        let req = to_dispatch_at(&mut m, "/v1/embeddings", &[("x-kvroute-tenant", "t")], body);
        assert_eq!(req.model, "e5");
        assert!(req.block_hashes.is_empty());
        assert_eq!(req.prompt_bytes, 0, "no canonical prompt");
        assert_eq!(req.prompt_tokens as usize, body.len().div_ceil(4));
        assert_eq!(req.max_output_tokens, Some(0));
        assert_eq!(req.tenant.as_deref(), Some("t"));
        // Not JSON: fail open, as any unreadable body.
        let mut m = machine();
        m.on_request_headers(headers(&post("/v1/messages/count_tokens")), false);
        m.on_request_body(3, true);
        let step = m.on_body_complete(b"abc", 1);
        assert!(
            step.effects
                .contains(&Effect::Count(Counter::FailOpen(FailKind::BodyParse))),
            "{step:?}"
        );
    }

    #[test]
    fn anthropic_messages_are_routed_with_claude_codes_session() {
        let body = br#"{"model":"m","max_tokens":5,"metadata":{"user_id":"user_1_account_2_session_s9"},
            "messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]}]}"#;
        let req = to_dispatch_at(&mut machine(), "/v1/messages", &[], body);
        assert_eq!(req.session.as_deref(), Some("s9"));
        assert_eq!(req.max_output_tokens, Some(5));
        assert!(req.prompt_bytes > 0);
    }

    /// Drives a machine to its complete body, then offers the request to `decide`.
    fn with_decider(
        m: &mut RequestMachine,
        body: &[u8],
        decide: impl FnMut(&mut RouteRequest) -> Option<RouteResponse>,
    ) -> Step {
        m.on_request_headers(headers(&post(CHAT)), false);
        assert_eq!(
            m.on_request_body(body.len(), true),
            BodyStep::ReadBody(body.len())
        );
        m.on_body_complete_with(body, 100, || None, decide)
    }

    // `decision: local`: a usable local answer routes inside the body callback (Continue, no
    // call), and the outcome report names the local decision.
    #[test]
    fn a_local_decision_routes_without_a_call() {
        let mut m = machine();
        let body = chat_body(&"y".repeat(2 * DEFAULT_BLOCK_BYTES));
        let mut offered = None;
        let step = with_decider(&mut m, &body, |request| {
            offered = Some(request.clone());
            serde_json::from_slice(&answer(&["10.0.0.3:8000"])).ok()
        });
        assert!(offered.is_some_and(|r| r.block_hashes.len() >= 2 && r.prompt_text.is_none()));
        assert_eq!(
            step,
            Step::go(vec![
                Effect::SetRequestHeader {
                    name: "x-gateway-destination-endpoint".into(),
                    value: "10.0.0.3:8000".into()
                },
                Effect::Count(Counter::Routed),
                Effect::Count(Counter::DecidedLocally),
            ])
        );
        m.on_response_headers(Some(200), Some("10.0.0.3:8000"));
        let outcome = m.on_done(120).unwrap();
        assert_eq!((outcome.decision_id, outcome.status), (42, 200));
    }

    // No local answer, a refusal or an unusable list: the control plane is asked as before, so
    // its answer (and its refusals) still decide.
    #[test]
    fn without_a_usable_local_answer_the_control_plane_is_asked() {
        let refusal = RouteResponse {
            reject: Some(Reject {
                status: 429,
                ..Reject::default()
            }),
            ..RouteResponse::default()
        };
        let not_an_address = serde_json::from_slice(&answer(&["not-an-endpoint"])).ok();
        for local in [
            None,
            Some(refusal),
            Some(RouteResponse::default()),
            not_an_address,
        ] {
            let mut m = machine();
            let step = with_decider(&mut m, &chat_body("hello"), |_| local.clone());
            assert_eq!(step.action, Action::Pause, "{local:?}");
            assert!(matches!(
                step.effects.as_slice(),
                [Effect::DispatchRoute { .. }]
            ));
        }
    }

    #[test]
    fn happy_path_sets_header_and_reports_outcome() {
        let mut m = machine();
        let text = "x".repeat(3 * DEFAULT_BLOCK_BYTES);
        let req = to_dispatch(&mut m, &[], &chat_body(&text));
        assert_eq!(req.model, "m");
        assert!(req.block_hashes.len() >= 3);
        assert_eq!(req.max_output_tokens, Some(9));
        assert_eq!(req.session.as_deref(), Some("u1"));
        assert_eq!(req.prompt_text, None);
        assert!(req.prompt_tokens as u64 * 4 >= req.prompt_bytes);

        let step =
            m.on_route_response(Some(200), &answer(&["10.0.0.1:8000", "10.0.0.2:8000"]), 103);
        assert_eq!(
            step.effects,
            vec![
                Effect::RouteLatencyMs(3),
                Effect::SetRequestHeader {
                    name: "x-gateway-destination-endpoint".into(),
                    value: "10.0.0.1:8000,10.0.0.2:8000".into()
                },
                Effect::ResumeRequest,
                Effect::Count(Counter::Routed),
            ]
        );
        m.on_response_headers(Some(200), Some("10.0.0.1:8000"));
        assert!(m.wants_response_body());
        m.on_response_body(b"", 104);
        m.on_response_body(b"data: {\"choices\":[]}\n\n", 110);
        m.on_response_body(
            b"data: {\"usage\":{\"prompt_tokens\":200,\"completion_tokens\":3,",
            120,
        );
        m.on_response_body(
            b"\"prompt_tokens_details\":{\"cached_tokens\":128}}}\n\ndata: [DONE]\n\n",
            130,
        );
        let outcome = m.on_done(140).unwrap();
        assert_eq!(
            outcome,
            Outcome {
                decision_id: 42,
                endpoint: "10.0.0.1:8000".into(),
                status: 200,
                ttfb_ms: Some(7),
                total_ms: 37,
                prompt_tokens: Some(200),
                completion_tokens: Some(3),
                cached_tokens: Some(128),
                response_id: None,
                decision_tag: 0,
            }
        );
        assert_eq!(m.on_done(150), None, "reported once");
    }

    // A streamed response's first chunk is its first token: reported once, with the decision's
    // tag and the time since it was routed; a buffered response's first chunk is its end, and
    // an error's is no token.
    #[test]
    fn a_streamed_responses_first_chunk_reports_its_first_token() {
        let streamed = |stream: bool, status: u16| {
            let mut m = machine();
            let body = serde_json::to_vec(&serde_json::json!({
                "model": "m", "stream": stream,
                "messages": [{"role": "user", "content": "hello"}]
            }))
            .unwrap();
            let req = to_dispatch(&mut m, &[], &body);
            assert_eq!(req.stream, stream);
            m.on_route_response(Some(200), &answer(&["10.0.0.1:8000"]), 103);
            m.on_response_headers(Some(status), Some("10.0.0.1:8000"));
            assert_eq!(
                m.on_response_body(b"", 104),
                None,
                "an empty chunk is no token"
            );
            let first = m.on_response_body(b"data: {\"choices\":[]}\n\n", 110);
            assert_eq!(m.on_response_body(b"data: [DONE]\n\n", 120), None, "once");
            first
        };
        assert_eq!(
            streamed(true, 200),
            Some(FirstToken {
                decision_id: 42,
                decision_tag: 0,
                ttft_ms: Some(7),
            })
        );
        assert_eq!(streamed(false, 200), None);
        assert_eq!(streamed(true, 500), None);
    }

    // The host reads the status with the response headers only for a streamed response (its
    // first chunk needs it); the status and upstream of any routed request are asked for once
    // more before the outcome, and nothing after it.
    #[test]
    fn the_status_is_read_early_only_for_a_streamed_response() {
        let routed = |stream: bool| {
            let mut m = machine();
            let body = serde_json::to_vec(&serde_json::json!({
                "model": "m", "stream": stream,
                "messages": [{"role": "user", "content": "hello"}]
            }))
            .unwrap();
            to_dispatch(&mut m, &[], &body);
            m.on_route_response(Some(200), &answer(&["10.0.0.1:8000"]), 103);
            m
        };
        let both = ResponseInfo {
            upstream: true,
            status: true,
        };
        let mut buffered = routed(false);
        assert!(!buffered.wants_status_early());
        assert_eq!(buffered.wants_response_info(), both);
        buffered.on_response_headers(Some(503), Some("10.0.0.2:8000"));
        let outcome = buffered.on_done(150).unwrap();
        assert_eq!(
            (outcome.status, outcome.endpoint.as_str()),
            (503, "10.0.0.2:8000")
        );
        assert_eq!(
            buffered.wants_response_info(),
            ResponseInfo {
                upstream: false,
                status: false
            },
            "nothing to read once finished"
        );

        let mut streamed = routed(true);
        assert!(streamed.wants_status_early());
        streamed.on_response_headers(Some(200), None);
        assert!(!streamed.wants_status_early());
        assert_eq!(
            streamed.wants_response_info(),
            ResponseInfo {
                upstream: true,
                status: false
            },
            "the status is known"
        );
    }

    #[test]
    fn hashes_are_those_of_scorer_core() {
        let mut m = machine();
        let body = chat_body(&"abc".repeat(400));
        let req = to_dispatch(&mut m, &[], &body);
        let prompt = canon::canonicalize(ApiKind::Chat, &body).unwrap();
        assert_eq!(
            req.block_hashes,
            block_hashes(model_seed("m"), &prompt.bytes, DEFAULT_BLOCK_BYTES)
        );
        assert_eq!(req.prompt_bytes, prompt.bytes.len() as u64);
    }

    #[test]
    fn cache_salt_seeds_the_hashes_and_travels_only_on_precise_routes() {
        let salted = |salt: &str| {
            serde_json::to_vec(&serde_json::json!({
                "model": "m", "cache_salt": salt,
                "messages": [{"role": "user", "content": "abc".repeat(400)}]
            }))
            .unwrap()
        };
        let body = salted("tenant-a");
        let prompt = canon::canonicalize(ApiKind::Chat, &body).unwrap();
        let req = to_dispatch(&mut machine(), &[], &body);
        assert_eq!(
            req.block_hashes,
            block_hashes(
                request_seed("m", Some("tenant-a")),
                &prompt.bytes,
                DEFAULT_BLOCK_BYTES
            )
        );
        let plain = block_hashes(model_seed("m"), &prompt.bytes, DEFAULT_BLOCK_BYTES);
        assert!(req.block_hashes.iter().all(|h| !plain.contains(h)));
        assert_eq!(req.cache_salt, None, "approximate routes send hashes only");

        let req = to_dispatch(&mut precise_machine(), &[], &body);
        assert_eq!(req.cache_salt.as_deref(), Some("tenant-a"));
        let text: serde_json::Value = serde_json::from_str(&req.prompt_text.unwrap()).unwrap();
        assert!(
            text.get("cache_salt").is_none(),
            "the salt is no prompt field"
        );

        // A salt vLLM would refuse (empty, not a string) is a bad body: fail open.
        for body in [salted(""), br#"{"messages":[],"cache_salt":1}"#.to_vec()] {
            let mut m = machine();
            m.on_request_headers(headers(&post(CHAT)), false);
            m.on_request_body(body.len(), true);
            assert_eq!(
                m.on_body_complete(&body, 1),
                Step::go(vec![Effect::Count(Counter::FailOpen(FailKind::BodyParse))])
            );
        }
    }

    #[test]
    fn precise_routes_send_prompt_fields_approximate_ones_never() {
        let mut m = precise_machine();
        let body = br#"{"model":"m","temperature":0.5,"messages":[{"role":"user","content":"hi \u00e9"}],
            "tools":[{"type":"function"}],"chat_template_kwargs":{"enable_thinking":false},"max_tokens":3}"#;
        let req = to_dispatch(&mut m, &[], body);
        assert_eq!(req.api, Some(ApiKind::Chat));
        let text = req.prompt_text.unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"model":"m","messages":[{"role":"user","content":"hi é"}],
                "tools":[{"type":"function"}],"chat_template_kwargs":{"enable_thinking":false}})
        );
        assert!(!req.block_hashes.is_empty() || req.prompt_bytes < 256);

        let mut m = machine();
        let req = to_dispatch(&mut m, &[], body);
        assert_eq!((req.prompt_text, req.api), (None, None));
    }

    #[test]
    fn session_header_wins_over_user() {
        let mut m = machine();
        let req = to_dispatch(&mut m, &[("x-session-id", "s-7")], &chat_body("hi"));
        assert_eq!(req.session.as_deref(), Some("s-7"));
    }

    #[test]
    fn the_session_header_is_configurable() {
        let mut m = machine_with(|c| c.session_header = "x-conversation".into());
        let req = to_dispatch(
            &mut m,
            &[("x-session-id", "ignored"), ("x-conversation", "c-9")],
            &chat_body("hi"),
        );
        assert_eq!(req.session.as_deref(), Some("c-9"));
    }

    #[test]
    fn client_routing_headers_are_always_stripped() {
        for path in [CHAT, "/v1/models"] {
            let mut m = machine();
            let mut h = post(path);
            h.push(("X-Gateway-Destination-Endpoint", "6.6.6.6:1"));
            h.push(("x-prefiller-host-port", "6.6.6.6:2"));
            let step = m.on_request_headers(headers(&h), false);
            assert_eq!(
                step.effects[..2],
                [
                    Effect::RemoveRequestHeader("x-gateway-destination-endpoint".into()),
                    Effect::RemoveRequestHeader("x-prefiller-host-port".into()),
                ]
            );
        }
    }

    #[test]
    fn non_inference_requests_pass_untouched() {
        let mut m = machine();
        let step = m.on_request_headers(headers(&post("/v1/models")), false);
        assert_eq!(step, Step::go(vec![]));
        assert_eq!(
            m.on_request_body(10, true),
            BodyStep::Step(Step::go(vec![]))
        );
        assert_eq!(m.on_done(5), None);
    }

    #[test]
    fn skip_reasons() {
        type Case<'a> = (&'a [(&'a str, &'a str)], bool, SkipReason);
        let cases: [Case<'_>; 7] = [
            (
                &[(":method", "GET"), (":path", CHAT)],
                false,
                SkipReason::NotPost,
            ),
            (
                &[
                    (":method", "POST"),
                    (":path", CHAT),
                    ("content-encoding", "gzip"),
                ],
                false,
                SkipReason::ContentEncoding,
            ),
            (
                &[
                    (":method", "POST"),
                    (":path", CHAT),
                    ("content-type", "text/plain"),
                ],
                false,
                SkipReason::NotJson,
            ),
            (
                &[
                    (":method", "POST"),
                    (":path", CHAT),
                    ("content-length", "4194305"),
                ],
                false,
                SkipReason::TooLarge,
            ),
            (
                &[
                    (":method", "POST"),
                    (":path", CHAT),
                    ("content-length", "lots"),
                ],
                false,
                SkipReason::TooLarge,
            ),
            (
                &[(":method", "POST"), (":path", CHAT)],
                true,
                SkipReason::NoBody,
            ),
            (
                &[
                    (":method", "POST"),
                    (":path", CHAT),
                    ("content-length", "0"),
                ],
                false,
                SkipReason::NoBody,
            ),
        ];
        for (h, eos, reason) in cases {
            let mut m = machine();
            let step = m.on_request_headers(headers(h), eos);
            assert_eq!(
                step,
                Step::go(vec![Effect::Count(Counter::Skipped(reason))]),
                "{h:?}"
            );
        }
        let mut m = machine();
        let h = [
            (":method", "POST"),
            (":path", "/v1/completions?x=1"),
            ("content-type", "application/json; charset=utf-8"),
            ("content-encoding", "identity"),
            ("content-length", "100"),
        ];
        assert_eq!(
            m.on_request_headers(headers(&h), false).action,
            Action::Pause
        );
    }

    #[test]
    fn body_limit_while_buffering() {
        let mut m = machine_with(|c| c.max_body_bytes = 100);
        assert_eq!(
            m.on_request_headers(headers(&post(CHAT)), false).action,
            Action::Pause
        );
        assert_eq!(
            m.on_request_body(100, false),
            BodyStep::Step(Step::hold(vec![]))
        );
        assert_eq!(
            m.on_request_body(101, false),
            BodyStep::Step(Step::go(vec![Effect::Count(Counter::FailOpen(
                FailKind::BodyTooLarge
            ))]))
        );
        assert_eq!(
            m.on_request_body(200, true),
            BodyStep::Step(Step::go(vec![]))
        );
    }

    #[test]
    fn trailers_end_the_body() {
        let mut m = machine_with(|c| c.max_body_bytes = 1000);
        m.on_request_headers(headers(&post(CHAT)), false);
        assert_eq!(
            m.on_request_body(10, false),
            BodyStep::Step(Step::hold(vec![]))
        );
        assert_eq!(m.on_request_trailers(), BodyStep::ReadBody(1001));
        assert_eq!(
            m.on_body_complete(&chat_body("hi"), 5).action,
            Action::Pause
        );

        let mut m = machine_with(|c| c.max_body_bytes = 10);
        m.on_request_headers(headers(&post(CHAT)), false);
        m.on_request_trailers();
        assert_eq!(
            m.on_body_complete(&[b' '; 11], 5),
            Step::go(vec![Effect::Count(Counter::FailOpen(
                FailKind::BodyTooLarge
            ))])
        );
        let mut m = machine();
        assert_eq!(m.on_request_trailers(), BodyStep::Step(Step::go(vec![])));
    }

    #[test]
    fn unparseable_body_fails_open_in_callback() {
        for body in [&b"{not json"[..], b"{}", b"{\"messages\":5}", b"\xff"] {
            let mut m = machine();
            m.on_request_headers(headers(&post(CHAT)), false);
            assert_eq!(
                m.on_request_body(body.len(), true),
                BodyStep::ReadBody(body.len())
            );
            assert_eq!(
                m.on_body_complete(body, 1),
                Step::go(vec![Effect::Count(Counter::FailOpen(FailKind::BodyParse))])
            );
        }
        let mut m = machine();
        m.on_request_headers(headers(&post(CHAT)), false);
        m.on_request_body(3, true);
        assert_eq!(
            m.on_body_read_failed(),
            Step::go(vec![Effect::Count(Counter::FailOpen(FailKind::BodyRead))])
        );
    }

    #[test]
    fn dispatch_failure_continues_without_resume() {
        let mut m = machine();
        m.on_request_headers(headers(&post(CHAT)), false);
        m.on_request_body(2, true);
        let step = m.on_body_complete(&chat_body("hi"), 1);
        assert_eq!(step.action, Action::Pause);
        assert_eq!(
            m.on_dispatch_failed(),
            Step::go(vec![Effect::Count(Counter::FailOpen(FailKind::Dispatch))])
        );
        assert_eq!(
            m.on_route_response(Some(200), &answer(&["1.2.3.4:5"]), 2),
            Step::go(vec![])
        );
    }

    #[test]
    fn every_bad_route_answer_fails_open_with_resume() {
        let cases: [(Option<u16>, Vec<u8>, FailKind); 7] = [
            (None, vec![], FailKind::Reset),
            (
                Some(504),
                b"upstream request timeout".to_vec(),
                FailKind::Timeout,
            ),
            (Some(503), answer(&["1.2.3.4:5"]), FailKind::Status),
            (Some(200), b"garbage".to_vec(), FailKind::BadResponse),
            (Some(200), answer(&[]), FailKind::NoEndpoint),
            (
                Some(200),
                answer(&["1.2.3.4:5", "evil\r\nx: y"]),
                FailKind::BadResponse,
            ),
            (Some(200), answer(&["a:1,b:2"]), FailKind::BadResponse),
        ];
        for (status, body, kind) in cases {
            let mut m = machine();
            to_dispatch(&mut m, &[], &chat_body("hi"));
            let step = m.on_route_response(status, &body, 150);
            assert_eq!(
                step,
                Step::go(vec![
                    Effect::RouteLatencyMs(50),
                    Effect::ResumeRequest,
                    Effect::Count(Counter::FailOpen(kind))
                ]),
                "{kind:?}"
            );
            assert!(!m.wants_response_body());
            assert_eq!(m.on_done(200), None, "unrouted requests report no outcome");
        }
        let mut m = machine();
        to_dispatch(&mut m, &[], &chat_body("hi"));
        assert_eq!(
            m.on_route_failure(FailKind::BadResponse),
            Step::go(vec![
                Effect::ResumeRequest,
                Effect::Count(Counter::FailOpen(FailKind::BadResponse))
            ])
        );
    }

    #[test]
    fn reset_stream_still_reports_outcome() {
        let mut m = machine();
        to_dispatch(&mut m, &[], &chat_body("hi"));
        m.on_route_response(Some(200), &answer(&["1.2.3.4:5"]), 110);
        let o = m.on_done(300).unwrap();
        assert_eq!(
            (o.status, o.ttfb_ms, o.total_ms, o.endpoint.as_str()),
            (0, None, 190, "1.2.3.4:5")
        );
        assert_eq!(o.prompt_tokens, None);
    }

    #[test]
    fn non_streaming_json_usage() {
        let mut m = machine();
        to_dispatch(&mut m, &[], &chat_body("hi"));
        m.on_route_response(Some(200), &answer(&["1.2.3.4:5"]), 110);
        m.on_response_headers(Some(200), None);
        m.on_response_body(
            br#"{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":5,"#,
            120,
        );
        m.on_response_body(br#""completion_tokens":1,"total_tokens":6}}"#, 121);
        let o = m.on_done(125).unwrap();
        assert_eq!(
            (o.prompt_tokens, o.completion_tokens, o.cached_tokens),
            (Some(5), Some(1), None)
        );
    }

    fn explaining() -> RequestMachine {
        RequestMachine::new(Arc::new(FilterConfig {
            allow_explain: true,
            ..FilterConfig::default()
        }))
    }

    #[test]
    fn explain_header_names_the_decision_when_asked_and_allowed() {
        let mut m = explaining();
        to_dispatch(&mut m, &[("x-kvroute-explain", " 1 ")], &chat_body("hi"));
        m.on_route_response(Some(200), &answer(&["10.0.0.1:8000", "10.0.0.2:8000"]), 110);
        assert_eq!(
            m.decision_header(),
            Some("id=42; reason=prefix; endpoint=10.0.0.1:8000; cached_blocks=1")
        );

        // Asked but not allowed, allowed but not asked, or asked with another value: nothing.
        for (mut m, extra) in [
            (machine(), vec![("x-kvroute-explain", "1")]),
            (explaining(), vec![]),
            (explaining(), vec![("x-kvroute-explain", "yes")]),
        ] {
            to_dispatch(&mut m, &extra, &chat_body("hi"));
            m.on_route_response(Some(200), &answer(&["10.0.0.1:8000"]), 110);
            assert_eq!(m.decision_header(), None, "{extra:?}");
        }
    }

    #[test]
    fn explain_header_tells_fail_open_and_skip_apart() {
        let mut m = explaining();
        to_dispatch(&mut m, &[("x-kvroute-explain", "1")], &chat_body("hi"));
        m.on_route_response(Some(504), b"", 110);
        assert_eq!(m.decision_header(), Some("reason=fail_open; error=timeout"));

        let mut m = explaining();
        let h = [
            (":method", "GET"),
            (":path", CHAT),
            ("x-kvroute-explain", "1"),
        ];
        m.on_request_headers(headers(&h), true);
        assert_eq!(m.decision_header(), Some("reason=skipped; skip=not_post"));

        let mut m = explaining();
        let h = [
            (":method", "GET"),
            (":path", "/v1/models"),
            ("x-kvroute-explain", "1"),
        ];
        m.on_request_headers(headers(&h), true);
        assert_eq!(m.decision_header(), None, "not an inference path");
    }

    #[test]
    fn client_sent_decision_header_is_removed_and_reason_is_sanitised() {
        let mut m = explaining();
        let mut h = post(CHAT);
        h.push(("X-Kvroute-Decision", "id=1; endpoint=6.6.6.6:1"));
        let step = m.on_request_headers(headers(&h), false);
        assert!(
            step.effects
                .contains(&Effect::RemoveRequestHeader("x-kvroute-decision".into())),
            "{step:?}"
        );

        let mut m = explaining();
        to_dispatch(&mut m, &[("x-kvroute-explain", "1")], &chat_body("hi"));
        let body = serde_json::to_vec(&RouteResponse {
            decision_id: 7,
            endpoints: vec!["10.0.0.1:8000".into()],
            cached_blocks: 0,
            reason: "Lo\r\nad; x=1 ".repeat(10).into(),
            ..RouteResponse::default()
        })
        .unwrap();
        m.on_route_response(Some(200), &body, 110);
        let value = m.decision_header().unwrap();
        assert!(value.starts_with("id=7; reason=loadx1loadx1"), "{value}");
        assert!(
            value.bytes().all(|b| b.is_ascii_graphic() || b == b' '),
            "{value}"
        );
    }

    #[test]
    fn hashing_is_timed_with_the_host_clock() {
        let mut m = machine();
        m.on_request_headers(headers(&post(CHAT)), false);
        let body = chat_body(&"abc ".repeat(500));
        m.on_request_body(body.len(), true);
        // With `time-decision` the figure is the decider's time, read around it.
        #[cfg(not(feature = "time-decision"))]
        let mut reads = [1_000_000u64, 1_250_999].into_iter();
        #[cfg(feature = "time-decision")]
        let mut reads = [1_000_000u64, 1_250_999, 2_000_000, 2_007_000].into_iter();
        let step = m.on_body_complete_timed(&body, 5, || reads.next());
        assert_eq!(step.action, Action::Pause);
        let want = if cfg!(feature = "time-decision") {
            7
        } else {
            250
        };
        assert_eq!(step.effects[0], Effect::HashMicros(want));
        assert!(matches!(step.effects[1], Effect::DispatchRoute { .. }));

        // No clock, no measurement; an unparseable body records none either.
        let mut m = machine();
        m.on_request_headers(headers(&post(CHAT)), false);
        m.on_request_body(body.len(), true);
        let step = m.on_body_complete_timed(&body, 5, || None);
        assert!(matches!(step.effects[..], [Effect::DispatchRoute { .. }]));
        let mut m = machine();
        m.on_request_headers(headers(&post(CHAT)), false);
        m.on_request_body(3, true);
        let mut t = 0;
        let step = m.on_body_complete_timed(b"{x]", 5, || {
            t += 1_000;
            Some(t)
        });
        assert_eq!(
            step.effects,
            vec![Effect::Count(Counter::FailOpen(FailKind::BodyParse))]
        );
    }

    #[test]
    fn tenant_and_criticality_headers_reach_the_route_call() {
        let mut m = trusted_machine();
        let req = to_dispatch(
            &mut m,
            &[
                ("x-kvroute-tenant", " acme "),
                ("x-kvroute-criticality", "sheddable"),
            ],
            &chat_body("hi"),
        );
        assert_eq!(req.tenant.as_deref(), Some("acme"));
        assert_eq!(
            req.criticality.as_ref().map(RequestedCriticality::as_str),
            Some("sheddable")
        );
        let mut m = trusted_machine();
        let req = to_dispatch(&mut m, &[], &chat_body("hi"));
        assert_eq!((req.tenant, req.criticality), (None, None));
    }

    #[test]
    fn llmd_headers_are_accepted_but_the_configured_ones_win() {
        let mut m = trusted_machine();
        let req = to_dispatch(
            &mut m,
            &[
                (LLMD_FAIRNESS_HEADER, "flow-a"),
                (LLMD_OBJECTIVE_HEADER, "batch"),
            ],
            &chat_body("hi"),
        );
        assert_eq!(req.tenant.as_deref(), Some("flow-a"));
        assert_eq!(
            req.criticality.as_ref().map(RequestedCriticality::as_str),
            Some("batch")
        );
        for order in [true, false] {
            let mut pairs = vec![
                (LLMD_FAIRNESS_HEADER, "flow-a"),
                ("x-kvroute-tenant", "acme"),
                (LLMD_OBJECTIVE_HEADER, "-1"),
                ("x-kvroute-criticality", "critical"),
            ];
            if order {
                pairs.reverse();
            }
            let mut m = trusted_machine();
            let req = to_dispatch(&mut m, &pairs, &chat_body("hi"));
            assert_eq!(req.tenant.as_deref(), Some("acme"));
            assert_eq!(
                req.criticality.as_ref().map(RequestedCriticality::as_str),
                Some("critical")
            );
        }
    }

    /// Issue #20, defect 5: by default a client cannot pick its tenant or criticality (it
    /// could claim another tenant's share or `critical` and skip shedding); the headers are
    /// removed before the request goes upstream.
    #[test]
    fn client_chosen_tenant_and_criticality_are_ignored_and_stripped_by_default() {
        let claims = [
            ("x-kvroute-tenant", "someone-else"),
            (LLMD_FAIRNESS_HEADER, "flow-a"),
            ("x-kvroute-criticality", "critical"),
            (LLMD_OBJECTIVE_HEADER, "premium"),
        ];
        let mut m = machine();
        let mut h = post(CHAT);
        h.extend_from_slice(&claims);
        let step = m.on_request_headers(headers(&h), false);
        for (name, _) in claims {
            assert!(
                step.effects
                    .contains(&Effect::RemoveRequestHeader(name.to_string())),
                "{name}: {step:?}"
            );
        }
        let body = chat_body("hi");
        m.on_request_body(body.len(), true);
        let step = m.on_body_complete(&body, 1);
        let req = dispatched(&step);
        assert_eq!((req.tenant, req.criticality), (None, None));
    }

    /// Issue #20, defect 1: a route call given up (no answer in time, a reset, an unusable
    /// answer) is withdrawn; one the control plane answered (a refusal, no endpoint) is not.
    #[test]
    fn a_route_call_given_up_is_withdrawn() {
        let cases: [(Option<u16>, Vec<u8>, bool); 5] = [
            (Some(504), b"upstream request timeout".to_vec(), true),
            (None, vec![], true),
            (Some(200), b"garbage".to_vec(), true),
            (Some(200), answer(&[]), false),
            (Some(401), b"{}".to_vec(), false),
        ];
        for (status, body, withdrawn) in cases {
            let mut m = machine();
            let chat = chat_body("hi");
            let step = with_decider(&mut m, &chat, |r| {
                r.call_id = Some(99);
                None
            });
            assert_eq!(dispatched(&step).call_id, Some(99));
            m.on_dispatched();
            let step = m.on_route_response(status, &body, 150);
            assert_eq!(
                step.effects.contains(&Effect::Withdraw(99)),
                withdrawn,
                "{status:?}: {step:?}"
            );
        }
        // The answer's tag travels back in the outcome.
        let mut m = machine();
        to_dispatch(&mut m, &[], &chat_body("hi"));
        let tagged = serde_json::to_vec(&RouteResponse {
            decision_id: 3,
            decision_tag: 0xfeed,
            endpoints: vec!["1.2.3.4:5".into()],
            ..RouteResponse::default()
        })
        .unwrap();
        m.on_route_response(Some(200), &tagged, 110);
        assert_eq!(m.on_done(120).unwrap().decision_tag, 0xfeed);
    }

    #[test]
    fn long_tenant_values_are_truncated() {
        let long = "t".repeat(1000);
        let mut m = trusted_machine();
        let req = to_dispatch(&mut m, &[("x-kvroute-tenant", &long)], &chat_body("hi"));
        assert_eq!(req.tenant.map(|t| t.len()), Some(MAX_TENANT_BYTES));
    }

    fn reject_answer(status: u16, retry_after_s: Option<u32>) -> Vec<u8> {
        serde_json::to_vec(&RouteResponse {
            decision_id: 5,
            reject: Some(Reject {
                status,
                message: "fleet saturated: \"sheddable\" requests are shed".into(),
                error_type: "rate_limit_exceeded".into(),
                retry_after_s,
            }),
            ..RouteResponse::default()
        })
        .unwrap()
    }

    #[test]
    fn a_reject_is_answered_locally_with_an_openai_error() {
        let mut m = machine();
        to_dispatch(&mut m, &[], &chat_body("hi"));
        let step = m.on_route_response(Some(200), &reject_answer(429, Some(2)), 104);
        assert_eq!(step.action, Action::Continue);
        assert_eq!(step.effects.len(), 4);
        assert_eq!(step.effects[0], Effect::RouteLatencyMs(4));
        assert_eq!(
            step.effects[1],
            Effect::SetRequestHeader {
                name: LOCAL_REPLY_HEADER.into(),
                value: "1".into()
            }
        );
        let Effect::SendLocalResponse {
            status,
            headers,
            body,
        } = &step.effects[2]
        else {
            panic!("expected a local response, got {:?}", step.effects);
        };
        assert_eq!(*status, 429);
        assert!(headers.contains(&("content-type".into(), "application/json".into())));
        assert!(headers.contains(&("retry-after".into(), "2".into())));
        let body: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(body["error"]["type"], "rate_limit_exceeded");
        assert_eq!(body["error"]["code"], 429);
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("sheddable")
        );
        assert_eq!(step.effects[3], Effect::Count(Counter::Rejected(429)));
        assert!(!step.effects.contains(&Effect::ResumeRequest));
        // Nothing went upstream: no outcome is reported.
        assert!(!m.wants_response_body());
        assert_eq!(m.on_done(110), None);
    }

    #[test]
    fn a_413_reject_has_no_retry_after_and_explains_itself() {
        let mut m = explaining();
        to_dispatch(&mut m, &[("x-kvroute-explain", "1")], &chat_body("hi"));
        let step = m.on_route_response(Some(200), &reject_answer(413, None), 101);
        let Effect::SendLocalResponse { headers, .. } = &step.effects[2] else {
            panic!("expected a local response");
        };
        assert!(!headers.iter().any(|(n, _)| n == "retry-after"));
        assert!(
            m.decision_header()
                .is_some_and(|d| d.contains("rejected") && d.contains("413"))
        );
    }

    #[test]
    fn a_newer_control_planes_reason_and_reject_type_still_parse() {
        let mut m = explaining();
        to_dispatch(&mut m, &[("x-kvroute-explain", "1")], &chat_body("hi"));
        let body = br#"{"decision_id":9,"endpoints":[],"reason":"warm_spare",
            "reject":{"status":429,"message":"later","error_type":"quota_exceeded"}}"#;
        let step = m.on_route_response(Some(200), body, 101);
        let Effect::SendLocalResponse { body, .. } = &step.effects[2] else {
            panic!("expected a local response, got {:?}", step.effects);
        };
        let body: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(body["error"]["type"], "quota_exceeded");
        assert_eq!(
            m.decision_header(),
            Some("reason=rejected; status=429; type=quota_exceeded")
        );

        let mut m = explaining();
        to_dispatch(&mut m, &[("x-kvroute-explain", "1")], &chat_body("hi"));
        let body = br#"{"decision_id":8,"endpoints":["10.0.0.1:8000"],"reason":"warm_spare"}"#;
        let step = m.on_route_response(Some(200), body, 101);
        assert!(step.effects.contains(&Effect::ResumeRequest), "{step:?}");
        assert_eq!(
            m.decision_header(),
            Some("id=8; reason=warm_spare; endpoint=10.0.0.1:8000; cached_blocks=0")
        );
    }

    #[test]
    fn a_reject_with_a_nonsense_status_fails_open() {
        for status in [0, 200, 302, 700] {
            let mut m = machine();
            to_dispatch(&mut m, &[], &chat_body("hi"));
            let step = m.on_route_response(Some(200), &reject_answer(status, None), 101);
            assert!(step.effects.contains(&Effect::ResumeRequest), "{status}");
            assert!(
                step.effects
                    .contains(&Effect::Count(Counter::FailOpen(FailKind::BadResponse)))
            );
        }
    }

    #[test]
    fn a_data_parallel_rank_goes_in_vllms_header_and_its_server_in_the_destination() {
        let mut h = post(CHAT);
        h.push(("X-Data-Parallel-Rank", "3"));
        let step = machine().on_request_headers(headers(&h), false);
        assert!(
            step.effects
                .contains(&Effect::RemoveRequestHeader("x-data-parallel-rank".into())),
            "a client's copy is removed: {step:?}"
        );
        let mut m = machine();
        to_dispatch(&mut m, &[], &chat_body("hi"));
        let body = serde_json::to_vec(&RouteResponse {
            decision_id: 1,
            endpoints: vec![
                "10.0.0.1:8000#dp2".into(),
                "10.0.0.1:8000#dp0".into(),
                "10.0.0.2:8000#dp1".into(),
            ],
            ..RouteResponse::default()
        })
        .unwrap();
        let effects = m.on_route_response(Some(200), &body, 101).effects;
        assert!(effects.contains(&Effect::SetRequestHeader {
            name: "x-gateway-destination-endpoint".into(),
            value: "10.0.0.1:8000,10.0.0.2:8000".into()
        }));
        assert!(effects.contains(&Effect::SetRequestHeader {
            name: DATA_PARALLEL_RANK_HEADER.into(),
            value: "2".into()
        }));
        // Served by the chosen server: the outcome names the rank; by a fallback: the server.
        m.on_response_headers(Some(200), Some("10.0.0.1:8000"));
        assert_eq!(m.on_done(150).unwrap().endpoint, "10.0.0.1:8000#dp2");
    }

    #[test]
    fn a_prefiller_is_passed_on_when_well_formed() {
        // The effects of a route answer that names `prefiller`.
        let answered = |prefiller: &str| {
            let mut m = machine();
            to_dispatch(&mut m, &[], &chat_body("hi"));
            let body = serde_json::to_vec(&RouteResponse {
                decision_id: 1,
                endpoints: vec!["10.0.0.1:8000".into()],
                prefiller: Some(prefiller.into()),
                ..RouteResponse::default()
            })
            .unwrap();
            m.on_route_response(Some(200), &body, 101).effects
        };
        assert!(
            answered("10.0.0.9:8000").contains(&Effect::SetRequestHeader {
                name: PREFILLER_HEADER.into(),
                value: "10.0.0.9:8000".into()
            })
        );
        assert!(
            answered("10.0.0.9:8000#dp3").contains(&Effect::SetRequestHeader {
                name: PREFILLER_HEADER.into(),
                value: "10.0.0.9:8000".into()
            }),
            "a data-parallel prefiller is named by its server"
        );
        assert!(!answered("bad,value").iter().any(
            |e| matches!(e, Effect::SetRequestHeader { name, .. } if name == PREFILLER_HEADER)
        ));
    }
}
