//! The module's logic in safe Rust: the proxy-wasm filter's glue (`filter/src/host.rs`)
//! translated to Envoy's dynamic-module hooks, over the same sans-IO core
//! ([`RequestMachine`] per request, [`RootState`] for what requests share).
//!
//! The one difference that matters: Envoy runs a proxy-wasm filter as one VM per worker, each
//! with its own copy of the routing state, and every copy applies every other copy's decisions
//! at each sync. A dynamic module is one library in Envoy's process, so the workers share one
//! [`RootState`] behind a lock: a decision is visible to every worker at once, and one sync a
//! tick serves the whole process.
//!
//! Ticks: Envoy gives an HTTP filter configuration no timer, so a small thread sleeps for the
//! tick period and posts a tick to Envoy's main thread ([`Scheduler`]), which makes the
//! control-plane call through Envoy's cluster (`control_plane_cluster`) as the wasm filter
//! does.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute_filter::config::FilterConfig;
use kvroute_filter::machine::{
    Action, BodyStep, Counter, DECISION_HEADER, Effect, RequestMachine, Step,
};
use kvroute_filter::metrics::{MetricIds, fail_open_warning};
use kvroute_filter::parse_status;
use kvroute_filter::root::RootState;
use parking_lot::Mutex;
use scorer_core::protocol::{ROUTE_PATH, RouteRequest, RouteResponse};

use crate::abi::{self, Body, ConfigHandle, HeaderMap, LogLevel, Scheduler, Stream};

/// The one scheduled event: run the tick.
const TICK: u64 = 1;
/// How Envoy's dynamic-module callouts name the control plane's authority.
const CALLOUT_AUTHORITY: &str = "host";
/// How long a tick waits while a call it needs answered is in flight (wasm's 1 ms tick).
const URGENT_TICK: Duration = Duration::from_millis(1);

/// Why a filter configuration was refused (Envoy then rejects it).
#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    /// The `filter_config` JSON is not a valid plugin configuration.
    #[error(transparent)]
    Config(#[from] kvroute_filter::config::ConfigError),
    /// The tick thread could not be started.
    #[error("cannot start the tick thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// What a request hook tells Envoy: go on, or hold the request (its body is buffered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Continue.
    Continue,
    /// Stop iteration (headers) or stop and buffer (body).
    Hold,
}

/// Proxy metric ids (`None` when Envoy refused to define one): the wasm filter's names.
type Metrics = MetricIds<usize>;

/// What every worker's requests and the main thread's tick share.
#[derive(Debug)]
struct Inner {
    state: Mutex<RootState>,
    config: Arc<FilterConfig>,
    metrics: Metrics,
    /// The tick thread's sleep, ms (the state's period; 1 while a call it needs is in flight).
    period_ms: AtomicU64,
    /// A tick is posted and not yet run: workers do not post another.
    tick_posted: AtomicBool,
    /// Posts ticks to the main thread; taken out (and deleted) when the configuration goes.
    scheduler: Mutex<Option<Scheduler>>,
}

impl Inner {
    /// Runs the tick soon, on the main thread: the tick thread's period is up, or a stored
    /// response is to be reported, or a request woke a resting copy.
    fn tick_now(&self) {
        if !self.tick_posted.swap(true, Ordering::AcqRel)
            && let Some(scheduler) = self.scheduler.lock().as_ref()
        {
            scheduler.commit(TICK);
        }
    }

    fn set_period(&self, state: &RootState) {
        let period = if state.urgent() {
            URGENT_TICK.as_millis() as u64
        } else {
            state.tick_period_ms()
        };
        self.period_ms.store(period.max(1), Ordering::Relaxed);
    }
}

/// One filter configuration: created on Envoy's main thread, shared by every worker's streams.
#[derive(Debug)]
pub struct Module {
    envoy: ConfigHandle,
    inner: Arc<Inner>,
    ticker: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
}

/// The wall clock in ms (Envoy's wasm host reads the same system clock).
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The `:status` of a call's answer.
pub fn status_of(headers: &[(&[u8], &[u8])]) -> Option<u16> {
    let (_, value) = headers.iter().find(|(k, _)| *k == b":status")?;
    parse_status(value)
}

