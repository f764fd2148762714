//! The single owner of the routing state: one `Router` behind one lock, plus the clock and seed.
//!
//! Route decisions take microseconds, so a plain mutex beats anything cleverer. Time is
//! milliseconds since process start from a monotonic clock; the Router never reads a clock
//! itself (it is sans-IO), so this is the only place time enters it.
//!
//! The same lock guards the replicated log ([`SyncLog`]) that proxies deciding locally pull:
//! every decision and outcome that changes the router's load accounting is appended to it in
//! the same critical section, whether it came from a route call, a feedback batch or a sync,
//! so the log and the router never disagree about what happened in which order.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use scorer_core::affinity::SessionStats;
use scorer_core::lora::LoraState;
use scorer_core::pools::{PoolStats, ServedModel};
use scorer_core::precise::{ApplyError, KvEvent};
use scorer_core::protocol::{FeedbackBatch, FirstToken, RouteReason, RouteRequest, RouteResponse};
use scorer_core::reuse::{MismatchRecord, ReuseTotals};
use scorer_core::router::{
    Decision, EndpointMetrics, EndpointView, Router, RouterConfig, RouterError, RouterStats,
};
use scorer_core::sync::{
    DecisionRecord, REPLICA_SHIFT, SyncEvent, SyncLog, SyncRequest, SyncResponse, serve_sync,
};
use serde::Serialize;

use crate::telemetry::Telemetry;

/// How often a route call waiting for a stored response's report looks again.
const STORED_RESPONSE_POLL: Duration = Duration::from_millis(2);

/// Shared by the API, admin and scrape tasks (behind an `Arc`).
#[derive(Debug)]
pub struct State {
    inner: Mutex<Inner>,
    started: Instant,
    telemetry: Telemetry,
    /// Scrape bookkeeping per endpoint, apart from the router lock (debug only).
    scrapes: Mutex<BTreeMap<String, ScrapeStatus>>,
    /// KV-event stream bookkeeping per endpoint, apart from the router lock.
    kv_streams: Mutex<BTreeMap<String, KvStreamStatus>>,
    /// Per endpoint: configured model names and the last `/v1/models` answer, merged into the
    /// router's model catalogue whenever either changes.
    catalogues: Mutex<BTreeMap<String, Catalogue>>,
    /// LoRA adapter names seen in KV events: a request for one of these hashes its tokens with
    /// the adapter's seed, as the events' blocks were.
    loras: Mutex<HashSet<String>>,
    /// Admission (priorities, tenant limits, fair share) before routing; `None`: admit all.
    admission: Option<std::sync::Arc<crate::admission::Gate>>,
    /// Outcomes of the SLO window for the autoscaling gauges; `None`: no SLO configured.
    slo: Option<std::sync::Arc<Mutex<crate::slo::SloWindow>>>,
    /// Where logged entries go when control-plane replicas share state (`replication:`).
    replication: Option<crate::replication::Outbox>,
    /// Names this process's messages on the shared stream.
    replica_id: u64,
    /// Whether the state is ready to serve: always without replication; with it, once this
    /// replica has replayed the shared stream (`/readyz`).
    ready: std::sync::atomic::AtomicBool,
    /// The newest `/metrics` page of each data-parallel server, which its ranks' scrape loops
    /// share.
    pages: crate::scrape::SharedPages,
}

/// What one endpoint is known to serve, from configuration and from polling.
#[derive(Debug, Clone, Default)]
struct Catalogue {
    configured: Vec<String>,
    polled: Option<Vec<ServedModel>>,
}

/// Model pools, sessions and adapters: what `/metrics` shows of them.
#[derive(Debug, Clone, Default)]
pub struct FleetFeatures {
    /// Session-affinity outcomes since start.
    pub sessions: SessionStats,
    /// Sessions remembered now.
    pub sessions_remembered: usize,
    /// The learned share of sessions that came back soon (scales the session-start charge).
    pub session_return_share: f64,
    /// Requests naming a stored response: pinned to its replica, unknown, unavailable.
    pub stored_responses: [(&'static str, u64); 3],
    /// Stored response ids remembered now.
    pub stored_responses_remembered: usize,
    /// Unknown-model counters since start.
    pub pools: PoolStats,
    /// Per endpoint: address, models served (`None`: unknown), running and waiting adapters,
    /// and blocks in CPU/storage tiers.
    pub endpoints: Vec<EndpointFeatures>,
}

/// One endpoint's pool, adapter and offload view.
#[derive(Debug, Clone, Default)]
pub struct EndpointFeatures {
    /// `ip:port`.
    pub address: String,
    /// Models it serves, when known.
    pub models: Option<usize>,
    /// The longest context its `/v1/models` cards give (`max_model_len`), when one does.
    pub max_model_len: Option<u32>,
    /// Adapters of running requests, when reported.
    pub lora_running: Option<usize>,
    /// Adapters of waiting requests, when reported.
    pub lora_waiting: Option<usize>,
    /// Adapter slots (`max_lora`), when reported.
    pub max_lora: Option<u32>,
    /// Blocks its KV events put in a CPU or storage tier.
    pub offload_blocks: usize,
}

/// Most LoRA names remembered from KV events (a bound against a misbehaving publisher).
const MAX_LORAS: usize = 4096;

/// How one endpoint's KV-event subscription is going: what tests and debugging look at.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct KvStreamStatus {
    /// `ip:port` of the endpoint the events describe.
    pub address: String,
    /// The publisher's ZMQ endpoint.
    pub endpoint: String,
    /// Whether the SUB socket is connected and its initial replay is done.
    pub connected: bool,
    /// Whether the view may lack blocks stored before the history we saw (joined mid-stream,
    /// or a gap could not be replayed).
    pub partial: bool,
    /// Connections made since start.
    pub sessions: u64,
    /// Batches applied (live and replayed).
    pub batches: u64,
    /// Events applied to the router.
    pub events: u64,
    /// Last applied sequence number per data-parallel rank.
    pub last_seq: BTreeMap<u32, u64>,
    /// Sequence gaps detected.
    pub gaps: u64,
    /// Replays that filled a gap (or the initial history).
    pub replays: u64,
    /// Replays that failed or could not cover a gap.
    pub replay_failures: u64,
    /// Times the endpoint's precise state was dropped.
    pub resets: u64,
    /// Messages that did not decode.
    pub decode_errors: u64,
    /// The most recent problem, for humans.
    pub last_error: Option<String>,
    /// Engine time to arrival of the latest live batch, in ms (clock skew included).
    pub lag_ms: Option<f64>,
}

/// What applying one batch of KV events did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchApplied {
    /// Events applied.
    pub applied: usize,
    /// Stores skipped because their parent precedes the history we have (partial view only).
    pub unknown_parents: usize,
    /// The error that made the router drop the endpoint's state, if one did.
    pub dropped: Option<ApplyError>,
}

