//! Root-context state shared by all requests of one VM: the configuration, the bounded queue of
//! outcomes waiting to be flushed to `/v1/feedback`, counters, and the "logged once" memory.
//! With `decision: local` it also holds the VM's copy of the routing state
//! ([`LocalRouter`]): requests are decided on it, and the tick syncs it with the control plane
//! (`/v1/sync`, which also carries the outcomes) instead of flushing feedback.
//!
//! Envoy runs one VM per worker thread, so each worker flushes its own batches and keeps its own
//! copy.

use std::collections::VecDeque;
use std::sync::Arc;

use scorer_core::protocol::{
    FEEDBACK_PATH, FeedbackBatch, FirstToken, Outcome, RouteRequest, RouteResponse,
};
use scorer_core::sync::{LocalRouter, SYNC_PATH, SyncRequest, SyncResponse, push_bounded};

use crate::config::{DecisionMode, FilterConfig};
use crate::machine::{Counter, FailKind, RequestMachine};

/// Most outcomes sent in one feedback call; the rest wait for the next tick.
pub const MAX_BATCH_OUTCOMES: usize = 512;
/// Response ids this VM saw answered, kept so a chain's next turn finds its replica before
/// the report reaches the control plane (a client may send it a millisecond later).
const RECENT_RESPONSES: usize = 256;
/// Most queued outcomes a route call carries (`RouteRequest::finished`): enough for the
/// requests of one feedback interval at a few hundred a second per worker, small beside a
/// prompt's hashes.
pub const MAX_CALL_OUTCOMES: usize = 32;

/// Counters kept inside the VM (the host also mirrors them into proxy metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Requests given a destination header.
    pub routed: u64,
    /// Inference requests let through without routing (see `SkipReason`).
    pub skipped: u64,
    /// Requests released unrouted because something failed.
    pub fail_open: u64,
    /// Requests the control plane refused, answered locally (404, 413, 429).
    pub rejected: u64,
    /// Fail-opens caused by an unparseable request body.
    pub body_parse_errors: u64,
    /// Outcomes dropped because the queue was full.
    pub outcomes_dropped: u64,
    /// Feedback calls answered with a 2xx.
    pub feedback_sent: u64,
    /// Feedback calls that could not start or did not succeed.
    pub feedback_failed: u64,
    /// Requests routed by the VM's own copy of the routing state (`decision: local`).
    pub decided_locally: u64,
    /// Sync calls whose answer was applied.
    pub sync_applied: u64,
    /// Sync calls that could not start, did not succeed or answered something unreadable.
    pub sync_failed: u64,
}

/// A call for the host to dispatch on the tick: a feedback batch, or a sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedbackCall {
    /// Control-plane path: `/v1/feedback`, or `/v1/sync` with `decision: local`.
    pub path: &'static str,
    /// Serialized [`FeedbackBatch`] or `SyncRequest`.
    pub body: Vec<u8>,
    /// Outcomes in the batch.
    pub outcomes: usize,
}

/// The root context's state.
#[derive(Debug)]
pub struct RootState {
    config: Arc<FilterConfig>,
    queue: VecDeque<Outcome>,
    /// First-token reports for the next call (bounded like `queue`; best effort like it).
    first_tokens: VecDeque<FirstToken>,
    /// When the outstanding feedback call was dispatched.
    feedback_in_flight_since_ms: Option<u64>,
    logged: [bool; FailKind::ALL.len()],
    stats: Stats,
    /// The VM's copy of the routing state (`decision: local` only).
    local: Option<LocalRouter>,
    /// The reports of the outstanding sync call, put back if it never reaches a control plane
    /// (one killed, or unreachable, while another would have answered the next tick).
    unacked: Option<SyncRequest>,
    /// The outstanding sync call carried its hash lists in base64: a 400 for it may be an
    /// older control-plane replica that cannot read them, so its reports go out again.
    unacked_compact: bool,
    /// The latest [`RECENT_RESPONSES`] response ids this VM saw answered, with their replica.
    recent_responses: VecDeque<(String, String)>,
    /// An outcome naming a stored response waits for the next call: the host keeps the tick
    /// brought forward until one goes out.
    urgent: bool,
    /// Route calls given up, to withdraw in the next feedback batch (bounded like `queue`).
    withdrawn: Vec<u64>,
    /// The withdrawals of the outstanding feedback call, sent again if it fails: a control
    /// plane stalled long enough to make route calls time out drops feedback calls too, and
    /// a lost withdrawal is phantom load until `inflight_ttl_ms`.
    unacked_withdrawn: Vec<u64>,
    /// Route call ids: `splitmix64(call_seed + n)`, distinct across VMs and restarts.
    call_seed: u64,
    calls: u64,
    /// A route or sync call failed since the last local decision: the copy stops deferring
    /// for a while ([`DEFERRAL_PAUSE_MS`]).
    control_plane_failed: bool,
    /// The requests this VM's copy left to a route call (`decision: local`), by call id, so
    /// the answer can be applied to the copy at once ([`RootState::adopt`]); the oldest of
    /// more than [`MAX_AWAITED_CALLS`] are forgotten (their decisions arrive with the sync).
    awaited: VecDeque<(u64, RouteRequest)>,
    /// When this VM last saw a request (its first tick until then): a copy nobody asked for
    /// `max_state_age_ms` and with nothing to report stops syncing ([`RootState::on_tick`]).
    last_request_ms: Option<u64>,
    /// The copy slowed its syncs for want of requests, or has not synced since it woke: until
    /// a sync is applied, requests ask the control plane, so none is decided on a copy that
    /// stopped following the fleet closely.
    resting: bool,
    /// When the last sync call went out.
    last_sync_ms: Option<u64>,
    /// The last tick found nobody asked for `max_state_age_ms`: the host ticks once per
    /// `max_state_age_ms` instead of every `sync_interval_ms` ([`RootState::tick_period_ms`]).
    idle: bool,
}

/// Route calls a copy remembers the request of: more than one Envoy worker has in flight
/// (each call waits at most the route timeout), small enough to bound the memory.
pub const MAX_AWAITED_CALLS: usize = 64;

