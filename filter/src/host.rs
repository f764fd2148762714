//! proxy-wasm glue: the only module that talks to the host.
//!
//! Callbacks are translated into [`RequestMachine`] / [`RootState`] calls and the returned
//! effects are executed with `proxy_wasm::hostcalls`. Every hostcall result is handled: a
//! failing hostcall fails the request open, it never panics across the ABI.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use log::{error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{
    Action as HostAction, BufferType, ContextType, LogLevel, MapType, MetricType,
};
use scorer_core::protocol::{ROUTE_PATH, RouteRequest, RouteResponse};

use crate::config::FilterConfig;
use crate::machine::{Action, BodyStep, Counter, Effect, RequestMachine, Step};
use crate::metrics::{MetricIds, fail_open_warning};
use crate::root::RootState;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Proxy metric ids (`None` when the host refused to define one).
type Metrics = MetricIds<u32>;

fn define_metrics() -> Metrics {
    MetricIds::define(
        |name| hostcalls::define_metric(MetricType::Counter, name).ok(),
        |name| hostcalls::define_metric(MetricType::Histogram, name).ok(),
    )
}

fn bump(id: Option<u32>) {
    if let Some(id) = id {
        // A metric the host rejects is not worth failing a request over.
        let _ = hostcalls::increment_metric(id, 1);
    }
}

/// What the root context shares with its HTTP contexts.
struct Shared {
    state: RootState,
    metrics: Metrics,
    /// The tick was brought forward (to report a stored response at once, or to wake a
    /// resting copy); the next tick puts the period back.
    tick_brought_forward: bool,
    /// The tick period last set, ms ([`RootState::tick_period_ms`] changes when a copy
    /// rests).
    period_ms: u64,
}

/// The tick period that makes the next tick come at once.
const NEXT_TICK_NOW: Duration = Duration::from_millis(1);

impl Shared {
    /// The tick's work: dispatches the next feedback batch or sync, if any. Calls made here
    /// belong to the root context, which receives their answers.
    fn on_tick(&mut self, now: u64) {
        let call = self.state.on_tick(now);
        // Brought forward: back to the period once the call went out (while a previous call
        // is still in flight, keep ticking soon). A copy that starts or stops resting changes
        // the period too.
        if self.tick_brought_forward && !self.state.urgent() {
            self.tick_brought_forward = false;
            self.period_ms = 0;
        }
        let period_ms = self.state.tick_period_ms();
        if !self.tick_brought_forward && period_ms != self.period_ms {
            match hostcalls::set_tick_period(Duration::from_millis(period_ms)) {
                Ok(()) => self.period_ms = period_ms,
                Err(status) => warn!("kvroute: cannot set the tick period: {status:?}"),
            }
        }
        let Some(call) = call else {
            return;
        };
        let config = Arc::clone(self.state.config());
        if post(&config, call.path, &call.body, config.feedback_timeout_ms).is_none() {
            self.state.on_feedback_dispatch_failed();
            self.count_tick_call(false);
        }
    }

    /// Brings the root context's next tick forward (a request context's own call would be
    /// answered to that context, gone by then).
    fn tick_now(&mut self) {
        if !self.tick_brought_forward && hostcalls::set_tick_period(NEXT_TICK_NOW).is_ok() {
            self.tick_brought_forward = true;
        }
    }

    /// Counts how a tick's call (a feedback batch, or with `decision: local` a sync) ended.
    fn count_tick_call(&self, ok: bool) {
        bump(self.metrics.tick_call(self.state.local().is_some(), ok));
    }

