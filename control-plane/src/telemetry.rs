//! What the control plane tells Prometheus about itself.
//!
//! Two sources: event counters the handlers bump as things happen ([`Telemetry`]), and a
//! collector that reads the router's state at scrape time ([`registry`]), so gauges are never
//! out of sync with the router and need no background updater.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use scorer_core::disagg::EndpointRole;
use scorer_core::protocol::RouteReason;
use scorer_core::reuse::{GapReason, ReuseTotals};
use scorer_core::router::{EndpointView, Health};
use scorer_core::self_check::StateChange;

use crate::state::State;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RejectLabels {
    path: &'static str,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScrapeLabels {
    endpoint: String,
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabels {
    endpoint: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointReasonLabels {
    endpoint: String,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenizeLabels {
    backend: &'static str,
    result: &'static str,
}

/// An endpoint's routing-state change ([`scorer_core::self_check`]): the state entered and why.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateChangeLabels {
    endpoint: String,
    to: &'static str,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenSourceLabels {
    backend: &'static str,
    source: &'static str,
}

/// Event counters; cheap to bump from any task (all handles are atomics behind `Arc`s).
#[derive(Debug, Clone)]
pub struct Telemetry {
    decisions: Family<ReasonLabels, Counter>,
    route_seconds: Histogram,
    rejected: Family<RejectLabels, Counter>,
    feedback_batches: Counter,
    feedback_outcomes: Counter,
    scrapes: Family<ScrapeLabels, Counter>,
    scrape_seconds: Histogram,
    kv_batches: Family<EndpointLabels, Counter>,
    kv_applied: Family<EndpointLabels, Counter>,
    kv_skipped: Family<EndpointReasonLabels, Counter>,
    kv_decode_errors: Family<EndpointLabels, Counter>,
    kv_gaps: Family<EndpointLabels, Counter>,
    kv_replays: Family<ScrapeLabels, Counter>,
    kv_resets: Family<EndpointReasonLabels, Counter>,
    kv_lag_seconds: Histogram,
    tokenize: Family<TokenizeLabels, Counter>,
    tokenize_seconds: Histogram,
    tokenize_tokens: Family<TokenSourceLabels, Counter>,
    precise_routes: Family<ReasonLabels, Counter>,
    stored_response_waits: Family<ReasonLabels, Counter>,
    sync_calls: Counter,
    sync_decisions: Counter,
    sync_resets: Counter,
    sync_full_tables: Counter,
    routing_state_changes: Family<StateChangeLabels, Counter>,
    replication_published: Counter,
    replication_applied: Counter,
    replication_dropped: Counter,
    replication_connected: Gauge,
    replication_catch_up_seconds: Gauge<f64, AtomicU64>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self {
            decisions: Family::default(),
            // 5 µs .. ~80 ms: the route handler should live in the first few buckets.
            route_seconds: Histogram::new(exponential_buckets(5e-6, 2.0, 15)),
            rejected: Family::default(),
            feedback_batches: Counter::default(),
            feedback_outcomes: Counter::default(),
            scrapes: Family::default(),
            // 100 µs .. ~3 s.
            scrape_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 15)),
            kv_batches: Family::default(),
            kv_applied: Family::default(),
            kv_skipped: Family::default(),
            kv_decode_errors: Family::default(),
            kv_gaps: Family::default(),
            kv_replays: Family::default(),
            kv_resets: Family::default(),
            // 100 µs .. ~3 s (engine clock to arrival, skew included).
            kv_lag_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 15)),
            tokenize: Family::default(),
            // 10 µs .. ~160 ms.
            tokenize_seconds: Histogram::new(exponential_buckets(1e-5, 2.0, 15)),
            tokenize_tokens: Family::default(),
            precise_routes: Family::default(),
            stored_response_waits: Family::default(),
            sync_calls: Counter::default(),
            sync_decisions: Counter::default(),
            sync_resets: Counter::default(),
            sync_full_tables: Counter::default(),
            routing_state_changes: Family::default(),
            replication_published: Counter::default(),
            replication_applied: Counter::default(),
            replication_dropped: Counter::default(),
            replication_connected: Gauge::default(),
            replication_catch_up_seconds: Gauge::default(),
        }
    }
}

impl Telemetry {
    /// One routing decision with its reason, labelled with its wire spelling (`prefix`,
    /// `load`, `guard`, `no_endpoint`, `rejected`, ...).
    pub fn count_decision(&self, reason: &RouteReason) {
        self.decisions
            .get_or_create(&ReasonLabels {
                reason: reason.as_str().to_string(),
            })
            .inc();
    }

    /// Time spent in the route handler after the body was read.
    pub fn observe_route(&self, elapsed: Duration) {
        self.route_seconds.observe(elapsed.as_secs_f64());
    }

    /// A request the API refused (`unauthorized`, `bad_request`, `too_large`, `timeout`, ...).
    pub fn count_rejected(&self, path: &'static str, reason: &'static str) {
        self.rejected
            .get_or_create(&RejectLabels { path, reason })
            .inc();
    }

    /// One feedback batch of `outcomes` outcomes.
    pub fn count_feedback(&self, outcomes: usize) {
        self.feedback_batches.inc();
        self.feedback_outcomes.inc_by(outcomes as u64);
    }

    /// One sync call of a locally deciding proxy that reported `decisions` decisions and
    /// `outcomes` outcomes, whether its copy had to start over, and whether the answer carried
    /// the whole endpoint table rather than its changes. Its outcomes count with feedback's
    /// (`feedback_outcomes`): one outcome total, however it arrived.
    pub fn count_sync(&self, decisions: usize, outcomes: usize, reset: bool, full_table: bool) {
        self.sync_calls.inc();
        self.sync_decisions.inc_by(decisions as u64);
        self.feedback_outcomes.inc_by(outcomes as u64);
        if reset {
            self.sync_resets.inc();
        }
        if full_table {
            self.sync_full_tables.inc();
        }
    }