/// `chunks` as one slice, copying only when there are several.
fn joined<'a>(chunks: &[&'a [u8]]) -> std::borrow::Cow<'a, [u8]> {
    match chunks {
        [] => std::borrow::Cow::Borrowed(&[]),
        [one] => std::borrow::Cow::Borrowed(one),
        many => std::borrow::Cow::Owned(many.concat()),
    }
}

impl Module {
    /// Reads the configuration JSON (the filter's `filter_config` string) and starts the tick.
    pub fn new(envoy: ConfigHandle, config: &[u8]) -> Result<Self, ModuleError> {
        let config = FilterConfig::from_json(config)?;
        let decision = config.decision;
        let cluster = config.control_plane_cluster.clone();
        let mut state = RootState::new(config);
        state.seed_calls(now_ns());
        let inner = Arc::new(Inner {
            config: Arc::clone(state.config()),
            period_ms: AtomicU64::new(state.tick_period_ms().max(1)),
            state: Mutex::new(state),
            metrics: MetricIds::define(
                |name| envoy.define_counter(name),
                |name| envoy.define_histogram(name),
            ),
            tick_posted: AtomicBool::new(false),
            scheduler: Mutex::new(envoy.scheduler()),
        });
        let (stop, stopped) = mpsc::channel::<()>();
        let ticking = Arc::clone(&inner);
        let thread = std::thread::Builder::new()
            .name("kvroute-tick".into())
            .spawn(move || {
                // Ends when the configuration drops the sender.
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(
                    Duration::from_millis(ticking.period_ms.load(Ordering::Relaxed)),
                ) {
                    ticking.tick_now();
                }
            })
            .map_err(ModuleError::Thread)?;
        abi::log(
            LogLevel::Info,
            &format!(
                "kvroute: configured as a dynamic module (control plane cluster {cluster}, \
                 decision {decision:?})"
            ),
        );
        Ok(Module {
            envoy,
            inner,
            ticker: Some((stop, thread)),
        })
    }

    /// A new stream's filter (from the shared configuration: no lock on the shared state).
    pub fn new_filter(&self) -> Filter {
        Filter {
            inner: Arc::clone(&self.inner),
            machine: RequestMachine::new(Arc::clone(&self.inner.config)),
            finished: false,
        }
    }

    /// The tick, on the main thread: dispatches the next feedback batch or sync, if any.
    pub fn on_scheduled(&self, event: u64) {
        if event != TICK {
            return;
        }
        self.inner.tick_posted.store(false, Ordering::Release);
        let call = {
            let mut state = self.inner.state.lock();
            let call = state.on_tick(now_ms());
            self.inner.set_period(&state);
            call
        };
        let Some(call) = call else { return };
        let config = &self.inner.config;
        let sent = self.envoy.callout(
            &config.control_plane_cluster,
            &config.control_plane_post(CALLOUT_AUTHORITY, call.path),
            &call.body,
            config.feedback_timeout_ms,
        );
        if sent.is_none() {
            self.inner.state.lock().on_feedback_dispatch_failed();
            self.count_tick_call(false);
        }
    }

    /// The answer to the tick's call (a sync with `decision: local`, else a feedback batch).
    pub fn on_callout_done(&self, ok: bool, headers: &[(&[u8], &[u8])], body: &[&[u8]]) {
        let status = if ok { status_of(headers) } else { None };
        let ok = {
            let mut state = self.inner.state.lock();
            let ok = if state.local().is_some() {
                state.on_sync_response(status, &joined(body), now_ms())
            } else {
                state.on_feedback_response(status)
            };
            self.inner.set_period(&state);
            ok
        };
        self.count_tick_call(ok);
    }

    fn count_tick_call(&self, ok: bool) {
        let local = self.inner.config.decision == kvroute_filter::config::DecisionMode::Local;
        self.envoy.bump(self.inner.metrics.tick_call(local, ok));
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // Stop the tick thread before the scheduler it posts on is deleted.
        if let Some((stop, thread)) = self.ticker.take() {
            drop(stop);
            let _ = thread.join();
        }
        drop(self.inner.scheduler.lock().take());
    }
}

/// One HTTP stream.
#[derive(Debug)]
pub struct Filter {
    inner: Arc<Inner>,
    machine: RequestMachine,
    finished: bool,
}