/// A per-endpoint status record that knows its endpoint's address.
trait EndpointStatus: Default {
    /// A fresh record for `address`.
    fn named(address: &str) -> Self;
}

impl EndpointStatus for KvStreamStatus {
    fn named(address: &str) -> Self {
        Self {
            address: address.to_string(),
            ..Self::default()
        }
    }
}

impl EndpointStatus for ScrapeStatus {
    fn named(address: &str) -> Self {
        Self {
            address: address.to_string(),
            ..Self::default()
        }
    }
}

/// `address`'s record in a per-endpoint status table, created on first use.
fn endpoint_status<'t, T: EndpointStatus>(
    table: &'t mut BTreeMap<String, T>,
    address: &str,
) -> &'t mut T {
    table
        .entry(address.to_string())
        .or_insert_with(|| T::named(address))
}

/// How scraping one endpoint is going: what `/debug/scrapes` shows.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ScrapeStatus {
    /// `ip:port` of the endpoint.
    pub address: String,
    /// Failed scrapes since the last success.
    pub consecutive_failures: u32,
    /// Successful scrapes since start.
    pub successes: u64,
    /// Failed scrapes since start.
    pub failures: u64,
    /// When the last success happened, in ms since start.
    pub last_success_ms: Option<u64>,
    /// The most recent failure's message, cleared by a success.
    pub last_error: Option<String>,
    /// Duration of the most recent scrape, in ms.
    pub last_duration_ms: f64,
}

#[derive(Debug)]
struct Inner {
    router: Router,
    seed: u64,
    /// Recent decisions, oldest first; ids increase because they are pushed under the lock.
    recent: VecDeque<Decision>,
    recent_cap: usize,
    /// Every decision and outcome, from any router, for the proxies' copies.
    sync: SyncLog,
}

/// Replica tags below this are never handed out: the control plane's own decision ids start
/// at wall-clock microseconds, whose bits above [`REPLICA_SHIFT`] read as a tag near 1600 for
/// decades, and a proxy with that tag would issue ids colliding with the control plane's.
const MIN_REPLICA_TAG: u32 = 1 << 16;
/// Tags above this lose bits when shifted into a decision id (`tag << REPLICA_SHIFT`).
const MAX_REPLICA_TAG: u32 = (1 << (64 - REPLICA_SHIFT)) - 1;
/// Tags left free above the first one, so a long-lived control plane does not run past
/// [`MAX_REPLICA_TAG`] however many proxies (re)start.
const REPLICA_TAG_HEADROOM: u32 = 1 << 22;

/// The first replica tag a control-plane generation hands out, from `entropy` (e.g. the start
/// time): random so that two generations hand out different tags and a proxy's stale tag does
/// not alias a new proxy's, and placed so that no tag collides with the control plane's own
/// decision ids or overflows a decision id.
pub fn first_replica_tag(entropy: u64) -> u32 {
    // splitmix64's finaliser: nearby start times give unrelated tags.
    let mut z = entropy.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let span = u64::from(MAX_REPLICA_TAG - REPLICA_TAG_HEADROOM - MIN_REPLICA_TAG);
    MIN_REPLICA_TAG + u32::try_from(z % span).unwrap_or(0)
}

/// What one sync call did, besides its answer: what the API counts.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncServed {
    /// The answer for the proxy.
    pub response: SyncResponse,
    /// Decisions the proxy reported having taken locally.
    pub decisions: usize,
    /// Outcomes the proxy reported.
    pub outcomes: usize,
    /// Whether the proxy's copy must start over (its `since` left the log, or it came from
    /// another control-plane generation and was given a new tag).
    pub reset: bool,
}

/// A consistent snapshot for `/metrics`.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Every endpoint's view.
    pub endpoints: Vec<EndpointView>,
    /// Router counters.
    pub stats: RouterStats,
    /// Requests routed and not yet reported.
    pub inflight: usize,
    /// Distinct blocks in the prefix index.
    pub index_blocks: usize,
    /// Approximate heap bytes of the prefix index.
    pub index_bytes: usize,
    /// Entries held in the sync log.
    pub sync_log_entries: usize,
    /// Canonical bytes per token the approximate index counts in (configured or learned).
    pub bytes_per_token: f64,
    /// The output an agent request is expected to have, tokens (learned or the default).
    pub agent_output_tokens: f64,
    /// The fleet numbers per pool (model): reuse available, aimed for, delivered, the gap.
    pub pools: Vec<(String, ReuseTotals)>,
}

impl State {
    /// A router over `endpoints`, keeping the last `decision_history` decisions for `/debug`.
    ///
    /// `first_decision_id` should differ across restarts (e.g. derived from wall-clock time) so
    /// late feedback for a previous incarnation's decisions cannot match new ones.
    pub fn new(
        config: RouterConfig,
        endpoints: &[String],
        decision_history: usize,
        first_decision_id: u64,
    ) -> Result<Self, RouterError> {
        let mut router = Router::new(config, first_decision_id);
        for address in endpoints {
            router.upsert_endpoint(address)?;
        }
        let seed = first_decision_id ^ 0x9e37_79b9_7f4a_7c15;
        Ok(Self {
            inner: Mutex::new(Inner {
                router,
                seed: seed.max(1),
                recent: VecDeque::with_capacity(decision_history.min(4096)),
                recent_cap: decision_history,
                sync: SyncLog::new(
                    crate::config::DEFAULT_SYNC_LOG_ENTRIES,
                    first_replica_tag(first_decision_id),
                ),
            }),
            started: Instant::now(),
            telemetry: Telemetry::default(),
            scrapes: Mutex::new(BTreeMap::new()),
            kv_streams: Mutex::new(BTreeMap::new()),
            catalogues: Mutex::new(BTreeMap::new()),
            loras: Mutex::new(HashSet::new()),
            admission: None,
            slo: None,
            replication: None,
            replica_id: (seed ^ (u64::from(std::process::id()) << 40)) | 1,
            ready: std::sync::atomic::AtomicBool::new(true),
            pages: crate::scrape::SharedPages::default(),
        })
    }