    /// Entries this replica published to the shared stream.
    pub fn count_replication_published(&self, events: usize) {
        self.replication_published.inc_by(events as u64);
    }

    /// Entries of the shared stream that entered this replica's log.
    pub fn count_replication_applied(&self, events: usize) {
        self.replication_applied.inc_by(events as u64);
    }

    /// An endpoint's routing state changed (load-only on a mismatch, degraded without a live
    /// KV-event stream or with another block size, or back to exact).
    pub fn count_state_change(&self, endpoint: &str, change: &StateChange) {
        self.routing_state_changes
            .get_or_create(&StateChangeLabels {
                endpoint: endpoint.to_string(),
                to: change.to.as_str(),
                reason: change.reason.as_str(),
            })
            .inc();
    }

    /// Entries that never reached the shared stream (outbox full, too large, unreadable).
    pub fn count_replication_dropped(&self, events: usize) {
        self.replication_dropped.inc_by(events as u64);
    }

    /// Whether a NATS session is up.
    pub fn replication_connected(&self, up: bool) {
        self.replication_connected.set(i64::from(up));
    }

    /// How long the last replay of the shared stream took.
    pub fn replication_caught_up(&self, took: Duration) {
        self.replication_catch_up_seconds.set(took.as_secs_f64());
    }

    /// One scrape of `endpoint` ending in `result` (`ok` or an error kind).
    pub fn count_scrape(&self, endpoint: &str, result: &'static str, elapsed: Duration) {
        self.scrapes
            .get_or_create(&ScrapeLabels {
                endpoint: endpoint.to_string(),
                result,
            })
            .inc();
        self.scrape_seconds.observe(elapsed.as_secs_f64());
    }

    /// One KV-event batch of `endpoint` applied: `applied` events, `unknown_parents` stores
    /// skipped in a partial view, and what the decoder skipped.
    pub fn count_kv_batch(
        &self,
        endpoint: &str,
        applied: usize,
        unknown_parents: usize,
        skipped: &vllm_wire::kv_events::Skipped,
    ) {
        let e = EndpointLabels {
            endpoint: endpoint.to_string(),
        };
        self.kv_batches.get_or_create(&e).inc();
        self.kv_applied.get_or_create(&e).inc_by(applied as u64);
        for (reason, n) in [
            ("unknown_parent", unknown_parents as u64),
            ("other_group", u64::from(skipped.other_groups)),
            ("unknown_type", u64::from(skipped.unknown_types)),
        ] {
            if n > 0 {
                self.kv_skipped
                    .get_or_create(&EndpointReasonLabels {
                        endpoint: endpoint.to_string(),
                        reason,
                    })
                    .inc_by(n);
            }
        }
    }

    /// A KV-event message of `endpoint` that did not decode.
    pub fn count_kv_decode_error(&self, endpoint: &str) {
        self.kv_decode_errors
            .get_or_create(&EndpointLabels {
                endpoint: endpoint.to_string(),
            })
            .inc();
    }

    /// A sequence gap in `endpoint`'s KV events.
    pub fn count_kv_gap(&self, endpoint: &str) {
        self.kv_gaps
            .get_or_create(&EndpointLabels {
                endpoint: endpoint.to_string(),
            })
            .inc();
    }

    /// A replay request to `endpoint`'s publisher ending in `result` (`ok` or `failed`).
    pub fn count_kv_replay(&self, endpoint: &str, result: &'static str) {
        self.kv_replays
            .get_or_create(&ScrapeLabels {
                endpoint: endpoint.to_string(),
                result,
            })
            .inc();
    }

    /// `endpoint`'s precise state was dropped for `reason` (`restart`, `unreplayable_gap`,
    /// `decode_error`, `apply_error`, `disconnect`).
    pub fn count_kv_reset(&self, endpoint: &str, reason: &'static str) {
        self.kv_resets
            .get_or_create(&EndpointReasonLabels {
                endpoint: endpoint.to_string(),
                reason,
            })
            .inc();
    }

    /// Engine timestamp to arrival of a live KV-event batch.
    pub fn observe_kv_lag(&self, _endpoint: &str, seconds: f64) {
        self.kv_lag_seconds.observe(seconds.max(0.0));
    }

    /// One tokenisation by `backend` (`remote`, `hf`) ending in `result` (`ok`, `error`), with
    /// its duration and how many tokens came from the prefix cache versus fresh work.
    pub fn observe_tokenize(
        &self,
        backend: &'static str,
        result: &'static str,
        elapsed: Duration,
        cached_tokens: usize,
        fresh_tokens: usize,
    ) {
        self.tokenize
            .get_or_create(&TokenizeLabels { backend, result })
            .inc();
        self.tokenize_seconds.observe(elapsed.as_secs_f64());
        for (source, n) in [("cached", cached_tokens), ("fresh", fresh_tokens)] {
            if n > 0 {
                self.tokenize_tokens
                    .get_or_create(&TokenSourceLabels { backend, source })
                    .inc_by(n as u64);
            }
        }
    }