impl Filter {
    /// Request headers: route from them, or hold the request for its body.
    pub fn on_request_headers(&mut self, stream: &mut Stream<'_>, end_of_stream: bool) -> Verdict {
        let machine = &mut self.machine;
        let now = now_ms();
        let headers = stream.headers(HeaderMap::Request);
        let step = machine.on_request_headers_with(
            headers
                .iter()
                .filter_map(|(k, v)| Some((std::str::from_utf8(k).ok()?, *v))),
            end_of_stream,
            now,
            local_decision(&self.inner, now),
        );
        drop(headers);
        self.run(stream, step)
    }

    /// A request body chunk: hold (buffer) until the last, then read and route.
    pub fn on_request_body(&mut self, stream: &mut Stream<'_>, end_of_stream: bool) -> Verdict {
        let machine = &mut self.machine;
        let whole = stream.received_is_buffered_request_body();
        let size = stream.body_size(Body::ReceivedRequest)
            + if whole {
                0
            } else {
                stream.body_size(Body::BufferedRequest)
            };
        let body_step = machine.on_request_body(size, end_of_stream);
        self.body_step(stream, body_step, !whole)
    }

    /// Request trailers end the body.
    pub fn on_request_trailers(&mut self, stream: &mut Stream<'_>) -> Verdict {
        let machine = &mut self.machine;
        let body_step = machine.on_request_trailers();
        self.body_step(stream, body_step, false)
    }

    /// Response headers: the explain header, and a streamed answer's status.
    pub fn on_response_headers(&mut self, stream: &mut Stream<'_>) {
        let machine = &mut self.machine;
        if let Some(value) = machine.decision_header()
            && !stream.set_header(HeaderMap::Response, DECISION_HEADER, Some(value))
        {
            abi::log(LogLevel::Warn, "kvroute: cannot set the explain header");
        }
        if machine.wants_status_early() {
            let status = stream
                .header(HeaderMap::Response, ":status")
                .and_then(parse_status);
            machine.on_response_headers(status, None);
        }
    }

    /// A response body chunk: scanned for the first token and `usage`.
    pub fn on_response_body(&mut self, stream: &mut Stream<'_>) {
        let machine = &mut self.machine;
        if !machine.wants_response_body() {
            return;
        }
        let now = now_ms();
        for chunk in stream.body_chunks(Body::ReceivedResponse) {
            if let Some(first) = machine.on_response_body(chunk, now) {
                self.inner.state.lock().push_first_token(first, now);
            }
        }
    }

    /// The stream is complete: its outcome goes to the shared state.
    pub fn on_stream_complete(&mut self, stream: &mut Stream<'_>) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let now = now_ms();
        let machine = &mut self.machine;
        let wants = machine.wants_response_info();
        let status = wants.status.then(|| stream.response_code()).flatten();
        let upstream = wants.upstream.then(|| stream.upstream_address()).flatten();
        machine.on_response_headers(status, upstream.as_deref());
        let Some(outcome) = machine.on_done(now) else {
            return;
        };
        let queued = self.inner.state.lock().push_outcome(outcome, now);
        if queued.dropped {
            stream.bump(self.inner.metrics.outcomes_dropped);
        }
        if queued.flush_now {
            self.inner.tick_now();
        }
    }

    /// The route call's answer.
    pub fn on_callout_done(
        &mut self,
        stream: &mut Stream<'_>,
        ok: bool,
        headers: &[(&[u8], &[u8])],
        body: &[&[u8]],
    ) {
        let machine = &mut self.machine;
        // A failed call (reset, timeout, answer too large) reads as one without headers, as
        // the wasm host reports it.
        let status = if ok { status_of(headers) } else { None };
        let step = machine.on_route_response(status, &joined(body), now_ms());
        self.run(stream, step);
    }

    fn body_step(
        &mut self,
        stream: &mut Stream<'_>,
        body_step: BodyStep,
        with_received: bool,
    ) -> Verdict {
        let machine = &mut self.machine;
        let step = match body_step {
            BodyStep::Step(step) => step,
            BodyStep::ReadBody(_) => {
                // The body so far: what is buffered, then this hook's chunk (Envoy adds it to
                // the buffer only after the hook returns).
                let mut chunks = stream.body_chunks(Body::BufferedRequest);
                if with_received {
                    chunks.extend(stream.body_chunks(Body::ReceivedRequest));
                } else if chunks.is_empty() {
                    chunks = stream.body_chunks(Body::ReceivedRequest);
                }
                let body = joined(&chunks);
                let now = now_ms();
                machine.on_body_complete_with(
                    &body,
                    now,
                    || Some(now_ns()),
                    local_decision(&self.inner, now),
                )
            }
        };
        self.run(stream, step)
    }