/// How long a VM's copy decides everything itself after a route or sync call failed, rather
/// than leave long misses to a control plane that may not answer (they would fail open,
/// unplaced). Syncs run every tick, so a dead control plane is usually noticed by a sync
/// before any deferred request reaches it.
pub const DEFERRAL_PAUSE_MS: u64 = 10_000;

/// What became of a finished request's outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Queued {
    /// The queue was full and its oldest outcome was dropped.
    pub dropped: bool,
    /// The outcome names a stored response: report it now rather than on the tick, so the
    /// control plane (and other proxies) can place the chain's next turn.
    pub flush_now: bool,
}

impl RootState {
    /// State for a freshly configured root context.
    pub fn new(config: FilterConfig) -> Self {
        let local = (config.decision == DecisionMode::Local).then(|| {
            LocalRouter::new(config.max_pending_reports).with_max_index_blocks(
                (config.max_index_blocks > 0).then_some(config.max_index_blocks),
            )
        });
        RootState {
            config: Arc::new(config),
            queue: VecDeque::new(),
            first_tokens: VecDeque::new(),
            feedback_in_flight_since_ms: None,
            logged: [false; FailKind::ALL.len()],
            stats: Stats::default(),
            local,
            unacked: None,
            unacked_compact: false,
            recent_responses: VecDeque::new(),
            urgent: false,
            withdrawn: Vec::new(),
            unacked_withdrawn: Vec::new(),
            awaited: VecDeque::new(),
            call_seed: 0,
            calls: 0,
            control_plane_failed: false,
            last_request_ms: None,
            resting: false,
            last_sync_ms: None,
            idle: false,
        }
    }

    /// Seeds the route call ids (the host passes its clock and context id): VMs started at
    /// different instants draw unrelated ids.
    pub fn seed_calls(&mut self, seed: u64) {
        self.call_seed = seed;
    }