    /// A route call that waited for a stored response's report, by how the wait ended.
    pub fn count_stored_response_wait(&self, found: bool) {
        let reason = if found { "reported" } else { "timeout" };
        self.stored_response_waits
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// A route request that asked for precise mode, by how it was scored (`precise`, or the
    /// reason it fell back to approximate).
    pub fn count_precise_route(&self, how: &str) {
        self.precise_routes
            .get_or_create(&ReasonLabels {
                reason: how.to_string(),
            })
            .inc();
    }
}

/// The `/metrics` registry: event counters plus a live view of `state`, prefixed `kvroute_`.
pub fn registry(state: Arc<State>) -> Registry {
    let mut r = Registry::with_prefix("kvroute");
    let t = state.telemetry().clone();
    r.register("decisions", "Routing decisions by reason", t.decisions);
    r.register(
        "route_duration_seconds",
        "Route handler time after the body is read",
        t.route_seconds,
    );
    r.register(
        "rejected_requests",
        "API requests refused, by path and reason",
        t.rejected,
    );
    r.register(
        "feedback_batches",
        "Feedback batches received",
        t.feedback_batches,
    );
    r.register(
        "feedback_outcomes",
        "Request outcomes received, in feedback batches or sync calls",
        t.feedback_outcomes,
    );
    r.register(
        "sync_calls",
        "Sync calls from proxies deciding locally",
        t.sync_calls,
    );
    r.register(
        "sync_decisions",
        "Decisions proxies took locally, reported in sync calls",
        t.sync_decisions,
    );
    r.register(
        "sync_resets",
        "Sync calls whose proxy had to start over (too far behind the log, or a new generation)",
        t.sync_resets,
    );
    r.register(
        "sync_full_tables",
        "Sync answers that carried the whole endpoint table (a copy's first, another control \
         plane's copy, or one too far behind the table's changes) instead of what changed",
        t.sync_full_tables,
    );
    r.register(
        "replication_published_events",
        "Log entries this replica published to the shared NATS stream",
        t.replication_published,
    );
    r.register(
        "replication_applied_events",
        "Entries of the shared NATS stream that entered this replica's log",
        t.replication_applied,
    );
    r.register(
        "routing_state_changes",
        "Endpoint routing-state changes: `to` load-only when the engine delivered almost none of \
         the cache hits the index believed in (reason mismatch), degraded while its KV-event \
         stream is down (no_kv_events), its engine's block_size differs from the configured \
         one (block_size), its stream lost batches no replay filled and has not run clean since \
         (kv_event_gap), its events store only KV-cache groups the index cannot use \
         (event_groups), its events do not hold the blocks the router hashed for the \
         requests it served (hash_mismatch), or its engine counts prompts in other tokens \
         than its pool (bytes_per_token), back to exact when that ends",
        t.routing_state_changes,
    );
    r.register(
        "replication_dropped_events",
        "Log entries that never reached the shared stream (outbox full, too large, unreadable)",
        t.replication_dropped,
    );
    r.register(
        "replication_connected",
        "1 while a NATS session is up (replication configured)",
        t.replication_connected,
    );
    r.register(
        "replication_catch_up_seconds",
        "How long this replica's last replay of the shared stream took",
        t.replication_catch_up_seconds,
    );
    r.register("scrapes", "Endpoint /metrics scrapes by result", t.scrapes);
    r.register(
        "scrape_duration_seconds",
        "Endpoint /metrics scrape time",
        t.scrape_seconds,
    );
    r.register(
        "kv_event_batches",
        "KV-event batches applied, by endpoint",
        t.kv_batches,
    );
    r.register(
        "kv_events_applied",
        "KV events applied to the precise index, by endpoint",
        t.kv_applied,
    );
    r.register(
        "kv_events_skipped",
        "KV events skipped: other KV groups, unknown types, stores whose parent precedes a partial view",
        t.kv_skipped,
    );
    r.register(
        "kv_event_decode_errors",
        "KV-event messages that did not decode (the endpoint's state was dropped)",
        t.kv_decode_errors,
    );
    r.register(
        "kv_event_gaps",
        "Sequence gaps in an endpoint's KV events",
        t.kv_gaps,
    );
    r.register(
        "kv_event_replays",
        "Replay requests to an endpoint's publisher, by result",
        t.kv_replays,
    );
    r.register(
        "kv_event_resets",
        "Times an endpoint's precise state was dropped, by reason",
        t.kv_resets,
    );
    r.register(
        "kv_event_lag_seconds",
        "Engine timestamp to arrival of live KV-event batches",
        t.kv_lag_seconds,
    );
    r.register(
        "tokenizations",
        "Prompt tokenisations for precise routes, by backend and result",
        t.tokenize,
    );
    r.register(
        "tokenize_duration_seconds",
        "Time to tokenise one precise route's prompt",
        t.tokenize_seconds,
    );
    r.register(
        "tokenized_tokens",
        "Prompt tokens of precise routes, by backend and source (prefix cache or fresh)",
        t.tokenize_tokens,
    );
    r.register(
        "precise_routes",
        "Route requests that asked for precise mode, by how they were scored",
        t.precise_routes,
    );
    r.register(
        "stored_response_waits",
        "Route calls that waited for the report of the stored response they name, by how the \
         wait ended (reported, timeout)",
        t.stored_response_waits,
    );
    r.register_collector(Box::new(crate::pools::FleetFeaturesCollector(
        state.clone(),
    )));
    r.register_collector(Box::new(RouterCollector(state)));
    r
}

/// Reads the router under its lock once per `/metrics` request.
#[derive(Debug)]
struct RouterCollector(Arc<State>);

impl Collector for RouterCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let snap = self.0.snapshot();
        let s = snap.stats;
        let counters: [(&str, &str, u64); 10] = [
            (
                "kv_events",
                "KV events applied to the precise index",
                s.kv_events,
            ),
            (
                "kv_event_errors",
                "KV events that could not be applied (the endpoint's precise state was dropped)",
                s.kv_event_errors,
            ),
            (
                "no_endpoint_decisions",
                "Decisions with no usable endpoint (the filter failed open)",
                s.no_endpoint,
            ),
            (
                "guarded_decisions",
                "Decisions where the guard or the wait cap skipped the cheapest endpoint",
                s.guarded,
            ),
            (
                "expired_inflight",
                "In-flight entries that expired without feedback",
                s.expired_inflight,
            ),
            (
                "first_tokens",
                "First-token reports of streamed responses (their prefill left the measured queue)",
                s.first_tokens,
            ),
            (
                "withdrawn_decisions",
                "Route calls the proxy stopped waiting for (it failed open) and withdrew",
                s.withdrawn,
            ),
            (
                "clamped_outcomes",
                "Outcomes reporting more time than had passed since their decision (clamped)",
                s.clamped_outcomes,
            ),
            (
                "predicted_cached_tokens",
                "Cached prompt tokens the router predicted, over outcomes reporting cached tokens",
                s.predicted_cached_tokens,
            ),
            (
                "actual_cached_tokens",
                "Cached prompt tokens the engines reported, over the same outcomes",
                s.actual_cached_tokens,
            ),
        ];
        for (name, help, value) in counters {
            let c = ConstCounter::new(value);
            c.encode(encoder.encode_descriptor(name, help, None, MetricType::Counter)?)?;
        }
        let gauges: [(&str, &str, u64); 4] = [
            (
                "inflight",
                "Requests routed and not yet reported",
                snap.inflight as u64,
            ),
            (
                "index_blocks",
                "Distinct prompt blocks in the prefix index",
                snap.index_blocks as u64,
            ),
            (
                "index_bytes",
                "Approximate memory of the prefix index",
                snap.index_bytes as u64,
            ),
            (
                "sync_log_entries",
                "Decisions and outcomes held in the sync log proxies pull",
                snap.sync_log_entries as u64,
            ),
        ];
        for (name, help, value) in gauges {
            let g = ConstGauge::new(value as i64);
            g.encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?)?;
        }
        ConstGauge::new(snap.bytes_per_token).encode(encoder.encode_descriptor(
            "bytes_per_token",
            "Canonical prompt bytes per token the approximate index counts in (configured, or \
             learned from usage.prompt_tokens with router.learn_bytes_per_token)",
            None,
            MetricType::Gauge,
        )?)?;
        let help = format!(
            "Output tokens an agent API request is expected to have when scored to its last \
             token (the mean agent requests' usage reported, or \
             router.scoring.default_output_tokens before {} have)",
            scorer_core::router::LEARNED_OUTPUT_MIN_SAMPLES
        );
        ConstGauge::new(snap.agent_output_tokens).encode(encoder.encode_descriptor(
            "agent_output_tokens",
            &help,
            None,
            MetricType::Gauge,
        )?)?;

        type Getter = fn(&EndpointView) -> Option<f64>;
        let per_endpoint: [(&str, &str, Getter); 12] = [
            (
                "endpoint_precise_blocks",
                "GPU blocks the endpoint's KV events say it holds",
                |e| Some(e.precise_blocks as f64),
            ),
            (
                "endpoint_events_live",
                "1 while the endpoint's KV-event stream is live",
                |e| Some(if e.events_live { 1.0 } else { 0.0 }),
            ),
            (
                "endpoint_up",
                "1 while the endpoint's /metrics answers, else 0",
                |e| Some(if e.health == Health::Ready { 1.0 } else { 0.0 }),
            ),
            (
                "endpoint_stale",
                "1 when the last successful scrape is older than stale_after_ms",
                |e| Some(if e.stale { 1.0 } else { 0.0 }),
            ),
            (
                "endpoint_running",
                "vllm:num_requests_running as last scraped",
                |e| e.metrics.map(|m| f64::from(m.running)),
            ),
            (
                "endpoint_waiting",
                "vllm:num_requests_waiting as last scraped",
                |e| e.metrics.map(|m| f64::from(m.waiting)),
            ),
            (
                "endpoint_kv_usage",
                "vllm:kv_cache_usage_perc as last scraped (0..1)",
                |e| e.metrics.map(|m| m.kv_usage),
            ),
            (
                "endpoint_capacity_tokens",
                "KV capacity in tokens from vllm:cache_config_info",
                |e| e.metrics.and_then(|m| m.capacity_tokens).map(|c| c as f64),
            ),
            (
                "endpoint_inflight",
                "Requests routed to the endpoint and not yet reported",
                |e| Some(f64::from(e.inflight)),
            ),
            (
                "endpoint_backlog_tokens",
                "Prefill tokens routed to the endpoint and not yet drained",
                |e| Some(e.backlog_tokens),
            ),
            (
                "endpoint_indexed_blocks",
                "Prompt blocks the index believes the endpoint holds",
                |e| Some(e.indexed_blocks as f64),
            ),
            (
                "endpoint_delivered_share",
                "Cached tokens the engine delivered over those the index believed it held, over \
                 its recent outcomes (1 with no evidence)",
                |e| Some(e.delivered_share),
            ),
        ];
        endpoint_gauges(&mut encoder, &snap.endpoints, |e| &e.address, &per_endpoint)?;
        encode_routing_states(&mut encoder, &snap.endpoints)?;
        encode_reuse(&mut encoder, &snap.endpoints, &snap.pools)?;
        encode_latency_model(&mut encoder, &snap.endpoints)?;
        encode_disaggregation(&mut encoder, snap.stats.disaggregated, &snap.endpoints)?;
        Ok(())
    }
}