    fn run(&mut self, stream: &mut Stream<'_>, step: Step) -> Verdict {
        match self.execute(stream, step) {
            Action::Continue => Verdict::Continue,
            Action::Pause => Verdict::Hold,
        }
    }

    fn execute(&mut self, stream: &mut Stream<'_>, step: Step) -> Action {
        let mut action = step.action;
        let metrics = self.inner.metrics;
        for effect in step.effects {
            match effect {
                Effect::RemoveRequestHeader(name) => {
                    stream.set_header(HeaderMap::Request, &name, None);
                }
                Effect::SetRequestHeader { name, value } => {
                    if !stream.set_header(HeaderMap::Request, &name, Some(&value)) {
                        abi::log(
                            LogLevel::Warn,
                            &format!("kvroute: cannot set request header {name}"),
                        );
                    }
                }
                Effect::DispatchRoute { body } => {
                    let config = &self.inner.config;
                    let sent = stream.callout(
                        &config.control_plane_cluster,
                        &config.control_plane_post(CALLOUT_AUTHORITY, ROUTE_PATH),
                        &body,
                        config.route_timeout_ms,
                    );
                    if sent.is_some() {
                        self.machine.on_dispatched();
                    } else {
                        let failed = self.machine.on_dispatch_failed();
                        action = self.execute(stream, failed);
                    }
                }
                Effect::ResumeRequest => stream.continue_decoding(),
                Effect::Count(counter) => {
                    // `decide_locally` counted a local decision under the decision's own lock
                    // (`RootState::count` does nothing with it): both workers would take the
                    // shared lock once more a request for nothing.
                    let first = match counter {
                        Counter::DecidedLocally => false,
                        _ => self.inner.state.lock().count(counter),
                    };
                    for id in metrics.counted(counter) {
                        stream.bump(Some(id));
                    }
                    if let (Counter::FailOpen(kind), true) = (counter, first) {
                        abi::log(LogLevel::Warn, &fail_open_warning(kind));
                    }
                }
                Effect::RouteLatencyMs(ms) => stream.record(metrics.route_latency_ms, ms),
                Effect::HashMicros(us) => stream.record(metrics.hash_duration_us, us),
                Effect::SendLocalResponse {
                    status,
                    headers,
                    body,
                } => stream.send_response(status, &headers, &body),
                Effect::Withdraw(call_id) => self.inner.state.lock().withdraw(call_id),
                Effect::Adopt {
                    call_id,
                    decision_id,
                    endpoint,
                } => self
                    .inner
                    .state
                    .lock()
                    .adopt(call_id, &endpoint, decision_id, now_ms()),
            }
        }
        action
    }
}

/// What the machine calls once a request is parsed: the shared state decides it or prepares
/// its route call ([`RootState::decide_or_prepare`]).
fn local_decision(
    inner: &Inner,
    now: u64,
) -> impl FnMut(&mut RouteRequest) -> Option<RouteResponse> + '_ {
    move |request| {
        let mut state = inner.state.lock();
        let answer = state.decide_or_prepare(request, now, now_ns);
        if state.resting() {
            drop(state);
            inner.tick_now();
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_is_read_from_the_pseudo_header() {
        let headers: Vec<(&[u8], &[u8])> = vec![(b"content-type", b"x"), (b":status", b"200")];
        assert_eq!(status_of(&headers), Some(200));
        assert_eq!(status_of(&[]), None);
        let bad: Vec<(&[u8], &[u8])> = vec![(b":status", b"2x")];
        assert_eq!(status_of(&bad), None);
    }

    #[test]
    fn one_chunk_is_borrowed_several_are_joined() {
        assert!(matches!(
            joined(&[b"ab"]),
            std::borrow::Cow::Borrowed(b"ab")
        ));
        assert_eq!(&*joined(&[b"ab", b"cd"]), b"abcd");
        assert!(joined(&[]).is_empty());
    }
}