    fn count(&mut self, counter: Counter) {
        let first = self.state.count(counter);
        for id in self.metrics.counted(counter) {
            bump(Some(id));
        }
        if let (Counter::FailOpen(kind), true) = (counter, first) {
            warn!("{}", fail_open_warning(kind));
        }
    }
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The host clock in nanoseconds (Envoy: the system clock, read at call time).
fn now_ns() -> Option<u64> {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .and_then(|d| u64::try_from(d.as_nanos()).ok())
}

/// The status of the answered HTTP call; `None` when it has no headers (it failed).
fn call_status(num_headers: usize) -> Option<u16> {
    if num_headers == 0 {
        None
    } else {
        status_of(MapType::HttpCallResponseHeaders)
    }
}

/// The stream's response code (Envoy's `response.code` property, an int64 in the host's byte
/// order), when one was sent.
fn response_code() -> Option<u16> {
    let bytes = hostcalls::get_property(vec!["response", "code"]).ok()??;
    let code = i64::from_le_bytes(bytes.as_slice().try_into().ok()?);
    u16::try_from(code).ok().filter(|c| *c > 0)
}

fn status_of(map: MapType) -> Option<u16> {
    let value = hostcalls::get_map_value_bytes(map, ":status").ok()??;
    crate::parse_status(&value)
}

/// POSTs JSON to the control plane; returns the call's token.
fn post(config: &FilterConfig, path: &str, body: &[u8], timeout_ms: u64) -> Option<u32> {
    hostcalls::dispatch_http_call(
        &config.control_plane_cluster,
        config.control_plane_post(":authority", path),
        Some(body),
        Vec::new(),
        Duration::from_millis(timeout_ms),
    )
    .ok()
}

/// Root context: configuration, the outcome queue and the feedback tick.
#[derive(Default)]
struct Root {
    shared: Option<Rc<RefCell<Shared>>>,
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        num_headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let status = call_status(num_headers);
        if let Some(shared) = &self.shared {
            let mut shared = shared.borrow_mut();
            if shared.state.local().is_some() {
                // The sync answer: the copy's new state. Unreadable counts as failed.
                let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                    .ok()
                    .flatten()
                    .unwrap_or_default();
                let ok = shared.state.on_sync_response(status, &body, now_ms());
                shared.count_tick_call(ok);
                return;
            }
            let ok = shared.state.on_feedback_response(status);
            shared.count_tick_call(ok);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(
            BufferType::PluginConfiguration,
            0,
            plugin_configuration_size,
        ) {
            Ok(bytes) => bytes.unwrap_or_default(),
            Err(status) => {
                error!("kvroute: cannot read plugin configuration: {status:?}");
                return false;
            }
        };
        let config = match FilterConfig::from_json(&bytes) {
            Ok(config) => config,
            Err(e) => {
                error!("kvroute: {e}");
                return false;
            }
        };
        let decision = config.decision;
        let cluster = config.control_plane_cluster.clone();
        let paths = config.routes.len();
        let mut state = RootState::new(config);
        // Distinct route call ids per VM (each call also mixes in the clock at the call).
        state.seed_calls(now_ns().unwrap_or_default());
        let tick = Duration::from_millis(state.tick_period_ms());
        if let Err(status) = hostcalls::set_tick_period(tick) {
            error!("kvroute: cannot set tick period: {status:?}");
            return false;
        }
        info!(
            "kvroute: configured (control plane cluster {cluster}, {paths} inference paths, \
             decision {decision:?})"
        );
        let shared = Shared {
            period_ms: state.tick_period_ms(),
            state,
            metrics: define_metrics(),
            tick_brought_forward: false,
        };
        self.shared = Some(Rc::new(RefCell::new(shared)));
        true
    }