    /// Readies `request` for a route call: a fresh call id (to withdraw it if the request
    /// gives up waiting) and up to [`MAX_CALL_OUTCOMES`] queued outcomes, so the control plane
    /// learns what finished before it decides instead of on the next tick. `nonce` (the host
    /// clock in ns) keeps two VMs seeded alike from drawing the same ids.
    pub fn prepare_call(&mut self, request: &mut RouteRequest, nonce: u64) {
        self.calls += 1;
        let mut z = (self.call_seed ^ nonce.rotate_left(32))
            .wrapping_add(self.calls.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        request.call_id = Some((z ^ (z >> 31)).max(1));
        if self.local.is_none() {
            let n = self.queue.len().min(MAX_CALL_OUTCOMES);
            request.finished = self.queue.drain(..n).collect();
            let n = self.first_tokens.len().min(MAX_CALL_OUTCOMES);
            request.first_tokens = self.first_tokens.drain(..n).collect();
        }
    }

    /// The control plane answered route call `call_id` with `endpoint`: with `decision:
    /// local` the VM's copy accounts for that decision now rather than at the next sync
    /// ([`LocalRouter::adopt`]), so a burst on this worker sees the load it just placed.
    pub fn adopt(&mut self, call_id: u64, endpoint: &str, decision_id: u64, now_ms: u64) {
        let Some(at) = self.awaited.iter().position(|(id, _)| *id == call_id) else {
            return;
        };
        let Some((_, request)) = self.awaited.remove(at) else {
            return;
        };
        if let Some(local) = self.local.as_mut() {
            local.adopt(&request, endpoint, decision_id, now_ms);
        }
    }

    /// A route call was given up: its decision is withdrawn in the next feedback batch.
    pub fn withdraw(&mut self, call_id: u64) {
        self.awaited.retain(|(id, _)| *id != call_id);
        if self.withdrawn.len() >= self.config.max_queued_outcomes {
            self.withdrawn.remove(0);
        }
        self.withdrawn.push(call_id);
    }

    /// Whether an outcome naming a stored response is still waiting for a call (one is in
    /// flight): the host should tick again soon rather than at the period.
    pub fn urgent(&self) -> bool {
        self.urgent
    }

    /// How often the host should tick: the sync interval with `decision: local`, else the
    /// feedback interval.
    pub fn tick_period_ms(&self) -> u64 {
        match self.config.decision {
            DecisionMode::Local if self.idle => self.config.max_state_age_ms,
            DecisionMode::Local => self.config.sync_interval_ms,
            DecisionMode::ControlPlane => self.config.feedback_interval_ms,
        }
    }

    /// [`RootState::decide_locally`], or, when that gives no answer, [`RootState::prepare_call`]:
    /// what the host's request contexts call. A precise request (it carries its prompt) is
    /// never decided on a copy: the control plane tokenises it. `nonce` is called only for a
    /// call (each host clock read is a crossing out of the VM).
    pub fn decide_or_prepare(
        &mut self,
        request: &mut RouteRequest,
        now_ms: u64,
        nonce: impl FnOnce() -> u64,
    ) -> Option<RouteResponse> {
        self.last_request_ms = Some(now_ms);
        self.idle = false;
        let answer = if request.prompt_text.is_some() {
            None
        } else {
            self.decide_locally(request, now_ms)
        };
        if answer.is_none() {
            self.prepare_call(request, nonce());
            if let (Some(call_id), Some(_)) = (request.call_id, self.local.as_ref()) {
                push_bounded(
                    &mut self.awaited,
                    (call_id, request.clone()),
                    MAX_AWAITED_CALLS,
                );
            }
        }
        answer
    }

    /// Decides `request` on the VM's copy of the routing state when there is one and it is
    /// fresh enough; `None` tells the request to ask the control plane. Either way, a request
    /// continuing a response this VM saw answered first learns its replica
    /// (`previous_response_endpoint`).
    pub fn decide_locally(
        &mut self,
        request: &mut RouteRequest,
        now_ms: u64,
    ) -> Option<RouteResponse> {
        if let Some(id) = request.previous_response_id.as_deref()
            && let Some((_, endpoint)) = self.recent_responses.iter().rev().find(|(r, _)| r == id)
        {
            request.previous_response_endpoint = Some(endpoint.clone());
        }
        let max_age = self.config.max_state_age_ms;
        // A resting copy stopped following the fleet: the control plane decides until it has
        // synced again.
        let resting = self.resting;
        let local = self
            .local
            .as_mut()
            .filter(|l| !resting && l.ready(now_ms, max_age))?;
        if std::mem::take(&mut self.control_plane_failed) {
            local.pause_deferral(now_ms.saturating_add(DEFERRAL_PAUSE_MS));
        }
        // A stored response neither this VM nor its copy has placed yet (another proxy served
        // it a moment ago): the control plane hears of it before the next sync does.
        if let Some(id) = request.previous_response_id.as_deref()
            && request.previous_response_endpoint.is_none()
            && !local
                .router()
                .is_some_and(|r| r.knows_stored_response(id, now_ms))
        {
            return None;
        }
        // Ties between equal candidates break on this seed; any per-request value spreads them.
        let seed = self.stats.routed ^ now_ms.rotate_left(17);
        let decision = local.route(request, now_ms, seed)?;
        if decision.response.endpoints.is_empty() || decision.response.reject.is_some() {
            return None;
        }
        self.stats.decided_locally += 1;
        Some(decision.response)
    }

    /// Whether this VM saw a request (or started) within `max_state_age_ms` of `now_ms`.
    fn asked_since(&self, now_ms: u64) -> bool {
        self.last_request_ms
            .is_none_or(|at| now_ms.saturating_sub(at) < self.config.max_state_age_ms)
    }

    /// Whether the copy rests (`decision: local`): it stopped syncing for want of requests, or
    /// has not synced since one woke it.
    pub fn resting(&self) -> bool {
        self.resting
    }

    /// The VM's copy of the routing state, with `decision: local`.
    pub fn local(&self) -> Option<&LocalRouter> {
        self.local.as_ref()
    }

    /// Applies a sync call's answer (`status` `None` on reset). Returns whether it was applied.
    pub fn on_sync_response(&mut self, status: Option<u16>, body: &[u8], now_ms: u64) -> bool {
        self.feedback_in_flight_since_ms = None;
        let unacked = self.unacked.take();
        let compact = std::mem::take(&mut self.unacked_compact);
        if status.is_none_or(|s| s >= 500 || (compact && s == 400)) {
            // Not processed (no answer, or the control plane or the path to it failed): the
            // reports go out again with the next tick, to whichever replica answers it. A 4xx
            // is the control plane refusing them, so they are not retried, unless it is a 400
            // for base64 hash lists, which an older replica in a rolling upgrade cannot read:
            // the next call writes them as arrays.
            self.requeue(unacked);
        }
        let answer = status
            .filter(|s| (200..300).contains(s))
            .and_then(|_| serde_json::from_slice::<SyncResponse>(body).ok());
        match (answer, self.local.as_mut()) {
            (Some(answer), Some(local)) => {
                local.apply(answer, now_ms);
                self.stats.sync_applied += 1;
                // Awake again once a request came while it rested.
                self.resting = self.resting && !self.asked_since(now_ms);
                true
            }
            (_, local) => {
                if let Some(local) = local {
                    local.sync_failed();
                }
                self.stats.sync_failed += 1;
                self.control_plane_failed = true;
                false
            }
        }
    }

    /// Puts a sync call's reports back in front of the copy's queues (bounded there).
    /// Puts the failed feedback call's withdrawals back in front of the queue.
    fn requeue_withdrawn(&mut self) {
        let mut again = std::mem::take(&mut self.unacked_withdrawn);
        again.append(&mut self.withdrawn);
        let max = self.config.max_queued_outcomes;
        if again.len() > max {
            again.drain(..again.len() - max);
        }
        self.withdrawn = again;
    }

    fn requeue(&mut self, request: Option<SyncRequest>) {
        if let (Some(request), Some(local)) = (request, self.local.as_mut()) {
            local.requeue(request);
        }
    }

    /// The active configuration.
    pub fn config(&self) -> &Arc<FilterConfig> {
        &self.config
    }

    /// A machine for a new request under this configuration.
    pub fn new_request(&self) -> RequestMachine {
        RequestMachine::new(Arc::clone(&self.config))
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Outcomes waiting for a flush.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Counts `counter`; returns true when it is a failure kind seen for the first time, which
    /// the host logs (once per kind, not once per request).
    pub fn count(&mut self, counter: Counter) -> bool {
        match counter {
            Counter::Routed => self.stats.routed += 1,
            // `decide_locally` counts these itself, where it knows the answer was used.
            Counter::DecidedLocally => {}
            Counter::Skipped(_) => self.stats.skipped += 1,
            Counter::Rejected(_) => self.stats.rejected += 1,
            Counter::FailOpen(kind) => {
                self.stats.fail_open += 1;
                self.control_plane_failed |= kind.is_route_call();
                if kind == FailKind::BodyParse {
                    self.stats.body_parse_errors += 1;
                }
                let first = !self.logged[kind.index()];
                self.logged[kind.index()] = true;
                return first;
            }
        }
        false
    }

    /// Queues a finished request's outcome; when full, the oldest is dropped (newer outcomes
    /// describe the fleet's current state better). Returns true when one was dropped.
    /// With `decision: local` the outcome is applied to the VM's copy at once and travels in the
    /// next sync instead (bounded there).
    pub fn push_outcome(&mut self, outcome: Outcome, now_ms: u64) -> Queued {
        let flush_now = match &outcome.response_id {
            Some(id) if (200..300).contains(&outcome.status) && !outcome.endpoint.is_empty() => {
                push_bounded(
                    &mut self.recent_responses,
                    (id.clone(), outcome.endpoint.clone()),
                    RECENT_RESPONSES,
                );
                true
            }
            _ => false,
        };
        self.urgent |= flush_now;
        if let Some(local) = self.local.as_mut() {
            local.outcome(outcome, now_ms);
            return Queued {
                dropped: false,
                flush_now,
            };
        }
        let dropped = push_bounded(&mut self.queue, outcome, self.config.max_queued_outcomes);
        self.stats.outcomes_dropped += u64::from(dropped);
        Queued { dropped, flush_now }
    }

    /// A routed request's streamed response sent its first token ([`FirstToken`]): with
    /// `decision: local` the VM's copy applies it at once and the next sync carries it;
    /// otherwise it waits for the next route call or feedback tick, whichever is first.
    pub fn push_first_token(&mut self, first: FirstToken, now_ms: u64) {
        if let Some(local) = self.local.as_mut() {
            local.first_token(first, now_ms);
            return;
        }
        push_bounded(
            &mut self.first_tokens,
            first,
            self.config.max_queued_outcomes,
        );
    }

    /// On a tick: the next batch to send, unless the queue is empty or a previous call is still
    /// outstanding. A call outstanding for twice its timeout is presumed lost.
    pub fn on_tick(&mut self, now_ms: u64) -> Option<FeedbackCall> {
        if let Some(since) = self.feedback_in_flight_since_ms {
            if now_ms.saturating_sub(since) < self.config.feedback_timeout_ms.saturating_mul(2) {
                return None;
            }
            self.feedback_in_flight_since_ms = None;
            self.stats.feedback_failed += 1;
            self.control_plane_failed = true;
            let lost = self.unacked.take();
            self.requeue(lost);
            self.requeue_withdrawn();
            if let Some(local) = self.local.as_mut() {
                local.sync_failed();
            }
        }
        // A VM's start counts as its last request: it syncs until its copy is ready.
        self.last_request_ms.get_or_insert(now_ms);
        let idle =
            self.local.as_ref().is_some_and(|l| !l.has_pending()) && !self.asked_since(now_ms);
        self.idle = idle;
        if idle {
            self.resting = true;
        }
        if let Some(local) = self.local.as_mut() {
            // Every tick the copy pulls what others did, even with nothing to report, while
            // requests come. One nobody asked for `max_state_age_ms`, with nothing to report,
            // rests: it syncs once every `max_state_age_ms` instead (an idle Envoy spent some
            // 0.5 ms of CPU a sync, 2 % of a core per worker; docs/BENCHMARKS.md), enough to
            // keep its place in the log, and the next request asks the control plane and wakes
            // it.
            let synced_lately = self
                .last_sync_ms
                .is_some_and(|at| now_ms.saturating_sub(at) < self.config.max_state_age_ms);
            if idle && synced_lately {
                return None;
            }
            let request = local.sync_request();
            let outcomes = request.outcomes.len();
            let compact = local.peer_reads_compact();
            return match scorer_core::sync::to_json(&request, compact) {
                Ok(body) => {
                    self.urgent = false;
                    self.last_sync_ms = Some(now_ms);
                    self.unacked = Some(request);
                    self.unacked_compact = compact;
                    self.feedback_in_flight_since_ms = Some(now_ms);
                    Some(FeedbackCall {
                        path: SYNC_PATH,
                        body,
                        outcomes,
                    })
                }
                Err(_) => {
                    self.stats.sync_failed += 1;
                    None
                }
            };
        }
        if self.queue.is_empty() && self.withdrawn.is_empty() && self.first_tokens.is_empty() {
            return None;
        }
        let n = self.queue.len().min(MAX_BATCH_OUTCOMES);
        let w = self.withdrawn.len().min(MAX_BATCH_OUTCOMES);
        let f = self.first_tokens.len().min(MAX_BATCH_OUTCOMES);
        let batch = FeedbackBatch {
            outcomes: self.queue.drain(..n).collect(),
            withdrawn: self.withdrawn.drain(..w).collect(),
            first_tokens: self.first_tokens.drain(..f).collect(),
        };
        self.unacked_withdrawn.clone_from(&batch.withdrawn);
        match serde_json::to_vec(&batch) {
            Ok(body) => {
                self.urgent = false;
                self.feedback_in_flight_since_ms = Some(now_ms);
                Some(FeedbackCall {
                    path: FEEDBACK_PATH,
                    body,
                    outcomes: n,
                })
            }
            Err(_) => {
                self.stats.feedback_failed += 1;
                None
            }
        }
    }

    /// The host could not start the feedback call. The batch is dropped: feedback is
    /// best-effort and must not grow memory while the control plane is away.
    pub fn on_feedback_dispatch_failed(&mut self) {
        self.feedback_in_flight_since_ms = None;
        if self.local.is_some() {
            let unsent = self.unacked.take();
            self.requeue(unsent);
            self.stats.sync_failed += 1;
            self.control_plane_failed = true;
        } else {
            self.stats.feedback_failed += 1;
            self.requeue_withdrawn();
        }
    }

    /// The feedback call finished; `status` is `None` on reset. Returns whether it succeeded.
    pub fn on_feedback_response(&mut self, status: Option<u16>) -> bool {
        self.feedback_in_flight_since_ms = None;
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        if ok {
            self.stats.feedback_sent += 1;
            self.unacked_withdrawn.clear();
        } else {
            self.stats.feedback_failed += 1;
            self.requeue_withdrawn();
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(id: u64) -> Outcome {
        Outcome {
            decision_id: id,
            status: 200,
            ..Outcome::default()
        }
    }

    fn batch(call: &FeedbackCall) -> Vec<u64> {
        let b: FeedbackBatch = serde_json::from_slice(&call.body).unwrap();
        b.outcomes.iter().map(|o| o.decision_id).collect()
    }

    // First tokens ride on the next route call, else on the feedback tick; with `decision:
    // local` they go to the VM's copy and its next sync.
    #[test]
    fn first_tokens_go_out_with_the_next_call() {
        let first = |id| FirstToken {
            decision_id: id,
            decision_tag: 9,
            ttft_ms: None,
        };
        let mut r = RootState::new(FilterConfig::default());
        r.push_first_token(first(1), 0);
        let mut request = RouteRequest::default();
        r.prepare_call(&mut request, 0);
        assert_eq!(request.first_tokens, vec![first(1)]);
        assert_eq!(r.on_tick(10), None, "nothing left");
        r.push_first_token(first(2), 20);
        let call = r.on_tick(30).unwrap();
        let batch: FeedbackBatch = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(batch.first_tokens, vec![first(2)]);

        let mut local = RootState::new(FilterConfig {
            decision: DecisionMode::Local,
            ..FilterConfig::default()
        });
        local.push_first_token(first(3), 0);
        let call = local.on_tick(10).unwrap();
        let sync: SyncRequest = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(sync.first_tokens, vec![first(3)]);
    }

    #[test]
    fn batches_in_order_one_call_at_a_time() {
        let mut r = RootState::new(FilterConfig::default());
        assert_eq!(r.on_tick(0), None, "nothing queued");
        for id in 1..=MAX_BATCH_OUTCOMES as u64 + 3 {
            r.push_outcome(outcome(id), 0);
        }
        let first = r.on_tick(10).unwrap();
        assert_eq!(first.outcomes, MAX_BATCH_OUTCOMES);
        assert_eq!(batch(&first)[..2], [1, 2]);
        assert_eq!(r.on_tick(20), None, "previous call outstanding");
        assert!(r.on_feedback_response(Some(200)));
        let second = r.on_tick(30).unwrap();
        assert_eq!(batch(&second), [513, 514, 515]);
        assert!(!r.on_feedback_response(None));
        assert_eq!(r.queued(), 0);
        assert_eq!((r.stats().feedback_sent, r.stats().feedback_failed), (1, 1));
    }

    #[test]
    fn lost_call_is_given_up_and_dispatch_failure_drops_batch() {
        let mut r = RootState::new(FilterConfig::default());
        r.push_outcome(outcome(1), 0);
        assert!(r.on_tick(0).is_some());
        r.push_outcome(outcome(2), 0);
        assert_eq!(r.on_tick(1999), None);
        assert_eq!(batch(&r.on_tick(2000).unwrap()), [2]);
        r.on_feedback_dispatch_failed();
        assert_eq!(r.on_tick(2001), None);
        assert_eq!(r.stats().feedback_failed, 2);
    }

    /// Issue #20, defects 1 and 4: a route call carries a fresh id and the outcomes queued
    /// so far (the control plane hears of finished requests before its next decision); a
    /// withdrawn call goes out with the next batch even when no outcome waits.
    #[test]
    fn route_calls_carry_an_id_and_the_queued_outcomes_and_withdrawals_flush() {
        let mut r = RootState::new(FilterConfig::default());
        r.seed_calls(7);
        for id in 1..=MAX_CALL_OUTCOMES as u64 + 2 {
            r.push_outcome(outcome(id), 0);
        }
        let mut first = RouteRequest::default();
        r.prepare_call(&mut first, 1);
        assert_eq!(first.finished.len(), MAX_CALL_OUTCOMES);
        assert_eq!(first.finished[0].decision_id, 1);
        assert_eq!(r.queued(), 2);
        let mut second = RouteRequest::default();
        r.prepare_call(&mut second, 1);
        assert!(first.call_id.is_some() && second.call_id.is_some());
        assert_ne!(first.call_id, second.call_id);
        assert_eq!(second.finished.len(), 2);
        // Another VM seeded the same way but calling at another instant draws another id.
        let mut other = RootState::new(FilterConfig::default());
        other.seed_calls(7);
        let mut third = RouteRequest::default();
        other.prepare_call(&mut third, 2);
        assert_ne!(third.call_id, first.call_id);

        r.withdraw(first.call_id.unwrap());
        let call = r.on_tick(10).expect("a withdrawal is worth a call");
        let sent: FeedbackBatch = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(sent.withdrawn, [first.call_id.unwrap()]);
        assert!(sent.outcomes.is_empty());
        // A failed call's withdrawals go again (a stalled control plane drops them); an
        // answered one's do not.
        assert!(!r.on_feedback_response(Some(503)));
        let again = r.on_tick(20).expect("sent again");
        let sent: FeedbackBatch = serde_json::from_slice(&again.body).unwrap();
        assert_eq!(sent.withdrawn, [first.call_id.unwrap()]);
        assert!(r.on_feedback_response(Some(204)));
        assert_eq!(r.on_tick(30), None);
    }

    #[test]
    fn queue_is_bounded_dropping_oldest() {
        let mut r = RootState::new(FilterConfig {
            max_queued_outcomes: 3,
            ..FilterConfig::default()
        });
        for id in 1..=5 {
            r.push_outcome(outcome(id), 0);
        }
        assert_eq!(r.stats().outcomes_dropped, 2);
        assert_eq!(batch(&r.on_tick(0).unwrap()), [3, 4, 5]);
    }

    #[test]
    fn a_stored_response_is_reported_at_once_and_hints_its_chain() {
        let mut r = RootState::new(FilterConfig::default());
        assert!(!r.push_outcome(outcome(1), 0).flush_now);
        let stored = Outcome {
            endpoint: "10.0.0.7:8000".into(),
            status: 200,
            response_id: Some("resp_1".into()),
            ..outcome(2)
        };
        assert!(r.push_outcome(stored.clone(), 0).flush_now);
        assert!(r.urgent());
        assert!(r.on_tick(1).is_some());
        assert!(!r.urgent(), "sent with that call");
        let failed = Outcome {
            status: 404,
            response_id: Some("resp_2".into()),
            ..stored.clone()
        };
        assert!(!r.push_outcome(failed, 0).flush_now);
        let mut next = RouteRequest {
            previous_response_id: Some("resp_1".into()),
            ..RouteRequest::default()
        };
        assert_eq!(r.decide_locally(&mut next, 1), None, "no local copy");
        assert_eq!(
            next.previous_response_endpoint.as_deref(),
            Some("10.0.0.7:8000")
        );
        let mut other = RouteRequest {
            previous_response_id: Some("resp_2".into()),
            ..RouteRequest::default()
        };
        r.decide_locally(&mut other, 1);
        assert_eq!(other.previous_response_endpoint, None);
        for id in 0..300 {
            r.push_outcome(
                Outcome {
                    response_id: Some(format!("resp_x{id}")),
                    ..stored.clone()
                },
                0,
            );
        }
        assert_eq!(r.recent_responses.len(), RECENT_RESPONSES, "bounded");
    }

    mod local {
        use super::*;
        use scorer_core::router::{EndpointMetrics, Router, RouterConfig};
        use scorer_core::sync::{
            DEFAULT_SYNC_INTERVAL_MS, DecisionRecord, SyncEvent, SyncLog, SyncRequest, serve_sync,
        };

        fn local_root() -> RootState {
            RootState::new(FilterConfig {
                decision: DecisionMode::Local,
                ..FilterConfig::default()
            })
        }

        fn control_plane() -> (SyncLog, Router) {
            let mut router = Router::new(RouterConfig::default(), 1);
            for address in ["10.0.0.1:8000", "10.0.0.2:8000"] {
                router.upsert_endpoint(address).unwrap();
                router.update_metrics(address, EndpointMetrics::default(), 0);
            }
            (SyncLog::new(100, 5), router)
        }

        /// One tick's sync call, answered by the control plane's side of the protocol.
        fn tick(root: &mut RootState, cp: &mut (SyncLog, Router), now_ms: u64) {
            let call = root.on_tick(now_ms).expect("a sync call every tick");
            answer_sync(root, cp, &call, now_ms);
        }

        /// `call` answered by the control plane's side of the protocol, the answer applied.
        fn answer_sync(
            root: &mut RootState,
            cp: &mut (SyncLog, Router),
            call: &FeedbackCall,
            now_ms: u64,
        ) -> SyncRequest {
            assert_eq!(call.path, SYNC_PATH);
            let request: SyncRequest = serde_json::from_slice(&call.body).unwrap();
            let compact = request.compact_hashes;
            let answer = serve_sync(&mut cp.0, &mut cp.1, request.clone(), now_ms);
            let body = scorer_core::sync::to_json(&answer, compact).unwrap();
            assert!(root.on_sync_response(Some(200), &body, now_ms));
            request
        }

        /// A served outcome of `answer`'s decision.
        fn served(answer: &RouteResponse) -> Outcome {
            Outcome {
                decision_id: answer.decision_id,
                endpoint: answer.endpoints[0].clone(),
                status: 200,
                ..Outcome::default()
            }
        }

        /// A synced copy that decided one request at 10 ms and reported it at 25 ms.
        fn reported_once(cp: &mut (SyncLog, Router)) -> (RootState, RouteResponse) {
            let mut root = local_root();
            tick(&mut root, cp, 0);
            let answer = root
                .decide_or_prepare(&mut request(), 10, || 1)
                .expect("decided locally");
            tick(&mut root, cp, 25);
            (root, answer)
        }

        fn request() -> RouteRequest {
            RouteRequest {
                model: "m".into(),
                block_hashes: vec![1, 2, 3],
                prompt_bytes: 768,
                prompt_tokens: 192,
                ..RouteRequest::default()
            }
        }

        // The VM's sync call names the endpoint table its copy holds, so every answer after the
        // first carries only what changed, and a removal still reaches the copy.
        #[test]
        fn syncs_after_the_first_carry_only_changes() {
            let mut root = local_root();
            let mut cp = control_plane();
            tick(&mut root, &mut cp, 0);
            let call = root.on_tick(50).expect("a sync call every tick");
            let request: SyncRequest = serde_json::from_slice(&call.body).unwrap();
            assert_eq!(request.table, cp.0.table());
            let answer = serve_sync(&mut cp.0, &mut cp.1, request, 50);
            assert!(answer.delta && answer.endpoints.is_empty() && answer.config.is_none());
            let body = serde_json::to_vec(&answer).unwrap();
            assert!(root.on_sync_response(Some(200), &body, 50));
            cp.1.remove_endpoint("10.0.0.2:8000");
            tick(&mut root, &mut cp, 100);
            let copy = root.local().and_then(LocalRouter::router).unwrap();
            assert_eq!(copy.endpoint_count(), 1);
        }

        // A long miss is left to the control plane while others decide; once a route call has
        // failed, the copy decides it itself for a while rather than let it fail open unplaced.
        /// A 2,560-token miss, distinct per `n`: a copy that knows of other routers defers it.
        fn long(n: u64) -> RouteRequest {
            RouteRequest {
                block_hashes: (n * 100..n * 100 + 40).collect(),
                prompt_bytes: 40 * 256,
                prompt_tokens: 2_560,
                ..request()
            }
        }

        /// Two synced VMs, the second having heard of the first's decision at time 1 (synced
        /// at 2), so it leaves long misses to the control plane.
        fn deferring_pair() -> (RootState, RootState, (SyncLog, Router)) {
            let (mut a, mut b) = (local_root(), local_root());
            let mut cp = control_plane();
            tick(&mut a, &mut cp, 0);
            tick(&mut b, &mut cp, 0);
            assert!(a.decide_locally(&mut long(1), 1).is_some());
            tick(&mut a, &mut cp, 2);
            tick(&mut b, &mut cp, 2);
            (a, b, cp)
        }

        #[test]
        fn a_failed_route_call_pauses_deferral() {
            let (_, mut b, mut cp) = deferring_pair();
            assert_eq!(b.decide_locally(&mut long(2), 3), None, "deferred");
            b.count(Counter::FailOpen(FailKind::Timeout));
            assert!(b.decide_locally(&mut long(3), 4).is_some(), "paused");
            let later = 5 + DEFERRAL_PAUSE_MS;
            tick(&mut b, &mut cp, later);
            assert!(b.local().is_some_and(|l| l.ready(later, 1_000)));
            assert_eq!(
                b.decide_locally(&mut long(4), later),
                None,
                "the pause is over"
            );
        }

        // A long miss left to the control plane is in the copy as soon as the answer comes:
        // the VM's next decision sees the load it placed, and the sync's copy of the same
        // decision is not counted again.
        #[test]
        fn a_route_calls_answer_is_adopted_by_the_copy_once() {
            let (_, mut b, mut cp) = deferring_pair();
            let mut long = long(2);
            assert_eq!(b.decide_or_prepare(&mut long, 3, || 7), None, "deferred");
            let call_id = long.call_id.expect("a route call");
            let decision = cp.1.route(&long, 3, 1);
            let endpoint = decision.response.endpoints[0].clone();
            let inflight = |root: &RootState| {
                let copy = root.local().and_then(LocalRouter::router).unwrap();
                copy.endpoints(4)
                    .into_iter()
                    .find(|e| e.address == endpoint)
                    .map_or(0, |e| e.inflight)
            };
            let before = inflight(&b);
            b.adopt(call_id, &endpoint, decision.response.decision_id, 4);
            assert_eq!(inflight(&b), before + 1, "adopted at once");
            b.adopt(call_id, &endpoint, decision.response.decision_id, 4);
            assert_eq!(inflight(&b), before + 1, "one call, one adoption");
            cp.0.push(
                SyncEvent::Decision {
                    origin: 0,
                    record: Box::new(DecisionRecord {
                        decision_id: decision.response.decision_id,
                        endpoint: endpoint.clone(),
                        request: long.clone(),
                        age_ms: 0,
                    }),
                },
                4,
            );
            tick(&mut b, &mut cp, 5);
            assert_eq!(inflight(&b), before + 1, "the sync's copy is a repeat");
        }

        // A chain's next turn is decided locally only where its stored response is known:
        // by this VM (it saw the answer) or by its copy; otherwise the control plane is asked.
        #[test]
        fn an_unplaced_stored_response_asks_the_control_plane() {
            let mut root = local_root();
            let mut cp = control_plane();
            tick(&mut root, &mut cp, 0);
            let mut unknown = RouteRequest {
                previous_response_id: Some("resp_far".into()),
                ..request()
            };
            assert_eq!(root.decide_locally(&mut unknown, 10), None);
            let answered = root.decide_locally(&mut request(), 10).unwrap();
            root.push_outcome(
                Outcome {
                    decision_id: answered.decision_id,
                    endpoint: answered.endpoints[0].clone(),
                    status: 200,
                    response_id: Some("resp_near".into()),
                    ..Outcome::default()
                },
                20,
            );
            let mut next = RouteRequest {
                previous_response_id: Some("resp_near".into()),
                ..request()
            };
            let d = root.decide_locally(&mut next, 30).expect("decided locally");
            assert_eq!(d.endpoints, vec![answered.endpoints[0].clone()]);
            assert_eq!(d.reason, scorer_core::protocol::RouteReason::StoredResponse);
        }

        // Before the first sync the VM has nothing to decide on: requests ask the control
        // plane. After it, they are decided locally, and the decision travels in the next sync.
        #[test]
        fn decides_once_synced_and_reports_the_decision() {
            let mut root = local_root();
            let mut cp = control_plane();
            assert_eq!(root.tick_period_ms(), DEFAULT_SYNC_INTERVAL_MS);
            assert_eq!(root.decide_locally(&mut request(), 0), None);
            tick(&mut root, &mut cp, 0);
            let answer = root
                .decide_locally(&mut request(), 10)
                .expect("decided locally");
            assert_eq!(
                answer.endpoints.len(),
                2,
                "the chosen endpoint and a fallback"
            );
            assert_eq!(root.stats().decided_locally, 1);
            root.push_outcome(
                Outcome {
                    decision_id: answer.decision_id,
                    endpoint: answer.endpoints[0].clone(),
                    status: 200,
                    ..Outcome::default()
                },
                15,
            );
            let call = root.on_tick(20).unwrap();
            let report: SyncRequest = serde_json::from_slice(&call.body).unwrap();
            assert_eq!(report.decisions.len(), 1);
            assert_eq!(report.decisions[0].decision_id, answer.decision_id);
            assert_eq!((report.outcomes.len(), call.outcomes), (1, 1));
        }

        // Decisions carry their block hashes in base64 once an answer says the control plane
        // reads them, and as arrays again after a failed sync (the next replica may be older).
        #[test]
        fn decisions_travel_in_the_form_the_control_plane_reads() {
            let mut root = local_root();
            let mut cp = control_plane();
            let first = root.on_tick(0).unwrap();
            let hello: SyncRequest = serde_json::from_slice(&first.body).unwrap();
            assert!(hello.compact_hashes, "the copy says it reads base64");
            let answer = serve_sync(&mut cp.0, &mut cp.1, hello, 0);
            let body = scorer_core::sync::to_json(&answer, true).unwrap();
            assert!(root.on_sync_response(Some(200), &body, 0));
            let sent = |root: &mut RootState, now_ms| {
                root.decide_locally(&mut request(), now_ms)
                    .expect("decided locally");
                let call = root.on_tick(now_ms + 1).unwrap();
                let report: SyncRequest = serde_json::from_slice(&call.body).unwrap();
                assert_eq!(report.decisions[0].request.block_hashes, [1, 2, 3]);
                String::from_utf8(call.body).unwrap()
            };
            let compact = sent(&mut root, 10);
            assert!(compact.contains(r#""block_hashes":""#), "{compact}");
            assert!(!root.on_sync_response(Some(503), b"", 12));
            let plain = sent(&mut root, 20);
            assert!(plain.contains(r#""block_hashes":[1,2,3]"#), "{plain}");
            // An older replica refuses base64 with a 400: the reports go again, as arrays.
            let answer = serve_sync(&mut cp.0, &mut cp.1, SyncRequest::default(), 22);
            let body = scorer_core::sync::to_json(&answer, true).unwrap();
            assert!(root.on_sync_response(Some(200), &body, 22));
            let refused = sent(&mut root, 30);
            assert!(refused.contains(r#""block_hashes":""#), "{refused}");
            assert!(!root.on_sync_response(Some(400), b"", 32));
            let call = root.on_tick(40).unwrap();
            let again: SyncRequest = serde_json::from_slice(&call.body).unwrap();
            assert_eq!(again.decisions.len(), 1, "the refused decision goes again");
            assert!(
                String::from_utf8(call.body)
                    .unwrap()
                    .contains(r#""block_hashes":[1,2,3]"#)
            );
        }

        // A copy that has not synced for `max_state_age_ms` is not trusted.
        #[test]
        fn a_stale_copy_asks_the_control_plane() {
            let mut root = local_root();
            let mut cp = control_plane();
            tick(&mut root, &mut cp, 0);
            assert!(root.decide_locally(&mut request(), 1000).is_some());
            assert_eq!(root.decide_locally(&mut request(), 1001), None);
        }

        // A copy nobody asks rests once it has nothing to report: it syncs once a rest period
        // instead of every tick. The next request asks the control plane (the copy stopped
        // following the fleet closely), the tick after it syncs, and the copy decides again.
        #[test]
        fn an_idle_copy_rests_and_the_next_request_wakes_it() {
            let mut cp = control_plane();
            let (mut root, answer) = reported_once(&mut cp);
            let rest_after = root.config().max_state_age_ms;
            // Its outcome goes out, then it keeps syncing until nobody asked for `rest_after`.
            root.push_outcome(served(&answer), 26);
            tick(&mut root, &mut cp, 30);
            tick(&mut root, &mut cp, 10 + rest_after - 1);
            assert!(!root.resting());
            assert!(root.on_tick(10 + rest_after).is_none(), "no call at rest");
            assert!(root.resting());
            assert_eq!(root.tick_period_ms(), rest_after, "the host ticks slower");
            // At rest, one sync every `rest_after`: the copy keeps its place in the log.
            let mut calls = 0;
            let mut now = 10 + rest_after;
            while now < 10 + 11 * rest_after {
                now += 25;
                if let Some(call) = root.on_tick(now) {
                    calls += 1;
                    answer_sync(&mut root, &mut cp, &call, now);
                    assert!(root.resting(), "a sync at rest does not wake it");
                }
            }
            assert!(
                (9..=10).contains(&calls),
                "{calls} syncs in 10 rest periods"
            );
            // The next request goes to the control plane, and the copy syncs on the next tick.
            let mut woken = request();
            assert_eq!(root.decide_or_prepare(&mut woken, now + 10, || 2), None);
            assert!(woken.call_id.is_some(), "a route call is prepared");
            assert_eq!(root.tick_period_ms(), DEFAULT_SYNC_INTERVAL_MS);
            tick(&mut root, &mut cp, now + 25);
            assert!(!root.resting());
            let again = root.decide_or_prepare(&mut request(), now + 30, || 3);
            assert!(again.is_some(), "decided locally again");
        }

        // A resting copy still reports an outcome that arrives (a long stream ending) and
        // stays at rest.
        #[test]
        fn a_resting_copy_still_reports_and_stays_at_rest() {
            let mut cp = control_plane();
            let (mut root, answer) = reported_once(&mut cp);
            let rest_after = root.config().max_state_age_ms;
            assert!(root.on_tick(10 + rest_after).is_none());
            assert!(root.resting());
            root.push_outcome(served(&answer), 90_000);
            let call = root.on_tick(90_010).expect("the outcome goes out");
            let report = answer_sync(&mut root, &mut cp, &call, 90_010);
            assert_eq!(report.outcomes.len(), 1);
            assert!(root.resting(), "no request came");
            assert!(root.on_tick(90_035).is_none(), "synced lately");
        }

        // Reports of a sync that reached no control plane (a dead replica, a reset) go out
        // again on the next tick; reports a control plane refused (4xx) do not.
        #[test]
        fn reports_of_an_unanswered_sync_are_sent_again() {
            let mut root = local_root();
            let mut cp = control_plane();
            tick(&mut root, &mut cp, 0);
            let answer = root
                .decide_locally(&mut request(), 10)
                .expect("decided locally");
            let sent = |call: &FeedbackCall| {
                let report: SyncRequest = serde_json::from_slice(&call.body).unwrap();
                report
                    .decisions
                    .iter()
                    .map(|d| d.decision_id)
                    .collect::<Vec<_>>()
            };
            let call = root.on_tick(20).unwrap();
            assert_eq!(sent(&call), [answer.decision_id]);
            assert!(!root.on_sync_response(Some(503), b"", 21));
            let call = root.on_tick(30).unwrap();
            assert_eq!(sent(&call), [answer.decision_id], "sent again after a 503");
            assert!(!root.on_sync_response(None, b"", 31));
            let call = root.on_tick(40).unwrap();
            assert_eq!(
                sent(&call),
                [answer.decision_id],
                "sent again after a reset"
            );
            assert!(!root.on_sync_response(Some(400), b"", 41));
            assert!(
                sent(&root.on_tick(50).unwrap()).is_empty(),
                "a 400 is final"
            );
            root.on_feedback_dispatch_failed();
            root.decide_locally(&mut request(), 60)
                .expect("decided locally");
            let call = root.on_tick(70).unwrap();
            root.on_feedback_dispatch_failed();
            assert_eq!(
                sent(&root.on_tick(80).unwrap()),
                sent(&call),
                "not dispatched"
            );
        }

        // A failed or unreadable sync changes nothing and is counted; the next tick retries.
        #[test]
        fn a_bad_sync_answer_is_counted_not_applied() {
            let mut root = local_root();
            assert!(root.on_tick(0).is_some());
            assert!(!root.on_sync_response(Some(503), b"", 1));
            assert!(
                root.on_tick(2).is_some(),
                "the failed call is no longer outstanding"
            );
            assert!(!root.on_sync_response(Some(200), b"{not json", 3));
            assert!(root.on_tick(4).is_some());
            assert!(!root.on_sync_response(None, b"", 5));
            assert_eq!(root.stats().sync_failed, 3);
            assert_eq!(root.decide_locally(&mut request(), 6), None);
        }

        // In control-plane mode nothing of this exists: the tick flushes feedback.
        #[test]
        fn control_plane_mode_keeps_the_feedback_path() {
            let mut root = RootState::new(FilterConfig::default());
            assert!(root.local().is_none());
            assert_eq!(root.decide_locally(&mut request(), 0), None);
            root.push_outcome(outcome(1), 0);
            assert_eq!(root.on_tick(0).unwrap().path, FEEDBACK_PATH);
        }
    }

    #[test]
    fn failures_log_once_per_kind() {
        let mut r = RootState::new(FilterConfig::default());
        assert!(r.count(Counter::FailOpen(FailKind::Timeout)));
        assert!(!r.count(Counter::FailOpen(FailKind::Timeout)));
        assert!(r.count(Counter::FailOpen(FailKind::BodyParse)));
        assert!(!r.count(Counter::Routed));
        let s = r.stats();
        assert_eq!((s.fail_open, s.body_parse_errors, s.routed), (3, 1, 1));
    }
}