/// One per-endpoint gauge family: name, help, and the endpoint's value when it has one.
pub(crate) type EndpointGauge<'a, E> = (&'a str, &'a str, fn(&E) -> Option<f64>);

/// Writes one gauge family per `(name, help, get)`, with a sample labelled `endpoint` for each
/// endpoint `get` has a value for: the collectors of the router's and the fleet features'
/// per-endpoint numbers share this layout.
pub(crate) fn endpoint_gauges<E>(
    encoder: &mut DescriptorEncoder,
    endpoints: &[E],
    address: fn(&E) -> &str,
    gauges: &[EndpointGauge<'_, E>],
) -> fmt::Result {
    for (name, help, get) in gauges {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for e in endpoints {
            if let Some(v) = get(e) {
                let labels = [("endpoint", address(e))];
                ConstGauge::new(v).encode(family.encode_family(&labels)?)?;
            }
        }
    }
    Ok(())
}

/// `endpoint_routing_state`: 1 for each endpoint's current state, labelled with the state and
/// the reason it is not `exact` (empty when it is), so an alert can select `state!="exact"`.
fn encode_routing_states(
    encoder: &mut DescriptorEncoder,
    endpoints: &[EndpointView],
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(
        "endpoint_routing_state",
        "1 for the endpoint's routing state: exact (prefix hits credited), degraded (its \
         KV-event stream is down, its engine's block_size is not the configured one, its stream \
         lost batches, or its events do not hold the router's blocks: precise requests scored \
         from the approximate index), \
         load-only (chosen by load: the engine did not deliver the hits the index believed in)",
        None,
        MetricType::Gauge,
    )?;
    for e in endpoints {
        let labels = [
            ("endpoint", e.address.as_str()),
            ("state", e.routing_state.as_str()),
            ("reason", e.state_reason.map_or("", |r| r.as_str())),
        ];
        ConstGauge::new(1.0).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The fleet numbers ([`scorer_core::reuse`]) as token counters, per endpoint and per pool (the
/// request's model), so every share is a PromQL ratio of rates over the same outcomes: reuse
/// available in the traffic, aimed for, and the gap by reason. Delivered reuse and its
/// denominator are `endpoint_served_cached_tokens` and `endpoint_served_prompt_tokens` per
/// endpoint (written with the fleet page's counters), `pool_served_*` per pool. The engines'
/// own prefix-cache counters, where scraped, follow.
fn encode_reuse(
    encoder: &mut DescriptorEncoder,
    endpoints: &[EndpointView],
    pools: &[(String, ReuseTotals)],
) -> fmt::Result {
    type Get = fn(&ReuseTotals) -> u64;
    endpoint_counter(
        encoder,
        endpoints,
        "endpoint_reuse_available_tokens",
        "Prompt tokens of the endpoint's served outcomes that an earlier request in the recent \
         window already had, wherever it went: the reuse the traffic offered (the ceiling)",
        |e| e.reuse.available_tokens,
    )?;
    endpoint_counter(
        encoder,
        endpoints,
        "endpoint_reuse_aimed_tokens",
        "Cached tokens the router credited when it chose the endpoint, over the same outcomes",
        |e| e.reuse.aimed_tokens,
    )?;
    let mut family = encoder.encode_descriptor(
        "endpoint_reuse_gap_tokens",
        "Available reuse the endpoint's served outcomes did not deliver, by the reason the router \
         attributes: load_spill, eviction, mismatch, fallback, unheld",
        None,
        MetricType::Counter,
    )?;
    for e in endpoints {
        for reason in GapReason::ALL {
            let labels = [
                ("endpoint", e.address.as_str()),
                ("reason", reason.as_str()),
            ];
            ConstCounter::new(e.reuse.gap_tokens.get(reason))
                .encode(family.encode_family(&labels)?)?;
        }
    }
    let per_pool: [(&str, &str, Get); 4] = [
        (
            "pool_served_prompt_tokens",
            "Prompt tokens of the pool's outcomes that reported cached tokens (the shares' \
             denominator)",
            |t| t.prompt_tokens,
        ),
        (
            "pool_reuse_available_tokens",
            "Prompt tokens an earlier request in the recent window already had: the reuse the \
             pool's traffic offered (the ceiling)",
            |t| t.available_tokens,
        ),
        (
            "pool_reuse_aimed_tokens",
            "Cached tokens the router credited the chosen endpoints with",
            |t| t.aimed_tokens,
        ),
        (
            "pool_served_cached_tokens",
            "Cached prompt tokens the engines reported (delivered reuse)",
            |t| t.delivered_tokens,
        ),
    ];
    for (name, help, get) in per_pool {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (pool, t) in pools {
            ConstCounter::new(get(t)).encode(family.encode_family(&[("pool", pool.as_str())])?)?;
        }
    }
    let mut family = encoder.encode_descriptor(
        "pool_reuse_gap_tokens",
        "Available reuse the pool's outcomes did not deliver, by the reason the router \
         attributes: load_spill, eviction, mismatch, fallback, unheld",
        None,
        MetricType::Counter,
    )?;
    for (pool, t) in pools {
        for reason in GapReason::ALL {
            let labels = [("pool", pool.as_str()), ("reason", reason.as_str())];
            ConstCounter::new(t.gap_tokens.get(reason)).encode(family.encode_family(&labels)?)?;
        }
    }
    type Engine = fn(&scorer_core::router::PrefixCacheCounters) -> f64;
    let engine: [(&str, &str, Engine); 2] = [
        (
            "endpoint_engine_prefix_cache_hit_tokens",
            "vllm:prefix_cache_hits_total as last scraped: prompt tokens the engine served from \
             its prefix cache, over all its traffic",
            |c| c.hits,
        ),
        (
            "endpoint_engine_prefix_cache_query_tokens",
            "vllm:prefix_cache_queries_total as last scraped: prompt tokens the engine looked up",
            |c| c.queries,
        ),
    ];
    for (name, help, get) in engine {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for e in endpoints {
            if let Some(c) = e.metrics.and_then(|m| m.prefix_cache) {
                let labels = [("endpoint", e.address.as_str())];
                ConstCounter::new(get(&c)).encode(family.encode_family(&labels)?)?;
            }
        }
    }
    Ok(())
}

/// Writes one counter family with a sample labelled `endpoint` for every endpoint.
pub(crate) fn endpoint_counter(
    encoder: &mut DescriptorEncoder,
    endpoints: &[EndpointView],
    name: &str,
    help: &str,
    get: fn(&EndpointView) -> u64,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for e in endpoints {
        let labels = [("endpoint", e.address.as_str())];
        ConstCounter::new(get(e)).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Prefill/decode disaggregation: decisions that named a prefill endpoint, how often each
/// endpoint was that prefill endpoint, and every endpoint's role.
fn encode_disaggregation(
    encoder: &mut DescriptorEncoder,
    disaggregated: u64,
    endpoints: &[EndpointView],
) -> fmt::Result {
    ConstCounter::new(disaggregated).encode(encoder.encode_descriptor(
        "disaggregated_decisions",
        "Decisions that also named a prefill endpoint (x-prefiller-host-port)",
        None,
        MetricType::Counter,
    )?)?;
    endpoint_counter(
        encoder,
        endpoints,
        "endpoint_prefill_picks",
        "Times the endpoint was picked to prefill for a decode endpoint",
        |e| e.prefill_picks,
    )?;
    let mut family = encoder.encode_descriptor(
        "endpoint_role",
        "1 for the endpoint's prefill/decode role (prefill, decode or both)",
        None,
        MetricType::Gauge,
    )?;
    for e in endpoints {
        let role = match e.role {
            EndpointRole::Prefill => "prefill",
            EndpointRole::Decode => "decode",
            EndpointRole::Both => "both",
        };
        let labels = [("endpoint", e.address.as_str()), ("role", role)];
        ConstGauge::new(1i64).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The learned latency model's figures per endpoint: how many outcomes taught it and how far
/// its predictions were from what then happened (measured before each update).
fn encode_latency_model(
    encoder: &mut DescriptorEncoder,
    endpoints: &[EndpointView],
) -> fmt::Result {
    type Getter = fn(&EndpointView) -> Option<f64>;
    let gauges: [(&str, &str, Getter); 7] = [
        (
            "endpoint_prefill_slowdown",
            "How many times slower than the pool's typical endpoint scoring prices the endpoint's prefill, from its first tokens, or the shown endpoints' mean for one that has shown none (1: not slower)",
            |e| Some(e.prefill_slowdown),
        ),
        (
            "endpoint_prefill_tokens_per_second",
            "Prefill throughput scoring assumes for the endpoint: calibrated from its counters, or the prior",
            |e| Some(e.calibration.prefill_tokens_per_ms * 1000.0),
        ),
        (
            "endpoint_itl_idle_seconds",
            "Time per output token scoring assumes on the idle endpoint (calibrated, or the prior)",
            |e| Some(e.calibration.itl_ms_idle / 1000.0),
        ),
        (
            "endpoint_itl_full_seconds",
            "Time per output token scoring assumes with the endpoint's KV cache full (calibrated, or the prior)",
            |e| Some(e.calibration.itl_ms_full / 1000.0),
        ),
        (
            "endpoint_ttft_prediction_error_ratio",
            "Smoothed |predicted - observed| / observed TTFT of the endpoint's learned model",
            |e| (e.latency_errors.ttft_samples > 0).then_some(e.latency_errors.ttft_error_ratio),
        ),
        (
            "endpoint_ttft_prediction_error_ms",
            "Smoothed |predicted - observed| TTFT of the endpoint's learned model, ms",
            |e| (e.latency_errors.ttft_samples > 0).then_some(e.latency_errors.ttft_abs_error_ms),
        ),
        (
            "endpoint_tpot_prediction_error_ratio",
            "Smoothed |predicted - observed| / observed time per output token of the learned model",
            |e| (e.latency_errors.tpot_samples > 0).then_some(e.latency_errors.tpot_error_ratio),
        ),
    ];
    for (name, help, get) in gauges {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for e in endpoints {
            if let Some(v) = get(e) {
                let labels = [("endpoint", e.address.as_str())];
                ConstGauge::new(v).encode(family.encode_family(&labels)?)?;
            }
        }
    }
    endpoint_counter(
        encoder,
        endpoints,
        "endpoint_latency_samples",
        "Outcomes the endpoint's learned latency model has learned from",
        |e| u64::from(e.latency_samples),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;
    use scorer_core::protocol::RouteRequest;

    use super::*;
    use crate::test_util::{assert_exposes, state_of};

    /// Asserts that `state`'s registry exposes every needle (see [`assert_exposes`]).
    pub(super) fn assert_exports(state: Arc<State>, needles: &[&str]) {
        let mut text = String::new();
        encode(&mut text, &registry(state)).unwrap();
        assert_exposes(&text, needles);
    }

    /// One endpoint, `10.0.0.1:80`, whose engine served none of the hits the index believed in,
    /// ten times: it is load-only (issue #18).
    fn mismatched_state() -> Arc<State> {
        let state = state_of(&["10.0.0.1:80"]);
        let request = RouteRequest {
            model: "m".into(),
            block_hashes: (1..=12).collect(),
            prompt_tokens: 900,
            ..Default::default()
        };
        for _ in 0..10 {
            let response = state.route(&request);
            state.feedback(&scorer_core::protocol::FeedbackBatch {
                outcomes: vec![scorer_core::protocol::Outcome {
                    decision_id: response.decision_id,
                    endpoint: "10.0.0.1:80".into(),
                    status: 200,
                    prompt_tokens: Some(900),
                    cached_tokens: Some(0),
                    ..Default::default()
                }],
                ..Default::default()
            });
        }
        state
    }

    // /metrics says which state the endpoint is in and why, counts the change, and shows the
    // delivered share.
    #[test]
    fn a_mismatched_endpoint_is_exported_load_only_with_its_reason() {
        assert_exports(
            mismatched_state(),
            &[
                "kvroute_endpoint_routing_state{endpoint=\"10.0.0.1:80\",state=\"load-only\",reason=\"mismatch\"} 1",
                "kvroute_routing_state_changes_total{endpoint=\"10.0.0.1:80\",to=\"load-only\",reason=\"mismatch\"} 1",
                "kvroute_endpoint_delivered_share{endpoint=\"10.0.0.1:80\"} ",
            ],
        );
    }

    // Issue #18's fleet numbers: the mismatched endpoint's outcomes offered reuse (the same
    // prompt ten times), the router aimed at it until the endpoint went load-only, and nothing
    // was delivered: the gap is eviction while it was exact, mismatch after. Exported per
    // endpoint and per pool, as the router counted them.
    #[test]
    fn the_fleet_numbers_are_exported_per_endpoint_and_pool() {
        let state = mismatched_state();
        let snap = state.snapshot();
        let [(pool, t)] = snap.pools.as_slice() else {
            panic!("one pool: {:?}", snap.pools);
        };
        assert_eq!(pool, "m");
        assert!(t.available_tokens > 0 && t.aimed_tokens > 0, "{t:?}");
        assert_eq!(t.delivered_tokens, 0);
        let gap = t.gap_tokens;
        assert!(gap.eviction > 0 && gap.mismatch > 0, "{gap:?}");
        assert_eq!(gap.total(), t.available_tokens);
        let e = "endpoint=\"10.0.0.1:80\"";
        let needles = [
            format!(
                "kvroute_pool_served_prompt_tokens_total{{pool=\"m\"}} {}",
                t.prompt_tokens
            ),
            format!(
                "kvroute_pool_reuse_available_tokens_total{{pool=\"m\"}} {}",
                t.available_tokens
            ),
            format!(
                "kvroute_pool_reuse_aimed_tokens_total{{pool=\"m\"}} {}",
                t.aimed_tokens
            ),
            "kvroute_pool_served_cached_tokens_total{pool=\"m\"} 0".to_string(),
            format!(
                "kvroute_pool_reuse_gap_tokens_total{{pool=\"m\",reason=\"eviction\"}} {}",
                gap.eviction
            ),
            format!(
                "kvroute_pool_reuse_gap_tokens_total{{pool=\"m\",reason=\"mismatch\"}} {}",
                gap.mismatch
            ),
            "kvroute_pool_reuse_gap_tokens_total{pool=\"m\",reason=\"load_spill\"} 0".to_string(),
            format!(
                "kvroute_endpoint_reuse_available_tokens_total{{{e}}} {}",
                t.available_tokens
            ),
            format!(
                "kvroute_endpoint_reuse_aimed_tokens_total{{{e}}} {}",
                t.aimed_tokens
            ),
            format!(
                "kvroute_endpoint_reuse_gap_tokens_total{{{e},reason=\"mismatch\"}} {}",
                gap.mismatch
            ),
        ];
        // Whole values: each needle ends its line.
        let lines: Vec<String> = needles.iter().map(|n| format!("{n}\n")).collect();
        assert_exports(state, &lines.iter().map(String::as_str).collect::<Vec<_>>());
    }

    // An engine scraped with another block size than the router's is degraded (block_size),
    // counted once when the scrape shows it, and exact again when the sizes match.
    #[test]
    fn an_engine_with_another_block_size_is_exported_degraded() {
        let state = state_of(&["10.0.0.1:80"]);
        let block_tokens = scorer_core::router::PreciseConfig::default().block_tokens as u32;
        let scraped = |block_size: u32| scorer_core::router::EndpointMetrics {
            block_size: Some(block_size),
            ..Default::default()
        };
        state.update_metrics("10.0.0.1:80", scraped(2 * block_tokens));
        state.update_metrics("10.0.0.1:80", scraped(2 * block_tokens));
        let e = "endpoint=\"10.0.0.1:80\"";
        let degraded = [
            format!(
                "kvroute_endpoint_routing_state{{{e},state=\"degraded\",reason=\"block_size\"}} 1"
            ),
            format!(
                "kvroute_routing_state_changes_total{{{e},to=\"degraded\",reason=\"block_size\"}} 1"
            ),
        ];
        assert_exports(
            state.clone(),
            &degraded.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        state.update_metrics("10.0.0.1:80", scraped(block_tokens));
        let exact = [
            format!("kvroute_endpoint_routing_state{{{e},state=\"exact\",reason=\"\"}} 1"),
            format!(
                "kvroute_routing_state_changes_total{{{e},to=\"exact\",reason=\"block_size\"}} 1"
            ),
        ];
        assert_exports(state, &exact.iter().map(String::as_str).collect::<Vec<_>>());
    }

    // A KV-event stream that lost batches no replay filled is degraded (kv_event_gap), counted
    // once however many losses follow, and exact again after enough batches in sequence.
    #[test]
    fn a_stream_that_lost_batches_is_exported_degraded_until_it_runs_clean() {
        let state = state_of(&["10.0.0.1:80"]);
        let address = "10.0.0.1:80";
        state.set_event_stream(address, true);
        state.note_event_gap(address);
        state.note_event_batch_in_sequence(address);
        state.note_event_gap(address);
        let e = "endpoint=\"10.0.0.1:80\"";
        let degraded = [
            format!(
                "kvroute_endpoint_routing_state{{{e},state=\"degraded\",reason=\"kv_event_gap\"}} 1"
            ),
            format!(
                "kvroute_routing_state_changes_total{{{e},to=\"degraded\",reason=\"kv_event_gap\"}} 1"
            ),
        ];
        assert_exports(
            state.clone(),
            &degraded.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let clean = scorer_core::self_check::SelfCheckConfig::default().clean_batches_after_gap;
        for _ in 0..clean {
            state.note_event_batch_in_sequence(address);
        }
        let exact = [
            format!("kvroute_endpoint_routing_state{{{e},state=\"exact\",reason=\"\"}} 1"),
            format!(
                "kvroute_routing_state_changes_total{{{e},to=\"exact\",reason=\"kv_event_gap\"}} 1"
            ),
        ];
        assert_exports(state, &exact.iter().map(String::as_str).collect::<Vec<_>>());
    }

    // The engines' own prefix-cache counters are passed on as scraped.
    #[test]
    fn the_engines_prefix_cache_counters_are_exported() {
        let state = state_of(&["10.0.0.1:80"]);
        state.update_metrics(
            "10.0.0.1:80",
            scorer_core::router::EndpointMetrics {
                prefix_cache: Some(scorer_core::router::PrefixCacheCounters {
                    hits: 300.0,
                    queries: 1_800.0,
                }),
                ..Default::default()
            },
        );
        assert_exports(
            state,
            &[
                "kvroute_endpoint_engine_prefix_cache_hit_tokens_total{endpoint=\"10.0.0.1:80\"} 300",
                "kvroute_endpoint_engine_prefix_cache_query_tokens_total{endpoint=\"10.0.0.1:80\"} 1800",
            ],
        );
    }

    // The shipped alerts (envoy-config/kubernetes/monitoring) select only metrics exported here,
    // under these names: a renamed metric must not leave an alert that can never fire.
    #[test]
    fn the_self_check_alerts_select_what_is_exported() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../envoy-config/kubernetes/monitoring/prometheusrule.yaml");
        let rule: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut text = String::new();
        encode(&mut text, &registry(mismatched_state())).unwrap();
        let mut alerts = 0;
        for group in rule["spec"]["groups"].as_sequence().unwrap() {
            for alert in group["rules"].as_sequence().unwrap() {
                alerts += 1;
                let expr = alert["expr"].as_str().unwrap();
                let names: Vec<&str> = expr
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|w| w.starts_with("kvroute_"))
                    .collect();
                assert!(!names.is_empty(), "{expr}");
                for name in names {
                    let family = name.strip_suffix("_total").unwrap_or(name);
                    assert!(
                        text.contains(&format!("# TYPE {family} ")),
                        "{expr}: nothing exports {family}"
                    );
                }
            }
        }
        assert_eq!(alerts, 5);
    }

    #[test]
    fn exposition_has_event_and_state_metrics() {
        let state = state_of(&["10.0.0.1:80"]);
        state.route(&RouteRequest {
            model: "m".into(),
            block_hashes: vec![1, 2],
            prompt_tokens: 9,
            ..Default::default()
        });
        state
            .telemetry()
            .count_rejected("/v1/route", "unauthorized");
        assert_exports(
            state,
            &[
                "kvroute_decisions_total{reason=\"load\"} 1",
                "kvroute_rejected_requests_total{path=\"/v1/route\",reason=\"unauthorized\"} 1",
                "kvroute_route_duration_seconds_bucket",
                "kvroute_no_endpoint_decisions_total 0",
                "kvroute_inflight 1",
                "kvroute_index_blocks 2",
                "kvroute_endpoint_up{endpoint=\"10.0.0.1:80\"} 1",
                "kvroute_endpoint_inflight{endpoint=\"10.0.0.1:80\"} 1",
                "kvroute_endpoint_indexed_blocks{endpoint=\"10.0.0.1:80\"} 2",
                "kvroute_sync_log_entries 1",
                "kvroute_sync_calls_total 0",
                "kvroute_sync_decisions_total 0",
                "kvroute_sync_resets_total 0",
                "# EOF",
            ],
        );
    }
}

#[cfg(test)]
mod latency_metric_tests {
    use scorer_core::protocol::{FeedbackBatch, Outcome, RouteRequest};

    use super::tests::assert_exports;
    use super::*;
    use crate::test_util::state_of;

    #[test]
    fn prediction_error_is_exported_per_endpoint() {
        let state = state_of(&["10.0.0.1:80"]);
        let response = state.route(&RouteRequest {
            model: "m".into(),
            block_hashes: vec![1, 2],
            prompt_tokens: 900,
            ..Default::default()
        });
        // No report may claim more time than has passed since its decision.
        std::thread::sleep(std::time::Duration::from_millis(400));
        state.feedback(&FeedbackBatch {
            outcomes: vec![Outcome {
                decision_id: response.decision_id,
                endpoint: "10.0.0.1:80".into(),
                status: 200,
                ttfb_ms: Some(200),
                total_ms: 400,
                completion_tokens: Some(11),
                ..Default::default()
            }],
            ..Default::default()
        });
        assert_exports(
            state,
            &[
                "kvroute_endpoint_latency_samples_total{endpoint=\"10.0.0.1:80\"} 1",
                "kvroute_endpoint_prefill_tokens_per_second{endpoint=\"10.0.0.1:80\"} 5000.0",
                "kvroute_endpoint_prefill_slowdown{endpoint=\"10.0.0.1:80\"} 1.0",
                "kvroute_endpoint_itl_idle_seconds{endpoint=\"10.0.0.1:80\"} 0.015",
                "kvroute_endpoint_ttft_prediction_error_ratio{endpoint=\"10.0.0.1:80\"} 0.",
                "kvroute_endpoint_ttft_prediction_error_ms{endpoint=\"10.0.0.1:80\"} ",
                "kvroute_endpoint_tpot_prediction_error_ratio{endpoint=\"10.0.0.1:80\"} ",
            ],
        );
    }

    #[test]
    fn disaggregation_is_exported() {
        let state = state_of(&["10.0.0.1:80", "10.0.0.2:80"]);
        state.set_role("10.0.0.1:80", EndpointRole::Prefill);
        let response = state.route(&RouteRequest {
            model: "m".into(),
            block_hashes: (0..40).collect(),
            prompt_tokens: 2_600,
            ..Default::default()
        });
        assert_eq!(response.prefiller.as_deref(), Some("10.0.0.1:80"));
        assert_eq!(response.endpoints, ["10.0.0.2:80"]);
        assert_exports(
            state,
            &[
                "kvroute_disaggregated_decisions_total 1",
                "kvroute_endpoint_prefill_picks_total{endpoint=\"10.0.0.1:80\"} 1",
                "kvroute_endpoint_role{endpoint=\"10.0.0.1:80\",role=\"prefill\"} 1",
                "kvroute_endpoint_role{endpoint=\"10.0.0.2:80\",role=\"both\"} 1",
            ],
        );
    }
}