    fn on_tick(&mut self) {
        let Some(shared) = &self.shared else { return };
        shared.borrow_mut().on_tick(now_ms());
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone();
        let machine = shared.as_ref().map(|s| s.borrow().state.new_request());
        Some(Box::new(Request { shared, machine }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One HTTP request. Without a configuration (`machine == None`) it passes everything through.
struct Request {
    shared: Option<Rc<RefCell<Shared>>>,
    machine: Option<RequestMachine>,
}

impl Request {
    /// Executes a step's effects and returns the action for the current callback.
    fn run(&mut self, step: Step) -> HostAction {
        match self.execute(step) {
            Action::Continue => HostAction::Continue,
            Action::Pause => HostAction::Pause,
        }
    }

    /// Records `value` on the histogram `pick` names, when the root context could define it.
    fn record(&self, pick: fn(&Metrics) -> Option<u32>, value: u64) {
        if let Some(id) = self.shared.as_ref().and_then(|s| pick(&s.borrow().metrics)) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    fn execute(&mut self, step: Step) -> Action {
        let mut action = step.action;
        for effect in step.effects {
            match effect {
                Effect::RemoveRequestHeader(name) => {
                    if let Err(status) =
                        hostcalls::remove_map_value(MapType::HttpRequestHeaders, &name)
                    {
                        warn!("kvroute: cannot remove request header {name}: {status:?}");
                    }
                }
                Effect::SetRequestHeader { name, value } => {
                    if let Err(status) =
                        hostcalls::set_map_value(MapType::HttpRequestHeaders, &name, Some(&value))
                    {
                        warn!("kvroute: cannot set request header {name}: {status:?}");
                    }
                }
                Effect::DispatchRoute { body } => {
                    let Some(machine) = self.machine.as_mut() else {
                        continue;
                    };
                    let config = self
                        .shared
                        .as_ref()
                        .map(|s| Arc::clone(s.borrow().state.config()));
                    let token =
                        config.and_then(|c| post(&c, ROUTE_PATH, &body, c.route_timeout_ms));
                    if token.is_some() {
                        machine.on_dispatched();
                    } else {
                        let failed = machine.on_dispatch_failed();
                        action = self.execute(failed);
                    }
                }
                Effect::ResumeRequest => {
                    if let Err(status) = hostcalls::resume_http_request() {
                        warn!("kvroute: cannot resume request: {status:?}");
                    }
                }
                Effect::Count(counter) => {
                    if let Some(shared) = &self.shared {
                        shared.borrow_mut().count(counter);
                    }
                }
                Effect::RouteLatencyMs(ms) => self.record(|m| m.route_latency_ms, ms),
                Effect::SendLocalResponse {
                    status,
                    headers,
                    body,
                } => {
                    let headers: Vec<(&str, &str)> = headers
                        .iter()
                        .map(|(n, v)| (n.as_str(), v.as_str()))
                        .collect();
                    if let Err(e) =
                        hostcalls::send_http_response(u32::from(status), headers, Some(&body))
                    {
                        // The request stays paused otherwise: let it go upstream (fail open).
                        warn!("kvroute: cannot answer a rejected request locally: {e:?}");
                        if let Err(status) = hostcalls::resume_http_request() {
                            warn!("kvroute: cannot resume request: {status:?}");
                        }
                    }
                }
                Effect::HashMicros(us) => self.record(|m| m.hash_duration_us, us),
                Effect::Withdraw(call_id) => {
                    if let Some(shared) = &self.shared {
                        shared.borrow_mut().state.withdraw(call_id);
                    }
                }
                Effect::Adopt {
                    call_id,
                    decision_id,
                    endpoint,
                } => {
                    if let Some(shared) = &self.shared {
                        let now = now_ms();
                        shared
                            .borrow_mut()
                            .state
                            .adopt(call_id, &endpoint, decision_id, now);
                    }
                }
            }
        }
        action
    }

    /// Reads the body when the machine asks for it, then runs the resulting step.
    fn body_step(&mut self, body_step: BodyStep) -> HostAction {
        let Some(machine) = self.machine.as_mut() else {
            return HostAction::Continue;
        };
        let step = match body_step {
            BodyStep::Step(step) => step,
            BodyStep::ReadBody(len) => {
                match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, len) {
                    Ok(body) => {
                        let now = now_ms();
                        machine.on_body_complete_with(
                            &body.unwrap_or_default(),
                            now,
                            now_ns,
                            local_decision(&self.shared, now),
                        )
                    }
                    Err(_) => machine.on_body_read_failed(),
                }
            }
        };
        self.run(step)
    }

    fn finish(&mut self) {
        let now = now_ms();
        if let Some(machine) = self.machine.as_mut() {
            let wants = machine.wants_response_info();
            // Envoy's stream info outlives the filter's callbacks, so both are readable in
            // `on_done` and `on_log`: the final response code (a local reply's too) and the
            // host of the last attempt.
            let status = wants.status.then(response_code).flatten();
            let upstream = wants
                .upstream
                .then(|| hostcalls::get_property(vec!["upstream", "address"]).ok())
                .flatten()
                .flatten()
                .and_then(|b| String::from_utf8(b).ok());
            machine.on_response_headers(status, upstream.as_deref());
        }
        let Some(outcome) = self.machine.as_mut().and_then(|m| m.on_done(now)) else {
            return;
        };
        if let Some(shared) = &self.shared {
            let mut shared = shared.borrow_mut();
            let queued = shared.state.push_outcome(outcome, now);
            if queued.dropped {
                bump(shared.metrics.outcomes_dropped);
            }
            if queued.flush_now {
                shared.tick_now();
            }
        }
    }
}

/// What the machine calls once a request is parsed: the worker's root state decides it locally
/// or prepares its route call ([`RootState::decide_or_prepare`]), with the host's clock as the
/// decision id's nonce. One copy for the header and the body path.
fn local_decision(
    shared: &Option<Rc<RefCell<Shared>>>,
    now: u64,
) -> impl FnMut(&mut RouteRequest) -> Option<RouteResponse> + '_ {
    move |request| {
        // The clock is read only when a call is prepared: a local decision needs no nonce.
        let mut shared = shared.as_ref()?.borrow_mut();
        let answer = shared
            .state
            .decide_or_prepare(request, now, || now_ns().unwrap_or_default());
        // A resting copy asked the control plane: it syncs at once, not a rest period later.
        if shared.state.resting() {
            shared.tick_now();
        }
        answer
    }
}

impl Context for Request {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        num_headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let Some(machine) = self.machine.as_mut() else {
            return;
        };
        let status = call_status(num_headers);
        let body = match hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size) {
            Ok(body) => body.unwrap_or_default(),
            Err(_) => {
                let step = machine.on_route_failure(crate::machine::FailKind::BadResponse);
                self.run(step);
                return;
            }
        };
        let step = machine.on_route_response(status, &body, now_ms());
        self.run(step);
    }

    fn on_done(&mut self) -> bool {
        self.finish();
        true
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> HostAction {
        let Some(machine) = self.machine.as_mut() else {
            return HostAction::Continue;
        };
        let headers = match hostcalls::get_map_bytes(MapType::HttpRequestHeaders) {
            Ok(headers) => headers,
            Err(status) => {
                warn!("kvroute: cannot read request headers: {status:?}");
                return HostAction::Continue;
            }
        };
        let now = now_ms();
        let step = machine.on_request_headers_with(
            headers.iter().map(|(k, v)| (k.as_str(), v.as_slice())),
            end_of_stream,
            now,
            local_decision(&self.shared, now),
        );
        self.run(step)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> HostAction {
        let Some(machine) = self.machine.as_mut() else {
            return HostAction::Continue;
        };
        let body_step = machine.on_request_body(body_size, end_of_stream);
        self.body_step(body_step)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> HostAction {
        let Some(machine) = self.machine.as_mut() else {
            return HostAction::Continue;
        };
        let body_step = machine.on_request_trailers();
        self.body_step(body_step)
    }

    fn on_http_response_headers(
        &mut self,
        _num_headers: usize,
        _end_of_stream: bool,
    ) -> HostAction {
        let Some(machine) = self.machine.as_mut() else {
            return HostAction::Continue;
        };
        if let Some(value) = machine.decision_header() {
            let set = hostcalls::set_map_value(
                MapType::HttpResponseHeaders,
                crate::machine::DECISION_HEADER,
                Some(value),
            );
            if let Err(status) = set {
                warn!("kvroute: cannot set the explain header: {status:?}");
            }
        }
        // Only a streamed response's first chunk needs the status now; the rest is read once
        // the client has the response (`finish`): each host call that returns data costs a
        // V8 allocation callback, on the response's path if made here.
        if machine.wants_status_early() {
            machine.on_response_headers(status_of(MapType::HttpResponseHeaders), None);
        }
        HostAction::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> HostAction {
        let Some(machine) = self.machine.as_mut() else {
            return HostAction::Continue;
        };
        if !machine.wants_response_body() || body_size == 0 {
            return HostAction::Continue;
        }
        if let Ok(Some(chunk)) = hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size) {
            let now = now_ms();
            if let Some(first) = machine.on_response_body(&chunk, now)
                && let Some(shared) = &self.shared
            {
                shared.borrow_mut().state.push_first_token(first, now);
            }
        }
        HostAction::Continue
    }

    fn on_log(&mut self) {
        self.finish();
    }
}