    /// The `/metrics` pages data-parallel ranks share ([`crate::scrape::SharedPages`]).
    pub fn shared_pages(&self) -> &crate::scrape::SharedPages {
        &self.pages
    }

    /// Shares the log with other control-plane replicas through `outbox` (the `replication:`
    /// section; [`crate::replication::run`] drains it). Not ready until the stream is replayed.
    pub fn with_replication(mut self, outbox: Option<crate::replication::Outbox>) -> Self {
        self.ready = std::sync::atomic::AtomicBool::new(outbox.is_none());
        self.replication = outbox;
        self
    }

    /// This process's name on the shared stream.
    pub fn replica_id(&self) -> u64 {
        self.replica_id
    }

    /// Whether to take traffic (`/readyz`): false while a replica replays the shared stream.
    pub fn is_ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The replay of the shared stream finished after `took`.
    pub fn set_replication_ready(&self, took: std::time::Duration) {
        self.telemetry.replication_caught_up(took);
        self.ready.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Ready without the shared stream: NATS stayed out of reach, and routing on this
    /// replica's own state beats every gateway failing open.
    pub fn set_ready_alone(&self) {
        self.ready.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The shared stream is out of reach: the log numbers its own entries again, under a new
    /// name (`scorer_core::sync::SyncLog::go_local`), so this replica's proxies keep seeing each
    /// other's decisions; they start over once.
    pub fn end_replication(&self) {
        let mut inner = self.inner.lock();
        inner.seed = xorshift64(inner.seed);
        let id = inner.seed;
        inner.sync.go_local(id);
    }

    /// From now on the log is numbered by the shared stream named `id`, from log number
    /// `first` (`scorer_core::sync::SyncLog::replicate`); copies synced before start over.
    pub fn begin_replication(&self, id: u64, first: u64) {
        let mut inner = self.inner.lock();
        inner.sync.replicate(id, first);
        self.forward(&mut inner);
    }

    /// Entries of the shared stream's message at `stream_seq`: each takes its place in the log,
    /// and unless this replica published them (`own`) the router applies them, as it applies a
    /// proxy's sync report. `age_ms` is how long ago the message was published (a replay after
    /// a restart reads old decisions, whose prefill is done). Returns how many entries were new
    /// to the log.
    pub fn apply_replicated(
        &self,
        own: bool,
        stream_seq: u64,
        events: Vec<SyncEvent>,
        age_ms: u64,
    ) -> usize {
        let now = self.now_ms();
        let mut inner = self.inner.lock();
        let Inner { router, sync, .. } = &mut *inner;
        let mut applied = 0;
        for (index, event) in events.into_iter().enumerate() {
            let seq = crate::replication::log_seq(stream_seq, index);
            if seq < sync.next_seq() {
                continue;
            }
            let event = event.aged(age_ms);
            if !own {
                event.apply_to(router, now);
            }
            if sync.push_replicated(seq, event, now) {
                applied += 1;
            }
        }
        self.note_state_changes(&mut inner);
        applied
    }

    /// Logs and counts, once each, the endpoint routing-state changes the router made
    /// ([`scorer_core::self_check`]): on outcomes, and on KV-event streams going down or live.
    fn note_state_changes(&self, inner: &mut Inner) {
        for (endpoint, change) in inner.router.take_state_changes() {
            tracing::warn!(
                endpoint,
                from = change.from.as_str(),
                to = change.to.as_str(),
                reason = change.reason.as_str(),
                delivered_share = change.delivered_share,
                outcomes = change.samples,
                "endpoint routing state changed"
            );
            self.telemetry.count_state_change(&endpoint, &change);
        }
    }

    /// Hands entries logged under `inner` to the replication task (replicated logs only);
    /// called before the lock is released, so they leave in the order they were logged. Every
    /// path that hands the router outcomes goes through here, so the state changes they made
    /// are noted too.
    fn forward(&self, inner: &mut Inner) {
        self.note_state_changes(inner);
        let Some(outbox) = &self.replication else {
            return;
        };
        let batch = inner.sync.take_outbox();
        if batch.is_empty() {
            return;
        }
        let n = batch.len();
        if outbox.try_send(batch).is_err() {
            self.telemetry.count_replication_dropped(n);
        }
    }

    /// Puts an admission gate in front of routing (the `admission:` section).
    pub fn with_admission(mut self, gate: Option<crate::admission::Gate>) -> Self {
        self.admission = gate.map(std::sync::Arc::new);
        self
    }

    /// Keeps an SLO window of outcomes for the autoscaling gauges (the `slo:` section).
    pub fn with_slo(mut self, window: Option<crate::slo::SloWindow>) -> Self {
        self.slo = window.map(|w| std::sync::Arc::new(Mutex::new(w)));
        self
    }

    /// Bounds the sync log to `log_entries` (the `sync:` section) and starts its replica tags
    /// at `first_replica` (see [`first_replica_tag`]). Call before serving: the log starts
    /// empty.
    pub fn with_sync(self, log_entries: usize, first_replica: u32) -> Self {
        self.inner.lock().sync = SyncLog::new(log_entries, first_replica);
        self
    }

    /// The admission gate, when configured (its metrics are registered from it).
    pub fn admission(&self) -> Option<&std::sync::Arc<crate::admission::Gate>> {
        self.admission.as_ref()
    }

    /// The SLO window, when configured (the SLO collector reads it).
    pub fn slo(&self) -> Option<&std::sync::Arc<Mutex<crate::slo::SloWindow>>> {
        self.slo.as_ref()
    }

    /// Sets the model names configuration gives `address` (its pool membership before, or
    /// without, `/v1/models` polling).
    pub fn set_configured_models(&self, address: &str, names: Vec<String>) {
        let mut catalogues = self.catalogues.lock();
        let c = catalogues.entry(address.to_string()).or_default();
        c.configured = names;
        self.publish_catalogue(address, c);
    }

    /// Records `address`'s `/v1/models` answer.
    pub fn set_polled_models(&self, address: &str, models: Vec<ServedModel>) {
        let mut catalogues = self.catalogues.lock();
        let c = catalogues.entry(address.to_string()).or_default();
        if c.polled.as_ref() == Some(&models) {
            return;
        }
        c.polled = Some(models);
        self.publish_catalogue(address, c);
    }

    fn publish_catalogue(&self, address: &str, c: &Catalogue) {
        if c.configured.is_empty() && c.polled.is_none() {
            return;
        }
        let merged = crate::pools::merge_catalogue(&c.configured, c.polled.as_deref());
        self.inner.lock().router.set_served_models(address, merged);
    }

    /// Records `address`'s LoRA adapters from its last scrape (`None`: the page had none).
    pub fn update_lora(&self, address: &str, lora: Option<LoraState>) {
        if let Some(lora) = lora {
            self.inner.lock().router.set_lora_state(address, lora);
        }
    }

    /// Model pools, sessions and adapters for `/metrics`.
    pub fn fleet_features(&self) -> FleetFeatures {
        let inner = self.inner.lock();
        let r = &inner.router;
        let (sessions, sessions_remembered) = r.session_stats();
        let endpoints = r
            .endpoints(self.now_ms())
            .into_iter()
            .map(|e| {
                let lora = r.lora_state(&e.address);
                let models = r.served_models(&e.address);
                EndpointFeatures {
                    models: models.map(<[_]>::len),
                    max_model_len: models
                        .and_then(|m| m.iter().filter_map(|m| m.max_model_len).max()),
                    lora_running: lora.map(|l| l.running.len()),
                    lora_waiting: lora.map(|l| l.waiting.len()),
                    max_lora: lora.map(|l| l.max_lora),
                    offload_blocks: r.offload_blocks(&e.address),
                    address: e.address,
                }
            })
            .collect();
        let stats = r.stats();
        FleetFeatures {
            sessions,
            sessions_remembered,
            session_return_share: r.session_return_share(),
            stored_responses: [
                ("pinned", stats.stored_response_pinned),
                ("unknown", stats.stored_response_unknown),
                ("unavailable", stats.stored_response_unavailable),
            ],
            stored_responses_remembered: r.stored_responses(),
            pools: r.pool_stats(),
            endpoints,
        }
    }

    /// Adds a discovered endpoint (idempotent): routable at once, scraped by its own loop.
    pub fn add_endpoint(&self, address: &str) -> Result<(), RouterError> {
        self.inner
            .lock()
            .router
            .upsert_endpoint(address)
            .map(|_| ())
    }

    /// Forgets an endpoint that discovery no longer reports: its router slot (prefix-index
    /// entries, in-flight requests, event-fed blocks) and its scrape and KV-stream status.
    pub fn remove_endpoint(&self, address: &str) {
        self.inner.lock().router.remove_endpoint(address);
        self.catalogues.lock().remove(address);
        self.scrapes.lock().remove(address);
        self.kv_streams.lock().remove(address);
    }

    /// Whether some proxy (or a peer replica) has reported which replica stored response `id`.
    pub fn knows_stored_response(&self, id: &str) -> bool {
        let now = self.now_ms();
        self.inner.lock().router.knows_stored_response(id, now)
    }

    /// Holds a route call that names a stored response neither it nor this replica knows of
    /// until the report arrives (from the proxy that served it, or a peer replica) or `wait`
    /// has passed; the caller then routes it as usual (pinned when known). A client can send
    /// a chain's next turn through another proxy the moment the answer arrives, before the
    /// serving proxy's report lands.
    pub async fn await_stored_response(&self, request: &RouteRequest, wait: Duration) {
        let Some(id) = request.previous_response_id.as_deref() else {
            return;
        };
        if wait.is_zero()
            || request.previous_response_endpoint.is_some()
            || self.knows_stored_response(id)
        {
            return;
        }
        let deadline = Instant::now() + wait;
        let found = loop {
            let now = Instant::now();
            if now >= deadline {
                break false;
            }
            tokio::time::sleep(STORED_RESPONSE_POLL.min(deadline - now)).await;
            if self.knows_stored_response(id) {
                break true;
            }
        };
        self.telemetry.count_stored_response_wait(found);
    }

    /// Milliseconds since this state was created (monotonic).
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The counters handlers and scrapers update.
    pub fn telemetry(&self) -> &Telemetry {
        &self.telemetry
    }

    /// Routes one request and remembers the decision for `/debug/decisions/{id}`.
    pub fn route(&self, request: &RouteRequest) -> RouteResponse {
        let now = self.now_ms();
        if let Some(gate) = &self.admission {
            // The router's light load view: no address strings or index counts per endpoint.
            let mut loads = Vec::new();
            self.inner
                .lock()
                .router
                .endpoint_loads(now, gate.reference_tokens(), &mut loads);
            if let Some(reject) = gate.decide(request, &loads, now).reject {
                self.telemetry.count_decision(&RouteReason::Rejected);
                return RouteResponse {
                    reason: RouteReason::Rejected,
                    reject: Some(reject),
                    ..RouteResponse::default()
                };
            }
        }
        let response = {
            let mut inner = self.inner.lock();
            inner.seed = xorshift64(inner.seed);
            let seed = inner.seed;
            let decision = inner.router.route(request, now, seed);
            let response = decision.response.clone();
            if let Some(endpoint) = response.endpoints.first() {
                let record = DecisionRecord {
                    decision_id: response.decision_id,
                    endpoint: endpoint.clone(),
                    request: replicable(request),
                    age_ms: 0,
                };
                inner.sync.push(
                    SyncEvent::Decision {
                        origin: 0,
                        record: Box::new(record),
                    },
                    now,
                );
                self.forward(&mut inner);
            }
            if inner.recent_cap > 0 {
                if inner.recent.len() >= inner.recent_cap {
                    inner.recent.pop_front();
                }
                inner.recent.push_back(decision);
            }
            response
        };
        self.telemetry.count_decision(&response.reason);
        response
    }

    /// Applies a batch of outcomes: releases in-flight load, records prediction accuracy.
    pub fn feedback(&self, batch: &FeedbackBatch) {
        let now = self.now_ms();
        {
            let mut inner = self.inner.lock();
            for outcome in &batch.outcomes {
                inner.router.feedback(outcome, now);
                inner.sync.push(
                    SyncEvent::Outcome {
                        origin: 0,
                        outcome: outcome.clone(),
                    },
                    now,
                );
            }
            self.forward(&mut inner);
        }
        if let Some(slo) = &self.slo {
            slo.lock().record(&batch.outcomes, now);
        }
        self.telemetry.count_feedback(batch.outcomes.len());
    }

    /// Streamed responses that sent their first token: each leaves its endpoint's measured
    /// queue, here and (through the log) in every copy.
    pub fn first_tokens(&self, reports: &[FirstToken]) {
        if reports.is_empty() {
            return;
        }
        let now = self.now_ms();
        let mut inner = self.inner.lock();
        for report in reports {
            inner
                .router
                .first_token(report.decision_id, now, report.ttft_ms);
            inner.sync.push(
                SyncEvent::FirstToken {
                    origin: 0,
                    decision_id: report.decision_id,
                    ttft_ms: report.ttft_ms,
                },
                now,
            );
        }
        self.forward(&mut inner);
    }

    /// Route calls their proxies stopped waiting for (they failed open): each decision taken
    /// for one is released, here and (through the log) in every copy; one not taken yet never
    /// will be. Returns how many were live decisions.
    pub fn withdraw(&self, call_ids: &[u64]) -> usize {
        if call_ids.is_empty() {
            return 0;
        }
        let now = self.now_ms();
        let mut inner = self.inner.lock();
        let mut released = 0;
        for &call in call_ids {
            if let Some(outcome) = inner.router.withdraw(call, now) {
                released += 1;
                inner
                    .sync
                    .push(SyncEvent::Outcome { origin: 0, outcome }, now);
            }
        }
        self.forward(&mut inner);
        released
    }

    /// A locally deciding proxy's sync tick: its decisions and outcomes enter the router and
    /// the log, and it gets back what it has not seen (`scorer_core::sync::serve_sync`). Its
    /// outcomes also feed the SLO window, as `/v1/feedback`'s do.
    ///
    /// A `since` beyond anything this log has issued comes from a copy of an earlier
    /// control-plane generation: patching it onto this log would skip entries, so the copy is
    /// treated as new (a fresh tag, hence a fresh router on its side, and the whole log).
    pub fn sync(&self, mut request: SyncRequest) -> SyncServed {
        let now = self.now_ms();
        for record in &mut request.decisions {
            record.request.prompt_text = None;
        }
        let outcomes =
            (!request.outcomes.is_empty() && self.slo.is_some()).then(|| request.outcomes.clone());
        let (decisions, outcome_count) = (request.decisions.len(), request.outcomes.len());
        let served = {
            let mut inner = self.inner.lock();
            let Inner { router, sync, .. } = &mut *inner;
            // A copy numbered by another log (another generation, or this replica before it
            // joined the shared stream) cannot be patched: it starts over. Copies too old to
            // name their log are judged by their sequence number alone.
            let foreign = request.replica.is_some()
                && if request.log != 0 {
                    request.log != sync.id()
                } else {
                    request.since > sync.next_seq()
                };
            if foreign {
                request.replica = None;
            }
            let response = serve_sync(sync, router, request, now);
            self.forward(&mut inner);
            SyncServed {
                reset: response.reset || foreign,
                response,
                decisions,
                outcomes: outcome_count,
            }
        };
        if let (Some(slo), Some(outcomes)) = (&self.slo, outcomes) {
            slo.lock().record(&outcomes, now);
        }
        served
    }

    /// Records a successful scrape of `address` (it becomes a candidate again). A change of its
    /// routing state the scrape shows (its engine's block size against the configured one) is
    /// logged and counted now.
    pub fn update_metrics(&self, address: &str, metrics: EndpointMetrics) {
        let now = self.now_ms();
        let mut inner = self.inner.lock();
        inner.router.update_metrics(address, metrics, now);
        self.note_state_changes(&mut inner);
    }

    /// Sets `address`'s prefill/decode role (from configuration).
    pub fn set_role(&self, address: &str, role: scorer_core::disagg::EndpointRole) {
        self.inner.lock().router.set_role(address, role);
    }

    /// Enough failed scrapes: stop routing to `address` until a scrape succeeds.
    pub fn mark_unreachable(&self, address: &str) {
        self.inner.lock().router.mark_unreachable(address);
    }

    /// Notes one scrape's result for `/debug/scrapes` (`error` is `None` on success).
    pub fn record_scrape(
        &self,
        address: &str,
        error: Option<String>,
        elapsed: std::time::Duration,
    ) {
        let now = self.now_ms();
        let mut scrapes = self.scrapes.lock();
        let status = endpoint_status(&mut scrapes, address);
        status.last_duration_ms = elapsed.as_secs_f64() * 1e3;
        match error {
            None => {
                status.successes += 1;
                status.consecutive_failures = 0;
                status.last_success_ms = Some(now);
                status.last_error = None;
            }
            Some(e) => {
                status.failures += 1;
                status.consecutive_failures = status.consecutive_failures.saturating_add(1);
                status.last_error = Some(e);
            }
        }
    }

    /// Every scraped endpoint's scrape status, by address.
    pub fn scrape_statuses(&self) -> Vec<ScrapeStatus> {
        self.scrapes.lock().values().cloned().collect()
    }

    /// Expires index and in-flight entries even while no requests arrive, and looks up the
    /// blocks served requests left in the KV-event index (a state change it makes is logged
    /// and counted now).
    pub fn expire(&self) {
        let now = self.now_ms();
        let mut inner = self.inner.lock();
        inner.router.expire(now);
        self.note_state_changes(&mut inner);
    }

    /// Marks `address`'s KV-event stream live (precise scoring trusts it) or down (its precise
    /// state is dropped and it is scored approximately). A change of its routing state
    /// (degraded, exact again) is logged and counted now, not with the next request.
    pub fn set_event_stream(&self, address: &str, live: bool) {
        let mut inner = self.inner.lock();
        inner.router.set_event_stream(address, live);
        self.note_state_changes(&mut inner);
    }

    /// `address`'s KV-event stream lost batches its replay socket could not fill: it is
    /// `degraded` (reason `kv_event_gap`, logged and counted now) until it runs clean.
    pub fn note_event_gap(&self, address: &str) {
        let mut inner = self.inner.lock();
        inner.router.note_event_gap(address);
        self.note_state_changes(&mut inner);
    }

    /// One of `address`'s KV-event batches arrived in sequence (it may end an outstanding gap:
    /// exact again, logged and counted now).
    pub fn note_event_batch_in_sequence(&self, address: &str) {
        let mut inner = self.inner.lock();
        inner.router.note_event_batch_in_sequence(address);
        self.note_state_changes(&mut inner);
    }

    /// Drops `address`'s precise state (publisher restart, unreplayable gap, bad message).
    pub fn clear_precise(&self, address: &str) {
        self.inner.lock().router.clear_precise(address);
    }

    /// Applies one batch of `address`'s KV events under one lock. `partial` says whether the
    /// view already misses history; it becomes true when an error drops the state, and false
    /// after `AllBlocksCleared` (an empty cache is an exactly known one). `other_group_stores`
    /// counts the batch's stores of KV-cache groups the decoder skipped: with the batch's own
    /// stores they feed the `event_groups` check (a state change is logged and counted now).
    pub fn apply_kv_batch(
        &self,
        address: &str,
        model: &str,
        events: &[KvEvent],
        other_group_stores: u32,
        partial: &mut bool,
    ) -> BatchApplied {
        let now = self.now_ms();
        let mut out = BatchApplied::default();
        let mut new_loras = Vec::new();
        {
            let mut inner = self.inner.lock();
            let mut usable_stores = 0u32;
            for event in events {
                let result = if *partial {
                    inner
                        .router
                        .apply_kv_event_partial(address, model, event, now)
                } else {
                    inner.router.apply_kv_event(address, model, event, now)
                };
                match result {
                    Ok(()) => out.applied += 1,
                    Err(ApplyError::UnknownParent(_)) if *partial => out.unknown_parents += 1,
                    Err(e) => {
                        *partial = true;
                        out.dropped = Some(e);
                    }
                }
                match event {
                    KvEvent::AllBlocksCleared => *partial = false,
                    KvEvent::BlockStored { lora_name, .. } => {
                        usable_stores = usable_stores.saturating_add(1);
                        new_loras.extend(lora_name);
                    }
                    _ => {}
                }
            }
            inner
                .router
                .note_event_groups(address, usable_stores, other_group_stores);
            self.note_state_changes(&mut inner);
        }
        if !new_loras.is_empty() {
            let mut loras = self.loras.lock();
            for l in new_loras {
                if loras.len() < MAX_LORAS && !loras.contains(l.as_str()) {
                    loras.insert(l.clone());
                }
            }
        }
        out
    }

    /// Whether KV events have named `model` as a LoRA adapter.
    pub fn is_known_lora(&self, model: &str) -> bool {
        self.loras.lock().contains(model)
    }

    /// Updates `address`'s KV-stream status with `f` (created on first use).
    pub fn kv_stream<R>(&self, address: &str, f: impl FnOnce(&mut KvStreamStatus) -> R) -> R {
        let mut streams = self.kv_streams.lock();
        f(endpoint_status(&mut streams, address))
    }

    /// Whether any endpoint's KV-event stream is connected (else precise scoring cannot help,
    /// and tokenising a precise route's prompt would be wasted work).
    pub fn any_event_stream(&self) -> bool {
        self.kv_streams.lock().values().any(|s| s.connected)
    }

    /// Every subscribed endpoint's KV-stream status, by address.
    pub fn kv_streams(&self) -> Vec<KvStreamStatus> {
        self.kv_streams.lock().values().cloned().collect()
    }

    /// Every endpoint's current view.
    pub fn endpoints(&self) -> Vec<EndpointView> {
        let now = self.now_ms();
        self.inner.lock().router.endpoints(now)
    }

    /// The recent outcomes whose engine delivered least of what the index believed, worst
    /// first (`/debug/mismatch`): where the router's and the engine's view of a prompt part.
    pub fn mismatches(&self) -> Vec<MismatchRecord> {
        self.inner.lock().router.mismatches()
    }

    /// A recent decision by id, with its candidate breakdown.
    pub fn decision(&self, id: u64) -> Option<Decision> {
        let inner = self.inner.lock();
        let i = inner
            .recent
            .binary_search_by_key(&id, |d| d.response.decision_id)
            .ok()?;
        inner.recent.get(i).cloned()
    }

    /// The most recent decisions' responses, newest first (at most `limit`).
    pub fn recent_decisions(&self, limit: usize) -> Vec<RouteResponse> {
        let inner = self.inner.lock();
        inner
            .recent
            .iter()
            .rev()
            .take(limit)
            .map(|d| d.response.clone())
            .collect()
    }

    /// Everything `/metrics` reports about the router, taken under one lock.
    pub fn snapshot(&self) -> Snapshot {
        let now = self.now_ms();
        let inner = self.inner.lock();
        let r = &inner.router;
        Snapshot {
            endpoints: r.endpoints(now),
            stats: r.stats(),
            inflight: r.inflight_len(),
            index_blocks: r.index().distinct_blocks(),
            index_bytes: r.index().approx_bytes(),
            bytes_per_token: r.bytes_per_token(),
            agent_output_tokens: r.agent_output_tokens(),
            sync_log_entries: inner.sync.len(),
            pools: r.pool_reuse(),
        }
    }
}

/// `request` as the sync log keeps it: hashes and numbers only. A precise route's prompt text
/// stays here; it must not be copied to every proxy (its token-block hashes are).
///
/// Destructured field by field, without `..`: a field added to `RouteRequest` fails to compile
/// here until someone decides whether it may be replicated.
fn replicable(request: &RouteRequest) -> RouteRequest {
    let RouteRequest {
        model,
        block_hashes,
        prompt_bytes,
        prompt_tokens,
        marked_blocks: _,
        max_output_tokens,
        session,
        token_block_hashes,
        prompt_text: _,
        api,
        cache_salt,
        tenant,
        criticality,
        previous_response_id: _,
        previous_response_endpoint: _,
        call_id,
        finished: _,
        first_tokens: _,
        stream,
    } = request;
    RouteRequest {
        model: model.clone(),
        block_hashes: block_hashes.clone(),
        prompt_bytes: *prompt_bytes,
        prompt_tokens: *prompt_tokens,
        // The marked prefix steered the ranking of the router that took the decision; copies
        // only account it.
        marked_blocks: 0,
        max_output_tokens: *max_output_tokens,
        session: session.clone(),
        token_block_hashes: token_block_hashes.clone(),
        prompt_text: None,
        api: *api,
        cache_salt: cache_salt.clone(),
        tenant: tenant.clone(),
        criticality: criticality.clone(),
        // Copies learn stored responses from outcomes (`Outcome::response_id`); a decision's
        // pin was already applied by the router that took it.
        previous_response_id: None,
        previous_response_endpoint: None,
        // A peer replica may receive the withdrawal of this call.
        call_id: *call_id,
        // Outcomes and first tokens travel as log entries of their own.
        finished: Vec::new(),
        first_tokens: Vec::new(),
        // Copies count a streamed request in the measured queue until its first token.
        stream: *stream,
    }
}

/// Marsaglia's xorshift64: a cheap per-decision seed for tie-breaking, not for secrets.
fn xorshift64(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

#[cfg(test)]
mod tests {
    use scorer_core::protocol::Outcome;
    use scorer_core::router::Health;

    use super::*;

    fn state(history: usize) -> State {
        let eps = vec!["10.0.0.1:8000".to_string(), "10.0.0.2:8000".to_string()];
        State::new(RouterConfig::default(), &eps, history, 100).unwrap()
    }

    #[test]
    fn decisions_are_kept_in_a_bounded_ring() {
        let s = state(3);
        let ids: Vec<u64> = (0..5)
            .map(|i| {
                let req = RouteRequest {
                    model: "m".into(),
                    block_hashes: vec![i],
                    prompt_tokens: 10,
                    ..Default::default()
                };
                s.route(&req).decision_id
            })
            .collect();
        assert_eq!(ids, vec![100, 101, 102, 103, 104]);
        assert!(s.decision(101).is_none());
        let d = s.decision(103).unwrap();
        assert_eq!(d.candidates.len(), 2);
        assert_eq!(
            s.recent_decisions(10)
                .iter()
                .map(|r| r.decision_id)
                .collect::<Vec<_>>(),
            vec![104, 103, 102]
        );
        assert!(state(0).decision(100).is_none());
    }

    #[test]
    fn feedback_releases_inflight() {
        let s = state(8);
        let r = s.route(&RouteRequest {
            model: "m".into(),
            prompt_tokens: 5,
            ..Default::default()
        });
        assert_eq!(s.snapshot().inflight, 1);
        s.feedback(&FeedbackBatch {
            outcomes: vec![Outcome {
                decision_id: r.decision_id,
                ..Default::default()
            }],
            ..Default::default()
        });
        assert_eq!(s.snapshot().inflight, 0);
    }

    #[test]
    fn unreachable_endpoints_are_skipped_until_scraped_again() {
        let s = state(0);
        s.mark_unreachable("10.0.0.1:8000");
        let req = RouteRequest {
            model: "m".into(),
            prompt_tokens: 5,
            ..Default::default()
        };
        assert_eq!(s.route(&req).endpoints, vec!["10.0.0.2:8000".to_string()]);
        s.update_metrics("10.0.0.1:8000", EndpointMetrics::default());
        assert_eq!(s.route(&req).endpoints.len(), 2);
        assert!(s.endpoints().iter().all(|e| e.health == Health::Ready));
    }

    fn sync_events(s: &State, replica: u32, since: u64) -> (Vec<SyncEvent>, u64) {
        let r = s
            .sync(SyncRequest {
                replica: Some(replica),
                since,
                ..Default::default()
            })
            .response;
        (r.events, r.next)
    }

    #[test]
    fn route_decisions_enter_the_log_without_prompt_text() {
        let s = state(0);
        let me = s.sync(SyncRequest::default()).response;
        let response = s.route(&RouteRequest {
            model: "m".into(),
            block_hashes: vec![1, 2],
            prompt_tokens: 10,
            prompt_text: Some("{\"messages\":\"secret\"}".into()),
            token_block_hashes: vec![7],
            ..Default::default()
        });
        let (events, next) = sync_events(&s, me.replica, me.next);
        let [SyncEvent::Decision { origin: 0, record }] = events.as_slice() else {
            panic!("expected one decision of the control plane's, got {events:?}");
        };
        assert_eq!(record.decision_id, response.decision_id);
        assert_eq!(record.endpoint, response.endpoints[0]);
        assert_eq!(record.request.block_hashes, vec![1, 2]);
        assert_eq!(record.request.token_block_hashes, vec![7]);
        assert_eq!(record.request.prompt_text, None);
        assert_eq!(next, me.next + 1);
        assert_eq!(s.snapshot().sync_log_entries, 1);
    }

    #[test]
    fn decisions_without_an_endpoint_are_not_logged() {
        let s = State::new(RouterConfig::default(), &[], 0, 1).unwrap();
        let r = s.route(&RouteRequest {
            model: "m".into(),
            ..Default::default()
        });
        assert!(r.endpoints.is_empty());
        assert_eq!(s.snapshot().sync_log_entries, 0);
    }

    #[test]
    fn feedback_outcomes_enter_the_log() {
        let s = state(0);
        let outcome = Outcome {
            decision_id: 42,
            endpoint: "10.0.0.1:8000".into(),
            status: 200,
            ..Default::default()
        };
        s.feedback(&FeedbackBatch {
            outcomes: vec![outcome.clone()],
            ..Default::default()
        });
        let (events, _) = sync_events(&s, 5, 0);
        assert_eq!(events, vec![SyncEvent::Outcome { origin: 0, outcome }]);
    }

    #[test]
    fn a_proxys_decision_is_load_here_and_news_to_other_proxies() {
        let s = state(0);
        let a = s.sync(SyncRequest::default()).response;
        let b = s.sync(SyncRequest::default()).response;
        assert_ne!(a.replica, b.replica);
        assert_eq!(a.endpoints.len(), 2);
        let record = DecisionRecord {
            decision_id: (u64::from(a.replica) << REPLICA_SHIFT) + 1,
            endpoint: "10.0.0.2:8000".into(),
            request: RouteRequest {
                model: "m".into(),
                block_hashes: vec![9],
                prompt_tokens: 10,
                prompt_text: Some("not for replication".into()),
                ..Default::default()
            },
            age_ms: 0,
        };
        let served = s.sync(SyncRequest {
            replica: Some(a.replica),
            since: a.next,
            log: a.log,
            decisions: vec![record.clone()],
            ..SyncRequest::default()
        });
        assert_eq!((served.decisions, served.reset), (1, false));
        assert!(
            served.response.events.is_empty(),
            "its own decision is not echoed"
        );
        assert_eq!(s.snapshot().inflight, 1);
        let (events, _) = sync_events(&s, b.replica, b.next);
        let [
            SyncEvent::Decision {
                origin,
                record: seen,
            },
        ] = events.as_slice()
        else {
            panic!("{events:?}");
        };
        assert_eq!(*origin, a.replica);
        assert_eq!(seen.request.prompt_text, None);
        assert_eq!(seen.decision_id, record.decision_id);
    }

    #[test]
    fn sync_outcomes_feed_the_slo_window() {
        let s = state(0).with_slo(Some(crate::slo::SloWindow::new(
            crate::slo::SloConfig::default(),
            Default::default(),
        )));
        let me = s.sync(SyncRequest::default()).response;
        let outcome = Outcome {
            decision_id: 1,
            endpoint: "10.0.0.1:8000".into(),
            status: 200,
            ttfb_ms: Some(10),
            total_ms: 20,
            ..Default::default()
        };
        let served = s.sync(SyncRequest {
            replica: Some(me.replica),
            since: me.next,
            outcomes: vec![outcome],
            ..Default::default()
        });
        assert_eq!(served.outcomes, 1);
        let now = s.now_ms();
        let signals = s.slo().unwrap().lock().signals(&BTreeMap::new(), now);
        assert_eq!(signals["default"].ttft_samples, 1, "{signals:?}");
    }

    #[test]
    fn a_copy_from_another_generation_starts_over() {
        let s = state(0);
        s.route(&RouteRequest {
            model: "m".into(),
            ..Default::default()
        });
        let served = s.sync(SyncRequest {
            replica: Some(77),
            since: 1_000_000,
            ..Default::default()
        });
        assert!(served.reset);
        assert_ne!(served.response.replica, 77);
        assert_eq!(served.response.events.len(), 1, "the whole log");
    }

    #[test]
    fn the_log_is_bounded_and_a_lagging_copy_resets() {
        let s = state(0).with_sync(2, 1 << 20);
        let me = s.sync(SyncRequest::default()).response;
        assert_eq!(me.replica, 1 << 20);
        for i in 0..3 {
            s.route(&RouteRequest {
                model: "m".into(),
                block_hashes: vec![i],
                ..Default::default()
            });
        }
        assert_eq!(s.snapshot().sync_log_entries, 2);
        let served = s.sync(SyncRequest {
            replica: Some(me.replica),
            since: me.next,
            ..Default::default()
        });
        assert!(served.reset && served.response.reset);
        assert_eq!(served.response.events.len(), 2);
    }

    #[test]
    fn replica_tags_avoid_the_control_planes_ids_and_fit_a_decision_id() {
        // Wall-clock microseconds now and in a century: the control plane's own id space.
        let own = [
            1_750_000_000_000_000u64 >> REPLICA_SHIFT,
            4_900_000_000_000_000 >> REPLICA_SHIFT,
        ];
        for entropy in [0, 1, 2, u64::MAX, 1_750_000_000_123_456_789] {
            let tag = first_replica_tag(entropy);
            assert!((MIN_REPLICA_TAG..MAX_REPLICA_TAG - REPLICA_TAG_HEADROOM).contains(&tag));
            assert!(own.iter().all(|&o| o < u64::from(MIN_REPLICA_TAG)));
            let id = (u64::from(tag + REPLICA_TAG_HEADROOM) << REPLICA_SHIFT) >> REPLICA_SHIFT;
            assert_eq!(id, u64::from(tag + REPLICA_TAG_HEADROOM), "no bits lost");
        }
        assert_ne!(first_replica_tag(1), first_replica_tag(2));
    }

    // Two replicas sharing a stream: what one logs reaches the other's router and log under
    // the stream's numbers, its own entries come back to its log without being applied twice,
    // and a proxy may sync with either.
    #[test]
    fn replicas_sharing_a_stream_hold_the_same_log_and_load() {
        let (tx_a, mut out_a) = crate::replication::outbox();
        let (tx_b, _out_b) = crate::replication::outbox();
        let a = state(0).with_replication(Some(tx_a));
        let b = state(0).with_replication(Some(tx_b));
        assert!(!a.is_ready(), "not ready before the stream is replayed");
        for s in [&a, &b] {
            s.begin_replication(77, crate::replication::log_seq(1, 0));
            s.set_replication_ready(std::time::Duration::from_millis(3));
            assert!(s.is_ready());
        }
        let decision = a.route(&RouteRequest {
            model: "m".into(),
            block_hashes: vec![1, 2, 3],
            prompt_tokens: 100,
            ..Default::default()
        });
        let batch = out_a.try_recv().expect("the decision left for the stream");
        assert_eq!(batch.len(), 1);
        assert_eq!(
            a.snapshot().sync_log_entries,
            0,
            "numbered by the stream, not yet back"
        );
        // The stream hands message 1 to both replicas.
        assert_eq!(a.apply_replicated(true, 1, batch.clone(), 0), 1);
        assert_eq!(b.apply_replicated(false, 1, batch.clone(), 0), 1);
        assert_eq!(
            b.apply_replicated(false, 1, batch, 0),
            0,
            "a redelivery changes nothing"
        );
        assert_eq!((a.snapshot().inflight, b.snapshot().inflight), (1, 1));
        assert_eq!(b.snapshot().index_blocks, 3);
        // A proxy that synced with a gets the same entries from b, and no reset.
        let first = a.sync(SyncRequest::default()).response;
        assert_eq!(first.log, 77);
        assert_eq!(first.events.len(), 1);
        let from_b = b
            .sync(SyncRequest {
                replica: Some(first.replica),
                since: first.next,
                log: first.log,
                ..Default::default()
            })
            .response;
        assert!(!from_b.reset && from_b.events.is_empty());
        assert_eq!(from_b.next, first.next);
        // The outcome, reported to b, releases the load on both.
        b.feedback(&FeedbackBatch {
            outcomes: vec![Outcome {
                decision_id: decision.decision_id,
                endpoint: decision.endpoints[0].clone(),
                status: 200,
                ..Default::default()
            }],
            ..Default::default()
        });
        assert_eq!(b.snapshot().inflight, 0);
        let (tx, mut out_b) = crate::replication::outbox();
        let b = b.with_replication(Some(tx));
        b.feedback(&FeedbackBatch::default());
        assert!(out_b.try_recv().is_err(), "an empty batch sends nothing");
    }

    #[test]
    fn xorshift_never_sticks_at_zero() {
        let mut x = 1;
        for _ in 0..1000 {
            x = xorshift64(x);
            assert_ne!(x, 0);
        }
    }
}
